"""Branch filtering rules for a rollout's prefix tree: which captured calls carry a usable training signal.

A black-box harness shows the gateway fragments: retries, context compaction and sub-agents make one rollout
fork into several branches that share history, and not every branch can be credited with the rollout's reward
(ClawGym II, "trajectory filtering and tree optimization"). The rules, each switchable in ``TreeConfig``:

- calls whose status is not kept (failed, cancelled) never enter the tree;
- *dead leaves*: of calls with identical prompt ids (retries), those whose prompt+completion a later call
  extended survive; if none was extended, the latest survives. The others' completion tokens are not trained;
- *compaction*: a call whose prompt leaves every known path strictly inside a segment (inside a harness-inserted
  context segment, or inside a model completion) rewrote history; one that shares nothing (or less than
  ``min_shared_fraction`` of its prompt) starts a new root. Either opens a compaction branch, which the calls
  continuing it join; compaction branches are dropped by default;
- *sub-agents*: kept as their own trajectories (one root per agent id) or dropped (default);
- *abnormal branching*: more than ``max_leaves`` surviving leaves drops the whole rollout.

Leaving a path exactly where a completion ends is a normal continuation (the harness appended a tool result or a
user turn); leaving it exactly where a completion starts is a retry (the same prompt, perhaps with something
appended). Every segment boundary on a path is one of these two, so "strictly inside a segment" is exactly
"not at the boundary of any earlier call". The functions here decide from those boundary facts alone; the
radix tree in ``build.py`` supplies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# How a call's prompt relates to the calls before it in its trajectory group.
ROOT = "root"  # the group's first call
CONTINUATION = "continuation"  # its prompt leaves the tree where an earlier call's completion ends
RETRY = "retry"  # its prompt leaves the tree where an earlier call's prompt ends (completion starts)
COMPACTION = "compaction"  # its prompt leaves the tree strictly inside a segment: history was rewritten
NEW_ROOT = "new_root"  # it shares nothing (or too little) with every known path

# What happens to a call's tokens.
KEPT = "kept"
DEAD_LEAF = "dead_leaf"
SUBAGENT = "subagent"


@dataclass(frozen=True)
class TreeConfig:
    """Switches for the filtering rules; the defaults follow ClawGym II (drop everything of unclear credit)."""

    # Call statuses that enter the tree; the others ("failed", "cancelled") are counted and left out.
    keep_statuses: frozenset[str] = field(default_factory=lambda: frozenset({"ok"}))
    # Untrain the completion of retries that were abandoned for a sibling with the same prompt.
    drop_dead_leaves: bool = True
    # Drop compaction branches (history rewrites and new roots) together with the calls continuing them.
    drop_compaction: bool = True
    # A call that shares fewer than this fraction of its prompt tokens with every known path starts a new root
    # (0 disables the test beyond "shares nothing"). Keep it low: a normal turn after a long tool result also
    # shares a small fraction of its prompt.
    min_shared_fraction: float = 0.0
    # Keep sub-agent calls as separate trajectories (one root per agent id) instead of dropping them.
    keep_subagents: bool = False
    # More surviving leaves than this drops the whole rollout; None disables the rule.
    max_leaves: int | None = 8
    # What a credential found in an answer keeps out of the loss (``CallView.untrained``, filled by the store):
    # "exclude" the whole answer, "mask" the credential's tokens, "drop" the answer of every call whose tokens held
    # one (its context was changed in storage), "off" nothing.
    secrets: str = "exclude"

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_shared_fraction <= 1.0:
            raise ValueError(f"min_shared_fraction must lie in [0, 1], got {self.min_shared_fraction}")
        if self.secrets not in ("exclude", "mask", "drop", "off"):
            raise ValueError(f"secrets must be exclude, mask, drop or off, got {self.secrets!r}")
        if self.max_leaves is not None and self.max_leaves < 1:
            raise ValueError(f"max_leaves must be at least 1 or None, got {self.max_leaves}")


@dataclass(frozen=True)
class Placement:
    """Where a call's prompt attaches to its trajectory group's tree."""

    relation: str  # ROOT | CONTINUATION | RETRY | COMPACTION | NEW_ROOT
    anchor: int | None  # the call (by time order) it continues or retries; None for a root or a compaction
    reason: str | None  # why it opens a compaction branch


def place_call(
    *,
    first: bool,
    shared: int,
    prompt_len: int,
    completion_ends: Sequence[int],
    prompt_ends: Sequence[int],
    config: TreeConfig,
) -> Placement:
    """Classify a call from where its prompt leaves the tree of the earlier calls of its group.

    ``shared`` is the length of the longest prefix of the prompt that some earlier path holds;
    ``completion_ends`` / ``prompt_ends`` are the earlier calls (time-order indices) whose prompt+completion /
    prompt ends exactly at that depth on that path.
    """
    if first:
        return Placement(ROOT, None, None)
    if shared == 0 and not completion_ends and not prompt_ends:
        return Placement(NEW_ROOT, None, "compaction: new root (shares no token with the earlier calls)")
    if shared < config.min_shared_fraction * prompt_len:
        return Placement(
            NEW_ROOT,
            None,
            f"compaction: new root (shares {shared} of {prompt_len} prompt tokens, < {config.min_shared_fraction:g})",
        )
    # The most recent call at the boundary defines the branch the new call joins.
    if completion_ends and (not prompt_ends or max(completion_ends) >= max(prompt_ends)):
        return Placement(CONTINUATION, max(completion_ends), None)
    if prompt_ends:
        return Placement(RETRY, max(prompt_ends), None)
    return Placement(
        COMPACTION,
        None,
        f"compaction: prompt rewrites history at token {shared} of {prompt_len} (inside an earlier segment)",
    )


def dead_retries(orders: Sequence[int], continued: Sequence[bool]) -> list[int]:
    """The dead leaves among calls with identical prompt ids (time-order indices, ascending).

    The calls a later call continued survive; if none was continued, the latest survives.
    """
    if len(orders) < 2:
        return []
    if any(continued):
        return [order for order, cont in zip(orders, continued, strict=True) if not cont]
    return list(orders[:-1])


def abnormal_branching(leaves: int, config: TreeConfig) -> str | None:
    """Why a rollout with this many surviving leaves is dropped, or None when it is kept."""
    if config.max_leaves is not None and leaves > config.max_leaves:
        return f"abnormal branching: {leaves} surviving leaves > max_leaves {config.max_leaves}"
    return None
