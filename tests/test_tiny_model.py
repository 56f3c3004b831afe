"""The tiny model builder: deterministic, loads in transformers, usable logits, Qwen-style chat template."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from clawgate.tiny_model import (  # noqa: E402
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TEXT_CONTROL_TOKENS,
    build_tiny_model,
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are helpful."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
    },
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the tool.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            # A JSON string is rendered verbatim (no re-serialization).
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "Thanks"},
]

EXPECTED_CONVERSATION = (
    "<|im_start|>system\nYou are helpful.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0])
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nI need the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Lyon"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    "<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nBoth answered.\n</think>\n\nSunny in Paris.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    # The seed drives the weights; the tokenizer does not depend on it.
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_saved_config(model_dir: Path, tokenizer: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["max_position_embeddings"] >= 32768
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= len(tokenizer)
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 2, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eos_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(generation["eos_token_id"]) == eos_ids
    # Unset, transformers would sample from the top 50 tokens, not the distribution whose logprobs we report.
    assert generation.get("top_k") in (0, None) and "top_k" in generation


def test_special_and_control_tokens_are_single_ids(tokenizer: Any) -> None:
    assert 1900 <= len(tokenizer) <= 2048
    for token in (*SPECIAL_TOKENS, *TEXT_CONTROL_TOKENS):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == token
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = '<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{"a": 1}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    # ChatML markers are dropped by skip_special_tokens, tool/think tags stay (a parser needs them).
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == 'assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{"a": 1}\n</tool_call>'
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_arbitrary_text(tokenizer: Any) -> None:
    text = "déjà vu 🚀 tabs\tand\r\nCRLF  double  spaces {'x': [1, 2.5e-3]} \u00a0\u200b end"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # Trained on code and prose: common text compresses well below one token per byte.
    sample = "def main(self, path):\n    return json.dumps({'name': 'get_weather'})\n"
    assert len(tokenizer.encode(sample, add_special_tokens=False)) < len(sample.encode()) / 2


def test_template_is_the_tokenizer_template(tokenizer: Any) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_template_renders_full_conversation(tokenizer: Any) -> None:
    text = render(tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert text == EXPECTED_CONVERSATION


def test_template_without_tools_or_system(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    assert render(tokenizer, messages) == expected
    system_only = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    assert render(tokenizer, system_only) == "<|im_start|>system\nBe brief.<|im_end|>\n"
    with_tools = render(tokenizer, messages[:1], tools=TOOLS, add_generation_prompt=True)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n\n")
    assert with_tools.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    no_think = render(tokenizer, messages[:1], add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_keeps_reasoning_of_earlier_turns(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "first thought"},
        {"role": "user", "content": "c"},
    ]
    assert "<think>\nfirst thought\n</think>\n\nb<|im_end|>" in render(tokenizer, messages)


def test_template_prefix_property(tokenizer: Any) -> None:
    """Rendering messages[:k] is a prefix of rendering messages[:k+j]: earlier turns never change later."""
    messages = [*CONVERSATION, {"role": "assistant", "content": "You're welcome."}]
    for tools in (None, TOOLS):
        renders = [render(tokenizer, messages[:k], tools=tools) for k in range(1, len(messages) + 1)]
        prompts = [
            render(tokenizer, messages[:k], tools=tools, add_generation_prompt=True)
            for k in range(1, len(messages) + 1)
        ]
        for k in range(1, len(messages) + 1):
            # A cut between two consecutive tool results splits their shared user turn (Qwen's format).
            if messages[k - 1]["role"] == "tool" and k < len(messages) and messages[k]["role"] == "tool":
                continue
            for j in range(k, len(messages) + 1):
                assert renders[j - 1].startswith(renders[k - 1]), (k, j)
            # A prompt that asks for the assistant turn is a prefix of the conversation that contains it.
            if k < len(messages) and messages[k]["role"] == "assistant":
                assert renders[k].startswith(prompts[k - 1]), k


def test_template_rejects_non_text_parts(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(Exception, match="only text content parts"):
        render(tokenizer, messages)


def logit_stats(model: Any, ids: Any) -> tuple[float, float, float]:
    """Mean over positions of: max next-token probability, entropy (nats), logit std."""
    with torch.no_grad():
        logits = model(ids).logits[0]
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    return probs.max(-1).values.mean().item(), entropy.mean().item(), logits.std(-1).mean().item()


def test_loads_and_logits_have_usable_range(model: Any, tokenizer: Any) -> None:
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    # Tied embeddings, like small Qwen3 models.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    messages = [{"role": "user", "content": "What is the weather?"}]
    prompt = render(tokenizer, messages, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    uniform = math.log(model.config.vocab_size)
    # Measured on seeds 0-2: max prob 0.019-0.032, entropy 7.11-7.17 of 7.62, logit std ~0.91. With the final
    # norm weight left at 1 it is 0.0013, 7.60 and 0.23: almost uniform, and LoRA training stalls.
    max_prob, entropy, std = logit_stats(model, ids)
    assert max_prob > 0.01
    assert entropy < uniform - 0.3
    assert std > 0.6
    assert torch.allclose(model.model.norm.weight, torch.full_like(model.model.norm.weight, 4.0))

    unscaled = copy.deepcopy(model)
    with torch.no_grad():
        unscaled.model.norm.weight.fill_(1.0)
    max_prob, entropy, std = logit_stats(unscaled, ids)
    assert max_prob < 0.005 and entropy > uniform - 0.1 and std < 0.4


def test_generate(model: Any, tokenizer: Any) -> None:
    prompt = render(tokenizer, [{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=8, do_sample=True, attention_mask=torch.ones_like(ids))
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 8
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    new = out[0, ids.shape[1] :].tolist()
    assert all(0 <= t < len(tokenizer) for t in new), new  # sampled from the tokenizer's ids, not the padding
    assert tokenizer.decode(new, skip_special_tokens=True).strip(), new  # seed 0 samples text
