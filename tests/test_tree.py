"""Prefix-tree reconstruction and filtering, checked against a slow, obviously-correct reference.

The reference keeps one dict entry per distinct token prefix (a per-token trie) and applies each filtering rule
by brute force over all pairs of calls. Hundreds of seeded random rollouts (retries, identical retries, strict
prefixes, compaction-like rewrites, new roots, sub-agents, empty completions, failed calls, tied start times,
shuffled input order) must give the same tree, the same trainable positions and logprobs, and the same
decisions. Hand-written cases pin each rule and the token-saving figure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from prefix_tree import CallView, RolloutTree, TreeConfig, TreeNode, build_tree, filters

Prefix = tuple[int, ...]


# ---------------------------------------------------------------------------------------------- reference


@dataclass
class RefCall:
    call: CallView
    order: int
    group: str
    prompt: Prefix
    seq: Prefix
    relation: str = ""
    branch: str | None = None
    continued: bool = False
    dead: bool = False


@dataclass
class Reference:
    fates: dict[str, str] = field(default_factory=dict)
    relations: dict[str, str] = field(default_factory=dict)
    all_prefixes: set[tuple[str, Prefix]] = field(default_factory=set)
    kept_prefixes: set[tuple[str, Prefix]] = field(default_factory=set)
    # (group, prefix ending with a generated token) -> (logprob, version) of the latest kept generator
    trainable: dict[tuple[str, Prefix], tuple[float, int]] = field(default_factory=dict)
    leaves: set[tuple[str, Prefix]] = field(default_factory=set)
    naive_tokens: int = 0
    dead_leaves: int = 0
    dead_leaf_tokens: int = 0
    # (group, prefix ending with a generated token) whose latest kept generator was constrained
    constrained: set[tuple[str, Prefix]] = field(default_factory=set)
    compaction_calls: int = 0
    compaction_branches: int = 0
    dropped: bool = False


def _lcp(a: Prefix, b: Prefix) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reference(calls: list[CallView], config: TreeConfig) -> Reference:
    ref = Reference()
    ordered = sorted(enumerate(calls), key=lambda item: (item[1].started_at, item[0]))
    groups: dict[str, list[RefCall]] = {}
    for order, (_, call) in enumerate(ordered):
        if call.status not in config.keep_statuses:
            ref.fates[call.id] = call.status
            continue
        group = "main"
        if call.is_subagent:
            group = "subagent" if call.agent_id is None else f"subagent:{call.agent_id}"
            if not config.keep_subagents:
                ref.fates[call.id] = "subagent"
                continue
        prompt = tuple(int(t) for t in call.prompt_ids)
        seq = prompt + tuple(int(t) for t in call.completion_ids)
        groups.setdefault(group, []).append(RefCall(call, order, group, prompt, seq))

    placed: list[RefCall] = []
    for members in groups.values():
        for k, c in enumerate(members):
            prior = members[:k]
            if not prior:
                c.relation = filters.ROOT
            else:
                shared = min(max(_lcp(c.prompt, e.seq) for e in prior), len(c.prompt))
                head = c.prompt[:shared]
                at_end = [e for e in prior if e.seq == head]
                at_prompt = [e for e in prior if e.prompt == head]
                anchor: RefCall | None = None
                shares_nothing = shared == 0 and not at_end and not at_prompt
                if shares_nothing or shared < config.min_shared_fraction * len(c.prompt):
                    c.relation = filters.NEW_ROOT
                elif at_end and (not at_prompt or at_end[-1].order >= at_prompt[-1].order):
                    c.relation, anchor = filters.CONTINUATION, at_end[-1]
                elif at_prompt:
                    c.relation, anchor = filters.RETRY, at_prompt[-1]
                else:
                    c.relation = filters.COMPACTION
                if anchor is not None:
                    c.branch = anchor.branch
                elif c.relation in (filters.NEW_ROOT, filters.COMPACTION):
                    c.branch = c.call.id
        for e in members:
            later = [c for c in members if c.order > e.order]
            e.continued = any(len(c.prompt) > len(e.prompt) and c.prompt[: len(e.seq)] == e.seq for c in later)
        by_prompt: dict[Prefix, list[RefCall]] = {}
        for e in members:
            by_prompt.setdefault(e.prompt, []).append(e)
        for same in by_prompt.values():
            if len(same) < 2:
                continue
            if any(e.continued for e in same):
                for e in same:
                    e.dead = not e.continued
            else:
                for e in same[:-1]:
                    e.dead = True
        placed.extend(members)

    placed.sort(key=lambda c: c.order)
    kept: list[RefCall] = []
    dead_dropped: list[RefCall] = []
    for c in placed:
        ref.relations[c.call.id] = c.relation
        for i in range(1, len(c.seq) + 1):
            ref.all_prefixes.add((c.group, c.seq[:i]))
        if c.branch is not None:
            ref.compaction_calls += 1
            ref.compaction_branches += c.branch == c.call.id
            if config.drop_compaction:
                ref.fates[c.call.id] = "compaction"
                continue
        if c.dead:
            ref.dead_leaves += 1
            if config.drop_dead_leaves:
                ref.fates[c.call.id] = "dead_leaf"
                dead_dropped.append(c)
                continue
        ref.fates[c.call.id] = "kept"
        kept.append(c)

    for c in kept:  # time order: later generators overwrite
        ref.naive_tokens += len(c.seq)
        for i in range(1, len(c.seq) + 1):
            ref.kept_prefixes.add((c.group, c.seq[:i]))
        version = -1 if c.call.policy_version is None else c.call.policy_version
        for j in range(len(c.call.completion_ids)):
            key = (c.group, c.seq[: len(c.prompt) + j + 1])
            if c.call.constrained:  # context; the latest generator decides
                ref.trainable.pop(key, None)
                ref.constrained.add(key)
            else:
                ref.trainable[key] = (float(c.call.completion_logprobs[j]), version)
                ref.constrained.discard(key)
    dead_positions = {
        (c.group, c.seq[: len(c.prompt) + j + 1])
        for c in dead_dropped
        if not c.call.constrained
        for j in range(len(c.call.completion_ids))
    }
    ref.dead_leaf_tokens = len(dead_positions - set(ref.trainable) - ref.constrained)
    ends = {(c.group, c.seq) for c in kept if c.seq}
    ref.leaves = {
        (g, s) for g, s in ends if not any(g2 == g and len(s2) > len(s) and s2[: len(s)] == s for g2, s2 in ends)
    }
    ref.dropped = config.max_leaves is not None and len(ref.leaves) > config.max_leaves
    return ref


# ---------------------------------------------------------------------------------------------- random rollouts


def random_calls(rng: np.random.Generator) -> list[CallView]:
    """A random rollout: a main agent and maybe sub-agents, with every kind of branching the rules know."""
    vocab = int(rng.integers(2, 7))  # small: accidental shared tokens and identical retries happen often

    def toks(lo: int, hi: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, int(rng.integers(lo, hi + 1)))]

    histories: dict[str | None, list[tuple[list[int], list[int]]]] = {}  # agent -> [(prompt, completion)]
    system = toks(0, 5)
    calls: list[CallView] = []
    t = 0.0
    for k in range(int(rng.integers(1, 16))):
        sub = rng.random() < 0.15
        agent: str | None = str(rng.choice(["a", "b", "none"])) if sub else "main"
        agent = None if agent == "none" else agent
        hist = histories.setdefault(agent, [])
        action = rng.choice(
            ["continue", "continue", "continue", "retry", "retry_same", "retry_more", "rewrite", "new", "prefix"]
        )
        completion = toks(0, 4)
        if not hist or action == "new":
            prompt = (system if rng.random() < 0.7 else []) + toks(0, 4)
        else:
            base_prompt, base_completion = hist[-1] if rng.random() < 0.6 else hist[int(rng.integers(len(hist)))]
            base = base_prompt + base_completion
            if action == "continue":
                prompt = base + toks(0, 3)
            elif action == "retry":
                prompt = list(base_prompt)
            elif action == "retry_same":
                prompt, completion = list(base_prompt), list(base_completion)
            elif action == "retry_more":
                prompt = base_prompt + toks(1, 3)
            elif action == "rewrite":
                prompt = base[: int(rng.integers(0, len(base) + 1))] + toks(0, 3)
            else:  # a strict prefix of an earlier prompt
                prompt = base_prompt[: int(rng.integers(0, len(base_prompt) + 1))]
        status = str(rng.choice(["ok"] * 8 + ["failed", "cancelled"]))
        if status == "ok":
            hist.append((prompt, completion))
        t += float(rng.choice([0.0, 1.0, 1.0, 2.5]))
        calls.append(
            CallView(
                id=f"c{k}",
                prompt_ids=prompt if rng.random() < 0.5 else np.asarray(prompt, dtype=np.uint32),
                completion_ids=completion,
                completion_logprobs=[float(x) for x in -rng.random(len(completion))],
                started_at=t,
                status=status,
                policy_version=None if rng.random() < 0.2 else int(rng.integers(0, 4)),
                is_subagent=sub,
                agent_id=agent if sub else None,
            )
        )
    order = rng.permutation(len(calls))
    return [calls[i] for i in order]


def with_constrained(calls: list[CallView], rng: np.random.Generator) -> list[CallView]:
    """The same rollout with some calls sampled under a grammar (a separate generator: the rollouts stay as seeded)."""
    return [dataclasses.replace(c, constrained=bool(rng.random() < 0.35)) for c in calls]


def random_config(rng: np.random.Generator) -> TreeConfig:
    return TreeConfig(
        drop_dead_leaves=bool(rng.random() < 0.7),
        drop_compaction=bool(rng.random() < 0.7),
        min_shared_fraction=float(rng.choice([0.0, 0.0, 0.4])),
        keep_subagents=bool(rng.random() < 0.5),
        max_leaves=[None, 1, 2, 4, 8][int(rng.integers(5))],
    )


# ---------------------------------------------------------------------------------------------- checks


def node_prefix(tree: RolloutTree, node_id: int) -> Prefix:
    return tuple(int(t) for t in tree.path_tokens(node_id))


def assert_matches_reference(calls: list[CallView], config: TreeConfig) -> RolloutTree:
    tree = build_tree(calls, config)
    ref = reference(calls, config)
    by_id = {c.id: c for c in calls}

    # Decisions.
    assert {cid: r.fate for cid, r in tree.calls.items()} == ref.fates
    assert {cid: r.relation for cid, r in tree.calls.items() if r.relation is not None} == ref.relations
    report = tree.report
    assert report.dead_leaves == ref.dead_leaves
    assert report.compaction_calls == ref.compaction_calls
    assert report.compaction_branches == ref.compaction_branches
    assert report.kept_calls == sum(f == "kept" for f in ref.fates.values())
    assert report.failed_calls == sum(f in ("failed", "cancelled") for f in ref.fates.values())
    assert tree.dropped == ref.dropped

    # Structure: every placed call is a root-to-node path; each distinct prefix is stored exactly once.
    roots = {r.trajectory: r for r in tree.roots}
    for cid, rec in tree.calls.items():
        if rec.end_node is None:
            assert rec.fate in ("failed", "cancelled", "subagent")
            continue
        assert rec.prompt_node is not None
        call = by_id[cid]
        prompt = tuple(int(t) for t in call.prompt_ids)
        seq = prompt + tuple(int(t) for t in call.completion_ids)
        assert node_prefix(tree, rec.end_node) == seq
        assert node_prefix(tree, rec.prompt_node) == prompt
        assert cid in tree.nodes[rec.end_node].calls_ending
        assert cid in tree.nodes[rec.prompt_node].prompts_ending
        assert tree.nodes[rec.end_node].trajectory == rec.trajectory
        assert roots[rec.trajectory].parent is None
    assert sum(len(n.tokens) for n in tree.nodes) == len(ref.all_prefixes) == report.tree_tokens_all
    assert sum(len(n.tokens) for n in tree.nodes if n.kept) == len(ref.kept_prefixes) == report.tree_tokens
    for node in tree.nodes:
        if node.parent is not None:
            assert len(node.tokens) > 0
            # Compressed edges: a node only ends where a call boundary or a fork forces it.
            assert len(node.children) != 1 or node.calls_ending or node.prompts_ending
            assert node.depth == node.parent.end
            assert node.parent.children[int(node.tokens[0])] is node
        assert len(node.trainable) == len(node.logprobs) == len(node.versions) == len(node.tokens)
        if not node.kept:
            assert not node.trainable.any()

    # Trainable positions and their logprobs, through every kept node.
    seen_trainable = 0
    for node in tree.nodes:
        if not node.kept:
            continue
        prefix = node_prefix(tree, node.id)
        group = node.trajectory
        for j in range(len(node.tokens)):
            key = (group, prefix[: node.depth + j + 1])
            if key in ref.trainable:
                logprob, version = ref.trainable[key]
                assert node.trainable[j], key
                assert node.logprobs[j] == logprob
                assert node.versions[j] == version
                seen_trainable += 1
            else:
                assert not node.trainable[j], key
                assert math.isnan(node.logprobs[j]) and node.versions[j] == -1
    assert seen_trainable == len(ref.trainable) == report.trainable_tokens
    constrained = {
        (node.trajectory, node_prefix(tree, node.id)[: node.depth + j + 1])
        for node in tree.nodes
        if node.kept and node.constrained
        for j in range(len(node.tokens))
    }
    assert constrained == ref.constrained and report.constrained_tokens == len(ref.constrained)
    assert report.dead_leaf_tokens == ref.dead_leaf_tokens
    assert report.naive_tokens == ref.naive_tokens
    assert report.leaves == len(ref.leaves)

    # Paths: the maximal kept trajectories, flattened with the same per-position facts.
    paths = tree.paths()
    if ref.dropped:
        assert paths == []
    else:
        got = {(p.trajectory, tuple(int(t) for t in p.tokens)) for p in paths}
        assert got == ref.leaves
        assert len(paths) == len(got)
        for p in paths:
            for i in range(len(p.tokens)):
                key = (p.trajectory, tuple(int(t) for t in p.tokens[: i + 1]))
                assert bool(p.trainable[i]) == (key in ref.trainable)
                if key in ref.trainable:
                    assert (p.logprobs[i], p.versions[i]) == ref.trainable[key]
            for cid in p.calls:
                assert tree.calls[cid].fate == "kept"
    json.dumps(tree.to_json(include_tokens=True))
    assert tree.render_text()
    return tree


@pytest.mark.parametrize("seed", range(400))
def test_random_rollouts_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    calls = random_calls(rng)
    assert_matches_reference(calls, random_config(rng))
    assert_matches_reference(calls, TreeConfig())
    # With constrained calls: their completions are context unless a later kept call generated them again.
    constrained = with_constrained(calls, np.random.default_rng(10_000 + seed))
    assert_matches_reference(constrained, random_config(rng))
    assert_matches_reference(constrained, TreeConfig())


def test_random_rollouts_cover_every_rule() -> None:
    """The generator really produces the situations the property test claims to cover."""
    seen: dict[str, int] = {}
    for seed in range(400):
        rng = np.random.default_rng(seed)
        calls = random_calls(rng)
        tree = build_tree(calls, TreeConfig(keep_subagents=True, max_leaves=None))
        for rec in tree.calls.values():
            seen[rec.fate] = seen.get(rec.fate, 0) + 1
            if rec.relation:
                seen[rec.relation] = seen.get(rec.relation, 0) + 1
        seen["empty_completion"] = seen.get("empty_completion", 0) + sum(not len(c.completion_ids) for c in calls)
        seen["dropped"] = seen.get("dropped", 0) + build_tree(calls, TreeConfig(max_leaves=2)).dropped
        seen["branching"] = seen.get("branching", 0) + (tree.report.branch_points > 0)
        mixed = with_constrained(calls, np.random.default_rng(10_000 + seed))
        seen["constrained"] = seen.get("constrained", 0) + (build_tree(mixed).report.constrained_tokens > 0)
        seen["constrained_overlap"] = seen.get("constrained_overlap", 0) + _constrained_overlap(mixed)
    for what in [
        "kept", "dead_leaf", "compaction", "failed", "cancelled", "root", "continuation", "retry", "new_root",
        "empty_completion", "dropped", "branching", "constrained", "constrained_overlap",
    ]:  # fmt: skip
        assert seen.get(what, 0) >= 10, (what, seen)


def _constrained_overlap(calls: list[CallView]) -> bool:
    """Whether a constrained and an unconstrained kept call generated the same position (latest wins)."""
    tree = build_tree(calls)
    generated: dict[bool, set[tuple[str | None, Prefix]]] = {False: set(), True: set()}
    for c in calls:
        rec = tree.calls[c.id]
        if rec.fate == "kept":
            seq = tuple(int(t) for t in [*c.prompt_ids, *c.completion_ids])
            n = len(c.prompt_ids)
            generated[c.constrained].update((rec.trajectory, seq[: n + j + 1]) for j in range(len(c.completion_ids)))
    return bool(generated[False] & generated[True])


# ---------------------------------------------------------------------------------------------- hand-written cases


def call(
    cid: str,
    prompt: list[int],
    completion: list[int],
    t: float,
    status: str = "ok",
    version: int | None = 1,
    **kw: Any,
) -> CallView:
    # Distinct logprobs per call and position, so a mix-up is visible.
    logprobs = [-1.0 - sum(map(ord, cid)) / 100 - 0.001 * j for j in range(len(completion))]
    return CallView(cid, prompt, completion, logprobs, t, status, policy_version=version, **kw)


SYSTEM = [100, 101, 102, 103]


def end_node(tree: RolloutTree, call_id: str) -> TreeNode:
    node_id = tree.calls[call_id].end_node
    assert node_id is not None
    return tree.nodes[node_id]


def test_tito_continuation_keeps_generated_tokens_trainable_in_later_prompts() -> None:
    c1 = call("c1", [*SYSTEM, 1], [10, 11], 1, version=3)
    c2 = call("c2", [*SYSTEM, 1, 10, 11, 2], [20], 2, version=4)
    tree = build_tree([c2, c1])  # input order does not matter, started_at does
    (path,) = tree.paths()
    assert path.tokens.tolist() == [*SYSTEM, 1, 10, 11, 2, 20]
    assert path.trainable.tolist() == [False] * 5 + [True, True, False, True]
    np.testing.assert_array_equal(path.logprobs[5:7], c1.completion_logprobs)
    assert path.logprobs[8] == c2.completion_logprobs[0]
    assert np.isnan(path.logprobs[:5]).all() and np.isnan(path.logprobs[7])
    assert path.versions.tolist() == [-1] * 5 + [3, 3, -1, 4]
    assert path.calls == ("c2",)
    assert tree.calls["c2"].relation == filters.CONTINUATION and tree.calls["c2"].anchor == "c1"


def test_naive_versus_tree_tokens_on_a_linear_conversation() -> None:
    prompt, calls = [*SYSTEM], []
    for k in range(5):
        prompt = [*prompt, 50 + k]
        completion = [60 + k, 70 + k]
        calls.append(call(f"c{k}", prompt, completion, k))
        prompt = prompt + completion
    tree = build_tree(calls)
    r = tree.report
    # Per-call sequences are 7, 10, 13, 16, 19 tokens long; the tree holds the last one once.
    assert r.naive_tokens == 7 + 10 + 13 + 16 + 19 == 65
    assert r.tree_tokens == r.max_depth == 19
    assert r.trainable_tokens == 10
    assert r.leaves == 1 and r.branch_points == 0
    assert r.saving == pytest.approx(65 / 19)
    assert "65 per call" in tree.render_text() and "3.42x" in tree.render_text()


def test_identical_retries_count_a_token_once_with_the_later_logprob() -> None:
    a = call("a1", [*SYSTEM, 1], [10, 11], 1, version=1)
    b = call("b2", [*SYSTEM, 1], [10, 11], 2, version=2)  # the same tokens sampled again
    c = call("c3", [*SYSTEM, 1, 10, 11, 5], [12], 3, version=2)
    tree = build_tree([a, b, c])
    assert {cid: r.fate for cid, r in tree.calls.items()} == {"a1": "kept", "b2": "kept", "c3": "kept"}
    (path,) = tree.paths()
    assert path.trainable.sum() == tree.report.trainable_tokens == 3
    np.testing.assert_array_equal(path.logprobs[5:7], b.completion_logprobs)
    assert path.versions[5:7].tolist() == [2, 2]
    assert tree.report.naive_tokens == 7 + 7 + 9 and tree.report.tree_tokens == 9


def test_constrained_completion_is_context_and_counted() -> None:
    free = call("c1", [*SYSTEM, 1], [10, 11], 1, version=3)
    # A structured-output follow-up: its logprobs are the grammar-masked distribution's.
    forced = call("c2", [*SYSTEM, 1, 10, 11, 2], [20, 21, 22], 2, version=3, constrained=True)
    tree = build_tree([free, forced])
    assert {cid: r.fate for cid, r in tree.calls.items()} == {"c1": "kept", "c2": "kept"}
    (path,) = tree.paths()
    assert path.tokens.tolist() == [*SYSTEM, 1, 10, 11, 2, 20, 21, 22]
    assert path.trainable.tolist() == [False] * 5 + [True, True] + [False] * 4
    np.testing.assert_array_equal(path.logprobs[5:7], free.completion_logprobs)
    assert np.isnan(path.logprobs[8:]).all() and path.versions[8:].tolist() == [-1, -1, -1]
    assert tree.report.trainable_tokens == 2
    assert tree.report.constrained_tokens == len(forced.completion_ids) == 3
    forced_end = end_node(tree, "c2")
    assert forced_end.constrained and forced_end.generator is None and forced_end.kept
    assert "3 constrained (context)" in tree.render_text() and "(constrained)" in tree.render_text()
    assert tree.to_json()["report"]["constrained_tokens"] == 3

    unconstrained = build_tree([free, dataclasses.replace(forced, constrained=False)])
    assert unconstrained.report.trainable_tokens == 5 and unconstrained.report.constrained_tokens == 0
    assert "constrained" not in unconstrained.render_text()


def test_identical_retries_mixing_constrained_calls_follow_the_latest() -> None:
    free = call("a1", [*SYSTEM, 1], [10, 11], 1, version=1)
    forced = call("b2", [*SYSTEM, 1], [10, 11], 2, version=2, constrained=True)  # same tokens, under a grammar
    cont = call("c3", [*SYSTEM, 1, 10, 11, 5], [12], 3, version=2)
    # The constrained retry is the later generator: the shared positions become context.
    tree = build_tree([free, forced, cont])
    assert {cid: r.fate for cid, r in tree.calls.items()} == dict.fromkeys(("a1", "b2", "c3"), "kept")
    (path,) = tree.paths()
    assert path.trainable.tolist() == [False] * 7 + [False, True]
    assert tree.report.trainable_tokens == 1 and tree.report.constrained_tokens == 2
    # The other way round, the later unconstrained sample makes them trainable with its own logprobs.
    free_later = dataclasses.replace(free, started_at=2.5)
    tree = build_tree([free_later, forced, cont])
    (path,) = tree.paths()
    assert path.trainable.tolist() == [False] * 5 + [True, True, False, True]
    np.testing.assert_array_equal(path.logprobs[5:7], free.completion_logprobs)
    assert tree.report.trainable_tokens == 3 and tree.report.constrained_tokens == 0


def test_constrained_dead_leaf_loses_no_trainable_tokens() -> None:
    first = call("c1", [*SYSTEM, 1], [10, 11, 12], 1)
    retry = call("c2", [*SYSTEM, 1], [10, 13], 2, constrained=True)
    cont = call("c3", [*SYSTEM, 1, 10, 11, 12, 2], [14], 3)
    tree = build_tree([first, retry, cont])
    assert tree.calls["c2"].fate == "dead_leaf"
    assert tree.report.dead_leaf_tokens == 0 and tree.report.constrained_tokens == 0
    assert tree.report.trainable_tokens == 4


def test_retry_whose_sibling_was_continued_is_a_dead_leaf() -> None:
    first = call("c1", [*SYSTEM, 1], [10, 11, 12], 1)
    retry = call("c2", [*SYSTEM, 1], [10, 13], 2)  # harness timed out on c1... but then continued c1
    cont = call("c3", [*SYSTEM, 1, 10, 11, 12, 2], [14], 3)
    tree = build_tree([first, retry, cont])
    assert tree.calls["c2"].fate == "dead_leaf" and "c1" in (tree.calls["c2"].reason or "")
    assert tree.calls["c1"].fate == tree.calls["c3"].fate == "kept"
    (path,) = tree.paths()
    assert path.tokens.tolist() == [*SYSTEM, 1, 10, 11, 12, 2, 14]
    # Token 10 was generated by both: trainable through c1; c2's own token 13 is not trainable anywhere.
    assert tree.report.trainable_tokens == 4
    assert tree.report.dead_leaves == 1 and tree.report.dead_leaf_tokens == 1
    dead_end = end_node(tree, "c2")
    assert not dead_end.kept and dead_end.filtered == "dead_leaf" and not dead_end.trainable.any()
    assert "✗ dead leaf: retry abandoned for c1" in tree.render_text()

    # Switched off, the abandoned retry trains like any other branch.
    kept_all = build_tree([first, retry, cont], TreeConfig(drop_dead_leaves=False))
    assert kept_all.calls["c2"].fate == "kept" and kept_all.report.dead_leaves == 1
    assert len(kept_all.paths()) == 2 and kept_all.report.trainable_tokens == 5


def test_when_no_retry_was_continued_the_latest_survives() -> None:
    calls = [call(f"c{k}", [*SYSTEM, 1], [10 + k], k) for k in range(3)]
    tree = build_tree(calls)
    assert [tree.calls[f"c{k}"].fate for k in range(3)] == ["dead_leaf", "dead_leaf", "kept"]
    (path,) = tree.paths()
    assert path.tokens.tolist() == [*SYSTEM, 1, 12]
    assert tree.report.tree_tokens == 6 and tree.report.tree_tokens_all == 8


def test_retry_with_an_appended_nudge_is_not_compaction() -> None:
    c1 = call("c1", [*SYSTEM, 1], [10], 1)
    c2 = call("c2", [*SYSTEM, 1, 7, 7], [11], 2)  # diverges where c1's completion starts
    tree = build_tree([c1, c2])
    assert tree.calls["c2"].relation == filters.RETRY and tree.calls["c2"].anchor == "c1"
    assert tree.calls["c2"].fate == "kept" and tree.report.compaction_calls == 0
    assert tree.report.leaves == 2


def test_fork_exactly_at_the_end_of_a_completion_is_a_continuation() -> None:
    c1 = call("c1", [*SYSTEM, 1], [10], 1)
    c2 = call("c2", [*SYSTEM, 1, 10, 5], [11], 2)
    c3 = call("c3", [*SYSTEM, 1, 10, 6], [12], 3)  # another tool result after the same output
    tree = build_tree([c1, c2, c3])
    assert [tree.calls[c].relation for c in ("c2", "c3")] == [filters.CONTINUATION, filters.CONTINUATION]
    assert tree.report.leaves == 2 and tree.report.branch_points == 1
    assert sorted(p.tokens.tolist()[-2:] for p in tree.paths()) == [[5, 11], [6, 12]]


def test_rewrite_inside_context_is_a_compaction_branch() -> None:
    c1 = call("c1", [*SYSTEM, 1, 2, 3], [10], 1)
    c2 = call("c2", [*SYSTEM, 1, 2, 3, 10, 4], [11], 2)
    # The harness summarized the history: same system prompt, the rest replaced.
    summary = call("c3", [*SYSTEM, 1, 9, 9], [12], 3)
    after = call("c4", [*SYSTEM, 1, 9, 9, 12, 4], [13], 4)
    tree = build_tree([c1, c2, summary, after])
    assert tree.calls["c3"].relation == filters.COMPACTION and tree.calls["c3"].fate == "compaction"
    assert "token 5 of 7" in (tree.calls["c3"].reason or "")
    assert tree.calls["c4"].relation == filters.CONTINUATION and tree.calls["c4"].fate == "compaction"
    assert tree.calls["c4"].branch == "c3" and "opened by c3" in (tree.calls["c4"].reason or "")
    assert tree.report.compaction_calls == 2 and tree.report.compaction_branches == 1
    (path,) = tree.paths()
    assert path.calls == ("c2",)
    assert "compaction" in tree.render_text()
    assert {f["call"]: f["fate"] for f in tree.to_json()["filtered"]} == {"c3": "compaction", "c4": "compaction"}

    kept = build_tree([c1, c2, summary, after], TreeConfig(drop_compaction=False))
    assert kept.calls["c4"].fate == "kept" and kept.report.leaves == 2
    assert kept.report.trainable_tokens == 4


def test_rewrite_inside_a_completion_is_compaction() -> None:
    c1 = call("c1", [*SYSTEM, 1], [10, 11, 12], 1)
    c2 = call("c2", [*SYSTEM, 1, 10, 11, 99], [13], 2)  # an edited assistant message
    tree = build_tree([c1, c2])
    assert tree.calls["c2"].relation == filters.COMPACTION and tree.calls["c2"].fate == "compaction"
    assert tree.calls["c1"].fate == "kept"


def test_new_roots_share_nothing_or_too_little() -> None:
    c1 = call("c1", [*SYSTEM, 1, 2, 3, 4, 5, 6], [10], 1)
    fresh = call("c2", [7, 7, 7], [11], 2)
    tree = build_tree([c1, fresh])
    assert tree.calls["c2"].relation == filters.NEW_ROOT and tree.calls["c2"].fate == "compaction"
    # Sharing only the system prompt with a long conversation: below the configured fraction.
    short = call("c3", [*SYSTEM, 1, 2, 3, 4, 5, 6, 10, 8, 8, 8, 8, 8, 8, 8, 8, 8], [12], 3)
    loose = build_tree([c1, short], TreeConfig(min_shared_fraction=0.6))
    assert loose.calls["c3"].relation == filters.NEW_ROOT
    assert build_tree([c1, short]).calls["c3"].relation == filters.CONTINUATION


def test_subagents_are_dropped_or_kept_as_their_own_roots() -> None:
    main = call("m1", [*SYSTEM, 1], [10], 1)
    s1 = call("s1", [200, 1], [20], 2, is_subagent=True, agent_id="explore")
    s2 = call("s2", [200, 1, 20, 3], [21], 3, is_subagent=True, agent_id="explore")
    s3 = call("s3", [*SYSTEM, 1], [22], 4, is_subagent=True, agent_id="plan")  # same prompt as m1: not a retry
    calls = [main, s1, s2, s3]
    tree = build_tree(calls)
    assert [tree.calls[c].fate for c in ("s1", "s2", "s3")] == ["subagent"] * 3
    assert tree.report.subagent_calls == 3 and tree.report.subagents == 2
    assert [r.trajectory for r in tree.roots] == ["main"]

    kept = build_tree(calls, TreeConfig(keep_subagents=True))
    assert [r.trajectory for r in kept.roots] == ["main", "subagent:explore", "subagent:plan"]
    assert {c: kept.calls[c].fate for c in ("m1", "s1", "s2", "s3")} == dict.fromkeys(("m1", "s1", "s2", "s3"), "kept")
    assert kept.calls["s3"].relation == filters.ROOT
    by_trajectory = {p.trajectory: p for p in kept.paths()}
    assert by_trajectory["subagent:explore"].tokens.tolist() == [200, 1, 20, 3, 21]
    assert by_trajectory["subagent:plan"].tokens.tolist() == [*SYSTEM, 1, 22]
    assert kept.report.leaves == 3


def test_failed_and_cancelled_calls_never_enter_the_tree() -> None:
    c1 = call("c1", [*SYSTEM, 1], [10], 1)
    bad = call("c2", [*SYSTEM, 1, 10, 2], [11, 12], 2, status="failed")
    gone = call("c3", [*SYSTEM, 1, 10, 2], [], 3, status="cancelled")
    ok = call("c4", [*SYSTEM, 1, 10, 2], [13], 4)
    tree = build_tree([c1, bad, gone, ok])
    assert tree.report.failed_calls == 2 and tree.report.excluded_by_status == {"failed": 1, "cancelled": 1}
    assert tree.calls["c2"].end_node is None and tree.calls["c3"].end_node is None
    assert tree.calls["c4"].relation == filters.CONTINUATION and tree.report.dead_leaves == 0
    assert tree.report.tree_tokens_all == 8


def test_abnormal_branching_drops_the_rollout() -> None:
    calls = [call("c0", [*SYSTEM, 1], [10], 0)]
    calls += [call(f"c{k}", [*SYSTEM, 1, 10, k], [20 + k], k) for k in range(1, 10)]  # 9 forks of one answer
    tree = build_tree(calls)
    assert tree.dropped and tree.paths() == []
    assert tree.report.leaves == 9
    assert tree.report.dropped_reason == "abnormal branching: 9 surviving leaves > max_leaves 8"
    assert "DROPPED: abnormal branching" in tree.render_text()
    assert tree.to_json()["report"]["dropped_reason"] == tree.report.dropped_reason
    assert len(build_tree(calls, TreeConfig(max_leaves=9)).paths()) == 9
    assert len(build_tree(calls, TreeConfig(max_leaves=None)).paths()) == 9


def test_empty_completion_is_continued_only_by_a_longer_prompt() -> None:
    empty = call("c1", [*SYSTEM, 1], [], 1)
    retry = call("c2", [*SYSTEM, 1], [10], 2)
    tree = build_tree([empty, retry])
    assert tree.calls["c1"].fate == "dead_leaf" and tree.calls["c2"].fate == "kept"
    cont = call("c3", [*SYSTEM, 1, 5], [11], 3)
    tree = build_tree([empty, retry, cont])
    assert tree.calls["c1"].fate == "kept" and tree.calls["c2"].fate == "dead_leaf"


def test_to_json_and_render_text_describe_the_tree() -> None:
    c1 = call("c1", [*SYSTEM, 1], [10, 11], 1)
    c2 = call("c2", [*SYSTEM, 1], [12], 2)
    c3 = call("c3", [*SYSTEM, 1, 10, 11, 2], [13], 3)
    tree = build_tree([c1, c2, c3])
    doc = json.loads(json.dumps(tree.to_json(include_tokens=True)))
    # The abandoned retry is not part of the per-call dataset either: only kept calls count.
    assert doc["report"]["tree_tokens"] == 9 and doc["report"]["naive_tokens"] == 7 + 9
    assert doc["report"]["saving"] == pytest.approx(16 / 9, abs=1e-4)
    assert [n["tokens"] for n in doc["nodes"]] == [len(n.tokens) for n in tree.nodes]
    assert sum(n["trainable"] for n in doc["nodes"]) == 3
    assert doc["filtered"] == [{"call": "c2", "fate": "dead_leaf", "reason": "dead leaf: retry abandoned for c1"}]
    assert sum(len(n["token_ids"]) for n in doc["nodes"]) == tree.report.tree_tokens_all
    text = tree.render_text()
    assert text.splitlines()[0].startswith("3 calls: 2 kept, 1 dead leaves")
    assert "+2 tok (2 trainable)" in text and "◀ c2  ✗ dead leaf" in text
    assert len(tree.render_text(max_lines=3).splitlines()) == 4


def test_rejects_inconsistent_calls() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        build_tree([CallView("x", [1], [2, 3], [-0.1], 0.0, "ok")])
    with pytest.raises(ValueError, match="duplicate"):
        build_tree([call("c1", [1], [2], 0), call("c1", [1], [3], 1)])
    with pytest.raises(ValueError):
        TreeConfig(min_shared_fraction=1.5)


def test_builds_200_calls_of_20k_token_prompts_quickly() -> None:
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 150_000, 16_000)
    calls = []
    for k in range(200):
        seq = np.concatenate([seq, rng.integers(0, 150_000, 20)])
        completion = rng.integers(0, 150_000, 20)
        calls.append(CallView(f"c{k}", seq, completion, rng.normal(size=20), float(k), "ok", policy_version=1))
        if k % 10 == 5:  # a retry now and then
            retry = rng.integers(0, 150_000, 5)
            calls.append(CallView(f"r{k}", seq, retry, rng.normal(size=5), k + 0.5, "ok"))
        seq = np.concatenate([seq, completion])
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        tree = build_tree(calls)
        best = min(best, time.perf_counter() - start)
    assert tree.report.kept_calls == 200 and tree.report.naive_tokens > 4_000_000
    assert tree.report.tree_tokens == len(seq) and tree.report.trainable_tokens == 4_000
    assert best < 1.0, f"build took {best:.3f} s"
