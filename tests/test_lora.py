"""The LoRA policy: v0 equals the base model, training moves only LoRA weights, versions round-trip on disk."""

from __future__ import annotations

import pytest
import torch

from trainer.lora import (
    LoraSettings,
    Manifest,
    base_parameters,
    latest_version,
    load_base,
    load_policy,
    lora_parameters,
    new_policy,
    read_manifest,
    save_version,
    version_path,
    versions,
)


@pytest.fixture
def policy(tiny_model_dir):
    torch.manual_seed(0)
    return new_policy(load_base(str(tiny_model_dir)), LoraSettings(rank=4, alpha=8))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


IDS = [5, 17, 300, 42, 9, 1000, 77]


def test_fresh_policy_equals_base(policy):
    with policy.disable_adapter():
        base = logits(policy, IDS)
    assert torch.equal(logits(policy, IDS), base)
    names = lora_parameters(policy)
    assert names and all(p.requires_grad for p in names.values())
    assert not any(p.requires_grad for p in base_parameters(policy).values())
    assert not any("lm_head" in n or "embed" in n for n in names)


def test_training_moves_lora_not_base(policy):
    before_lora = {n: p.detach().clone() for n, p in lora_parameters(policy).items()}
    before_base = {n: p.detach().clone() for n, p in base_parameters(policy).items()}
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([IDS])
    for _ in range(3):
        loss = -torch.log_softmax(policy(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert any(not torch.equal(before_lora[n], p) for n, p in lora_parameters(policy).items())
    assert all(torch.equal(before_base[n], p) for n, p in base_parameters(policy).items())
    with policy.disable_adapter():
        base = logits(policy, IDS)
    assert not torch.allclose(logits(policy, IDS), base, atol=1e-4), "the trained adapter changes the output"


def test_versions_round_trip(policy, tiny_model_dir, tmp_path):
    with torch.no_grad():
        for n, p in lora_parameters(policy).items():
            if "lora_B" in n:
                p.add_(0.05)
    expected = logits(policy, IDS)
    root = tmp_path / "adapters"
    path = save_version(policy, root, Manifest(version=3, base_model=str(tiny_model_dir), step=7, rollouts=["ro-a"]))
    assert path == version_path(root, 3) and path.name == "policy@v3"
    assert (path / "adapter_model.safetensors").exists()
    assert versions(root) == [3] and latest_version(root) == 3
    manifest = read_manifest(path)
    assert manifest.step == 7 and manifest.rollouts == ["ro-a"]
    reloaded = load_policy(load_base(str(tiny_model_dir)), path)
    assert torch.allclose(logits(reloaded, IDS), expected, atol=1e-6)
    with pytest.raises(FileExistsError):
        save_version(policy, root, Manifest(version=3, base_model="x"))
    assert not any(p.name.startswith(".") for p in root.iterdir()), "no temporary directory left behind"
    with pytest.raises(ValueError):
        version_path(root, -1)
