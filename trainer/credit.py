"""Token-level credit: the advantage each trained token of a packed tree gets.

A rollout of a task run has one advantage for all its trained tokens (GRPO broadcasts it over every branch). A
tree built from turns of everyday traffic holds several calls, each rewarded on its own: a token's advantage is
that of the call that generated it (``TreeNode.generators``; call boundaries are node boundaries, so it is one
number per node; where several calls generated the same tokens after the same prompt, as a counterfactual group's
answers that begin alike, the mean of theirs). Both are a table of one value per node per tree; a prediction reads
its target's entry through ``(rollout_index, nodes)``, which every ``PackedBatch`` carries.

Pure numpy/torch; no database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from prefix_tree import RolloutTree
from trainer.batch import PackedBatch

Credit = float | Mapping[str, float]  # one advantage for the whole tree, or one per generating call


def node_table(tree: RolloutTree, credit: Credit) -> npt.NDArray[np.float64]:
    """One advantage per node of ``tree`` (0 on nodes without trained tokens)."""
    table = np.zeros(len(tree.nodes), dtype=np.float64)
    for node in tree.nodes:
        if not node.trainable.any():
            continue
        if isinstance(credit, Mapping):
            generators = node.generators or ([node.generator] if node.generator is not None else [])
            missing = [g for g in generators if g not in credit]
            if not generators or missing:
                call = missing[0] if missing else None
                raise ValueError(f"node {node.id}: no advantage for its generating call {call!r}")
            # A node several calls generated alike (answers to one prompt that begin the same) counts once, with the
            # mean of their advantages: what per-path sequences give when each token is weighted 1/(paths through it).
            table[node.id] = sum(credit[g] for g in generators) / len(generators)
        else:
            table[node.id] = credit
    return table


class CreditTable:
    """Node tables of the trees given to ``pack_trees``, read per prediction of a batch."""

    def __init__(self, trees: Sequence[RolloutTree], credits: Sequence[Credit]) -> None:
        if len(trees) != len(credits):
            raise ValueError(f"{len(trees)} trees but {len(credits)} credits")
        tables = [node_table(t, c) for t, c in zip(trees, credits, strict=True)]
        self._offsets = torch.tensor(np.cumsum([0] + [len(t) for t in tables[:-1]]), dtype=torch.int64)
        flat = np.concatenate(tables) if tables else np.zeros(0)
        self._flat = torch.from_numpy(flat.astype(np.float32))

    def for_batch(self, batch: PackedBatch) -> torch.Tensor:
        """[P] advantages of ``batch``'s predictions (on the batch's device)."""
        device = batch.nodes.device
        index = self._offsets.to(device)[batch.rollout_index] + batch.nodes
        return self._flat.to(device)[index]


__all__ = ["Credit", "CreditTable", "node_table"]
