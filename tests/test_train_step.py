"""`clawgate train --once` over rollouts captured through the gateway: one GRPO step, a new policy version, and
exactly-once consumption recorded in the store."""

from __future__ import annotations

import httpx
import openai
import sqlalchemy as sa
from safetensors.torch import load_file

from clawgate.cli import main
from gateway.store.db import connect

ADMIN = {"Authorization": "Bearer adm"}


def rollout(gw, task: str, reward: float | None, finish: bool = True, turns: int = 2, max_tokens: int = 6) -> str:
    ro = httpx.post(gw.url + "/v1/rollouts", json={"task_id": task, "harness": "sdk"}, headers=ADMIN).json()
    client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["api_key"], max_retries=0)
    messages = [{"role": "user", "content": f"Task {task}: begin."}]
    for turn in range(turns):
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=1.0)
        messages += [
            {"role": "assistant", "content": out.choices[0].message.content or ""},
            {"role": "user", "content": f"turn {turn}"},
        ]
    if reward is not None:
        httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/reward", json={"value": reward}, headers=ADMIN)
    if finish:
        httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/finish", json={"status": "completed"}, headers=ADMIN)
    return ro["id"]


def test_train_once_consumes_ready_rollouts_exactly_once(gateway_factory, tiny_model_dir, tmp_path, capsys):
    gw = gateway_factory(admin_key="adm")
    a_hi, a_lo = rollout(gw, "A", 1.0), rollout(gw, "A", 0.0)
    b1, b2 = rollout(gw, "B", 0.5), rollout(gw, "B", 0.5)  # zero variance: no signal
    pending = rollout(gw, "A", None, finish=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    args = [
        "train",
        "--once",
        "--model",
        str(tiny_model_dir),
        "--database-url",
        url,
        "--adapter-dir",
        str(adapters),
        "--lr",
        "0.01",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "policy@v1" in out and "rollouts 2/4" in out
    v0 = load_file(adapters / "policy@v0" / "adapter_model.safetensors")
    v1 = load_file(adapters / "policy@v1" / "adapter_model.safetensors")
    assert v0.keys() == v1.keys()
    assert any(not (v0[k] == v1[k]).all() for k in v0), "the step changed the LoRA weights"
    assert all((v0[k] == 0).all() for k in v0 if "lora_B" in k), "v0 is the zero adapter"
    engine = connect(url)
    with engine.connect() as conn:
        trained = dict(conn.execute(sa.text("SELECT rollout_id, advantage FROM trained_rollouts")).all())
        step = conn.execute(
            sa.text("SELECT version, status, trainable_tokens, tokens_processed FROM train_steps")
        ).one()
        versions = [r[0] for r in conn.execute(sa.text("SELECT version FROM policy_versions ORDER BY version"))]
    assert set(trained) == {a_hi, a_lo, b1, b2} and pending not in trained
    assert trained[a_hi] > 0 > trained[a_lo] and trained[b1] is None and trained[b2] is None
    assert step.version == 1 and step.status == "ok" and step.trainable_tokens > 0
    assert versions == [0, 1]
    # Nothing is ready any more: a second run trains nothing and publishes nothing.
    assert main(args) == 1
    assert not (adapters / "policy@v2").exists()
    # The pending rollout becomes ready once rewarded and finished, and only it is consumed next.
    httpx.post(f"{gw.url}/v1/rollouts/{pending}/reward", json={"value": 1.0}, headers=ADMIN)
    httpx.post(f"{gw.url}/v1/rollouts/{pending}/finish", json={"status": "completed"}, headers=ADMIN)
    assert main([*args, "--allow-empty"]) == 0
    with engine.connect() as conn:
        last = conn.execute(
            sa.text("SELECT rollout_id, version, advantage FROM trained_rollouts WHERE version = 2")
        ).all()
    engine.dispose()
    assert [(r[0], r[2]) for r in last] == [(pending, None)]  # a group of one carries no signal
