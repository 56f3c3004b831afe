"""The OpenAPI schema and the documentation pages: open in development, admin-only in production; the schema
documents the serving routes' request and response models and the admin routes."""

from __future__ import annotations

import json
import re

import httpx

from tests.fakes import ScriptedEngine


def test_docs_are_open_in_development(gateway_factory, tiny_tokenizer):
    gw = gateway_factory(engine=ScriptedEngine(tiny_tokenizer), tokenizer=tiny_tokenizer)
    schema = httpx.get(gw.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/rollouts", "/v1/policy/pin"} <= set(
        schema["paths"]
    )
    assert not any(p.startswith("/dashboard") for p in schema["paths"]), "the console's pages are not API"
    components = schema["components"]["schemas"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs <= set(components), f"dangling references: {refs - set(components)}"
    for path, fields in {
        "/v1/chat/completions": {"messages", "tools", "stream"},
        "/v1/completions": {"prompt", "echo"},
        "/v1/messages": {"messages", "system", "thinking"},
        "/v1/responses": {"input", "instructions", "previous_response_id"},
        "/rollouts/{rollout_id}/v1/chat/completions": {"messages"},
    }.items():
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        model = components[ref.rsplit("/", 1)[1]]
        assert fields <= set(model["properties"]), (path, sorted(model["properties"]))
        assert "200" in schema["paths"][path]["post"]["responses"]
    for page in ("/docs", "/redoc"):
        r = httpx.get(gw.url + page)
        assert r.status_code == 200 and "/openapi.json" in r.text, page


def test_docs_need_the_admin_key_in_production(gateway_factory, tiny_tokenizer):
    gw = gateway_factory(
        engine=ScriptedEngine(tiny_tokenizer),
        tokenizer=tiny_tokenizer,
        environment="production",
        api_keys=["client-key"],
        admin_key="admin-key-for-docs",
    )
    for page in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(gw.url + page).status_code == 401, page
        assert httpx.get(gw.url + page, headers={"Authorization": "Bearer client-key"}).status_code == 401, page
        r = httpx.get(gw.url + page, headers={"Authorization": "Bearer admin-key-for-docs"})
        assert r.status_code == 200, page
