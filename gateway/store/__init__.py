"""The store: what the gateway records (rollouts, calls, rewards, policy versions) and how it gets there.

- ``models``: the SQLAlchemy tables (created only by the Alembic migrations in ``migrations/``).
- ``codec``: token ids, logprobs and request bodies in their compact stored forms.
- ``db``: engines for SQLite and Postgres, and the migration commands.
- ``records``: the capture records the gateway hands the writer, and their JSON form.
- ``rows``: records → table rows, and the batch statements.
- ``spool``: the dead-letter and pending files.
- ``errors``: ``CaptureFull``, ``RecordNotFound`` and ``InvalidInput`` (the store's own errors: the app maps them to
  HTTP answers), and which database errors are transient.
- ``writer``: ``CallWriter``, the non-blocking, batching, never-losing capture writer; ``batch_commit``: its
  database side (one batch committed on the writer's thread, retried row by row, dead-lettered).
- ``repo``: reads, including a call's full prompt and request rebuilt from parent deltas.
- ``rollout_lifecycle``: the rollout lifecycle (create, reward, finish, list, inspect) and rollout keys.
- ``turns``, ``readiness``: what the trainer may take now (ready turns and rollouts, stale data, the backlog).
- ``training_data``: a rollout's calls as the prefix tree's input, its tree and reward; ready turns.
- ``policy_versions``: the one owner of the ``policy_versions`` rows (published, current, retired, their stage).
- ``train_steps``: a train step and the version it publishes, in one transaction; a failed step.
- ``policy_control``, ``promotion``, ``adapter_leases``: the operator's pin and rollback, guarded promotion's stages
  and decisions, which gateway still serves which adapter.
- ``judgements``: the reward worker's claims and verdicts, and a turn's tokens as the judge reads them.
- ``console``: the operator console's bounded reads.

SQL lives only here (``tests/test_layout.py`` checks it): the rest of the project calls these functions.
"""

from gateway.store.db import connect, current_revision, downgrade, head_revision, normalize_url, upgrade
from gateway.store.models import Base, Call, PolicyVersion, Reward, Rollout
from gateway.store.records import CallRecord, RewardRecord, RolloutRecord
from gateway.store.repo import (
    CallCache,
    calls_for_rollout,
    full_prompt_array,
    full_prompt_ids,
    full_request,
    get_call,
    latest_call_by_tail_hash,
)
from gateway.store.writer import CallWriter, WriterStats

__all__ = [
    "Base",
    "Call",
    "CallCache",
    "CallRecord",
    "CallWriter",
    "PolicyVersion",
    "Reward",
    "RewardRecord",
    "Rollout",
    "RolloutRecord",
    "WriterStats",
    "calls_for_rollout",
    "connect",
    "current_revision",
    "downgrade",
    "full_prompt_array",
    "full_prompt_ids",
    "full_request",
    "get_call",
    "head_revision",
    "latest_call_by_tail_hash",
    "normalize_url",
    "upgrade",
]
