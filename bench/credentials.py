"""Credentials on capture: what the scan costs, what it finds, and what it adds to the capture writer.

1. Detector cost: the harness fixtures' text (Claude Code, Codex, OpenClaw requests) cut into suffixes of 4,096
   tokens of the built-in tokenizer (about 10,000 characters) and of 16,384 characters (about 4,096 tokens of a
   real model's tokenizer on code and prose): time to decode the ids and to scan the text, median and p99.
2. Recall and false positives: the generated corpus of ``tests/secret_corpus.py`` planted in tool output, and the
   fixtures' whole text (every finding there is a false positive).
3. The capture writer: ``rows.prepare`` of calls with a 1,000-token prompt delta and a 200-token answer, with and
   without the scan (what a batch's commit waits for in addition).

    .venv/bin/python bench/credentials.py
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.credentials.detect import scan  # noqa: E402
from gateway.credentials.tokens import RecordScanner, tokenizer_decode  # noqa: E402
from gateway.store.records import CallRecord  # noqa: E402
from gateway.store.rows import prepare  # noqa: E402
from tests.secret_corpus import ORDINARY, corpus  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "harness-requests"


def strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in strings(item)]


def fixture_text() -> str:
    files = sorted(FIXTURES.rglob("*.json"))
    return "\n".join("\n".join(strings(json.loads(p.read_text(encoding="utf-8")))) for p in files)


def timed(fn: Any, inputs: list[Any], rounds: int = 5) -> list[float]:
    """Milliseconds per input, the best of ``rounds`` for each."""
    out = []
    for item in inputs:
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            fn(item)
            best = min(best, time.perf_counter() - start)
        out.append(best * 1e3)
    return out


def summary(ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"median {statistics.median(ms):.3f} ms, p99 {p99:.3f} ms ({len(ms)} samples)"


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from clawgate.tiny_model import build_tiny_model

    folder = ROOT / ".clawgate" / "bench-tiny-model"
    if not (folder / "tokenizer.json").exists():
        build_tiny_model(folder, seed=0)
    return AutoTokenizer.from_pretrained(folder)


def main() -> None:
    tok = tokenizer()
    decode = tokenizer_decode(tok)
    text = fixture_text()
    ids = tok.encode(text, add_special_tokens=False)
    print(f"fixtures: {len(text):,} characters, {len(ids):,} tokens ({len(text) / len(ids):.2f} characters a token)")

    chunks = [ids[i : i + 4096] for i in range(0, len(ids) - 4096, 4096)]
    texts = [decode(c) for c in chunks]
    print(f"4,096-token suffixes: decode {summary(timed(decode, chunks))}")
    print(f"4,096-token suffixes: scan   {summary(timed(scan, texts))}")
    long_texts = [text[i : i + 16384] for i in range(0, len(text) - 16384, 16384)]
    print(f"16,384-character suffixes: scan {summary(timed(scan, long_texts))}")

    planted = corpus()
    found = 0
    for p in planted:
        doc = f"$ cat config\n{p.line}\n$ "
        at = doc.find(p.value)
        found += any(f.start <= at and f.end >= at + len(p.value) for f in scan(doc))
    print(f"recall: {found}/{len(planted)} generated credentials found")
    print(
        f"false positives: {len(scan(text))} in the fixtures, {sum(bool(scan(o)) for o in ORDINARY)} in "
        f"{len(ORDINARY)} ordinary lines"
    )

    now = dt.datetime.now(dt.UTC)
    records = [
        CallRecord(
            id=f"call-{n}",
            request_id=f"req-{n}",
            rollout_id="ro",
            api="chat",
            model="m",
            engine="e",
            render_mode="fresh",
            request={"messages": []},
            started_at=now,
            ended_at=now,
            prompt_delta=ids[n * 1200 : n * 1200 + 1000],
            completion_ids=ids[n * 1200 + 1000 : n * 1200 + 1200],
            completion_logprobs=[-0.5] * 200,
        )
        for n in range(min(100, len(ids) // 1200))
    ]
    scanner = RecordScanner(tok)
    plain = timed(lambda r: prepare([r]), records)

    def scan_anew(record: CallRecord) -> None:
        record.secret_findings = None  # the scanner keeps a record's findings: each round scans again
        prepare([record], scanner)

    scanned = timed(scan_anew, records)
    print(f"capture rows for a call of 1,000 + 200 tokens: {summary(plain)} without the scan, {summary(scanned)} with")


if __name__ == "__main__":
    main()
