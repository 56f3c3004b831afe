"""The model files a gateway reads (tokenizer, generation config), loaded without importing torch.

A gateway that serves through vLLM needs the model's tokenizer and its ``generation_config.json``, never its
weights. ``transformers.AutoTokenizer`` and ``transformers.GenerationConfig`` import torch (and with it the CUDA
libraries: hundreds of MiB of resident memory, seconds of start-up) even to read a JSON file, so a model that ships
a ``tokenizer.json`` is loaded with the Rust-backed ``PreTrainedTokenizerFast`` directly and the generation config
is read as JSON. Only a model without ``tokenizer.json`` (a slow, Python-only tokenizer) goes through
``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_file(model: str, name: str) -> Path | None:
    """``name`` from a model folder or a Hub repository (downloaded, or found in the Hub cache); None if absent."""
    folder = Path(model)
    if folder.is_dir():
        path = folder / name
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(model, name))
    except Exception:  # not in the repository, no such repository, or offline without a cached copy
        return None


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer; torch-free whenever the model ships a ``tokenizer.json``."""
    if model_file(model, "tokenizer.json") is not None:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def generation_config(model: str) -> dict[str, Any]:
    """The model's ``generation_config.json`` as a dict ({} when it has none or it is unreadable)."""
    path = model_file(model, "generation_config.json")
    if path is None:
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
