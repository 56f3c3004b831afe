"""The prefix tree's data: the calls it is built from (``CallView``), its nodes, paths, per-call records, report.

Plain data with no behaviour beyond a few derived figures: ``build.py`` fills it in, ``tree.py`` reads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

MAIN = "main"  # the trajectory of the main agent; sub-agents' are "subagent:<agent id>"
TokenArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CallView:
    """One captured call as the tree needs it: full prompt ids, completion ids and sampled-token logprobs."""

    id: str
    prompt_ids: Sequence[int] | npt.NDArray[np.integer[Any]]
    completion_ids: Sequence[int] | npt.NDArray[np.integer[Any]]
    completion_logprobs: Sequence[float] | npt.NDArray[np.floating[Any]]
    started_at: float  # seconds; orders the calls of a rollout
    status: str  # "ok" | "failed" | "cancelled"
    policy_version: int | None = None
    is_subagent: bool = False
    agent_id: str | None = None
    finish_reason: str | None = None
    # Sampled under a grammar: the logprobs are the masked distribution's, so the completion is context.
    constrained: bool = False
    # Completion positions ``[start, end)`` kept out of the loss: credentials the answer holds (the whole answer under
    # ``secrets=exclude``, the credential's tokens under "mask"; ``gateway/credentials``).
    untrained: tuple[tuple[int, int], ...] = ()


class TreeNode:
    """One edge of the radix tree and the node it leads to.

    ``tokens`` are the edge's token ids, which start at position ``depth`` of every path through the node.
    ``trainable``, ``logprobs`` (NaN where not trainable) and ``versions`` (-1 where not trainable or unknown)
    run parallel to ``tokens``. A root has no tokens.
    """

    __slots__ = (
        "calls_ending",
        "children",
        "constrained",
        "depth",
        "filtered",
        "generator",
        "generators",
        "id",
        "kept",
        "logprobs",
        "parent",
        "prompt_last",
        "prompts_ending",
        "tokens",
        "trainable",
        "trajectory",
        "versions",
    )

    def __init__(self, tokens: TokenArray, depth: int, parent: TreeNode | None, trajectory: str) -> None:
        self.tokens = tokens
        self.depth = depth
        self.parent = parent
        self.trajectory = trajectory
        self.children: dict[int, TreeNode] = {}  # by first token
        self.prompts_ending: list[str] = []  # calls whose prompt ends here (their completion starts here)
        self.calls_ending: list[str] = []  # calls whose prompt + completion ends here
        self.kept = False  # on the path of a kept call
        self.filtered: str | None = None  # why a node off every kept path was filtered
        self.id = -1
        # Latest call (time order) whose prompt ends here: tells whether a completion was continued.
        self.prompt_last = -1
        self.trainable: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)
        self.logprobs: npt.NDArray[np.float64] = np.zeros(0)
        self.versions: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        # The kept call whose completion holds this node's trainable tokens (the latest, when several generated
        # the same positions); None on context. Call boundaries are node boundaries, so one call per node.
        self.generator: str | None = None
        # Every kept call whose completion holds these trainable tokens, in time order: answers to one prompt that
        # begin alike (a counterfactual group) share their first nodes, and each of them counts there.
        self.generators: list[str] = []
        # The latest kept call that generated this node's tokens was constrained: they stay context (see build.py).
        self.constrained = False

    @property
    def end(self) -> int:
        """Position just past the edge: the length of every path ending at this node."""
        return self.depth + len(self.tokens)

    @property
    def parent_id(self) -> int | None:
        return None if self.parent is None else self.parent.id

    @property
    def child_nodes(self) -> list[TreeNode]:
        return list(self.children.values())

    def chain(self) -> list[TreeNode]:
        """The nodes holding tokens on the way from the root down to this one, in order (a root holds none)."""
        chain: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None:
            if len(node.tokens):
                chain.append(node)
            node = node.parent
        chain.reverse()
        return chain

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, depth={self.depth}, tokens={len(self.tokens)}, kept={self.kept})"


@dataclass(frozen=True)
class TreePath:
    """One kept root-to-leaf trajectory, flattened for the loss."""

    tokens: TokenArray
    trainable: npt.NDArray[np.bool_]
    logprobs: npt.NDArray[np.float64]  # NaN on context positions
    versions: npt.NDArray[np.int64]  # -1 on context positions and for unknown versions
    trajectory: str  # "main" or "subagent:<agent id>"
    leaf: int  # node id
    calls: tuple[str, ...]  # kept calls whose prompt + completion is exactly this path


@dataclass
class TreeCall:
    """What the tree made of one call."""

    id: str
    order: int  # position in time order
    fate: str  # "kept" | "dead_leaf" | "compaction" | "subagent" | a dropped status ("failed", "cancelled")
    relation: str | None  # filters.ROOT / CONTINUATION / RETRY / COMPACTION / NEW_ROOT; None when not placed
    anchor: str | None  # the call it continues or retries
    branch: str | None  # the call that opened the compaction branch it belongs to
    reason: str | None  # why it was filtered
    trajectory: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_node: int | None = None  # node where its prompt ends
    end_node: int | None = None  # node where its prompt + completion ends


@dataclass
class TreeReport:
    """Counts of every filtering decision and the token figures of the kept tree.

    A rollout dropped for abnormal branching keeps the figures it would have had (so a dashboard can show why)
    but yields no paths.
    """

    calls: int = 0
    kept_calls: int = 0
    excluded_by_status: dict[str, int] = field(default_factory=dict)
    failed_calls: int = 0  # all calls left out by status
    dead_leaves: int = 0  # calls detected as abandoned retries
    dead_leaf_tokens: int = 0  # generated positions no longer trainable because of them
    compaction_calls: int = 0  # calls on compaction branches (openers and the calls continuing them)
    compaction_branches: int = 0
    subagent_calls: int = 0
    subagents: int = 0  # distinct agent ids among them
    leaves: int = 0  # surviving leaves = kept trajectories
    branch_points: int = 0  # kept nodes with more than one kept child
    max_depth: int = 0  # tokens on the longest kept path
    tree_tokens: int = 0  # tokens stored once in the kept tree
    tree_tokens_all: int = 0  # including filtered branches
    naive_tokens: int = 0  # prompt + completion summed over kept calls: a per-call dataset
    trainable_tokens: int = 0  # trainable positions in the kept tree
    constrained_tokens: int = 0  # generated positions left untrained because their call was constrained
    dropped_reason: str | None = None

    @property
    def saving(self) -> float:
        """How many times fewer tokens the tree holds than a per-call dataset."""
        return self.naive_tokens / self.tree_tokens if self.tree_tokens else math.nan

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["saving"] = None if math.isnan(self.saving) else round(self.saving, 4)
        return out
