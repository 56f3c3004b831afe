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
from dataclasses import dataclass, field
from typing import Any

from gateway.credentials.detect import Finding, scan
from gateway.credentials.redact import scrubbed

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
    # The characters, for ``secrets=drop`` to replace them in the stored request; in memory only (not in its repr,
    # never stored).
    text: str = field(default="", repr=False, compare=False)


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


class RecordScanner:
    """The capture writer's scan of a ``CallRecord``; with ``drop`` it also removes what it found from the record
    (``drop_credentials``) before the record becomes rows."""

    def __init__(self, tokenizer: Any, *, drop: bool = False) -> None:
        self.drop = drop
        self._decode = tokenizer_decode(tokenizer)
        self._filler = filler_token(tokenizer) if drop else 0

    def __call__(self, record: Any) -> list[TokenFinding]:
        if record.secret_findings is not None:  # scanned before (a retried batch, a replayed spool line)
            return [TokenFinding(**f) for f in record.secret_findings]
        found = scan_call(record.prompt_delta, record.prompt_prefix_len, record.completion_ids, self._decode)
        if self.drop and found:
            drop_credentials(record, found, self._filler)
        record.secret_findings = [{"part": f.part, "kind": f.kind, "start": f.start, "end": f.end} for f in found]
        return found


class AnswerScanner:
    """The scan of an answer that is not a call (a counterfactual sibling): its credentials as completion token
    spans, and with ``drop`` the answer with them removed (their tokens become the filler, their text leaves its
    parsed message), as the capture writer treats a call."""

    def __init__(self, tokenizer: Any, *, drop: bool = False) -> None:
        self.drop = drop
        self._decode = tokenizer_decode(tokenizer)
        self._filler = filler_token(tokenizer) if drop else 0

    def __call__(self, ids: list[int], message: Any) -> tuple[list[int], Any, list[tuple[str, int, int]]]:
        """(the answer's ids, its message, its credentials as (kind, start, end) token spans)."""
        found = scan_call((), 0, ids, self._decode)
        spans = [(f.kind, f.start, f.end) for f in found]
        if not (self.drop and found):
            return ids, message, spans
        out = list(ids)
        for f in found:
            out[f.start : f.end] = [self._filler] * (f.end - f.start)
        return out, scrubbed(message, dropped_texts(found)), spans


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


def _spans(ids: Sequence[int], decode: Decode, text: str, findings: list[Finding]) -> list[tuple[str, int, int, str]]:
    return [
        (f.kind, *token_span(ids, decode, f.start, f.end), text[f.start : f.end])
        for f in findings
        if f.end <= len(text)
    ]


def scan_call(
    prompt_delta: Sequence[int], prompt_offset: int, completion_ids: Sequence[int], decode: Decode
) -> list[TokenFinding]:
    """The credentials in a call's new prompt tokens (at ``prompt_offset`` in its full prompt) and its answer."""
    found: list[TokenFinding] = []
    prompt_text = decode(prompt_delta) if len(prompt_delta) else ""
    prompt_findings = scan(prompt_text) if prompt_text else []
    for kind, start, end, text in _spans(prompt_delta, decode, prompt_text, prompt_findings):
        found.append(TokenFinding(PROMPT, kind, prompt_offset + start, prompt_offset + end, text))
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
    for kind, start, end, text in _spans(completion_ids, decode, answer, answer_findings):
        found.append(TokenFinding(COMPLETION, kind, start, end, text))
    return found


def drop_credentials(record: Any, findings: list[TokenFinding], filler: int) -> None:
    """``secrets=drop``: the record's credential tokens become ``filler`` (the same count, so every later call's
    prefix and every position stays where it was) and their text leaves its request body and stored answer (the
    writer also scrubs every stored request of a call without findings: an earlier answer's credential can come back
    in a later request's messages). New lists and dicts: the session index keeps the tokens as served."""
    prompt, completion = list(record.prompt_delta), list(record.completion_ids)
    for f in findings:
        ids, offset = (prompt, record.prompt_prefix_len) if f.part == PROMPT else (completion, 0)
        for i in range(max(f.start - offset, 0), min(f.end - offset, len(ids))):
            ids[i] = filler
    record.prompt_delta, record.completion_ids = prompt, completion
    texts = dropped_texts(findings)
    record.request = scrubbed(record.request, texts)
    if record.response is not None:
        record.response = scrubbed(record.response, texts)


def dropped_texts(findings: list[TokenFinding]) -> list[str]:
    """The credentials' texts to scrub from stored JSON, longest first (shorter ones would match anything)."""
    return sorted({f.text for f in findings if len(f.text) >= 4}, key=len, reverse=True)


def filler_token(tokenizer: Any) -> int:
    """The token a dropped credential's tokens become: ``*`` where that is one token, else the unknown or padding
    token."""
    ids = tokenizer.encode("*", add_special_tokens=False)
    if len(ids) == 1:
        return int(ids[0])
    fallback = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.pad_token_id
    return int(fallback or 0)
