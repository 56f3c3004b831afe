"""Logging for every clawgate process: one line format, at the level the settings give, chatty libraries quieted."""

from __future__ import annotations

import logging


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: one line per engine call would drown everything else; alembic a dozen lines
    # of plugin set-up each time the schema version is checked.
    for name in ("httpx", "alembic"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
