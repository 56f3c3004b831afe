"""Token-level text work of the serving core: single-token lookups, token prompts and the text of tokens.

Pure functions of a tokenizer and their inputs. ``ChatService`` runs the heavy ones in a worker thread (a prompt
of many thousand tokens, or the logprobs of a long answer, would otherwise stall every stream on the event loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.render import Renderer
from gateway.errors import BadRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str | None) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as exactly one token, else None."""
    if not text:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, renderer: Renderer, prompt: str | list[int], *, echo: bool, param: str
) -> tuple[list[int], str]:
    """A raw prompt's token ids (text is encoded, ids are checked against the vocabulary) and, with ``echo``, its
    text; a prompt the model cannot take is a 400 naming ``param``."""
    if isinstance(prompt, str):
        ids = renderer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", param=param)
    if not ids:
        raise BadRequest("prompt is empty", param=param)
    if not echo:
        return ids, ""
    return ids, prompt if isinstance(prompt, str) else str(tokenizer.decode(ids))


# An alternative's text and logprob, in the order the engine reported them.
Alternatives = list[tuple[str, float]]


def token_texts(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], tops: list[dict[int, float]] | None
) -> tuple[list[str], list[Alternatives] | None]:
    """The text of each token, and of each position's top alternatives (for logprobs)."""
    texts = [str(tokenizer.decode([t])) for t in ids]
    if tops is None:
        return texts, None
    return texts, [[(str(tokenizer.decode([a])), lp) for a, lp in alt.items()] for alt in tops]
