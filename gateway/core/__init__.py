"""The request core: one call from a protocol's ``ChatJob`` to its recorded answer, in the order a reader follows.

1. **plan** (``service.ChatService.plan``): which earlier call the request continues (``sessions``, and
   ``continuity`` across gateway processes), the tool choice (``tool_choice``), the stop strings (``stops``);
2. **render** (``render``): messages and tools to prompt token ids, splicing the exact ids of earlier turns (TITO);
3. **generate**: the engine (``gateway/engines``) samples ids and their logprobs;
4. **text pipeline**: ids to text deltas (``detokenize``), stop strings cut, tool calls and reasoning parsed
   (``parsers``);
5. **record** (``service``): the call registered for the next turn and handed to the capture writer
   (``gateway/store/writer.py``).

``job`` holds the types a protocol hands the core and gets back; ``conversation`` the one internal request model;
``next_state`` what a later call says about an earlier answer; ``response_store`` the Responses API's stored
conversations; ``tokens`` the token-level text helpers.
"""
