"""A scripted engine for protocol edge cases a random tiny model cannot produce on demand (tool calls with
reasoning, engine failures mid-stream). Real-engine tests exist beside every use of it."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from gateway.engines.base import GenerationEnd, GenerationEvent, GenerationRequest, TokenDelta, answer_once
from gateway.errors import EngineError


class ScriptedEngine:
    name = "scripted"

    def __init__(self, tokenizer, max_model_len: int = 40960) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scripts: deque[tuple[list[int], int | None]] = deque()
        self.requests: list[GenerationRequest] = []
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.loaded: dict[str, str] = {}  # adapter name -> path
        self.unloaded: list[str] = []

    def push(self, text: str, *, end: bool = True, fail_after: int | None = None) -> list[int]:
        """Queue the next completion: ``text`` tokenized (+ the end-of-turn token)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.end_id] if end else [])
        self.scripts.append((ids, fail_after))
        return ids

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        ids, fail_after = self.scripts.popleft() if self.scripts else ([self.end_id], None)
        ids = ids[: request.params.max_tokens]
        for cut, tid in enumerate(ids):  # as real engines do: a stop token ends the completion (and is in it)
            if tid in request.params.stop_token_ids:
                ids = ids[: cut + 1]
                break
        for i, tid in enumerate(ids):
            if fail_after is not None and i == fail_after:
                raise EngineError("scripted failure")
            await asyncio.sleep(0)
            yield TokenDelta([tid], [-0.25 - 0.01 * i])
        stopped = bool(ids) and (ids[-1] == self.end_id or ids[-1] in request.params.stop_token_ids)
        yield GenerationEnd("stop" if stopped else "length", ids[-1] if stopped else None, len(request.prompt_ids))

    async def load_adapter(self, name: str, path: str) -> None:
        self.loaded[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.unloaded.append(name)

    async def adapters(self) -> list[str]:
        return sorted(self.loaded)

    async def verify_adapter(self, name: str, prompt_ids: list[int]) -> None:
        await answer_once(self, name, prompt_ids)

    async def health(self) -> bool:
        return True


class SlowEngine(ScriptedEngine):
    """Scripted tokens at 20 per second: long enough for a client to hang up mid-stream."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        async for ev in super().generate(request):
            await asyncio.sleep(0.05)
            yield ev
