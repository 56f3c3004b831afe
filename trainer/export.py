"""Exporting a policy version for use outside clawgate: the PEFT adapter as it is, or merged into the base model.

``clawgate adapter export VERSION --out DIR`` copies ``policy@vN`` (a PEFT LoRA adapter: ``adapter_config.json``,
``adapter_model.safetensors``, ``manifest.json``); ``--merge DIR`` writes a plain Hugging Face model with the LoRA
folded into the base weights, plus the base model's tokenizer, which any engine loads without PEFT. Neither
overwrites anything: the target must not exist or be empty.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer import lora


def _target(path: Path) -> Path:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory: choose a new one")
    return path


def source(adapter_dir: str | Path, version: int) -> Path:
    path = lora.version_path(adapter_dir, version)
    if not (path / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"no policy@v{version} in {Path(adapter_dir).resolve()}")
    return path


def copy_adapter(adapter_dir: str | Path, version: int, out: Path) -> Path:
    src = source(adapter_dir, version)
    target = _target(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, target, dirs_exist_ok=True)
    return target


def merge(adapter_dir: str | Path, version: int, out: Path, *, base_model: str | None = None) -> Path:
    """Fold ``policy@v<version>`` into its base model (the manifest's, unless ``base_model`` is given)."""
    from transformers import AutoTokenizer

    src = source(adapter_dir, version)
    target = _target(out)
    model = base_model or lora.read_manifest(src).base_model
    policy = lora.load_policy(lora.load_base(model), src, trainable=False)
    merged = policy.merge_and_unload()
    target.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(target), safe_serialization=True)
    AutoTokenizer.from_pretrained(model).save_pretrained(str(target))
    shutil.copy2(src / lora.MANIFEST, target / f"clawgate-{lora.MANIFEST}")
    return target


__all__ = ["copy_adapter", "merge", "source"]
