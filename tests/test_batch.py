"""Tree packing against per-path sequences on a real (tiny, random) transformers Qwen3 model.

Random rollouts (shared system prompts, continuations that branch from earlier turns, retries that share part of
a sibling's completion and are either continued or abandoned, failed calls, sub-agents with their own root) are
turned into prefix trees and packed both ways. The two layouts must give the same per-token logprobs, the same
weighted loss Σ weight · (−logp · A) and the same gradients (LoRA on q, k, v, o and a full model), with eager and
SDPA attention, also when a tree is larger than the bin budget and gets split by paths; tree packing must equal a
plain forward pass of each path alone, and the stored sampled logprobs must land on the predictions of their
tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from prefix_tree import CallView, RolloutTree, TreeConfig, TreeNode, build_tree
from trainer.batch import PackedBatch, pack_trees
from trainer.logprobs import prediction_logits, sequence_logprobs

VOCAB = 96
CONFIG = TreeConfig(keep_subagents=True, max_leaves=None)
Key = tuple[int, int, int]  # (rollout index, node id, depth): one token of one tree


def tiny_model(attn: str, seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # a wider init than 0.02, so logits (and gradients) are far from uniform
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model


def lora(model: Qwen3ForCausalLM) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so both LoRA matrices get non-zero gradients.
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------- random rollouts


def random_calls(rng: np.random.Generator, *, subagent: bool = False) -> list[CallView]:
    calls: list[CallView] = []

    def tokens(lo: int, hi: int) -> list[int]:
        return rng.integers(1, VOCAB, size=int(rng.integers(lo, hi + 1))).tolist()

    def add(prompt: list[int], completion: list[int], status: str = "ok", agent: str | None = None) -> None:
        logprobs = rng.uniform(-6.0, -0.01, size=len(completion)).tolist()
        calls.append(
            CallView(
                f"c{len(calls)}",
                prompt,
                completion,
                logprobs,
                float(len(calls)),
                status,
                policy_version=int(rng.integers(0, 4)),
                is_subagent=agent is not None,
                agent_id=agent,
            )
        )

    system = tokens(3, 10)
    states: list[list[int]] = []  # prompt + completion of calls a later call may continue
    for _ in range(int(rng.integers(2, 7))):
        if not states:
            prompt = system + tokens(1, 5)
        else:  # mostly the latest turn; sometimes a branch from an earlier one
            base = states[-1] if rng.random() < 0.6 else states[int(rng.integers(len(states)))]
            prompt = base + tokens(1, 5)
        completion = tokens(1, 6)
        add(prompt, completion)
        for _ in range(int(rng.integers(1, 3)) if rng.random() < 0.6 else 0):
            # A retry of the same prompt, sharing the start of the sibling's completion (shared trainable tokens).
            retry = completion[: int(rng.integers(0, len(completion)))] + tokens(1, 4)
            add(prompt, retry)
            if rng.random() < 0.6:  # continued: a kept branch beside the original; otherwise a dead leaf
                branch = prompt + retry + tokens(1, 4)
                extra = tokens(1, 5)
                add(branch, extra)
                states.append(branch + extra)
        states.append(prompt + completion)  # the next turn most often goes on from the original
        if rng.random() < 0.15:
            add(prompt, tokens(1, 4), status="failed")
    if subagent:
        sub, first = tokens(2, 6), tokens(1, 5)
        add(sub, first, agent="a1")
        add(sub + first + tokens(1, 3), tokens(1, 4), agent="a1")
    return calls


def random_trees(seed: int, n: int) -> list[RolloutTree]:
    rng = np.random.default_rng(seed)
    trees = [build_tree(random_calls(rng, subagent=i % 3 == 2), CONFIG) for i in range(n)]
    assert not any(t.dropped for t in trees)
    return trees


def with_model_logprobs(model: Qwen3ForCausalLM, calls: list[CallView]) -> list[CallView]:
    """The calls with completion logprobs as an engine sampling from ``model`` at temperature 1 records them."""
    out = []
    with torch.no_grad():
        for c in calls:
            seq = torch.tensor([[*c.prompt_ids, *c.completion_ids]])
            logp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
            n, k = len(c.prompt_ids), len(c.completion_ids)
            lp = logp[n - 1 : n - 1 + k].gather(-1, torch.tensor(c.completion_ids)[:, None]).squeeze(-1)
            out.append(dataclasses.replace(c, completion_logprobs=lp.tolist()))
    return out


# ---------------------------------------------------------------------------------------------- helpers


def keys(batch: PackedBatch) -> list[Key]:
    return list(zip(batch.rollout_index.tolist(), batch.nodes.tolist(), batch.depths.tolist(), strict=True))


def chain(node: TreeNode) -> list[TreeNode]:
    out = []
    cur: TreeNode | None = node
    while cur is not None:
        out.append(cur)
        cur = cur.parent
    return out[::-1]


def trainable_keys(trees: list[RolloutTree]) -> set[Key]:
    """Every trainable token of every kept path that has a predecessor."""
    out = set()
    for r, tree in enumerate(trees):
        for leaf in tree.leaves():
            for node in chain(leaf):
                for k in np.flatnonzero(node.trainable):
                    if node.depth + k > 0:
                        out.add((r, node.id, node.depth + int(k)))
    return out


def run(model: Any, batches: list[PackedBatch], advantages: torch.Tensor) -> tuple[dict[Key, list[float]], float]:
    """Per-token logprobs and the weighted loss Σ weight · (−logp · A); gradients accumulate in ``model``."""
    logps: dict[Key, list[float]] = defaultdict(list)
    total = 0.0
    for batch in batches:
        lp = sequence_logprobs(model, batch)
        loss = (batch.weights * (-lp * advantages[batch.rollout_index])).sum()
        loss.backward()
        total += loss.item()
        for key, value in zip(keys(batch), lp.tolist(), strict=True):
            logps[key].append(value)
    return logps, total


def grads(model: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    scale = max(float(g.abs().max()) for g in a.values())
    assert scale > 1e-3  # gradients are not all vanishing: the comparison means something
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=2e-6 * scale, msg=name)


# ---------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("split", [False, True], ids=["whole-trees", "split-trees"])
def test_tree_packing_gives_per_path_logprobs_loss_and_lora_gradients(attn: str, split: bool) -> None:
    trees = random_trees(seed=7, n=6)
    longest = max(leaf.end for t in trees for leaf in t.leaves())
    biggest = max(t.report.tree_tokens for t in trees)
    # Split: a budget that fits every path but not the biggest trees, which get cut into sub-forests of paths.
    budget = longest + 2 if split else 4096
    assert not split or biggest > budget
    model = lora(tiny_model(attn))
    advantages = torch.tensor(np.random.default_rng(3).normal(size=len(trees)), dtype=torch.float32)

    tree_batches = pack_trees(trees, "tree", budget)
    path_batches = pack_trees(trees, "paths", budget)
    tree_lp, tree_loss = run(model, tree_batches, advantages)
    tree_grads = grads(model)
    path_lp, path_loss = run(model, path_batches, advantages)
    path_grads = grads(model)

    # Same tokens, same logprobs: each shared token once per sub-forest holding it vs once per kept path through it.
    assert tree_lp.keys() == path_lp.keys() == trainable_keys(trees)
    for key, values in path_lp.items():
        assert max(abs(v - tree_lp[key][0]) for v in values) < 2e-5, key
        if not split:
            assert len(tree_lp[key]) == 1
    assert any(len(v) > 1 for v in path_lp.values())  # there are shared trainable tokens
    # ... and positions that predict the first tokens of several trainable children
    assert any(b.sources.unique().numel() < b.num_predictions for b in tree_batches)
    assert math.isclose(tree_loss, path_loss, rel_tol=1e-5, abs_tol=1e-4)
    assert_same_grads(tree_grads, path_grads)
    assert all("lora_" in name for name in tree_grads)
    total_weight = [sum(float(b.weights.sum()) for b in batches) for batches in (tree_batches, path_batches)]
    assert total_weight[0] == pytest.approx(total_weight[1], rel=1e-6)
    assert total_weight[0] == pytest.approx(len(trainable_keys(trees)), rel=1e-6)

    tree_tokens = sum(b.num_tokens for b in tree_batches)
    path_tokens = sum(b.real_tokens for b in path_batches)
    if not split:
        # Whole trees, no padding: exactly the kept tree tokens, fewer than the paths hold together.
        assert tree_tokens == sum(t.report.tree_tokens for t in trees)
        assert tree_tokens < path_tokens, (tree_tokens, path_tokens)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_model_gradients_match(attn: str) -> None:
    trees = random_trees(seed=11, n=4)
    model = tiny_model(attn, seed=2)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    _, loss_a = run(model, pack_trees(trees, "tree"), advantages)
    grads_a = grads(model)
    _, loss_b = run(model, pack_trees(trees, "paths"), advantages)
    grads_b = grads(model)
    assert math.isclose(loss_a, loss_b, rel_tol=1e-5)
    assert len(grads_a) == len(list(model.parameters()))  # every parameter, embeddings and norms included
    assert_same_grads(grads_a, grads_b)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_packing_equals_a_plain_forward_of_each_path_and_the_sampled_logprobs(attn: str) -> None:
    model = tiny_model(attn, seed=4)
    rng = np.random.default_rng(5)
    trees = [build_tree(with_model_logprobs(model, random_calls(rng)), CONFIG) for _ in range(4)]
    with torch.no_grad():
        batches = pack_trees(trees, "tree", all_tokens=True)
        packed: dict[Key, float] = {}
        rollout: dict[Key, float] = {}
        for b in batches:
            lp = sequence_logprobs(model, b)
            packed.update(zip(keys(b), lp.tolist(), strict=True))
            for key, value, train in zip(keys(b), b.rollout_logprobs.tolist(), b.trainable.tolist(), strict=True):
                if train:
                    rollout[key] = value
        checked = 0
        for r, tree in enumerate(trees):
            for leaf in tree.leaves():
                nodes = [n for n in chain(leaf) for _ in range(len(n.tokens))]
                path = torch.from_numpy(np.concatenate([n.tokens for n in chain(leaf)]))[None]
                logp = torch.log_softmax(model(input_ids=path).logits[0].float(), -1)
                for d in range(1, path.shape[1]):
                    key = (r, nodes[d].id, d)
                    assert abs(packed[key] - float(logp[d - 1, path[0, d]])) < 2e-5, key
                    checked += 1
    assert checked > 100
    # The logprob stored for each generated token is the one the model gives at its prediction: aligned.
    assert rollout.keys() == trainable_keys(trees)
    for key, value in rollout.items():
        assert abs(value - packed[key]) < 2e-5, key


def test_logits_and_temperature() -> None:
    model = tiny_model("sdpa", seed=6)
    (batch,) = pack_trees(random_trees(seed=2, n=1), "tree")
    with torch.no_grad():
        logits = prediction_logits(model, batch)
        hot = prediction_logits(model, batch, temperature=2.0)
        lp = sequence_logprobs(model, batch)
    assert logits.shape == (batch.num_predictions, VOCAB)
    torch.testing.assert_close(hot, logits / 2.0)
    ref = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(lp, ref.log_prob(batch.targets))


# ---------------------------------------------------------------------------------------------- layout


def test_several_children_are_predicted_from_their_parents_last_token() -> None:
    system = [1, 2, 3, 4, 5, 6]
    calls = [
        CallView("a", system, [7, 8, 9], [-1.0, -2.0, -3.0], 0, "ok", policy_version=1),
        CallView("b", system, [7, 8, 10], [-1.1, -2.1, -3.5], 1, "ok", policy_version=1),
        CallView("c", [*system, 7, 8, 9, 11, 12], [13, 14], [-4.0, -5.0], 2, "ok", policy_version=2),
        CallView("d", [*system, 7, 8, 10, 15], [16], [-6.0], 3, "ok", policy_version=3),
    ]
    tree = build_tree(calls)
    assert tree.report.leaves == 2
    (t,) = pack_trees([tree], "tree")
    assert t.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 10, 15, 16]]
    assert t.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 8, 9, 10]]
    # Position 7 (token 8, the shared trainable prefix's end) predicts 9 on one branch and 10 on the other.
    assert t.sources.tolist() == [5, 6, 7, 10, 11, 7, 14]
    assert t.targets.tolist() == [7, 8, 9, 13, 14, 10, 16]
    assert t.target_positions.tolist() == [6, 7, 8, 11, 12, 13, 15]
    assert t.depths.tolist() == [6, 7, 8, 11, 12, 8, 10]
    # The later call's logprob wins on the shared tokens 7, 8 (the tree's rule); each target keeps its own.
    assert t.rollout_logprobs.tolist() == pytest.approx([-1.1, -2.1, -3.0, -4.0, -5.0, -3.5, -6.0])
    assert t.versions.tolist() == [1, 1, 1, 2, 2, 1, 3]
    assert t.weights.tolist() == [1.0] * 7
    assert t.trainable.all()

    assert not t.linear
    allowed = t.tree_mask()[0, 0]
    # Branch b (positions 13..15) sees the shared prefix 0..7 and itself, never branch a (8..12).
    assert allowed[13].nonzero().flatten().tolist() == [*range(8), 13]
    assert allowed[15].nonzero().flatten().tolist() == [*range(8), 13, 14, 15]
    assert allowed[12].nonzero().flatten().tolist() == list(range(13))
    eager = t.attention_mask("eager", torch.float32)
    assert eager.shape == (1, 1, 16, 16) and eager.dtype == torch.float32
    assert torch.equal(eager[0, 0] == 0, allowed)
    assert (eager[0, 0][~allowed] == torch.finfo(torch.float32).min).all()

    (p,) = pack_trees([tree], "paths")
    assert p.input_ids.tolist() == [
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14],
        [1, 2, 3, 4, 5, 6, 7, 8, 10, 15, 16, 0, 0],
    ]
    assert p.padding_mask.sum(1).tolist() == [13, 11]
    assert p.rows.tolist() == [0] * 5 + [1] * 4
    assert p.sources.tolist() == [5, 6, 7, 10, 11, 5, 6, 7, 9]
    assert p.weights.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0]  # 7, 8 lie on both paths
    assert p.token_nodes is None and p.attention_mask().shape == (2, 13)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_single_path_tree_uses_the_models_causal_mask(attn: str) -> None:
    calls = [
        CallView("a", [1, 2, 3], [4, 5], [-1.0, -2.0], 0.0, "ok"),
        CallView("b", [1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [-1.0, -2.0, -3.0], 1.0, "ok"),
    ]
    branched = build_tree([*calls, CallView("c", [1, 2, 3, 4, 5, 11], [12], [-1.0], 2.0, "ok")])
    (one,) = pack_trees([build_tree(calls)], "tree")
    assert one.linear and one.attention_mask(attn).shape == (1, 10)
    assert one.position_ids.tolist() == [list(range(10))]
    (two,) = pack_trees([build_tree(calls), branched], "tree")  # two trees in one bin: block mask
    assert not two.linear and two.attention_mask(attn).dim() == 4
    model = tiny_model(attn, seed=8)
    with torch.no_grad():
        fast = sequence_logprobs(model, one)
        dense = sequence_logprobs(model, dataclasses.replace(one, linear=False))
        assert dataclasses.replace(one, linear=False).attention_mask(attn).dim() == 4
        assert one.num_predictions == 5
        torch.testing.assert_close(fast, dense, rtol=0, atol=2e-5)
        torch.testing.assert_close(sequence_logprobs(model, two)[:5], fast, rtol=0, atol=2e-5)


@pytest.mark.parametrize("seed", range(6))
def test_mask_and_positions_follow_the_tree(seed: int) -> None:
    trees = random_trees(seed=100 + seed, n=3)
    for batch in pack_trees(trees, "tree", 4096, all_tokens=True):
        allowed = batch.tree_mask()[0, 0]
        # Every token's node, from the predictions (a root's first token has none).
        layout: dict[int, TreeNode] = {}
        for r, node_id, pos in zip(
            batch.rollout_index.tolist(), batch.nodes.tolist(), batch.target_positions.tolist(), strict=True
        ):
            layout[pos] = trees[r].nodes[node_id]
        owner = [layout.get(i) for i in range(batch.num_tokens)]
        for i in reversed(range(batch.num_tokens)):
            if owner[i] is None:  # a root's first token: the node of the next token, or that node's parent
                nxt = owner[i + 1]
                assert nxt is not None
                owner[i] = nxt if nxt.depth == 0 else nxt.parent
                assert owner[i] is not None and owner[i].depth == 0  # type: ignore[union-attr]
        for i in range(batch.num_tokens):
            ni = owner[i]
            assert ni is not None
            assert batch.position_ids[0, i] == ni.depth + sum(1 for j in range(i) if owner[j] is ni)
            ancestors = {id(n) for n in chain(ni)}
            for j in range(batch.num_tokens):
                nj = owner[j]
                expected = id(nj) in ancestors and j <= i
                assert bool(allowed[i, j]) == expected, (i, j)


def test_context_tokens_are_never_trained() -> None:
    trees = random_trees(seed=21, n=5)
    default = [k for b in pack_trees(trees, "tree") for k in keys(b)]
    assert set(default) == trainable_keys(trees) and len(default) == len(set(default))
    n_context = 0
    for strategy in ("tree", "paths"):
        for b in pack_trees(trees, strategy, all_tokens=True):
            context = ~b.trainable
            n_context += int(context.sum())
            assert (b.weights[context] == 0).all()
            assert b.rollout_logprobs[context].isnan().all() and (b.versions[context] == -1).all()
            assert (b.weights[b.trainable] > 0).all() and not b.rollout_logprobs[b.trainable].isnan().any()
    assert n_context > 0
    # all_tokens adds context predictions and changes nothing about the trainable ones.
    only = pack_trees(trees, "tree")
    every = pack_trees(trees, "tree", all_tokens=True)
    for a, b in zip(only, every, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        for name in ("sources", "targets", "weights", "rollout_logprobs", "versions"):
            assert torch.equal(getattr(a, name), getattr(b, name)[b.trainable]), name


@pytest.mark.parametrize("budget", [48, 64, 100, 160, 400])
def test_bins_respect_the_budget(budget: int) -> None:
    trees = random_trees(seed=33, n=12)
    longest = max(leaf.end for t in trees for leaf in t.leaves())
    if longest > budget:
        with pytest.raises(ValueError, match="max_tokens_per_bin"):
            pack_trees(trees, "tree", budget)
        with pytest.raises(ValueError, match="max_tokens_per_bin"):
            pack_trees(trees, "paths", budget)
        return
    for strategy in ("tree", "paths"):
        batches = pack_trees(trees, strategy, budget)
        assert all(b.num_tokens <= budget for b in batches)
        weight: dict[Key, float] = defaultdict(float)
        for b in batches:
            for key, w in zip(keys(b), b.weights.tolist(), strict=True):
                weight[key] += w
        # Every trainable token is trained with total weight 1, whether its tree was split or not.
        assert weight.keys() == trainable_keys(trees)
        assert all(abs(w - 1.0) < 1e-6 for w in weight.values())
        if strategy == "tree":
            assert all(b.input_ids.shape[0] == 1 for b in batches)
            # First fit: at most one bin is at most half full.
            assert sum(b.num_tokens <= budget / 2 for b in batches) <= 1
            if max(t.report.tree_tokens for t in trees) <= budget:
                assert sum(b.num_tokens for b in batches) == sum(t.report.tree_tokens for t in trees)
            else:  # some tree was split by paths: its shared nodes are computed once per sub-forest
                assert sum(b.num_tokens for b in batches) > sum(t.report.tree_tokens for t in trees)


def test_dropped_and_untrainable_rollouts_produce_nothing() -> None:
    calls = [CallView("a", [1, 2, 3], [4, 5], [-1.0, -1.0], 0.0, "ok")]
    # Three continuations of the first turn, each with its own tool result: three leaves.
    calls += [CallView(f"c{i}", [1, 2, 3, 4, 5, 60 + i], [70 + i], [-1.0], 1.0 + i, "ok") for i in range(3)]
    dropped = build_tree(calls, TreeConfig(max_leaves=2))
    assert dropped.dropped
    untrainable = build_tree([CallView("x", [1, 2, 3], [], [], 0.0, "ok")])
    assert untrainable.report.trainable_tokens == 0
    for strategy in ("tree", "paths"):
        assert pack_trees([dropped, untrainable], strategy) == []
    # Asked for every token, the context-only rollout is still laid out (reference logprobs), the dropped one not.
    (only,) = pack_trees([dropped, untrainable], "tree", all_tokens=True)
    assert only.rollout_index.tolist() == [1, 1] and only.weights.sum() == 0
    assert pack_trees([], "tree") == []


def test_bad_arguments_are_refused() -> None:
    trees = random_trees(seed=1, n=1)
    with pytest.raises(ValueError, match="strategy"):
        pack_trees(trees, "calls")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        pack_trees(trees, "tree", 0)
    (batch,) = pack_trees(trees, "tree")
    with pytest.raises(ValueError, match="dense 4-D mask"):
        batch.attention_mask("flash_attention_2")


def test_a_constrained_calls_tokens_carry_no_loss() -> None:
    """Structured outputs' rule (prefix_tree/build.py): a completion sampled under a grammar has masked-distribution
    logprobs, which the trainer's unmasked recomputation cannot be compared with, so its tokens are context in the
    batch: no weight, no rollout logprob, and the loss and its gradient do not depend on them."""
    model = lora(tiny_model("sdpa"))
    first = CallView("a", [1, 2, 3], [4, 5, 6], [-1.0, -1.1, -1.2], 0.0, "ok", 1)
    second = CallView("b", [1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11], [-0.5] * 4, 1.0, "ok", 1, constrained=True)
    [every] = pack_trees([build_tree([first, second], CONFIG)], all_tokens=True)
    later = every.depths >= 7  # the second call's completion positions
    assert later.sum() == 4 and not every.trainable[later].any() and bool((every.weights[later] == 0).all())
    assert every.trainable[~later].sum() > 0 and bool(torch.isnan(every.rollout_logprobs[later]).all())
    [batch] = pack_trees([build_tree([first, second], CONFIG)])
    _, loss = run(model, [batch], torch.tensor([1.0]))
    reference = grads(model)
    # The same answer unconstrained is trained: its tokens have weight.
    [free] = pack_trees([build_tree([first, dataclasses.replace(second, constrained=False)], CONFIG)])
    assert bool((free.weights[free.depths >= 7] > 0).all())
    # The loss sees the first call's tokens only: the same as a batch of the first call alone.
    [alone] = pack_trees([build_tree([first], CONFIG)])
    _, loss_alone = run(model, [alone], torch.tensor([1.0]))
    assert loss == pytest.approx(loss_alone, rel=1e-5)
    assert_same_grads(reference, grads(model))
