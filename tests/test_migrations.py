"""Alembic migrations on SQLite and Postgres: up, down and up again, and a schema identical to the models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from gateway.store import db
from gateway.store.models import Base
from tests import pg

TABLES = {
    "rollouts",
    "calls",
    "rewards",
    "policy_versions",
    "train_steps",
    "trained_rollouts",
    "judgements",
    "trained_turns",
    "policy_control",
    "stored_responses",
    "gateway_adapters",
    "promotion_decisions",
    "secret_findings",
    "exports",
    "export_rollouts",
    "tenants",
    "api_keys",
    "quota_usage",
    "counterfactual_groups",
    "counterfactuals",
}


def _schema_diff(url: str) -> list[object]:
    engine = db.connect(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = db.connect(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _up_down_up(url: str) -> None:
    assert db.current_revision(url) is None
    db.upgrade(url)
    head = db.head_revision()
    assert head is not None and db.current_revision(url) == head
    assert _tables(url) == TABLES | {"alembic_version"}
    assert _schema_diff(url) == []

    db.downgrade(url, "base")
    assert db.current_revision(url) is None
    assert _tables(url) == {"alembic_version"}

    db.upgrade(url)
    assert db.current_revision(url) == head
    assert _schema_diff(url) == []


def test_sqlite_upgrade_downgrade_upgrade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # From an unrelated working directory: the migrations are found next to the package, not through cwd.
    monkeypatch.chdir(tmp_path)
    _up_down_up(f"sqlite:///{tmp_path / 'clawgate.db'}")


@pytest.fixture
def postgres_database(postgres_server_url: str) -> Iterator[str]:
    with pg.fresh_database(postgres_server_url) as url:
        yield url


@pytest.mark.postgres
def test_postgres_upgrade_downgrade_upgrade(postgres_database: str) -> None:
    _up_down_up(postgres_database)


@pytest.mark.postgres
def test_postgres_plain_url_with_percent_in_password(postgres_database: str) -> None:
    # A plain postgresql:// URL goes to psycopg 3, and an encoded password's '%' survives Alembic's config
    # interpolation (the test server trusts local connections, so any password is accepted).
    url = sa.engine.make_url(postgres_database).set(drivername="postgresql", password="p%ss@w0rd")
    plain = url.render_as_string(hide_password=False)
    assert plain.startswith("postgresql://") and "%25" in plain
    db.upgrade(plain)
    assert db.current_revision(plain) == db.head_revision()


def test_normalize_url() -> None:
    assert db.normalize_url("postgresql://u:p@h:5432/d") == "postgresql+psycopg://u:p@h:5432/d"
    assert db.normalize_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"
    assert db.normalize_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert db.normalize_url("sqlite:///x.db") == "sqlite:///x.db"


def test_sqlite_engine_settings(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    engine = db.connect(url, busy_timeout_ms=1234)
    try:
        with engine.connect() as connection:
            pragma = connection.exec_driver_sql
            assert pragma("PRAGMA journal_mode").scalar() == "wal"
            assert pragma("PRAGMA busy_timeout").scalar() == 1234
            assert pragma("PRAGMA foreign_keys").scalar() == 1
        # Foreign keys are enforced: a call of a rollout that does not exist is refused.
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as connection:
            connection.exec_driver_sql(
                "INSERT INTO calls (id, request_id, choice_index, rollout_id, api, model, engine, status,"
                " render_mode, request, prompt_delta, prompt_len, completion_ids, completion_logprobs,"
                " completion_len, started_at, ended_at) VALUES ('c', 'r', 0, 'missing', 'chat', 'm', 'local',"
                " 'ok', 'fresh', x'', x'', 0, x'', x'', 0, '2025-01-01', '2025-01-01')"
            )
        # SAVEPOINTs work (the writer's row-by-row retry relies on them).
        with engine.begin() as connection:
            connection.exec_driver_sql(
                "INSERT INTO rollouts (id, kind, created_at, updated_at) VALUES"
                " ('a', 'implicit', '2025-01-01', '2025-01-01')"
            )
            with pytest.raises(sa.exc.IntegrityError), connection.begin_nested():
                connection.exec_driver_sql(
                    "INSERT INTO rollouts (id, kind, created_at, updated_at) VALUES"
                    " ('a', 'implicit', '2025-01-01', '2025-01-01')"
                )
            connection.exec_driver_sql(
                "INSERT INTO rollouts (id, kind, created_at, updated_at) VALUES"
                " ('b', 'implicit', '2025-01-01', '2025-01-01')"
            )
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT id FROM rollouts ORDER BY id").scalars().all() == ["a", "b"]
    finally:
        engine.dispose()


def test_each_revision_steps_up_and_down(sqlite_url_bare: str) -> None:
    """Every migration downgrades to exactly the schema of the revision before it."""
    db.upgrade(sqlite_url_bare, "0001")
    assert _tables(sqlite_url_bare) == {"rollouts", "calls", "rewards", "policy_versions", "alembic_version"}
    db.upgrade(sqlite_url_bare)
    db.downgrade(sqlite_url_bare, "0001")
    assert "train_steps" not in _tables(sqlite_url_bare) and db.current_revision(sqlite_url_bare) == "0001"


@pytest.fixture
def sqlite_url_bare(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'steps.db'}"


def _call_columns(url: str) -> set[str]:
    engine = db.connect(url)
    try:
        return {c["name"] for c in sa.inspect(engine).get_columns("calls")}
    finally:
        engine.dispose()


def test_0009_marks_existing_calls_unconstrained_and_downgrades(sqlite_url_bare: str) -> None:
    """A call stored before 0009 reads as sampled without a grammar; the downgrade removes the column again."""
    url = sqlite_url_bare
    db.upgrade(url, "0008")
    assert "constrained" not in _call_columns(url)
    engine = db.connect(url)
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql(
                "INSERT INTO rollouts (id, kind, created_at, updated_at) VALUES"
                " ('r', 'implicit', '2025-01-01', '2025-01-01')"
            )
            connection.exec_driver_sql(
                "INSERT INTO calls (id, request_id, choice_index, rollout_id, api, model, engine, status,"
                " render_mode, request, prompt_delta, prompt_len, completion_ids, completion_logprobs,"
                " completion_len, started_at, ended_at) VALUES ('old', 'r', 0, 'r', 'chat', 'm', 'local',"
                " 'ok', 'fresh', x'', x'', 0, x'', x'', 0, '2025-01-01', '2025-01-01')"
            )
    finally:
        engine.dispose()
    db.upgrade(url, "0009")
    engine = db.connect(url)
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT constrained FROM calls WHERE id = 'old'").scalar() == 0
    finally:
        engine.dispose()
    db.downgrade(url, "0008")
    assert "constrained" not in _call_columns(url) and db.current_revision(url) == "0008"
    engine = db.connect(url)
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT id FROM calls").scalars().all() == ["old"]
    finally:
        engine.dispose()
