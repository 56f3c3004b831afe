"""The local engine's running batch as one KV cache: rows right-aligned, shorter rows padded on the left.

A request is prefilled alone (batch 1, so its first token sees no padding) and its cache is then appended as a
new row. Because rows are right-aligned, a row's next position is simply how many tokens it has cached, and a
decode step needs a padding mask only while the rows' lengths differ. Rows that finish are dropped between steps,
along with cache columns that are padding in every remaining row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def is_batchable(cache: Any) -> bool:
    """Whether rows can be concatenated: a plain ``DynamicCache`` of full-attention layers (not sliding windows or
    linear attention)."""
    return all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)


def append_row(batch: Any, cache: Any) -> None:
    """Append a batch-1 cache to ``batch`` as a new row, left-padding whichever side is shorter."""
    length = max(batch.get_seq_length(), cache.get_seq_length())
    for mine, theirs in zip(batch.layers, cache.layers, strict=True):
        mine.keys = torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)], dim=0)
        mine.values = torch.cat([_left_pad(mine.values, length), _left_pad(theirs.values, length)], dim=0)


def keep_rows(batch: Any, keep: list[int], cached: list[int], device: torch.device) -> None:
    """Keep only rows ``keep`` (``cached``: their cached lengths) and cut columns that are padding in all of them."""
    start = batch.get_seq_length() - max(cached)
    index = torch.tensor(keep, dtype=torch.long, device=device)
    for layer in batch.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, start:]
        layer.values = layer.values.index_select(0, index)[:, :, start:]


def decode_inputs(
    next_tokens: list[int], cached: list[int], length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``input_ids``, ``position_ids`` and the padding mask (None when no row is padded) for one decode step of a
    batch whose cache is ``length`` columns long."""
    input_ids = torch.tensor([[token] for token in next_tokens], dtype=torch.long, device=device)
    positions = torch.tensor(cached, dtype=torch.long, device=device)
    attention_mask = None
    if any(c != length for c in cached):
        columns = torch.arange(length + 1, device=device)
        attention_mask = (columns[None, :] >= (length - positions)[:, None]).long()
    return input_ids, positions[:, None], attention_mask


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Pad a ``[batch, heads, seq, dim]`` cache tensor with zeros on the left of the sequence axis."""
    missing = length - tensor.shape[-2]
    return F.pad(tensor, (0, 0, missing, 0)) if missing > 0 else tensor
