"""Tokens per training step and training throughput: tree packing vs per-path vs per-call sequences.

Builds one rollout per captured harness request in tests/fixtures/harness-requests/ (Claude Code, Codex, OpenClaw;
Anthropic messages, responses and chat completions bodies), translated to the gateway's internal messages with
the gateway's own protocol translators and rendered with the tiny model's chat template. Each conversation is
continued by a few tool turns of the same shape and the answer the capture server gave; one call is recorded per
assistant turn the way the gateway records it (token-in-token-out: the prompt is the previous prompt, the raw
tokens of the previous completion and the text the template puts after it), plus one retry of a middle turn with
another answer, abandoned for the original.

Two filterings: the default one (the retry is a dead leaf: one kept path per rollout) and one that keeps the
retry as a second branch (``drop_dead_leaves=False``), where the two paths share everything before the retried
turn. For each, one training step over all rollouts is laid out three ways:

- tree:  ``pack_trees(strategy="tree")``: every kept token once, ancestor-only mask;
- paths: ``pack_trees(strategy="paths")``: every kept root-to-leaf path as its own row;
- calls: every kept call as its own sequence (what a trainer without prefix trees processes).

It prints tokens processed per step (padding included, and without it), and the time of one forward+backward
step with a LoRA (r=8 on q, k, v, o) on the tiny model with SDPA attention, as processed tokens/s and as
trainable tokens/s (distinct generated tokens learned from per second: the figure to compare).

    .venv/bin/python bench/tree_packing.py [--fixtures all] [--turns 4] [--skip-calls-timing]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.core.conversation import Message, ToolCall, ToolSpec  # noqa: E402
from gateway.core.render import Renderer  # noqa: E402
from prefix_tree import CallView, RolloutTree, TreeConfig, build_tree  # noqa: E402
from trainer.batch import PackedBatch, pack_trees  # noqa: E402
from trainer.logprobs import sequence_logprobs  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "harness-requests"
# One per harness by default: the turn after a tool result, each in a different API.
DEFAULT_FIXTURES = (
    "claude-code/02-after-tool-result-messages.json",
    "codex/02-after-tool-result-responses-custom-model.json",
    "openclaw/01-chat-completions-after-tool-result.json",
)
TOOL_OUTPUTS = (
    ("ls -la", "total 8\n-rw-r--r-- 1 root root 12 notes.txt\n-rw-r--r-- 1 root root 240 main.py\n"),
    ("wc -l notes.txt", "1 notes.txt"),
    ("cat notes.txt", "hello world"),
    (
        "python main.py",
        "Traceback (most recent call last):\n  File \"main.py\", line 3\nNameError: name 'x' is not defined",
    ),
    ("grep -n x main.py", "3:print(x)"),
    ("sed -i 's/x/1/' main.py && python main.py", "1"),
)


def conversation(path: Path) -> tuple[list[Message], list[ToolSpec], str]:
    """A captured request body as internal messages and tools, and the answer the capture server sent."""
    capture = json.loads(path.read_text())
    body, endpoint = capture["body"], capture["path"]
    answer = str(capture.get("_response", {}).get("text") or "done")
    if endpoint.endswith("/messages"):
        from gateway.protocols.anthropic import serving as anthropic
        from gateway.protocols.anthropic.wire import MessagesRequest

        req = MessagesRequest.model_validate(body)
        return anthropic.to_messages(req), anthropic.to_tools(req.tools), answer
    if endpoint.endswith("/responses"):
        from gateway.protocols.responses import serving as responses
        from gateway.protocols.responses.wire import ResponsesRequest

        rreq = ResponsesRequest.model_validate(body)
        items = rreq.input if isinstance(rreq.input, list) else []
        return responses.to_messages(items), responses.to_tools(rreq.tools), answer
    from gateway.protocols.openai import chat as openai
    from gateway.protocols.openai.wire import ChatCompletionRequest

    creq = ChatCompletionRequest.model_validate(body)
    tools = [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in creq.tools or []]
    return openai.to_messages(creq.messages), tools, answer


def continue_conversation(messages: list[Message], tools: list[ToolSpec], answer: str, turns: int) -> list[Message]:
    """The captured messages followed by ``turns`` tool turns and the final answer.

    A harness that appended a user turn after the captured tool result (OpenClaw's internal context) does so
    after every tool result.
    """
    out = list(messages)
    trailer = copy.deepcopy(out[-1]) if out[-1].role == "user" and len(out) > 1 and out[-2].role == "tool" else None
    name = tools[0].name if tools else "exec"
    for k in range(turns):
        command, output = TOOL_OUTPUTS[k % len(TOOL_OUTPUTS)]
        call_id = f"call{k}"
        out.append(Message("assistant", tool_calls=[ToolCall(name, json.dumps({"command": command}), call_id)]))
        out.append(Message("tool", content=output, tool_call_id=call_id))
        if trailer is not None:
            out.append(copy.deepcopy(trailer))
    out.append(Message("assistant", content=answer))
    return out


def record_calls(renderer: Renderer, messages: list[Message], tools: list[ToolSpec]) -> list[CallView]:
    """One call per assistant turn, spliced like the gateway (TITO), and a retry of a middle turn."""
    end = "<|im_end|>"
    dicts = [m.to_template() for m in messages]
    calls: list[CallView] = []
    prompt: list[int] = []
    rendered = ""
    for k, message in enumerate(messages):
        if message.role != "assistant":
            continue
        prompt_text = renderer.render_text(dicts[:k], tools, add_generation_prompt=True)
        if not prompt_text.startswith(rendered):
            raise RuntimeError("the template re-renders earlier turns differently: no token-exact prefix")
        prompt = prompt + renderer.encode(prompt_text[len(rendered) :])
        turn = renderer.render_text(dicts[: k + 1], tools, add_generation_prompt=False)[len(prompt_text) :]
        completion_text = turn[: turn.index(end) + len(end)]
        completion = renderer.encode(completion_text)
        calls.append(CallView(f"turn{k}", prompt, completion, [-0.5] * len(completion), float(k), "ok", 1))
        prompt = prompt + completion
        rendered = prompt_text + completion_text
    middle = calls[len(calls) // 2]
    other = renderer.encode("Let me look at the files first.\n" + end)
    # The harness re-sent this turn's request (a timeout); the first answer was dropped and the session went on.
    calls.append(CallView("retry", middle.prompt_ids, other, [-1.0] * len(other), middle.started_at - 0.5, "ok", 1))
    return calls


@dataclass
class Layout:
    name: str
    batches: list[PackedBatch]

    @property
    def tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    @property
    def real_tokens(self) -> int:
        return sum(b.real_tokens for b in self.batches)

    @property
    def trainable(self) -> int:
        """Distinct trainable tokens (a token on c paths counts once: its weights sum to 1)."""
        return round(sum(float(b.weights.sum()) for b in self.batches))


def layouts(trees: list[RolloutTree], calls: list[list[CallView]], budget: int) -> list[Layout]:
    per_call = [
        build_tree([c])
        for tree, rollout in zip(trees, calls, strict=True)
        for c in rollout
        if tree.calls[c.id].fate == "kept"
    ]
    return [
        Layout("tree", pack_trees(trees, "tree", budget)),
        Layout("paths", pack_trees(trees, "paths", budget)),
        Layout("calls", pack_trees(per_call, "paths", budget)),
    ]


def train_step(model: Any, batches: list[PackedBatch]) -> float:
    """Seconds for one forward + backward pass over the batches (a GRPO-shaped loss, advantage 1)."""
    start = time.perf_counter()
    for batch in batches:
        logp = sequence_logprobs(model, batch)
        loss = (batch.weights * -logp).sum()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default="default", help="'default' (one per harness), 'all', or a glob")
    ap.add_argument("--turns", type=int, default=4, help="tool turns added after the captured request")
    ap.add_argument("--max-tokens-per-bin", type=int, default=24576)
    ap.add_argument("--model", type=Path, default=None, help="a model folder (default: build the tiny model)")
    ap.add_argument("--repeat", type=int, default=1, help="time each step this many times, keep the fastest")
    ap.add_argument("--skip-calls-timing", action="store_true", help="count per-call tokens but do not train them")
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawgate.tiny_model import build_tiny_model

    torch.manual_seed(0)
    if args.fixtures == "default":
        paths = [FIXTURES / name for name in DEFAULT_FIXTURES]
    else:
        paths = sorted(FIXTURES.glob("*/*.json" if args.fixtures == "all" else args.fixtures))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "tiny", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        base.load_state_dict({k: v.clone() for k, v in base.state_dict().items()})  # off the temporary file
    renderer = Renderer(tokenizer)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, lora)

    rollouts: list[list[CallView]] = []
    print(f"{'fixture':58} {'calls':>5} {'prompt':>7} {'tree':>7} {'per call':>9} {'saving':>7}")
    for path in paths:
        messages, tools, answer = conversation(path)
        calls = record_calls(renderer, continue_conversation(messages, tools, answer, args.turns), tools)
        rollouts.append(calls)
        report = build_tree(calls).report
        print(
            f"{path.relative_to(FIXTURES)!s:58} {len(calls):5} {len(calls[0].prompt_ids):7,} "
            f"{report.tree_tokens:7,} {report.naive_tokens:9,} {report.saving:6.2f}x"
        )
    longest = max(len(c.prompt_ids) + len(c.completion_ids) for calls in rollouts for c in calls)
    budget = max(args.max_tokens_per_bin, longest)
    print(f"\nmax_tokens_per_bin {budget:,}; LoRA r=8 on q,k,v,o; attention sdpa; {torch.get_num_threads()} threads")

    # Warm-up (allocation, kernel choice) on a small branched tree, with the dense tree mask and the causal one.
    head = list(rollouts[0][0].prompt_ids[:1024])
    warm = [CallView(f"w{i}", head, [i + 1] * 8, [-1.0] * 8, float(i), "ok") for i in range(2)]
    warm.append(CallView("w2", [*head, 1, 1, 1, 1, 1, 1, 1, 1, 7], [9], [-1.0], 2.0, "ok"))
    warm.append(CallView("w3", [*head, 2, 2, 2, 2, 2, 2, 2, 2, 7], [9], [-1.0], 3.0, "ok"))
    for strategy in ("tree", "paths"):
        train_step(model, pack_trees([build_tree(warm)], strategy, budget))
    for title, config in (
        ("default filtering (the retry is a dead leaf)", TreeConfig()),
        ("retry kept as a second branch (drop_dead_leaves=False)", TreeConfig(drop_dead_leaves=False)),
    ):
        trees = [build_tree(calls, config) for calls in rollouts]
        leaves = sum(t.report.leaves for t in trees)
        print(f"\n== {title}: {len(trees)} rollouts, {leaves} kept paths")
        print(
            f"{'layout':6} {'passes':>6} {'tokens/step':>12} {'no padding':>11} {'vs tree':>8} "
            f"{'trainable':>9} {'step s':>7} {'tokens/s':>9} {'trainable/s':>11}"
        )
        results = layouts(trees, rollouts, budget)
        tree_tokens = results[0].tokens
        for layout in results:
            seconds = None
            if not (layout.name == "calls" and args.skip_calls_timing):
                seconds = min(train_step(model, layout.batches) for _ in range(args.repeat))
            timing = (
                f"{seconds:7.2f} {layout.tokens / seconds:9,.0f} {layout.trainable / seconds:11,.1f}"
                if seconds is not None
                else f"{'-':>7} {'-':>9} {'-':>11}"
            )
            print(
                f"{layout.name:6} {len(layout.batches):6} {layout.tokens:12,} {layout.real_tokens:11,} "
                f"{layout.tokens / tree_tokens:7.2f}x {layout.trainable:9,} {timing}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
