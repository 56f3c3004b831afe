"""One sampling step of the local engine, and the checks on sampling parameters it relies on.

The gateway records the logprob of every sampled token as the behaviour-policy logprob for training, so the
logprob must come from exactly the distribution the token was drawn from. A step applies
``logits / temperature → top-k → top-p → softmax`` and draws from that distribution with the request's own
``torch.Generator``; the reported logprob is the log of that processed distribution at the drawn id (temperature
0 is greedy and reports the raw softmax).

Under a grammar the logits are masked first (``apply_bitmasks``, a whole batch at once), so the logprob is the
masked one. Where the mask allows a single token (``forced_tokens``) the distribution is that token with
probability 1: it is taken without a draw, logprob 0 (``forced_draw``). On a 2,048-token vocabulary that is most
steps of a JSON answer's keys, punctuation and enum values, and a draw costs more than filling and applying a
mask, so these steps pay for much of the masks' cost (``bench/structured.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from gateway.engines.base import SamplingParams
from gateway.errors import BadRequest

# Below this temperature sampling is greedy (the same threshold vLLM uses).
_GREEDY_EPS = 1e-5


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float, dict[int, float] | None]:
    """Draw one token from ``logits`` (shape ``[vocab]``, float32) and return ``(id, logprob, top_logprobs)``.

    The logprob is taken from the same processed distribution the id was drawn from. Top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches ``top_p`` (the token that crosses it is kept).
    """
    if params.temperature < _GREEDY_EPS:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
    else:
        scores = logits / params.temperature
        if 0 < params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = mass_before >= params.top_p
            drop[0] = False
            scores = scores.scatter(0, order[drop], float("-inf"))
        logprobs = torch.log_softmax(scores, dim=-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    top: dict[int, float] | None = None
    if params.top_logprobs > 0:
        values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
        top = {int(i): float(v) for v, i in zip(values.tolist(), ids.tolist(), strict=True) if v > float("-inf")}
    return token, float(logprobs[token]), top


def mask_logits(allowed: np.ndarray, logits: torch.Tensor) -> None:
    """Set the logits of every token not ``allowed`` (a bool array over the vocabulary, from a grammar) to -inf."""
    mask = torch.from_numpy(allowed)
    width = min(len(mask), logits.shape[-1])
    logits[..., :width].masked_fill_(~mask[:width], float("-inf"))
    logits[..., width:] = float("-inf")


def apply_bitmasks(masks: np.ndarray, logits: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in rows ``rows`` of ``logits`` (``[batch, vocab]``), every token the row's bitmask (``masks``
    from ``Grammars.bitmasks``: int32 words, bit set = allowed) does not allow, and every id past the mask's width.

    One unpack and one ``masked_fill_`` over the whole batch: the other rows' masks are made to allow everything,
    which is cheaper than gathering the constrained rows and scattering them back. The words are inverted before
    unpacking, so the unpacked bits are the forbidden set as they are (numpy's unpack: a third of the time of
    torch's shifts, measured on 8 rows)."""
    batch, vocab = logits.shape
    if len(rows) < batch:
        masks, given = np.full_like(masks, -1), masks
        masks[rows] = given[rows]
    width = min(masks.shape[1] * 32, vocab)
    forbidden = np.unpackbits((~masks).view(np.uint8), axis=1, count=width, bitorder="little").view(np.bool_)
    target = logits if width == vocab else logits[:, :width]
    target.masked_fill_(torch.from_numpy(forbidden), float("-inf"))
    if width < vocab:
        logits[torch.tensor(rows), width:] = float("-inf")


def forced_tokens(masks: np.ndarray, rows: list[int]) -> dict[int, int]:
    """The rows of ``rows`` whose bitmask (as in ``apply_bitmasks``) allows exactly one token, each with that
    token's id: one nonzero word, a power of two. (Row by row: a row with several nonzero words, the usual case
    outside a forced stretch, costs one count.)"""
    forced: dict[int, int] = {}
    for i in rows:
        row = masks[i]
        if np.count_nonzero(row) != 1:
            continue
        index = int(np.flatnonzero(row)[0])
        word = int(row[index]) & 0xFFFFFFFF
        if word & (word - 1) == 0:
            forced[i] = index * 32 + word.bit_length() - 1
    return forced


def forced_draw(token: int, params: SamplingParams) -> tuple[int, float, dict[int, float] | None]:
    """What ``sample_token`` returns for logits masked to the one allowed ``token`` (any temperature, top-k or
    top-p leaves it the whole distribution: logprob 0), without drawing: a draw with one outcome needs no random
    number. The request's generator then does not advance, so its later draws differ from those of an engine that
    draws here, but each is still drawn from its own distribution."""
    return token, 0.0, {token: 0.0} if params.top_logprobs > 0 else None


def validate_params(params: SamplingParams) -> None:
    """Refuse (BadRequest) parameters that ``sample_token`` cannot honour."""
    if params.max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    if params.temperature < 0:
        raise BadRequest("temperature must be non-negative", param="temperature")
    if not 0 < params.top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]", param="top_p")
    if params.top_k < 0:
        raise BadRequest("top_k must be non-negative (0 disables it)", param="top_k")
    if params.top_logprobs < 0:
        raise BadRequest("top_logprobs must be non-negative", param="top_logprobs")
    if any(not s for s in params.stop):
        raise BadRequest("stop strings must be non-empty", param="stop")
