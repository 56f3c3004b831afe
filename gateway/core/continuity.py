"""Finding a conversation's earlier turns in the database, for whichever gateway process serves the next one.

Several gateway processes may share one database (uvicorn workers, hosts behind a load balancer), and the turn
before a request may have been answered by another of them, or before a restart. The in-memory ``SessionIndex``
is each process's cache; what it does not know is looked up here (in a worker thread, on a miss only):

- the call that ended the conversation so far (its raw tokens start the new prompt; ``calls.tail_hash``);
- whether an assistant turn that cannot be spliced was generated here (drift; ``calls.output_hash``);
- whether the parent's implicit rollout is still open: a rollout another process closed for idleness may
  already be trained, so nothing more is added to it. A parent that ended less than half the idle timeout ago
  cannot have been closed for idleness and needs no look; an older one is claimed (touched) in the database,
  which excludes a concurrent close. Closes by other processes (idle or explicit) also reach every process
  through the idle-close loop's shared read (``rollout_lifecycle.closed_since``).

Everything seen is committed: with durable capture (the default) a call is committed before its client sees the
end of the answer, so a follow-up sent anywhere finds it. Without it, a follow-up that reaches another process
within the capture flush interval finds nothing and starts a fresh prompt and a new rollout — the price of not
waiting for the commit.
"""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa

from gateway.bounded import ExpiringSet
from gateway.core.conversation import exact_hash
from gateway.core.render import Renderer
from gateway.core.sessions import CallEntry, SessionIndex
from gateway.store import repo, rollout_lifecycle

log = logging.getLogger("clawgate.continuity")


class Continuity:
    def __init__(
        self,
        db: sa.Engine | None,
        renderer: Renderer,
        index: SessionIndex,
        closed_rollouts: ExpiringSet[str],
        idle_seconds: float,
    ) -> None:
        self.db = db
        self.renderer = renderer
        self.index = index
        self.closed_rollouts = closed_rollouts
        self.idle_seconds = idle_seconds

    def stored_parent(self, scope: str | None, tail: bytes) -> CallEntry | None:
        """The call that ended the conversation ``tail``, from the database."""
        if self.db is None:
            return None
        call = repo.continued_call(self.db, tail.hex(), scope)
        if call is None:
            return None
        if scope is None and not call.rollout_open:
            self.closed_rollouts.add(call.rollout_id)
        entry = CallEntry(
            call_id=call.call_id,
            rollout_id=call.rollout_id,
            token_ids=call.token_ids,
            ends_with_end_of_turn=self.renderer.ends_with_end_of_turn(call.completion_ids),
            exact_hashes=[exact_hash(m) for m in call.messages],
            explicit=scope is not None,
            ended_at=0.0,  # its rollout's state was read now, but may change before this call is recorded
            policy_version=call.policy_version,
        )
        log.info("continuing call %s found in the database", call.call_id)
        self.index.add(scope, tail, b"", entry)
        return entry

    def known_outputs(self, scope: str | None, hashes: list[bytes]) -> bool:
        """Whether a call of this scope (an explicit rollout, or any implicit one) generated one of these answers."""
        if self.db is None:
            return False
        return repo.answered_here(self.db, [h.hex() for h in hashes], scope)

    def can_join(self, parent: CallEntry) -> bool:
        """Whether a call continuing ``parent`` (no explicit rollout) may join the parent's implicit rollout.

        A closed rollout is remembered for one idle timeout after its close was learned (``closed_rollouts``), which
        is enough: its calls ended before the close (give or take a call in flight), so once it is forgotten every
        parent of it is older than half the idle timeout, and its state is claimed in the database instead.
        """
        if parent.rollout_id in self.closed_rollouts:
            return False
        if self.db is None or time.time() - parent.ended_at < self.idle_seconds / 2:
            return True
        try:
            open_ = rollout_lifecycle.claim_open(self.db, parent.rollout_id)
        except Exception as exc:  # the database is down: the writer reports it; the call is served all the same
            log.debug("cannot check rollout %s: %s", parent.rollout_id, exc)
            return True
        if not open_:
            self.closed_rollouts.add(parent.rollout_id)
        return open_
