"""Credentials in captured traffic: found on capture, never trained on, never shown (``gateway/credentials``).

A generated corpus (``secret_corpus.py``: AWS, GitHub, GitLab, Slack, Stripe, OpenAI keys, JWTs, PEM blocks, passwords
in URLs and ``.env`` lines) goes through the three APIs, with the official SDKs as clients, inside user messages,
tool results and answers (a scripted engine writes the answers: the tiny model cannot be made to). Then every place
text leaves clawgate is checked: the log records, the rollout API, `clawgate export`, the console page in a real
browser, the judge's requests (a test judge server records them) and the trainer's packed batches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.cli import cmd_export
from gateway.credentials.detect import scan
from gateway.credentials.redact import decode_redacted, redact_pieces
from gateway.credentials.tokens import COMPLETION, PROMPT, scan_call, tokenizer_decode
from gateway.store import turns
from gateway.store.db import connect
from gateway.store.models import Call, SecretFinding
from gateway.store.training_data import load_turns, turn_trees
from tests.fakes import ScriptedEngine
from tests.judge_server import JudgeServer
from tests.secret_corpus import ORDINARY, corpus
from tests.test_console import browser_page
from tests.test_console import chromium_path as chromium_path  # a fixture
from tests.test_retention import orphans
from tests.test_reward_worker import worker_for

ADMIN = {"Authorization": "Bearer adm"}
FIXTURES = Path(__file__).parent / "fixtures" / "harness-requests"
PLANTED = corpus()
BY_NAME = {p.name: p for p in PLANTED}
READ_FILE = {"name": "read_file", "description": "Read a file.", "parameters": {"type": "object"}}
TOOL_CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": ".env"}}\n</tool_call>'


# --- the detector ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_every_generated_credential_is_found_in_every_setting(planted):
    for text in (planted.line, f"cat .env\n{planted.line}\n$ ", f"The file says:\n\n{planted.line}\n\nDone."):
        at = text.find(planted.value)
        found = scan(text)
        assert any(f.start <= at and f.end >= at + len(planted.value) for f in found), (planted.name, found)


def test_ordinary_code_prose_and_the_harness_fixtures_are_not_credentials():
    for line in ORDINARY:
        assert scan(line) == [], line

    def strings(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
        return [s for item in items for s in strings(item)]

    files = sorted(FIXTURES.rglob("*.json"))
    assert len(files) >= 3, f"the harness fixtures are missing under {FIXTURES}"
    found = {}
    for path in files:
        text = "\n".join(strings(json.loads(path.read_text(encoding="utf-8"))))
        findings = scan(text)
        if findings:
            found[path.name] = [(f.kind, text[max(0, f.start - 30) : f.start]) for f in findings]
    # Claude Code's, Codex's and OpenClaw's real requests: system prompts, tool schemas, code, shell output.
    assert found == {}, f"false positives in the harness fixtures: {found}"


def test_token_spans_cover_the_credential_and_a_repeat_in_the_answer_is_found(tiny_tokenizer):
    decode = tokenizer_decode(tiny_tokenizer)
    planted = BY_NAME["env password"]  # found by its name in the prompt; alone in the answer, only as a repeat
    prompt = tiny_tokenizer.encode(f"read .env:\n{planted.line}\nthanks", add_special_tokens=False)
    answer = tiny_tokenizer.encode(f"It is {planted.value}, keep it safe.", add_special_tokens=False)
    assert scan(decode(answer)) == [], "the value alone is not recognisable"
    found = scan_call(prompt, 100, answer, decode)
    assert [(f.part, f.kind) for f in found] == [
        (PROMPT, "Secret Assignment"),
        (COMPLETION, "Repeated Secret Assignment"),
    ]
    in_prompt, in_answer = found
    covered = decode(prompt[in_prompt.start - 100 : in_prompt.end - 100])
    assert planted.value in covered and len(covered) < len(planted.value) + 8
    assert planted.value in decode(answer[in_answer.start : in_answer.end])
    # Redacted text keeps what is around the credential.
    shown = decode_redacted(answer, [("Repeated Secret Assignment", in_answer.start, in_answer.end)], decode)
    assert planted.value not in shown and shown.startswith("It is") and "[secret redacted:" in shown
    pieces = redact_pieces([decode([t]) for t in prompt], [])
    assert planted.value not in "".join(pieces) and "[secret redacted: Secret Assignment]" in "".join(pieces)


# --- through the gateway -----------------------------------------------------------------------------------------


def _chat(gw: Any, engine: ScriptedEngine) -> str:
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-chat/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", "function": READ_FILE}]
    messages: list[Any] = [{"role": "user", "content": f"Deploy it. {BY_NAME['postgres url'].line}"}]
    engine.push(TOOL_CALL)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=tools)
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": f"{BY_NAME['env password'].line}\n{BY_NAME['rsa private key'].line}",
        },
    ]
    engine.push(f"Pushed with {BY_NAME['github token'].value} as asked.")
    client.chat.completions.create(model="tiny", messages=messages, tools=tools)
    return "ro-chat"


def _responses(gw: Any, engine: ScriptedEngine) -> str:
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-resp/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", **READ_FILE}]
    engine.push(TOOL_CALL)
    first = client.responses.create(model="tiny", input=f"Call the API with {BY_NAME['jwt'].line}", tools=tools)
    call = first.output[0]
    engine.push(f"aws_secret_access_key = {BY_NAME['aws secret key'].value} is now in the config.")
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": BY_NAME["openssh private key"].line}]
    client.responses.create(model="tiny", previous_response_id=first.id, input=follow, tools=tools)
    return "ro-resp"


def _messages(gw: Any, engine: ScriptedEngine) -> str:
    client = anthropic.Anthropic(base_url=gw.url + "/rollouts/ro-msg", api_key="k", max_retries=0)
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object"}}]
    messages: list[Any] = [{"role": "user", "content": f"Post to Slack: {BY_NAME['slack token'].line}"}]
    engine.push(TOOL_CALL)
    first = client.messages.create(model="tiny", max_tokens=64, messages=messages, tools=tools)
    use = next(b for b in first.content if b.type == "tool_use")
    result = f"{BY_NAME['openai key'].line}\n{BY_NAME['json client secret'].line}"
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]},
    ]
    engine.push(f"Charged the card with key {BY_NAME['stripe key'].value}.")
    client.messages.create(model="tiny", max_tokens=64, messages=messages, tools=tools)
    return "ro-msg"


# Where each API's conversation put each credential: (rollout, credential, the part of the second call that holds it,
# or of the first call for what the first request sent).
PLACES = [
    ("ro-chat", "postgres url", 0, PROMPT),
    ("ro-chat", "env password", 1, PROMPT),
    ("ro-chat", "rsa private key", 1, PROMPT),
    ("ro-chat", "github token", 1, COMPLETION),
    ("ro-resp", "jwt", 0, PROMPT),
    ("ro-resp", "openssh private key", 1, PROMPT),
    ("ro-resp", "aws secret key", 1, COMPLETION),
    ("ro-msg", "slack token", 0, PROMPT),
    ("ro-msg", "openai key", 1, PROMPT),
    ("ro-msg", "json client secret", 1, PROMPT),
    ("ro-msg", "stripe key", 1, COMPLETION),
]
VALUES = sorted({BY_NAME[name].value for _, name, _, _ in PLACES})


def leaked(text: str) -> list[str]:
    """The planted credentials ``text`` holds (a PEM block counts by its body's first line)."""
    return [v for v in VALUES if v.split("\n")[1 if v.startswith("-----") else 0] in text]


def decoded(decode: Any, ids: list[int]) -> str:
    """Token ids as the API gives them, -1 for a redacted token, as text."""
    return decode([t for t in ids if t >= 0])


@pytest.fixture
def traffic(gateway_factory, tiny_tokenizer, store_url, caplog):
    caplog.set_level(logging.DEBUG)
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, admin_key="adm", database_url=store_url)
    rollouts = [_chat(gw, engine), _responses(gw, engine), _messages(gw, engine)]
    gw.flush()
    db = connect(store_url)
    yield gw, db, rollouts
    db.dispose()


def calls_of(db: sa.Engine, rollout_id: str) -> list[Call]:
    with Session(db) as session:
        return list(session.scalars(sa.select(Call).where(Call.rollout_id == rollout_id).order_by(Call.started_at)))


def test_credentials_across_the_three_apis_are_recorded_and_never_shown(traffic, tiny_tokenizer, caplog, tmp_path):
    gw, db, rollouts = traffic
    decode = tokenizer_decode(tiny_tokenizer)
    with Session(db) as session:
        findings = list(session.scalars(sa.select(SecretFinding)))
    assert {f.kind for f in findings} >= {"Private Key", "JSON Web Token", "Slack Token", "Basic Auth Credentials"}

    # Recorded on the call and the part that first held each one, and the raw tokens there are the credential.
    for rollout_id, name, index, part in PLACES:
        call = calls_of(db, rollout_id)[index]
        raw = httpx.get(f"{gw.url}/v1/rollouts/{rollout_id}", params={"raw": "true"}, headers=ADMIN).json()
        item = next(c for c in raw["calls"] if c["id"] == call.id)
        ids = item["prompt_token_ids"] + item["completion_token_ids"]
        spans = [s for s in item["secrets"] if (s["start"] >= call.prompt_len) == (part == COMPLETION)]
        assert any(leaked(decode(ids[s["start"] : s["end"]])) == [BY_NAME[name].value] for s in spans), (
            rollout_id,
            name,
            spans,
        )

    # The rollout API: every credential's tokens read -1; the text of what is left holds none of them.
    for rollout_id in rollouts:
        body = httpx.get(f"{gw.url}/v1/rollouts/{rollout_id}", headers=ADMIN).json()
        for c in body["calls"]:
            assert leaked(decoded(decode, c["prompt_token_ids"])) == []
            assert leaked(decoded(decode, c["completion_token_ids"])) == []
            assert (-1 in c["prompt_token_ids"] + c["completion_token_ids"]) == bool(c["secrets"])
        tree = httpx.get(f"{gw.url}/v1/rollouts/{rollout_id}/tree", params={"tokens": "true"}, headers=ADMIN).json()
        assert leaked(decoded(decode, [t for n in tree["nodes"] for t in n["token_ids"]])) == []
    # Raw ids are for the admin key only: a rollout's own key gets a 403 in the API's error shape.
    key = httpx.post(f"{gw.url}/v1/rollouts", json={"task_id": "t"}, headers=ADMIN).json()["api_key"]
    own = {"Authorization": f"Bearer {key}"}
    created = httpx.get(f"{gw.url}/v1/rollouts", headers=ADMIN).json()["data"][0]["id"]
    refused = httpx.get(f"{gw.url}/v1/rollouts/{created}", params={"raw": "true"}, headers=own)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "raw"

    # `clawgate export`: neither the file's text nor its token ids decoded.
    out = tmp_path / "export.jsonl"
    args = argparse.Namespace(
        database_url=gw.settings.database_url, out=str(out), status=None, limit=None, no_tokens=False, raw=False,
        tenant=None, keep_dead_leaves=False, keep_compaction=False, keep_subagents=False, max_leaves=8,
    )  # fmt: skip
    assert cmd_export(args) == 0
    text = out.read_text(encoding="utf-8")
    assert leaked(text) == []
    for line in text.splitlines():
        record = json.loads(line)
        for c in record["calls"]:
            assert leaked(decoded(decode, c["prompt_token_ids"] + c["completion_token_ids"])) == []

    # No log line of clawgate's at any level, from serving the calls (the fixture) to here (the SDK clients' own
    # debug lines print their requests, and are not clawgate's).
    records = [*caplog.get_records("setup"), *caplog.records]
    ours = [r for r in records if r.name.startswith(("clawgate", "gateway", "uvicorn"))]
    assert ours, "the gateway's log records are captured"
    assert leaked("\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in ours)) == []


def test_the_judge_sees_placeholders_and_the_trainer_trains_no_credential(traffic, tiny_tokenizer):
    gw, db, rollouts = traffic
    decode = tokenizer_decode(tiny_tokenizer)
    for rollout_id in rollouts:
        r = httpx.post(f"{gw.url}/v1/rollouts/{rollout_id}/finish", json={"status": "completed"}, headers=ADMIN)
        assert r.status_code == 200, r.text

    # The judge (through LiteLLM, to a server that records every request) gets redacted text.
    with JudgeServer(lambda m: json.dumps({"score": 0.5, "reason": "ok"})) as server:
        judged = asyncio.run(worker_for(db, tiny_tokenizer, server).run_once())
    assert judged == 6 and len(server.requests) == 6
    sent = json.dumps(server.requests)
    assert leaked(sent) == [] and "[secret redacted: " in sent

    # Training: under "exclude" (the default) an answer holding a credential is never a ready turn and never
    # trainable in a tree; under "mask" only its credential's tokens are left out; "off" trains it (the control).
    answers = {calls_of(db, r)[1].id for r in rollouts}
    everything = {c.id for r in rollouts for c in calls_of(db, r)}
    ready = set(turns.ready_turns(db, 0, 100, await_judge=True))
    assert ready == everything - answers
    assert set(turns.ready_turns(db, 0, 100, await_judge=True, secrets="off")) == everything

    def trained_text(secrets: str) -> str:
        texts = []
        for _, tree in turn_trees(db, load_turns(db, sorted(everything)), secrets):
            for node in tree.nodes:
                if node.trainable.any():
                    texts.append(decode([int(t) for t, keep in zip(node.tokens, node.trainable, strict=True) if keep]))
        return "\n".join(texts)

    assert leaked(trained_text("off")) != [], "the control: the answers do hold credentials"
    assert leaked(trained_text("exclude")) == []
    masked = trained_text("mask")
    assert leaked(masked) == [] and "as asked" in masked, "mask keeps the rest of the answer"


def test_the_console_shows_placeholders_in_a_real_browser(traffic, chromium_path):
    gw, _, rollouts = traffic
    errors: list[str] = []
    with browser_page(chromium_path, errors) as page:
        page.goto(gw.url + "/dashboard/login")
        page.fill("#key", "adm")
        page.click("button[type=submit]")
        for rollout_id in rollouts:
            page.goto(f"{gw.url}/dashboard/rollouts/{rollout_id}")
            html = page.content()
            assert leaked(html) == [], rollout_id
            assert "[secret redacted: " in html and "credential" in page.inner_text(".flag >> nth=0")
    assert errors == []


def test_forgetting_a_rollout_removes_its_findings(traffic):
    gw, db, _ = traffic
    r = httpx.post(f"{gw.url}/v1/admin/forget", json={"rollouts": ["ro-chat"]}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["deleted"]["secret_findings"] >= 4
    with Session(db) as session:
        left = set(session.scalars(sa.select(SecretFinding.rollout_id)))
    assert left == {"ro-resp", "ro-msg"} and orphans(db) == {}


def test_a_trees_untrained_span_is_context_and_the_rest_of_the_answer_trains():
    from prefix_tree import CallView, build_tree

    prompt, answer = [1, 2, 3], [10, 11, 12, 13, 14, 15]
    logprobs = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]

    def view(untrained: tuple[tuple[int, int], ...]) -> CallView:
        return CallView("c", prompt, answer, logprobs, 0.0, "ok", policy_version=3, untrained=untrained)

    def trained(untrained: tuple[tuple[int, int], ...]) -> list[tuple[int, float, int]]:
        tree = build_tree([view(untrained)])
        out = []
        for node in tree.nodes:
            for i in range(len(node.tokens)):
                if node.trainable[i]:
                    out.append((int(node.tokens[i]), float(node.logprobs[i]), int(node.versions[i])))
                else:
                    assert node.versions[i] == -1 and (
                        node.depth + i < len(prompt) or node.logprobs[i] != node.logprobs[i]
                    )
        return sorted(out)

    assert trained(()) == [(t, lp, 3) for t, lp in zip(answer, logprobs, strict=True)]
    assert trained(((2, 4),)) == [(10, -0.1, 3), (11, -0.2, 3), (14, -0.5, 3), (15, -0.6, 3)]
    assert trained(((0, len(answer)),)) == []


def test_drop_replaces_credentials_in_what_is_stored_and_nothing_around_them_trains(
    gateway_factory, tiny_tokenizer, store_url
):
    from gateway.store import codec
    from gateway.store.models import StoredResponse

    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(
        engine=engine, tokenizer=tiny_tokenizer, admin_key="adm", database_url=store_url, secrets="drop"
    )
    decode = tokenizer_decode(tiny_tokenizer)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-drop/v1", api_key="k", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"Use this: {BY_NAME['gitlab token'].line}"}]
    engine.push(f"Done with {BY_NAME['stripe key'].value} too.")
    first = client.chat.completions.create(model="tiny", messages=messages)
    assert BY_NAME["stripe key"].value in first.choices[0].message.content, "the client gets the answer as served"
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks."}]
    engine.push("You are welcome.")
    client.chat.completions.create(model="tiny", messages=messages)
    engine.push(f"Your key is {BY_NAME['github token'].value}.")
    other = openai.OpenAI(base_url=gw.url + "/rollouts/ro-drop-r/v1", api_key="k", max_retries=0)
    answer = other.responses.create(model="tiny", input="What is my key?")
    gw.flush()

    db = connect(store_url)
    try:
        first_call, second_call = calls_of(db, "ro-drop")
        assert second_call.parent_call_id == first_call.id and second_call.prompt_prefix_len > first_call.prompt_len
        raw = httpx.get(f"{gw.url}/v1/rollouts/ro-drop", params={"raw": "true"}, headers=ADMIN).json()
        for c in raw["calls"]:
            assert leaked(decode(c["prompt_token_ids"] + c["completion_token_ids"])) == []
            assert len(c["prompt_token_ids"]) == c["prompt_tokens"], "positions stay where they were"
            assert "*" * 8 in decode(c["prompt_token_ids"] + c["completion_token_ids"])
        with Session(db) as session:
            stored = [codec.unpack_request(c.request) for c in session.scalars(sa.select(Call))]
            items = [codec.unpack_request(r.items) for r in session.scalars(sa.select(StoredResponse)) if r.items]
            kinds = set(session.scalars(sa.select(SecretFinding.kind)))
        assert leaked(json.dumps(stored)) == [] and leaked(json.dumps(items)) == [] and items
        assert "[secret redacted: dropped]" in json.dumps(stored)
        assert {"GitLab Token", "Stripe Access Key", "GitHub Token"} <= kinds
        assert answer.output_text.endswith(f"{BY_NAME['github token'].value}."), "served as generated"

        # Neither call of the conversation trains: the first held credentials, the second's context repeats them.
        for rollout_id in ("ro-drop", "ro-drop-r"):
            r = httpx.post(f"{gw.url}/v1/rollouts/{rollout_id}/finish", json={"status": "completed"}, headers=ADMIN)
            assert r.status_code == 200
        for call in (first_call, second_call):
            posted = httpx.post(f"{gw.url}/v1/feedback", json={"call_id": call.id, "value": 1.0}, headers=ADMIN)
            assert posted.status_code == 201, posted.text
        assert set(turns.ready_turns(db, 0, 10, await_judge=False, secrets="drop")) == {second_call.id}
        [(_, tree)] = turn_trees(db, load_turns(db, [second_call.id]), "drop")
        assert not any(node.trainable.any() for node in tree.nodes)
        [(_, tree)] = turn_trees(db, load_turns(db, [second_call.id]), "off")
        assert any(node.trainable.any() for node in tree.nodes), "the control"
    finally:
        db.dispose()


def test_a_dropped_call_replayed_from_a_spool_line_keeps_its_findings(tiny_tokenizer):
    import datetime as dt

    from gateway.credentials.tokens import RecordScanner
    from gateway.store.records import CallRecord, record_from_json, record_to_json
    from gateway.store.rows import prepare

    decode = tokenizer_decode(tiny_tokenizer)
    now = dt.datetime.now(dt.UTC)
    line = BY_NAME["github token"].line
    record = CallRecord(
        id="call-1", request_id="r", rollout_id="ro", api="chat", model="m", engine="e", render_mode="fresh",
        request={"messages": [{"role": "user", "content": line}]}, started_at=now, ended_at=now,
        prompt_delta=tiny_tokenizer.encode(line, add_special_tokens=False),
        completion_ids=tiny_tokenizer.encode("ok", add_special_tokens=False), completion_logprobs=[-0.1],
    )  # fmt: skip
    scanner = RecordScanner(tiny_tokenizer, drop=True)
    first = prepare([record], scanner)
    assert [(f["part"], f["kind"]) for f, _ in first.findings] == [(PROMPT, "GitHub Token")]
    assert leaked(decode(record.prompt_delta)) == [] and leaked(json.dumps(record.request)) == []
    # The writer spools the record while the database is down; the replay stores the same findings.
    replayed = record_from_json(json.loads(json.dumps(record_to_json(record))))
    again = prepare([replayed], scanner)
    assert [(f["part"], f["start"], f["end"]) for f, _ in again.findings] == [
        (f["part"], f["start"], f["end"]) for f, _ in first.findings
    ]
