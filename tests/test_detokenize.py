"""Incremental detokenization against a real byte-level BPE tokenizer.

The tokenizer is trained here in well under a second on a small corpus with accents, CJK and emoji, so that
multi-byte characters are split across tokens the way Qwen's tokenizer splits rare ones. The property checked:
the pieces returned by ``add`` and ``finish`` concatenate to ``tokenizer.decode(all_ids)``, for random id
sequences (mostly invalid UTF-8 byte soup), for encodings of random text, under random chunkings, with and
without special tokens skipped; and each step decodes only a few ids, however long the completion.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from gateway.core.detokenize import IncrementalDetokenizer

TEXT_CONTROL = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Café, naïve, façade, jalapeño, Zürich.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。東京は大きな都市です。",
    "Emoji: 🙂 😀 🎉 👍🏽 🇫🇷 👨‍👩‍👧 — and math: ∑ ∫ √ ≠ ≤ ≥ π ∞.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "def main() -> None:\n    print('hello, world')\n\n",
]
SAMPLE_CHARS = 'abc xyz\n\t{}"é日本語中文🙂😀🎉👍🏽∑π한국—'


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"eos_token": "<|im_end|>"})
    tok.add_tokens(TEXT_CONTROL)
    return tok


def detokenize(tok: PreTrainedTokenizerBase, chunks: list[list[int]], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.add(chunk) for chunk in chunks]
    pieces.append(detok.finish())
    return pieces


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.choice([0, 1, 1, 1, 2, 3, 7])  # 0: engines may send empty deltas
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def test_tokenizer_splits_characters_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    # The detokenizer's fast path (the Rust decoder directly) applies to this tokenizer; CountingTokenizer
    # below has no backend, so the tests cover both paths.
    assert tokenizer.clean_up_tokenization_spaces is False
    # Guard for the tests below: they only prove something if some characters span several tokens.
    ids = tokenizer.encode("🎉👍🏽한", add_special_tokens=False)
    assert len(ids) > len("🎉👍🏽한")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.all_special_ids
    for tag in TEXT_CONTROL:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1


def test_holds_incomplete_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("a🎉", add_special_tokens=False)
    assert len(ids) >= 3  # "a" and the emoji's bytes in at least two pieces
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == "a"
    assert [detok.add([i]) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert detok.add(ids[-1:]) == "🎉"
    assert detok.finish() == ""


def test_finish_releases_a_truncated_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("ok🎉", add_special_tokens=False)[:-1]  # the emoji cut short, as by max_tokens
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed == "ok"
    assert detok.finish() == "\ufffd"
    assert tokenizer.decode(ids) == "ok\ufffd"


def test_special_and_added_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("<think>hi</think>ok<tool_call>{}</tool_call>", add_special_tokens=False)
    ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert "".join(detokenize(tokenizer, [[i] for i in ids], skip=True)) == (
        "<think>hi</think>ok<tool_call>{}</tool_call>"
    )
    assert "".join(detokenize(tokenizer, [[i] for i in ids], skip=False)).endswith("</tool_call><|im_end|>")


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_concatenate_to_full_decode(tokenizer: PreTrainedTokenizerFast, skip: bool) -> None:
    vocab = len(tokenizer)
    rng = random.Random(1234)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        pieces = detokenize(tokenizer, random_chunks(rng, ids), skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("skip", [True, False])
def test_encoded_text_concatenates_to_full_decode(tokenizer: PreTrainedTokenizerFast, skip: bool) -> None:
    rng = random.Random(99)
    special = [*TEXT_CONTROL, "<|im_end|>"]
    for _ in range(200):
        text = "".join(
            rng.choice(special) if rng.random() < 0.05 else rng.choice(SAMPLE_CHARS)
            for _ in range(rng.randrange(1, 60))
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = detokenize(tokenizer, random_chunks(rng, ids), skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
        if not skip:
            assert "".join(pieces) == text


class CountingTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.window_sizes.append(len(token_ids))
        text = self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text


def test_decode_window_does_not_grow_with_completion(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(5)
    text = "".join(rng.choice(SAMPLE_CHARS) for _ in range(3000))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 3000
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    streamed = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert streamed == text
    assert counting.window_sizes, "the plain decode path was not used"
    # A window holds the previous step's ids plus the pending ones (a character is at most 4 bytes).
    assert max(counting.window_sizes) <= 8
    assert len(counting.window_sizes) <= 2 * len(ids) + 1
