"""Stored forms of token ids, logprobs and requests: exact round trips, compact layout, loud rejections."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gateway.store import codec


@pytest.mark.parametrize(
    "ids",
    [[], [0], [1, 2, 3], [2**32 - 1, 0, 151_643, 2**31], list(range(0, 300_000, 7))],
    ids=["empty", "zero", "small", "extremes", "long"],
)
def test_ids_round_trip(ids: list[int]) -> None:
    data = codec.pack_ids(ids)
    assert len(data) == 4 * len(ids)
    assert codec.unpack_ids(data) == ids
    assert all(type(value) is int for value in codec.unpack_ids(data))


def test_ids_are_little_endian_uint32() -> None:
    assert codec.pack_ids([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


def test_ids_accept_numpy_arrays() -> None:
    array = np.array([5, 6, 2**32 - 1], dtype=np.int64)
    assert codec.unpack_ids(codec.pack_ids(array)) == [5, 6, 2**32 - 1]
    assert codec.pack_ids(np.array([5, 6], dtype=np.uint16)) == codec.pack_ids([5, 6])


@pytest.mark.parametrize("bad", [[1, -1], [2**32], [2**64], [1.5], [[1, 2]]])
def test_ids_rejects_what_uint32_cannot_hold(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        codec.pack_ids(bad)  # type: ignore[arg-type]


def test_unpack_rejects_truncated_bytes() -> None:
    with pytest.raises(ValueError):
        codec.unpack_ids(b"\x01\x00\x00")
    with pytest.raises(ValueError):
        codec.unpack_logprobs(b"\x00\x00")


def test_ids_array_is_a_view_without_copy() -> None:
    data = codec.pack_ids([7, 8, 9])
    array = codec.ids_array(data)
    assert array.dtype == np.dtype("<u4") and array.tolist() == [7, 8, 9]
    assert not array.flags.writeable  # a view on immutable bytes


def test_logprobs_round_trip_keeps_specials() -> None:
    values = [0.0, -0.5, -1.25, -1e-8, float("-inf"), float("nan"), -123.75]
    data = codec.pack_logprobs(values)
    assert len(data) == 4 * len(values)
    back = codec.unpack_logprobs(data)
    assert back[:4] == [0.0, -0.5, -1.25, pytest.approx(-1e-8, rel=1e-6)]
    assert back[4] == float("-inf")
    assert math.isnan(back[5])
    assert back[6] == -123.75
    assert codec.unpack_logprobs(codec.pack_logprobs([])) == []


def test_logprobs_are_float32() -> None:
    # 0.1 is not exact in float32: the stored value is the float32 nearest to it, as the engine produced it.
    (back,) = codec.unpack_logprobs(codec.pack_logprobs([0.1]))
    assert back == float(np.float32(0.1)) and back != 0.1


def test_request_round_trip_and_compression() -> None:
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "héllo ✓ " * 200}],
        "temperature": 0.7,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "n": None,
    }
    data = codec.pack_request(request)
    assert codec.unpack_request(data) == request
    assert len(data) < 300  # the repeated content compresses


def test_trim_request_keeps_only_new_messages() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant"}]
    request = {"model": "m", "messages": messages}
    trimmed = codec.trim_request(request, 2)
    assert trimmed == {"model": "m", "messages": [{"role": "assistant"}]}
    assert request["messages"] is messages and len(messages) == 3  # the caller's request is untouched
    assert codec.trim_request(request, 0) is request
    assert codec.trim_request({"input": messages}, 1) == {"input": messages[1:]}


def test_trim_request_rejects_impossible_prefixes() -> None:
    with pytest.raises(ValueError):
        codec.trim_request({"model": "m", "messages": [{"role": "user"}]}, 2)
    with pytest.raises(ValueError):
        codec.trim_request({"model": "m", "prompt": [1, 2, 3]}, 1)
