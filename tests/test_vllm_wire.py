"""Reading vLLM's completion stream (``gateway.engines.vllm_wire.StreamReader``): bytes split anywhere, events that
arrive together, an error after tokens, an event longer than any read buffer."""

from __future__ import annotations

import json
import random

import pytest

from gateway.engines.base import GenerationEnd
from gateway.engines.vllm_wire import StreamReader
from gateway.errors import BadRequest, EngineError


def event(ids: list[int], finish: str | None = None, tops: bool = False) -> bytes:
    logprobs: dict[str, object] = {"token_logprobs": [-0.5 - i for i in range(len(ids))]}
    if tops:
        logprobs["top_logprobs"] = [{f"token_id:{t}": -0.5, f"token_id:{t + 1}": -1.5} for t in ids]
    choice = {"index": 0, "text": "", "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 7}}\n\ndata: [DONE]\n\n'


def read(pieces: list[bytes], top_logprobs: int = 0) -> tuple[list[list[int]], list[float], GenerationEnd]:
    reader = StreamReader(top_logprobs, prompt_tokens=3)
    deltas, logprobs = [], []
    for piece in pieces:
        delta, failure = reader.feed(piece)
        assert failure is None
        if delta is not None:
            deltas.append(delta.token_ids)
            logprobs += delta.logprobs
    return deltas, logprobs, reader.end()


def test_events_split_anywhere_read_the_same() -> None:
    body = b"".join(event([t]) for t in range(1, 40)) + event([40], finish="stop") + USAGE
    whole_deltas, whole_logprobs, whole_end = read([body])
    assert whole_deltas == [list(range(1, 41))]  # all arrived together: one delta
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, 30)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        deltas, logprobs, end = read(pieces)
        assert [t for d in deltas for t in d] == list(range(1, 41))
        assert logprobs == whole_logprobs and end == whole_end
    assert whole_end == GenerationEnd("stop", 40, 7, {})  # no stop_reason: the last id sent is the EOS


def test_one_delta_per_read_and_one_per_event_when_they_come_apart() -> None:
    events = [event([5, 6]), event([7]), event([8], finish="length"), USAGE]
    deltas, _, end = read(events)
    assert deltas == [[5, 6], [7], [8]] and end.finish_reason == "length" and end.stop_reason is None


def test_tokens_before_an_error_event_come_with_the_error() -> None:
    reader = StreamReader(0, prompt_tokens=3)
    error = b'data: {"error": {"message": "Token id 9999 is out of vocabulary", "code": 400}}\n\n'
    delta, failure = reader.feed(event([3]) + event([4]) + error)
    assert delta is not None and delta.token_ids == [3, 4]
    assert isinstance(failure, BadRequest) and "out of vocabulary" in failure.message


def test_an_event_longer_than_a_read_buffer() -> None:
    ids = list(range(20_000))  # ~1 MB of one event, with top logprobs
    deltas, logprobs, end = read([event(ids, finish="length", tops=True), USAGE], top_logprobs=2)
    assert deltas == [ids] and len(logprobs) == len(ids) and end.prompt_tokens == 7


def test_a_stream_without_a_finish_or_with_garbage_fails() -> None:
    reader = StreamReader(0, prompt_tokens=3)
    reader.feed(event([3]) + b"data: [DONE]\n\n")
    with pytest.raises(EngineError, match="without a finish reason"):
        reader.end()
    with pytest.raises(EngineError, match="unreadable stream event"):
        StreamReader(0, prompt_tokens=3).feed(b"data: {not json\n\n")


def test_a_whole_answer_reads_as_its_stream_does() -> None:
    """An unstreamed answer is one completion object with its usage: ``read`` gives what the stream's events give."""
    choice = json.loads(event([5, 6, 2], finish="stop").decode().removeprefix("data: "))["choices"][0]
    answer = {"choices": [choice], "usage": {"prompt_tokens": 7}, "metrics": {"time_to_first_token_ms": 40.0}}
    reader = StreamReader(0, prompt_tokens=3)
    delta = reader.read(answer)
    assert delta is not None and delta.token_ids == [5, 6, 2] and delta.logprobs == [-0.5, -1.5, -2.5]
    assert reader.end() == GenerationEnd("stop", 2, 7, {"prefill": 0.04})
    _, _, streamed = read([event([5, 6, 2], finish="stop"), USAGE])
    assert streamed.finish_reason == "stop" and streamed.stop_reason == 2 and streamed.prompt_tokens == 7
