"""Id minting: every id the gateway hands out (requests, calls, rollouts, messages, output items).

The protocols spell their ids differently (OpenAI ``chatcmpl-…``, Anthropic ``msg_…``, Responses ``resp_…`` with
a longer random part); one function makes them all so the randomness and its length are decided in one place.
"""

from __future__ import annotations

import uuid


def new_id(prefix: str, *, sep: str = "-", length: int = 24) -> str:
    """``prefix`` + ``sep`` + ``length`` random hex digits (at most 32)."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:length]}"
