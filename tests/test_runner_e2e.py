"""The runner end to end with the built-in harness and the real tiny model, through a live gateway with an admin
key: rewards land on the rollouts, groups are task × harness, sandboxes are removed, a verifier crash and a
harness timeout are reported without stopping the run, evaluation rollouts are flagged and reported per
policy version, and infrastructure failures are retried a bounded number of times."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawgate.cli import main as clawgate
from runner.client import RunAborted
from runner.harnesses import make_harness
from runner.report import RunReport
from runner.run import RunConfig, Runner
from runner.sandbox import SandboxFactory
from tests.conftest import LiveGateway, free_port, module_gateway
from tests.runner_support import make_tasks, require_bwrap, task_file

ADMIN = "runner-admin-key"
TASKS = [
    {"id": "keep-file", "instruction": "Do not delete a.txt.", "files": {"a.txt": "x\n"}, "verifier": "test -f a.txt"},
    {"id": "make-file", "instruction": "Create made.txt.", "verifier": "test -f made.txt"},
    {"id": "half", "instruction": "Anything.", "verifier": "echo '{\"reward\": 0.5}'"},
    {"id": "broken-verifier", "instruction": "Anything.", "verifier": "no-such-verifier-command"},
    # Starting the agent alone (an interpreter, httpx, a model call) takes far longer than 50 ms.
    {"id": "too-slow", "instruction": "Anything.", "verifier": "true", "timeout": 0.05},
]
EXPECTED = {
    "keep-file": ("rewarded", "completed", 1.0),
    "make-file": ("rewarded", "completed", 0.0),
    "half": ("rewarded", "completed", 0.5),
    "broken-verifier": ("verifier_failed", "failed", None),
    "too-slow": ("harness_timeout", "aborted", None),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LiveGateway]:
    yield from module_gateway(tmp_path_factory.mktemp("gw-runner"), tiny_model_dir, admin_key=ADMIN, max_tokens=24)


def admin_get(gw: LiveGateway, path: str, **params: Any) -> Any:
    resp = httpx.get(gw.url + path, params=params, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    resp.raise_for_status()
    return resp.json()


def run(config: RunConfig, tasks: list, harnesses: list[str], sandboxes: SandboxFactory) -> RunReport:
    runner = Runner(config, tasks, [make_harness(h) for h in harnesses], sandboxes)
    return asyncio.run(runner.run())


def test_a_task_set_runs_end_to_end(gateway, sandboxes, tmp_path):
    tasks = make_tasks(tmp_path, *TASKS)
    config = RunConfig(gateway.url, ADMIN, n=2, concurrency=2)
    report = run(config, tasks, ["builtin"], sandboxes)

    assert len(report.results) == len(TASKS) * 2
    for r in report.results:
        kind, status, reward = EXPECTED[r.task_id]
        assert (r.kind, r.status, r.reward) == (kind, status, reward), r
        assert r.group == f"{r.task_id}::builtin" and r.attempts == 1 and r.sandbox_removed
        detail = admin_get(gateway, f"/v1/rollouts/{r.rollout_id}", tokens="false")
        assert (detail["status"], detail["reward"], detail["group"], detail["eval"]) == (status, reward, r.group, False)
        assert detail["metadata"]["runner"]["sandbox"] == "bwrap"
        if kind == "rewarded":
            # The agent reached the model through the rollout's own URL and key, from inside the sandbox.
            assert r.calls >= 1 and all(c["status"] == "ok" for c in detail["calls"])
            assert len(detail["calls"]) == r.calls
            [reward_row] = detail["rewards"]
            assert reward_row["source"] == "verifier" and reward_row["details"]["verifier"]
        else:
            assert detail["rewards"] == []
    crash = admin_get(gateway, f"/v1/rollouts/{report.results[6].rollout_id}")
    assert crash["finish_reason"].startswith("verifier crashed: verifier could not run (exit 127)")
    slow = admin_get(gateway, f"/v1/rollouts/{report.results[8].rollout_id}")
    assert slow["finish_reason"] == "harness timed out after 0.05 s (process tree killed)"

    assert sandboxes.leftovers() == [] and report.leftover_sandboxes == 0
    assert report.exit_code == 1  # the broken verifier is the task author's to fix
    table = report.table().splitlines()
    assert table[1].split() == ["task", "builtin"]
    rows = {line.split()[0]: line.split()[1:] for line in table[2:]}
    assert rows["keep-file"] == ["1.00", "2/2"] and rows["make-file"] == ["0.00", "0/2"]
    assert rows["half"] == ["0.50", "0/2"]
    assert rows["broken-verifier"] == ["n/a", "V2"] and rows["too-slow"] == ["n/a", "T2"]
    assert "2 harness timeouts, 2 verifier failures, 0 infrastructure failures (0 retries)" in report.summary()


def test_eval_mode_through_the_cli(gateway, tmp_path, monkeypatch, capsys):
    require_bwrap()
    path = task_file(
        tmp_path,
        [
            {"id": "eval-pass", "instruction": "Anything.", "verifier": "true"},
            {"id": "eval-fail", "instruction": "Anything.", "verifier": "false"},
        ],
    )
    monkeypatch.setenv("CLAWGATE_ADMIN_KEY", ADMIN)
    argv = ["rollout", "--tasks", str(path), "--n", "2", "--eval", "--gateway", gateway.url + "/v1"]
    code = clawgate(
        [*argv, "--sandbox", "bwrap", "--work-dir", str(tmp_path / "work"), "--json-out", str(tmp_path / "r.jsonl")]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err

    listed = admin_get(gateway, "/v1/rollouts", eval="true", task_id="eval-pass")["data"]
    assert len(listed) == 2 and all(r["eval"] and r["status"] == "completed" for r in listed)
    assert admin_get(gateway, "/v1/rollouts", eval="false", task_id="eval-pass")["data"] == []
    versions = {
        c["policy_version"]
        for r in listed
        for c in admin_get(gateway, f"/v1/rollouts/{r['id']}", tokens="false")["calls"]
    }
    assert len(versions) == 1
    [version] = versions
    label = "base" if version is None else f"v{version}"

    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("eval pass rates by policy version")))
    rates = [line.split() for line in lines[start + 2 :] if line.strip()]
    assert [label, "builtin", "eval-pass", "2/2", "100%"] in rates
    assert [label, "builtin", "eval-fail", "0/2", "0%"] in rates
    assert [label, "builtin", "(all)", "2/4", "50%"] in rates
    assert "4 rollouts:" in err and "sandbox: bubblewrap, network: the gateway only" in err
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 4
    assert not any((tmp_path / "work").iterdir())  # the run directory and every sandbox are gone


def test_without_bubblewrap_the_runner_warns_and_still_works(gateway, tmp_path):
    factory = SandboxFactory("auto", base_dir=tmp_path / "sandboxes", bwrap=str(tmp_path / "no-bwrap"))
    assert factory.kind == "none"
    progress = io.StringIO()
    tasks = make_tasks(tmp_path, TASKS[0])
    runner = Runner(RunConfig(gateway.url, ADMIN), tasks, [make_harness("builtin")], factory, progress)
    report = asyncio.run(runner.run())
    factory.close()
    [r] = report.results
    assert (r.kind, r.reward, r.sandbox_removed) == ("rewarded", 1.0, True) and r.calls >= 1
    assert progress.getvalue().startswith("WARNING: bubblewrap is not usable:")
    assert "WITHOUT isolation" in progress.getvalue() and report.summary().endswith("sandbox: NONE (plain dirs)")


def test_a_refused_admin_key_stops_the_run(gateway, sandboxes, tmp_path):
    tasks = make_tasks(tmp_path, TASKS[0])
    with pytest.raises(RunAborted, match="refused the admin key"):
        run(RunConfig(gateway.url, "wrong-key", n=3), tasks, ["builtin"], sandboxes)
    assert sandboxes.leftovers() == []


def test_infrastructure_failures_are_retried_a_bounded_number_of_times(sandboxes, tmp_path):
    tasks = make_tasks(tmp_path, TASKS[0], TASKS[1])
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    config = RunConfig(dead, ADMIN, n=1, retries=2, retry_backoff=0.01)
    report = run(config, tasks, ["builtin"], sandboxes)
    assert [r.kind for r in report.results] == ["infra", "infra"]
    assert all(r.attempts == 3 and "gateway unreachable" in r.reason for r in report.results)
    assert report.retries == 4 and report.exit_code == 1
    assert "2 infrastructure failures (4 retries)" in report.summary()
    rows = {line.split()[0]: line.split()[1:] for line in report.table().splitlines()[2:]}
    assert rows["keep-file"] == ["n/a", "I1"]
