"""`flint_jax.chat`: one assistant turn in the GLM-4.7 format (thinking and tool calls).

The checkpoint's chat template renders the conversation (`apply_chat_template` semantics); the
model generates until end-of-text, `<|user|>` or `<|observation|>`; the raw text (special tokens
kept) is parsed as vLLM's glm47 reasoning and tool parsers do (`chat_format.parse_assistant`).
With `stream=True` the same parse runs incrementally and yields deltas as tokens are decoded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from flint_jax import chat_format
from flint_jax.decode import generate
from flint_jax.decode import Flint


def render_prompt(model: Flint, messages: Sequence[Mapping], *, tools=None,
                  enable_thinking: bool = True) -> str:
    """The prompt text for the next assistant turn."""
    if model.tokenizer is None:
        raise ValueError("chat needs a tokenizer; this checkpoint has no tokenizer.json")
    return model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                               enable_thinking=enable_thinking)


class _RawText:
    """Incremental decode that keeps special tokens (the parser needs `<think>`, `<tool_call>`)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tok.decode(self.ids, skip_special_tokens=False)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the next token
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return delta


def chat(model: Flint, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
         enable_thinking: bool = True, stream: bool = False, max_new_tokens: int = 1024,
         **sampling):
    """Generates the assistant's reply to `messages`.

    Args:
      messages: OpenAI-style dicts with roles system / user / assistant / tool; an assistant
        message may carry `reasoning_content` and `tool_calls`; tool results are role "tool".
      tools: OpenAI-style function schemas (`{"type": "function", "function": {"name", ...,
        "parameters": {json schema}}}`); argument values are coerced to their schema types.
      enable_thinking: render the generation prompt with thinking on (`<think>`) or off.
      stream: yield deltas (`{"reasoning_content": str}`, `{"content": str}`,
        `{"tool_call": {"index", "id", "name"}}`, `{"tool_call": {"index", "arguments": str}}`,
        `{"error": ...}`) as tokens are decoded, then `{"finish_reason": ..., "stats": {...}}`
        (the call's timings, `GenerationStats.as_dict()`); `chat_format.assemble(deltas)`
        rebuilds the message.
      max_new_tokens: token budget (thinking counts); **sampling: as `generate` (temperature,
        top_k, top_p, min_p, repetition_penalty, seed, key).
    Returns: `{"role": "assistant", "reasoning_content": str | None, "content": str | None,
      "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}],
      "errors": [...], "finish_reason": "stop" | "length", "stats": {...}}` (stats: time to
      first token, prompt and generation tokens/s, compile time; `decode.GenerationStats`).
    """
    prompt = render_prompt(model, messages, tools=tools, enable_thinking=enable_thinking)
    ids = model.tokenizer.encode(prompt)
    stop_ids = model.tokenizer.stop_token_ids()
    events = generate(model, [ids], max_new_tokens=max_new_tokens, stream=True,
                      stop_token_ids=stop_ids, **sampling)
    if stream:
        return _stream(model, events, tools, enable_thinking, set(stop_ids))
    deltas = list(_stream(model, events, tools, enable_thinking, set(stop_ids)))
    end = next((d for d in deltas if "finish_reason" in d), {})
    message = chat_format.assemble([d for d in deltas if "finish_reason" not in d])
    message["finish_reason"] = end.get("finish_reason", "length")
    message["stats"] = end.get("stats")
    return message


def _stream(model, events, tools, thinking, stop_ids) -> Iterator[dict]:
    parser = chat_format.StreamingParser(tools=tools, thinking=thinking)
    raw = _RawText(model.tokenizer)
    finish = "length"
    for ev in events:
        if ev.token_id not in stop_ids:
            piece = raw.add(ev.token_id)
            if piece:
                yield from parser.feed(piece)
        if ev.finish_reason:
            finish = ev.finish_reason
    yield from parser.finish()
    stats = getattr(events, "stats", None)  # a GenerationStream's; None from other iterators
    yield {"finish_reason": finish, "stats": stats.as_dict() if stats is not None else None}

