"""Pack rollout prefix trees into training tensors, and compute the token logprobs of packed sequences.

A rollout's prefix tree (``tree.py``) holds all its kept trajectories, and their root-to-leaf paths share long
prefixes (system prompt, tool catalogue, the conversation so far). Two layouts give the same loss and the same
gradients:

- ``"tree"`` (tree packing): one sequence per bin holding every kept node of one or more trees once, in depth-first
  order. Token i may attend to token j iff j lies in i's own node at or before i, or in an ancestor node of i's
  node (ancestor-only mask); its position id is its depth from the root, so every path sees exactly the positions
  and the context it would see alone. A shared prefix is computed once and counted once.
- ``"paths"`` (the reference): each kept root-to-leaf path is its own right-padded row with the model's ordinary
  causal mask and positions 0..L−1.

Predictions instead of shifted labels: in a tree, the last token of a node with several kept children predicts a
different next token for each child, which a shifted label array cannot express. A batch therefore lists
prediction pairs (row, source position, target token): the logits at the source position give the target's
logprob. The first token of a child node has the last token of its parent node as its source; a root's first
token has none and is never predicted. The rollout logprob, policy version and weight of a prediction are those of
its target token (the logprob of token t was sampled from the distribution at position t − 1: the same pair).

Weights: on per-path rows a trainable token that lies on c kept paths of its rollout appears c times, each copy
weighted 1/c; packed as a tree it appears once with weight c · 1/c = 1. Either way Σ weight · loss(token) is the
sum over the rollout's distinct trainable tokens, so both layouts give one loss and one gradient, and Σ weight
(the token count a loss may normalize by) is the same too. Context tokens get weight 0; by default they get no
prediction at all (``all_tokens=True`` adds them, for reference logprobs or checks). The advantage of a prediction
is the caller's: ``rollout_index`` says which input tree (rollout) each prediction belongs to, which is all GRPO
needs (one advantage per rollout). Per-branch advantages (PPO) differ between the paths through a shared token;
the tree layout then needs their mean over those paths, which is what the per-path layout sums to.

Memory: ``max_tokens_per_bin`` bounds the tokens of one forward pass (rows × padded length). Trees go into bins
by first-fit decreasing. A tree larger than the budget is split by paths into sub-forests of whole paths; nodes
two sub-forests share are computed in each, with their trainable tokens' weights split in proportion to the kept
paths each sub-forest holds (so the loss stays the same). A single path longer than the budget is an error: the
trainer sets such a rollout or turn aside before packing (``longest_path``; consumed untrained, with the reason),
since truncating a trajectory would train on a context the model never saw. The tree mask is built at
forward time from a small per-node ancestor table; it takes L² bytes (boolean, SDPA) or L² · itemsize (additive,
eager) for a bin of L ≤ budget tokens.

Model side, checked against transformers 5.19: a 4-D ``attention_mask`` of shape [batch, 1, q, k] is passed to the
attention function unchanged (``masking_utils._preprocess_mask_arguments`` returns it as is). The "eager" function
adds it to the scores, so it must be additive float in the model's dtype (0 where allowed, the dtype's minimum
elsewhere: no NaN even for a fully masked row); "sdpa" hands it to ``scaled_dot_product_attention``, which takes a
boolean mask (True = attend), a quarter of the float mask's memory in float32. Flash-attention implementations
take no dense mask, so tree batches refuse them. A tree row that is a single path (a rollout with one kept path,
alone in its bin) is exactly causal and uses the model's own causal masking instead (``PackedBatch.linear``).
With a dense mask, attention computes the full L × L product (twice the work of a causal row of the same
length), so against causal per-path rows tree packing always saves the projections and MLP of every repeated token
but saves attention work only from about three paths sharing a prefix; a block-sparse mask (flex attention) would
be the next step for long branched trees. The forward pass over a batch is ``logprobs.py``.

Pure torch and numpy; no database.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from prefix_tree import RolloutTree, TreeNode

__all__ = [
    "DEFAULT_MAX_TOKENS_PER_BIN",
    "STRATEGIES",
    "PackedBatch",
    "Strategy",
    "pack_trees",
]

Strategy = Literal["tree", "paths"]
STRATEGIES: tuple[Strategy, ...] = ("tree", "paths")
DEFAULT_MAX_TOKENS_PER_BIN = 16384
# Attention implementations that accept a dense 4-D mask (see the module docstring).
TREE_ATTENTION = ("eager", "sdpa")


@dataclass(frozen=True)
class PackedBatch:
    """One forward pass: B rows of L tokens, and P predictions flattened over the rows.

    ``token_nodes`` and ``node_ancestors`` are set for tree batches only: ``token_nodes[b, i]`` is the row-local
    node of token i (−1 on padding) and ``node_ancestors[b, u, v]`` says that node v is u or an ancestor of u.
    Path batches use the model's causal mask with ``padding_mask``.
    """

    strategy: Strategy
    input_ids: torch.Tensor  # [B, L] int64; padding holds token 0
    position_ids: torch.Tensor  # [B, L] int64: the token's depth from its root (0 on padding)
    padding_mask: torch.Tensor  # [B, L] bool: True on real tokens
    token_nodes: torch.Tensor | None  # [B, L] int64
    node_ancestors: torch.Tensor | None  # [B, N, N] bool
    # Per prediction, [P]:
    rows: torch.Tensor  # int64: row of the source and target
    sources: torch.Tensor  # int64: position whose logits predict the target
    targets: torch.Tensor  # int64: the target token id (the next-token label)
    target_positions: torch.Tensor  # int64: position of the target token in its row
    depths: torch.Tensor  # int64: the target's position in its own path
    trainable: torch.Tensor  # bool: the target was generated by a kept call
    rollout_logprobs: torch.Tensor  # float32: sampled logprob of the target; NaN on context
    weights: torch.Tensor  # float32: 1/c per copy of a token on c kept paths (see module docstring); 0 on context
    rollout_index: torch.Tensor  # int64: index of the target's tree in the list given to pack_trees
    versions: torch.Tensor  # int64: policy version that sampled the target; -1 on context or unknown
    nodes: torch.Tensor  # int64: id of the target's node in its tree (with rollout_index and depths: a token key)
    # A tree row that is one path (a rollout with one kept path, alone in its bin): its tree mask is the plain
    # causal mask, so the model's own causal masking is used (SDPA then picks its faster causal kernels).
    linear: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass processes, padding included."""
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.padding_mask.sum())

    @property
    def num_predictions(self) -> int:
        return int(self.targets.numel())

    @property
    def trainable_tokens(self) -> int:
        return int(self.trainable.sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        moved: dict[str, Any] = {
            f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def attention_mask(
        self, attn_implementation: str | None = "sdpa", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The mask to give the model: [B, L] padding mask for paths (and linear trees), [B, 1, L, L] for trees."""
        if self.token_nodes is None or self.node_ancestors is None or self.linear:
            return self.padding_mask.to(torch.long)
        allowed = self.tree_mask()
        if attn_implementation == "sdpa":
            return allowed
        if attn_implementation == "eager":
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
        raise ValueError(
            f"tree batches need an attention implementation that takes a dense 4-D mask {TREE_ATTENTION}, "
            f"got {attn_implementation!r}; load the model with attn_implementation='sdpa' or pack with "
            "strategy='paths'"
        )

    def tree_mask(self) -> torch.Tensor:
        """[B, 1, L, L] bool: token i may attend to token j (ancestor-only; padding attends only to itself)."""
        assert self.token_nodes is not None and self.node_ancestors is not None
        masks = []
        for b in range(self.input_ids.shape[0]):
            index = self.token_nodes[b].clamp(min=0)
            # Two 1-D gathers (rows, then columns) never materialize an [L, L] index tensor.
            allowed = self.node_ancestors[b].index_select(0, index).index_select(1, index)
            allowed = allowed.tril()  # within a node: causal; ancestors' tokens all come earlier anyway
            real = self.padding_mask[b]
            allowed &= real[:, None] & real[None, :]
            allowed |= torch.diag(~real)  # a fully masked row would give NaN in softmax
            masks.append(allowed)
        return torch.stack(masks)[:, None]

    def model_inputs(
        self, attn_implementation: str | None = "sdpa", dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask(attn_implementation, dtype),
        }


# ------------------------------------------------------------------------------------------------ packing


@dataclass
class _Item:
    """A unit of packing: a whole tree, a sub-forest of whole paths of one tree, or (paths strategy) one path."""

    rollout: int
    nodes: list[TreeNode]  # kept nodes with tokens, by id: depth-first, ancestors before descendants
    shares: dict[int, float]  # node id -> weight of each of its trainable tokens here
    tokens: int


def _path_groups(leaves: list[TreeNode], budget: int) -> list[list[TreeNode]]:
    """Leaves in depth-first order, grouped greedily so that each group's union of paths fits the budget."""
    groups: list[list[TreeNode]] = []
    current: list[TreeNode] = []
    seen: set[int] = set()
    load = 0
    for leaf in leaves:
        chain = leaf.chain()
        if leaf.end > budget:
            raise ValueError(
                f"a kept path of {leaf.end:,} tokens exceeds max_tokens_per_bin={budget:,}; raise the budget"
            )
        new = sum(len(n.tokens) for n in chain if n.id not in seen)
        if current and load + new > budget:
            groups.append(current)
            current, seen, load = [], set(), 0
            new = leaf.end
        current.append(leaf)
        seen.update(n.id for n in chain)
        load += new
    if current:
        groups.append(current)
    return groups


def _items(rollout: int, tree: RolloutTree, strategy: Strategy, budget: int, all_tokens: bool) -> list[_Item]:
    if tree.dropped:
        return []
    leaves = tree.leaves()
    through: dict[int, int] = {}  # node id -> kept paths through it
    for leaf in leaves:
        for node in leaf.chain():
            through[node.id] = through.get(node.id, 0) + 1
    if strategy == "paths":
        groups = [[leaf] for leaf in leaves]
        for leaf in leaves:
            if leaf.end > budget:
                raise ValueError(
                    f"a kept path of {leaf.end:,} tokens exceeds max_tokens_per_bin={budget:,}; raise the budget"
                )
    else:
        groups = _path_groups(leaves, budget)
    items = []
    for group in groups:
        below: dict[int, int] = {}
        members: dict[int, TreeNode] = {}
        for leaf in group:
            for node in leaf.chain():
                below[node.id] = below.get(node.id, 0) + 1
                members[node.id] = node
        nodes = [members[i] for i in sorted(members)]
        if not all_tokens and not any(n.trainable.any() for n in nodes):
            continue  # nothing to learn from: skip the forward pass
        shares = {i: below[i] / through[i] for i in members}
        items.append(_Item(rollout, nodes, shares, sum(len(n.tokens) for n in nodes)))
    return items


def _first_fit_decreasing(items: list[_Item], budget: int, padded: bool) -> list[list[_Item]]:
    """Bins of items: the summed tokens (tree rows) or rows × longest item (padded path rows) within budget."""
    bins: list[list[_Item]] = []
    loads: list[int] = []
    for item in sorted(items, key=lambda it: -it.tokens):  # stable: ties keep input order
        for b, members in enumerate(bins):
            # Items arrive longest first, so a bin's first item sets its padded length.
            cost = (len(members) + 1) * members[0].tokens if padded else loads[b] + item.tokens
            if cost <= budget:
                members.append(item)
                loads[b] += item.tokens
                break
        else:
            bins.append([item])
            loads.append(item.tokens)
    for members in bins:
        members.sort(key=lambda it: it.rollout)
    return bins


@dataclass
class _Row:
    ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    token_nodes: npt.NDArray[np.int64]
    node_parents: list[int]  # row-local parent of each row-local node, -1 for none
    pred: dict[str, npt.NDArray[Any]]


_PRED_FIELDS = (
    "sources",
    "targets",
    "target_positions",
    "depths",
    "trainable",
    "rollout_logprobs",
    "weights",
    "rollout_index",
    "versions",
    "nodes",
)


def _lay_out(items: list[_Item], all_tokens: bool) -> _Row:
    """Concatenate items' nodes into one row and list its predictions."""
    ids, positions, token_nodes = [], [], []
    node_parents: list[int] = []
    pred: dict[str, list[npt.NDArray[Any]]] = {name: [] for name in _PRED_FIELDS}
    offset = 0
    for item in items:
        local_of: dict[int, int] = {}  # node id -> row-local node index (per item: two items may share a node)
        last_of: dict[int, int] = {}  # node id -> row position of the node's last token
        for node in item.nodes:
            m = len(node.tokens)
            parent = node.parent
            while parent is not None and parent.id not in local_of:
                parent = parent.parent  # only an empty root is skipped: an item holds whole paths
            local_of[node.id] = len(node_parents)
            node_parents.append(-1 if parent is None else local_of[parent.id])
            ids.append(node.tokens)
            positions.append(node.depth + np.arange(m, dtype=np.int64))
            token_nodes.append(np.full(m, local_of[node.id], dtype=np.int64))

            target_positions = offset + np.arange(m, dtype=np.int64)
            sources = target_positions - 1
            # A child's first token is predicted from its parent's last token, wherever that sits in the row.
            sources[0] = -1 if parent is None else last_of[parent.id]
            keep = np.ones(m, dtype=np.bool_) if all_tokens else node.trainable.copy()
            keep[0] &= sources[0] >= 0
            last_of[node.id] = offset + m - 1
            offset += m
            if not keep.any():
                continue
            pred["sources"].append(sources[keep])
            pred["targets"].append(node.tokens[keep])
            pred["target_positions"].append(target_positions[keep])
            pred["depths"].append(node.depth + np.flatnonzero(keep))
            pred["trainable"].append(node.trainable[keep])
            pred["rollout_logprobs"].append(node.logprobs[keep])
            pred["weights"].append(np.where(node.trainable[keep], item.shares[node.id], 0.0))
            pred["rollout_index"].append(np.full(int(keep.sum()), item.rollout, dtype=np.int64))
            pred["versions"].append(node.versions[keep])
            pred["nodes"].append(np.full(int(keep.sum()), node.id, dtype=np.int64))
    empty = {"trainable": np.bool_, "rollout_logprobs": np.float64, "weights": np.float64}
    return _Row(
        ids=np.concatenate(ids).astype(np.int64),
        positions=np.concatenate(positions),
        token_nodes=np.concatenate(token_nodes),
        node_parents=node_parents,
        pred={
            name: np.concatenate(parts) if parts else np.zeros(0, dtype=empty.get(name, np.int64))
            for name, parts in pred.items()
        },
    )


def _ancestors(parents: list[int]) -> npt.NDArray[np.bool_]:
    table = np.zeros((len(parents), len(parents)), dtype=np.bool_)
    for u, p in enumerate(parents):  # parents come before children
        if p >= 0:
            table[u] = table[p]
        table[u, u] = True
    return table


def _batch(strategy: Strategy, rows: list[_Row]) -> PackedBatch:
    length = max(len(r.ids) for r in rows)
    n = len(rows)
    ids = np.zeros((n, length), dtype=np.int64)
    positions = np.zeros((n, length), dtype=np.int64)
    real = np.zeros((n, length), dtype=np.bool_)
    token_nodes = np.full((n, length), -1, dtype=np.int64)
    for b, r in enumerate(rows):
        k = len(r.ids)
        ids[b, :k], positions[b, :k], real[b, :k], token_nodes[b, :k] = r.ids, r.positions, True, r.token_nodes
    pred = {name: np.concatenate([r.pred[name] for r in rows]) for name in _PRED_FIELDS}
    row_of = np.concatenate([np.full(len(r.pred["targets"]), b, dtype=np.int64) for b, r in enumerate(rows)])
    tree_nodes = tree_ancestors = None
    linear = False
    if strategy == "tree":
        linear = all(r.node_parents == list(range(-1, len(r.node_parents) - 1)) for r in rows)
        width = max(len(r.node_parents) for r in rows)
        table = np.zeros((n, width, width), dtype=np.bool_)
        for b, r in enumerate(rows):
            k = len(r.node_parents)
            table[b, :k, :k] = _ancestors(r.node_parents)
        tree_nodes, tree_ancestors = torch.from_numpy(token_nodes), torch.from_numpy(table)
    return PackedBatch(
        strategy=strategy,
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(positions),
        padding_mask=torch.from_numpy(real),
        token_nodes=tree_nodes,
        node_ancestors=tree_ancestors,
        rows=torch.from_numpy(row_of),
        sources=torch.from_numpy(pred["sources"].astype(np.int64)),
        targets=torch.from_numpy(pred["targets"].astype(np.int64)),
        target_positions=torch.from_numpy(pred["target_positions"].astype(np.int64)),
        depths=torch.from_numpy(pred["depths"].astype(np.int64)),
        trainable=torch.from_numpy(pred["trainable"].astype(np.bool_)),
        rollout_logprobs=torch.from_numpy(pred["rollout_logprobs"].astype(np.float32)),
        weights=torch.from_numpy(pred["weights"].astype(np.float32)),
        rollout_index=torch.from_numpy(pred["rollout_index"].astype(np.int64)),
        versions=torch.from_numpy(pred["versions"].astype(np.int64)),
        nodes=torch.from_numpy(pred["nodes"].astype(np.int64)),
        linear=linear,
    )


def longest_path(tree: RolloutTree) -> int:
    """The tokens of ``tree``'s longest kept path: the least ``max_tokens_per_bin`` that can pack it (0: dropped)."""
    return 0 if tree.dropped else max((leaf.end for leaf in tree.leaves()), default=0)


def pack_trees(
    trees: Sequence[RolloutTree],
    strategy: Strategy = "tree",
    max_tokens_per_bin: int = DEFAULT_MAX_TOKENS_PER_BIN,
    *,
    all_tokens: bool = False,
) -> list[PackedBatch]:
    """Lay out the kept paths of ``trees`` as forward passes of at most ``max_tokens_per_bin`` tokens each.

    ``"tree"``: one row per bin, holding whole trees (or sub-forests of a tree larger than the budget).
    ``"paths"``: one right-padded row per kept path, rows × padded length within the budget.
    Dropped rollouts, and rollouts with no trainable token (unless ``all_tokens``), produce nothing.
    ``all_tokens`` also predicts context tokens (weight 0, rollout logprob NaN).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if max_tokens_per_bin < 1:
        raise ValueError(f"max_tokens_per_bin must be positive, got {max_tokens_per_bin}")
    items = [
        item
        for index, tree in enumerate(trees)
        for item in _items(index, tree, strategy, max_tokens_per_bin, all_tokens)
    ]
    bins = _first_fit_decreasing(items, max_tokens_per_bin, padded=strategy == "paths")
    if strategy == "tree":
        return [_batch(strategy, [_lay_out(members, all_tokens)]) for members in bins]
    return [_batch(strategy, [_lay_out([item], all_tokens) for item in members]) for members in bins]
