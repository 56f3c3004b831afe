"""The serving layer: one module per public protocol over a shared base.

Each protocol module (``chat``, ``completions``, ``messages``, ``responses``) translates its wire request into a
``ChatJob`` for ``ChatService`` and the service's results back into its wire format, streamed or whole; ``base``
holds what they share (request prologue, sampling defaults, the respond and stream shells with their one error
tail, SSE framing), ``choices`` runs a request's n choices, and ``blocks`` is the "open a new block when the kind
of text changes" state machine of the Anthropic and Responses streams. ``gateway/api`` only routes HTTP here.
"""
