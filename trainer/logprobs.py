"""Token logprobs of a packed batch under a model: the forward pass of training.

``batch.py`` lays out trees (or paths) as rows with their masks, positions and prediction pairs; this runs the model
over them and reads the logits at each prediction's source position only (``logits_to_keep``), never over the whole
vocabulary at every context position, which for long harness contexts would dominate memory.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.batch import PackedBatch

__all__ = ["logprobs_from_logits", "prediction_logits", "sequence_logprobs"]


def _attn_implementation(model: Any) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def prediction_logits(model: Any, batch: PackedBatch, *, temperature: float = 1.0) -> torch.Tensor:
    """[P, V] float32 logits of every prediction of ``batch`` (divided by ``temperature``).

    ``model`` is a transformers causal LM (or a PEFT model around one) that accepts ``position_ids``, a 4-D
    ``attention_mask`` and a tensor ``logits_to_keep``. The result is on the model's device (the batch is moved
    there if needed); for entropies, pass it to ``loss.token_entropy``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    weight = model.get_input_embeddings().weight
    if batch.input_ids.device != weight.device:
        batch = batch.to(weight.device)
    inputs = batch.model_inputs(_attn_implementation(model), weight.dtype)
    if batch.num_predictions == 0:
        vocab = model.get_output_embeddings().weight.shape[0]
        return torch.zeros(0, vocab, device=batch.input_ids.device)
    # Only the source positions' logits: for long contexts the vocabulary projection dominates memory otherwise.
    keep = torch.unique(batch.sources)  # sorted
    out = model(**inputs, logits_to_keep=keep, use_cache=False)
    logits = out.logits[batch.rows, torch.searchsorted(keep, batch.sources)].float()
    return logits / temperature if temperature != 1.0 else logits


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row, without materializing the full log-softmax."""
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(model: Any, batch: PackedBatch, *, temperature: float = 1.0) -> torch.Tensor:
    """[P] logprob of each prediction's target under ``model`` (temperature 1 matches processed sampling logprobs)."""
    return logprobs_from_logits(prediction_logits(model, batch, temperature=temperature), batch.targets)
