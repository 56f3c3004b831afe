"""Incremental detokenization: completion token ids → text deltas for streaming.

Decoding the whole completion again at every step costs O(n) per token and O(n²) per completion. Decoding
each token alone is wrong: one character can span several byte-level tokens (emoji, CJK), and some decoders
treat a token differently at the start of a text (SentencePiece drops the space of the first word). So, as
vLLM and ``tokenizers.decoders.DecodeStream`` do, each step decodes a short window of ids: ``ids[prefix:]``,
where ``ids[prefix:read]`` is already-emitted context, and returns the part beyond the context's own text.
The window moves on whenever the decoded text ends on a complete character, so its length stays a few tokens
whatever the completion length. While the text ends in U+FFFD the last character may still be incomplete
UTF-8, so nothing is returned until more ids (or ``finish``) decide it.

The pieces returned by ``add`` and ``finish`` concatenate to exactly
``tokenizer.decode(all_ids, skip_special_tokens=...)`` when decoding is prefix-stable: the text of
``ids[a:]`` starts with the text of ``ids[a:b]`` whenever ``ids[:b]`` ends on a complete character.
Byte-level BPE (Qwen, Llama 3, GPT-2) is; transformers skips its ``clean_up_tokenization_spaces``
post-processing for BPE models, and a tokenizer that does apply it (it rewrites " ." as ".") is not exact at
window edges.
The window only grows while every step ends in U+FFFD, i.e. across a run of tokens that do not decode to
valid UTF-8 at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (``transformers.PreTrainedTokenizerBase`` has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]: ...


class IncrementalDetokenizer:
    """Turns a completion's token ids, as they arrive, into text deltas; one instance per completion."""

    def __init__(
        self, tokenizer: TokenDecoder, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> None:
        """``context_ids`` are decoded in front of the completion but never returned (a few prompt ids, so that the
        first completion token decodes as it does mid-text)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # transformers' decode is the Rust decode plus optional space clean-up and ~4 µs of Python per call;
        # with clean-up off (Qwen, Llama 3) the Rust decoder gives the same text, several times faster.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode: Callable[..., str] | None = (
            backend.decode
            if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
            else None
        )
        self._ids: list[int] = list(context_ids)
        self._context = len(self._ids)
        self._prefix_offset = 0  # window start: ids[prefix:read] are context, already emitted
        self._read_offset = self._context  # ids before this are emitted
        self._prefix_len = len(self._decode(self._ids)) if self._ids else 0  # len(decode(ids[prefix:read]))
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._context :]

    def add(self, token_ids: list[int]) -> str:
        """Append ids; return the text they complete (possibly empty while a character is incomplete)."""
        if self._finished:
            raise RuntimeError("add() after finish()")
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= self._prefix_len or text.endswith(_REPLACEMENT):
            return ""
        new_text = text[self._prefix_len :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        return new_text

    def finish(self) -> str:
        """End of completion: return the held-back text, replacement characters included."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        text = self._decode(self._ids[self._prefix_offset :])
        return text[self._prefix_len :]

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
        return text
