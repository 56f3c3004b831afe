"""Postgres for tests: find (or start) a server, and give each test a database of its own.

``postgres_server(env_url)`` yields a server URL: ``env_url`` when given (the conftest passes
``CLAWGATE_TEST_POSTGRES_URL``), else the local default server when it answers, else a throw-away cluster made
with ``initdb``/``pg_ctl`` in a temporary directory on a free port, stopped and removed on exit.
``fresh_database(server_url)`` creates ``clawgate_test_<random>`` on that server, yields its URL and drops it,
so tests never see each other's tables.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from sqlalchemy.engine import URL, make_url

from gateway.store.db import normalize_url

DEFAULT_SERVER_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _libpq_url(url: str | URL) -> str:
    """The URL as libpq reads it (no SQLAlchemy driver suffix)."""
    return (
        make_url(str(url) if isinstance(url, URL) else url)
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )


def answers(url: str, timeout_s: int = 2) -> bool:
    try:
        with psycopg.connect(_libpq_url(url), connect_timeout=timeout_s):
            return True
    except psycopg.Error:
        return False


def postgres_url(env_url: str | None) -> str:
    """A reachable server URL; a throw-away cluster started here is stopped when the process exits."""
    if env_url:
        return normalize_url(env_url)
    if answers(DEFAULT_SERVER_URL):
        return DEFAULT_SERVER_URL
    cluster = ThrowawayCluster()
    atexit.register(cluster.stop)
    return cluster.start()


@contextlib.contextmanager
def postgres_server(env_url: str | None) -> Iterator[str]:
    """Like ``postgres_url``, but a throw-away cluster is stopped when the block ends."""
    if env_url:
        yield normalize_url(env_url)
        return
    if answers(DEFAULT_SERVER_URL):
        yield DEFAULT_SERVER_URL
        return
    cluster = ThrowawayCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def database_url(server_url: str, name: str) -> str:
    return make_url(normalize_url(server_url)).set(database=name).render_as_string(hide_password=False)


def create_database(server_url: str, name: str) -> None:
    with psycopg.connect(_libpq_url(server_url), autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')


def drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(_libpq_url(server_url), autocommit=True) as connection:
        # FORCE (Postgres 13+) ends sessions a failed test left open.
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def unique_database_name() -> str:
    return f"clawgate_test_{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server for the duration of the block."""
    name = unique_database_name()
    create_database(server_url, name)
    try:
        yield database_url(server_url, name)
    finally:
        drop_database(server_url, name)


def _find_bin(name: str) -> str:
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key)
    if candidates:
        return candidates[-1]
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"no Postgres server answers and {name} is not installed")
    return found


def _version_key(path: str) -> tuple[int, ...]:
    version = Path(path).parents[1].name
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayCluster:
    """A private Postgres cluster in a temporary directory (trust auth, fsync off: test data only)."""

    def __init__(self) -> None:
        self._dir: Path | None = None
        self._started = False
        self._prefix: list[str] = []
        self._options = ""

    def start(self) -> str:
        self._dir = Path(tempfile.mkdtemp(prefix="clawgate-pg-"))
        data = self._dir / "data"
        port = _free_port()
        if os.geteuid() == 0:
            # initdb refuses to run as root; run the server as the packaged `postgres` user.
            user = pwd.getpwnam("postgres")
            os.chown(self._dir, user.pw_uid, user.pw_gid)
            self._prefix = ["runuser", "-u", "postgres", "--"]
        self._run(_find_bin("initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        self._options = f"-p {port} -k {self._dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self.resume()
        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    def pause(self) -> None:
        """Stop the server (its data stays): connections are cut and new ones refused until ``resume``."""
        assert self._dir is not None and self._started
        self._run(_find_bin("pg_ctl"), "-D", str(self._dir / "data"), "-m", "fast", "-w", "-t", "60", "stop")
        self._started = False

    def resume(self) -> None:
        """Start the server on its data directory and port."""
        assert self._dir is not None and not self._started
        data, log = self._dir / "data", self._dir / "server.log"
        self._run(_find_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-o", self._options, "-w", "-t", "60", "start")
        self._started = True

    def stop(self) -> None:
        if self._dir is None:
            return
        if self._started:
            with contextlib.suppress(subprocess.CalledProcessError):
                self._run(_find_bin("pg_ctl"), "-D", str(self._dir / "data"), "-m", "immediate", "-w", "stop")
            self._started = False
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def _run(self, *args: str) -> None:
        subprocess.run([*self._prefix, *args], check=True, capture_output=True, timeout=120)
