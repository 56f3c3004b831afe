"""The self-hosting stack (docker-compose.yml, Dockerfile, .env.example) agrees with the code it runs.

No Docker engine is needed. The compose file is read as YAML and its `${VAR}` references are substituted as
compose substitutes them; what each service runs is then checked against clawgate's own pieces: the CLI parser
(`clawgate …` commands), the `Settings` class (every `CLAWGATE_*` variable, production validation), the vLLM
launcher (the flags clawgate starts vLLM with) and the trainer's version layout (the health check's file). A renamed
flag, a misspelt setting or a dropped vLLM option fails here, not at `docker compose up` on a GPU host. Where the
vLLM CPU build is installed, vLLM's own argument parser checks the vLLM command line; where the `docker-compose`
validator is installed (Debian package `docker-compose`), it checks the whole file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from pydantic import ValidationError

from clawgate import cli
from gateway import cli as gateway_cli
from gateway.engines.vllm_server import VLLMServer
from gateway.settings import Settings
from rewards import cli as rewards_cli
from tests.missing import missing
from trainer import cli as trainer_cli

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

CLAWGATE_SERVICES = {"migrate", "trainer", "gateway", "judge"}
# Variables docker compose itself reads from .env (not substituted into the file).
COMPOSE_OWN = {"COMPOSE_PROFILES"}
SECRETS = ("CLAWGATE_ADMIN_KEY", "CLAWGATE_API_KEYS", "POSTGRES_PASSWORD")
ADAPTERS_VOLUME = "adapters"

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}, ${NAME:+alt}, $NAME; $$ is a `$`.
_REFERENCE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(Exception):
    """A `${NAME:?message}` reference whose variable is unset or empty: compose refuses to start."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"] or "", match["arg"] or ""
        value = env.get(name)
        # With a colon the operator treats an empty value as unset, as in the shell.
        present = bool(value) if op.startswith(":") else value is not None
        if op.endswith("-"):
            return value if present and value is not None else arg
        if op.endswith("?"):
            if not present or value is None:
                raise MissingVariable(name, arg)
            return value
        if op.endswith("+"):
            return arg if present else ""
        return value or ""

    return _REFERENCE.sub(substitute, text)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    return node


def references(text: str) -> list[tuple[str, str]]:
    """(variable, operator) for every substitution in ``text``."""
    return [(m["braced"] or m["bare"], m["op"] or "") for m in _REFERENCE.finditer(text) if not m["escaped"]]


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep, f"{path.name}: not NAME=VALUE: {line!r}"
        assert name not in env, f"{path.name}: {name} is set twice"
        env[name.strip()] = value.strip()
    return env


def example_env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


def filled_env(**overrides: str) -> dict[str, str]:
    """``.env.example`` with the secrets filled in as its comments ask (random hex)."""
    env = example_env()
    env["CLAWGATE_ADMIN_KEY"] = secrets.token_hex(32)
    env["CLAWGATE_API_KEYS"] = f"{secrets.token_hex(32)},{secrets.token_hex(32)}"
    env["POSTGRES_PASSWORD"] = secrets.token_hex(24)
    env.update(overrides)
    return env


def raw_compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def compose(env: Mapping[str, str]) -> dict[str, Any]:
    """The compose file with its variables substituted from ``env`` (raises ``MissingVariable``)."""
    data: dict[str, Any] = resolve(raw_compose(), env)
    return data


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    assert isinstance(environment, dict), "environment is written as a mapping"
    return {name: "" if value is None else str(value) for name, value in environment.items()}


def settings_for(service: Mapping[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The Settings a clawgate process builds inside this service's container (its env, nothing from ours)."""
    with monkeypatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("CLAWGATE_"):
                patch.delenv(name)
        for name, value in service_env(service).items():
            patch.setenv(name, value)
        return Settings()


def flag_values(argv: Sequence[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` pairs of an option-only command line."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        assert token.startswith("--"), f"unexpected positional argument {token!r} in {list(argv)}"
        value: str | None
        if "=" in token:
            token, value = token.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = None
            i += 1
        assert token not in flags, f"{token} given twice"
        flags[token] = value
    return flags


def volume_mounts(service: Mapping[str, Any]) -> Iterator[tuple[str, str, bool]]:
    """(source, target, read_only) of each short-syntax volume."""
    for spec in service.get("volumes", []):
        parts = spec.split(":")
        yield parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")


def port_of(url: str) -> int:
    match = re.match(r"^https?://[^/:]+:(\d+)", url)
    assert match, f"no explicit port in {url!r}"
    return int(match.group(1))


# -- what each service runs ------------------------------------------------------------------------------------------


def test_clawgate_services_run_commands_the_cli_accepts() -> None:
    services = compose(filled_env())["services"]
    ours = {name for name, service in services.items() if "build" in service}
    assert ours == CLAWGATE_SERVICES
    parser = cli.build_parser()
    parsed = {}
    for name in CLAWGATE_SERVICES:
        service = services[name]
        # The image's ENTRYPOINT is `clawgate`; a service that replaced it would not run a clawgate command.
        assert "entrypoint" not in service, name
        assert service["image"] == services["gateway"]["image"], "one image for every clawgate service"
        parsed[name] = parser.parse_args(service["command"])

    assert parsed["migrate"].func is gateway_cli.cmd_db
    assert parsed["migrate"].action == "upgrade"
    assert parsed["migrate"].revision is None  # head
    assert parsed["gateway"].func is gateway_cli.cmd_serve
    assert parsed["gateway"].engine == "vllm"
    assert parsed["trainer"].func is trainer_cli.cmd_train
    assert parsed["trainer"].once is False, "the trainer service runs the daemon, not one step"
    assert parsed["judge"].func is rewards_cli.cmd_judge
    assert parsed["judge"].once is False, "the judge service runs the worker, not one pass"
    assert services["judge"]["profiles"] == ["judge"], "the reward worker runs only when asked for"


def test_the_judge_service_and_the_trainer_agree_on_the_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, nobody waits for a judge; set, the trainer waits for the verdicts the judge service records."""
    services = compose(filled_env())["services"]
    trainer, judge = (settings_for(services[name], monkeypatch) for name in ("trainer", "judge"))
    assert trainer.judge_model is None and not trainer.awaits_judge
    assert judge.judge_model is None and not judge.reward_worker_enabled
    assert service_env(services["judge"])["JUDGE_API_KEY"] == "", "no key: a self-hosted judge"

    services = compose(filled_env(CLAWGATE_JUDGE_MODEL="openai/gpt-4o-mini", JUDGE_API_KEY="sk-test"))["services"]
    trainer, judge = (settings_for(services[name], monkeypatch) for name in ("trainer", "judge"))
    assert trainer.awaits_judge and judge.judge_model == trainer.judge_model == "openai/gpt-4o-mini"
    assert judge.judge_api_key_env == "JUDGE_API_KEY"
    assert service_env(services["judge"])["JUDGE_API_KEY"] == "sk-test"
    assert "JUDGE_API_KEY" not in service_env(services["trainer"]), "the judge's key goes to the judge only"


def test_every_clawgate_variable_is_a_setting() -> None:
    names: set[str] = set()
    text = COMPOSE.read_text(encoding="utf-8")
    names |= {name for name, _ in references(text)}
    for service in raw_compose()["services"].values():
        names |= set(service_env(service))
    names |= set(example_env())
    for instruction, args in dockerfile_instructions():
        if instruction == "ENV":
            names |= {item.split("=", 1)[0] for item in shlex.split(args)}
    ours = {name for name in names if name.startswith("CLAWGATE_")}
    # The collection itself works: these are set in all three files.
    assert {"CLAWGATE_TRAIN_LORA_RANK", "CLAWGATE_ADMIN_KEY", "CLAWGATE_ADAPTER_DIR"} <= ours
    unknown = sorted(n for n in ours if n.removeprefix("CLAWGATE_").lower() not in Settings.model_fields)
    assert not unknown, f"not Settings fields (gateway/settings.py): {unknown}"


def test_env_example_gives_valid_settings_for_every_service(monkeypatch: pytest.MonkeyPatch) -> None:
    env = filled_env()
    example = example_env()
    services = compose(env)["services"]
    settings = {name: settings_for(services[name], monkeypatch) for name in CLAWGATE_SERVICES}

    # The gateway builds its settings from env and flags, as `clawgate serve` does.
    with monkeypatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("CLAWGATE_"):
                patch.delenv(name)
        for name, value in service_env(services["gateway"]).items():
            patch.setenv(name, value)
        gateway = gateway_cli.serve_settings(cli.build_parser().parse_args(services["gateway"]["command"]))
    assert gateway.environment == "production" == example["CLAWGATE_ENVIRONMENT"]
    assert gateway.engine == "vllm"
    assert gateway.promotion_mode == "guarded" and gateway.canary_share == 0.1, "a self-hosted stack guards promotion"
    assert gateway.api_keys == env["CLAWGATE_API_KEYS"].split(",")
    assert gateway.admin_key is not None and gateway.admin_key.get_secret_value() == env["CLAWGATE_ADMIN_KEY"]
    assert gateway.host == "0.0.0.0"
    assert gateway.vllm_url.startswith("http://vllm:")
    assert gateway.policy_follow is True
    assert gateway.model_aliases == []

    for name, s in settings.items():
        assert s.database_url == f"postgresql://clawgate:{env['POSTGRES_PASSWORD']}@postgres:5432/clawgate", name
        assert s.model == example["CLAWGATE_MODEL"], name
    trainer = settings["trainer"]
    assert trainer.train_device == "cuda"
    assert trainer.train_lora_rank == int(example["CLAWGATE_TRAIN_LORA_RANK"])
    assert trainer.train_dtype == example["CLAWGATE_TRAIN_DTYPE"]
    assert trainer.train_min_rollouts == int(example["CLAWGATE_TRAIN_MIN_ROLLOUTS"])


def test_secrets_are_required_and_placeholders_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    example = example_env()
    for name in SECRETS:
        assert example[name] == "", f".env.example must not ship a value for {name}"
        with pytest.raises(MissingVariable) as missing:
            compose(filled_env(**{name: ""}))
        assert missing.value.name == name

    # A copied `.env.example` with the secrets left empty does not start.
    with pytest.raises(MissingVariable):
        compose(example)

    # Production mode is what refuses placeholder secrets once compose has passed them.
    for placeholder in ({"CLAWGATE_ADMIN_KEY": "changeme"}, {"CLAWGATE_API_KEYS": "changeme"}):
        gateway = compose(filled_env(**placeholder))["services"]["gateway"]
        with pytest.raises(ValidationError, match=r"CLAWGATE_(ADMIN_KEY|API_KEYS)"):
            settings_for(gateway, monkeypatch)
    development = compose(filled_env(CLAWGATE_ENVIRONMENT="development", CLAWGATE_ADMIN_KEY="changeme"))
    assert settings_for(development["services"]["gateway"], monkeypatch).environment == "development"


def test_every_substitution_is_documented_or_defaulted() -> None:
    example = example_env()
    found = references(COMPOSE.read_text(encoding="utf-8"))
    assert found
    undocumented = sorted({name for name, op in found if op not in ("-", ":-") and name not in example})
    assert not undocumented, f"neither in .env.example nor with a default: {undocumented}"
    unused = sorted(set(example) - {name for name, _ in found} - COMPOSE_OWN)
    assert not unused, f".env.example documents variables docker-compose.yml never reads: {unused}"


# -- start order and health ------------------------------------------------------------------------------------------


def test_services_start_in_dependency_order() -> None:
    services = compose(filled_env())["services"]
    conditions = {
        name: {dep: spec["condition"] for dep, spec in service.get("depends_on", {}).items()}
        for name, service in services.items()
    }
    assert conditions == {
        "postgres": {},
        "vllm": {},
        "migrate": {"postgres": "service_healthy"},
        "trainer": {"migrate": "service_completed_successfully"},
        "judge": {"migrate": "service_completed_successfully"},
        "gateway": {
            "migrate": "service_completed_successfully",
            "vllm": "service_healthy",
            "trainer": "service_healthy",
        },
        "prometheus": {"gateway": "service_healthy"},
        "grafana": {"prometheus": "service_started"},
    }
    for deps in conditions.values():
        for dep, condition in deps.items():
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} is waited on as healthy but has no healthcheck"
    assert services["migrate"]["restart"] == "no", "a one-shot job must not be restarted after it exits 0"


def test_health_checks_probe_what_the_dependents_need(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import lora

    services = compose(filled_env())["services"]
    postgres = services["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in postgres

    vllm_port = flag_values(services["vllm"]["command"])["--port"]
    assert f"http://127.0.0.1:{vllm_port}/health" in " ".join(services["vllm"]["healthcheck"]["test"])

    gateway = settings_for(services["gateway"], monkeypatch)
    assert f"http://127.0.0.1:{gateway.port}/health" in " ".join(services["gateway"]["healthcheck"]["test"])

    # The trainer is healthy once v0 (the zero adapter) is published where the trainer writes versions.
    trainer = settings_for(services["trainer"], monkeypatch)
    v0_manifest = lora.version_path(trainer.adapter_dir, 0) / lora.MANIFEST
    assert services["trainer"]["healthcheck"]["test"] == ["CMD", "test", "-f", str(v0_manifest)]


# -- the shared adapter volume ---------------------------------------------------------------------------------------


def test_adapter_volume_is_one_path_everywhere_and_read_only_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose(filled_env())
    services = data["services"]
    assert ADAPTERS_VOLUME in data["volumes"], "a named volume, not a host folder"
    mounts = {
        name: (target, read_only)
        for name, service in services.items()
        for source, target, read_only in volume_mounts(service)
        if source == ADAPTERS_VOLUME
    }
    assert set(mounts) == {"vllm", "gateway", "trainer"}
    assert len({target for target, _ in mounts.values()}) == 1, mounts
    path = Path(mounts["vllm"][0])
    assert mounts["vllm"][1] is True, "vLLM only reads adapters"
    assert mounts["trainer"][1] is False, "the trainer writes policy versions"

    gateway = settings_for(services["gateway"], monkeypatch)
    trainer = settings_for(services["trainer"], monkeypatch)
    assert trainer.adapter_dir == gateway.adapter_dir == path
    # The path the gateway hands vLLM in POST /v1/load_lora_adapter must exist in vLLM's container.
    assert gateway.vllm_adapter_dir == path


# -- vLLM ------------------------------------------------------------------------------------------------------------


def test_vllm_runs_with_the_flags_clawgate_starts_it_with(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose(filled_env())["services"]
    vllm = services["vllm"]
    flags = flag_values(vllm["command"])
    required = ("--model", "--served-model-name", "--host", "--port", "--dtype", "--max-model-len")
    missing = [f for f in (*required, "--max-lora-rank", "--max-loras") if flags.get(f) is None]
    assert not missing, f"vllm command lacks {missing}"

    # What VLLMServer runs for the same deployment values. Chunked prefill stays on: its flags work around a bug of
    # the CPU build only.
    reference = VLLMServer(
        "python3",
        str(flags["--model"]),
        served_model_name=str(flags["--served-model-name"]),
        host=str(flags["--host"]),
        port=int(str(flags["--port"])),
        dtype=str(flags["--dtype"]),
        max_model_len=int(str(flags["--max-model-len"])),
        max_lora_rank=int(str(flags["--max-lora-rank"])),
        max_loras=int(str(flags["--max-loras"])),
        chunked_prefill=True,
    )
    command = reference.command()
    assert vllm["entrypoint"] == ["python3", *command[1:3]]
    expected = flag_values(command[3:])
    assert "--logprobs-mode" in expected and "--enable-lora" in expected  # the reference is the real launcher's
    absent = "<absent>"
    differing = {
        flag: (value, flags.get(flag, absent)) for flag, value in expected.items() if flags.get(flag, absent) != value
    }
    assert not differing, f"compose's vllm flags differ from VLLMServer's (expected, compose): {differing}"
    lora_updating = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    assert service_env(vllm)[lora_updating] == reference.environment()[lora_updating]

    gateway = settings_for(services["gateway"], monkeypatch)
    assert flags["--host"] == "0.0.0.0", "reachable from the gateway's container"
    assert gateway.vllm_url == f"http://vllm:{flags['--port']}"
    assert port_of(gateway.vllm_url) == int(str(flags["--port"]))
    assert (gateway.vllm_model or gateway.model) == flags["--served-model-name"] == flags["--model"]
    assert [d["capabilities"] for d in vllm["deploy"]["resources"]["reservations"]["devices"]] == [["gpu"]]
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", vllm["image"]), "pinned to a release tag"


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"CLAWGATE_TRAIN_LORA_RANK": "16", "CLAWGATE_POLICY_KEEP_LOADED": "2"},
        {"CLAWGATE_TRAIN_LORA_RANK": "64", "VLLM_MAX_LORAS": "6", "CLAWGATE_POLICY_KEEP_LOADED": "6"},
    ],
)
def test_vllm_lora_capacity_follows_trainer_and_gateway(
    overrides: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for use_compose_defaults in (False, True):
        env = filled_env(**overrides)
        if use_compose_defaults:
            for name in ("CLAWGATE_TRAIN_LORA_RANK", "VLLM_MAX_LORAS", "CLAWGATE_POLICY_KEEP_LOADED"):
                env.pop(name)
        services = compose(env)["services"]
        flags = flag_values(services["vllm"]["command"])
        trainer = settings_for(services["trainer"], monkeypatch)
        gateway = settings_for(services["gateway"], monkeypatch)
        if not use_compose_defaults and "CLAWGATE_TRAIN_LORA_RANK" in overrides:
            assert trainer.train_lora_rank == int(overrides["CLAWGATE_TRAIN_LORA_RANK"])
        assert int(str(flags["--max-lora-rank"])) == trainer.train_lora_rank
        # Every version the gateway keeps loaded must fit in vLLM at once.
        assert int(str(flags["--max-loras"])) >= gateway.policy_keep_loaded


_VLLM_PARSE = """
import json, sys
from vllm import __version__
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
print(json.dumps({
    "version": __version__,
    "enable_lora": args.enable_lora,
    "max_lora_rank": args.max_lora_rank,
    "logprobs_mode": args.logprobs_mode,
    "generation_config": args.generation_config,
    "enable_per_request_metrics": args.enable_per_request_metrics,
}))
"""


@pytest.mark.vllm
def test_vllm_itself_accepts_the_compose_command_line(vllm_python: str) -> None:
    vllm = compose(filled_env())["services"]["vllm"]
    result = subprocess.run(
        [vllm_python, "-c", _VLLM_PARSE, json.dumps(vllm["command"])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed["enable_lora"] is True
    assert parsed["max_lora_rank"] == int(example_env()["CLAWGATE_TRAIN_LORA_RANK"])
    assert parsed["logprobs_mode"] == "processed_logprobs"
    assert parsed["generation_config"] == "vllm"
    assert parsed["enable_per_request_metrics"] is True
    # The image runs the vLLM release these tests (and the vLLM integration tests) run.
    assert vllm["image"].endswith(f":v{parsed['version']}")


# -- the image -------------------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        instruction, _, args = pending.partition(" ")
        instructions.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.removeprefix("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        patterns.append((negated, re.compile(regex.replace(r"\?", "[^/]"))))
    return patterns


def excluded_from_build(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    decision = False
    for negated, pattern in _dockerignore_patterns():
        if any(pattern.fullmatch(candidate) for candidate in candidates):
            decision = not negated
    return decision


def test_dockerfile_runs_clawgate_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    # Users build on python:3.11-slim; BASE_IMAGE lets the test suite build on a local image (tests/test_image.py).
    assert instructions[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    assert [instruction for instruction, _ in instructions].count("FROM") == 1
    entrypoints = [json.loads(args) for instruction, args in instructions if instruction == "ENTRYPOINT"]
    assert entrypoints == [["clawgate"]]
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users and users[-1] not in ("root", "0"), "the last USER is who runs clawgate"

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    target = pyproject["project"]["scripts"]["clawgate"]
    module, _, function = target.partition(":")
    assert (module, function) == ("clawgate.cli", "main")
    assert cli.main.__module__ == module

    # The default command is one the CLI knows.
    cmd = [json.loads(args) for instruction, args in instructions if instruction == "CMD"]
    assert len(cmd) == 1
    assert callable(cli.build_parser().parse_args(cmd[0]).func)


def test_dockerfile_installs_torch_and_dependencies_before_the_source() -> None:
    instructions = dockerfile_instructions()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    train_extra = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["train"]]
    torch_wanted = next(r for r in train_extra if r.name == "torch")

    args_declared = dict(
        item.split("=", 1) for instruction, args in instructions if instruction == "ARG" for item in shlex.split(args)
    )
    torch_arg = Requirement(args_declared["TORCH_REQUIREMENT"])
    assert torch_arg.name == "torch" and torch_arg.specifier == torch_wanted.specifier, "same bounds as pyproject"

    def index(predicate: Any) -> int:
        found = [i for i, (instruction, args) in enumerate(instructions) if predicate(instruction, args)]
        assert found
        return found[0]

    torch_step = index(lambda i, a: i == "RUN" and "pip install" in a and "${TORCH_REQUIREMENT}" in a)
    deps_step = index(lambda i, a: i == "RUN" and "optional-dependencies" in a and "'train'" in a and "'judge'" in a)
    pyproject_copy = index(lambda i, a: i == "COPY" and a.split()[0] == "pyproject.toml")
    source_copy = index(lambda i, a: i == "COPY" and a.split()[0] in ("gateway", "trainer", "migrations"))
    project_step = index(lambda i, a: i == "RUN" and 'pip install ".[train,judge]"' in a)
    assert torch_step < pyproject_copy < deps_step < source_copy < project_step

    # Everything the Dockerfile copies is in the build context, and secrets and local state are not.
    sources = [args.split()[0] for instruction, args in instructions if instruction == "COPY"]
    assert {"pyproject.toml", "README.md", "gateway", "trainer", "migrations"} <= set(sources)
    for source in sources:
        assert not excluded_from_build(source), f".dockerignore leaves out {source}, which the Dockerfile copies"
    assert not excluded_from_build("gateway/cli.py")
    assert not excluded_from_build("migrations/alembic.ini")
    for private in (".env", ".venv/bin/python", "adapters/policy@v1/manifest.json", "clawgate.db", ".git/HEAD"):
        assert excluded_from_build(private), f"{private} would be sent to the image build"
    assert excluded_from_build("gateway/__pycache__/cli.cpython-311.pyc")


def test_image_holds_every_package_the_cli_imports() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    installed = {
        pattern.removesuffix("*")
        for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
        if "." not in pattern.removesuffix("*")
    }
    cli.build_parser()  # imports what every `clawgate` command needs (subcommands register themselves)
    # The project's own top-level packages: folders of the checkout (site-packages of .venv are not).
    imported = {
        name
        for name, module in list(sys.modules.items())
        if "." not in name and Path(getattr(module, "__file__", None) or "/").resolve() == ROOT / name / "__init__.py"
    }
    imported.discard("tests")
    assert "gateway" in imported
    assert imported <= installed, f"imported by the CLI but not installed by pyproject: {imported - installed}"

    copied = {args.split()[0] for instruction, args in dockerfile_instructions() if instruction == "COPY"}
    for package in installed:
        assert package in copied, f"pyproject installs {package}, which the Dockerfile does not copy"
        assert not excluded_from_build(f"{package}/__init__.py"), f".dockerignore leaves out {package}"


# -- the real validator, where installed -----------------------------------------------------------------------------


def _docker_compose_config(env_file: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        missing("docker-compose is not installed (Debian: apt-get install docker-compose)")
    # Only the env file may supply variables: the caller's environment would override it.
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [binary, "--env-file", str(env_file), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env=clean,
        timeout=60,
    )


def _write_env(path: Path, env: Mapping[str, str]) -> Path:
    path.write_text("".join(f"{name}={value}\n" for name, value in env.items()), encoding="utf-8")
    return path


def test_docker_compose_validates_the_file(tmp_path: Path) -> None:
    env = filled_env()
    result = _docker_compose_config(_write_env(tmp_path / "filled.env", env))
    assert result.returncode == 0, result.stderr
    validated = yaml.safe_load(result.stdout)
    ours = compose(env)
    # Its substitution agrees with the one the other tests use.
    assert validated["services"]["vllm"]["command"] == ours["services"]["vllm"]["command"]
    for name in CLAWGATE_SERVICES:
        assert service_env(validated["services"][name]) == service_env(ours["services"][name]), name
        assert validated["services"][name]["command"] == ours["services"][name]["command"], name

    refused = _docker_compose_config(ENV_EXAMPLE)
    assert refused.returncode != 0
    assert any(secret in refused.stderr for secret in SECRETS), refused.stderr
