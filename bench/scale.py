"""Scale-out run on one machine: 2 gateway processes + 2 vLLM CPU replicas behind vllm-router, 64 agent sessions.

The topology of docker-compose.scale.yml, as local processes: two vLLM CPU servers on the tiny model (small
``--max-model-len``), ``vllm-router`` in front of them, two clawgate gateways sharing one fresh Postgres database
(``CLAWGATE_VLLM_URL`` = the router, ``CLAWGATE_VLLM_REPLICAS`` = both replicas). ``--sessions`` clients each hold
a multi-turn conversation (each turn sends back the previous answer, as harnesses do), their turns alternating
between the two gateways. It runs once per router policy (``--policies``: consistent hashing on the session header,
then round robin) and prints, for each:

- errors, and calls captured once (the database holds exactly the call ids the clients received), and how the
  calls were rendered (spliced: the previous turn's tokens were found, whichever gateway answered it);
- rollouts per session (1: the session stayed one rollout across both gateways);
- the replica of every call and how many sessions had all their calls on one replica (from the replicas' request
  logs, ``--enable-log-requests``: vLLM names a request ``cmpl-<X-Request-Id>…``, and the gateway sends its call id);
- the prefix-cache hit rate, from each replica's ``/metrics`` (``vllm:prefix_cache_hits_total`` over
  ``vllm:prefix_cache_queries_total``, counted over the run).

``--via router`` leaves the gateways out: the clients send their chat requests to the router themselves, with the
session header the gateway would set (``X-Session-Id``), which measures the router's part alone.

    .venv/bin/python bench/scale.py [--sessions 64] [--turns 4] [--via gateway|router]
                                    [--policies consistent_hash,round_robin] [--router PATH] [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.engines.managed import free_port  # noqa: E402
from gateway.engines.vllm_server import VLLMServer, find_vllm_python  # noqa: E402

SESSION_HEADER = "X-Session-Id"
SYSTEM = (
    "You are a coding agent working in a repository. Use the tools you are given, read files before editing them, "
    "run the tests after each change and report what you did in one short paragraph."
)
# vLLM logs each request it accepts with its id (the X-Request-Id it was sent, behind a prefix).
_REQUEST_LOG = re.compile(r"(?:Received|Added) request (\S+?)[:,\s]")


def replica_metrics(url: str) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, summed over the replica's label sets."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for kind in totals:
            if line.startswith(f"vllm:prefix_cache_{kind}_total"):
                totals[kind] += float(line.rsplit(" ", 1)[1])
    return totals["queries"], totals["hits"]


def logged_requests(path: Path, offset: int) -> list[str]:
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", errors="replace")
    return _REQUEST_LOG.findall(text)


def wait_http(url: str, proc: subprocess.Popen, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start (see its log)")
        time.sleep(0.3)


def find_router(setting: str | None) -> str:
    for candidate in (setting, ROOT / ".venv-vllm" / "bin" / "vllm-router", shutil.which("vllm-router")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit("no vllm-router: .venv-vllm/bin/pip install vllm-router==0.1.17, or pass --router")


def start_router(router: str, policy: str, replicas: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas, "--policy", policy]
    # It always serves its own metrics, by default on a fixed port.
    command += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, "vllm-router")
    return proc, url


def start_gateway(model: Path, url: str, router: str, replicas: list[str], data: Path, log: Path) -> Any:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CLAWGATE_ENGINE": "vllm",
        "CLAWGATE_VLLM_URL": router,
        "CLAWGATE_VLLM_REPLICAS": ",".join(replicas),
        "CLAWGATE_VLLM_MODEL": "tiny",
        "CLAWGATE_MODEL": str(model),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": url,
        "CLAWGATE_PORT": str(port),
        "CLAWGATE_DATA_DIR": str(data),
        "CLAWGATE_POLICY_FOLLOW": "false",
        "CLAWGATE_LOG_LEVEL": "warning",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawgate.cli", "serve"],
        env=env,
        cwd=ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", proc, f"gateway (log {log})")
    return proc, base


async def session(
    args: argparse.Namespace, bases: list[str], tag: str, sid: int, out: dict[str, Any], start: asyncio.Event
) -> None:
    name = f"{tag}s{sid:03d}"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {name}: fix the failing test in module_{sid}.py and explain the fix."},
    ]
    # Idle connections are not reused after 2 s: the gateway (uvicorn) closes them after 5 s, and a turn sent on a
    # connection it is closing fails with a read error (turns alternate gateways, so each connection idles a turn).
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await start.wait()
        for turn in range(args.turns):
            base = bases[turn % len(bases)]
            body: dict[str, Any] = {
                "model": "tiny",
                "messages": messages,
                "stream": True,
                "max_tokens": args.max_tokens,
            }
            body |= {"temperature": 1.0, "seed": sid * 100 + turn}
            if args.via == "router":
                # What the gateway sends: the session header the router hashes, a request id vLLM logs.
                headers = {SESSION_HEADER: name, "X-Request-Id": f"{name}t{turn}"}
            else:
                headers = {"X-Rollout-Id": name}
            text: list[str] = []
            try:
                async with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        out["errors"].append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                        return
                    call_id = r.headers.get("x-clawgate-call-id", f"{name}t{turn}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["errors"].append(str(chunk["error"])[:200])
                            return
                        for choice in chunk.get("choices", []):
                            text.append(choice["delta"].get("content") or "")
            except httpx.HTTPError as exc:
                out["errors"].append(repr(exc))
                return
            out["calls"].append(call_id)
            out["session_of"][call_id] = name
            messages = [
                *messages,
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": f"The tests still fail (attempt {turn + 1}). Look again."},
            ]


def fresh_database(url: str) -> tuple[str, sa.Engine, str]:
    name = f"clawgate_scale_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    return url.rsplit("/", 1)[0] + "/" + name, admin, name


def stored_calls(url: str, expected: int) -> list[Any]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    rows: list[Any] = []
    try:
        for _ in range(300):
            with engine.connect() as conn:
                rows = list(conn.execute(sa.text("SELECT id, rollout_id, render_mode FROM calls")))
            if len(rows) >= expected:
                break
            time.sleep(0.1)
    finally:
        engine.dispose()
    return rows


def run_policy(
    args: argparse.Namespace, policy: str, model: Path, replicas: list[VLLMServer], tmp: Path
) -> dict[str, Any]:
    urls = [r.url for r in replicas]
    tag = policy.replace("_", "")[:6]
    router_proc, router_url = start_router(args.router, policy, urls, tmp / f"router-{policy}.log")
    procs = [router_proc]
    admin = None
    db_url = db_name = ""
    try:
        if args.via == "gateway":
            from gateway.store import db

            db_url, admin, db_name = fresh_database(args.database_url)
            db.upgrade(db_url)
            bases = []
            for i in range(2):
                proc, base = start_gateway(
                    model, db_url, router_url, urls, tmp / f"data-{policy}-{i}", tmp / f"gateway-{policy}-{i}.log"
                )
                procs.append(proc)
                bases.append(base)
        else:
            bases = [router_url]
        before = [replica_metrics(u) for u in urls]
        offsets = [r.log_path.stat().st_size if r.log_path else 0 for r in replicas]
        out: dict[str, Any] = {"calls": [], "errors": [], "session_of": {}}

        async def drive() -> float:
            start = asyncio.Event()
            tasks = [asyncio.create_task(session(args, bases, tag, i, out, start)) for i in range(args.sessions)]
            t0 = time.perf_counter()
            start.set()
            await asyncio.gather(*tasks)
            return time.perf_counter() - t0

        elapsed = asyncio.run(drive())
        time.sleep(1.0)  # the replicas' log lines and counters of the last requests
        after = [replica_metrics(u) for u in urls]
        # Which replica served each request: vLLM's id holds the X-Request-Id it was sent.
        served: list[tuple[int, str]] = []
        for i, r in enumerate(replicas):
            assert r.log_path is not None
            served += [(i, rid) for rid in logged_requests(r.log_path, offsets[i])]
        result: dict[str, Any] = {"elapsed": elapsed, "out": out, "before": before, "after": after}
        if args.via == "gateway":
            result["rows"] = stored_calls(db_url, len(out["calls"]))
        # The gateway sends vLLM its call id as the request id; without the gateway, the client's own request id.
        pattern = re.compile(r"call-[0-9a-f]{24}" if args.via == "gateway" else rf"{tag}s\d{{3}}t\d+")
        replica_of_call = {}
        for i, rid in served:
            match = pattern.search(rid)
            if match and match.group(0) in out["session_of"]:
                replica_of_call[match.group(0)] = i
        result["replica_of_call"] = replica_of_call
        return result
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
            admin.dispose()


def report(args: argparse.Namespace, policy: str, result: dict[str, Any]) -> None:
    out = result["out"]
    calls = out["calls"]
    print(f"\n== router policy {policy}, via {args.via}: {args.sessions} sessions x {args.turns} turns")
    print(f"calls {len(calls)} in {result['elapsed']:.1f} s, errors {len(out['errors'])}", end="")
    print(f" (first: {out['errors'][0]})" if out["errors"] else "")
    if "rows" in result:
        stored = [row.id for row in result["rows"]]
        exact = sorted(stored) == sorted(calls) and len(set(stored)) == len(stored)
        print(f"captured: {len(stored)} rows for {len(calls)} calls received: {'each once' if exact else 'MISMATCH'}")
        rollouts: dict[str, set[str]] = {}
        for row in result["rows"]:
            if row.id in out["session_of"]:
                rollouts.setdefault(out["session_of"][row.id], set()).add(row.rollout_id)
        spread = Counter(len(r) for r in rollouts.values())
        modes = Counter(row.render_mode for row in result["rows"])
        # A turn answered by the other gateway than the one before it is spliced only if the parent was found in
        # the database.
        print(f"rollouts per session: {dict(sorted(spread.items()))} (rollouts: sessions); render {dict(modes)}")
    replica_of_call = result["replica_of_call"]
    per_session: dict[str, set[int]] = {}
    for call_id, name in out["session_of"].items():
        if call_id in replica_of_call:
            per_session.setdefault(name, set()).add(replica_of_call[call_id])
    located = len(replica_of_call)
    one = sum(1 for replicas in per_session.values() if len(replicas) == 1)
    home = Counter(next(iter(r)) for r in per_session.values() if len(r) == 1)
    print(
        f"replica of each call (replica logs): {located}/{len(calls)} located; sessions on one replica "
        f"{one}/{len(per_session)}; sessions per replica {dict(sorted(home.items()))}"
    )
    parts = []
    total_q = total_h = 0.0
    for i, ((q0, h0), (q1, h1)) in enumerate(zip(result["before"], result["after"], strict=True)):
        q, h = q1 - q0, h1 - h0
        total_q, total_h = total_q + q, total_h + h
        parts.append(f"replica {i} {h / q:.1%} of {q:.0f} tokens" if q else f"replica {i} idle")
    rate = total_h / total_q if total_q else 0.0
    print(f"prefix-cache hit rate: {rate:.1%} ({'; '.join(parts)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--via", choices=("gateway", "router"), default="gateway")
    ap.add_argument("--policies", default="consistent_hash,round_robin")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--router", default=None, help="the vllm-router command (default: .venv-vllm's, then PATH)")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM install (default .venv-vllm)")
    ap.add_argument(
        "--database-url",
        default=os.environ.get("CLAWGATE_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a Postgres server (a fresh database is created per run)",
    )
    args = ap.parse_args()
    args.router = find_router(args.router)
    python = find_vllm_python(args.vllm_python)
    if python is None:
        raise SystemExit("no vLLM install found: run ./dev setup-vllm or pass --vllm-python")

    from clawgate.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="clawgate-scale-"))
    model = build_tiny_model(tmp / "model", seed=0)
    replicas = [
        VLLMServer(
            python,
            model,
            served_model_name="tiny",
            max_model_len=args.max_model_len,
            extra_args=["--enable-log-requests", "--max-log-len", "0"],
            log_path=tmp / f"vllm-{i}.log",
        )
        for i in range(2)
    ]
    print(f"starting 2 vLLM replicas (logs in {tmp}) ...", file=sys.stderr)
    errors: list[BaseException] = []

    def start(server: VLLMServer) -> None:
        try:
            server.start(timeout=600)
        except BaseException as exc:  # reported below, after both tried
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise SystemExit(f"a vLLM replica did not start: {errors[0]}")
        for policy in args.policies.split(","):
            report(args, policy, run_policy(args, policy, model, replicas, tmp))
    finally:
        for r in replicas:
            r.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
