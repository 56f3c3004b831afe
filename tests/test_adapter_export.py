"""`clawgate adapter export`: a policy version as a PEFT adapter, or merged into its base model so that any engine
loads it without PEFT — the merged model computes the same logits as base + adapter."""

from __future__ import annotations

import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clawgate.cli import main
from tests.policies import publish


def test_export_merged_and_adapter(tiny_model_dir, tmp_path, sqlite_url, capsys):
    adapters = tmp_path / "adapters"
    path = publish(sqlite_url, adapters, tiny_model_dir, 3, scale=0.5)
    merged_dir, adapter_out = tmp_path / "merged", tmp_path / "adapter"
    assert main(["adapter", "export", "3", "--merge", str(merged_dir), "--adapter-dir", str(adapters)]) == 0
    assert main(["adapter", "export", "3", "--out", str(adapter_out), "--adapter-dir", str(adapters)]) == 0
    assert (adapter_out / "adapter_model.safetensors").read_bytes() == (path / "adapter_model.safetensors").read_bytes()
    assert json.loads((merged_dir / "clawgate-manifest.json").read_text())["version"] == 3
    assert (merged_dir / "tokenizer.json").is_file()

    ids = torch.tensor([[5, 17, 99, 4, 250, 31]])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(path)).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        got, want, plain = merged(ids).logits, peft(ids).logits, base(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-3), "the adapter changed the model (a zero adapter proves nothing)"
    assert not any("lora" in name for name, _ in merged.named_parameters()), "a plain model, no PEFT layers"

    capsys.readouterr()
    assert main(["adapter", "export", "3", "--merge", str(merged_dir), "--adapter-dir", str(adapters)]) == 2
    assert main(["adapter", "export", "8", "--out", str(tmp_path / "x"), "--adapter-dir", str(adapters)]) == 2
    assert main(["adapter", "export", "3", "--adapter-dir", str(adapters)]) == 2
    err = capsys.readouterr().err
    assert "is not an empty directory" in err and "no policy@v8" in err and "needs one of --out" in err
