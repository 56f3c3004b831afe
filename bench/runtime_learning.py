"""Does everyday traffic teach the model? Runtime RL end to end, through the serving API only.

`clawgate up` runs on the tiny model (gateway, trainer daemon and, in judge mode, the reward worker). A simulated
user works with it the way a person works with an agent: plain chat completions, no rollout API, no task, no
rewards posted by the client — single questions, multi-turn conversations, and requests that carry tool calls and
tool results — in parallel. Conversations are grouped implicitly by the gateway and closed after an idle timeout.

- ``--reward judge``: a judge server started here (OpenAI-compatible, answering ``{"score": …, "reason": …}`` from a
  fixed rule) is reached through LiteLLM by the reward worker, which scores each turn once its next state is known.
- ``--reward feedback``: the client posts per-call feedback (``POST /v1/feedback``) with the same rule's score: the
  only reward source.

The rule: the fraction of the reply's tokens that fall in a fixed set of 50 token ids (the reply re-tokenized with the
model's tokenizer; a random policy scores about 50/2048). The trainer trains turns as they are rewarded, with a
batch baseline; new versions are hot-swapped in while the user goes on. A learning-rate-0 control runs the same
loop: its score must stay flat. ``--counterfactuals K [K ...]``: the gateway draws K siblings per served turn, the
judge scores each group on the context alone, and a turn with a scored group is normalized within it (judge mode);
each K given runs (0: the batch baseline alone), seed by seed. ``--think S``: the user pauses S seconds before each
turn, as a person reads and types; the gateway draws siblings in those pauses (on the local engine a sibling yields
to any live call). ``--paced``: the user waits while the trainer has a step's worth of work waiting (ready answers,
siblings included, and turns the judge has not scored), so a run's turn count follows the trainer's steps rather than
the wall clock and the machine's load.

    .venv/bin/python bench/runtime_learning.py [--seeds 0 1] [--reward judge|feedback] [--lr 1e-2] [--timeout 420]
        [--counterfactuals 0 3 7] [--think 1.0] [--side-by-side] [--paced]

Prints the mean score of the turns each policy version served, the user turns sent until the newest versions scored
``gain`` above v0, the engine tokens spent per user turn (served answers, siblings), and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.store import db  # noqa: E402
from gateway.store import turns as store_turns  # noqa: E402
from tests.judge_server import JudgeServer, free_port, section  # noqa: E402
from tests.online import UpProcess, wait_healthy  # noqa: E402

ADMIN = "runtime-learning-admin"
GAIN = 0.3  # the rise of the served answers' judge score a run waits for
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


class TargetRule:
    """Score = the fraction of a text's tokens in a fixed target set (the judge's rule and the user's feedback)."""

    def __init__(self, tokenizer: Any, seed: int, size: int = 50) -> None:
        rng = random.Random(seed)
        special = set(tokenizer.all_special_ids)
        self.tokenizer = tokenizer
        self.targets = set(rng.sample([i for i in range(len(tokenizer)) if i not in special], size))

    def score(self, text: str) -> float:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return sum(t in self.targets for t in ids) / max(len(ids), 1)

    def judge(self, messages: list[dict[str, Any]]) -> str:
        score = self.score(section(messages, "reply"))
        return json.dumps({"score": round(score, 4), "reason": f"{score:.0%} of the reply is on target"})


class Pacer:
    """Holds the user back while the trainer has a step's worth of work waiting (``--paced``): ready answers (a turn
    with K scored siblings counts K + 1, as the trainer's step budget does) plus turns the judge has not scored yet.
    The user's turns then follow the trainer's steps instead of the wall clock, so the turns a run needs compare
    across machine loads and Ks; without it a slow trainer lets turns pile up and age out untrained."""

    def __init__(self, url: str, limit: int, *, judge: bool) -> None:
        self.db = db.connect(url)
        self.limit = limit
        self.judge = judge
        self._lock = threading.Lock()
        self._seen = (0.0, 0)  # (when, outstanding work)
        self.waited = 0.0  # seconds the user was held back, all threads together

    def outstanding(self) -> int:
        with self._lock:  # one look every 0.25 s, shared by the user's threads
            now = time.monotonic()
            if now - self._seen[0] >= 0.25:
                b = store_turns.backlog(self.db, 0, await_judge=self.judge)
                self._seen = (now, b.answers + b.awaiting_judge)
            return self._seen[1]

    def wait(self, until: float) -> None:
        start = time.monotonic()
        while self.outstanding() >= self.limit and time.monotonic() < until:
            time.sleep(0.25)
        self.waited += time.monotonic() - start

    def close(self) -> None:
        self.db.dispose()


@dataclass
class User:
    """Works with the gateway like a person: conversations of one to three turns, some with tools, in parallel."""

    url: str
    rule: TargetRule
    seed: int
    feedback: bool
    think: float = 0.0  # seconds before each turn
    pacer: Pacer | None = None
    failures: list[str] = field(default_factory=list)
    turns: int = 0
    deadline: float = float("inf")

    def reply_text(self, message: dict[str, Any]) -> str:
        parts = [message.get("reasoning_content") or "", message.get("content") or ""]
        parts += [c["function"]["arguments"] for c in message.get("tool_calls") or []]
        return "".join(parts)

    def ask(self, client: httpx.Client, body: dict[str, Any]) -> dict[str, Any] | None:
        if self.think:
            time.sleep(self.think)
        if self.pacer is not None:
            self.pacer.wait(self.deadline)
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            self.failures.append(f"{r.status_code}: {r.text[:300]}")
            return None
        self.turns += 1
        message: dict[str, Any] = r.json()["choices"][0]["message"]
        if self.feedback:
            value = self.rule.score(self.reply_text(message))
            call = r.headers["x-clawgate-call-id"]
            fb = client.post("/v1/feedback", json={"call_id": call, "value": value}, headers=self.admin)
            if fb.status_code != 201:
                self.failures.append(f"feedback {fb.status_code}: {fb.text[:300]}")
        return message

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN}"}

    def conversation(self, client: httpx.Client, rng: random.Random) -> None:
        topic = rng.randrange(100_000)
        kind = rng.choice(("single", "multi", "tool"))
        body: dict[str, Any] = {"model": "tiny", "temperature": 1.0, "max_tokens": 24}
        if kind == "tool":
            body["tools"] = TOOLS
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": f"List the files of project {topic}."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{topic}",
                            "type": "function",
                            "function": {"name": "exec", "arguments": json.dumps({"command": "ls"})},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"call_{topic}", "content": "main.py\nREADME.md\n"},
            ]
        else:
            messages = [{"role": "user", "content": f"Tell me about item {topic}."}]
        rounds = 1 if kind == "single" else rng.randint(2, 3)
        for r in range(rounds):
            answer = self.ask(client, {**body, "messages": messages})
            if answer is None:
                return
            messages.append({k: v for k, v in answer.items() if k in ("role", "content", "tool_calls")})
            if answer.get("tool_calls"):
                for call in answer["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "done"})
            else:
                messages.append({"role": "user", "content": f"Thanks. And part {r + 2}?"})

    def run(self, until: Callable[[], bool], timeout: float, workers: int = 8) -> None:
        deadline = self.deadline = time.monotonic() + timeout

        def work(index: int) -> None:
            rng = random.Random(self.seed * 7919 + index)
            with httpx.Client(base_url=self.url, timeout=120) as client:
                while time.monotonic() < deadline and not until():
                    try:
                        self.conversation(client, rng)
                    except httpx.HTTPError as error:
                        self.failures.append(repr(error))

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def scores_by_version(url: str, source: str) -> dict[int, list[float]]:
    """The reward of each served turn (one source) by the policy version that served it."""
    engine = db.connect(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT c.policy_version, r.value FROM rewards r JOIN calls c ON c.id = r.call_id "
                    "WHERE r.source = :source ORDER BY r.id"
                ),
                {"source": source},
            ).all()
    finally:
        engine.dispose()
    out: dict[int, list[float]] = {}
    for version, value in rows:
        out.setdefault(int(version or 0), []).append(float(value))
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def curve(by_version: dict[int, list[float]]) -> str:
    return "  ".join(f"v{v}: {mean(s):.3f} (n={len(s)})" for v, s in sorted(by_version.items()))


def engine_tokens(url: str) -> tuple[int, int, int]:
    """(completion tokens of the served calls, siblings drawn, their completion tokens)."""
    engine = db.connect(url)
    try:
        with engine.connect() as conn:
            served = conn.execute(sa.text("SELECT COALESCE(SUM(completion_len), 0) FROM calls")).scalar_one()
            drawn, sibling_tokens = conn.execute(
                sa.text("SELECT COUNT(*), COALESCE(SUM(completion_len), 0) FROM counterfactuals")
            ).one()
    finally:
        engine.dispose()
    return int(served), int(drawn), int(sibling_tokens)


@dataclass
class Result:
    by_version: dict[int, list[float]]
    seconds: float
    turns: int
    failures: list[str]
    output: str
    turns_to_goal: int | None = None  # user turns sent when the newest versions first scored ``gain`` above v0
    tokens: tuple[int, int, int] = (0, 0, 0)  # engine_tokens()
    held: float = 0.0  # seconds the pacer held the user back, all threads together

    @property
    def v0(self) -> float:
        return mean(self.by_version.get(0, []))

    def late(self, n: int = 64) -> float:
        """The mean score of the last ``n`` scored turns served by the newest versions."""
        newest = [s for v in sorted(self.by_version, reverse=True) if v > 0 for s in self.by_version[v]]
        return mean(newest[:n]) if newest else float("nan")


def run(
    model: Path,
    tokenizer: Any,
    *,
    workdir: Path,
    seed: int,
    lr: float,
    reward: str = "judge",
    min_turns: int = 48,
    max_turns: int | None = None,
    min_versions: int = 6,
    gain: float = GAIN,
    timeout: float = 420.0,
    workers: int = 4,
    counterfactuals: int = 0,
    think: float = 0.0,
    paced: bool = False,
    log: bool = True,
) -> Result:
    """One run; stops once ``min_versions`` versions served turns and the newest score ``gain`` above v0."""
    name = f"{reward}-{seed}-{lr:g}" + (f"-k{counterfactuals}" if counterfactuals else "")
    url = f"sqlite:///{workdir / (name + '.db')}"
    rule = TargetRule(tokenizer, seed)
    port = free_port()
    env = {
        "CLAWGATE_MODEL": str(model),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": url,
        "CLAWGATE_ADAPTER_DIR": str(workdir / f"adapters-{name}"),
        "CLAWGATE_DATA_DIR": str(workdir / f"data-{name}"),
        "CLAWGATE_PORT": str(port),
        "CLAWGATE_ADMIN_KEY": ADMIN,
        "CLAWGATE_MAX_TOKENS": "24",
        "CLAWGATE_SESSION_IDLE_TIMEOUT": "2",
        "CLAWGATE_POLICY_POLL_INTERVAL": "0.2",
        "CLAWGATE_TRAIN_LR": str(lr),
        "CLAWGATE_TRAIN_MIN_TURNS": str(min_turns),
        # A step takes at most this many turns (default: min_turns): the user sends turns faster than the trainer
        # takes them, and a step on 256 turns (the trainer's default) takes five times as long for about the same
        # move of the weights, so fewer turns a step means more versions a minute.
        "CLAWGATE_TRAIN_MAX_TURNS": str(max_turns or min_turns),
        "CLAWGATE_TRAIN_MAX_ROLLOUTS": str(2 * min_turns),
        "CLAWGATE_TRAIN_INTERVAL": "0.5",
        "CLAWGATE_TRAIN_GROUP_WAIT": "60",
        "CLAWGATE_TRAIN_SEED": str(seed),
        "CLAWGATE_TOOL_ERROR_REWARD": "0",
        # Siblings drawn per served turn (0: the batch baseline only); scored by the judge on the context alone.
        "CLAWGATE_COUNTERFACTUALS": str(counterfactuals),
    }
    server = None
    if reward == "judge":
        server = JudgeServer(rule.judge).start()
        env |= {
            "CLAWGATE_JUDGE_MODEL": "openai/rule-judge",
            "CLAWGATE_JUDGE_API_BASE": server.url,
            "CLAWGATE_JUDGE_API_KEY_ENV": "RULE_JUDGE_KEY",
            "RULE_JUDGE_KEY": "not-a-secret",
            "CLAWGATE_JUDGE_CONCURRENCY": "8",
            "CLAWGATE_JUDGE_INTERVAL": "0.2",
        }
    up = UpProcess(env=env, cwd=workdir)
    up.start()
    source = "judge" if reward == "judge" else "feedback"
    t0 = time.perf_counter()
    user = User(f"http://127.0.0.1:{port}", rule, seed, feedback=reward == "feedback", think=think)
    if paced:
        user.pacer = Pacer(url, max_turns or min_turns, judge=reward == "judge")
    try:
        wait_healthy(user.url, up, 120, version=0)
        state: dict[str, Any] = {"last": 0.0, "done": False, "turns": None}
        lock = threading.Lock()

        def done() -> bool:
            with lock:  # one look every 3 s, shared by the user's threads; once done, done for all
                now = time.monotonic()
                if state["done"] or now - state["last"] < 3:
                    return bool(state["done"])
                state["last"] = now
                by_version = scores_by_version(url, source)
                if log:
                    print(f"  [{name} {time.perf_counter() - t0:5.0f}s] {curve(by_version)}", flush=True)
                if len([v for v in by_version if v > 0]) >= min_versions:
                    late = Result(by_version, 0, 0, [], "").late()
                    # With a margin: the last turns judged after the stop may pull the newest score down a little.
                    reached = late > mean(by_version.get(0, [])) + gain
                    if reached and state["turns"] is None:
                        state["turns"] = user.turns
                    state["done"] = lr == 0 or late > mean(by_version.get(0, [])) + gain + 0.05
                return bool(state["done"])

        user.run(done, timeout, workers)
        # Let the last replies be judged before reading the scores.
        time.sleep(3)
        by_version = scores_by_version(url, source)
        tokens = engine_tokens(url)
    finally:
        code = up.stop()
        if server is not None:
            server.stop()
        if user.pacer is not None:
            user.pacer.close()
    if code != 0:
        raise RuntimeError(f"`clawgate up` exited with {code}:\n{up.output}")
    held = user.pacer.waited if user.pacer is not None else 0.0
    return Result(
        by_version, time.perf_counter() - t0, user.turns, user.failures, up.output, state["turns"], tokens, held
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--reward", choices=["judge", "feedback"], default="judge")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--min-turns", type=int, default=48)
    ap.add_argument("--max-turns", type=int, default=None, help="turns a step takes at most (default: --min-turns)")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--workers", type=int, default=4, help="the user's parallel conversations")
    ap.add_argument("--no-control", action="store_true", help="skip the learning-rate-0 control")
    ap.add_argument(
        "--counterfactuals",
        type=int,
        nargs="+",
        default=[0],
        metavar="K",
        help="siblings drawn per served turn (0: batch baseline); each K given runs",
    )
    ap.add_argument("--think", type=float, default=0.0, help="seconds the user pauses before each turn")
    ap.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the Ks of a seed at the same time, so they share the machine's load (the trainer's pace, and so the "
        "user turns a version takes, depends on it)",
    )
    ap.add_argument(
        "--paced",
        action="store_true",
        help="hold the user back while the trainer has a step's worth (--max-turns answers) of work waiting, so turn "
        "counts follow the trainer's steps, not the wall clock",
    )
    ap.add_argument("--show-output", action="store_true", help="print the end of `clawgate up`'s output")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from clawgate.tiny_model import build_tiny_model

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(model)
        t0 = time.perf_counter()
        batches = [[(k, seed, args.lr) for k in args.counterfactuals] for seed in args.seeds]
        batches += [] if args.no_control else [[(k, args.seeds[0], 0.0) for k in args.counterfactuals]]
        if not args.side_by_side:
            batches = [[one] for batch in batches for one in batch]

        def one(k: int, seed: int, lr: float) -> Result:
            return run(
                model,
                tokenizer,
                workdir=work,
                seed=seed,
                lr=lr,
                reward=args.reward,
                min_turns=args.min_turns,
                max_turns=args.max_turns,
                timeout=args.timeout,
                workers=args.workers,
                counterfactuals=k,
                think=args.think,
                paced=args.paced,
            )

        for batch in batches:
            with ThreadPoolExecutor(len(batch)) as pool:
                results = list(pool.map(lambda r: one(*r), batch))
            for (k, seed, lr), result in zip(batch, results, strict=True):
                report(args, k, seed, lr, result)
        print(f"wall time {time.perf_counter() - t0:.0f}s")
    return 0


def report(args: argparse.Namespace, k: int, seed: int, lr: float, result: Result) -> None:
    served, drawn, sibling_tokens = result.tokens
    per_turn = max(result.turns, 1)
    print(
        f"{args.reward} K={k} seed {seed} lr {lr:g}: v0 {result.v0:.3f} -> newest {result.late():.3f} "
        f"in {result.seconds:.0f}s, {result.turns} turns ({result.turns_to_goal} to +{GAIN:g}), "
        f"{len(result.failures)} failed requests"
        + (f", user held back {result.held:.0f}s" if args.paced else "")
        + "\n"
        f"  engine tokens per user turn: {served / per_turn:.1f} served + {sibling_tokens / per_turn:.1f} "
        f"in {drawn} siblings ({drawn / per_turn:.2f} per turn of {k} asked)\n"
        f"  {curve(result.by_version)}",
        flush=True,
    )
    if args.show_output:
        print(result.output, flush=True)


if __name__ == "__main__":
    sys.exit(main())
