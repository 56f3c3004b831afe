"""A gateway-only install (``pip install clawgate``, no extras: no torch, no peft) serves every API: the request
path (routes, rendering, tokenizing, parsing, capture) must not need torch. Checked in a fresh interpreter that
sees this environment's packages except torch, peft and their kin, as if they were not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    import gateway.engines.vllm  # the engine a gateway-only install serves with
    from gateway.app import build_app
    from gateway.settings import Settings
    from gateway.store import db
    from tests.fakes import ScriptedEngine

    model, url, data = sys.argv[1:4]
    db.upgrade(url)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = ScriptedEngine(tokenizer)
    settings = Settings(model=model, served_model_name="tiny", database_url=url, data_dir=data, policy_follow=False)
    app = build_app(settings, engine=engine, tokenizer=tokenizer)
    answers = []
    with TestClient(app) as client:
        tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
        for stream in (False, True):
            engine.push('<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "stream": stream}
            r = client.post("/v1/chat/completions", json=body)
            answers.append((r.status_code, "ls" in r.text))
            engine.push("hello")
            r = client.post("/v1/messages", json={**body, "tools": None, "max_tokens": 16})
            answers.append((r.status_code, ("message_stop" if stream else "hello") in r.text))
            engine.push("hello")
            r = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "stream": stream})
            answers.append((r.status_code, ("response.completed" if stream else "hello") in r.text))
        answers.append((client.get("/metrics").status_code, True))
    loaded = sorted(m for m in ("torch", "peft") if m in sys.modules)
    assert __import__("importlib").util.find_spec("torch") is None
    print(json.dumps({"answers": answers, "loaded": loaded}))
    """
)


# Distributions a gateway-only install does not have (the `train` extra and what they pull in).
NOT_INSTALLED = ("torch", "peft", "triton", "nvidia", "accelerate", "functorch", "torchgen")


def site_without_training(into: Path) -> Path:
    """A directory of links to this environment's packages, less the training stack's."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    into.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower().replace("-", "_")
        if not name.startswith(NOT_INSTALLED) and not name.endswith(".pth"):
            (into / entry.name).symlink_to(entry)
    return into


def test_the_request_path_imports_no_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    url = f"sqlite:///{tmp_path / 'gw.db'}"
    site = site_without_training(tmp_path / "site")
    # -S: no site-packages of its own; the filtered copy and the project are all it sees.
    env = {"PYTHONPATH": f"{root}{os.pathsep}{site}", "PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", SCRIPT, str(tiny_model_dir), url, str(tmp_path / "data")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], "the serving path imported torch or peft"
    assert result["answers"] == [[200, True]] * 7, result
