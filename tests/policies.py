"""Publishing policy versions the way the trainer does (directory first, then the database row), for tests of
the gateway's side of the hot swap without running training steps."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import torch
from sqlalchemy.orm import Session

from gateway.store import promotion
from gateway.store.db import connect
from gateway.store.models import PolicyVersion
from trainer import lora


def publish(
    database_url: str, adapter_dir: Path, model_dir: Path, version: int, *, scale: float = 0.0, broken: bool = False
) -> Path:
    """Write ``policy@v<version>`` (zero adapter, or lora_B ~ N(0, scale) seeded by the version) and record it;
    ``broken`` writes unreadable weights."""
    base = lora.load_base(str(model_dir))
    policy = lora.new_policy(base, lora.LoraSettings())
    if scale:
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in lora.lora_parameters(policy).items():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * scale)
    path = lora.save_version(policy, adapter_dir, lora.Manifest(version=version, base_model=str(model_dir)))
    if broken:
        (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    engine = connect(database_url)
    try:
        with Session(engine) as session, session.begin():
            # The stage the trainer would publish it in: a candidate under guarded promotion (``trainer/publish.py``).
            stage = promotion.initial_stage(session, rolled_back_from=None)
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
                )
            )
            if stage == "promoted":
                promotion.record_published(session, version, rolled_back_from=None, at=dt.datetime.now(dt.UTC))
    finally:
        engine.dispose()
    return path
