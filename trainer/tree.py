"""Prefix-tree reconstruction of one rollout: merge its captured calls on shared token prefixes.

The gateway sees a rollout as separate model calls whose prompts repeat the whole history. Merged into a
token-level radix tree (compressed edges), identical prefixes are stored once and every root-to-leaf path is
one complete multi-turn trajectory (ClawGym II, "prefix-tree reconstruction"). Each token position knows who
put it there: a position some kept call *generated* is trainable and carries that call's sampled logprob and
policy version — also where it reappears as prompt of the next call, which TITO makes token-identical — and
every other position is context the harness inserted (system prompt, user turns, tool results). When several
kept calls generated the same position (identical retries) the latest call's logprob is kept and the token is
counted once.

Filtering (retries' dead leaves, compaction branches, sub-agents, abnormal branching) follows the rules in
``filters.py``; every decision is recorded per call and summed in ``TreeReport``. Building is linear in the
tokens of the calls: each call walks its path once, comparing whole edges with numpy, and splits nodes only at
call boundaries and divergence points.

Pure: no database, no torch. The input is a list of ``CallView`` (one stored call with its full prompt ids).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from trainer import filters
from trainer.filters import TreeConfig

__all__ = ["CallRecord", "CallView", "RolloutTree", "TreeConfig", "TreeNode", "TreePath", "TreeReport", "build_tree"]

MAIN = "main"
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


class TreeNode:
    """One edge of the radix tree and the node it leads to.

    ``tokens`` are the edge's token ids, which start at position ``depth`` of every path through the node.
    ``trainable``, ``logprobs`` (NaN where not trainable) and ``versions`` (-1 where not trainable or unknown)
    run parallel to ``tokens``. A root has no tokens.
    """

    __slots__ = (
        "calls_ending",
        "children",
        "depth",
        "filtered",
        "generator",
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
class CallRecord:
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
    dropped_reason: str | None = None

    @property
    def saving(self) -> float:
        """How many times fewer tokens the tree holds than a per-call dataset."""
        return self.naive_tokens / self.tree_tokens if self.tree_tokens else math.nan

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["saving"] = None if math.isnan(self.saving) else round(self.saving, 4)
        return out


@dataclass
class _Entry:
    """A placed call during the build."""

    call: CallView
    record: CallRecord
    seq: TokenArray
    prompt_len: int
    prompt_node: TreeNode
    end_node: TreeNode
    continued: bool = False
    dead_reason: str | None = None  # set when the retry rule found it abandoned


@dataclass
class _Group:
    """One trajectory group (the main agent, or one sub-agent) with its own root."""

    name: str
    root: TreeNode
    entries: list[_Entry] = field(default_factory=list)
    by_id: dict[str, _Entry] = field(default_factory=dict)
    by_order: dict[int, _Entry] = field(default_factory=dict)


class RolloutTree:
    """The prefix forest of one rollout (a root for the main agent, one per kept sub-agent) after filtering."""

    def __init__(
        self,
        nodes: list[TreeNode],
        roots: list[TreeNode],
        calls: dict[str, CallRecord],
        report: TreeReport,
        config: TreeConfig,
    ) -> None:
        self.nodes = nodes  # nodes[i].id == i, in depth-first order
        self.roots = roots
        self.calls = calls  # every input call by id, in time order
        self.report = report
        self.config = config

    @property
    def dropped(self) -> bool:
        return self.report.dropped_reason is not None

    def leaves(self) -> list[TreeNode]:
        """Kept nodes with no kept child that end at least one token deep."""
        return [n for n in self.nodes if n.kept and n.end > 0 and not any(c.kept for c in n.children.values())]

    def _chain(self, node: TreeNode) -> list[TreeNode]:
        chain: list[TreeNode] = []
        cur: TreeNode | None = node
        while cur is not None:
            chain.append(cur)
            cur = cur.parent
        chain.reverse()
        return chain

    def path_tokens(self, node_id: int) -> TokenArray:
        """The token ids from the root to the end of a node."""
        chain = self._chain(self.nodes[node_id])
        return np.concatenate([n.tokens for n in chain]) if chain else np.zeros(0, dtype=np.int64)

    def paths(self) -> list[TreePath]:
        """Every kept root-to-leaf trajectory; none when the rollout was dropped."""
        if self.dropped:
            return []
        out = []
        for leaf in self.leaves():
            chain = self._chain(leaf)
            out.append(
                TreePath(
                    tokens=np.concatenate([n.tokens for n in chain]),
                    trainable=np.concatenate([n.trainable for n in chain]),
                    logprobs=np.concatenate([n.logprobs for n in chain]),
                    versions=np.concatenate([n.versions for n in chain]),
                    trajectory=leaf.trajectory,
                    leaf=leaf.id,
                    calls=tuple(c for c in leaf.calls_ending if self.calls[c].fate == filters.KEPT),
                )
            )
        return out

    def to_json(self, include_tokens: bool = False) -> dict[str, Any]:
        """A JSON-ready summary: report, nodes with token counts per edge, calls and filtered branches."""
        nodes = []
        for n in self.nodes:
            item: dict[str, Any] = {
                "id": n.id,
                "parent": n.parent_id,
                "trajectory": n.trajectory,
                "depth": n.depth,
                "tokens": len(n.tokens),
                "trainable": int(n.trainable.sum()),
                "kept": n.kept,
                "filtered": n.filtered,
                "children": [c.id for c in n.children.values()],
                "prompts_ending": list(n.prompts_ending),
                "calls_ending": list(n.calls_ending),
            }
            if include_tokens:
                item["token_ids"] = n.tokens.tolist()
            nodes.append(item)
        calls = [asdict(r) for r in self.calls.values()]
        return {
            "report": self.report.as_dict(),
            "config": {**asdict(self.config), "keep_statuses": sorted(self.config.keep_statuses)},
            "roots": [{"trajectory": r.trajectory, "node": r.id} for r in self.roots],
            "nodes": nodes,
            "calls": calls,
            "filtered": [
                {"call": r.id, "fate": r.fate, "reason": r.reason}
                for r in self.calls.values()
                if r.fate != filters.KEPT
            ],
        }

    def render_text(self, max_lines: int | None = None) -> str:
        """A terminal view: one line per edge (start position, tokens, trainable, calls ending, filters).

        Chains without branching stay at one indentation level so a long linear rollout reads top to bottom.
        """
        lines = _summary_line(self.report).splitlines()
        for root in self.roots:
            lines.append(f"[{root.trajectory}]")
            stack: list[tuple[TreeNode, str, str]] = []  # (node, indentation, branch connector)
            _push_children(stack, root, "")
            while stack:
                node, indent, conn = stack.pop()
                lines.append(indent + conn + self._node_line(node))
                _push_children(stack, node, indent + {"": "", "├─ ": "│  ", "└─ ": "   "}[conn])
        if max_lines is not None and len(lines) > max_lines:
            lines = [*lines[:max_lines], f"... {len(lines) - max_lines} more lines"]
        return "\n".join(lines)

    def _node_line(self, node: TreeNode) -> str:
        n = len(node.tokens)
        train = int(node.trainable.sum())
        text = f"@{node.depth:,} +{n:,} tok"
        text += f" ({train:,} trainable)" if train else " (context)"
        if node.prompts_ending:
            text += "  prompt of " + ", ".join(node.prompts_ending)
        if node.calls_ending:
            text += "  ◀ " + ", ".join(node.calls_ending)
        if not node.kept:
            if node.parent is None or node.parent.kept:  # explain once, where the filtered branch leaves
                reasons = sorted({self.calls[c].reason or self.calls[c].fate for c in _calls_below(node)})
                text += "  ✗ " + "; ".join(reasons)
            else:
                text += f"  ✗ {node.filtered}"
        return text


def _push_children(stack: list[tuple[TreeNode, str, str]], node: TreeNode, indent: str) -> None:
    """Queue a node's children for rendering: an only child continues the chain, siblings get connectors."""
    kids = node.child_nodes
    if len(kids) == 1:
        stack.append((kids[0], indent, ""))
        return
    for i in reversed(range(len(kids))):
        stack.append((kids[i], indent, "└─ " if i == len(kids) - 1 else "├─ "))


def _calls_below(node: TreeNode) -> list[str]:
    """Calls ending in a node's subtree (for the reason of a filtered branch)."""
    out: list[str] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        out.extend(cur.calls_ending)
        stack.extend(cur.children.values())
    return out


def _summary_line(r: TreeReport) -> str:
    parts = [f"{r.calls} calls: {r.kept_calls} kept"]
    if r.dead_leaves:
        parts.append(f"{r.dead_leaves} dead leaves")
    if r.compaction_calls:
        parts.append(f"{r.compaction_calls} compaction ({r.compaction_branches} branches)")
    if r.subagent_calls:
        parts.append(f"{r.subagent_calls} sub-agent ({r.subagents} agents)")
    if r.failed_calls:
        parts.append(", ".join(f"{v} {k}" for k, v in sorted(r.excluded_by_status.items())))
    saving = "n/a" if math.isnan(r.saving) else f"{r.saving:.2f}x"
    head = (
        ", ".join(parts) + f"; {r.leaves} leaves, {r.branch_points} branch points, depth {r.max_depth:,}\n"
        f"tokens: {r.tree_tokens:,} in tree vs {r.naive_tokens:,} per call ({saving} saving), "
        f"{r.trainable_tokens:,} trainable"
    )
    if r.dropped_reason:
        head += f"\nDROPPED: {r.dropped_reason}"
    return head


def _as_tokens(values: Sequence[int] | npt.NDArray[np.integer[Any]]) -> TokenArray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _lcp(a: TokenArray, b: TokenArray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _split(node: TreeNode, k: int) -> TreeNode:
    """Cut a node's edge after k tokens; returns the new upper node (the lower part keeps its identity)."""
    assert node.parent is not None and 0 < k < len(node.tokens)
    upper = TreeNode(node.tokens[:k], node.depth, node.parent, node.trajectory)
    node.parent.children[int(node.tokens[0])] = upper
    node.tokens = node.tokens[k:]
    node.depth += k
    node.parent = upper
    upper.children[int(node.tokens[0])] = node
    return upper


def _insert(start: TreeNode, seq: TokenArray, cuts: list[int]) -> tuple[list[TreeNode], int]:
    """Add a sequence to the tree so that every depth in ``cuts`` (sorted, > start.end) ends a node on its path.

    ``start`` is a node whose root path spells ``seq[:start.end]``. Returns the path from ``start`` to the node
    where the sequence ends and the length of the longest prefix the tree already held.
    """
    path = [start]
    node = start
    i, n, ci = start.end, len(seq), 0
    while i < n:
        child = node.children.get(int(seq[i]))
        if child is None:
            break
        edge = child.tokens
        matched = _lcp(edge, seq[i : i + len(edge)])
        while cuts[ci] <= i:
            ci += 1
        stop = min(matched, cuts[ci] - i)
        if stop < len(edge):
            child = _split(child, stop)
        node = child
        path.append(node)
        i += stop
        if stop < matched:
            continue  # cut at a call boundary inside a matching edge: keep walking
        if matched < len(edge):
            break  # diverged (or the sequence ended) inside the edge
    shared = i
    for cut in cuts:
        if cut > i:
            leaf = TreeNode(seq[i:cut], i, node, start.trajectory)
            node.children[int(seq[i])] = leaf
            node = leaf
            path.append(node)
            i = cut
    return path, shared


def build_tree(calls: Iterable[CallView], config: TreeConfig | None = None) -> RolloutTree:
    """Reconstruct and filter the prefix tree of one rollout's calls (any order; sorted by ``started_at``)."""
    config = config or TreeConfig()
    ordered = sorted(enumerate(calls), key=lambda item: (item[1].started_at, item[0]))
    report = TreeReport(calls=len(ordered))
    records: dict[str, CallRecord] = {}
    groups: dict[str, _Group] = {}
    agents: set[str | None] = set()

    for order, (_, call) in enumerate(ordered):
        if call.id in records:
            raise ValueError(f"duplicate call id {call.id!r}")
        if len(call.completion_logprobs) != len(call.completion_ids):
            raise ValueError(
                f"call {call.id!r}: {len(call.completion_logprobs)} logprobs for {len(call.completion_ids)} tokens"
            )
        record = CallRecord(
            id=call.id,
            order=order,
            fate=filters.KEPT,
            relation=None,
            anchor=None,
            branch=None,
            reason=None,
            trajectory=None,
            prompt_tokens=len(call.prompt_ids),
            completion_tokens=len(call.completion_ids),
        )
        records[call.id] = record
        if call.status not in config.keep_statuses:
            record.fate, record.reason = call.status, f"status {call.status}"
            report.excluded_by_status[call.status] = report.excluded_by_status.get(call.status, 0) + 1
            report.failed_calls += 1
            continue
        name = MAIN
        if call.is_subagent:
            report.subagent_calls += 1
            agents.add(call.agent_id)
            name = "subagent" if call.agent_id is None else f"subagent:{call.agent_id}"
            if not config.keep_subagents:
                record.fate, record.reason = filters.SUBAGENT, f"sub-agent call ({name})"
                continue
        group = groups.get(name)
        if group is None:
            group = groups[name] = _Group(name, TreeNode(np.zeros(0, dtype=np.int64), 0, None, name))
        _place(group, call, record, config)
    report.subagents = len(agents)

    # Main first, then sub-agents in order of their first call.
    roots = [g.root for g in sorted(groups.values(), key=lambda g: (g.name != MAIN, g.entries[0].record.order))]
    entries = [e for g in groups.values() for e in g.entries]
    entries.sort(key=lambda e: e.record.order)
    for group in groups.values():
        _mark_dead_leaves(group)
    for e in entries:
        # A compaction branch is dropped as a whole, retries inside it included.
        rec = e.record
        reason, rec.reason = rec.reason, None
        if rec.branch is not None:
            report.compaction_calls += 1
            report.compaction_branches += rec.branch == rec.id
            if config.drop_compaction:
                rec.fate = filters.COMPACTION
                rec.reason = reason or f"compaction: continues the branch opened by {rec.branch}"
                continue
        if e.dead_reason is not None:
            report.dead_leaves += 1
            if config.drop_dead_leaves:
                rec.fate, rec.reason = filters.DEAD_LEAF, e.dead_reason
    nodes = _number_nodes(roots)
    for node in nodes:
        node.trainable = np.zeros(len(node.tokens), dtype=np.bool_)
        node.logprobs = np.full(len(node.tokens), np.nan)
        node.versions = np.full(len(node.tokens), -1, dtype=np.int64)
    kept = [e for e in entries if e.record.fate == filters.KEPT]
    for e in kept:  # time order: a later generator of the same position overwrites an earlier one
        _mark_kept(e.end_node)
        _attach_logprobs(e)
    for e in entries:
        if e.record.fate != filters.KEPT:
            _mark_filtered(e.end_node, e.record.fate)
    report.dead_leaf_tokens = _dead_leaf_tokens([e for e in entries if e.record.fate == filters.DEAD_LEAF])
    _figures(report, nodes, kept, config)
    for e in entries:
        e.record.prompt_node, e.record.end_node = e.prompt_node.id, e.end_node.id
    return RolloutTree(nodes, roots, records, report, config)


def _place(group: _Group, call: CallView, record: CallRecord, config: TreeConfig) -> None:
    """Insert one call into its group's tree and classify it against the calls before it."""
    prompt = _as_tokens(call.prompt_ids)
    completion = _as_tokens(call.completion_ids)
    seq = np.concatenate([prompt, completion]) if len(completion) else prompt
    plen, n = len(prompt), len(seq)
    # A call usually extends (or retries) the one before it: start the walk where the two part, found with one
    # vectorized comparison, instead of re-walking the whole shared history edge by edge.
    start = group.root
    if group.entries:
        last = group.entries[-1]
        limit = min(_lcp(seq, last.seq), plen)
        start = last.end_node
        while start.end > limit:
            start = start.parent  # type: ignore[assignment]  # the root (end 0) stops the walk
    path, shared = _insert(start, seq, sorted({plen, n} - {0}) or [0])
    by_end = {node.end: node for node in path}
    # Split nodes carry no marks, so a boundary inside an earlier segment shows no calls here.
    boundary = by_end[min(shared, plen)]
    placement = filters.place_call(
        first=not group.entries,
        shared=min(shared, plen),
        prompt_len=plen,
        completion_ends=[group.by_id[c].record.order for c in boundary.calls_ending],
        prompt_ends=[group.by_id[c].record.order for c in boundary.prompts_ending],
        config=config,
    )
    record.relation, record.reason, record.trajectory = placement.relation, placement.reason, group.name
    if placement.anchor is not None:
        anchor = group.by_order[placement.anchor].record
        record.anchor, record.branch = anchor.id, anchor.branch
    elif placement.relation in (filters.COMPACTION, filters.NEW_ROOT):
        record.branch = record.id
    prompt_node, end_node = by_end[plen], by_end[n]
    prompt_node.prompts_ending.append(call.id)
    end_node.calls_ending.append(call.id)
    prompt_node.prompt_last = record.order
    entry = _Entry(call, record, seq, plen, prompt_node, end_node)
    group.entries.append(entry)
    group.by_id[call.id] = group.by_order[record.order] = entry


def _mark_dead_leaves(group: _Group) -> None:
    """Apply the retry rule to each set of calls with identical prompt ids (they share a prompt node)."""
    # Latest prompt ending strictly below each node: a later prompt there extends the node's whole path.
    below: dict[int, int] = {}
    for node in reversed(_preorder(group.root)):
        below[id(node)] = max((max(c.prompt_last, below[id(c)]) for c in node.children.values()), default=-1)
    same_prompt: dict[int, list[_Entry]] = {}
    for e in group.entries:
        latest = below[id(e.end_node)]
        if len(e.seq) > e.prompt_len:  # a prompt equal to prompt + completion continues it too
            latest = max(latest, e.end_node.prompt_last)
        # (an empty completion ends at its own prompt node, where a same-prompt retry is no continuation)
        e.continued = latest > e.record.order
        same_prompt.setdefault(id(e.prompt_node), []).append(e)
    for siblings in same_prompt.values():
        dead = set(filters.dead_retries([e.record.order for e in siblings], [e.continued for e in siblings]))
        survivors = ", ".join(e.call.id for e in siblings if e.record.order not in dead)
        for e in siblings:
            if e.record.order in dead:
                e.dead_reason = f"dead leaf: retry abandoned for {survivors}"


def _preorder(root: TreeNode) -> list[TreeNode]:
    nodes: list[TreeNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(reversed(node.child_nodes))
    return nodes


def _number_nodes(roots: list[TreeNode]) -> list[TreeNode]:
    nodes = [node for root in roots for node in _preorder(root)]
    for i, node in enumerate(nodes):
        node.id = i
    return nodes


def _mark_kept(node: TreeNode | None) -> None:
    while node is not None and not node.kept:
        node.kept = True
        node = node.parent


def _mark_filtered(node: TreeNode | None, fate: str) -> None:
    """Label the nodes a filtered call alone leads through with its fate (several fates: sorted, joined)."""
    while node is not None and not node.kept:
        fates = set() if node.filtered is None else set(node.filtered.split(","))
        if fate in fates:
            return
        node.filtered = ",".join(sorted(fates | {fate}))
        node = node.parent


def _attach_logprobs(e: _Entry) -> None:
    """Mark a kept call's completion positions trainable with its logprobs and policy version."""
    logprobs = np.asarray(e.call.completion_logprobs, dtype=np.float64).reshape(-1)
    version = -1 if e.call.policy_version is None else e.call.policy_version
    node: TreeNode | None = e.end_node
    # The prompt end is a node boundary, so the completion covers whole nodes.
    while node is not None and node.depth >= e.prompt_len and node.end > e.prompt_len:
        lo = node.depth - e.prompt_len
        node.trainable[:] = True
        node.logprobs[:] = logprobs[lo : lo + len(node.tokens)]
        node.versions[:] = version
        node.generator = e.call.id
        node = node.parent


def _dead_leaf_tokens(dead: list[_Entry]) -> int:
    seen: dict[int, TreeNode] = {}
    for e in dead:
        node: TreeNode | None = e.end_node
        while node is not None and node.depth >= e.prompt_len and node.end > e.prompt_len:
            seen[id(node)] = node
            node = node.parent
    return sum(int((~n.trainable).sum()) for n in seen.values())


def _figures(report: TreeReport, nodes: list[TreeNode], kept: list[_Entry], config: TreeConfig) -> None:
    report.kept_calls = len(kept)
    report.naive_tokens = sum(len(e.seq) for e in kept)
    for node in nodes:
        report.tree_tokens_all += len(node.tokens)
        if not node.kept:
            continue
        report.tree_tokens += len(node.tokens)
        report.trainable_tokens += int(node.trainable.sum())
        kept_children = sum(c.kept for c in node.children.values())
        report.branch_points += kept_children > 1
        if kept_children == 0 and node.end > 0:
            report.leaves += 1
            report.max_depth = max(report.max_depth, node.end)
    report.dropped_reason = filters.abnormal_branching(report.leaves, config)
