"""Grammar-constrained sampling: a compiled grammar per distinct ``Constraint`` and the allowed-token mask per step.

The library is llguidance (guidance-ai; also a backend of vLLM's structured outputs and of llama.cpp): a 3 MB
wheel with no Python dependencies, JSON schemas and Lark grammars in one dialect (``%json`` inside Lark, which
forced tool calls need), masks in well under a millisecond a token, and resource limits on every grammar so a
pathological schema fails instead of stalling. xgrammar would pull in triton (1 GB) on a CPU machine.

Its torch helper applies masks with a ``torch.compile`` kernel (seconds of compilation on the first call on a CPU);
``bitmasks`` fills the masks of a whole decode batch into one array instead (row by row, on the engine's worker
thread, after the forward pass), and the local engine unpacks and applies them to the batch's logits in a few array
operations (``sampling.apply_bitmasks``): a step of eight constrained rows costs one unpack and one ``masked_fill``,
not eight. A row its grammar leaves a single token is not drawn from at all (``sampling.forced_tokens``,
``forced_draw``). Filling the next step's masks on a second thread during the forward pass (the library releases the
GIL while it computes) measured slower on two cores, not faster: that thread takes the GIL back after every row and
at every hand-over, against the forward's own Python. ``allowed`` gives one matcher's mask as a bool array (for
recomputing masked logprobs). This module imports no torch: the request core checks grammars with it in a gateway
that serves through vLLM.

``Grammars`` belongs to one tokenizer. ``check`` refuses a grammar the library cannot compile (BadRequest with
its message); ``matcher`` hands out a fresh matcher per request, copied from a compiled one kept per grammar text
(LRU), so a schema sent again is not compiled again; ``stats`` counts compilations, cache hits and compile time.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.errors import BadRequest

if TYPE_CHECKING:
    from llguidance import LLMatcher

# Compiled grammars kept per tokenizer: schemas differ per tool set, not per request.
CACHE_SIZE = 256


class Grammars:
    def __init__(self, tokenizer: Any, *, vocab_size: int | None = None, eos_ids: Iterable[int] = ()) -> None:
        import llguidance.hf

        eos = sorted(set(eos_ids)) or None
        self.vocab_size = vocab_size or len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"compiles": 0, "hits": 0, "compile_s": 0.0}

    def _compiled_matcher(self, grammar: str, param: str) -> LLMatcher:
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                self.stats["hits"] += 1
                return matcher
        t0 = time.perf_counter()
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        elapsed = time.perf_counter() - t0
        if matcher.is_error():
            raise BadRequest(f"the output format cannot be enforced: {matcher.get_error()}", param=param)
        with self._lock:
            self.stats["compiles"] += 1
            self.stats["compile_s"] += elapsed
            self._compiled[grammar] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def cached(self, grammar: str) -> bool:
        """Whether ``grammar`` is compiled already (counted as a cache hit); cheap enough for the event loop."""
        with self._lock:
            if grammar not in self._compiled:
                return False
            self._compiled.move_to_end(grammar)
            self.stats["hits"] += 1
            return True

    def check(self, grammar: str, param: str) -> None:
        """Compile ``grammar`` (or find it compiled); BadRequest naming ``param`` when it cannot be enforced."""
        self._compiled_matcher(grammar, param)

    def matcher(self, grammar: str, param: str = "response_format") -> LLMatcher:
        """A fresh matcher at the start of ``grammar``."""
        return self._compiled_matcher(grammar, param).deep_copy()

    def bitmasks(self, rows: list[tuple[LLMatcher, int]], batch: int) -> np.ndarray:
        """The allowed-token bitmasks of a batch of ``batch`` rows (int32, 32 tokens a word, bit set: allowed): row
        ``i`` of each ``(matcher, i)`` holds what that matcher allows next; other rows allow everything."""
        masks = np.full((batch, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        # Row by row on this thread: the library's thread pool (``fill_next_token_bitmask_par``) took twice as long
        # for 8 rows on 2 cores, its threads competing with torch's. The pointer arithmetic is that of
        # ``llguidance.numpy.fill_next_token_bitmask``, without its per-row checks and ctypes round trip; the bound
        # check stays, since the library writes wherever the pointer says.
        base, stride = masks.ctypes.data, masks.strides[0]
        for matcher, i in rows:
            if not 0 <= i < batch:
                raise IndexError(f"bitmask row {i} of {batch}")
            matcher.unsafe_compute_mask_ptr(base + i * stride, stride)
        return masks

    def allowed(self, matcher: LLMatcher) -> np.ndarray:
        """The tokens ``matcher`` allows next, as a bool array over the vocabulary."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)


def consume(matcher: LLMatcher, token: int) -> None:
    """Advance ``matcher`` past the sampled ``token``; a token the mask let through is always accepted."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token}: {matcher.get_error()}")
