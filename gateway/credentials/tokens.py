"""A captured call's credentials as token spans: what the capture writer records in ``secret_findings``.

The writer scans each call once, on its own thread after the answer was sent: the text of the prompt's new part
(``prompt_delta``: what the harness added since the parent call, so a conversation's tool results and messages are
scanned once each, not once per turn) and of the answer, decoded with special tokens kept. A character span becomes
the smallest run of tokens whose text covers it, found by bisection over decoded prefixes (findings are rare, so
only calls with one pay for it). Prompt spans are positions in the call's full prompt; answer spans, in its
completion.

An answer that repeats a credential found in its own prompt is a finding even where the detector would not flag the
repeated text on its own (a value whose key-like name stayed in the prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.credentials.detect import Finding, scan

PROMPT, COMPLETION = "prompt", "completion"
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class TokenFinding:
    """A credential in a call: ``part`` "prompt" (positions in the full prompt) or "completion", tokens
    ``[start, end)``, and its kind. Never the credential itself."""

    part: str
    kind: str
    start: int
    end: int


def tokenizer_decode(tokenizer: Any) -> Decode:
    """Decoding with special tokens kept; through the fast tokenizer's backend where there is one (half the time of
    ``PreTrainedTokenizer.decode``, the same text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:

        def fast(ids: Sequence[int]) -> str:
            return str(backend.decode(list(ids), skip_special_tokens=False))

        return fast

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


def record_scanner(tokenizer: Any) -> Callable[[Any], list[TokenFinding]]:
    """The capture writer's scan of a ``CallRecord``."""
    decode = tokenizer_decode(tokenizer)

    def scan_record(record: Any) -> list[TokenFinding]:
        return scan_call(record.prompt_delta, record.prompt_prefix_len, record.completion_ids, decode)

    return scan_record


def _first_token_past(ids: Sequence[int], decode: Decode, chars: int) -> int:
    """The smallest ``k`` with ``len(decode(ids[:k])) > chars`` (``len(ids)`` when none)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[: mid + 1])) > chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def token_span(ids: Sequence[int], decode: Decode, start: int, end: int) -> tuple[int, int]:
    """The tokens of ``ids`` whose decoded text covers characters ``[start, end)``."""
    first = _first_token_past(ids, decode, start)
    last = _first_token_past(ids, decode, end - 1)
    return first, min(len(ids), max(last + 1, first + 1))


def _spans(ids: Sequence[int], decode: Decode, text: str, findings: list[Finding]) -> list[tuple[str, int, int]]:
    return [(f.kind, *token_span(ids, decode, f.start, f.end)) for f in findings if f.end <= len(text)]


def scan_call(
    prompt_delta: Sequence[int], prompt_offset: int, completion_ids: Sequence[int], decode: Decode
) -> list[TokenFinding]:
    """The credentials in a call's new prompt tokens (at ``prompt_offset`` in its full prompt) and its answer."""
    found: list[TokenFinding] = []
    prompt_text = decode(prompt_delta) if len(prompt_delta) else ""
    prompt_findings = scan(prompt_text) if prompt_text else []
    for kind, start, end in _spans(prompt_delta, decode, prompt_text, prompt_findings):
        found.append(TokenFinding(PROMPT, kind, prompt_offset + start, prompt_offset + end))
    if not len(completion_ids):
        return found
    answer = decode(completion_ids)
    answer_findings = scan(answer)
    covered = [(f.start, f.end) for f in answer_findings]
    for f in prompt_findings:
        secret = prompt_text[f.start : f.end]
        at = answer.find(secret) if len(secret) >= 8 else -1
        while at >= 0:
            if not any(lo < at + len(secret) and at < hi for lo, hi in covered):
                answer_findings.append(Finding(f"Repeated {f.kind}", at, at + len(secret)))
            at = answer.find(secret, at + len(secret))
    answer_findings.sort(key=lambda f: f.start)
    for kind, start, end in _spans(completion_ids, decode, answer, answer_findings):
        found.append(TokenFinding(COMPLETION, kind, start, end))
    return found
