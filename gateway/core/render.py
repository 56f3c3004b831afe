"""Messages + tools → prompt token ids, with token-in-token-out (TITO) splicing.

The gateway owns the chat template. A fresh conversation is rendered with the model's own template and tokenized.
When a request extends a conversation this gateway already answered, the prompt is

    parent.prompt_ids + parent.completion_ids + tokens(text the template puts after that assistant turn)

so the model's earlier output enters the prompt as the raw ids that were sampled, never as a re-tokenization of
the text the harness echoed back (which may be re-serialized, stripped of reasoning, or split differently).

The text after the spliced turn is found by rendering the whole conversation once with the spliced assistant
turn's content replaced by a unique marker: everything after the marker is exactly what the template writes after
that turn (its end-of-turn text, the new tool results and user turns, the generation prompt), whatever the template
does to *earlier* turns (Qwen3's template, for one, drops old reasoning). If the parent's completion already ended
with the end-of-turn token the template writes, that text is not repeated.

Rendering the whole conversation costs time linear in its length, though only the text after the marker is used.
So the text after the marker is taken from a short conversation instead: the leading system message, the last user
message before the spliced turn, the marker turn and the messages after it (``incremental_after``). For a template
whose text after a turn depends only on that turn's neighbourhood (every template we know: ChatML, Qwen3, Llama 3)
that text is the same, and the cost no longer grows with the conversation. It is checked against the full render
on the first use of each shape of conversation tail and on every ``VERIFY_EVERY``-th splice; a mismatch (or a
template that rejects the short conversation) turns the shortcut off for that template, and the full render is
what is used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers.utils.chat_template_utils import render_jinja_template

from gateway.core.conversation import Message, ToolSpec
from gateway.end_of_turn import end_of_turn_tokens
from gateway.errors import BadRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SPLICE_MARK = "\u2063clawgate\u2063splice\u2063"
# Every VERIFY_EVERY-th splice is rendered in full too and compared (besides the first of each tail shape).
VERIFY_EVERY = 64

log = logging.getLogger("clawgate.render")


@dataclass(frozen=True, slots=True)
class Splice:
    """Where to splice: message ``index`` of the request is the assistant turn that ``token_ids`` ended with."""

    index: int
    token_ids: Sequence[int]  # parent prompt + completion, raw
    ends_with_end_of_turn: bool


class Renderer:
    """Renders conversations with a tokenizer's chat template. Thread-safe; call it off the event loop."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> None:
        template = chat_template or tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ValueError("the tokenizer has no chat template; pass one explicitly")
        self.tokenizer = tokenizer
        self.chat_template = template
        self._template_kwargs: dict[str, Any] = dict(tokenizer.special_tokens_map)
        # The Rust tokenizer directly: the Python wrapper costs more than the encoding of a short suffix.
        self._fast = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        self.end_of_turn_ids = end_of_turn_tokens(tokenizer)
        self._incremental = _Verification()

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_text(
        self, messages: list[dict[str, Any]], tools: list[ToolSpec], add_generation_prompt: bool = True
    ) -> str:
        try:
            result: Any = render_jinja_template(
                conversations=[messages],
                tools=[t.to_template() for t in tools] or None,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **self._template_kwargs,
            )
        except Exception as exc:  # a template's raise_exception() or a type error on odd input
            raise BadRequest(f"the model's chat template rejected the conversation: {exc}") from exc
        # Returns (rendered conversations, generation indices); annotated as str upstream.
        return str(result[0][0])

    def render_fresh(self, messages: list[Message], tools: list[ToolSpec]) -> list[int]:
        return self.encode(self.render_text([m.to_template() for m in messages], tools))

    def render_spliced(self, messages: list[Message], tools: list[ToolSpec], splice: Splice) -> list[int] | None:
        """Prompt ids that begin with ``splice.token_ids`` exactly, or None if the template defeats the splice."""
        after = self.text_after_splice(messages, tools, splice.index)
        if after is None:
            return None
        if splice.ends_with_end_of_turn:
            last = splice.token_ids[-1]
            end_text = self.end_of_turn_ids.get(last, "")
            if not end_text or not after.startswith(end_text):
                return None
            after = after[len(end_text) :]
        return [*splice.token_ids, *self.encode(after)]

    def text_after_splice(self, messages: list[Message], tools: list[ToolSpec], index: int) -> str | None:
        """What the template writes after assistant turn ``index`` (None: the template defeats the marker)."""
        if not self._incremental.enabled:
            return self.full_after(messages, tools, index)
        try:
            after = self.incremental_after(messages, tools, index)
        except BadRequest:
            after = None  # the short conversation is one the template refuses (the full one may not be)
        shape, verify = self._incremental.due(messages, index)
        if after is not None and not verify:
            return after
        full = self.full_after(messages, tools, index)
        if after != full:
            self._incremental.disable(shape)
        return full

    def full_after(self, messages: list[Message], tools: list[ToolSpec], index: int) -> str | None:
        dicts = [m.to_template() for m in messages]
        dicts[index] = {"role": "assistant", "content": SPLICE_MARK}
        return _after_mark(self.render_text(dicts, tools))

    def incremental_after(self, messages: list[Message], tools: list[ToolSpec], index: int) -> str | None:
        head = [0] if messages and messages[0].role in ("system", "developer") and index > 0 else []
        user = next((i for i in range(index - 1, -1, -1) if messages[i].role == "user"), None)
        if user is not None and user not in head:
            head.append(user)
        dicts = [messages[i].to_template() for i in head]
        dicts.append({"role": "assistant", "content": SPLICE_MARK})
        dicts += [m.to_template() for m in messages[index + 1 :]]
        return _after_mark(self.render_text(dicts, tools))

    def ends_with_end_of_turn(self, completion_ids: list[int]) -> bool:
        return bool(completion_ids) and completion_ids[-1] in self.end_of_turn_ids


def _after_mark(text: str) -> str | None:
    _, sep, after = text.partition(SPLICE_MARK)
    if not sep or SPLICE_MARK in after:
        return None
    return after


class _Verification:
    """When the short render of a splice is checked against the full one, and whether it is trusted at all."""

    def __init__(self) -> None:
        self.enabled = True
        self._seen: set[tuple[str, ...]] = set()
        self._splices = 0
        self._lock = threading.Lock()

    def due(self, messages: list[Message], index: int) -> tuple[tuple[str, ...], bool]:
        # The shape of what the short render keeps: the roles of the tail (and whether a system message leads).
        shape = (messages[0].role if messages else "", *(m.role for m in messages[index + 1 :]))
        with self._lock:
            self._splices += 1
            verify = shape not in self._seen or self._splices % VERIFY_EVERY == 0
            self._seen.add(shape)
        return shape, verify

    def disable(self, shape: tuple[str, ...]) -> None:
        if self.enabled:
            self.enabled = False
            log.warning(
                "the chat template writes a different text after a turn when earlier turns are left out (tail %s): "
                "rendering spliced conversations in full from now on",
                "/".join(shape[1:]) or "none",
            )
