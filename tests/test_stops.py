"""Stop strings on streamed text: what the client sees is the text cut before the stop, however it was chunked.

Checked on seeded random texts and stop sets over a small alphabet with accents, CJK, emoji and whitespace (so
that stops occur, overlap and straddle chunk boundaries often): the pieces returned by ``feed`` and ``finish``
concatenate to the text cut before the earliest stop occurrence, ``stopped`` names that stop, and between feeds
exactly the longest tail that could still begin a stop is held back.
"""

from __future__ import annotations

import random

import pytest

from gateway.core.stops import StopTrimmer

ALPHABET = ["a", "b", "c", "é", "日", "本", "🙂", "👍🏽", " ", "\n"]


def random_text(rng: random.Random, max_len: int = 24) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_len)))


def random_stops(rng: random.Random) -> list[str]:
    return [random_text(rng, 4) or "a" for _ in range(rng.randint(1, 4))]


def substring_free(stops: list[str]) -> list[str]:
    """Drop stops that contain another stop (or repeat one): then the earliest occurrence is unambiguous."""
    unique = sorted(set(stops), key=len)
    return [s for i, s in enumerate(unique) if not any(t in s for t in unique[:i])]


def random_chunks(rng: random.Random, text: str) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 5, 50])  # 0: detokenizers return "" while a character is incomplete
        chunks.append(text[i : i + size])
        i += size
    return chunks


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    pos, stop = min(found)
    return text[:pos], stop


def run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    trimmer = StopTrimmer(stops)
    out = "".join(trimmer.feed(c) for c in chunks) + trimmer.finish()
    return out, trimmer.stopped


def longest_pending_prefix(text: str, stops: list[str]) -> str:
    """The longest tail of ``text`` that is a proper prefix of some stop: the part that is still undecided."""
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-n:]) and s != text[-n:] for s in stops):
            return text[-n:]
    return ""


def test_random_texts_stops_and_chunkings_match_the_reference() -> None:
    rng = random.Random(1234)
    stopped_cases = 0
    for _ in range(600):
        stops = substring_free(random_stops(rng))
        text = random_text(rng)
        if rng.random() < 0.5:  # plant a stop so that about half the cases do stop
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(stops) + text[at:]
        expected = reference(text, stops)
        stopped_cases += expected[1] is not None
        for _ in range(4):
            assert run(stops, random_chunks(rng, text)) == expected, (text, stops)
        assert run(stops, [text]) == expected
        assert run(stops, list(text)) == expected
    assert stopped_cases > 250


def test_held_back_text_is_exactly_the_undecided_tail() -> None:
    rng = random.Random(99)
    for _ in range(400):
        stops = substring_free(random_stops(rng))
        text = random_text(rng, 30)
        trimmer = StopTrimmer(stops)
        fed, out = "", ""
        for chunk in random_chunks(rng, text):
            fed += chunk
            out += trimmer.feed(chunk)
            if trimmer.stopped is not None:
                break
            assert fed.startswith(out)
            assert fed[len(out) :] == longest_pending_prefix(fed, stops), (fed, out, stops)
        out += trimmer.finish()
        assert (out, trimmer.stopped) == reference(text, stops)


def test_any_stop_set_cuts_right_before_a_stop_and_never_shows_one() -> None:
    # Stops may contain each other here; whatever the chunking, the client never sees a whole stop string and
    # the cut sits right before the stop that is reported.
    rng = random.Random(7)
    for _ in range(600):
        stops = random_stops(rng)
        text = random_text(rng)
        out, stopped = run(stops, random_chunks(rng, text))
        assert text.startswith(out)
        assert not any(s in out for s in stops)
        if stopped is None:
            assert out == text
        else:
            assert stopped in stops
            assert text[len(out) :].startswith(stopped)


def test_possible_prefix_is_held_then_released() -> None:
    trimmer = StopTrimmer(["</answer>", "🙂!"])
    assert trimmer.feed("done </ans") == "done "
    assert trimmer.feed("we") == ""  # "</answe" may still become "</answer>"
    assert trimmer.feed("x 🙂") == "</answex "  # ...and now it cannot
    assert trimmer.feed("?") == "🙂?"
    assert trimmer.feed(" </") == " "
    assert trimmer.finish() == "</"
    assert trimmer.stopped is None


def test_stop_across_chunks_cuts_and_ends_the_stream() -> None:
    trimmer = StopTrimmer(["\nUser:"])
    assert trimmer.feed("Hi 日本\nUs") == "Hi 日本"
    assert trimmer.feed("er: more") == ""
    assert trimmer.stopped == "\nUser:"
    assert trimmer.feed("later text") == ""
    assert trimmer.finish() == ""


def test_without_stops_text_passes_through() -> None:
    for stops in ([], [""], ("", "")):
        trimmer = StopTrimmer(stops)
        assert trimmer.feed("abc") == "abc"
        assert trimmer.feed("") == ""
        assert trimmer.finish() == ""
        assert trimmer.stopped is None


@pytest.mark.parametrize(("stops", "text"), [(["abc", "b"], "abc"), (["abc", "ab"], "abcd")])
def test_result_does_not_depend_on_chunking_when_stops_overlap(stops: list[str], text: str) -> None:
    # Fed whole: ("", "abc"). Fed a character at a time, "b" (or "ab") is complete before "abc" is, so it wins.
    assert run(stops, [text]) == run(stops, list(text))
