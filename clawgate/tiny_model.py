"""Build a tiny random Qwen3-architecture model and a matching tokenizer, offline and deterministically.

Tests, the demo and the benchmarks need a real model that both transformers and vLLM load, without a model
hub. ``build_tiny_model`` trains a byte-level BPE tokenizer on text present on every machine (a fixed sorted
slice of the Python standard library sources plus a small built-in corpus of prose, JSON and tool calls),
initializes a ~0.7M-parameter ``Qwen3ForCausalLM`` from a seeded generator and ``save_pretrained``s both into
one folder. The same seed gives byte-identical ``model.safetensors`` and ``tokenizer.json`` (for a given
Python, tokenizers and transformers version).

Two choices matter for training experiments: with tied embeddings (init std 0.02) a random model's logits all
stay within a few units, so its next-token distribution is almost uniform and a LoRA on the decoder layers
cannot move it; the final RMSNorm weight is therefore scaled ×4 at build time, which gives the logits a usable
range. Embeddings stay tied, like small Qwen3 models.

The chat template is Qwen/ChatML with Hermes-style tool calls, like Qwen2.5/Qwen3, with two deliberate
differences that a token-exact gateway needs: reasoning (``<think>``) is rendered for every assistant turn
that carries it (Qwen3 drops it from earlier turns), and a message renders the same whatever follows it, so
the rendering of ``messages[:k]`` is a prefix of the rendering of ``messages[:k + j]``. The one exception,
inherited from Qwen's format, is a cut between two consecutive ``tool`` messages: they share one user turn,
which is closed only after the last of them.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Single tokens that are not "special": decode(skip_special_tokens=True) keeps them, as in Qwen's tokenizer,
# so a parser still sees tool calls and reasoning tags in the decoded text.
TEXT_CONTROL_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2.5/Qwen3's pre-tokenizer split: digits are single pieces, words keep one leading non-letter.
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Enough Python source for a ~2k vocabulary to settle while training stays under a second.
_STDLIB_CORPUS_CHARS = 1_500_000
_VOCAB_MULTIPLE = 64

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none or content is undefined -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- elif content is mapping -%}"
    "{{- raise_exception('message content must be a string or a list of parts') -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}"
    "{%- else -%}{{- raise_exception('only text content parts are supported, got ' ~ part.type) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    # System turn: the first system message, followed by the tool block when tools are given.
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- render_content(messages[0].content) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments'"
    " + ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    # Already rendered above.
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is defined"
    " else message.reasoning -%}"
    "{%- if reasoning is string and reasoning -%}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- set content = render_content(message.content) -%}"
    "{{- content -}}"
    "{%- if message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    # Qwen merges consecutive tool results into one user turn.
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
"""Jinja chat template stored in the tiny model's tokenizer (``tokenizer.chat_template``)."""

_PROSE = """\
The gateway records the exact tokens that the model saw and produced, so that a trainer can learn from them.
Please read the file, summarize the main points, and list any open questions at the end.
I could not find the configuration file. Could you check whether the path is correct and try again?
Sure! Here is a short plan: first we inspect the repository, then we run the tests, then we fix the bug.
The weather in Paris today is sunny with a high of 24 degrees and a light breeze from the west.
Error: permission denied while opening the log directory. The process exited with status 1.
Let me think about this step by step. The user wants the total, so I should add the two numbers first.
Thank you for your help. The results look good, and the report has been sent to the whole team.
You are a helpful assistant. Answer concisely and use the available tools when they help.
What is the capital of France? The capital of France is Paris.
Write a function that returns the sum of a list of numbers, then test it with an empty list.
"""

_TOOLS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("get_weather", "Get the current weather for a city.", {"city": "Paris", "unit": "celsius"}),
    ("read_file", "Read a file from the workspace.", {"path": "src/main.py"}),
    ("write_file", "Write text to a file.", {"path": "notes.txt", "content": "hello world\n"}),
    ("run_command", "Run a shell command and return its output.", {"command": "ls -la", "timeout": 30}),
    ("search", "Search the web for a query.", {"query": "python list sort", "max_results": 5}),
    ("calculator", "Evaluate an arithmetic expression.", {"expression": "12 * (3 + 4)"}),
)


def _builtin_corpus() -> Iterator[str]:
    """Chat-shaped text the stdlib sources lack: prose, JSON tool schemas, tool calls and results."""
    yield _PROSE
    for name, description, arguments in _TOOLS:
        properties = {
            key: {"type": "integer" if isinstance(value, int) else "string"} for key, value in arguments.items()
        }
        tool = {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": sorted(arguments)},
            },
        }
        yield json.dumps(tool)
        yield f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
        yield f"<tool_response>\n{json.dumps({'ok': True, 'result': arguments})}\n</tool_response>"
        yield f"<|im_start|>user\nPlease use {name}: {description}<|im_end|>\n"
        yield (f"<|im_start|>assistant\n<think>\nI should call {name}.\n</think>\n\nCalling {name} now.<|im_end|>\n")


def _stdlib_corpus(budget: int) -> Iterator[str]:
    """The first ``budget`` characters of the top-level stdlib modules, in file-name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    remaining = budget
    for path in sorted(stdlib.glob("*.py")):
        if remaining <= 0:
            break
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        remaining -= len(text)
        yield text


def _train_tokenizer(bpe_vocab_size: int) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level like Qwen, and no normalizer: decode(encode(text)) == text for every string.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Weight the chat-shaped text up: the Python sources dwarf it otherwise.
    corpus = [*_stdlib_corpus(_STDLIB_CORPUS_CHARS), *(list(_builtin_corpus()) * 20)]
    tokenizer.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    # Added after training so that their ids sit above the BPE vocabulary, as in Qwen.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_CONTROL_TOKENS])
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_position_embeddings: int = 40960,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a random Qwen3ForCausalLM (float32 safetensors) and its tokenizer into ``out_dir``.

    ``vocab_size`` is the tokenizer's size including the 9 added tokens; the model's embedding is padded up to
    a multiple of 64. Attention keeps head_dim 32 with ``hidden_size // 32`` query heads and half as many KV
    heads. Returns the folder.
    """
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    def report(message: str) -> None:
        if progress is not None:
            progress(message)

    n_added = len(SPECIAL_TOKENS) + len(TEXT_CONTROL_TOKENS)
    if vocab_size < 256 + n_added + 1:
        raise ValueError(f"vocab_size must exceed {256 + n_added} (the byte alphabet and added tokens)")
    head_dim = 32
    if hidden_size % (2 * head_dim):
        raise ValueError(f"hidden_size must be a multiple of {2 * head_dim}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    report("training the tokenizer")
    backend = _train_tokenizer(vocab_size - n_added)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Listed so that all_special_ids covers every special=True token, as in Qwen's tokenizer_config.
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out)
    token_id = {t: backend.token_to_id(t) for t in (*SPECIAL_TOKENS, *TEXT_CONTROL_TOKENS)}

    report("initializing the model")
    num_heads = hidden_size // head_dim
    config = Qwen3Config(
        vocab_size=-(-backend.get_vocab_size() // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=token_id[EOS_TOKEN],
        pad_token_id=token_id[PAD_TOKEN],
        dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    _init_weights(model, seed=seed, std=config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[token_id[EOS_TOKEN], token_id[PAD_TOKEN]],
        pad_token_id=token_id[PAD_TOKEN],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        # 0 disables top-k; left unset, transformers would sample from the top 50 only.
        top_k=0,
    )

    report("saving")
    with torch.no_grad():
        model.save_pretrained(out)
    # transformers writes the weights 0600; an engine in another container or account must read them.
    (out / "model.safetensors").chmod(0o644)
    report(f"tiny model written to {out}")
    return out


def build_tiny(out: Path, seed: int = 0) -> None:
    """``build_tiny_model`` with its progress on stderr (for `clawgate tiny-model` and `clawgate up`)."""
    t0 = time.perf_counter()
    print(f"building tiny model in {out} ...", file=sys.stderr)
    build_tiny_model(out, seed=seed, progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    print(f"built {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def _init_weights(model: Any, *, seed: int, std: float) -> None:
    """Seeded init from a private generator, independent of transformers' init code and the global RNG."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:
                param.zero_()
        # Tied embeddings at std 0.02 give near-uniform next-token distributions; ×4 on the last norm
        # gives the logits a range a decoder-layer LoRA can shape.
        model.model.norm.weight.mul_(4.0)
