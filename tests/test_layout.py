"""The dependency directions of the README's layout section, checked against the imports of every module.

Each package may import only the project modules listed for it in ``ALLOWED`` (the most specific entry for a
module wins): the pure ``prefix_tree`` nothing of the project, the gateway nothing of the trainer, the reward
worker or the runner, the trainer and the reward worker the gateway only through its store (and the fault log;
their commands also ``gateway.settings`` and ``gateway.logs``, as every process does), and only ``clawgate`` (the
command that assembles the others) everything. Imports inside functions and under ``TYPE_CHECKING`` count too: a
lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("clawgate", "gateway", "prefix_tree", "trainer", "rewards", "runner", "migrations")

# Importer (a package or a module) -> the project modules it may import (each with everything below it).
PROCESS_EDGE = ("gateway.settings", "gateway.logs")
ALLOWED: dict[str, tuple[str, ...]] = {
    "prefix_tree": ("prefix_tree",),
    "gateway": ("gateway", "prefix_tree"),
    "trainer": ("trainer", "prefix_tree", "gateway.store", "gateway.faults"),
    "trainer.cli": ("trainer", "prefix_tree", "gateway.store", "gateway.faults", *PROCESS_EDGE),
    "rewards": ("rewards", "gateway.store", "gateway.faults"),
    "rewards.cli": ("rewards", "gateway.store", "gateway.faults", *PROCESS_EDGE),
    "runner": ("runner",),
    "runner.cli": ("runner", *PROCESS_EDGE),
    "migrations": ("migrations", "gateway.store"),
    "clawgate": PACKAGES,
}
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, module: str) -> list[tuple[int, str]]:
    """Every module ``source`` imports (``from a import b`` counts as ``a.b``: b may be a module), with its line."""
    package = module if module in PACKAGES else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
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
        ("trainer.step", "from gateway.service import GatewayService"),
        ("trainer.loop", "from gateway import rollouts"),
        ("trainer.step", "from gateway.settings import Settings"),
        ("rewards.worker", "from trainer.publish import TrainerLock"),
        ("runner.run", "from gateway.store import db"),
        ("gateway.cli", "from clawgate.tiny_model import build_tiny"),
        ("prefix_tree.build", "import torch"),
        ("prefix_tree.build", "from gateway.store import models"),
        ("prefix_tree.tree", "import sqlalchemy"),
        ("trainer.batch", "from ..gateway import service"),
        ("gateway.render", "def f():\n    import torch\n"),
        ("gateway.end_of_turn", "from transformers import GenerationConfig"),
        ("gateway.app", "from transformers import AutoTokenizer"),
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
        ("gateway.render", "from transformers.utils.chat_template_utils import render_jinja_template"),
    ],
)
def test_an_import_along_the_directions_passes(module: str, source: str) -> None:
    assert violations(source, module) == []
