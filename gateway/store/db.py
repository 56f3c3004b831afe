"""Database engines and schema migrations, for SQLite (embedded default) and Postgres (production).

``connect`` sets up each backend for a writer thread next to readers: SQLite gets WAL, a busy timeout,
foreign keys and real transactions (so SAVEPOINT works, which the capture writer's row-by-row retry needs);
Postgres goes through psycopg 3 with pre-ping. The migration helpers drive Alembic from code with a Config
built here, so they work from any working directory and from an installed package; Alembic is the only thing
that creates or changes the schema.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

DEFAULT_BUSY_TIMEOUT_MS = 5000
DEFAULT_CONNECT_TIMEOUT_S = 10


def normalize_url(url: str) -> str:
    """Route plain ``postgresql://`` and ``postgres://`` URLs to the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def connect(
    url: str,
    *,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S,
    **kwargs: Any,
) -> sa.Engine:
    """An engine for ``url``; extra keyword arguments go to ``sqlalchemy.create_engine``."""
    parsed = make_url(normalize_url(url))
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        connect_args = {
            "check_same_thread": False,
            "timeout": busy_timeout_ms / 1000,  # the driver's own busy timeout (default 5 s) applies until then
            **kwargs.pop("connect_args", {}),
        }
        engine = sa.create_engine(parsed, connect_args=connect_args, **kwargs)
        _configure_sqlite(engine, busy_timeout_ms)
        return engine
    if backend == "postgresql":
        connect_args = dict(kwargs.pop("connect_args", {}))
        if "connect_timeout" not in parsed.query:
            # Without it an unreachable host blocks a connect for the OS TCP timeout (minutes).
            connect_args.setdefault("connect_timeout", connect_timeout_s)
        kwargs.setdefault("pool_pre_ping", True)
        return sa.create_engine(parsed, connect_args=connect_args, **kwargs)
    return sa.create_engine(parsed, **kwargs)


def _configure_sqlite(engine: sa.Engine, busy_timeout_ms: int) -> None:
    def on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        # pysqlite's own transaction handling defers BEGIN and breaks SAVEPOINT; take over (the documented
        # SQLAlchemy recipe): autocommit at the driver level, BEGIN emitted on the "begin" event below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching to WAL needs a lock another process may hold.
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer thread, nor it them
            cursor.execute("PRAGMA synchronous=NORMAL")  # WAL-safe; fsync at checkpoints, not per commit
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    def on_begin(connection: sa.Connection) -> None:
        # IMMEDIATE: take the write lock up front. A deferred transaction that reads and then writes while another
        # connection writes gets SQLITE_BUSY at once (the busy timeout cannot help a lock upgrade), which failed
        # concurrent reward/finish requests beside the capture writer.
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    sa.event.listen(engine, "connect", on_connect)
    sa.event.listen(engine, "begin", on_begin)


def migrations_dir() -> Path:
    """The ``migrations`` package directory (source checkout or installed)."""
    # Installed or checked out, `migrations` sits next to `gateway`; the import lookup covers layouts where it
    # does not (say, an editable install mapping packages to different places).
    beside = Path(__file__).resolve().parents[2] / "migrations"
    if (beside / "env.py").is_file():
        return beside
    return Path(str(importlib.resources.files("migrations")))


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Config values go through ConfigParser interpolation: a URL-encoded password's '%' must be doubled.
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(url: str) -> str | None:
    """The revision the database is at (None when it was never migrated)."""
    engine = sa.create_engine(normalize_url(url), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
