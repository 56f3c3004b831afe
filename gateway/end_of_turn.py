"""Which token ids end a model's turn: one discovery for the renderer and both engines.

A chat model ends its turn with a marker token (``<|im_end|>`` for Qwen, ``<|eot_id|>`` for Llama 3, …) that the
tokenizer's ``eos_token`` may not name, and its ``generation_config.json`` may list more end ids still (Qwen lists
both ``<|im_end|>`` and ``<|endoftext|>``). The renderer needs the marker tokens and their text (to splice after a
turn that ended on one); an engine needs every id that must stop a generation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# The end-of-turn markers of the chat templates we know; a tokenizer that lacks one simply does not match it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def end_of_turn_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's end-of-turn markers and its EOS token: id → token text."""
    ids: dict[int, str] = {}
    for tok in END_OF_TURN_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids[tid] = tok
    if tokenizer.eos_token_id is not None and tokenizer.eos_token:
        ids.setdefault(tokenizer.eos_token_id, tokenizer.eos_token)
    return ids


def end_token_ids(tokenizer: Any, generation_eos: int | Iterable[int] | None) -> frozenset[int]:
    """Every id that ends a generation: the end-of-turn markers, the tokenizer's EOS and ``generation_eos`` (the
    ``eos_token_id`` of the model's generation config: one id, several, or none)."""
    ids = set(end_of_turn_tokens(tokenizer))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(int(i) for i in generation_eos)
    return frozenset(ids)


def generation_eos_ids(model: str) -> list[int]:
    """The model's own end-of-generation ids (generation_config.json), which the tokenizer may not name."""
    from gateway.model_files import generation_config

    eos = generation_config(model).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]
