"""Gateway render time against prompt length over a 20-turn harness conversation: fresh, spliced in full (the
whole conversation rendered with a marker, as before), and spliced incrementally (only the turns after the splice,
checked against the full render on first use per tail shape and on every 64th splice).

The conversation is OpenClaw's captured chat request (its system prompt, tools and first turns) continued for
``--turns`` tool rounds whose results repeat the captured tool output until each round adds about ``--round``
tokens. "spliced" is the whole spliced render (template, then the new text tokenized: the tokenizing grows with
the new turns, not with the prompt), "template" its template part alone. Each figure is the median of
``--repeat`` renders, in milliseconds of CPU time (the thread's, so that a busy machine changes the figures
little); ``hashes`` is the per-request prefix hashing that finds the splice parent (outside the renderer, for
scale).

    .venv/bin/python bench/render_splice.py [--model DIR] [--turns 20] [--round 1500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.core.conversation import Message, ToolCall, prefix_hashes  # noqa: E402
from gateway.core.render import Renderer, Splice  # noqa: E402
from gateway.model_files import load_tokenizer  # noqa: E402
from gateway.protocols.openai import chat  # noqa: E402
from gateway.protocols.openai.wire import ChatCompletionRequest  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "harness-requests" / "openclaw" / "01-chat-completions-after-tool-result.json"


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: a freshly built tiny model)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--round", type=int, default=1500, help="tokens each tool round adds, about")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from clawgate.tiny_model import build_tiny_model

            model = str(Path(tmp) / "tiny-model")
            build_tiny_model(model, seed=0)
        renderer = Renderer(load_tokenizer(model))
        body = json.loads(FIXTURE.read_text())["body"]
        req = ChatCompletionRequest.model_validate(body)
        convo, tools = chat.to_messages(req.messages), chat.to_tools(req)
        output = next(m.content for m in convo if m.role == "tool" and m.content) or "ok"
        result = output
        while len(renderer.encode(result)) < args.round:
            result += "\n" + output
        print(
            f"{'turn':>4} {'prompt tokens':>13} {'fresh':>7} {'spliced before':>14} {'spliced now':>11}"
            f" {'template before':>15} {'template now':>12} {'hashes':>7}"
        )
        for turn in range(args.turns):
            call = ToolCall(tools[0].name, json.dumps({"step": turn}), id=f"call{turn}")
            convo.append(Message(role="assistant", content=f"Step {turn}.", tool_calls=[call]))
            at = len(convo) - 1
            convo.append(Message(role="tool", content=result, tool_call_id=f"call{turn}"))
            parent = renderer.render_fresh(convo[:at], tools)  # stands in for the parent's raw ids
            splice = Splice(at, parent, False)

            def spliced_full(at: int = at, parent: list[int] = parent) -> list[int]:
                after = renderer.full_after(convo, tools, at)
                return parent + renderer.encode(after or "")

            ids = renderer.render_spliced(convo, tools, splice)
            assert ids == spliced_full(), "the incremental render differs from the full one"
            fresh = median_ms(lambda: renderer.render_fresh(convo, tools), args.repeat)
            full = median_ms(spliced_full, args.repeat)
            incremental = median_ms(lambda s=splice: renderer.render_spliced(convo, tools, s), args.repeat)
            text_full = median_ms(lambda at=at: renderer.full_after(convo, tools, at), args.repeat)
            text_now = median_ms(lambda at=at: renderer.incremental_after(convo, tools, at), args.repeat)
            hashes = median_ms(lambda: prefix_hashes(convo, tools), args.repeat)
            print(
                f"{turn + 1:>4} {len(ids or []):>13,} {fresh:7.2f} {full:14.2f} {incremental:11.2f}"
                f" {text_full:15.2f} {text_now:12.2f} {hashes:7.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
