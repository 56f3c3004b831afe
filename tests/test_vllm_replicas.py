"""Several vLLM replicas behind vllm-router: session affinity, a policy version on every replica, a canary on a
replica that lacks the candidate's adapter, a replica that dies (and comes back).

The first tests script two replicas and a router (``tests/scripted_http.py``: what goes where). The rest start
two real vLLM CPU replicas of the tiny model and ``vllm-router`` once for the module (about a minute, ~3 GB of
memory per replica) and drive the gateway through them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from gateway.engines.base import GenerationRequest, SamplingParams
from gateway.engines.vllm import SESSION_HEADER, VLLMEngine
from gateway.engines.vllm_router import VLLMRouter
from gateway.engines.vllm_server import VLLMServer
from gateway.errors import EngineUnavailable
from gateway.store import codec
from gateway.store.db import connect
from gateway.store.models import Call
from tests.missing import missing
from tests.policies import publish
from tests.scripted_http import scripted_server
from tests.tcp_proxy import TcpProxy
from tests.test_promotion import stage

# ---- what goes where, against scripted replicas ------------------------------------------------------------------

ROUTER, A, B = "http://router", "http://replica-a", "http://replica-b"


class Replicas:
    """Two scripted vLLM servers and a router; ``down`` holds the hosts that refuse connections."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any], httpx.Headers]] = []
        self.loaded: dict[str, dict[str, str]] = {A: {}, B: {}}
        self.down: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base in self.down:
            raise httpx.ConnectError("refused", request=request)
        body = json.loads(request.content) if request.content else {}
        self.seen.append((base, request.url.path, body, request.headers))
        path = request.url.path
        if path == "/v1/load_lora_adapter":
            self.loaded[base][body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="ok")
        if path == "/v1/unload_lora_adapter":
            if self.loaded[base].pop(body["lora_name"], None) is None:
                return httpx.Response(404, json={"error": {"message": "not found", "code": 404}})
            return httpx.Response(200, text="ok")
        if path == "/v1/models":
            cards = [{"id": "base", "max_model_len": 64}]
            cards += [{"id": n, "parent": "base", "root": p} for n, p in self.loaded[base].items()]
            return httpx.Response(200, json={"data": cards})
        if path == "/inference/v1/abort_requests":
            return httpx.Response(200, json={})
        if path == "/v1/completions":
            choice = {
                "index": 0,
                "text": "",
                "token_ids": [3],
                "finish_reason": "length",
                "logprobs": {"token_logprobs": [-0.5]},
            }
            return httpx.Response(200, json={"choices": [choice], "usage": {"prompt_tokens": 1}})
        return httpx.Response(404, json={"error": {"message": path}})

    def hosts(self, path: str) -> list[str]:
        return sorted(base for base, p, _, _ in self.seen if p == path)


@asynccontextmanager
async def scripted() -> AsyncIterator[tuple[VLLMEngine, Replicas]]:
    """An engine, started, on a scripted router and two scripted replicas (``tests/scripted_http.py``)."""
    replicas = Replicas()
    async with (
        scripted_server(replicas, name=ROUTER) as router,
        scripted_server(replicas, name=A) as a,
        scripted_server(replicas, name=B) as b,
    ):
        engine = VLLMEngine(router, model="base", max_model_len=64, replicas=[a, b])
        await engine.start()
        try:
            yield engine, replicas
        finally:
            await engine.close()


async def test_generations_go_through_the_router_keyed_by_rollout_and_adapters_go_to_every_replica() -> None:
    async with scripted() as (engine, replicas):
        request = GenerationRequest("call-1", [1, 2], SamplingParams(max_tokens=1), stream=False, session_id="ro-7")
        [*_] = [event async for event in engine.generate(request)]
        [(base, _, _, headers)] = [s for s in replicas.seen if s[1] == "/v1/completions"]
        assert base == ROUTER and headers[SESSION_HEADER] == "ro-7"

        await engine.load_adapter("policy@v1", "/adapters/policy@v1")
        assert replicas.hosts("/v1/load_lora_adapter") == [A, B]
        assert await engine.adapters() == ["policy@v1"]
        # A replica that restarted lost it: it is not loaded everywhere any more, so the follower loads it again.
        replicas.loaded[B].clear()
        assert await engine.adapters() == []
        await engine.load_adapter("policy@v1", "/adapters/policy@v1")
        assert await engine.adapters() == ["policy@v1"]

        engine._abort_later("cmpl-x-0")
        await engine.close()
        assert replicas.hosts("/inference/v1/abort_requests") == [A, B] and engine.aborts_sent == 1


async def test_a_replica_that_is_down_is_skipped_until_none_answers() -> None:
    async with scripted() as (engine, replicas):
        replicas.down.add(B)
        await engine.load_adapter("policy@v2", "/adapters/policy@v2")
        assert replicas.loaded == {A: {"policy@v2": "/adapters/policy@v2"}, B: {}}
        assert await engine.adapters() == ["policy@v2"]  # the reachable replicas all have it
        replicas.down.discard(B)
        assert await engine.adapters() == []  # B is back without it
        await engine.unload_adapter("policy@v2")  # B never had it: that is what unloading asks for
        assert replicas.loaded == {A: {}, B: {}}
        replicas.down.update({A, B})
        with pytest.raises(EngineUnavailable):
            await engine.load_adapter("policy@v3", "/adapters/policy@v3")
        with pytest.raises(EngineUnavailable):
            await engine.adapters()


# ---- two real vLLM CPU replicas behind vllm-router ----------------------------------------------------------------

REPLICA_MAX_MODEL_LEN = 512
PROMPT_TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Cluster:
    replicas: list[VLLMServer]
    router: VLLMRouter
    adapters: Path  # the shared adapters folder (the replicas' LoRA resolver reads it)

    def gateway(self, factory: Any, **overrides: Any) -> Any:
        values: dict[str, Any] = {
            "engine": "vllm",
            "vllm_url": self.router.url,
            "vllm_replicas": [r.url for r in self.replicas],
            "vllm_model": "tiny",
            "max_tokens": 16,
            "adapter_dir": self.adapters,
            "policy_poll_interval": 0.2,
            "admin_key": "adm",
        }
        return factory(**{**values, **overrides})

    def served(self) -> list[float]:
        """Requests each replica finished (vLLM's own counter), -1 for one that does not answer."""
        return [finished_requests(r.url) for r in self.replicas]


def finished_requests(url: str) -> float:
    return metric(url, "vllm:request_success_total")


def metric(url: str, name: str) -> float:
    """The sum of one vLLM metric's series, -1 when the server does not answer."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return -1.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def cluster(vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if subprocess.run([vllm_python, "-c", "import vllm_router"], capture_output=True).returncode != 0:
        missing("vllm-router is not installed in the vLLM environment: run ./dev setup-vllm")
    tmp = tmp_path_factory.mktemp("replicas")
    adapters = tmp / "adapters"
    adapters.mkdir()
    replicas = [
        VLLMServer(
            vllm_python,
            tiny_model_dir,
            served_model_name="tiny",
            max_model_len=REPLICA_MAX_MODEL_LEN,
            kv_cache_space_gib=1,
            lora_resolver_dir=adapters,
            log_path=tmp / f"replica{i}.log",
        )
        for i in range(2)
    ]
    router = VLLMRouter(vllm_python, [r.url for r in replicas], log_path=tmp / "router.log")
    try:
        with ThreadPoolExecutor(2) as pool:  # both load at once: half the wait
            list(pool.map(lambda r: r.start(timeout=300), replicas))
        router.start()
        yield Cluster(replicas, router, adapters)
    finally:
        router.stop()
        for r in replicas:
            r.stop()


def stored_calls(gw: Any, where: str, **params: Any) -> list[tuple[Call, list[int]]]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    try:
        with sa.orm.Session(engine) as session:
            calls = session.scalars(sa.select(Call).where(sa.text(where)).params(**params)).all()
            return [(c, codec.unpack_ids(c.completion_ids)) for c in calls]
    finally:
        engine.dispose()


def chat_turns(base: str, opening: str, turns: int) -> list[httpx.Response]:
    """One conversation of ``turns`` calls, each sending back the answers before it."""
    messages = [{"role": "user", "content": opening}]
    out = []
    for turn in range(turns):
        body = {"model": "tiny", "messages": messages, "max_tokens": 8, "seed": turn}
        r = httpx.post(base + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r)
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"and {turn}?"}]
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_each_rollout_is_served_from_one_replica(gateway_factory: Any, cluster: Cluster) -> None:
    """Explicit rollouts (the /rollouts/{id} prefix) and implicit ones (a conversation continued): every call of
    one rollout is counted by one replica's vLLM, and the rollouts spread over both."""
    gw = cluster.gateway(gateway_factory, policy_follow=False)
    homes = set()
    for i in range(10):
        before = cluster.served()
        base = f"{gw.url}/rollouts/ro-affinity-{i}/v1" if i % 2 else gw.v1
        responses = chat_turns(base, f"Conversation {i}: name a color.", turns=3)
        grew = [after - b for after, b in zip(cluster.served(), before, strict=True)]
        assert sorted(grew) == [0, 3], grew
        assert len({r.headers["x-clawgate-rollout-id"] for r in responses}) == 1
        homes.add(grew.index(3))
        if homes == {0, 1} and i >= 3:
            break
    assert homes == {0, 1}, "every rollout hashed to one replica"


def greedy_on(url: str, model: str, prompt: list[int]) -> list[int]:
    """The replica at ``url`` asked directly: greedy ids of ``prompt`` through ``model`` (base or adapter)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["choices"][0]["token_ids"]
    return ids


def complete(gw: Any, rollout: str, prompt: list[int], **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, **extra}
    return httpx.post(f"{gw.url}/rollouts/{rollout}/v1/completions", json=body, timeout=120)


def stream_event(line: str) -> dict[str, Any]:
    """A ``data:`` line's event (``[DONE]`` reads as an empty one)."""
    payload = line.removeprefix("data: ")
    return {} if payload == "[DONE]" else dict(json.loads(payload))


def wait_for(predicate: Any, what: str, timeout: float = 60.0, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_new_policy_version_is_served_by_both_replicas(
    gateway_factory: Any, cluster: Cluster, tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    gw = cluster.gateway(gateway_factory)
    prompt = tiny_tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    publish(gw.settings.database_url, cluster.adapters, tiny_model_dir, 1, scale=0.5)
    wait_for(lambda: gw.state.service.policy_version == 1, "policy@v1 to be served")
    # Loaded on each replica before the first call names it.
    for replica in cluster.replicas:
        names = [card["id"] for card in httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]]
        assert "policy@v1" in names, (replica.url, names)
    by_replica: dict[int, str] = {}
    for i in range(16):
        before = cluster.served()
        r = complete(gw, f"ro-policy-{i}", prompt)
        assert r.status_code == 200, r.text
        grew = [after - b for after, b in zip(cluster.served(), before, strict=True)]
        by_replica.setdefault(grew.index(1), r.headers["x-clawgate-call-id"])
        if len(by_replica) == 2:
            break
    assert sorted(by_replica) == [0, 1], "every rollout hashed to one replica"
    # Each replica's resolver loads a version nobody loaded yet from the adapters folder on its first call (what
    # a replica that comes back empty relies on until the gateway loads the current version there again).
    shutil.copytree(cluster.adapters / "policy@v1", cluster.adapters / "policy@v1-copy")
    for replica in cluster.replicas:
        assert greedy_on(replica.url, "policy@v1-copy", prompt) == greedy_on(replica.url, "policy@v1", prompt)
    for index, call_id in by_replica.items():
        url = cluster.replicas[index].url
        [(call, ids)] = stored_calls(gw, "id = :i", i=call_id)
        assert (call.adapter, call.policy_version) == ("policy@v1", 1)
        # The replica that answered really ran the adapter: its greedy answer is the adapter's, not the base's.
        assert ids == greedy_on(url, "policy@v1", prompt) != greedy_on(url, "tiny", prompt)


def adapter_names(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(url + "/v1/models", timeout=10).json()["data"] if card.get("parent")]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_canary_reaches_a_replica_that_lacks_the_candidates_adapter_and_no_call_fails(
    gateway_factory: Any, cluster: Cluster, tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    """Replica b was out of the gateway's reach when the candidate was loaded (a partition; alike, a replica that
    restarted since), so only a has it, while the router still sends b canary conversations. b's LoRA resolver loads
    the candidate from the adapters folder on its first call: no call fails, b answers with the candidate's weights,
    and once the gateway reaches b again the canary goes on (it is not rejected as an adapter that cannot load)."""
    a, b = cluster.replicas
    # The gateway's way to b (adapter loads and lists); the router's way to b is direct.
    to_b = TcpProxy("127.0.0.1", b.port).start()
    try:
        gw = cluster.gateway(
            gateway_factory,
            vllm_replicas=[a.url, f"http://127.0.0.1:{to_b.port}"],
            promotion="guarded",
            canary_share=1.0,  # every new conversation is the candidate's
            canary_min_turns=10_000,  # and no decision is taken on evidence
            canary_check_interval=0.1,
        )
        url = gw.settings.database_url
        prompt = tiny_tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
        publish(url, cluster.adapters, tiny_model_dir, 5)  # the first version: the incumbent, on both replicas
        wait_for(lambda: gw.state.service.policy_version == 5, "policy@v5 to be served")
        to_b.cut()
        publish(url, cluster.adapters, tiny_model_dir, 6, scale=0.5)
        wait_for(lambda: gw.state.service.routing.candidate is not None, "the canary of policy@v6 to start")
        assert "policy@v6" in adapter_names(a.url) and "policy@v6" not in adapter_names(b.url)

        served_by: dict[str, int] = {}  # call id -> the replica that answered it
        for i in range(24):
            before = cluster.served()
            r = complete(gw, f"ro-canary-{i}", prompt)
            assert r.status_code == 200, r.text
            grew = [now - then for now, then in zip(cluster.served(), before, strict=True)]
            served_by[r.headers["x-clawgate-call-id"]] = grew.index(1)
            if sorted(set(served_by.values())) == [0, 1] and list(served_by.values()).count(1) >= 2:
                break
        assert list(served_by.values()).count(1) >= 2, f"no two canary conversations hashed to b: {served_by}"
        assert "policy@v6" in adapter_names(b.url), "loaded on demand by b's resolver"
        for call_id, index in served_by.items():
            [(call, ids)] = stored_calls(gw, "id = :i", i=call_id)
            assert (call.adapter, call.policy_version, call.status) == ("policy@v6", 6, "ok")
            replica = cluster.replicas[index].url
            # The candidate's weights, not the incumbent's (policy@v5 is a zero LoRA: the base model's answer).
            assert ids == greedy_on(replica, "policy@v6", prompt) != greedy_on(replica, "policy@v5", prompt)

        to_b.restore()
        time.sleep(1.5)  # several polls (0.2 s) of the follower, each listing b's adapters again
        assert stage(url, 6) == "canary" and gw.state.service.routing.candidate is not None
        assert not gw.state.policy.fault.active
        r = complete(gw, "ro-canary-after", prompt)
        assert r.status_code == 200, r.text
        [(call, _)] = stored_calls(gw, "id = :i", i=r.headers["x-clawgate-call-id"])
        assert call.adapter == "policy@v6"
    finally:
        to_b.stop()


def homes(gw: Any, cluster: Cluster, prompt: list[int], prefix: str, each: int) -> tuple[dict[str, int], set[str]]:
    """Rollout ids, ``each`` per replica, with the replica that serves each (found by one call apiece), and the
    ids of those calls."""
    found: dict[str, int] = {}
    calls = set()
    for i in range(8 * each):
        before = cluster.served()
        r = complete(gw, f"{prefix}-{i}", prompt, max_tokens=1)
        assert r.status_code == 200, r.text
        calls.add(r.headers["x-clawgate-call-id"])
        home = [after - b for after, b in zip(cluster.served(), before, strict=True)].index(1)
        if list(found.values()).count(home) < each:
            found[f"{prefix}-{i}"] = home
        if len(found) == 2 * each:
            return found, calls
    raise AssertionError(f"no {each} rollouts on each replica: {found}")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.postgres
def test_a_replica_killed_mid_run_loses_no_call_and_is_taken_back_with_the_current_version(
    postgres_url: str, gateway_factory: Any, cluster: Cluster, tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    """kill -9 of one replica while rollouts run on both: calls cut on it fail (recorded failed; the harness
    retries them), later calls go to the survivor, every call a client got is stored once; started again, the
    replica is taken back by the router and answers its first call through the current version."""
    gw = cluster.gateway(gateway_factory, database_url=postgres_url, max_tokens=128)
    prompt = tiny_tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    publish(postgres_url, cluster.adapters, tiny_model_dir, 2, scale=0.5)
    wait_for(lambda: gw.state.service.policy_version == 2, "policy@v2 to be served")
    rollouts, found_by = homes(gw, cluster, prompt, "ro-kill", each=3)
    turns = 6
    outcomes: dict[str, str] = {}  # call id -> "ok" | "failed", as each client saw it
    failures: list[str] = []  # what each failed attempt answered, for the assertion messages
    halfway = threading.Barrier(len(rollouts) + 1, timeout=300)
    # Set by a harness when the first tokens of a generation on the victim arrive: the kill lands while the rest
    # are generated (a metrics scrape finds a running request too late on a loaded machine).
    streaming_on_victim = threading.Event()
    open_on_victim: set[str] = set()  # rollouts with a stream on the victim that has tokens and no end yet
    lock = threading.Lock()

    def harness(rollout: str) -> None:
        on_victim = rollouts[rollout] == 0
        for turn in range(turns):
            if turn == turns // 2:
                halfway.wait()
            for _attempt in range(20):  # a harness retries a failed call
                # The gateway's cap: long enough that the kill finds one running on the victim.
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 128, "seed": turn, "stream": True}
                url = f"{gw.url}/rollouts/{rollout}/v1/completions"
                with httpx.stream("POST", url, json=body, timeout=120) as r:
                    call_id = r.headers.get("x-clawgate-call-id")
                    answer = []
                    try:
                        for line in r.iter_lines():
                            answer.append(line)
                            if on_victim and turn >= turns // 2 and line.startswith("data: "):
                                with lock:
                                    if line == "data: [DONE]":
                                        open_on_victim.discard(rollout)
                                    else:
                                        open_on_victim.add(rollout)
                                streaming_on_victim.set()
                    finally:
                        with lock:
                            open_on_victim.discard(rollout)
                lines = [line for line in answer if line.startswith("data: ")]
                # An error event is an event with an "error" key (a generated text may say "error" too).
                errors = [line for line in lines if "error" in stream_event(line)]
                ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"] and not errors
                if call_id is not None:
                    outcomes[call_id] = "ok" if ok else "failed"
                if ok:
                    break
                said = errors[:1] or lines[-2:] or answer[:1]
                failures.append(f"{time.monotonic() - t0:.2f}s {rollout} turn {turn}: {r.status_code} {said}")
                time.sleep(0.5)

    threads = [threading.Thread(target=harness, args=(rollout,)) for rollout in rollouts]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    halfway.wait()
    victim = cluster.replicas[0]
    assert victim._process is not None
    # Freeze the victim as soon as a harness has its first tokens, and kill it only if, once what it had already
    # sent has arrived, a stream is still open: a generation is then cut for sure. (On a loaded machine a short
    # generation may be over by the time its first tokens are read; the victim then goes on and the next is tried.)
    for _ in range(20):
        assert streaming_on_victim.wait(120), "no generation on the replica to kill"
        os.killpg(victim._process.pid, signal.SIGSTOP)
        time.sleep(2)
        with lock:
            cut = bool(open_on_victim)
            streaming_on_victim.clear()
        if cut:
            break
        os.killpg(victim._process.pid, signal.SIGCONT)
    assert cut, "no generation was caught running on the replica to kill"
    os.killpg(victim._process.pid, signal.SIGKILL)
    killed_at = dt.datetime.now(dt.UTC)
    failures.append(f"{time.monotonic() - t0:.2f}s killed")
    at_kill = cluster.served()[1]
    for t in threads:
        t.join(300)
    assert list(outcomes.values()).count("ok") == len(rollouts) * turns, "\n".join(failures)
    assert "failed" in outcomes.values(), "no call was running on the killed replica"
    # Every call a client got back is stored exactly once, with the outcome the client saw.
    rows = {c.id: c for c, _ in stored_calls(gw, "rollout_id LIKE 'ro-kill-%'") if c.id not in found_by}
    assert sorted(rows) == sorted(outcomes)
    assert {i: ("ok" if c.status == "ok" else "failed") for i, c in rows.items()} == outcomes
    assert {c.adapter for c in rows.values()} == {"policy@v2"}
    # The victim's rollouts that were not done at the kill (those it cut, at least) went on on the survivor: each has
    # a call that began after the kill and was served there. (On a loaded machine a victim's rollout may finish its
    # last turn before the kill lands.)
    victims = [c for c in rows.values() if rollouts[c.rollout_id] == 0]
    running = {c.rollout_id for c in victims if c.status != "ok" or c.started_at > killed_at}
    after = [c for c in victims if c.status == "ok" and c.started_at > killed_at]
    assert running and {c.rollout_id for c in after} == running, "\n".join(failures)
    # vLLM publishes its request counter from the engine's stats a moment after the answer: poll it briefly.
    deadline = time.monotonic() + 15
    while cluster.served()[1] - at_kill < len(after) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.served()[1] - at_kill >= len(after)

    victim.stop()
    victim.start(timeout=300)  # same address, nothing loaded
    # The gateway loads the current version into it again (the adapter list is what every reachable replica
    # has) and the router takes it back after two good health checks; its rollouts go to it again, no call
    # fails meanwhile, and the first it serves is answered through the current version.
    victims = [rollout for rollout, home in rollouts.items() if home == 0]
    deadline = time.monotonic() + 180  # a failure bound, with room for a loaded machine
    while True:
        before = cluster.served()[0]
        r = complete(gw, victims[0], prompt)
        assert r.status_code == 200, r.text
        if cluster.served()[0] > before:
            break
        assert time.monotonic() < deadline, "the router never took the restarted replica back"
        time.sleep(0.2)
    [(call, ids)] = stored_calls(gw, "id = :i", i=r.headers["x-clawgate-call-id"])
    assert call.adapter == "policy@v2" and ids == greedy_on(victim.url, "policy@v2", prompt)
