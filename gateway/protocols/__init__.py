"""The public APIs, one folder per protocol: its routes (``routes.py``), wire models (``wire.py``) and serving.

- ``openai``: chat completions (``chat.py``), completions (``completions.py``) and the model list;
- ``anthropic``: Messages and token counting (``serving.py``);
- ``responses``: the OpenAI Responses API (``serving.py``);
- ``common``: what they share: the error body (``wire.py``), the request prologue, sampling defaults, the respond
  and stream shells with their one error tail and SSE framing (``serving.py``), a request's n choices
  (``choices.py``), the "open a new block when the kind of text changes" state machine of the Anthropic and
  Responses streams (``blocks.py``), and how a serving class becomes routes (``routes.py``).

Each serving class translates its wire request into a ``ChatJob`` for the request core (``gateway/core``) and the
core's results back into its wire format, streamed or whole. A protocol imports ``common`` and the core, never
another protocol.
"""
