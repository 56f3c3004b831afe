"""Compact binary forms of what a call stores: token ids, logprobs and the request body.

Token ids are little-endian uint32 (4 bytes a token; every vocabulary in use fits) and logprobs
little-endian float32, converted with numpy so a 100k-token prompt costs one memcpy rather than a Python loop.
The request is zlib-compressed JSON with its message list cut to the messages after the prefix shared with the
parent call, so a long conversation stores each message once.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

IDS_DTYPE = np.dtype("<u4")
LOGPROBS_DTYPE = np.dtype("<f4")
MAX_TOKEN_ID = 2**32 - 1

# Where a request keeps its conversation: chat and Anthropic use `messages`, the Responses API `input`.
MESSAGE_KEYS = ("messages", "input")


def pack_ids(ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bytes:
    """Token ids as little-endian uint32 bytes; rejects negative, too large or non-integer ids."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers (between 0 and {MAX_TOKEN_ID}), got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"negative token id {int(arr.min())}")
    if int(arr.max()) > MAX_TOKEN_ID:
        raise ValueError(f"token id {int(arr.max())} does not fit in uint32")
    return arr.astype(IDS_DTYPE, copy=False).tobytes()


def ids_array(data: bytes) -> npt.NDArray[np.uint32]:
    """A read-only uint32 view of packed token ids (no copy)."""
    if len(data) % IDS_DTYPE.itemsize:
        raise ValueError(f"packed token ids have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=IDS_DTYPE)


def unpack_ids(data: bytes) -> list[int]:
    return ids_array(data).tolist()


def pack_logprobs(logprobs: Sequence[float] | npt.NDArray[np.floating[Any]]) -> bytes:
    """Logprobs as little-endian float32 bytes (the engines' own precision; NaN and -inf survive)."""
    arr = np.asarray(logprobs, dtype=LOGPROBS_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be a flat sequence, got shape {arr.shape}")
    return arr.tobytes()


def logprobs_array(data: bytes) -> npt.NDArray[np.float32]:
    if len(data) % LOGPROBS_DTYPE.itemsize:
        raise ValueError(f"packed logprobs have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=LOGPROBS_DTYPE)


def unpack_logprobs(data: bytes) -> list[float]:
    return logprobs_array(data).tolist()


def pack_request(request: dict[str, Any]) -> bytes:
    return zlib.compress(orjson.dumps(request))


def unpack_request(data: bytes) -> dict[str, Any]:
    value = orjson.loads(zlib.decompress(data))
    if not isinstance(value, dict):
        raise ValueError("stored request is not a JSON object")
    return value


def messages_key(request: dict[str, Any]) -> str | None:
    """The key of the request's conversation list, or None when it has none (a plain completions prompt)."""
    for key in MESSAGE_KEYS:
        if isinstance(request.get(key), list):
            return key
    return None


def trim_request(request: dict[str, Any], prefix_messages: int) -> dict[str, Any]:
    """The request with its first ``prefix_messages`` messages removed (they are the parent call's)."""
    if prefix_messages == 0:
        return request
    key = messages_key(request)
    if key is None:
        raise ValueError("request_prefix_messages > 0 but the request has no message list")
    messages = request[key]
    if prefix_messages < 0 or prefix_messages > len(messages):
        raise ValueError(f"request_prefix_messages={prefix_messages}, but the request has {len(messages)}")
    return {**request, key: messages[prefix_messages:]}
