"""Which policy version serves a call: the canary assignment.

Pure and cheap (it runs on every call, on the event loop): a hash of the conversation's id, salted with the
candidate's version so that each canary samples other conversations, decides whether a *new* conversation goes to
the candidate. The same id gives the same answer on every gateway process and every host, so all turns of one
conversation land on one arm however the load balancer spreads them. A conversation that continues an earlier call
keeps the version that call was served by while that version is still served here (a conversation that began before
the canary stays on the incumbent; one that began on the candidate stays on it), unless that version was rejected.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

_SCALE = float(1 << 64)


@dataclass(frozen=True, slots=True)
class Arm:
    adapter: str | None  # None: the base model
    version: int | None


def in_canary(conversation_id: str, candidate_version: int, share: float) -> bool:
    """Whether a new conversation goes to the candidate (deterministic; a share of 0 never, of 1 always)."""
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    digest = hashlib.blake2b(f"{candidate_version}:{conversation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE < share


@dataclass(frozen=True, slots=True)
class Routing:
    """What this gateway serves: the incumbent, and during a canary the candidate and its share.

    ``sticky`` (guarded promotion): a continuing conversation keeps its version if it is among ``kept`` (the
    versions still loaded here and not rejected). Without it every call goes to the incumbent (immediate
    promotion: a new version reaches all traffic at once, as it always did)."""

    incumbent: Arm = Arm(None, None)
    candidate: Arm | None = None
    share: float = 0.0
    sticky: bool = False
    kept: dict[int, Arm] = field(default_factory=dict)

    def arms(self) -> list[Arm]:
        """Every arm a call may be routed to (their adapters must stay loaded)."""
        out = [self.incumbent, *self.kept.values()]
        if self.candidate is not None:
            out.append(self.candidate)
        return out

    def arm_of(self, version: int) -> Arm | None:
        """The arm of ``version`` if this gateway serves it (a rollout pinned to a version), else None."""
        if self.incumbent.version == version:
            return self.incumbent
        if self.candidate is not None and self.candidate.version == version:
            return self.candidate
        return self.kept.get(version)

    def arm_for(self, conversation_id: str, parent_version: int | None, continues: bool) -> Arm:
        """The arm of a call of ``conversation_id``; ``continues``: it continues an earlier call, served by
        ``parent_version``."""
        candidate = self.candidate
        if continues and self.sticky:
            if candidate is not None and parent_version == candidate.version:
                return candidate
            if parent_version is not None:
                kept = self.kept.get(parent_version)
                if kept is not None:
                    return kept
            return self.incumbent  # began before the canary, or on a version no longer served
        if (
            candidate is not None
            and candidate.version is not None
            and in_canary(conversation_id, candidate.version, self.share)
        ):
            return candidate
        return self.incumbent


__all__ = ["Arm", "Routing", "in_canary"]


class Routed(Protocol):
    """What the policy follower (``gateway/policy.py``) reads and changes on the request core
    (``gateway.core.service.ChatService``): the routing of new calls, and the calls running per adapter."""

    @property
    def routing(self) -> Routing: ...

    @property
    def adapter_in_flight(self) -> Counter[str]: ...

    @property
    def lineage_routing(self) -> dict[str, Routing]:
        """Tenants with a policy of their own: their routing."""
        ...

    @property
    def adapter(self) -> str | None: ...

    @property
    def policy_version(self) -> int | None: ...

    def use_routing(self, routing: Routing) -> None: ...

    def use_lineage_routing(self, tenant: str, routing: Routing | None) -> None: ...
