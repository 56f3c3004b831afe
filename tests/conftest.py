"""Shared fixtures: the tiny model (built once per test session), databases, and a live gateway server."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gateway.app import build_app
from gateway.settings import Settings
from gateway.store import db
from tests.missing import missing

# Test files that take minutes, slowest first (per-file time in CI on the 2-core machine kind): collected first, so
# the two xdist processes (./dev test hands files out in collection order) start on them and end together, instead of
# one process running a long file alone at the end while the other has finished.
SLOW_FIRST = (
    "tests/test_runtime_learning.py",  # ~830 s
    "tests/test_learning.py",  # ~400 s
    "tests/test_online_learning.py",  # ~320 s
    "tests/test_gateway_vllm.py",  # ~300 s
    "tests/test_vllm_replicas.py",  # ~230 s
    "tests/test_image.py",  # 50 s with its layer cache, 6 min without
    "tests/test_distributed_train.py",  # ~240 s
    "tests/test_engine_vllm.py",
    "tests/test_claude_code_e2e.py",
    "tests/test_trainer_daemon.py",
    "tests/test_crash.py",
    "tests/test_turn_training.py",
    "tests/test_outage.py",
    "tests/test_structured.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def _hypothesis_profiles() -> None:
    """Property tests print the seed that reproduces a failure; CI (and ./dev test) runs a fixed, derandomized
    profile, so a red run is reproducible and a green one is not luck."""
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
    settings.register_profile("dev", print_blob=True)
    settings.load_profile("ci" if os.environ.get("CI") or os.environ.get("CLAWGATE_TEST_STRICT") else "dev")


_hypothesis_profiles()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clawgate.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "tiny-model"
    build_tiny_model(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    return url


@dataclass
class LiveGateway:
    url: str  # base URL, e.g. http://127.0.0.1:PORT
    app: Any
    server: uvicorn.Server
    settings: Settings

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def state(self) -> Any:
        return self.app.state.clawgate

    def flush(self) -> None:
        """Wait until every captured call is committed."""
        import asyncio

        fut = asyncio.run_coroutine_threadsafe(self.state.writer.flush(), self.loop)
        fut.result(timeout=30)

    loop: Any = None


def start_gateway(settings: Settings, engine: Any = None, tokenizer: Any = None) -> LiveGateway:
    app = build_app(settings, engine=engine, tokenizer=tokenizer)
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    gw = LiveGateway(url=f"http://127.0.0.1:{settings.port}", app=app, server=server, settings=settings)

    def run() -> None:
        import asyncio

        loop = asyncio.new_event_loop()
        gw.loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=run, daemon=True, name="gateway")
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway failed to start")
        time.sleep(0.02)
    gw._thread = thread  # type: ignore[attr-defined]
    return gw


def stop_gateway(gw: LiveGateway) -> None:
    gw.server.should_exit = True
    gw._thread.join(timeout=60)  # type: ignore[attr-defined]


@pytest.fixture
def gateway_factory(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Any]:
    """Start gateways with given settings overrides; all are stopped at the end of the test."""
    started: list[LiveGateway] = []

    def make(engine: Any = None, tokenizer: Any = None, **overrides: Any) -> LiveGateway:
        url = overrides.pop("database_url", None)
        if url is None:
            url = f"sqlite:///{tmp_path / f'gw{len(started)}.db'}"
            db.upgrade(url)
        values: dict[str, Any] = {
            "model": str(tiny_model_dir),
            "served_model_name": "tiny",
            "database_url": url,
            "port": free_port(),
            "data_dir": tmp_path / f"data{len(started)}",
            "max_tokens": 64,
        }
        values.update(overrides)
        if isinstance(engine, str):  # an engine kind for Settings, not an engine object
            values["engine"], engine = engine, None
        gw = start_gateway(Settings(**values), engine=engine, tokenizer=tokenizer)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        stop_gateway(gw)


@pytest.fixture(scope="module")
def shared_gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LiveGateway]:
    """One local-engine gateway for a whole test module (the model loads once)."""
    yield from module_gateway(tmp_path_factory.mktemp("gw"), tiny_model_dir, max_tokens=48)


@pytest.fixture(scope="module")
def any_model_gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LiveGateway]:
    """The real tiny model accepting any model name (harnesses send their own), with a small generation cap
    (harness prompts are long)."""
    yield from module_gateway(tmp_path_factory.mktemp("gw-any"), tiny_model_dir, model_aliases=["*"], max_tokens=8)


def module_gateway(tmp: Path, model_dir: Path, **overrides: Any) -> Iterator[LiveGateway]:
    """A local-engine gateway on a fresh SQLite file in ``tmp``, stopped when the generator closes."""
    url = f"sqlite:///{tmp / 'clawgate.db'}"
    db.upgrade(url)
    settings = Settings(
        model=str(model_dir),
        served_model_name="tiny",
        database_url=url,
        port=free_port(),
        data_dir=tmp / "data",
        **overrides,
    )
    gw = start_gateway(settings)
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """A PostgreSQL server: CLAWGATE_TEST_POSTGRES_URL, else 127.0.0.1:5432, else a throw-away cluster."""
    from tests import pg

    with pg.postgres_server(os.environ.get("CLAWGATE_TEST_POSTGRES_URL")) as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, migrated database on the test server, dropped afterwards."""
    from tests import pg

    with pg.fresh_database(postgres_server_url) as url:
        db.upgrade(url)
        yield url


VLLM_MAX_MODEL_LEN = 4096


@pytest.fixture(scope="session")
def vllm_python() -> str:
    from gateway.engines.vllm_server import find_vllm_python

    python = find_vllm_python(os.environ.get("CLAWGATE_TEST_VLLM_PYTHON"))
    if python is None or not Path(python).exists():
        missing("no vLLM interpreter: set CLAWGATE_TEST_VLLM_PYTHON or run ./dev setup-vllm")
    return python


@pytest.fixture(scope="session")
def vllm_server(vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One vLLM CPU server on the tiny model for the whole test session (~30 s to start)."""
    from gateway.engines.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = VLLMServer(
        vllm_python,
        tiny_model_dir,
        served_model_name="tiny",
        max_model_len=VLLM_MAX_MODEL_LEN,
        dtype="float32",
        log_path=log,
    )
    server.start(timeout=240)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh migrated database: SQLite, then PostgreSQL (the same test runs on both)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        db.upgrade(url)
        yield url
    else:
        yield request.getfixturevalue("postgres_url")


@pytest.fixture
def sandboxes(tmp_path: Path) -> Iterator[Any]:
    """The task runner's bubblewrap sandboxes, under the test's temporary folder (bubblewrap required)."""
    from runner.sandbox import SandboxFactory
    from tests.runner_support import require_bwrap

    require_bwrap()
    factory = SandboxFactory("bwrap", base_dir=tmp_path / "sandboxes")
    yield factory
    factory.close()
