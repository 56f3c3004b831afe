"""Which earlier call does a request continue? The in-memory index behind TITO splicing and implicit sessions.

Every finished call registers the hash of its conversation *including its own answer* (``tail_hash``). A new
request hashes each prefix of its messages (``conversation.prefix_hashes``); if the prefix ending at one of its
assistant turns equals a registered tail, that call is the parent: its raw prompt+completion ids start the new
prompt, and (without an explicit rollout id) the request joins the parent's rollout.

Entries are scoped: calls of an explicit rollout only continue calls of the same rollout; calls without one
continue any implicit-session call (that is how implicit sessions are found). The index is bounded by the number
of tokens it holds and evicts least recently used entries; an entry nobody looked up or added for ``max_idle_s``
(``CLAWGATE_SESSION_CACHE_IDLE``) is forgotten too, so its memory follows the traffic of that window and levels
off, instead of filling the token budget with conversations that ended long ago. A conversation that resumes
after that is still continued exactly: its last turn is found in the database (``fallback``).

The index is this process's cache; the database is the shared truth. With several gateway processes, the turn
before may have been answered by another one: when the last assistant turn is not in the index, ``fallback``
finds its call in the database, and an assistant turn that cannot be spliced is checked against the stored
answer hashes (``known_outputs``) before it is called someone else's — so drift counts the same on every process.
Both are asked only when the index does not know the turn, never on a spliced continuation it knows.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.core.conversation import Message, output_hash, prefix_hashes
from gateway.core.conversation import ToolSpec as ToolSpec
from gateway.core.render import Renderer, Splice


@dataclass(slots=True)
class CallEntry:
    call_id: str
    rollout_id: str
    # Prompt + completion, raw. The index holds every conversation of the last idle window, and a list of token ids
    # costs about 36 bytes a token (a pointer and an int object each): an array of 4-byte ints is 9 times smaller.
    token_ids: Sequence[int]
    ends_with_end_of_turn: bool
    # Exact hashes of the request's messages (as sent) plus nothing for the answer: a child request whose first
    # messages hash the same stores only the rest.
    exact_hashes: list[bytes] = field(default_factory=list)
    explicit: bool = True
    # When the call ended (time.time()); 0 for one read back from the database. Its rollout cannot have been
    # closed for idleness sooner than the idle timeout after this.
    ended_at: float = field(default_factory=time.time)
    # The policy version that served it: a conversation keeps its version under guarded promotion.
    policy_version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, array):
            self.token_ids = array("i", self.token_ids)


def entry_ids(parent: CallEntry | None, prompt_ids: list[int], completion_ids: list[int]) -> array[int]:
    """A finished call's raw prompt + completion as an array. A spliced prompt begins with its parent's ids: those
    are copied as one block, and only the ids after them are converted one by one (a long conversation's turn then
    costs microseconds here, not the millisecond of converting its whole prompt on the event loop)."""
    if parent is None or len(parent.token_ids) > len(prompt_ids):
        out = array("i", prompt_ids)
    else:
        out = array("i", parent.token_ids)
        out.extend(prompt_ids[len(out) :])
    out.extend(completion_ids)
    return out


@dataclass(slots=True)
class PromptPlan:
    prompt_ids: list[int]
    mode: str  # fresh | spliced | drifted
    parent: CallEntry | None
    hashes: list[bytes]  # prefix hashes of the request's messages
    # Index of the request message that echoes the parent's answer (-1: none); the messages after it are what
    # the harness added since: the parent turn's next state.
    splice_at: int = -1


class SessionIndex:
    def __init__(
        self,
        max_tokens: int = 20_000_000,
        max_idle_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_idle_s = max_idle_s
        self._clock = clock
        # Least recently used first; each entry with when it was last added or looked up.
        self._entries: OrderedDict[tuple[str | None, bytes], tuple[CallEntry, float]] = OrderedDict()
        # Answer hashes of our calls, each with when it was last added, oldest first. They only mark "ours": one
        # forgotten is looked up in the database (known_outputs) before a turn is called someone else's.
        self._outputs: OrderedDict[tuple[str | None, bytes], float] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Token ids held, over all entries."""
        return self._tokens

    def lookup(self, scope: str | None, tail_hash: bytes) -> CallEntry | None:
        key = (scope, tail_hash)
        with self._lock:
            held = self._entries.get(key)
            if held is None:
                return None
            self._entries[key] = (held[0], self._clock())
            self._entries.move_to_end(key)
            return held[0]

    def is_known_output(self, scope: str | None, out_hash: bytes) -> bool:
        return (scope, out_hash) in self._outputs

    def add(self, scope: str | None, tail_hash: bytes, out_hash: bytes, entry: CallEntry) -> None:
        with self._lock:
            key = (scope, tail_hash)
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old[0].token_ids)
            now = self._clock()
            self._entries[key] = (entry, now)
            self._tokens += len(entry.token_ids)
            okey = (scope, out_hash)
            self._outputs[okey] = now
            self._outputs.move_to_end(okey)
            # The front is the least recently used: evict while over budget, then while idle too long (never the
            # entry just added: it is the one its harness is about to continue).
            stale = now - self.max_idle_s
            while len(self._entries) > 1:
                front, (evicted, used) = next(iter(self._entries.items()))
                if self._tokens <= self.max_tokens and used > stale:
                    break
                del self._entries[front]
                self._tokens -= len(evicted.token_ids)
            most = 4 * max(len(self._entries), 1024)
            while self._outputs:
                okey, added = next(iter(self._outputs.items()))
                if len(self._outputs) <= most and added > stale:
                    break
                del self._outputs[okey]


Fallback = Callable[[str | None, bytes], CallEntry | None]
# The subset of answer hashes that a call of this scope generated, from durable storage.
KnownOutputs = Callable[[str | None, list[bytes]], bool]


def plan_prompt(
    renderer: Renderer,
    index: SessionIndex,
    scope: str | None,
    messages: list[Message],
    tools: list[ToolSpec],
    fallback: Fallback | None = None,
    known_outputs: KnownOutputs | None = None,
    tenant: str = "default",
) -> PromptPlan:
    """Render a request's prompt, splicing the raw ids of the latest earlier answer it continues.

    ``fallback`` looks up the last assistant turn in durable storage when the in-memory index does not know it
    (another process answered it, a restart, or the index evicted the conversation); ``known_outputs`` tells
    whether assistant turns the index does not know were generated here all the same.
    """
    hashes = prefix_hashes(messages, tools, tenant)
    assistant_at = [i for i, m in enumerate(messages) if m.role == "assistant"]
    parent: CallEntry | None = None
    splice_at = -1
    if assistant_at:
        # The last assistant turn first, from memory, then from storage: an earlier turn found in memory is no
        # substitute when another process answered the last one (its raw tokens would be lost).
        last = assistant_at[-1]
        parent = index.lookup(scope, hashes[last])
        if parent is None and fallback is not None:
            parent = fallback(scope, hashes[last])
        if parent is not None:
            splice_at = last
        else:
            for i in reversed(assistant_at[:-1]):
                parent = index.lookup(scope, hashes[i])
                if parent is not None:
                    splice_at = i
                    break
    # An answer of ours that we could not splice (its history was rewritten, or it sits after the splice point)
    # means the prompt re-tokenizes model output: that is drift, counted and recorded.
    after = [output_hash(messages[i], tenant) for i in assistant_at if i > splice_at]
    unknown = [h for h in after if not index.is_known_output(scope, h)]
    drifted = len(unknown) < len(after) or bool(unknown and known_outputs is not None and known_outputs(scope, unknown))
    if parent is not None:
        ids = renderer.render_spliced(
            messages, tools, Splice(splice_at, parent.token_ids, parent.ends_with_end_of_turn)
        )
        if ids is not None:
            return PromptPlan(ids, "drifted" if drifted else "spliced", parent, hashes, splice_at)
        drifted = True
        parent = None
    return PromptPlan(renderer.render_fresh(messages, tools), "drifted" if drifted else "fresh", parent, hashes)
