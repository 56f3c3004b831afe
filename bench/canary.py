"""Guarded promotion: how many calls a canary needs to decide, how many conversations a bad candidate serves
meanwhile, and what the per-call assignment costs.

1. Calls to a decision vs effect size. A simulated user's feedback depends on the version serving it. Each new
   conversation gets an id (``ro-`` + 24 hex digits, as ``new_id("ro")`` makes them) and ``in_canary(id,
   candidate_version, share)`` puts it on an arm; it then has ``--turns`` turns, all on that arm, and each turn's
   reward is the arm's mean plus Gaussian noise (sd ``--sd``). Rewards live on a scale of about [0, 1]: the
   incumbent's mean is 0.6 and the candidate's is 0.6 − δ (not clipped: the test only sees means and variances).
   Conversations arrive one after another, so every ``--look-every`` rewarded turns (the promoter looks every few
   seconds) ``decide()`` is called with the ``Rule`` of the gateway's settings (``max_seconds`` infinite) and each
   arm's rewards so far; the error evidence is all zeros, one per call of each arm. The first verdict that is not
   "wait" ends a run; ``--max-calls`` turns without one leave it undecided. ``--seeds`` runs per δ, for δ = 0 (the
   same candidate: it should be promoted) and δ ∈ {0.1, 0.2, 0.4} (a worse one: it should be rejected), at the
   canary share of the settings and at 0.5. Per δ it prints the verdicts, calls (turns, both arms) and
   conversations to a decision (p50, p90, over decided runs), the candidate's share of the conversations until the
   decision, and the conversations the candidate served (its exposure).
   Turns are independent here; ``--conversation-sd`` adds an offset per conversation shared by its turns (real
   feedback is correlated within a conversation, which the test, counting turns, does not model).

2. Assignment latency. ``timeit`` of ``in_canary`` and ``Routing.arm_for`` per call, for a new conversation and a
   continuing one, in immediate mode (``Routing(incumbent)``) and during a canary (a candidate at share 0.1,
   sticky), interleaved in one run; the difference is what a canary adds to each call.

    .venv/bin/python bench/canary.py [--seeds 200] [--turns 3] [--sd 0.5] [--look-every 10] [--share 0.1]
                                     [--min-turns 50] [--margin 0.05] [--max-calls 100000] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import timeit
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.promotion.routing import Arm, Routing, in_canary  # noqa: E402
from gateway.promotion.stats import ArmStats, Outcome, Rule, decide  # noqa: E402
from gateway.settings import Settings  # noqa: E402

INCUMBENT_MEAN = 0.6
CANDIDATE_VERSION = 2
CHUNK = 1024  # conversations simulated at a time
DELTAS = (0.0, 0.1, 0.2, 0.4)


@dataclass(frozen=True, slots=True)
class Run:
    outcome: Outcome  # "wait": undecided within --max-calls
    calls: int
    conversations: int
    candidate_conversations: int


class Assignments:
    """The arms of each seed's conversations (True: the candidate), grown as runs need them; shared by every δ."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.arms: dict[int, np.ndarray] = {}

    def get(self, seed: int, upto: int) -> np.ndarray:
        have = self.arms.get(seed, np.zeros(0, dtype=bool))
        if len(have) < upto:
            more = np.fromiter(
                (in_canary(f"ro-{seed:08x}{j:016x}", CANDIDATE_VERSION, self.share) for j in range(len(have), upto)),
                dtype=bool,
                count=upto - len(have),
            )
            have = self.arms[seed] = np.concatenate([have, more])
        return have


def stats(n: float, s: float, q: float) -> ArmStats:
    """ArmStats from a count, sum and sum of squares (what ``ArmStats.of`` gives for the values themselves)."""
    k = int(n)
    if k == 0:
        return ArmStats()
    mean = s / k
    return ArmStats(k, mean, max(q - s * mean, 0.0) / (k - 1) if k > 1 else 0.0)


def simulate(
    seed: int, delta: float, assignments: Assignments, rule: Rule, args: argparse.Namespace, check: bool = False
) -> Run:
    """One canary: conversations until the first verdict that is not "wait" (or ``--max-calls`` turns)."""
    rng = np.random.default_rng([seed, round(delta * 1000)])
    turns, every = args.turns, args.look_every
    carry = np.zeros(6)  # candidate n, sum, sum of squares; incumbent n, sum, sum of squares
    done = 0  # turns simulated
    seen: list[tuple[np.ndarray, np.ndarray]] = []  # (arm, reward) per chunk, kept for ``check``
    while done < args.max_calls:
        first = done // turns
        arm = np.repeat(assignments.get(seed, first + CHUNK)[first : first + CHUNK], turns)
        offset = np.repeat(args.conversation_sd * rng.standard_normal(CHUNK), turns)
        noise = offset + args.sd * rng.standard_normal(arm.size)
        reward = np.where(arm, INCUMBENT_MEAN - delta, INCUMBENT_MEAN) + noise
        if check:
            seen.append((arm, reward))
        c = arm.astype(float)
        i = 1.0 - c
        sums = np.cumsum(np.stack([c, c * reward, c * reward**2, i, i * reward, i * reward**2], axis=1), axis=0)
        sums += carry
        for at in range((every - 1 - done) % every, min(arm.size, args.max_calls - done), every):
            nc, sc, qc, ni, si, qi = sums[at].tolist()  # Python floats: decide() rounds them
            verdict = decide(
                (stats(nc, sc, qc), stats(ni, si, qi)),
                (ArmStats(int(nc), 0.0, 0.0), ArmStats(int(ni), 0.0, 0.0)),
                rule,
                0.0,
            )
            if verdict.outcome != "wait":
                calls = done + at + 1
                conversations = (calls - 1) // turns + 1
                if check:  # the running sums give the verdict ArmStats.of gives on the rewards themselves
                    arms = np.concatenate([a for a, _ in seen])[:calls]
                    rewards = np.concatenate([r for _, r in seen])[:calls]
                    exact = decide(
                        (ArmStats.of(rewards[arms].tolist()), ArmStats.of(rewards[~arms].tolist())),
                        (ArmStats.of([0.0] * int(nc)), ArmStats.of([0.0] * int(ni))),
                        rule,
                        0.0,
                    )
                    assert exact.outcome == verdict.outcome, (exact, verdict)
                cand = int(assignments.get(seed, conversations)[:conversations].sum())
                return Run(verdict.outcome, calls, conversations, cand)
        carry = sums[-1]
        done += arm.size
    conversations = (args.max_calls - 1) // turns + 1
    cand = int(assignments.get(seed, conversations)[:conversations].sum())
    return Run("wait", args.max_calls, conversations, cand)


def pct(xs: list[int], q: float) -> str:
    return f"{np.percentile(xs, q):,.0f}" if xs else "-"


def effect_table(share: float, rule: Rule, args: argparse.Namespace) -> dict[float, list[Run]]:
    assignments = Assignments(share)
    print(f"\n== share {share:g}: {args.seeds} seeds per δ, cap {args.max_calls:,} calls")
    print(
        f"{'δ':>4} {'promoted':>8} {'rejected':>8} {'undecided':>9} {'calls p50':>9} {'calls p90':>9} "
        f"{'convs p50':>9} {'cand share':>10} {'cand convs p50':>14} {'p90':>6} {'s':>5}"
    )
    out: dict[float, list[Run]] = {}
    for delta in DELTAS:
        start = time.perf_counter()
        runs = [simulate(seed, delta, assignments, rule, args, check=seed == 0) for seed in range(args.seeds)]
        out[delta] = runs
        decided = [r for r in runs if r.outcome != "wait"]
        rate = {o: sum(r.outcome == o for r in runs) / len(runs) for o in ("promote", "reject", "wait")}
        exposure = sum(r.candidate_conversations for r in runs) / sum(r.conversations for r in runs)
        cand = [r.candidate_conversations for r in decided]
        print(
            f"{delta:4.1f} {rate['promote']:8.1%} {rate['reject']:8.1%} {rate['wait']:9.1%} "
            f"{pct([r.calls for r in decided], 50):>9} {pct([r.calls for r in decided], 90):>9} "
            f"{pct([r.conversations for r in decided], 50):>9} {exposure:10.3f} "
            f"{pct(cand, 50):>14} {pct(cand, 90):>6} {time.perf_counter() - start:5.1f}",
            flush=True,
        )
    same, worst = out[0.0], out[max(DELTAS)]
    print(
        f"false rejection (δ=0): {sum(r.outcome == 'reject' for r in same) / len(same):.1%}   "
        f"false promotion (δ={max(DELTAS):g}): {sum(r.outcome == 'promote' for r in worst) / len(worst):.1%}"
    )
    return out


def per_call_us(fn: Callable[[], object], calls: int, repeat: int) -> float:
    """Fastest of ``repeat`` timings of ``fn`` (which makes ``calls`` calls), in µs per call."""
    return min(timeit.repeat(fn, number=1, repeat=repeat)) / calls * 1e6


def latency(calls: int, repeat: int) -> None:
    ids = [f"ro-{uuid.uuid4().hex[:24]}" for _ in range(calls)]
    incumbent, candidate = Arm("policy", 1), Arm("policy", CANDIDATE_VERSION)
    immediate = Routing(incumbent)
    canary = Routing(incumbent, candidate, share=0.1, sticky=True)

    def loop(routing: Routing, parent: int | None, continues: bool) -> Callable[[], object]:
        arm_for = routing.arm_for
        return lambda: [arm_for(cid, parent, continues) for cid in ids]

    cases: dict[str, Callable[[], object]] = {
        "empty loop (baseline)": lambda: [cid for cid in ids],
        "in_canary": lambda: [in_canary(cid, CANDIDATE_VERSION, 0.1) for cid in ids],
        "immediate, new": loop(immediate, None, False),
        "canary, new": loop(canary, None, False),
        "immediate, continuing": loop(immediate, 1, True),
        "canary, continuing on incumbent": loop(canary, 1, True),
        "canary, continuing on candidate": loop(canary, CANDIDATE_VERSION, True),
    }
    best = {name: math.inf for name in cases}
    for _ in range(repeat):  # interleaved, so a slow moment of the machine hits every case alike
        for name, fn in cases.items():
            best[name] = min(best[name], per_call_us(fn, calls, 1))
    print(f"\n== assignment latency: {calls:,} calls per timing, fastest of {repeat} (goal ≤ 100 µs per call)")
    print(f"{'case':34} {'µs/call':>8}")
    for name, us in best.items():
        print(f"{name:34} {us:8.3f}")
    print(
        f"canary adds per call: new {best['canary, new'] - best['immediate, new']:+.3f} µs, "
        f"continuing {best['canary, continuing on candidate'] - best['immediate, continuing']:+.3f} µs "
        f"(on candidate), {best['canary, continuing on incumbent'] - best['immediate, continuing']:+.3f} µs "
        "(on incumbent)"
    )


def main() -> int:
    settings = Settings()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="runs per δ")
    ap.add_argument("--turns", type=int, default=3, help="turns per conversation")
    ap.add_argument("--sd", type=float, default=0.5, help="reward noise per turn (rewards on a ~[0, 1] scale)")
    ap.add_argument("--conversation-sd", type=float, default=0.0, help="noise per conversation, shared by its turns")
    ap.add_argument("--look-every", type=int, default=10, help="rewarded turns between looks")
    ap.add_argument("--share", type=float, default=settings.canary_share)
    ap.add_argument("--min-turns", type=int, default=settings.canary_min_turns)
    ap.add_argument("--margin", type=float, default=settings.promotion_margin)
    ap.add_argument("--max-calls", type=int, default=100_000, help="turns after which a run counts as undecided")
    ap.add_argument("--latency-calls", type=int, default=200_000)
    ap.add_argument("--no-half", action="store_true", help="skip the runs at share 0.5")
    ap.add_argument("--quick", action="store_true", help="40 seeds, 50,000 latency calls")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.latency_calls = min(args.seeds, 40), min(args.latency_calls, 50_000)
    rule = Rule(margin=args.margin, min_n=args.min_turns, max_seconds=math.inf)

    print(
        f"rule: margin {rule.margin:g}, min_n {rule.min_n} per arm, alpha {rule.alpha:g}, no time limit; "
        f"share {args.share:g}"
    )
    print(
        f"user: {args.turns} turns per conversation, reward = mean + N(0, {args.sd:g}²)"
        + (f" + N(0, {args.conversation_sd:g}²) per conversation" if args.conversation_sd else "")
        + f"; incumbent mean {INCUMBENT_MEAN:g}, candidate {INCUMBENT_MEAN:g} − δ; a look every {args.look_every} "
        f"rewarded turns; {args.seeds} seeds"
    )
    start = time.perf_counter()
    for share in dict.fromkeys([args.share, *([] if args.no_half else [0.5])]):
        effect_table(share, rule, args)
    print(f"(simulation {time.perf_counter() - start:.0f} s)")
    latency(args.latency_calls, repeat=3 if args.quick else 5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
