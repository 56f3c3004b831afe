"""Prefix-tree reconstruction of one rollout: merge its captured calls on shared token prefixes.

The gateway sees a rollout as separate model calls whose prompts repeat the whole history. Merged into a
token-level radix tree (compressed edges), identical prefixes are stored once and every root-to-leaf path is
one complete multi-turn trajectory (ClawGym II, "prefix-tree reconstruction"). Each token position knows who
put it there: a position some kept call *generated* is trainable and carries that call's sampled logprob and
policy version — also where it reappears as prompt of the next call, which TITO makes token-identical — and
every other position is context the harness inserted (system prompt, user turns, tool results). When several
kept calls generated the same position (identical retries) the latest call's logprob is kept and the token is
counted once.

A call sampled under a grammar (``CallView.constrained``: structured output, a forced tool call) recorded the
logprobs of the *masked* distribution, while the trainer recomputes unmasked ones: their ratio would be a
spurious importance weight, not a policy change. So a constrained call's completion is context — never
trainable, NaN logprobs, version -1 — and ``TreeReport.constrained_tokens`` counts those positions. The "latest
call wins" rule holds for it too: where a constrained and an unconstrained kept call generated the same position
(identical retries), the later one decides, so a later constrained retry turns the position into context and a
later unconstrained one makes it trainable with its own logprob. Such a position is counted once, as
constrained or as trainable, never in ``dead_leaf_tokens``; nor are the positions of a constrained dead leaf,
which would not have been trainable anyway.

Filtering (retries' dead leaves, compaction branches, sub-agents, abnormal branching) follows the rules in
``filters.py``; every decision is recorded per call and summed in ``TreeReport``. Building is linear in the
tokens of the calls: each call walks its path once, comparing whole edges with numpy, and splits nodes only at
call boundaries and divergence points.

Pure: no database, no torch. The input is a list of ``CallView`` (one stored call with its full prompt ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from prefix_tree import filters
from prefix_tree.filters import TreeConfig
from prefix_tree.nodes import MAIN, CallView, TokenArray, TreeCall, TreeNode, TreeReport
from prefix_tree.tree import RolloutTree


@dataclass
class _Entry:
    """A placed call during the build."""

    call: CallView
    record: TreeCall
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
    records: dict[str, TreeCall] = {}
    groups: dict[str, _Group] = {}
    agents: set[str | None] = set()

    for order, (_, call) in enumerate(ordered):
        if call.id in records:
            raise ValueError(f"duplicate call id {call.id!r}")
        if len(call.completion_logprobs) != len(call.completion_ids):
            raise ValueError(
                f"call {call.id!r}: {len(call.completion_logprobs)} logprobs for {len(call.completion_ids)} tokens"
            )
        record = TreeCall(
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


def _place(group: _Group, call: CallView, record: TreeCall, config: TreeConfig) -> None:
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
    """Mark a kept call's completion positions trainable with its logprobs and policy version.

    A constrained call's positions become context instead (overwriting an earlier generator's marks: the latest
    call wins either way).
    """
    logprobs = np.asarray(e.call.completion_logprobs, dtype=np.float64).reshape(-1)
    version = -1 if e.call.policy_version is None else e.call.policy_version
    constrained = e.call.constrained
    trained = np.ones(len(logprobs), dtype=np.bool_)
    for start, end in e.call.untrained:
        trained[max(0, start) : max(0, end)] = False
    node: TreeNode | None = e.end_node
    # The prompt end is a node boundary, so the completion covers whole nodes.
    while node is not None and node.depth >= e.prompt_len and node.end > e.prompt_len:
        lo = node.depth - e.prompt_len
        hi = lo + len(node.tokens)
        if constrained:
            node.trainable[:] = False
            node.logprobs[:] = np.nan
            node.versions[:] = -1
        else:
            keep = trained[lo:hi]
            node.trainable[:] = keep
            node.logprobs[:] = np.where(keep, logprobs[lo:hi], np.nan)
            node.versions[:] = np.where(keep, version, -1)
        node.generator = None if constrained or not node.trainable.any() else e.call.id
        node.generators = [] if node.generator is None else [*node.generators, e.call.id]
        node.constrained = constrained
        node = node.parent


def _dead_leaf_tokens(dead: list[_Entry]) -> int:
    seen: dict[int, TreeNode] = {}
    for e in dead:
        if e.call.constrained:
            continue  # never trainable: nothing lost by dropping it
        node: TreeNode | None = e.end_node
        while node is not None and node.depth >= e.prompt_len and node.end > e.prompt_len:
            seen[id(node)] = node
            node = node.parent
    return sum(int((~n.trainable).sum()) for n in seen.values() if not n.constrained)


def _figures(report: TreeReport, nodes: list[TreeNode], kept: list[_Entry], config: TreeConfig) -> None:
    report.kept_calls = len(kept)
    report.naive_tokens = sum(len(e.seq) for e in kept)
    for node in nodes:
        report.tree_tokens_all += len(node.tokens)
        if not node.kept:
            continue
        report.tree_tokens += len(node.tokens)
        report.trainable_tokens += int(node.trainable.sum())
        report.constrained_tokens += len(node.tokens) if node.constrained else 0
        kept_children = sum(c.kept for c in node.children.values())
        report.branch_points += kept_children > 1
        if kept_children == 0 and node.end > 0:
            report.leaves += 1
            report.max_depth = max(report.max_depth, node.end)
    report.dropped_reason = filters.abnormal_branching(report.leaves, config)
