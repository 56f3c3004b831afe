"""One rank of ``clawgate train`` under torchrun, for tests/test_distributed_train.py.

Ranks other than 0 are given a database URL nothing answers on, so a rank that touched the database would fail the
run. With ``CLAWGATE_TEST_RANK_DIES=CODE``, rank 1 exits with that code when rank 0's first update reaches it (a
non-zero code makes torchrun stop the group; with 0 rank 0 finds the collective broken by itself).

``torchrun_rank.py learning MODEL WORKDIR LR:STEPS... [--shard]`` runs the learning check of bench/learning_check.py
instead, once per learning rate, with its trainer as rank 0 of this group, and prints each reward curve as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def learning(model: str, workdir: str, *runs: str) -> int:
    """The learning check's loop (gateway, rollouts, rewards, one ``Trainer`` step each round) with rank 0's
    ``Trainer`` sharing each update with the other ranks, as ``clawgate train`` does under torchrun; one run per
    ``LR:STEPS`` of ``runs``, one after the other in the same group."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import learning_check

    from trainer import distributed
    from trainer.cli import _serve_rank
    from trainer.config import TrainConfig
    from trainer.step import Trainer

    world = distributed.from_env("cpu", shard="--shard" in runs)
    assert world is not None, "run under torchrun"
    if not world.main:
        return _serve_rank(world, TrainConfig(model=model, database_url="unused"))
    # learning_check.run builds its Trainer by name; this one is rank 0 of the group.
    learning_check.Trainer = lambda config, engine: Trainer(config, engine, world)  # type: ignore[attr-defined]
    try:
        for lr, steps in (r.split(":") for r in runs if r != "--shard"):
            curve = learning_check.run(
                Path(model),
                steps=int(steps),
                lr=float(lr),
                seed=0,
                prompts=8,
                group=8,
                max_tokens=24,
                target_size=50,
                workdir=Path(workdir),
                log=False,
            )
            print(json.dumps(curve), flush=True)
    finally:
        world.send(None)
        distributed.close(world)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["learning"]:
        from trainer.distributed import exit_rank

        exit_rank(learning(*args[1:]))  # as `clawgate train` ends a rank
    if os.environ.get("RANK", "0") != "0":
        i = args.index("--database-url")
        args[i + 1] = "postgresql+psycopg://nobody@127.0.0.1:9/unreachable"
        if os.environ.get("CLAWGATE_TEST_RANK_DIES") and os.environ.get("RANK") == "1":
            from trainer.distributed import World

            def die(self: World, policy: object) -> None:
                os._exit(int(os.environ["CLAWGATE_TEST_RANK_DIES"]))

            World.share_weights = die  # type: ignore[method-assign]
    from clawgate.cli import main

    sys.exit(main(args))
