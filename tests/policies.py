"""Publishing policy versions the way the trainer does (directory first, then the database row), for tests of
the gateway's side of the hot swap without running training steps; and checking which version's weights serve.

A zero adapter (``scale=0``, the default) answers exactly like the base model and like every other zero adapter, so
a test of *which* version serves publishes with ``scale > 0`` and checks the answer by content: a greedy completion
of ``PROBE`` through the gateway must be that version's reference ids, computed here with transformers + PEFT."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import httpx
import torch
from sqlalchemy.orm import Session

from gateway.store import promotion
from gateway.store.db import connect
from gateway.store.models import PolicyVersion
from trainer import lora


def publish(
    database_url: str,
    adapter_dir: Path,
    model_dir: Path,
    version: int,
    *,
    scale: float = 0.0,
    broken: bool = False,
    gated: bool = False,
    seeded: bool = False,
    lineage: str = "",
) -> Path:
    """Write ``policy@v<version>`` (zero adapter, or lora_B ~ N(0, scale) seeded by the version) and record it;
    ``broken`` writes unreadable weights; ``gated``: as a trainer with an evaluation gate publishes it; ``seeded``:
    lora_A is drawn from a generator seeded by the version too (like PEFT's default init: U(±1/sqrt(fan_in))),
    so the whole adapter, and its greedy answers, is the same in every run (PEFT draws A from the process's
    global generator, which the gateway's threads use as well); ``lineage``: a version of that tenant's own policy."""
    base = lora.load_base(str(model_dir))
    policy = lora.new_policy(base, lora.LoraSettings())
    if scale or seeded:
        gen, gen_a = torch.Generator().manual_seed(version), torch.Generator().manual_seed(1_000_003 + version)
        with torch.no_grad():
            for name, param in lora.lora_parameters(policy).items():
                if "lora_B" in name and scale:
                    param.copy_(torch.randn(param.shape, generator=gen) * scale)
                elif "lora_A" in name and seeded:
                    bound = param.shape[1] ** -0.5
                    param.copy_((torch.rand(param.shape, generator=gen_a) * 2 - 1) * bound)
    path = lora.save_version(policy, adapter_dir, lora.Manifest(version=version, base_model=str(model_dir)))
    if broken:
        (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    engine = connect(database_url)
    try:
        with Session(engine) as session, session.begin():
            # The stage the trainer would publish it in: a candidate under guarded promotion (``trainer/publish.py``).
            stage = promotion.initial_stage(session, rolled_back_from=None, gated=gated, lineage=lineage)
            session.add(
                PolicyVersion(
                    version=version,
                    adapter_name=lora.version_name(version),
                    path=str(path),
                    base_model=str(model_dir),
                    status="published",
                    is_current=False,
                    created_at=dt.datetime.now(dt.UTC),
                    stage=stage,
                    stage_at=dt.datetime.now(dt.UTC),
                    lineage=lineage,
                )
            )
            if stage == "promoted":
                at = dt.datetime.now(dt.UTC)
                promotion.record_published(session, version, rolled_back_from=None, at=at, lineage=lineage)
    finally:
        engine.dispose()
    return path


PROBE = (5, 17, 99, 4, 250, 31)  # a token prompt whose greedy answers tell the tests' versions apart
MARGIN = 1e-3  # the least gap between the best and the second-best logit of a reference's greedy step


def reference_ids(model_dir: Path, adapter_path: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    """The greedy ids of ``prompt`` under the base model plus the adapter at ``adapter_path``, computed here with
    transformers + PEFT (not by the gateway's engine): ``n`` tokens of argmax, EOS or not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_path)).eval()
    ids = list(prompt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend with the gateway's engine (per thread)
    try:
        with torch.no_grad():
            for _ in range(n):
                top = torch.topk(model(torch.tensor([ids])).logits[0, -1], 2)
                # Far from a tie: the engine's arithmetic (KV cache, batching) cannot pick the runner-up instead.
                assert float(top.values[0] - top.values[1]) > MARGIN, f"a near-tie after {ids}: pick another prompt"
                ids.append(int(top.indices[0]))
    finally:
        torch.set_num_threads(threads)
    return ids[len(prompt) :]


def distinct_references(
    model_dir: Path, paths: dict[int, Path], prompt: tuple[int, ...], n: int
) -> dict[int, list[int]]:
    """Each version's reference ids; asserts that no two versions answer alike (else a check by content proves
    nothing about which version's weights served)."""
    refs = {v: reference_ids(model_dir, path, prompt, n) for v, path in paths.items()}
    answers = [tuple(ids) for ids in refs.values()]
    assert len(set(answers)) == len(answers), f"versions must answer {prompt} differently: {refs}"
    return refs


def assert_serves(
    gw: Any, version: int, refs: dict[int, list[int]], prompt: tuple[int, ...], headers: dict[str, str]
) -> None:
    """A greedy completion of ``prompt`` through ``gw`` answers exactly ``policy@v<version>``'s reference ids
    (``refs``, from :func:`distinct_references`), stores them, and its call records that version."""
    want = refs[version]
    got = served_ids(gw, prompt, len(want), headers)
    assert got["ids"] == want, f"not policy@v{version}'s weights: answered {got['ids']}, references {refs}"
    assert got["stored_ids"] == want, "the call stores the ids it answered"
    assert (got["adapter"], got["version"]) == (f"policy@v{version}", version), "the call records what served it"


def served_ids(gw: Any, prompt: tuple[int, ...], n: int, headers: dict[str, str]) -> dict[str, Any]:
    """One greedy completion of ``prompt`` through the gateway: the ids it answered, and the recorded call's
    adapter, version and stored completion ids (read back with the admin ``headers``)."""
    body = {"model": "tiny", "prompt": list(prompt), "max_tokens": n, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(gw.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    call_id, rollout = r.headers["x-clawgate-call-id"], r.headers["x-clawgate-rollout-id"]
    gw.flush()
    detail = httpx.get(f"{gw.v1}/rollouts/{rollout}", headers=headers, timeout=30)
    assert detail.status_code == 200, detail.text
    [call] = [c for c in detail.json()["calls"] if c["id"] == call_id]
    return {
        "ids": choice["token_ids"],
        "adapter": call["adapter"],
        "version": call["policy_version"],
        "stored_ids": call["completion_token_ids"],
    }
