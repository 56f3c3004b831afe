"""Text shown to people or sent to a judge, with credentials replaced by a placeholder naming their kind.

Two layers: the spans recorded on capture (``secret_findings``, exact, also for a value only its context marks as a
credential), then a scan of the text as shown, which also covers calls captured before scanning was on or with
``secrets=off``, and a credential cut by the display's own clipping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gateway.credentials.detect import Finding, scan

# (kind, start, end) over the token ids being shown.
Span = tuple[str, int, int]


def placeholder(kind: str) -> str:
    return f"[secret redacted: {kind}]"


def redact_text(text: str, findings: list[Finding] | None = None) -> str:
    """``text`` with each credential (``findings``, else what ``scan`` finds) replaced by a placeholder."""
    spans = scan(text) if findings is None else findings
    if not spans:
        return text
    parts: list[str] = []
    at = 0
    for f in spans:
        parts.append(text[at : f.start])
        parts.append(placeholder(f.kind))
        at = f.end
    parts.append(text[at:])
    return "".join(parts)


def scrubbed(value: Any, texts: Sequence[str] = ()) -> Any:
    """``value`` (a request body, stored Responses items: JSON data) with every string's credentials replaced: the
    exact ``texts`` (found in the call's tokens, longest first), then what a scan of the string finds."""
    if isinstance(value, str):
        for text in texts:
            value = value.replace(text, placeholder("dropped"))
        return redact_text(value)
    if isinstance(value, dict):
        return {k: scrubbed(v, texts) for k, v in value.items()}
    if isinstance(value, list):
        return [scrubbed(v, texts) for v in value]
    return value


def decode_redacted(ids: Sequence[int], spans: Sequence[Span], decode: Callable[[Sequence[int]], str]) -> str:
    """``ids`` decoded, the tokens of each span shown as a placeholder, and the text scanned once more."""
    parts: list[str] = []
    at = 0
    for kind, start, end in sorted(spans, key=lambda s: s[1]):
        start, end = max(start, at), min(end, len(ids))
        if start >= end:
            continue
        parts.append(decode(ids[at:start]))
        parts.append(placeholder(kind))
        at = end
    parts.append(decode(ids[at:]))
    return redact_text("".join(parts))


def redact_pieces(pieces: list[str], spans: Sequence[Span]) -> list[str]:
    """Per-token text (the console shows each answer token with its logprob) with credentials hidden: a span's
    first token shows the placeholder, its others nothing; then the joined text is scanned and the tokens of what
    it finds are hidden the same way."""
    out = list(pieces)
    for kind, start, end in spans:
        for i in range(max(start, 0), min(end, len(out))):
            out[i] = placeholder(kind) if i == max(start, 0) else ""
    text = "".join(out)
    findings = scan(text)
    if not findings:
        return out
    starts: list[int] = []
    at = 0
    for piece in out:
        starts.append(at)
        at += len(piece)
    for f in findings:
        covered = [i for i, s in enumerate(starts) if s < f.end and s + len(out[i]) > f.start]
        for n, i in enumerate(covered):
            out[i] = placeholder(f.kind) if n == 0 else ""
    return out
