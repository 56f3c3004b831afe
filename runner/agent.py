"""The built-in agent: a minimal tool-using loop over OpenAI chat completions, run as its own process.

    python -m runner.agent --base-url URL --model NAME --instruction-file F [--max-turns N] [--api-key-env VAR]

A white-box baseline next to the black-box harnesses: every step is visible here, it needs no install, and it
exercises the same path through the gateway (tools offered, tool calls parsed, tool results sent back and the
model's earlier answers echoed so the gateway can splice their raw tokens). The loop: send the conversation;
run every tool call the answer makes and append the results; stop when an answer makes no tool call.

Tools, all confined to the workspace (the current directory): ``read_file``, ``write_file``, ``list_files``
resolve paths (symlinks included) and refuse any that leave it; ``run`` executes a shell command there with a
time limit. A shell command can still touch anything the process can — confining it is the sandbox's job.

Exit codes are the completion protocol the runner reads: 0 the model ended its turn; 3 it gave up (turn limit,
or the gateway refused a request, e.g. context too long); 75 the gateway could not be reached (an
infrastructure failure the runner may retry).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

EXIT_DONE = 0
EXIT_GAVE_UP = 3
EXIT_INFRA = 75
OUTPUT_LIMIT = 8000  # characters of a tool result shown to the model
LIST_LIMIT = 500
RETRIES = 4
RETRY_STATUS = (429, 502, 503, 504)

SYSTEM_PROMPT = (
    "You are a careful software agent working in a directory called the workspace. Use the tools to look at "
    "and change files and to run shell commands; paths are relative to the workspace. When the task is done, "
    "answer with a one-line summary and no tool call."
)


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


_STR = {"type": "string"}
TOOLS = [
    _function("read_file", "Read a text file of the workspace.", {"path": _STR}, ["path"]),
    _function(
        "write_file",
        "Create or overwrite a text file of the workspace (parent directories are created).",
        {"path": _STR, "content": _STR},
        ["path", "content"],
    ),
    _function("list_files", "List files under a directory of the workspace (default: all).", {"path": _STR}, []),
    _function(
        "run",
        "Run a shell command in the workspace; returns its exit code and output.",
        {"command": _STR, "timeout": {"type": "number", "description": "seconds (default 60)"}},
        ["command"],
    ),
]


class ToolError(Exception):
    """A tool call that cannot be carried out; its message goes back to the model as the tool result."""


def _clip(text: str, limit: int = OUTPUT_LIMIT) -> str:
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n… [{len(text) - limit} characters cut] …\n" + text[-limit // 2 :]


class Workspace:
    """The agent's tools over one directory."""

    def __init__(self, root: Path, *, run_timeout: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.root = root.resolve()
        self.run_timeout = run_timeout
        self.env = env

    def resolve(self, path: str) -> Path:
        if not isinstance(path, str) or not path:
            raise ToolError("path must be a non-empty string")
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise ToolError(f"{path!r} is outside the workspace")
        return target

    def read_file(self, path: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file")
        try:
            return _clip(target.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise ToolError(f"cannot read {path!r}: {exc.strerror}") from exc

    def write_file(self, path: str, content: str) -> str:
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        target = self.resolve(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        except OSError as exc:
            raise ToolError(f"cannot write {path!r}: {exc.strerror}") from exc
        return f"wrote {len(content.encode())} bytes to {path}"

    def list_files(self, path: str = ".") -> str:
        top = self.resolve(path or ".")
        if not top.is_dir():
            raise ToolError(f"{path!r} is not a directory")
        names: list[str] = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            base = Path(dirpath)
            for name in sorted(filenames):
                names.append(str((base / name).relative_to(self.root)))
            if len(names) > LIST_LIMIT:
                break
        if not names:
            return "(no files)"
        more = f"\n… and more ({len(names) - LIST_LIMIT}+ not shown)" if len(names) > LIST_LIMIT else ""
        return "\n".join(names[:LIST_LIMIT]) + more

    def run(self, command: str, timeout: float | None = None) -> str:
        if not isinstance(command, str) or not command.strip():
            raise ToolError("command must be a non-empty string")
        limit = self.run_timeout if timeout is None else max(1.0, min(float(timeout), self.run_timeout))
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=self.root,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=limit)
            status = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            status = f"killed after {limit:g} s"
        parts = [status]
        if out:
            parts.append("stdout:\n" + out.decode(errors="replace"))
        if err:
            parts.append("stderr:\n" + err.decode(errors="replace"))
        return _clip("\n".join(parts))

    def call(self, name: str, arguments: str) -> str:
        """Carry out one tool call; every failure becomes an ``error: …`` result the model can read."""
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"error: arguments are not valid JSON: {exc.msg}"
        if not isinstance(args, dict):
            return "error: arguments must be a JSON object"
        handlers: dict[str, Callable[..., str]] = {
            "read_file": self.read_file,
            "write_file": self.write_file,
            "list_files": self.list_files,
            "run": self.run,
        }
        try:
            if name in handlers:
                return handlers[name](**args)
        except ToolError as exc:
            return f"error: {exc}"
        except TypeError as exc:
            return f"error: bad arguments for {name}: {exc}"
        return f"error: unknown tool {name!r} (tools: read_file, write_file, list_files, run)"


class GatewayUnavailable(Exception):
    pass


class RequestRefused(Exception):
    pass


def chat(client: httpx.Client, body: dict[str, Any], *, backoff: float = 0.5) -> dict[str, Any]:
    """One chat completion; transient failures are retried, then reported as ``GatewayUnavailable``."""
    last = ""
    for attempt in range(RETRIES):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            resp = client.post("/chat/completions", json=body)
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        if resp.status_code in RETRY_STATUS:
            last = f"HTTP {resp.status_code}: {resp.text[:300]}"
            continue
        if resp.status_code != 200:
            raise RequestRefused(f"HTTP {resp.status_code}: {resp.text[:500]}")
        data: dict[str, Any] = resp.json()
        return data
    raise GatewayUnavailable(last)


@dataclass(frozen=True, slots=True)
class AgentResult:
    exit_code: int
    turns: int
    reason: str
    final: str = ""


def _echo(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as it goes back into the conversation: what the gateway produced, unchanged."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def run_agent(client: httpx.Client, model: str, instruction: str, workspace: Workspace, max_turns: int) -> AgentResult:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": instruction},
    ]
    for turn in range(1, max_turns + 1):
        try:
            data = chat(client, {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "auto"})
        except GatewayUnavailable as exc:
            return AgentResult(EXIT_INFRA, turn - 1, f"gateway unreachable: {exc}")
        except RequestRefused as exc:
            return AgentResult(EXIT_GAVE_UP, turn - 1, f"the gateway refused the request: {exc}")
        message = data["choices"][0]["message"]
        messages.append(_echo(message))
        calls = message.get("tool_calls") or []
        print(f"turn {turn}: {len(calls)} tool call(s) {[c['function']['name'] for c in calls]}", file=sys.stderr)
        if not calls:
            return AgentResult(EXIT_DONE, turn, "the model ended its turn", message.get("content") or "")
        for call in calls:
            fn = call.get("function", {})
            result = workspace.call(fn.get("name", ""), fn.get("arguments", ""))
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
    return AgentResult(EXIT_GAVE_UP, max_turns, f"turn limit reached ({max_turns} turns)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.agent", description="the built-in minimal agent")
    p.add_argument("--base-url", required=True, help="OpenAI-style base URL ending in /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--instruction-file", required=True)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    p.add_argument("--run-timeout", type=float, default=60.0, help="seconds per `run` tool call")
    args = p.parse_args(argv)
    key = os.environ.get(args.api_key_env, "")
    instruction = Path(args.instruction_file).read_text(encoding="utf-8")
    # Commands the model runs see neither the key nor this package's import path.
    env = {k: v for k, v in os.environ.items() if k not in (args.api_key_env, "PYTHONPATH")}
    workspace = Workspace(Path.cwd(), run_timeout=args.run_timeout, env=env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    with httpx.Client(base_url=args.base_url.rstrip("/"), headers=headers, timeout=timeout) as client:
        result = run_agent(client, args.model, instruction, workspace, args.max_turns)
    if result.final:
        print(result.final)
    print(f"agent: {result.reason} after {result.turns} turn(s)", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
