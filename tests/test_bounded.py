"""Per-id memory that forgets: the LRU cache of rollout keys and the expiring set of closed rollouts."""

from __future__ import annotations

from gateway.bounded import ExpiringSet, LRUDict
from gateway.state import ROLLOUT_KEYS_CACHED, AppState


def test_lru_dict_keeps_the_most_recently_used() -> None:
    cache: LRUDict[str, int] = LRUDict(2)
    cache["a"] = 1
    cache["b"] = 2
    assert cache["a"] == 1  # a is now the most recently used
    cache["c"] = 3
    assert "b" not in cache and dict(cache) == {"a": 1, "c": 3}
    cache["a"] = 4  # overwriting does not grow it
    assert len(cache) == 2 and cache["a"] == 4


def test_rollout_keys_stay_bounded_after_many_rollouts() -> None:
    keys = AppState.__dataclass_fields__["rollout_keys"].default_factory()  # type: ignore[misc]
    for i in range(ROLLOUT_KEYS_CACHED + 1000):
        keys[f"ro-{i}"] = i
    assert len(keys) == ROLLOUT_KEYS_CACHED
    assert f"ro-{ROLLOUT_KEYS_CACHED + 999}" in keys and "ro-0" not in keys


def test_expiring_set_forgets_members_after_ttl() -> None:
    now = [0.0]
    closed: ExpiringSet[str] = ExpiringSet(100, clock=lambda: now[0])
    closed.update(["ro-1", "ro-2"])
    now[0] = 60
    closed.add("ro-2")  # added again: remembered from now on
    assert "ro-1" in closed and "ro-2" in closed
    now[0] = 100
    assert "ro-1" not in closed and "ro-2" in closed and "ro-3" not in closed
    now[0] = 200
    assert len(closed) == 0


def test_expiring_set_stays_bounded_under_endless_closes() -> None:
    now = [0.0]
    closed: ExpiringSet[str] = ExpiringSet(60, clock=lambda: now[0])
    for i in range(100_000):  # a close every 10 ms
        now[0] += 0.01
        closed.add(f"ro-{i}")
    assert 5999 <= len(closed) <= 6001  # one minute of closes
