"""The policy: a PEFT LoRA on any causal LM, and its versions on disk (``adapters/policy@vN``).

Each version is its own directory, written atomically (a temporary sibling renamed into place), holding the PEFT
adapter (safetensors) and ``manifest.json`` (base model, version, step, the rollouts it was trained on, metrics).
A new directory per version matters for serving: vLLM keys its prefix cache by adapter name and path, so a reused
path could serve stale KV entries. v0 is a zero-initialized LoRA (PEFT's default init sets B = 0), identical to the
base model, so every request can go through an adapter (vLLM CPU mixes base and LoRA requests wrongly otherwise).

The adapter targets the decoder's linear layers only: a LoRA on ``lm_head`` also learns, but on tied-embedding
models vLLM and PEFT then disagree about its output (a training/inference mismatch).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VERSION_DIR = re.compile(r"^policy@v(\d+)$")
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class LoraSettings:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS


@dataclass(slots=True)
class Manifest:
    version: int
    base_model: str
    step: int = 0
    lora: dict[str, Any] = field(default_factory=dict)
    rollouts: list[str] = field(default_factory=list)  # the data this version was trained on: rollouts,
    turns: list[str] = field(default_factory=list)  # and turns (call ids) of everyday traffic
    metrics: dict[str, float] = field(default_factory=dict)
    parent_version: int | None = None
    rolled_back_from: int | None = None  # a rollback: the weights are those of this earlier version
    lineage: str = ""  # "" the shared policy, else the tenant whose own policy it is
    created_at: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat())


def version_name(version: int) -> str:
    if version < 0:
        raise ValueError("versions are non-negative")
    return f"policy@v{version}"


def version_path(root: str | Path, version: int) -> Path:
    """``root/policy@vN``, checked to stay inside ``root``."""
    base = Path(root).resolve()
    path = (base / version_name(version)).resolve()
    if path.parent != base:
        raise ValueError(f"adapter path escapes {base}")
    return path


def versions(root: str | Path) -> list[int]:
    base = Path(root)
    if not base.is_dir():
        return []
    found = (VERSION_DIR.match(p.name) for p in base.iterdir() if p.is_dir() and (p / MANIFEST).exists())
    return sorted(int(m.group(1)) for m in found if m)


def latest_version(root: str | Path) -> int | None:
    found = versions(root)
    return found[-1] if found else None


def read_manifest(path: str | Path) -> Manifest:
    return Manifest(**json.loads((Path(path) / MANIFEST).read_text()))


def load_base(model: str, *, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    base.to(device)  # type: ignore[arg-type]  # transformers' stub types `to` for the wrapped call
    return base


def new_policy(base: PreTrainedModel, lora: LoraSettings, *, gradient_checkpointing: bool = False) -> PeftModel:
    """A fresh LoRA on ``base`` (B = 0: the policy equals the base model until trained)."""
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    if gradient_checkpointing:
        enable_gradient_checkpointing(base)
    policy = get_peft_model(base, config)
    assert isinstance(policy, PeftModel)
    return policy


def enable_gradient_checkpointing(base: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (training only).

    Non-reentrant checkpointing: the frozen base's inputs need no ``requires_grad`` for the LoRA weights inside a
    checkpointed layer to get their gradients, and the gradients equal those without checkpointing.
    """
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()


def load_policy(
    base: PreTrainedModel, path: str | Path, *, trainable: bool = True, gradient_checkpointing: bool = False
) -> PeftModel:
    """Resume from a saved version."""
    if gradient_checkpointing:
        enable_gradient_checkpointing(base)
    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)


def load_weights(policy: PeftModel, path: str | Path) -> None:
    """Put a saved version's adapter weights into ``policy`` in place (a rollback: same adapter, older weights)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(iter(lora_parameters(policy).values())).device
    state = load_file(str(Path(path) / "adapter_model.safetensors"), device=str(device))
    result = set_peft_model_state_dict(policy, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"{path} holds weights this policy does not have: {unexpected[:3]}")


def save_version(
    policy: PeftModel,
    root: str | Path,
    manifest: Manifest,
    *,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/policy@vN`` atomically; refuses to overwrite an existing version.

    ``extra`` writes further files (a value head) into the version's temporary directory before the rename, so
    a version appears with all its files or not at all.
    """
    final = version_path(root, manifest.version)
    if final.exists():
        raise FileExistsError(f"{final} already exists: versions are immutable")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        policy.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True))
        if extra is not None:
            extra(tmp)
        for f in tmp.iterdir():  # readable by a serving engine running as another user
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def lora_parameters(policy: PeftModel) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.named_parameters() if "lora_" in n}


def base_parameters(policy: PeftModel) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.named_parameters() if "lora_" not in n}
