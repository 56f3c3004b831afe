"""Everything a running gateway holds, assembled once in the app's lifespan and kept on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sqlalchemy as sa

from gateway.engines.base import Engine
from gateway.errors import NotFound
from gateway.metrics import Metrics
from gateway.policy import PolicyFollower
from gateway.render import Renderer
from gateway.response_store import ResponseStore
from gateway.service import ChatService
from gateway.sessions import SessionIndex
from gateway.settings import Settings
from gateway.store.writer import CallWriter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
    # rollout id -> sha256 of its per-rollout key (None: the rollout has no key), filled on first use
    rollout_keys: dict[str, str | None] = field(default_factory=dict)
    policy: PolicyFollower | None = None  # follows the trainer's published versions (CLAWGATE_POLICY_FOLLOW)

    def check_model(self, name: str) -> None:
        if self.accept_any_model or name in self.model_names:
            return
        raise NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")
