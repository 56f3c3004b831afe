"""The dependency directions of the README's layout section, checked against the imports of every module, and
where SQL may be written.

Each package may import only the project modules listed for it in ``ALLOWED`` (the most specific entry for a
module wins): the pure ``prefix_tree`` nothing of the project, the gateway nothing of the trainer, the reward
worker or the runner, the trainer and the reward worker the gateway only through its store (and the fault log;
their commands also ``gateway.settings`` and ``gateway.logs``, as every process does), and only ``clawgate`` (the
command that assembles the others) everything; within the gateway, the console no route module (``FORBIDDEN``).
Imports inside functions and under ``TYPE_CHECKING`` count too: a lazy import is still a dependency.

SQL lives in ``gateway/store/``: no module of ``gateway`` (outside the store), ``trainer``, ``rewards``, ``runner`` or
``clawgate`` builds a SQLAlchemy statement, opens a session or imports ``sqlalchemy.orm`` (to be handed one); they
call the store's functions. The rows of ``policy_versions`` have one owner, ``gateway/store/policy_versions.py``:
elsewhere, the store included, ``PolicyVersion`` is only a type (an annotation), never part of a query, a
``session.get`` or a new row. Migrations write schema and are exempt.
"""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("clawgate", "gateway", "prefix_tree", "trainer", "rewards", "runner", "migrations")

# Importer (a package or a module) -> the project modules it may import (each with everything below it).
PROCESS_EDGE = ("gateway.settings", "gateway.logs")
# What a protocol folder (``gateway/protocols/<name>/``) may use besides itself and ``common``: the request core, the
# engine's types, and the request plumbing (errors, ids, request dependencies, the app state).
PROTOCOL_USES = (
    "gateway.protocols.common",
    "gateway.core",
    "gateway.engines.base",
    "gateway.errors",
    "gateway.ids",
    "gateway.deps",
    "gateway.state",
)
ALLOWED: dict[str, tuple[str, ...]] = {
    "prefix_tree": ("prefix_tree",),
    "gateway": ("gateway", "prefix_tree"),
    # Within the gateway, from the bottom up: the store (no HTTP: its errors are its own), the engines (the local
    # engine runs the core's pure detokenizer and stop trimmer in its worker), the request core, the protocols.
    "gateway.store": ("gateway.store", "gateway.faults", "gateway.credentials", "prefix_tree"),
    # Finding credentials in text and redacting them: pure, for the store, the console, the trainer and the judge.
    "gateway.credentials": ("gateway.credentials",),
    "gateway.engines": (
        "gateway.engines",
        "gateway.errors",
        "gateway.end_of_turn",
        "gateway.core.detokenize",
        "gateway.core.stops",
    ),
    "gateway.core": (
        "gateway.core",
        "gateway.engines.base",
        "gateway.engines.grammar",  # a structured output's grammar is checked before any engine work
        "gateway.errors",
        "gateway.ids",
        "gateway.bounded",
        "gateway.end_of_turn",
        "gateway.metrics",
        "gateway.promotion.routing",
        "gateway.store",
        "prefix_tree",
    ),
    "gateway.promotion": ("gateway.promotion", "gateway.metrics", "gateway.settings", "gateway.store"),
    "gateway.protocols.common": PROTOCOL_USES,
    "gateway.protocols.openai": ("gateway.protocols.openai", *PROTOCOL_USES),
    "gateway.protocols.anthropic": ("gateway.protocols.anthropic", *PROTOCOL_USES),
    "gateway.protocols.responses": ("gateway.protocols.responses", *PROTOCOL_USES),
    "trainer": ("trainer", "prefix_tree", "gateway.store", "gateway.faults", "gateway.credentials"),
    "trainer.cli": ("trainer", "prefix_tree", "gateway.store", "gateway.faults", "gateway.credentials", *PROCESS_EDGE),
    # The evaluation gate drives the task runner, a client of the gateway's HTTP API.
    "trainer.eval_gate": ("trainer", "prefix_tree", "gateway.store", "gateway.faults", "runner"),
    "rewards": ("rewards", "gateway.store", "gateway.faults", "gateway.credentials"),
    "rewards.cli": ("rewards", "gateway.store", "gateway.faults", "gateway.credentials", *PROCESS_EDGE),
    "runner": ("runner",),
    "runner.cli": ("runner", *PROCESS_EDGE),
    "migrations": ("migrations", "gateway.store"),
    "clawgate": PACKAGES,
}
# Within an allowed package, what a module still may not import: the console changes the policy through the follower
# (``gateway/policy.py``) and reads through the store, never through a route module or the request core.
FORBIDDEN: dict[str, tuple[str, ...]] = {"gateway.dashboard": ("gateway.api", "gateway.protocols", "gateway.core")}
# The pure tree package's third-party dependencies: no torch, no database, no web framework.
PURE_THIRD_PARTY = {"numpy"}
# A gateway serving through vLLM loads no torch (hundreds of MiB with the CUDA libraries): only the in-process
# engine's modules import it, and transformers' entry points that import it on their own, and model_files for a
# model that has no tokenizer.json.
TORCH_IMPORTS = ("torch", "transformers.AutoTokenizer", "transformers.GenerationConfig", "transformers.AutoModel")
TORCH_ALLOWED = (
    "gateway.engines.local",
    "gateway.engines.local_worker",
    "gateway.engines.kv_batch",
    "gateway.engines.sampling",
    "gateway.model_files",
)


def parse(source: str) -> ast.Module:
    """``ast.parse``; again in a fresh thread if CPython 3.11's AST recursion check misfires (gh-106905: a rare
    ``SystemError: AST constructor recursion depth mismatch`` in a thread whose recursion counter is off, seen once
    in CI after other tests' threads had run in the same worker)."""
    try:
        return ast.parse(source)
    except SystemError:
        parsed: list[ast.Module] = []
        worker = threading.Thread(target=lambda: parsed.append(ast.parse(source)))
        worker.start()
        worker.join()
        return parsed[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def absolute(node: ast.ImportFrom, module: str) -> str:
    """The module a ``from … import`` names, relative imports resolved against ``module``."""
    base = node.module or ""
    if not node.level:
        return base
    package = module if module in PACKAGES else module.rpartition(".")[0]
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*anchor, *([base] if base else [])])


def imported(source: str, module: str) -> list[tuple[int, str]]:
    """Every module ``source`` imports (``from a import b`` counts as ``a.b``: b may be a module), with its line."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.extend((node.lineno, f"{absolute(node, module)}.{alias.name}") for alias in node.names)
    return out


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rule_for(module: str) -> tuple[str, ...]:
    owner = max((key for key in ALLOWED if within(module, key)), key=len)
    return ALLOWED[owner]


def violations(source: str, module: str) -> list[str]:
    allowed = rule_for(module)
    out = []
    for line, name in imported(source, module):
        top = name.split(".")[0]
        if top == "__future__":
            continue
        if top in PACKAGES and not any(within(name, prefix) for prefix in allowed):
            out.append(f"{module}:{line} imports {name}")
        forbidden = [p for key, prefixes in FORBIDDEN.items() if within(module, key) for p in prefixes]
        if any(within(name, prefix) for prefix in forbidden):
            out.append(f"{module}:{line} imports {name} (the console uses no route module and not the request core)")
        third_party = top not in PACKAGES and top not in sys.stdlib_module_names
        if within(module, "prefix_tree") and third_party and top not in PURE_THIRD_PARTY:
            out.append(f"{module}:{line} imports {name} (the tree package is pure)")
        torch_import = name.startswith(TORCH_IMPORTS)
        if within(module, "gateway") and torch_import and not any(within(module, m) for m in TORCH_ALLOWED):
            out.append(f"{module}:{line} imports {name} (a gateway serving through vLLM loads no torch)")
    return out


def project_modules() -> list[Path]:
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    return [p for p in files if "__pycache__" not in p.parts]


def test_every_package_is_checked() -> None:
    top_level = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() or p.name == "migrations"}
    assert top_level - {"tests", "bench"} <= set(PACKAGES), "a new top-level package needs its rule here"
    assert len(project_modules()) > 50


def test_imports_follow_the_documented_directions() -> None:
    found = []
    for path in project_modules():
        found += violations(path.read_text(encoding="utf-8"), module_name(path))
    assert not found, "imports against the layout (README, 'Layout'):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("gateway.api.rollouts", "from trainer.step import Trainer"),
        ("gateway.store.readiness", "def f():\n    import trainer.loop\n"),
        ("gateway.api.system", "from rewards import report"),
        ("trainer.step", "from gateway.core.service import GatewayService"),
        ("trainer.loop", "from gateway import rollouts"),
        ("trainer.step", "from gateway.settings import Settings"),
        ("rewards.worker", "from trainer.publish import TrainerLock"),
        ("runner.run", "from gateway.store import db"),
        ("gateway.cli", "from clawgate.tiny_model import build_tiny"),
        ("prefix_tree.build", "import torch"),
        ("prefix_tree.build", "from gateway.store import models"),
        ("prefix_tree.tree", "import sqlalchemy"),
        ("trainer.batch", "from ..gateway import service"),
        ("gateway.core.render", "def f():\n    import torch\n"),
        ("gateway.end_of_turn", "from transformers import GenerationConfig"),
        ("gateway.app", "from transformers import AutoTokenizer"),
        ("gateway.dashboard.routes", "from gateway.api import policy as policy_api"),
        ("gateway.dashboard.routes", "from gateway.protocols.openai.routes import router"),
        ("gateway.dashboard.charts", "from gateway.core.service import ChatService"),
        ("gateway.store.rollout_lifecycle", "from gateway.errors import NotFound"),
        ("gateway.store.writer", "from gateway.metrics import Metrics"),
        ("gateway.core.service", "from gateway.protocols.common.serving import ProtocolServing"),
        ("gateway.core.render", "from gateway.state import State"),
        ("gateway.engines.vllm", "from gateway.core.service import ChatService"),
        ("gateway.protocols.anthropic.serving", "from gateway.protocols.openai.chat import ChatServing"),
        ("gateway.protocols.common.serving", "from gateway.protocols.responses import wire"),
        ("gateway.promotion.promoter", "from gateway.core.service import ChatService"),
    ],
)
def test_an_import_against_the_directions_is_caught(module: str, source: str) -> None:
    assert violations(source, module)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("gateway.api.rollouts", "from gateway.store.training_data import load_rollout"),
        ("gateway.store.training_data", "from prefix_tree import build_tree"),
        ("trainer.step", "from gateway.store import turns"),
        ("trainer.cli", "from gateway.settings import Settings"),
        ("rewards.cli", "from gateway.logs import setup_logging"),
        ("prefix_tree.tree", "import numpy as np\nfrom prefix_tree.nodes import TreeNode\nfrom . import filters"),
        ("clawgate.up", "from trainer.cli import train_flags"),
        ("gateway.engines.local", "import torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer"),
        ("gateway.core.render", "from transformers.utils.chat_template_utils import render_jinja_template"),
        ("gateway.dashboard.routes", "from gateway.policy import apply_change\nfrom gateway.state import State"),
        ("gateway.protocols.anthropic.serving", "from gateway.protocols.common.blocks import Blocks"),
        ("gateway.protocols.openai.chat", "from gateway.core.service import ChatService"),
        ("gateway.core.service", "from gateway.store.writer import CallWriter"),
        ("gateway.engines.local_worker", "from gateway.core.stops import StopTrimmer"),
        ("gateway.store.errors", "from sqlalchemy import exc"),
    ],
)
def test_an_import_along_the_directions_passes(module: str, source: str) -> None:
    assert violations(source, module) == []


# -- SQL lives in the store ------------------------------------------------------------------------------------

SQL_FREE = ("gateway", "trainer", "rewards", "runner", "clawgate")
STORE = "gateway.store"
# What builds a statement: sqlalchemy's constructors (top level, ``sqlalchemy.sql`` or a dialect's ``insert``) and
# every ``func.*``; what opens a session: the session factories; what takes one: ``sqlalchemy.orm``. Calls are
# resolved through the module's imports, so an aiohttp ``session.get`` or the runner's own ``select`` is not SQL.
QUERY_CONSTRUCTORS = {"select", "update", "delete", "insert", "text", "exists"}
SESSION_FACTORIES = {"Session", "sessionmaker", "scoped_session"}
ORM = "sqlalchemy.orm"
# The table class (``gateway.store`` re-exports it) and the one module that may use it in a query.
VERSION_CLASS = {"gateway.store.models.PolicyVersion", "gateway.store.PolicyVersion"}
VERSION_OWNER = "gateway.store.policy_versions"


def bindings(tree: ast.Module, module: str) -> dict[str, str]:
    """Each name the module's imports bind, as the dotted path it stands for (``sa`` -> ``sqlalchemy``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                head = alias.name.split(".")[0]
                out[alias.asname or head] = alias.name if alias.asname else head
        elif isinstance(node, ast.ImportFrom):
            out.update((alias.asname or alias.name, f"{absolute(node, module)}.{alias.name}") for alias in node.names)
    return out


def resolve(node: ast.AST, names: dict[str, str]) -> str | None:
    """What a name or an attribute chain on an imported name stands for (``sa.func.max`` -> ``sqlalchemy.func.max``);
    None for anything else (a local variable, ``self._session.get``)."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id], *attrs])


def sql_outside_store(source: str, module: str) -> list[str]:
    """The statements built and sessions opened by ``module``, unless it is the store (or outside ``SQL_FREE``)."""
    if within(module, STORE) or not any(within(module, package) for package in SQL_FREE):
        return []
    tree = parse(source)
    names = bindings(tree, module)
    # A function handed a session (``session.get(Call, …)``) runs SQL as surely as one that opens it.
    out = [
        f"{module}:{line} imports {name} (sessions belong in the store)"
        for line, name in imported(source, module)
        if within(name, ORM)
    ]
    for node in ast.walk(tree):
        target = resolve(node.func, names) if isinstance(node, ast.Call) else None
        if target is None or not within(target, "sqlalchemy"):
            continue
        *path, name = target.split(".")
        if "func" in path or name in QUERY_CONSTRUCTORS:
            out.append(f"{module}:{node.lineno} builds a statement ({target})")
        elif name in SESSION_FACTORIES:
            out.append(f"{module}:{node.lineno} opens a session ({target})")
    return out


def annotation_nodes(tree: ast.Module) -> set[int]:
    """The ids of every node inside an annotation (a parameter's, a return's, a variable's)."""
    roots: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            roots += [arg.annotation for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if arg]
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(n) for root in roots if root is not None for n in ast.walk(root)}


def version_queries(source: str, module: str) -> list[str]:
    """Where ``module`` uses ``PolicyVersion`` (the class or its columns) as a value — in a query, a ``session.get``,
    a new row — rather than as a type; the owner module may."""
    if module == VERSION_OWNER or within(module, "migrations"):
        return []
    tree = parse(source)
    names = bindings(tree, module)
    types = annotation_nodes(tree)
    return [
        f"{module}:{node.lineno} uses PolicyVersion in a query (only {VERSION_OWNER} may)"
        for node in ast.walk(tree)
        if isinstance(node, ast.Name | ast.Attribute)
        and id(node) not in types
        and resolve(node, names) in VERSION_CLASS
    ]


def test_sql_lives_in_the_store() -> None:
    found = []
    for path in project_modules():
        found += sql_outside_store(path.read_text(encoding="utf-8"), module_name(path))
    assert not found, "SQL outside gateway/store (call a store function instead):\n" + "\n".join(found)


def test_only_the_owner_queries_policy_versions() -> None:
    found = []
    for path in project_modules():
        found += version_queries(path.read_text(encoding="utf-8"), module_name(path))
    assert not found, "queries on policy_versions outside its owner:\n" + "\n".join(found)


def owner_source() -> str:
    return (ROOT / "gateway" / "store" / "policy_versions.py").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("gateway.policy", "import sqlalchemy as sa\ndef f(db):\n    return sa.select(1)\n"),
        ("trainer.loop", "from sqlalchemy import update\nupdate(T).values(x=1)\n"),
        ("rewards.report", "from sqlalchemy import func as f\nf.count()\n"),
        ("trainer.publish", "import sqlalchemy as sa\nq = sa.func.max(T.version)\n"),
        ("runner.report", "from sqlalchemy import text\ntext('select 1')\n"),
        ("rewards.worker", "from sqlalchemy.dialects import postgresql\npostgresql.insert(t)\n"),
        (
            "gateway.policy",
            "from sqlalchemy.orm import Session\ndef f(db):\n    with Session(db) as s:\n        pass\n",
        ),
        ("rewards.worker", "def f(db):\n    import sqlalchemy.orm\n    return sqlalchemy.orm.Session(db)\n"),
        ("clawgate.up", "from sqlalchemy import orm\nmake = orm.sessionmaker(db)\n"),
        (
            "rewards.turns",
            "from sqlalchemy.orm import Session\ndef load(session: Session, i):\n    return session.get(C, i)\n",
        ),
        ("gateway.api.policy", "import sqlalchemy as sa\nclass A:\n    def f(self):\n        return sa.delete(T)\n"),
        ("gateway.policy", None),  # the owner's real source, were it outside the store
    ],
)
def test_sql_outside_the_store_is_caught(module: str, source: str | None) -> None:
    assert sql_outside_store(source or owner_source(), module)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (
            "gateway.engines.vllm",
            "async def f(self, url):\n    async with self._session.get(url) as r:\n        return r\n",
        ),
        ("runner.cli", "from runner.tasks import select\nselect(tasks, tags)\n"),
        ("gateway.app", "from sqlalchemy import exc as sa_exc\ntry:\n    pass\nexcept sa_exc.DBAPIError:\n    pass\n"),
        ("trainer.step", "import sqlalchemy as sa\ndef f(db: sa.Engine) -> None:\n    readiness(db)\n"),
        ("rewards.worker", "from gateway.store import judgements\njudgements.release(db, 'c', 't')\n"),
        ("gateway.store.promotion", "import sqlalchemy as sa\nsa.update(T)\n"),
        ("migrations.versions.x", "import sqlalchemy as sa\nsa.text('ALTER TABLE t')\n"),
    ],
)
def test_sql_in_the_store_and_lookalikes_pass(module: str, source: str) -> None:
    assert sql_outside_store(source, module) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (
            "gateway.policy",
            "from gateway.store.models import PolicyVersion\ndef f(s, v):\n    return s.get(PolicyVersion, v)\n",
        ),
        (
            "gateway.store.console",
            "from gateway.store.models import PolicyVersion\nq = sa.select(PolicyVersion.version)\n",
        ),
        (
            "gateway.store.promotion",
            "from gateway.store import models\nq = q.where(models.PolicyVersion.stage == 'x')\n",
        ),
        ("trainer.publish", "from gateway.store import PolicyVersion as PV\nsession.add(PV(version=1))\n"),
        (
            "gateway.store.readiness",
            "def f(s):\n    from .models import PolicyVersion\n    return PolicyVersion.version\n",
        ),
        ("gateway.store.promotion", None),  # the owner's real source, were it another module
    ],
)
def test_a_query_on_policy_versions_outside_its_owner_is_caught(module: str, source: str | None) -> None:
    assert version_queries(source or owner_source(), module)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (
            "gateway.policy",
            "from gateway.store.models import PolicyVersion\ndef f(row: PolicyVersion) -> PolicyVersion | None:\n"
            "    return row\n",
        ),
        (
            "gateway.store.promotion",
            "from gateway.store.models import PolicyVersion\nclass S:\n    x: list[PolicyVersion]\n",
        ),
        ("gateway.promotion.status", "def f(row):\n    return row.stage, row.version\n"),
        ("gateway.store.policy_versions", "from gateway.store.models import PolicyVersion\nsa.select(PolicyVersion)\n"),
    ],
)
def test_policy_versions_as_a_type_passes(module: str, source: str) -> None:
    assert version_queries(source, module) == []


# -- one folder per protocol -----------------------------------------------------------------------------------

PROTOCOLS = ROOT / "gateway" / "protocols"
SERVING_BASE = "ProtocolServing"
ROUTE_MAKER = "add_serving_route"


def protocol_misplacements(source: str, module: str) -> list[str]:
    """Where ``module`` holds a piece of a public protocol (a serving class, a serving route) outside that protocol's
    folder, ``gateway/protocols/<name>/`` (``common`` holds the shared base, not a protocol)."""
    parts = module.split(".")
    if parts[:2] == ["gateway", "protocols"] and len(parts) > 3 and parts[2] != "common":
        return []
    out = []
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if any(b.split("[")[0].rsplit(".", 1)[-1] == SERVING_BASE for b in bases):
                out.append(
                    f"{module}:{node.lineno} defines the serving class {node.name} outside its protocol's folder"
                )
        elif isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] == ROUTE_MAKER:
            out.append(f"{module}:{node.lineno} registers a serving route outside its protocol's folder")
    return out


def test_each_protocol_is_one_folder() -> None:
    folders = sorted(p for p in PROTOCOLS.iterdir() if p.is_dir() and p.name not in ("common", "__pycache__"))
    assert [p.name for p in folders] == ["anthropic", "openai", "responses"]
    for folder in folders:  # its routes, its wire models, its serving, side by side
        names = {p.name for p in folder.glob("*.py")}
        assert {"routes.py", "wire.py"} <= names, folder
        sources = [p.read_text(encoding="utf-8") for p in folder.glob("*.py")]
        assert any(f"({SERVING_BASE}[" in source for source in sources), f"no serving class in {folder}"
    assert not [*(ROOT / "gateway").glob("serving/*.py"), *(ROOT / "gateway").glob("protocol/*.py")]
    found = []
    for path in project_modules():
        found += protocol_misplacements(path.read_text(encoding="utf-8"), module_name(path))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("gateway.api.rollouts", "class S(ProtocolServing[R]):\n    pass\n"),
        ("gateway.protocols.common.serving", "class Chat(base.ProtocolServing[ChatRequest]):\n    pass\n"),
        ("gateway.core.service", "from x import add_serving_route\nadd_serving_route(r, '/v1/x', S, M, name='x')\n"),
        ("gateway.app", "routes.add_serving_route(router, '/v1/y', S, M, name='y')\n"),
    ],
)
def test_a_protocol_piece_outside_its_folder_is_caught(module: str, source: str) -> None:
    assert protocol_misplacements(source, module)


def test_a_protocol_piece_in_its_folder_passes() -> None:
    source = "class Chat(ProtocolServing[ChatRequest]):\n    pass\nadd_serving_route(r, '/v1/c', Chat, M, name='c')\n"
    assert protocol_misplacements(source, "gateway.protocols.openai.chat") == []


# -- settings are typed ----------------------------------------------------------------------------------------


def untyped_settings(source: str, module: str) -> list[str]:
    """Parameters named ``settings`` (or ``*_settings``) typed ``Any`` or ``object``: a way to take the process
    settings where the layout does not allow importing them. Pass the values the code needs instead."""
    out = []
    for node in ast.walk(parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
            named = arg.arg == "settings" or arg.arg.endswith("_settings")
            loose = arg.annotation is not None and ast.unparse(arg.annotation) in ("Any", "typing.Any", "object")
            if named and loose:
                out.append(f"{module}:{node.lineno} {node.name}({arg.arg}: {ast.unparse(arg.annotation)})")  # type: ignore[arg-type]
    return out


def test_settings_parameters_are_typed() -> None:
    found = []
    for path in project_modules():
        found += untyped_settings(path.read_text(encoding="utf-8"), module_name(path))
    assert not found, "settings typed loosely (pass the values instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from typing import Any\ndef build_worker(settings: Any) -> None:\n    pass\n",
        "async def f(db, *, judge_settings: object) -> None:\n    pass\n",
        "class W:\n    def __init__(self, settings: typing.Any):\n        pass\n",
    ],
)
def test_a_loosely_typed_settings_parameter_is_caught(source: str) -> None:
    assert untyped_settings(source, "rewards.worker")


def test_typed_settings_and_other_any_parameters_pass() -> None:
    source = "def f(settings: Settings, config: Any, **extra: Any) -> None:\n    pass\n"
    assert untyped_settings(source, "rewards.cli") == []


def test_the_slow_first_order_names_existing_test_files():
    from tests.conftest import SLOW_FIRST

    assert [name for name in SLOW_FIRST if not (ROOT / name).is_file()] == []
