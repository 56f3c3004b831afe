"""``RolloutTree``: the filtered prefix forest of one rollout, its paths, and its JSON and terminal views."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import numpy as np

from prefix_tree import filters
from prefix_tree.filters import TreeConfig
from prefix_tree.nodes import TokenArray, TreeCall, TreeNode, TreePath, TreeReport


class RolloutTree:
    """The prefix forest of one rollout (a root for the main agent, one per kept sub-agent) after filtering."""

    def __init__(
        self,
        nodes: list[TreeNode],
        roots: list[TreeNode],
        calls: dict[str, TreeCall],
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

    def path_tokens(self, node_id: int) -> TokenArray:
        """The token ids from the root to the end of a node."""
        chain = self.nodes[node_id].chain()
        return np.concatenate([n.tokens for n in chain]) if chain else np.zeros(0, dtype=np.int64)

    def paths(self) -> list[TreePath]:
        """Every kept root-to-leaf trajectory; none when the rollout was dropped."""
        if self.dropped:
            return []
        out = []
        for leaf in self.leaves():
            chain = leaf.chain()
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
                "constrained": n.constrained,
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
        text += f" ({train:,} trainable)" if train else " (constrained)" if node.constrained else " (context)"
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
    if r.constrained_tokens:
        head += f", {r.constrained_tokens:,} constrained (context)"
    if r.dropped_reason:
        head += f"\nDROPPED: {r.dropped_reason}"
    return head
