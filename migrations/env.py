"""Alembic environment: runs clawgate's migrations against the URL the caller put in the Alembic config.

``gateway.store.db`` builds the config in code and sets ``sqlalchemy.url``; a caller holding a connection
already (a test on an in-memory database) can pass it as ``config.attributes["connection"]`` instead. SQLite
gets batch mode, since it cannot ALTER most things in place.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from gateway.store.db import normalize_url
from gateway.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("the Alembic config has no sqlalchemy.url; use gateway.store.db.upgrade(url)")
    return normalize_url(url)


def run_migrations_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = sa.create_engine(_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
