"""Trainer throughput on one process and on several (the data-parallel update of ``trainer/distributed.py``).

Synthetic agent rollouts (a system prompt, then turns that each add a tool result and an answer to the same
conversation: one long kept path per rollout, as tree packing sees harness traffic) are packed into micro-batches of
``--max-tokens-per-rank`` tokens and trained with the GRPO update the trainer uses (``update.run``: LoRA on the
attention and MLP projections, the truncated-IS PPO-clip loss), for ``--steps`` steps after one warm-up step, on 1
and on each of ``--ranks`` processes. Every rank builds the same rollouts from one seed (the trainer proper sends
rank 0's instead: same batches, no database here). Printed per world size: trainable tokens per second per step, the
step's time, and peak memory per rank (CUDA: ``max_memory_allocated``; CPU: the process's peak resident set). With
``--shard`` the frozen base is sharded over the ranks (FSDP2, ``trainer/sharding.py``): less memory per rank.

On CPU (gloo) expect little gain from 2 ranks on 2 cores: the point there is correctness. On a GPU host, with a
random-init model of a given architecture (no download):

    .venv/bin/python bench/trainer_throughput.py                         # tiny model, CPU, 1 vs 2 ranks
    python bench/trainer_throughput.py --device cuda --size 8b --ranks 1,2,4,8 --rollouts 32 --turns 8
    python bench/trainer_throughput.py --device cuda --size 14b --ranks 2,4,8 --shard --mixed-precision bf16
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Qwen3 dense shapes (the public configs): hidden, layers, attention heads, KV heads, MLP width, vocabulary.
SIZES = {
    "0.6b": (1024, 28, 16, 8, 3072, 151936),
    "1.7b": (2048, 28, 16, 8, 6144, 151936),
    "4b": (2560, 36, 32, 8, 9728, 151936),
    "8b": (4096, 36, 32, 8, 12288, 151936),
    "14b": (5120, 40, 40, 8, 17408, 151936),
}


def build_model(args: argparse.Namespace, tiny_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.size == "tiny":
        return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=dtype)
    hidden, layers, heads, kv, mlp, vocab = SIZES[args.size]
    config = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=32768,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def rollouts(args: argparse.Namespace, vocab: int) -> list[Any]:
    import numpy as np

    from prefix_tree import CallView, TreeConfig, build_tree

    rng = np.random.default_rng(args.seed)
    trees = []
    for r in range(args.rollouts):
        context = rng.integers(3, vocab, size=args.prompt).tolist()
        calls = []
        for t in range(args.turns):
            completion = rng.integers(3, vocab, size=args.completion).tolist()
            logprobs = rng.uniform(-4.0, -0.05, size=args.completion).tolist()
            calls.append(CallView(f"r{r}c{t}", list(context), completion, logprobs, float(t), "ok", policy_version=0))
            context = context + completion + rng.integers(3, vocab, size=args.tool).tolist()
        trees.append(build_tree(calls, TreeConfig()))
    return trees


def rank_main(rank: int, size: int, port: int, args: argparse.Namespace, tiny_dir: str, out: Any) -> None:
    import torch

    from trainer import distributed, lora, sharding, update
    from trainer.credit import CreditTable
    from trainer.logprobs import sequence_logprobs

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(args.threads)
    world = distributed.from_env(args.device, shard=args.shard) if size > 1 else None
    device = f"cuda:{rank}" if args.device.startswith("cuda") else "cpu"
    base = build_model(args, tiny_dir)
    policy = lora.new_policy(base, lora.LoraSettings(rank=args.lora_rank), gradient_checkpointing=args.checkpointing)
    if world is not None and world.sharded:  # only this rank's shards go to the device
        sharding.shard(policy, device=device, mixed_precision=args.mixed_precision)
    policy.to(device)
    policy.train()
    optimizer = torch.optim.AdamW(distributed.trainable(policy), lr=1e-5) if rank == 0 else None
    trees = rollouts(args, int(base.config.vocab_size))
    credits = CreditTable(trees, [float(i % 3 - 1) for i in range(len(trees))])

    class Settings:
        temperature, clip_low, clip_high, is_cap = 1.0, 0.2, 0.28, 2.0
        strategy, max_tokens_per_bin = "tree", args.max_tokens_per_bin

    batches = update.pack(trees, Settings)  # type: ignore[arg-type]

    def loss(batch: Any) -> tuple[Any, dict[str, float]]:
        logp = sequence_logprobs(policy, batch, temperature=1.0)
        return update.policy_term(logp, batch, credits.for_batch(batch), Settings)  # type: ignore[arg-type]

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    times, tokens = [], 0.0
    for step in range(args.steps + 1):
        if world is not None:
            world.share_weights(policy)
        t0 = time.perf_counter()
        metrics = update.run(policy, optimizer, batches, loss, world=world)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if step:  # the first step warms up (allocations, kernels)
            times.append(time.perf_counter() - t0)
            tokens = metrics["trainable_tokens"]
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out.put((rank, sorted(times)[len(times) // 2], tokens, peak, len(batches)))
    distributed.close(world)


def measure(size: int, args: argparse.Namespace, tiny_dir: str) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, size, port, args, tiny_dir, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"a rank of the {size}-rank run failed (exit code {p.exitcode})")
    step = max(r[1] for r in results)
    tokens, batches = results[0][2], results[0][4]
    memory = ", ".join(f"{r[3]:.2f}" for r in results)
    unit = "GiB allocated" if args.device.startswith("cuda") else "GiB peak RSS"
    print(
        f"{size} rank(s): {tokens / step:,.0f} trainable tokens/s; a step of {tokens:,.0f} tokens in {batches} "
        f"micro-batches took {step:.3f} s (median of {args.steps}); memory per rank ({unit}): {memory}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2", help="world sizes to measure, comma-separated")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--size", default="tiny", choices=["tiny", *SIZES], help="the tiny model, or a random Qwen3 shape")
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4, help="calls per rollout")
    ap.add_argument("--prompt", type=int, default=96, help="system prompt tokens")
    ap.add_argument("--completion", type=int, default=24, help="tokens per answer")
    ap.add_argument("--tool", type=int, default=16, help="tokens per tool result between answers")
    ap.add_argument("--max-tokens-per-rank", "--max-tokens-per-bin", dest="max_tokens_per_bin", type=int, default=1024)
    ap.add_argument("--shard", action="store_true", help="shard the frozen base over the ranks (FSDP2)")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="with --shard")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from clawgate.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = str(Path(tmp) / "tiny")
        if args.size == "tiny":
            build_tiny_model(Path(tiny_dir), seed=0)
        shard = ", base sharded" if args.shard else ""
        print(
            f"{args.rollouts} rollouts × {args.turns} calls on the {args.size} model ({args.device}{shard})", flush=True
        )
        for size in [int(s) for s in args.ranks.split(",")]:
            measure(size, args, tiny_dir)


if __name__ == "__main__":
    main()
