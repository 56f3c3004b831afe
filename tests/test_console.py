"""The operator console in a real headless Chromium (Debian's `chromium`, driven by Playwright; no browser download).

A gateway on the tiny model serves task rollouts and everyday turns under three policy versions (published the
way the trainer does and followed by the gateway), with rollout rewards, per-call feedback, a retried call and train
steps. Then a browser: the console asks for the admin key (a wrong one is refused), every page loads with no console
error, the charts are drawn from the data (one point per version that served rewarded turns), and a rollout's page
shows its decoded calls, coloured tokens, rewards and the retry the tree filtered; with counterfactual groups on, a
turn's siblings are shown apart from its answer, decoded token by token, with their finish reasons and scores beside
the served answer's (and credentials hidden). Under guarded promotion the versions page shows each version's stage, a
running canary's arms (the same figures as ``GET /v1/policy``), the verdict so far and the decisions, and its buttons
promote or reject the candidate. Screenshots of every page land in the test's tmp dir (``screenshots/``).

The versions are published with distinct non-zero adapters, and after every pin, unpin, rollback, promotion and
rejection from the console a greedy completion through the gateway must be the served version's reference ids (base
model + its adapter, computed in the test): a gateway serving one version's weights under another's name fails.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from gateway.credentials.tokens import token_span, tokenizer_decode
from gateway.dashboard import auth, charts, rollout_page, routes
from gateway.promotion.stats import ArmStats, Rule, decide
from gateway.store import counterfactuals
from gateway.store.counterfactuals import SiblingScore
from gateway.store.db import connect
from gateway.store.models import TrainStep
from gateway.store.policy_control import Control
from tests.missing import missing
from tests.policies import PROBE, assert_serves, distinct_references, publish, served_ids
from tests.secret_corpus import corpus
from tests.test_counterfactuals import settle
from tests.test_promotion import ADMIN as PROMOTION_ADMIN
from tests.test_promotion import GUARDED, User, stage

ADMIN_KEY = "console-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHROMIUM = os.environ.get("CLAWGATE_TEST_CHROMIUM", "/usr/bin/chromium")
# Chromium's own background traffic is refused on a closed network: keep it quiet.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def wait_for(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def chat(base: str, content: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}
    r = httpx.post(base + "/chat/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def task_rollout(gw: Any, task: str, reward: float) -> str:
    ro = httpx.post(gw.v1 + "/rollouts", json={"task_id": task, "harness": "sdk"}, headers=ADMIN, timeout=30).json()
    key = {"Authorization": f"Bearer {ro['api_key']}"}
    chat(ro["base_url"], f"solve {task}", key, temperature=1.0)
    assert httpx.post(f"{gw.v1}/rollouts/{ro['id']}/reward", json={"value": reward}, headers=key).status_code == 201
    assert httpx.post(f"{gw.v1}/rollouts/{ro['id']}/finish", json={}, headers=key).status_code == 200
    return str(ro["id"])


def retried_rollout(gw: Any) -> str:
    """The same first request sent twice, the second answer continued: the first is a dead leaf of the tree."""
    ro = httpx.post(gw.v1 + "/rollouts", json={"task_id": "retry", "harness": "sdk"}, headers=ADMIN).json()
    key = {"Authorization": f"Bearer {ro['api_key']}"}
    first = [{"role": "user", "content": "list the files"}]
    for _ in range(2):
        r = httpx.post(
            ro["base_url"] + "/chat/completions",
            json={"model": "tiny", "messages": first, "max_tokens": 6, "temperature": 1.0},
            headers=key,
            timeout=60,
        )
        assert r.status_code == 200
    answer = r.json()["choices"][0]["message"]["content"] or ""
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "now read them"}]
    r = httpx.post(
        ro["base_url"] + "/chat/completions",
        json={"model": "tiny", "messages": follow, "max_tokens": 6},
        headers=key,
        timeout=60,
    )
    assert r.status_code == 200
    httpx.post(f"{gw.v1}/rollouts/{ro['id']}/finish", json={}, headers=key)
    return str(ro["id"])


def train_steps(url: str) -> None:
    now = dt.datetime.now(dt.UTC)
    store = connect(url)
    try:
        with Session(store) as session, session.begin():
            for i, loss in enumerate((0.9, 0.6, 0.4)):
                session.add(
                    TrainStep(
                        version=i + 1,
                        base_version=i,
                        algorithm="grpo",
                        status="ok",
                        n_rollouts=4,
                        n_paths=4,
                        tokens_processed=1000 + 100 * i,
                        trainable_tokens=200,
                        metrics={"loss": loss, "reward_mean": 0.2 * i, "approx_kl": 0.01 * i, "grad_norm": 1.5},
                        started_at=now - dt.timedelta(seconds=60 - 10 * i),
                        ended_at=now - dt.timedelta(seconds=55 - 10 * i),
                    )
                )
            session.add(
                TrainStep(
                    base_version=3,
                    algorithm="grpo",
                    status="failed",
                    n_rollouts=0,
                    n_paths=0,
                    tokens_processed=0,
                    trainable_tokens=0,
                    error="RuntimeError: CUDA error: out of memory",
                    started_at=now,
                    ended_at=now,
                )
            )
    finally:
        store.dispose()


@pytest.fixture(scope="module")
def chromium_path() -> str:
    if shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists():
        missing("Debian's chromium is not installed (apt-get install chromium)")
    return CHROMIUM


@contextlib.contextmanager
def browser_page(chromium_path: str, errors: list[str]) -> Iterator[Any]:
    """A page of headless Debian chromium that appends the page's script and console errors to ``errors``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        try:
            yield page
        finally:
            browser.close()


@pytest.fixture
def console(gateway_factory, tiny_model_dir, tmp_path) -> Any:
    adapters = tmp_path / "adapters"
    gw = gateway_factory(admin_key=ADMIN_KEY, policy_poll_interval=0.1, adapter_dir=adapters, max_tokens=16)
    url = gw.settings.database_url
    paths = {}
    for version in range(3):
        paths[version] = publish(url, adapters, tiny_model_dir, version, scale=0.5, seeded=True)
        wait_for(lambda v=version: gw.state.service.policy_version == v, what=f"policy@v{version}")
        for reward in (0.2 * version, 0.2 * version + 0.1):
            task_rollout(gw, "fix-bug", reward)
        call_id = chat(gw.v1, f"everyday question {version}").headers["x-clawgate-call-id"]
        posted = httpx.post(gw.v1 + "/feedback", json={"call_id": call_id, "value": 0.3 * version}, headers=ADMIN)
        assert posted.status_code == 201, posted.text
    gw.retry_rollout = retried_rollout(gw)
    train_steps(url)
    gw.flush()
    gw.references = distinct_references(tiny_model_dir, paths, PROBE, 8)
    return gw


def test_the_console_shows_what_serves_what_learns_and_what_happened(console, chromium_path, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    errors: list[str] = []
    with browser_page(chromium_path, errors) as page:
        # Login is required: the console sends the browser to the form, and a wrong key is refused.
        page.goto(console.url + "/dashboard/rollouts")
        assert page.url.startswith(console.url + "/dashboard/login")
        page.fill("#key", "not-the-key")
        page.click("button[type=submit]")
        assert "not the admin key" in page.inner_text("form")
        page.screenshot(path=str(shots / "login.png"))
        assert len(errors) == 1 and "401" in errors[0], "the refused login answers 401, which the browser reports"
        errors.clear()
        page.fill("#key", ADMIN_KEY)
        page.click("button[type=submit]")
        assert page.url == console.url + "/dashboard/rollouts", "back where the login was asked for"
        cookie = next(c for c in page.context.cookies() if c["name"] == auth.COOKIE)
        assert cookie["httpOnly"] and ADMIN_KEY not in cookie["value"]

        page.goto(console.url + "/dashboard")
        assert page.inner_text("#serving-adapter") == "policy@v2"
        trainer = page.inner_text("#card-trainer")
        assert "failing" in trainer and "out of memory" in trainer, trainer
        page.screenshot(path=str(shots / "overview.png"), full_page=True)

        page.goto(console.url + "/dashboard/rewards")
        points = page.locator('#reward-chart circle.point[data-series="turn reward"]')
        assert points.count() == 3, "one point per policy version that served rewarded turns"
        assert [float(points.nth(i).get_attribute("data-y") or "nan") for i in range(3)] == pytest.approx(
            [0.0, 0.3, 0.6]
        )
        rollout_points = page.locator('#reward-chart circle.point[data-series="rollout reward"]')
        assert [float(rollout_points.nth(i).get_attribute("data-y") or "nan") for i in range(3)] == pytest.approx(
            [0.05, 0.25, 0.45]
        )
        assert "fix-bug" in page.inner_text("#groups")
        page.screenshot(path=str(shots / "rewards.png"), full_page=True)

        page.goto(console.url + "/dashboard/steps")
        loss = page.locator('[data-figure="loss"] circle.point')
        assert loss.count() == 3, "the failed step has no loss to draw"
        assert "out of memory" in page.inner_text("#steps")
        page.screenshot(path=str(shots / "steps.png"), full_page=True)

        page.goto(console.url + "/dashboard/rollouts?task_id=fix-bug")
        table = page.inner_text("#rollouts")
        assert "6 rollouts" in page.inner_text("main") and "retry" not in table
        page.goto(console.url + "/dashboard/rollouts?policy_version=1")
        assert page.locator("#rollouts tr").count() == 1 + 3, "two task rollouts and one conversation served by v1"
        page.screenshot(path=str(shots / "rollouts.png"), full_page=True)

        page.goto(f"{console.url}/dashboard/rollouts/{console.retry_rollout}")
        assert page.locator(".call").count() == 3
        assert page.locator(".call .tok").count() > 0, "completions shown token by token"
        filtered = page.inner_text("#filtered")
        assert "dead_leaf" in filtered, filtered
        assert page.inner_text("#tree").strip()
        page.screenshot(path=str(shots / "rollout.png"), full_page=True)

        page.goto(console.url + "/dashboard/versions")
        assert page.locator("#policy-versions tr").count() == 1 + 3
        assert "current" in page.inner_text("#policy-versions tr.current")
        page.screenshot(path=str(shots / "versions.png"), full_page=True)

        # Pin, unpin and roll back from the page change what the gateway serves: as /health reports it, and by
        # content (that version's weights answer).
        def health_policy() -> tuple[int | None, int | None]:
            policy = httpx.get(console.url + "/health").json()["policy"]
            return policy["version"], policy["pinned_version"]

        def serves(version: int) -> None:
            assert_serves(console, version, console.references, PROBE, ADMIN)

        serves(2)
        page.click('tr[data-version="0"] button.pin')
        assert page.url == console.url + "/dashboard/versions"
        assert health_policy() == (0, 0) and "Pinned to policy@v0" in page.inner_text("#policy-control")
        serves(0)
        page.screenshot(path=str(shots / "versions-pinned.png"), full_page=True)
        page.click("#unpin")
        assert health_policy() == (2, None)
        serves(2)
        page.click('tr[data-version="1"] button.rollback')
        assert health_policy() == (1, 1) and "rollback" in page.inner_text("#policy-control")
        serves(1)

        # Signing out ends the session.
        page.click("header button")
        page.goto(console.url + "/dashboard")
        assert page.url.startswith(console.url + "/dashboard/login")
    assert not errors, errors
    assert sorted(p.name for p in shots.iterdir()) == [
        "login.png", "overview.png", "rewards.png", "rollout.png", "rollouts.png", "steps.png", "versions-pinned.png",
        "versions.png",
    ]  # fmt: skip


@pytest.fixture
def canary_console(gateway_factory, tiny_model_dir, tmp_path) -> Any:
    """A guarded gateway serving v0 with v1 in a 50% canary that stays undecided (its minimum sample is out of reach),
    and two-turn conversations with feedback until both arms have rewarded turns. Both versions have non-zero
    adapters whose greedy answers differ (``gw.references``)."""
    adapters = tmp_path / "adapters"
    gw = gateway_factory(adapter_dir=adapters, **{**GUARDED, "canary_min_turns": 10_000})
    url = gw.settings.database_url
    paths = {0: publish(url, adapters, tiny_model_dir, 0, scale=0.5, seeded=True)}
    wait_for(lambda: gw.state.service.policy_version == 0, "v0 served")
    assert stage(url, 0) == "promoted", "the first version has nothing to be compared with"
    paths[1] = publish(url, adapters, tiny_model_dir, 1, scale=0.5, seeded=True)
    wait_for(lambda: gw.state.service.routing.candidate is not None, "the canary to start")
    assert gw.state.service.policy_version == 0, "the incumbent still serves everything else"
    gw.references = distinct_references(tiny_model_dir, paths, PROBE, GUARDED["max_tokens"])
    user = User(score={0: 0.8, 1: 0.4})
    for _ in range(30):
        user.converse([gw])
        if len(user.versions) >= 4 and {v[0] for v in user.versions.values()} == {0, 1}:
            break
    assert {v[0] for v in user.versions.values()} == {0, 1}, "both arms served conversations"
    gw.flush()
    return gw


def promotion_of(gw: Any) -> dict[str, Any]:
    """What ``GET /v1/policy`` says of promotion (``gateway.promotion.status``, as the console computes it)."""
    r = httpx.get(gw.v1 + "/policy", headers=PROMOTION_ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json()["promotion"])


def test_the_versions_page_shows_a_running_canary_and_its_reject_button_ends_it(
    canary_console, chromium_path, tmp_path
):
    gw = canary_console
    expected = promotion_of(gw)
    arms = expected["arms"]
    assert expected["stage"] == "canary" and arms["candidate"]["n"] > 0 and arms["incumbent"]["n"] > 0, expected
    got = served_ids(gw, PROBE, GUARDED["max_tokens"], PROMOTION_ADMIN)
    assert got["ids"] == gw.references[got["version"]], "either arm answers with the weights its call records"
    errors: list[str] = []
    with browser_page(chromium_path, errors) as page:
        page.goto(gw.url + "/dashboard/versions")
        page.fill("#key", GUARDED["admin_key"])
        page.click("button[type=submit]")
        assert page.url == gw.url + "/dashboard/versions"

        def stage_of(version: int) -> str:
            return page.inner_text(f'#policy-versions tr[data-version="{version}"] .stage')

        assert (stage_of(0), stage_of(1)) == ("promoted", "canary")
        assert page.inner_text("#promotion-mode") == "guarded" and page.inner_text("#incumbent") == "policy@v0"
        assert page.inner_text("#canary-share") == "50%"
        canary = page.inner_text("#canary")
        assert "policy@v1" in canary and "policy@v0" in canary, canary
        for arm in ("candidate", "incumbent"):
            row = f'#canary-arms tr[data-arm="{arm}"]'
            assert int(page.inner_text(row + " .arm-n").replace(",", "")) == arms[arm]["n"], arm
            assert float(page.inner_text(row + " .arm-mean")) == pytest.approx(arms[arm]["mean"], rel=1e-2, abs=1e-3)
        verdict = page.inner_text("#verdict")
        assert "wait" in verdict and expected["verdict"]["reason"] in verdict, verdict
        history = page.locator("#promotion-decisions tr")
        assert [history.nth(i).get_attribute("data-outcome") for i in range(1, history.count())] == [
            "canary",
            "promoted",
        ], "newest first: v1's canary, then v0 promoted as the first version"
        started = history.nth(1).inner_text()
        assert "canary started" in started and "policy@v1" in started and "50%" in started, started
        shot = tmp_path / "versions-canary.png"
        page.screenshot(path=str(shot), full_page=True)

        page.click("#reject")
        assert page.url == gw.url + "/dashboard/versions"
        assert stage_of(1) == "rejected" and "No version awaits a decision" in page.inner_text("#promotion")
        newest = history.nth(1)
        assert newest.get_attribute("data-outcome") == "rejected" and "operator" in newest.inner_text()
        page.screenshot(path=str(tmp_path / "versions-rejected.png"), full_page=True)
    assert gw.state.service.routing.candidate is None and gw.state.service.policy_version == 0
    assert_serves(gw, 0, gw.references, PROBE, PROMOTION_ADMIN)  # the incumbent's weights, for every conversation
    assert not errors, errors
    assert shot.stat().st_size > 0


def test_the_versions_page_carries_the_canary_figures_and_promotes_from_its_form(canary_console):
    gw = canary_console
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        login = client.post("/dashboard/login", data={"key": GUARDED["admin_key"], "next": "/dashboard/versions"})
        assert login.status_code == 303 and auth.COOKIE in client.cookies
        html = client.get("/dashboard/versions").text
        arms = promotion_of(gw)["arms"]
        assert '<b id="canary-share">50%</b>' in html
        for arm in ("candidate", "incumbent"):
            assert f'<td class="num arm-n">{arms[arm]["n"]:,}</td>' in html, arm
        assert '<span class="stage stage-canary">canary</span>' in html and "canary started" in html

        promoted = client.post("/dashboard/policy/promote", data={"version": "1"})
        assert promoted.status_code == 303 and promoted.headers["location"] == "/dashboard/versions"
        assert gw.state.service.policy_version == 1, "the promoted candidate is the incumbent at once"
        assert_serves(gw, 1, gw.references, PROBE, PROMOTION_ADMIN)
        [newest, *_] = promotion_of(gw)["decisions"]
        assert (newest["version"], newest["outcome"], newest["decided_by"]) == (1, "promoted", "operator")

        again = client.post("/dashboard/policy/promote", data={"version": "1"}, follow_redirects=True)
        assert again.status_code == 200 and 'role="alert"' in again.text
        assert "policy@v1 is not being evaluated, a candidate or in a canary" in again.text


def test_a_decision_on_evidence_shows_both_arms_and_every_text_is_escaped():
    rule = Rule(margin=0.1, min_n=10)
    verdict = decide(
        (ArmStats.of([0.5] * 12), ArmStats.of([0.4, 0.6] * 7)),
        (ArmStats.of([0.0] * 12), ArmStats.of([0.0] * 14)),
        rule,
        60.0,
    )
    assert verdict.outcome == "promote"
    at = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    decisions = [
        {"version": 2, "incumbent_version": 1, "outcome": "promoted", "reason": verdict.reason,
         "evidence": verdict.evidence, "decided_by": "<gw-a>", "created_at": at.isoformat()},
        {"version": 1, "incumbent_version": None, "outcome": "promoted", "reason": "first version", "evidence": None,
         "decided_by": "trainer", "created_at": at.isoformat()},
    ]  # fmt: skip
    promo = {"mode": "guarded", "incumbent": 2, "pinned_version": None, "candidate": None, "stage": None}
    html = (
        routes.templates()
        .get_template("versions.html")
        .render(
            served_model="<tiny>",
            policy={"adapter": "policy@v2", "version": 2},
            title="Versions",
            versions=[],
            control=Control(),
            promo=promo,
            canary_since=None,
            decisions=[routes._decision_view(d) for d in decisions],
            error="<b>bad</b>",
        )
    )
    assert '<td class="num">12 / 14</td>' in html and '<td class="num">0.5 / 0.5</td>' in html
    assert html.count('<td class="num muted">—</td>') == 2, "the first version's decision has no evidence"
    assert "5 min ago" in html and "No version awaits a decision" in html
    assert "&lt;gw-a&gt;" in html and "&lt;tiny&gt;" in html and "&lt;b&gt;bad&lt;/b&gt;" in html
    assert "<gw-a>" not in html and "<b>bad</b>" not in html

    # A version before its evaluation gate: named, with its stage, and decidable by hand.
    gated = {**promo, "candidate": 3, "stage": "evaluating"}
    html = routes.templates().get_template("versions.html").render(
        served_model="tiny", policy={"adapter": "policy@v2", "version": 2}, title="Versions", versions=[],
        control=Control(), promo=gated, canary_since=None, decisions=[], error=None,
    )  # fmt: skip
    assert '<span class="stage stage-evaluating">evaluating</span> <b>policy@v3</b> serves no traffic' in html
    assert 'name="version" value="3"' in html


def test_a_turns_counterfactual_siblings_show_their_text_finish_and_score_beside_the_served_answer(
    gateway_factory, chromium_path, tmp_path
):
    gw = gateway_factory(admin_key=ADMIN_KEY, policy_follow=False, counterfactuals=3, max_tokens=12)
    served = chat(gw.v1, "Name a colour.", temperature=1.0)
    call_id, rollout_id = served.headers["x-clawgate-call-id"], served.headers["x-clawgate-rollout-id"]
    settle(gw)
    store = connect(gw.settings.database_url)
    try:
        group = counterfactuals.group_of(store, call_id)
        assert group is not None and len(group.siblings) == 3
        first, second, _ = group.siblings  # the third stays unscored
        scores = {first.id: SiblingScore(0.25, {"reason": "<b>too short</b>"}), second.id: SiblingScore(0.75)}
        assert counterfactuals.record_scores(store, call_id, 0.5, scores)
    finally:
        store.dispose()
    decode = tokenizer_decode(gw.state.tokenizer)
    errors: list[str] = []
    with browser_page(chromium_path, errors) as page:
        page.goto(gw.url + "/dashboard/login")
        page.fill("#key", ADMIN_KEY)
        page.click("button[type=submit]")
        page.goto(f"{gw.url}/dashboard/rollouts/{rollout_id}")
        call = page.locator(f'[id="call-{call_id}"]')
        served_tokens = served.json()["usage"]["completion_tokens"]
        assert call.locator(":scope > .tokens .tok").count() == served_tokens, "the served answer stands apart"
        box = call.locator(".counterfactuals")
        assert box.count() == 1, "the turn's counterfactual group is shown"
        assert "never served to the client" in box.locator(":scope > .muted").inner_text()
        assert box.locator("tr.served td.score").inner_text() == "0.5"
        assert box.locator("div.sibling").count() == 3
        for sibling, score in zip(group.siblings, ("0.25", "0.75", "not scored"), strict=True):
            row = box.locator(f'tr.sibling-score[data-sibling="{sibling.id}"]')
            assert row.locator("td.score").inner_text() == score
            assert row.locator("td.finish").inner_text() == (sibling.finish_reason or "—")
            shown = box.locator(f'div.sibling[data-sibling="{sibling.id}"]')
            ids = sibling.completion_ids.tolist()
            assert shown.locator(".tok").count() == len(ids), "each sibling token with its logprob"
            assert shown.locator(".tokens").text_content() == "".join(decode([t]) for t in ids)
            header = shown.locator(".muted").inner_text()
            assert "never served" in header and f"score {score} (served answer 0.5)" in header, header
        assert "<b>too short</b>" in box.inner_text(), "a judge's reason shown as text"
        page.screenshot(path=str(tmp_path / "rollout-group.png"), full_page=True)
    assert not errors, errors


def test_a_sibling_repeating_a_credential_of_its_prompt_shows_a_placeholder(tiny_tokenizer):
    decode = tokenizer_decode(tiny_tokenizer)
    planted = next(p for p in corpus() if p.name == "env password")  # alone, only recognisable as a repeat
    prompt = decode(tiny_tokenizer.encode(f"read .env:\n{planted.line}\nthanks", add_special_tokens=False))
    answer = tiny_tokenizer.encode(f"It is {planted.value}, keep it safe.", add_special_tokens=False)
    sibling = {"completion_token_ids": answer, "secrets": None}  # drawn with no scan (``secrets=off``)
    assert planted.value in "".join(rollout_page.sibling_pieces(sibling, [], decode)), "a scan alone misses it"
    shown = "".join(rollout_page.sibling_pieces(sibling, rollout_page.prompt_secrets(prompt), decode))
    assert planted.value not in shown and shown.startswith("It is") and "keep it safe." in shown
    assert "[secret redacted: Repeated Secret Assignment]" in shown
    # What the scan found when the sibling was drawn is hidden as a call's recorded spans are.
    start, end = token_span(answer, decode, 6, 6 + len(planted.value))
    sibling["secrets"] = [{"kind": "Secret Keyword", "start": start, "end": end}]
    shown = "".join(rollout_page.sibling_pieces(sibling, [], decode))
    assert planted.value not in shown and "[secret redacted: Secret Keyword]" in shown


def test_a_forged_or_expired_session_is_refused():
    token = auth.issue("k", now=1000.0)
    assert auth.valid("k", token, now=1001.0)
    assert not auth.valid("k", token, now=1000.0 + auth.LIFETIME_S + 1), "expired"
    assert not auth.valid("other", token, now=1001.0), "signed under another admin key"
    expires, nonce, sig = token.split(".")
    assert not auth.valid("k", f"{int(expires) + 9999}.{nonce}.{sig}", now=1001.0), "a lengthened expiry"
    assert not auth.valid("k", None) and not auth.valid("k", "garbage")


def test_pages_need_the_session_and_keep_redirects_inside_the_console(gateway_factory):
    gw = gateway_factory(admin_key=ADMIN_KEY)
    for path in ("/dashboard", "/dashboard/rewards", "/dashboard/steps", "/dashboard/rollouts", "/dashboard/versions"):
        r = httpx.get(gw.url + path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/login"), path
    r = httpx.get(gw.url + "/dashboard", headers=ADMIN, follow_redirects=False)
    assert r.status_code == 303, "the API's bearer key is not a console session"
    r = httpx.post(gw.url + "/dashboard/login", data={"key": ADMIN_KEY, "next": "https://evil.example/"})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard", "no open redirect"
    session = r.cookies[auth.COOKIE]
    r = httpx.get(gw.url + "/dashboard/rollouts/no-such", cookies={auth.COOKIE: session})
    assert r.status_code == 404 and "no-such" in r.text


def test_charts_draw_one_point_per_value_and_gaps_for_missing_ones():
    svg = charts.line_chart("t", [charts.Series("a", [(0, 1.0), (1, None), (2, 3.0), (3, float("nan"))])])
    assert svg.count('class="point"') == 2 and svg.count("<polyline") == 0, "no line across a gap"
    svg = charts.line_chart("t", [charts.Series("a", [(0, 1.0), (1, 2.0)]), charts.Series("<b>", [(0, 5.0)])])
    assert svg.count('class="point"') == 3 and "<b>" not in svg and "&lt;b&gt;" in svg
    assert "no data yet" in charts.line_chart("t", [charts.Series("a", [(0, None)])])
    assert charts.logprob_colour(0.0) == "hsl(120, 85%, 85%)" and charts.logprob_colour(-20.0) == "hsl(0, 85%, 85%)"
