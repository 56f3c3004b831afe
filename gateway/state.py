"""Everything a running gateway holds, assembled once in the app's lifespan and kept on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import sqlalchemy as sa
from fastapi import Depends, Request

from gateway.bounded import LRUDict
from gateway.core.render import Renderer
from gateway.core.response_store import ResponseStore
from gateway.core.service import ChatService
from gateway.core.sessions import SessionIndex
from gateway.engines.base import Engine
from gateway.errors import NotFound
from gateway.metrics import Metrics
from gateway.policy import PolicyFollower
from gateway.settings import Settings
from gateway.store.rollout_lifecycle import Access
from gateway.store.writer import CallWriter
from gateway.tenants.cache import KeyCache
from gateway.tenants.quotas import QuotaBook

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Rollouts whose key and pinned version are held in memory (a few hundred bytes each).
ROLLOUT_KEYS_CACHED = 16384


@dataclass(slots=True)
class AppState:
    settings: Settings
    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    renderer: Renderer
    index: SessionIndex
    writer: CallWriter
    metrics: Metrics
    service: ChatService
    model_names: frozenset[str]
    accept_any_model: bool
    started_at: float
    db: sa.Engine
    responses: ResponseStore  # conversations of stored responses, for previous_response_id
    # rollout id -> its key's sha256 and pinned version (rollout_lifecycle.Access), filled on first use; a cache of
    # the most recently used rollouts (a forgotten one is read from the database again)
    rollout_keys: LRUDict[str, Access] = field(default_factory=lambda: LRUDict(ROLLOUT_KEYS_CACHED))
    keys: KeyCache | None = None  # tenant keys checked lately (``gateway/tenants/cache.py``)
    quotas: QuotaBook | None = None  # requests and tokens per minute per tenant and key (``gateway/tenants/quotas.py``)
    policy: PolicyFollower | None = None  # follows the trainer's published versions (CLAWGATE_POLICY_FOLLOW)

    def check_model(self, name: str) -> None:
        if self.accept_any_model or name in self.model_names:
            return
        raise NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")


async def get_state(request: Request) -> AppState:
    """The running gateway's state, for routes and the console (``async``: a plain ``def`` dependency would cost a
    thread hop per request)."""
    state: AppState = request.app.state.clawgate
    return state


State = Annotated[AppState, Depends(get_state)]
