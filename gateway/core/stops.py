"""Stop strings on the text the client sees.

Engines stop *after* the token that completes a stop string, and that token may carry text beyond it; the client
must see the text up to (not including) the stop string, as the OpenAI API specifies. While streaming, text that
could be the beginning of a stop string is held back until it is decided. The stored token ids are not touched:
training sees exactly what was sampled.
"""

from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=0) - 1
        self._buffer = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        buf = self._buffer + text
        # The stop that *completes* first wins (ties: the one starting first). A streamed generation sees the
        # text in pieces and can only know about a stop once it is complete, so this is the rule that gives the
        # same answer however the text was chunked (with stops such as "abc" and "b" in "abc": "b").
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos != -1 and (best is None or (pos + len(stop), pos) < best[:2]):
                best = (pos + len(stop), pos, stop)
        if best is not None:
            self._buffer = ""
            self.stopped = best[2]
            return buf[: best[1]]
        keep = min(self._hold, len(buf))
        # Hold back only a tail that is a proper prefix of some stop string.
        while keep > 0 and not any(s.startswith(buf[-keep:]) for s in self.stops):
            keep -= 1
        self._buffer = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        out, self._buffer = ("" if self.stopped is not None else self._buffer), ""
        return out
