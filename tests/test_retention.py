"""Retention and forgetting (``gateway/store/retention.py``): what goes, what stays, and that nothing is left behind.

Real conversations through a gateway on the in-process tiny model (chat completions, a harness session, a
Responses-API chain), rewards and feedback through the API, judgements and training records as the reward worker
and the trainer write them; on SQLite and on Postgres. Every test ends with ``orphans``: no row in any table names
a row that is gone.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.retention_cli import parse_duration
from gateway.store import codec, retention, spool
from gateway.store import forget as forgetting
from gateway.store.db import connect
from gateway.store.models import Judgement, TrainedRollout, TrainedTurn, TrainStep, utcnow

ADMIN = {"Authorization": "Bearer adm"}

# Every reference between the tables: (table, column, referenced table, its column). A new table or column that
# names calls or rollouts belongs here.
REFERENCES = [
    ("calls", "rollout_id", "rollouts", "id"),
    ("calls", "parent_call_id", "calls", "id"),
    ("calls", "next_call_id", "calls", "id"),
    ("rewards", "rollout_id", "rollouts", "id"),
    ("rewards", "call_id", "calls", "id"),
    ("judgements", "call_id", "calls", "id"),
    ("judgements", "rollout_id", "rollouts", "id"),
    ("trained_turns", "call_id", "calls", "id"),
    ("trained_turns", "rollout_id", "rollouts", "id"),
    ("trained_turns", "step_id", "train_steps", "id"),
    ("trained_rollouts", "rollout_id", "rollouts", "id"),
    ("trained_rollouts", "step_id", "train_steps", "id"),
    ("stored_responses", "call_id", "calls", "id"),
    ("secret_findings", "call_id", "calls", "id"),
    ("secret_findings", "rollout_id", "rollouts", "id"),
    ("export_rollouts", "export_id", "exports", "id"),
    ("stored_responses", "previous_id", "stored_responses", "id"),
]


def orphans(engine: sa.Engine) -> dict[str, int]:
    """Rows naming a row that is not there, per reference (empty: none anywhere)."""
    found = {}
    with engine.connect() as conn:
        for table, column, target, key in REFERENCES:
            n = conn.execute(
                sa.text(
                    f"SELECT count(*) FROM {table} t WHERE t.{column} IS NOT NULL "
                    f"AND NOT EXISTS (SELECT 1 FROM {target} x WHERE x.{key} = t.{column})"
                )
            ).scalar_one()
            if n:
                found[f"{table}.{column}"] = n
    return found


def scalar(engine: sa.Engine, query: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(query), params).scalar_one()


def count(engine: sa.Engine, table: str, where: str = "1=1", **params: Any) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE {where}"), params).scalar_one()


def chat(
    gw: Any, turns: int, headers: dict[str, str], first: str = "Hello.", messages: list[dict[str, str]] | None = None
) -> list[str]:
    """A conversation of ``turns`` turns (each continuing the last, and ``messages`` when given: it grows); the
    response ids."""
    client = openai.OpenAI(base_url=gw.v1, api_key="k", max_retries=0, default_headers=headers)
    if messages is None:
        messages = []
    if not messages:
        messages.append({"role": "user", "content": first})
    ids = []
    for turn in range(turns):
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=turn)
        ids.append(out.id)
        messages += [
            {"role": "assistant", "content": out.choices[0].message.content or ""},
            {"role": "user", "content": f"and {turn}?"},
        ]
    return ids


def calls_of(engine: sa.Engine, rollout_id: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.scalars(sa.text("SELECT id FROM calls WHERE rollout_id = :r ORDER BY started_at"), {"r": rollout_id})
        )


def train_records(engine: sa.Engine, version: int, rollouts: list[str] = (), turns: list[tuple[str, str]] = ()) -> None:
    """What a train step that published ``version`` leaves: its step, trained rollouts and trained turns."""
    with sa.orm.Session(engine) as session, session.begin():
        step = TrainStep(
            version=version, algorithm="grpo", status="ok", n_rollouts=len(rollouts), n_paths=1,
            tokens_processed=10, trainable_tokens=5,
        )  # fmt: skip
        session.add(step)
        session.flush()
        for r in rollouts:
            session.add(TrainedRollout(rollout_id=r, epoch=0, step_id=step.id, version=version, advantage=0.5))
        for call_id, rollout_id in turns:
            session.add(TrainedTurn(call_id=call_id, epoch=0, rollout_id=rollout_id, step_id=step.id, version=version))


@pytest.fixture
def gw(gateway_factory, store_url):
    return gateway_factory(database_url=store_url, admin_key="adm")


def test_forget_a_rollout_a_session_and_a_call_leaves_no_orphans(gw, store_url):
    engine = connect(store_url)
    a = httpx.post(gw.url + "/v1/rollouts", json={"task_id": "t", "harness": "sdk"}, headers=ADMIN).json()["id"]
    chat(gw, 3, {"X-Rollout-Id": a})
    chat(gw, 3, {"X-Rollout-Id": "keep-b"}, first="Other.")
    session, session_messages = uuid.uuid4().hex, []
    chat(gw, 2, {"X-Claude-Code-Session-Id": session}, first="Session.", messages=session_messages)
    responses = openai.OpenAI(base_url=gw.v1, api_key="k", max_retries=0)
    r1 = responses.responses.create(model="tiny", input="Chain.", max_output_tokens=4)
    r2 = responses.responses.create(model="tiny", previous_response_id=r1.id, input="On.", max_output_tokens=4)
    gw.flush()
    assert httpx.post(f"{gw.url}/v1/rollouts/{a}/reward", json={"value": 1.0}, headers=ADMIN).status_code == 201
    b_calls = calls_of(engine, "keep-b")
    for call_id in b_calls:
        feedback = {"call_id": call_id, "value": 0.5}
        assert httpx.post(gw.v1 + "/feedback", json=feedback, headers=ADMIN).status_code == 201
    with sa.orm.Session(engine) as s, s.begin():
        s.add(Judgement(call_id=b_calls[1], rollout_id="keep-b", status="done", score=0.7))
    train_records(engine, 1, rollouts=[a])
    train_records(engine, 2, turns=[(b_calls[1], "keep-b")])
    # A dead-letter entry of rollout a in the gateway's own spool directory, beside one of another rollout.
    own_spool = gw.settings.data_dir / "spool"
    lines = [
        {"failed_at": utcnow().isoformat(), "error": "x", "record": {"type": "reward", "rollout_id": r}}
        for r in (a, "z")
    ]
    (own_spool / spool.DEAD_LETTER_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    session_rollout = "claude-code-" + session
    chain_rollout = scalar(
        engine, "SELECT rollout_id FROM calls c JOIN stored_responses r ON r.call_id = c.id WHERE r.id = :i", i=r1.id
    )
    assert count(engine, "stored_responses") == 2 and count(engine, "calls") == 10

    # Forget rollout a and the harness session through the admin route.
    answer = httpx.post(gw.url + "/v1/admin/forget", json={"rollouts": [a], "sessions": [session]}, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["deleted"]["calls"] == 5 and report["deleted"]["rollouts"] == 2
    assert report["deleted"]["trained_rollouts"] == 1 and report["deleted"]["rewards"] == 1
    assert report["trained_versions"] == [1] and report["not_found"] == [] and report["spool_lines"] == 1
    assert count(engine, "calls", "rollout_id IN (:a, :s)", a=a, s=session_rollout) == 0
    assert count(engine, "rollouts", "id IN (:a, :s)", a=a, s=session_rollout) == 0
    assert count(engine, "calls", "rollout_id = 'keep-b'") == 3 and count(engine, "rewards") == 3
    assert [
        json.loads(x)["record"]["rollout_id"] for x in (own_spool / spool.DEAD_LETTER_FILE).read_text().splitlines()
    ] == ["z"]
    assert orphans(engine) == {}

    # The forgotten session goes on (the gateway still holds its last turn): served, and stored whole as a new
    # conversation, never attached to the deleted rows nor dead-lettered.
    chat(gw, 1, {"X-Claude-Code-Session-Id": session}, messages=session_messages)
    gw.flush()
    with engine.connect() as conn:
        (root,) = conn.execute(
            sa.text("SELECT parent_call_id, prompt_prefix_len FROM calls WHERE rollout_id = :s"), {"s": session_rollout}
        ).all()
    assert root == (None, 0) and gw.state.writer.stats.dead_lettered == 0

    # Forget b's middle call: it and the call continuing it go, with their feedback, judgement and trained turn;
    # the first call stays and loses its next-state link.
    report = forgetting.forget(engine, calls=[b_calls[1]])
    assert report.deleted["calls"] == 2 and report.deleted["judgements"] == 1 and report.deleted["trained_turns"] == 1
    assert report.deleted["rewards"] == 2 and report.trained_versions == {2} and report.deleted["rollouts"] == 0
    assert calls_of(engine, "keep-b") == b_calls[:1]
    assert count(engine, "calls", "id = :c AND next_call_id IS NULL", c=b_calls[0]) == 1
    assert orphans(engine) == {}

    # The Responses chain: its rollout goes with both stored answers, and a continuation of one is refused.
    report = forgetting.forget(engine, rollouts=[chain_rollout])
    assert report.deleted["stored_responses"] == 2 and report.response_ids == {r1.id, r2.id}
    gw.state.responses.discard(report.response_ids)
    with pytest.raises(openai.BadRequestError) as refused:
        responses.responses.create(model="tiny", previous_response_id=r2.id, input="More.")
    assert refused.value.body["param"] == "previous_response_id"
    assert orphans(engine) == {}

    # Idempotent: the same forget again deletes nothing and says what was not there.
    again = httpx.post(gw.url + "/v1/admin/forget", json={"rollouts": [a], "calls": [b_calls[1]]}, headers=ADMIN).json()
    assert again["rows"] == 0 and again["not_found"] == [a, b_calls[1]]
    engine.dispose()


def test_forget_refuses_bad_input_in_the_apis_error_format(gw):
    post = lambda body, headers=ADMIN: httpx.post(gw.url + "/v1/admin/forget", json=body, headers=headers)  # noqa: E731
    assert post({"rollouts": ["x"]}, headers={"Authorization": "Bearer k"}).status_code == 401
    empty = post({})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "rollouts"
    unknown = post({"rollout": ["x"]})
    assert unknown.status_code == 400 and "rollout" in unknown.text
    assert post({"calls": [""]}).json()["error"]["param"] == "calls"


def age(engine: sa.Engine, rollout_ids: list[str], days: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE rollouts SET updated_at = :t WHERE id IN :ids").bindparams(
                sa.bindparam("ids", expanding=True)
            ),
            {"t": utcnow() - dt.timedelta(days=days), "ids": rollout_ids},
        )


def test_prune_by_age_keeps_new_continued_and_trained_summaries(gw, store_url, tmp_path):
    engine = connect(store_url)
    for name in ("old-trained", "old", "old-continued", "new"):
        chat(gw, 2, {"X-Rollout-Id": name}, first=name)
    gw.flush()
    trained_calls = calls_of(engine, "old-trained")
    train_records(engine, 3, rollouts=["old-trained"], turns=[(trained_calls[0], "old-trained")])
    for r in ("old-trained", "new"):
        assert httpx.post(f"{gw.url}/v1/rollouts/{r}/reward", json={"value": 1.0}, headers=ADMIN).status_code == 201
    # "new" continues a call of "old-continued" (a conversation that moved on to another rollout).
    moved = calls_of(engine, "old-continued")[1]
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE calls SET rollout_id = 'new' WHERE id = :c"), {"c": moved})
    age(engine, ["old-trained", "old", "old-continued"], 40)
    # A spool directory no process holds: an old and a new dead-letter line, and an old pending file.
    spool_dir = gw.settings.data_dir / "spool-7"
    spool_dir.mkdir(parents=True)
    stamps = [utcnow() - dt.timedelta(days=40), utcnow()]
    (spool_dir / spool.DEAD_LETTER_FILE).write_text(
        "".join(json.dumps({"failed_at": t.isoformat(), "error": "e", "line": "x"}) + "\n" for t in stamps)
    )
    pending = spool_dir / "pending-old.jsonl"
    pending.write_text('{"type": "reward"}\n')
    old = time.time() - 40 * 86400
    os.utime(pending, (old, old))

    report = retention.prune(engine, older_than=parse_duration("30d"), keep_trained_summaries=True)
    assert report.kept_continued == 1 and report.trained_versions == {3}
    assert report.deleted["calls"] == 4 and report.deleted["rollouts"] == 1 and report.deleted["trained_turns"] == 1
    assert count(engine, "rollouts", "id = 'old'") == 0
    # The trained rollout's summary stays: its row, its reward, its training record; its calls go.
    assert (
        count(engine, "rollouts", "id = 'old-trained'") == 1
        and count(engine, "calls", "rollout_id = 'old-trained'") == 0
    )
    assert count(engine, "trained_rollouts", "rollout_id = 'old-trained'") == 1
    assert count(engine, "rewards", "rollout_id = 'old-trained'") == 1
    assert len(calls_of(engine, "old-continued")) == 1 and len(calls_of(engine, "new")) == 3
    assert orphans(engine) == {}
    assert spool.clean_all(gw.settings.data_dir / "spool", cutoff=utcnow() - dt.timedelta(days=30)) == (2, 1, 1)
    assert len((spool_dir / spool.DEAD_LETTER_FILE).read_text().splitlines()) == 1 and not pending.exists()

    # Idempotent; and once the continuing rollout ages out too, both go.
    assert retention.prune(engine, older_than=dt.timedelta(days=30), keep_trained_summaries=True).rows == 0
    age(engine, ["new"], 40)
    report = retention.prune(engine, older_than=dt.timedelta(days=30))
    assert report.deleted["rollouts"] == 3 and count(engine, "calls") == 0 and count(engine, "rollouts") == 0
    assert count(engine, "trained_rollouts") == 0 and orphans(engine) == {}
    engine.dispose()


def test_db_prune_and_forget_commands(gw, store_url, capsys, monkeypatch, tmp_path):
    from clawgate.cli import main

    monkeypatch.setenv("CLAWGATE_DATA_DIR", str(tmp_path / "cli-data"))
    engine = connect(store_url)
    chat(gw, 2, {"X-Rollout-Id": "cli-old"})
    chat(gw, 1, {"X-Rollout-Id": "cli-forget"})
    gw.flush()
    age(engine, ["cli-old"], 10)
    assert main(["db", "prune", "--older-than", "7d", "--database-url", store_url]) == 0
    out = capsys.readouterr().out
    assert "pruned 3 rows" in out and "2 calls, 1 rollouts" in out
    assert main(["forget", "--rollout", "cli-forget", "--call", "nope", "--json", "--database-url", store_url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"]["calls"] == 1 and report["not_found"] == ["nope"]
    assert count(engine, "rollouts") == 0
    with pytest.raises(SystemExit) as refused:
        main(["db", "prune", "--older-than", "soon", "--database-url", store_url])
    assert refused.value.code == 2 and "not a positive duration: 'soon'" in capsys.readouterr().err
    assert main(["db", "prune", "--database-url", store_url]) == 2
    assert main(["db", "upgrade", "--older-than", "3d", "--database-url", store_url]) == 2
    engine.dispose()


def test_forget_takes_the_rollouts_out_of_export_files(gw, store_url, capsys, tmp_path):
    from clawgate.cli import main
    from gateway.store import exports

    engine = connect(store_url)
    for name in ("ex-a", "ex-b", "ex-c"):
        chat(gw, 2, {"X-Rollout-Id": name}, first=f"Hello {name}.")
    gw.flush()
    whole, single = tmp_path / "all.jsonl", tmp_path / "one.jsonl"
    assert main(["export", "--out", str(whole), "--database-url", store_url]) == 0
    assert main(["export", "--out", str(single), "--limit", "1", "--database-url", store_url]) == 0
    ids = lambda path: [json.loads(line)["id"] for line in path.read_text().splitlines()]  # noqa: E731
    assert ids(whole) == ["ex-a", "ex-b", "ex-c"] and ids(single) == ["ex-a"]
    elsewhere = exports.record(engine, tmp_path / "remote.jsonl", ["ex-a"])
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE exports SET host = 'other-host' WHERE id = :i"), {"i": elsewhere})
    capsys.readouterr()

    # Forgetting a rollout rewrites every export on this host that holds it; one left empty is deleted.
    answer = httpx.post(gw.url + "/v1/admin/forget", json={"rollouts": ["ex-a"]}, headers=ADMIN).json()
    assert answer["exports"]["lines"] == 2 and sorted(answer["exports"]["rewritten"]) == sorted(
        [str(whole.resolve()), str(single.resolve())]
    )
    assert answer["exports"]["elsewhere"] == [f"other-host:{(tmp_path / 'remote.jsonl').resolve()}"]
    assert ids(whole) == ["ex-b", "ex-c"] and not single.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary file left"

    # Forgetting a call changes its rollout: the command takes the rollout out too.
    call = calls_of(engine, "ex-b")[1]
    assert main(["forget", "--call", call, "--database-url", store_url]) == 0
    assert f"exports: 1 rollouts taken out of {whole.resolve()}" in capsys.readouterr().out
    assert ids(whole) == ["ex-c"]
    # A moved export is reported, and its rows go; a second forget of the same rollout touches nothing.
    whole.rename(tmp_path / "moved.jsonl")
    answer = httpx.post(gw.url + "/v1/admin/forget", json={"rollouts": ["ex-c"]}, headers=ADMIN).json()
    assert answer["exports"]["missing"] == [str(whole.resolve())] and answer["exports"]["rewritten"] == []
    assert count(engine, "exports") == 1 and count(engine, "export_rollouts") == 1  # the other host's
    assert orphans(engine) == {}
    engine.dispose()


def test_prune_and_forget_under_concurrent_capture(gw, store_url, caplog):
    """Conversations go on while prune (a 1-second window) and forget delete around and under them: every call is
    served, none is dead-lettered, and nothing is left dangling."""
    caplog.set_level(logging.INFO, logger="clawgate.capture")
    engine = connect(store_url)
    stop = threading.Event()
    served: list[str] = []
    errors: list[BaseException] = []
    rollouts = [f"busy-{i}" for i in range(6)]

    def converse(worker: int) -> None:
        try:
            i = worker
            while not stop.is_set():
                served.extend(chat(gw, 3, {"X-Rollout-Id": rollouts[i % len(rollouts)]}, first=f"w{worker} {i}"))
                i += 2
        except BaseException as error:  # reported by the test
            errors.append(error)

    threads = [threading.Thread(target=converse, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    deletions = 0
    stored_whole = lambda: sum("stored whole" in r.getMessage() for r in caplog.records)  # noqa: E731
    deadline = time.monotonic() + 10
    # 10 s of deleting beside the conversations, and on (at most 30 s more) until a deletion has hit a call being
    # served: on a loaded machine the first seconds may pass without one.
    while not errors and (time.monotonic() < deadline or (stored_whole() == 0 and time.monotonic() < deadline + 30)):
        deletions += retention.prune(engine, older_than=dt.timedelta(seconds=1)).rows
        deletions += forgetting.forget(engine, rollouts=rollouts[deletions % 3 :: 3]).rows
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == [] and len(served) >= 12 and deletions > 0
    gw.flush()
    whole = stored_whole()
    print(f"{len(served)} calls served, {deletions} rows deleted meanwhile, {whole} calls stored whole")
    assert whole > 0  # a forget or prune did delete a parent under a call being served
    assert gw.state.writer.stats.dead_lettered == 0
    assert count(engine, "calls", "status <> 'ok'") == 0
    assert orphans(engine) == {}
    # What was not deleted is whole: every kept call's prompt rebuilds from its parent chain.
    with engine.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                sa.text(
                    "SELECT id, parent_call_id, prompt_prefix_len, prompt_len, prompt_delta, completion_ids FROM calls"
                )
            )
        }
    for row in rows.values():
        if row.parent_call_id is None:
            assert row.prompt_prefix_len == 0 and len(codec.unpack_ids(row.prompt_delta)) == row.prompt_len
        else:
            parent = rows[row.parent_call_id]
            assert row.prompt_prefix_len <= parent.prompt_len + len(codec.unpack_ids(parent.completion_ids))
    engine.dispose()


def test_parse_duration():
    assert parse_duration("30d") == dt.timedelta(days=30) and parse_duration("12h") == dt.timedelta(hours=12)
    assert parse_duration("90m") == dt.timedelta(minutes=90) and parse_duration("2") == dt.timedelta(days=2)
    for bad in ("", "0d", "-1d", "3 years", "d"):
        with pytest.raises(Exception, match="positive duration"):
            parse_duration(bad)


def test_dead_letter_and_pending_lines_of_forgotten_ids(tmp_path: Path):
    base = tmp_path / "spool"
    base.mkdir()
    records = [
        {"type": "call", "id": "c1", "rollout_id": "r1"},
        {"type": "call", "id": "c2", "rollout_id": "r2", "rollout": {"id": "r2"}},
    ]
    (base / "pending-1.jsonl").write_text(json.dumps(records[0]) + "\n")
    (base / "pending-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (base / spool.DEAD_LETTER_FILE).write_text(
        json.dumps({"failed_at": "x", "error": "e", "line": '{"rollout_id": "r1" broken'}) + "\n"
    )
    assert spool.clean_all(base, ids=frozenset({"r1"})) == (3, 1, 0)
    assert not (base / "pending-1.jsonl").exists()
    assert [json.loads(x)["id"] for x in (base / "pending-2.jsonl").read_text().splitlines()] == ["c2"]
    # A directory a running writer holds is left to it.
    _, lock = spool.claim_dir(base)
    try:
        assert spool.clean_all(base, ids=frozenset({"r2"})) == (0, 0, 1)
    finally:
        lock.close()


def test_a_step_whose_data_is_forgotten_before_it_publishes_publishes_nothing_and_forgets_the_update(
    gateway_factory, tiny_model_dir, tmp_path, monkeypatch
):
    """The trainer claimed a batch; an operator forgets one of its rollouts before the step's publish commits. The
    publish fails on the deleted rows, the policy goes back to the last published weights (the update that saw
    the forgotten rollout reaches no version), and the next step trains on what is left."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from tests.test_train_step import rollout
    from trainer import publish
    from trainer.config import TrainConfig
    from trainer.step import Trainer

    gw = gateway_factory(admin_key="adm")
    url = gw.settings.database_url
    a_hi, a_lo, b_hi, b_lo = (rollout(gw, t, r) for t, r in (("A", 1.0), ("A", 0.0), ("B", 1.0), ("B", 0.0)))
    engine = connect(url)
    adapters = tmp_path / "adapters"
    trainer = Trainer(TrainConfig(database_url=url, model=str(tiny_model_dir), adapter_dir=adapters, lr=0.05), engine)
    original = publish.record_version

    def forget_first(*args: Any, **kwargs: Any) -> Any:
        forgetting.forget(engine, rollouts=[a_hi])
        return original(*args, **kwargs)

    monkeypatch.setattr(publish, "record_version", forget_first)
    with pytest.raises(sa.exc.IntegrityError):
        trainer.step()
    monkeypatch.setattr(publish, "record_version", original)
    v0 = load_file(adapters / "policy@v0" / "adapter_model.safetensors")
    held = get_peft_model_state_dict(trainer.policy)
    assert held.keys() == v0.keys() and all(torch_equal(held[k], v0[k]) for k in v0)
    assert count(engine, "policy_versions", "version > 0") == 0 and count(engine, "trained_rollouts") == 0

    result = trainer.step()
    assert result is not None and result.version == 1
    with engine.connect() as conn:
        trained = set(conn.scalars(sa.text("SELECT rollout_id FROM trained_rollouts")))
    assert trained and a_hi not in trained and trained <= {a_lo, b_hi, b_lo}
    assert orphans(engine) == {}
    engine.dispose()


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
