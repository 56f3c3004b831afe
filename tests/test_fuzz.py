"""Fuzzing every route with hypothesis: random JSON, and valid requests with fields replaced, dropped or added.
Whatever arrives, the gateway answers in the route's own error shape and never with a 500 (a 500 is a bug: input
the code did not expect). Counts are printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import build_app
from gateway.settings import Settings
from gateway.store import db
from tests.fakes import ScriptedEngine

EXAMPLES = int(os.environ.get("CLAWGATE_FUZZ_EXAMPLES", "120"))  # per route

SCALARS = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20)
JSON = st.recursive(
    SCALARS | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
# Values that reach deeper: the strings and shapes the translators switch on.
WORDS = st.sampled_from(
    ["user", "assistant", "system", "tool", "developer", "text", "image_url", "tool_use", "tool_result", "thinking",
     "function", "function_call", "function_call_output", "reasoning", "message", "input_text", "auto", "none",
     "required", "any", "tiny", "", "x" * 300]
)  # fmt: skip
VALUE = st.one_of(JSON, WORDS, st.lists(st.dictionaries(WORDS, JSON | WORDS, max_size=4), max_size=3))

TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "tools": [TOOL],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    "/v1/messages": {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
    },
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {
        "model": "tiny",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "max_output_tokens": 4,
    },
    "/v1/rollouts": {"task_id": "t", "harness": "h", "metadata": {}},
    "/v1/feedback": {"call_id": "call-x", "value": 1.0},
    "/v1/policy/pin": {"version": 0},
    "/v1/policy/rollback": {"version": 0},
}


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    how = draw(st.sampled_from(["random", "replace", "drop", "add", "nested"]))
    if how == "random":
        return draw(VALUE)
    body = json.loads(json.dumps(base))
    key = draw(st.sampled_from(sorted(body)))
    if how == "replace":
        body[key] = draw(VALUE)
    elif how == "drop":
        del body[key]
    elif how == "add":
        body[draw(st.text(min_size=1, max_size=12))] = draw(VALUE)
    else:  # inside the first item of a list field (a message, a tool, an input item)
        lists = [k for k, v in body.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if lists:
            item = body[draw(st.sampled_from(lists))][0]
            item[draw(st.sampled_from([*sorted(item), "content", "type", "role"]))] = draw(VALUE)
    return body


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_model_dir, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{tmp / 'fuzz.db'}"
    db.upgrade(url)
    engine = ScriptedEngine(tiny_tokenizer)
    settings = Settings(
        model=str(tiny_model_dir), served_model_name="tiny", database_url=url, data_dir=tmp / "data", max_tokens=8
    )
    with TestClient(build_app(settings, engine=engine, tokenizer=tiny_tokenizer), raise_server_exceptions=False) as c:
        yield c


STATUSES: Counter[tuple[str, int]] = Counter()


def check(client: TestClient, path: str, body: Any) -> None:
    stream = isinstance(body, dict) and body.get("stream") is True
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    STATUSES[path, r.status_code] += 1
    assert r.status_code != 500 and r.status_code < 502, (path, body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and {"type", "message"} <= set(error["error"]), error
        else:
            assert {"message", "type", "param", "code"} <= set(error["error"]), error
    elif stream:
        assert "error" not in r.text.split("\n", 1)[0]


@pytest.mark.parametrize("path", sorted(BASES))
def test_no_input_makes_a_route_fail_with_500(client: TestClient, path: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=mutated(BASES[path]))
    def run(body: Any) -> None:
        check(client, path, body)

    run()
    counts = {status: n for (p, status), n in sorted(STATUSES.items()) if p == path}
    print(f"{path}: {sum(counts.values())} requests, statuses {counts}")
