"""PPO with a value head over prefix trees, and the trainer's bf16 / gradient-checkpointing options.

GAE runs along each branch of a hand-built two-branch tree (sibling values never leak; γ = λ = 1 gives the
terminal reward as every return); the value head learns fixed returns on the tiny model; critic warm-up moves
only the head; the tree layout's step equals the per-path layout's and a per-path PPO reference; a PPO
``Trainer.step()`` over rollouts captured through the gateway writes a version with ``value_head.safetensors``
and a ``ppo`` train step, and a resumed trainer gets the same head back. The bf16 and checkpointed trainers
change only LoRA weights, and a checkpointed step computes what an ordinary one does.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import sqlalchemy as sa
import torch
from safetensors.torch import load_file
from sqlalchemy.orm import Session

from gateway.store.db import connect
from gateway.store.readiness import ready_rollouts
from gateway.store.training_data import load_rollout
from prefix_tree import CallView, RolloutTree, TreeConfig, build_tree
from tests.conftest import module_gateway
from trainer import lora, ppo
from trainer.advantages import gae
from trainer.batch import pack_trees
from trainer.config import TrainConfig, Trigger
from trainer.step import Trainer

ADMIN = {"Authorization": "Bearer adm"}
KEEP_BOTH = TreeConfig(drop_dead_leaves=False)  # two retries of one prompt, both kept: a two-branch tree


def settings(**overrides: Any) -> TrainConfig:
    """The PPO knobs ``ppo.optimize`` reads, on the trainer's own configuration."""
    values: dict[str, Any] = {"model": "unused", "database_url": "unused", "algorithm": "ppo", "gamma": 1.0}
    values.update({"lam": 1.0, "critic_lr": 2e-3, "lr": 1e-2, **overrides})
    return TrainConfig(**values)


def two_branch_calls(seed: int = 0) -> list[CallView]:
    """prompt → completion a → user turn → two sibling completions b1, b2 (retries of one turn)."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(20, 1900, size=n).tolist()

    def lp(n: int) -> list[float]:
        return rng.uniform(-3.0, -0.1, size=n).tolist()

    prompt, a, user, b1, b2 = ids(12), ids(5), ids(4), ids(6), ids(3)
    return [
        CallView("c0", prompt, a, lp(5), 0.0, "ok"),
        CallView("c1", prompt + a + user, b1, lp(6), 1.0, "ok"),
        CallView("c2", prompt + a + user, b2, lp(3), 2.0, "ok"),
    ]


def two_branch_tree(seed: int = 0) -> RolloutTree:
    """The calls of ``two_branch_calls`` as a tree with both retries kept: two branches."""
    tree = build_tree(two_branch_calls(seed), KEEP_BOTH)
    assert len(tree.leaves()) == 2 and not tree.dropped
    return tree


def branch_keys(tree: RolloutTree) -> tuple[set[ppo.Key], set[ppo.Key], set[ppo.Key]]:
    """Trained token keys (node, position) that are shared, only on the first branch, only on the second."""
    first, second = (_path_keys(leaf) for leaf in tree.leaves())
    shared = set(first) & set(second)
    return shared, set(first) - shared, set(second) - shared


def _path_keys(leaf: Any) -> list[ppo.Key]:
    keys: list[ppo.Key] = []
    node = leaf
    while node is not None:
        keys[:0] = [(node.id, node.depth + int(i)) for i in np.flatnonzero(node.trainable)]
        node = node.parent
    return keys


# ---------------------------------------------------------------------------------------------- GAE on a tree


def test_gae_runs_per_branch_and_sibling_values_do_not_leak():
    tree = two_branch_tree()
    shared, only1, only2 = branch_keys(tree)
    assert len(shared) == 5 and len(only1) == 6 and len(only2) == 3
    rng = np.random.default_rng(1)
    values = {k: float(v) for k, v in zip(sorted(shared | only1 | only2), rng.normal(size=14), strict=True)}
    branches = ppo.branch_gae(tree, 2.0, values, gamma=0.9, lam=0.7)
    assert [len(b.keys) for b in branches] == [11, 8]
    for branch in branches:
        # Each branch is plain GAE along its own steps, with the reward on its last one.
        v = np.array([values[k] for k in branch.keys])
        adv, ret = gae(np.r_[np.zeros(len(v) - 1), 2.0], v, gamma=0.9, lam=0.7)
        np.testing.assert_allclose(branch.advantages, adv)
        np.testing.assert_allclose(branch.returns, ret)
    # Changing the values on branch 2 leaves every target of branch 1 as it was.
    moved = {k: (v + 5.0 if k in only2 else v) for k, v in values.items()}
    again = ppo.branch_gae(tree, 2.0, moved, gamma=0.9, lam=0.7)
    np.testing.assert_array_equal(again[0].advantages, branches[0].advantages)
    np.testing.assert_array_equal(again[0].returns, branches[0].returns)
    assert not np.allclose(again[1].advantages, branches[1].advantages)
    # A shared token's targets are the means over the two paths through it; a branch's own tokens keep theirs.
    targets = ppo.token_targets(branches)
    per_branch = [dict(zip(b.keys, zip(b.advantages, b.returns, strict=True), strict=True)) for b in branches]
    for k in shared:
        expected = np.mean([per_branch[0][k], per_branch[1][k]], axis=0)
        np.testing.assert_allclose(targets[k], expected)
        assert not np.isclose(per_branch[0][k][0], per_branch[1][k][0]), "the branches disagree here"
    for k in only1:
        assert targets[k] == pytest.approx(per_branch[0][k])
    for k in only2:
        assert targets[k] == pytest.approx(per_branch[1][k])


def test_gamma_lambda_one_returns_are_the_terminal_reward():
    tree = two_branch_tree(seed=3)
    shared, only1, only2 = branch_keys(tree)
    rng = np.random.default_rng(2)
    values = {k: float(rng.normal()) for k in shared | only1 | only2}
    branches = ppo.branch_gae(tree, -1.5, values, gamma=1.0, lam=1.0)
    for b in branches:
        np.testing.assert_allclose(b.returns, -1.5)
        np.testing.assert_allclose(b.advantages, -1.5 - b.values)
    targets = ppo.token_targets(branches)
    assert set(targets) == shared | only1 | only2
    for k, (a, r) in targets.items():
        assert r == pytest.approx(-1.5) and a == pytest.approx(-1.5 - values[k])


def test_missing_value_is_an_error():
    tree = two_branch_tree()
    shared, only1, _ = branch_keys(tree)
    values = dict.fromkeys(shared | only1, 0.0)
    with pytest.raises(ValueError, match="no value"):
        ppo.branch_gae(tree, 1.0, values, gamma=1.0, lam=1.0)


def test_explained_variance():
    assert ppo.explained_variance([1.0, -1.0], [1.0, -1.0]) == pytest.approx(1.0)
    assert ppo.explained_variance([0.0, 0.0], [1.0, -1.0]) == pytest.approx(0.0)
    assert ppo.explained_variance([0.3, 0.1], [1.0, 1.0]) is None  # no variance: undefined, not NaN


# ---------------------------------------------------------------------------------------------- on the tiny model


@pytest.fixture
def policy(tiny_model_dir: Path) -> Any:
    torch.manual_seed(0)
    policy = lora.new_policy(lora.load_base(str(tiny_model_dir)), lora.LoraSettings(rank=4, alpha=8))
    policy.train()
    return policy


def trainable(policy: Any) -> list[torch.Tensor]:
    return [p for p in policy.parameters() if p.requires_grad]


def snapshot(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in params.items()}


CALLS = [two_branch_calls(seed) for seed in range(4)]
TREES_REWARDS = ([build_tree(calls, KEEP_BOTH) for calls in CALLS], [1.0, -1.0, 0.5, -0.5])


def test_value_head_learns_fixed_returns(policy):
    trees, rewards = TREES_REWARDS
    # The head alone (a long warm-up): the returns stay fixed (γ = λ = 1: the rewards).
    cfg = settings(critic_warmup_steps=100, critic_lr=1e-3)
    critic = ppo.Critic.for_policy(policy, lr=cfg.critic_lr)
    optimizer = torch.optim.AdamW(trainable(policy), lr=cfg.lr)
    losses, ev, return_means = [], [], []
    for _ in range(8):
        m = ppo.optimize(policy, optimizer, critic, trees, rewards, cfg)
        assert m["critic_warmup"] == 1.0
        losses.append(m["value_loss"])
        ev.append(m["explained_variance"])
        return_means.append(m["return_mean"])
    assert return_means == pytest.approx([return_means[0]] * 8), "the targets stay put"
    # A zero head predicts 0: the loss is ½·mean(R²) over distinct trained tokens, explained variance 0.
    assert losses[0] == pytest.approx(0.5 * np.mean([r * r for r in rewards]), rel=0.05)
    assert ev[0] == pytest.approx(0.0)
    assert all(a > b for a, b in itertools.pairwise(losses[:6])), losses
    assert losses[-1] < 0.2 * losses[0], losses
    assert ev[-1] > 0.7, ev
    assert critic.updates == 8


def test_critic_warmup_moves_only_the_head(policy):
    trees, rewards = TREES_REWARDS
    cfg = settings(critic_warmup_steps=2)
    critic = ppo.Critic.for_policy(policy, lr=cfg.critic_lr)
    optimizer = torch.optim.AdamW(trainable(policy), lr=cfg.lr)
    lora_before = snapshot(lora.lora_parameters(policy))
    for step in range(2):
        head_before = snapshot(dict(critic.head.named_parameters()))
        m = ppo.optimize(policy, optimizer, critic, trees, rewards, cfg)
        assert m["critic_warmup"] == 1.0 and m["grad_norm"] == 0.0, step
        assert all(torch.equal(lora_before[n], p) for n, p in lora.lora_parameters(policy).items())
        assert any(not torch.equal(head_before[n], p) for n, p in critic.head.named_parameters())
    base_before = snapshot(lora.base_parameters(policy))
    m = ppo.optimize(policy, optimizer, critic, trees, rewards, cfg)
    assert m["critic_warmup"] == 0.0 and m["grad_norm"] > 0
    assert any(not torch.equal(lora_before[n], p) for n, p in lora.lora_parameters(policy).items())
    assert all(torch.equal(base_before[n], p) for n, p in lora.base_parameters(policy).items())


def randomize(policy: Any, critic: ppo.Critic, seed: int) -> None:
    """Non-zero LoRA B and head, so every LoRA matrix and the values take part in the gradients."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.lora_parameters(policy).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        critic.head.linear.weight.copy_(torch.randn(critic.head.linear.weight.shape, generator=gen) * 0.02)
        critic.head.linear.bias.fill_(0.1)


def sgd_step(policy: Any, critic: ppo.Critic, trees, rewards, cfg: TrainConfig) -> dict[str, float]:
    """``ppo.optimize`` with plain SGD on both sides, so the step shows the (clipped) gradients linearly."""
    critic.optimizer = torch.optim.SGD(critic.head.parameters(), lr=1.0)
    return ppo.optimize(policy, torch.optim.SGD(trainable(policy), lr=1.0), critic, trees, rewards, cfg)


def paths_of(calls: list[CallView]) -> list[tuple[list[int], dict[int, float]]]:
    """Each leaf call's full sequence with its trained positions and their sampled logprobs: the completions of
    every call whose prompt + completion the sequence begins with (the leaf's own included)."""
    full = {c.id: [*c.prompt_ids, *c.completion_ids] for c in calls}
    out = []
    for leaf in calls:
        seq = full[leaf.id]
        if any(o.id != leaf.id and full[o.id][: len(seq)] == seq for o in calls):
            continue  # continued by another call: not a leaf
        trained: dict[int, float] = {}
        for c in calls:
            if seq[: len(full[c.id])] == full[c.id]:
                trained.update(zip(range(len(c.prompt_ids), len(full[c.id])), c.completion_logprobs, strict=True))
        out.append((seq, trained))
    return out


def gae_by_hand(values: list[float], reward: float, gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE over one path's trained tokens, the reward at the last: δ_k = r_k + γ·V_k+1 − V_k, A_k = δ_k + γλ·A_k+1."""
    adv = [0.0] * len(values)
    after = 0.0
    for k in reversed(range(len(values))):
        nxt = values[k + 1] if k + 1 < len(values) else 0.0
        r = reward if k == len(values) - 1 else 0.0
        after = r + gamma * nxt - values[k] + gamma * lam * after
        adv[k] = after
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def reference_grads(policy: Any, critic: ppo.Critic, calls_of: list[list[CallView]], rewards, cfg: TrainConfig):
    """Per-path PPO written out from the calls alone (not from the trainer's packing, forward, GAE or losses): each
    path is run through the model by itself, its trained tokens get their own GAE targets, and a token on c paths
    weighs 1/c in each. With one update, logp_old is the current policy and V_old the current head, so the loss
    gradient is −w·A·∇logp (w the IS weight against the sampled logprob, capped at 2) plus value_coef·(V − R)·∇V."""
    w_head, b_head = critic.head.linear.weight, critic.head.linear.bias
    params = [*trainable(policy), *critic.head.parameters()]
    for p in params:
        p.grad = None
    work = []
    distinct = 0
    for calls, reward in zip(calls_of, rewards, strict=True):
        paths = paths_of(calls)
        # A token is its prefix: a shared one lies on several paths, siblings at one position are distinct.
        on_paths = Counter(tuple(seq[: p + 1]) for seq, trained in paths for p in trained)
        distinct += len(on_paths)  # the loss: a sum over distinct trained tokens divided by their number
        work += [(seq, trained, reward, on_paths) for seq, trained in paths]
    total = torch.zeros(())
    for seq, trained, reward, on_paths in work:
        out = policy(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False)
        positions = sorted(trained)
        src = torch.tensor([p - 1 for p in positions])  # the logits and state that predict token p
        logp = torch.log_softmax(out.logits[0, src].float() / cfg.temperature, -1)[
            torch.arange(len(positions)), torch.tensor([seq[p] for p in positions])
        ]
        values = (out.hidden_states[-1][0, src].float() @ w_head.T).squeeze(-1) + b_head
        adv, ret = gae_by_hand(values.tolist(), reward, cfg.gamma, cfg.lam)
        rollout = torch.tensor([trained[p] for p in positions])
        w = torch.clamp(torch.exp(logp.detach() - rollout), max=2.0)
        c = torch.tensor([float(on_paths[tuple(seq[: p + 1])]) for p in positions])
        pg = -(w * torch.tensor(adv) * torch.exp(logp - logp.detach()))
        vl = 0.5 * torch.square(values - torch.tensor(ret))
        total = total + ((pg + cfg.value_coef * vl) / c).sum()
    (total / distinct).backward()
    torch.nn.utils.clip_grad_norm_(trainable(policy), 1.0)
    torch.nn.utils.clip_grad_norm_(critic.head.parameters(), 1.0)
    return [p.grad.clone() for p in params]  # type: ignore[union-attr]


def test_tree_and_path_layouts_give_per_path_ppo_gradients(policy):
    trees, rewards = TREES_REWARDS
    cfg = settings(gamma=0.9, lam=0.8, value_coef=0.5)
    critic = ppo.Critic.for_policy(policy, lr=1.0)
    randomize(policy, critic, seed=5)
    expected = reference_grads(policy, critic, CALLS, rewards, cfg)
    metrics = {}
    for strategy in ("tree", "paths"):
        pol, cri = copy.deepcopy(policy), copy.deepcopy(critic)
        metrics[strategy] = sgd_step(pol, cri, trees, rewards, dataclasses.replace(cfg, strategy=strategy))
        grads = [p.grad for p in [*trainable(pol), *cri.head.parameters()]]
        assert all(g is not None for g in grads)
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert metrics["tree"]["tokens_processed"] < metrics["paths"]["tokens_processed"]
    for name in ("loss", "value_loss", "explained_variance", "advantage_mean", "return_mean", "value_mean"):
        assert metrics["tree"][name] == pytest.approx(metrics["paths"][name], rel=1e-4, abs=1e-6), name


def count_calls(module: torch.nn.Module) -> list[int]:
    """Count runs of ``module.forward``, recomputations included (module hooks do not see those)."""
    calls: list[int] = []
    forward = module.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    module.forward = counting  # type: ignore[method-assign]
    return calls


def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir, tmp_path):
    """A checkpointed policy (here resumed from disk, as a trainer restarting does) recomputes every decoder layer
    in the backward pass and still computes the same loss and gradients, in float32."""
    trees, rewards = TREES_REWARDS
    cfg = settings(gamma=0.95, lam=0.9)
    torch.manual_seed(0)
    plain = lora.new_policy(lora.load_base(str(tiny_model_dir)), lora.LoraSettings(rank=4, alpha=8))
    critic = ppo.Critic.for_policy(plain, lr=1.0)
    randomize(plain, critic, seed=7)
    path = lora.save_version(plain, tmp_path, lora.Manifest(version=0, base_model=str(tiny_model_dir)))
    ckpt = lora.load_policy(lora.load_base(str(tiny_model_dir)), path, gradient_checkpointing=True)
    assert ckpt.base_model.model.is_gradient_checkpointing and not plain.base_model.model.is_gradient_checkpointing
    results = []
    for policy in (plain, ckpt):
        policy.train()
        mlp = policy.base_model.model.model.layers[0].mlp
        calls = count_calls(mlp)
        metrics = sgd_step(policy, copy.deepcopy(critic), trees, rewards, cfg)
        del mlp.forward  # back to the class's forward
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        results.append((metrics, grads, len(calls)))
    (m0, g0, calls0), (m1, g1, calls1) = results
    # Two forward passes per batch (values, then the update); checkpointing runs the layer again in backward.
    batches = len(pack_trees(trees))
    assert calls0 == 2 * batches and calls1 == 3 * batches
    for name in ("loss", "value_loss", "grad_norm", "value_grad_norm"):
        assert m1[name] == pytest.approx(m0[name], rel=1e-5, abs=1e-7), name
    assert g0.keys() == g1.keys() and any(float(g.abs().max()) > 0 for g in g0.values())
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- the trainer


def branched_rollout(gw: Any, task: str, reward: float) -> str:
    """A rollout whose first call has two choices, each continued: two kept branches sharing the first prompt."""
    ro = httpx.post(gw.url + "/v1/rollouts", json={"task_id": task, "harness": "sdk"}, headers=ADMIN).json()
    client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["api_key"], max_retries=0)
    first = [{"role": "user", "content": f"Task {task}: begin."}]
    out = client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=1.0, n=2)
    for choice in out.choices:
        history = [*first, {"role": "assistant", "content": choice.message.content or ""}]
        messages = [*history, {"role": "user", "content": "go on"}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=1.0)  # type: ignore[arg-type]
    httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/reward", json={"value": reward}, headers=ADMIN)
    httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/finish", json={"status": "completed"}, headers=ADMIN)
    return ro["id"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A SQLite store with four finished, rewarded, branched rollouts captured through the gateway: group A with
    rewards 1 and 0, group B with 0.5 twice (no variance: GRPO leaves it out, PPO trains it)."""
    tmp = tmp_path_factory.mktemp("ppo-store")
    gateways = module_gateway(tmp, tiny_model_dir, admin_key="adm", max_tokens=16)
    gw = next(gateways)
    for task, reward in (("A", 1.0), ("A", 0.0), ("B", 0.5), ("B", 0.5)):
        branched_rollout(gw, task, reward)
    gw.flush()
    next(gateways, None)  # stops the gateway
    return tmp / "clawgate.db"


def trainer_config(store: Path, tiny_model_dir: Path, tmp_path: Path, **overrides: Any) -> TrainConfig:
    """A private copy of the store (each trainer publishes its own versions) and a config on it."""
    db = tmp_path / "clawgate.db"
    with sqlite3.connect(store) as source, sqlite3.connect(db) as target:
        source.backup(target)  # a consistent copy, whatever sits in the write-ahead log
    values: dict[str, Any] = {
        "model": str(tiny_model_dir),
        "database_url": f"sqlite:///{db}",
        "adapter_dir": tmp_path / "adapters",
        "lr": 1e-2,
        "critic_lr": 2e-3,
        "device": "cpu",
    }
    values.update(overrides)
    return TrainConfig(**values)


@pytest.fixture
def engines() -> Iterator[list[sa.Engine]]:
    made: list[sa.Engine] = []
    yield made
    for engine in made:
        engine.dispose()


def test_ppo_trainer_step_publishes_the_value_head_and_resumes_with_it(store, tiny_model_dir, tmp_path, engines):
    cfg = trainer_config(store, tiny_model_dir, tmp_path, algorithm="ppo", lam=0.9)
    engines.append(engine := connect(cfg.database_url))
    trainer = Trainer(cfg, engine)
    assert trainer.critic is not None and (cfg.adapter_dir / "policy@v0" / ppo.VALUE_HEAD).exists()
    loaded = [load_rollout(engine, rid, cfg.tree) for rid in ready_rollouts(engine, 0, 10)]
    assert len(loaded) == 4 and all(d is not None and len(d.tree.leaves()) == 2 for d in loaded), "two branches each"

    result = trainer.step()
    assert result is not None and result.version == 1
    assert result.rollouts == 4 and result.trained_rollouts == 4, "no group baseline: all four train"
    m = result.metrics
    assert m["critic_warmup"] == 0.0 and m["grad_norm"] > 0 and m["value_loss"] > 0
    assert {"explained_variance", "value_mean", "return_mean", "loss"} <= m.keys()
    v0, v1 = cfg.adapter_dir / "policy@v0", cfg.adapter_dir / "policy@v1"
    saved = load_file(v1 / ppo.VALUE_HEAD)
    assert saved.keys() == {"linear.weight", "linear.bias"}
    assert torch.equal(saved["linear.weight"], trainer.critic.head.linear.weight.detach())  # type: ignore[union-attr]
    assert not torch.equal(saved["linear.weight"], load_file(v0 / ppo.VALUE_HEAD)["linear.weight"]), "it trained"
    lora0, lora1 = load_file(v0 / "adapter_model.safetensors"), load_file(v1 / "adapter_model.safetensors")
    assert any(not torch.equal(lora0[k], lora1[k]) for k in lora0), "the policy trained"
    with engine.connect() as conn:
        step = conn.execute(sa.text("SELECT algorithm, version, status FROM train_steps")).one()
        trained = dict(conn.execute(sa.text("SELECT rollout_id, advantage FROM trained_rollouts")).all())
    assert tuple(step) == ("ppo", 1, "ok")
    assert len(trained) == 4 and all(a is not None for a in trained.values())

    resumed = Trainer(cfg, engine)
    assert resumed.version == 1 and resumed.critic is not None and resumed.critic.updates == 1
    for name, tensor in trainer.critic.head.state_dict().items():  # type: ignore[union-attr]
        assert torch.equal(resumed.critic.head.state_dict()[name], tensor), name
    assert resumed.step() is None, "every rollout was consumed exactly once"


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="algorithm"):
        TrainConfig(model="m", database_url="sqlite://", algorithm="a2c")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("option", ["bfloat16", "gradient_checkpointing"])
def test_trainer_options_change_lora_weights_only(store, tiny_model_dir, tmp_path, engines, option, algorithm):
    overrides: dict[str, Any] = {"dtype": "bfloat16"} if option == "bfloat16" else {"gradient_checkpointing": True}
    cfg = trainer_config(store, tiny_model_dir, tmp_path, algorithm=algorithm, **overrides)
    engines.append(engine := connect(cfg.database_url))
    trainer = Trainer(cfg, engine)
    model = trainer.policy.base_model.model
    base = lora.base_parameters(trainer.policy)
    if option == "bfloat16":
        assert {p.dtype for p in base.values()} == {torch.bfloat16}
    else:
        assert model.is_gradient_checkpointing
    assert (trainer.critic is not None) == (algorithm == "ppo")
    assert (cfg.adapter_dir / "policy@v0" / ppo.VALUE_HEAD).exists() == (algorithm == "ppo")
    lora_before, base_before = snapshot(lora.lora_parameters(trainer.policy)), snapshot(base)
    result = trainer.step()
    assert result is not None and result.trained_rollouts == (4 if algorithm == "ppo" else 2)
    assert math.isfinite(result.metrics["loss"]) and result.metrics["grad_norm"] > 0
    after = lora.lora_parameters(trainer.policy)
    assert any(not torch.equal(lora_before[n], p) for n, p in after.items())
    assert all(torch.equal(base_before[n], p) for n, p in lora.base_parameters(trainer.policy).items())


def test_a_failed_step_is_recorded_as_failed_with_its_algorithm_and_the_loop_retries(
    store, tiny_model_dir, tmp_path, engines, caplog
):
    """A step that raises (here an out-of-memory error on the first try) is recorded as a failed PPO step with its
    error, and the daemon loop backs off and trains the same data on the next try."""
    import threading

    from trainer import loop

    cfg = trainer_config(store, tiny_model_dir, tmp_path, algorithm="ppo")
    engines.append(engine := connect(cfg.database_url))
    trainer = Trainer(cfg, engine)
    real_step, tries = trainer.step, []

    def flaky_step() -> Any:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("CUDA error: out of memory")
        return real_step()

    trainer.step = flaky_step  # type: ignore[method-assign]
    trainer.config.trigger = Trigger(min_rollouts=1, min_groups=1, interval=0.05, max_steps=1, max_backoff=0.1)
    assert loop.run(trainer, stop=threading.Event()) == 1
    with engine.connect() as conn:
        steps = conn.execute(
            sa.text("SELECT algorithm, status, base_version, version, error FROM train_steps ORDER BY id")
        ).all()
        trained = conn.execute(sa.text("SELECT count(*) FROM trained_rollouts")).scalar()
    assert [tuple(s[:4]) for s in steps] == [("ppo", "failed", 0, None), ("ppo", "ok", 0, 1)]
    assert steps[0][4] == "RuntimeError: CUDA error: out of memory"
    assert trained == 4, "the data the failed step would have consumed was trained by the next one"
    said = [m for r in caplog.records if r.name == "clawgate.trainer" and "train step failed" in (m := r.getMessage())]
    assert len(said) == 2 and "out of memory" in said[0] and "recovered" in said[1], "once when it starts and clears"


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_rollback_request_republishes_the_earlier_weights_as_the_next_version(
    store, tiny_model_dir, tmp_path, engines, algorithm
):
    """The operator asks to roll back to v0 after v1 was trained: the daemon republishes v0's weights (and value
    head) as v2, records where they come from, releases the pin, and goes on from v2."""
    import threading

    from gateway.store import policy_control
    from gateway.store.models import PolicyVersion
    from trainer import loop

    cfg = trainer_config(store, tiny_model_dir, tmp_path, algorithm=algorithm)
    engines.append(engine := connect(cfg.database_url))
    trainer = Trainer(cfg, engine)
    assert trainer.step() is not None and trainer.version == 1
    policy_control.request_rollback(engine, 0)

    stop = threading.Event()
    trainer.config.trigger = Trigger(min_rollouts=1, interval=0.05)
    loop.run(trainer, stop=stop, on_wait=lambda why: stop.set())
    assert trainer.version == 2
    v0, v1, v2 = (cfg.adapter_dir / f"policy@v{v}" for v in (0, 1, 2))
    w0, w1, w2 = (load_file(v / "adapter_model.safetensors") for v in (v0, v1, v2))
    assert all(torch.equal(w0[k], w2[k]) for k in w0), "v2 carries v0's weights"
    assert any(not torch.equal(w1[k], w2[k]) for k in w1), "not v1's"
    if algorithm == "ppo":
        h0, h2 = load_file(v0 / ppo.VALUE_HEAD), load_file(v2 / ppo.VALUE_HEAD)
        assert all(torch.equal(h0[k], h2[k]) for k in h0), "and v0's value head"
    assert lora.read_manifest(v2).rolled_back_from == 0
    with Session(engine) as session:
        row = session.get(PolicyVersion, 2)
        assert row is not None and (row.parent_version, row.rolled_back_from) == (0, 0)
        assert session.get(PolicyVersion, 1).parent_version == 0  # type: ignore[union-attr]
    assert policy_control.read(engine) == policy_control.Control(None, None, policy_control.read(engine).updated_at)
