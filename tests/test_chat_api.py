"""flint_jax.chat: template -> generate -> GLM-4.7 parse, whole and streamed, multi-turn."""

import numpy as np
import pytest

import flint_jax
from flint_jax import chat_api, chat_format
from flint_jax.decode import StreamEvent

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def demo():
    from flint_jax.demo import demo_model
    return demo_model(kernels="xla")


def scripted(model, text, finish="stop"):
    """A stand-in for generate(stream=True) that 'generates' the tokens of `text`."""
    ids = model.tokenizer.encode(text)

    def fake_generate(m, rows, **kw):
        assert kw["stream"] and set(kw["stop_token_ids"]) == set(m.tokenizer.stop_token_ids())
        for i, t in enumerate(ids):
            yield StreamEvent(0, t, "", 0.0, finish if i == len(ids) - 1 else None)
    return fake_generate


def test_tool_call_is_parsed_from_generated_tokens(demo, monkeypatch):
    text = "I should look it up.</think><tool_call>get_weather<arg_key>city</arg_key>" \
           "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    monkeypatch.setattr(chat_api, "generate", scripted(demo, text + "<|observation|>"))
    msg = flint_jax.chat(demo, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    assert msg["reasoning_content"] == "I should look it up."
    call = msg["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    assert msg["finish_reason"] == "stop" and not msg["errors"]
    # The streamed deltas rebuild the same message.
    deltas = [d for d in flint_jax.chat(demo, [{"role": "user", "content": "x"}], tools=TOOLS,
                                        stream=True) if "finish_reason" not in d]
    streamed = chat_format.assemble(deltas)
    assert streamed["tool_calls"][0]["function"] == call


def test_multi_turn_with_tool_results_renders_observation(demo):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "look up", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ]
    prompt = chat_api.render_prompt(demo, messages, tools=TOOLS)
    assert "<|observation|><tool_response>" in prompt and "{\"temp\": 21}" in prompt
    assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" in prompt
    assert prompt.endswith("<|assistant|><think>")
    off = chat_api.render_prompt(demo, messages, tools=TOOLS, enable_thinking=False)
    assert off.endswith("<|assistant|></think>")
    msg = flint_jax.chat(demo, messages, tools=TOOLS, max_new_tokens=5, seed=0)
    assert msg["role"] == "assistant" and msg["finish_reason"] in ("stop", "length")
    st = msg["stats"]   # the call's timings (decode.GenerationStats.as_dict())
    assert 1 <= st["generated_tokens"] <= 5 and st["ttft_s"] > 0 and st["prompt_tokens"] > 10


def test_real_generation_stream_equals_whole(demo):
    kw = dict(max_new_tokens=12, temperature=0.8, seed=5)
    msgs = [{"role": "user", "content": "hello"}]
    whole = flint_jax.chat(demo, msgs, **kw)
    deltas = [d for d in flint_jax.chat(demo, msgs, stream=True, **kw) if "finish_reason" not in d]
    rebuilt = chat_format.assemble(deltas)
    for k in ("reasoning_content", "content"):
        assert rebuilt[k] == whole[k]
