"""One rank of ``clawgate train`` under torchrun, for tests/test_distributed_train.py.

Ranks other than 0 are given a database URL nothing answers on, so a rank that touched the database would fail the
run. With ``CLAWGATE_TEST_RANK_DIES=CODE``, rank 1 exits with that code when rank 0's first update reaches it (a
non-zero code makes torchrun stop the group; with 0 rank 0 finds the collective broken by itself).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    args = sys.argv[1:]
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
