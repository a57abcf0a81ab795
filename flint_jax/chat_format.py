"""The GLM-4.7 chat format that Flint speaks: special tokens, built-in template, output parsers.

This module has no jax import (and imports jinja2 only when a template is rendered), so tools that
run in other environments (`tools/make_chat_goldens.py`) can import it.

Special tokens and stopping
---------------------------
`SPECIAL_TOKENS` lists the 17 GLM-4.7 control tokens. Generation stops at any of `STOP_TOKENS`
(`<|endoftext|>`, `<|user|>`, `<|observation|>`: GLM-4.7's `generation_config.json` eos ids, and
llama.cpp's extra GLM stop words): after a tool call the model hands the turn over with
`<|observation|>`, after an answer with `<|user|>` or end-of-text. Decode generated ids with
`skip_special_tokens=False` before parsing, or the `<think>` / `<tool_call>` markers are lost (vLLM's
parsers set the same flag in `adjust_request`).

Built-in template (`DEFAULT_CHAT_TEMPLATE`)
-------------------------------------------
For checkpoints without a chat template. It renders exactly what zai-org's GLM-4.7 /
GLM-4.7-Flash `chat_template.jinja` renders (checked against copies of both on the golden suite and
400 random conversations with `tools/make_chat_goldens.py --reference`):

* prefix `[gMASK]<sop>`; role tokens `<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>`
  with no newline after them and none between turns;
* with tools, a first system turn::

      <|system|>
      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {tool 1 as JSON}
      ...
      </tools>

      For each function call, output the function name and arguments within the following XML format:
      <tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>

  (each tool is the caller's dict, `tojson(ensure_ascii=False)`, one per line; the last line has
  no newline); a caller's system message is a separate `<|system|>` turn after it;
* message content may be a string or a list of `{"type": "text", "text": ...}` parts / strings;
* an assistant turn is `<|assistant|>` + reasoning + stripped content + tool calls. Its reasoning
  is `reasoning_content` (transformers also fills it from `reasoning` / `thinking`), else the part
  of the content before `</think>`. Reasoning is kept, as `<think>REASONING</think>`, only on
  assistant turns after the last user message (the current tool-calling loop) or everywhere when
  `clear_thinking=False`; other assistant turns get a bare `</think>` (earlier turns' reasoning is
  dropped, as the real template does);
* a tool call is `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, string
  values raw, other values `tojson(ensure_ascii=False)`; `arguments` must be a mapping (the real
  GLM-4.7-Flash rule: anything else renders no arguments; `render_chat_template` first parses JSON
  string arguments, as vLLM's chat_utils does);
* tool results: `<|observation|>` once per run of consecutive `tool` messages, each result wrapped
  in `<tool_response>...</tool_response>`; a list content renders one `<tool_response>` per item
  (its `output` when present);
* generation prompt: `<|assistant|><think>` when `enable_thinking` is true or undefined,
  `<|assistant|></think>` when it is false.

Parsing (`parse_assistant`, `StreamingParser`, `assemble`)
-----------------------------------------------------------
Follows vLLM's `glm47` parser (vllm `frontend/processing/parser/glm47_moe.py` on the
`parser_engine.py` state machine, which both `--reasoning-parser glm47` and
`--tool-call-parser glm47` use):

* with thinking on, the text starts inside reasoning; a `<think>` there is dropped; `</think>` ends
  reasoning; a `<tool_call>` also ends it; a later `<think>` in content starts reasoning again and a
  stray `</think>` in content is dropped. With thinking off, `<think>`/`</think>` are no markers
  and are dropped like the other special tokens (below);
* `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`: NAME is everything
  up to the first `<arg_key>` or `</tool_call>`, stripped; whitespace between a key and its value
  and between pairs is ignored; keys are stripped, values kept raw (string values are not stripped);
  a duplicate key keeps its first position and its last value (a JSON object's rule);
* values are coerced with the tool's JSON schema as vLLM's `coerce_to_schema_type` does: types from
  `type` (string or list), `enum` values and `anyOf`/`oneOf`/`allOf`, aliases (`int`, `float`,
  `bool`, `dict`, `list`, ...), tried in the order null, integer (`int()`), number (`float()`,
  finite, integral values become int), boolean (`true`/`1`, `false`/`0`), object / array
  (`json.loads`, plus, beyond vLLM's current code, the `ast.literal_eval` fallback of its older
  `Glm4MoeModelToolParser._deserialize`), string (raw); nothing fits: `json.loads` else the raw
  string. A key without a schema (no tools given, tool without that property) stays a raw string;
* tool names must be among `tools` when tools are given (vLLM's `validate_tool_names`); an unknown
  or empty name drops the call (vLLM drops it silently, its text goes nowhere; here the raw text is
  kept in the error record);
* text that ends inside a tool call closes the call (vLLM's `finish`); an unterminated argument
  value is kept as if closed;
* reasoning is `rstrip`ped, `None` when empty; content is stripped when there are tool calls, and
  `None` when empty; text before, between and after tool calls is all content;
* GLM control tokens that are not markers (`[gMASK]`, `<sop>`, role tokens, `<|endoftext|>`,
  `<tool_response>`, ...) are dropped wherever they appear, as vLLM's parser engine drops special
  tokens it has no rule for (all 17 GLM tokens are special in Flint's tokenizer).

Anything malformed is reported in the message's `errors` list (dicts with `type`, `message` and
details); parsing never raises. Types: `unknown_tool`, `empty_tool_name` (call dropped, `raw` holds
its text), `unterminated_tool_call` (closed at end of text), `unterminated_arg_value` (kept),
`unterminated_arg_key`, `missing_arg_value` (argument dropped), `stray_arg_text`,
`orphan_arg_value`, `stray_arg_tag` (ignored), `argument_type_mismatch` (the value fits none of the
schema's types; kept as coerced), and from `assemble` only, `invalid_arguments` (deltas that do not
form a JSON object, e.g. an incomplete delta list).

Known deviations from vLLM (all on malformed output, or deliberate):

* vLLM's non-streaming path drops content that follows the first tool call (it is "deferred" and
  never flushed); its streaming path delivers it. Here it is content in both.
* vLLM's streaming path numbers tool calls by every `<tool_call>` seen, so a dropped call leaves a
  gap in `index`; here indices count the accepted calls (0, 1, 2, ...).
* vLLM's non-streaming path drops an argument whose `</arg_value>` never came; its older streaming
  path keeps it, and so does this module (so that streaming can send long string values early).
* vLLM extracts pairs with the regex `<arg_key>(.*?)</arg_key>\\s*<arg_value>(.*?)</arg_value>`,
  whose lazy key group can swallow a following malformed pair; here a key that is not followed by
  `<arg_value>` is dropped with an error and parsing resumes at the next `<arg_key>`.
* Trailing reasoning whitespace is held back while streaming (as vLLM does); vLLM's streaming path
  throws it away when reasoning ends, so `a </think>x<think>b` streams reasoning "ab" there; here
  it is sent if reasoning resumes ("a b", what vLLM's non-streaming path gives).
* Tool call ids: vLLM's default `chatcmpl-tool-<uuid4 hex>`; pass `id_factory(index) -> str` for
  deterministic ids.

Streaming deltas are dicts with one key: `{"reasoning_content": str}`, `{"content": str}`,
`{"tool_call": {"index": i, "id": str, "name": str}}`, `{"tool_call": {"index": i, "arguments":
str}}` (pieces of the call's JSON arguments; their concatenation is a JSON object) or
`{"error": {...}}`. Text is sent as soon as it cannot be part of a marker; string argument values
whose final form is the raw string are streamed as they arrive, other values when their
`</arg_value>` comes. For any text and any way of cutting it into pieces,
`assemble(all deltas incl. finish()) == parse_assistant(text)` (with the same `id_factory`).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = [
    "SPECIAL_TOKENS", "STOP_TOKENS", "MARKER_TOKENS", "DEFAULT_CHAT_TEMPLATE", "stop_token_ids",
    "render_chat_template", "parse_assistant", "StreamingParser", "assemble",
]

# ---------------------------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------------------------

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
ARG_KEY_START, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE_START, ARG_VALUE_END = "<arg_value>", "</arg_value>"

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START,
    ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END, "<tool_response>", "</tool_response>",
)
"""The GLM-4.7 control tokens (Flint's tokenizer marks all of them special)."""

STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")
"""Generation stops at any of these (end of text, the user's turn, a tool result's turn)."""

MARKER_TOKENS: tuple[str, ...] = (
    THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END,
    ARG_VALUE_START, ARG_VALUE_END,
)
"""The tokens the output parser acts on (`<think>`/`</think>` only with thinking on)."""


def stop_token_ids(token_to_id: Callable[[str], int | None] | Mapping[str, int],
                   eos_token: str | None = None) -> list[int]:
    """Ids of `STOP_TOKENS` (and `eos_token`, first) that exist in a vocabulary.

    Args:
      token_to_id: a vocabulary dict or a `token -> id | None` function (`tokenizers`'
        `token_to_id`).
      eos_token: the tokenizer's eos token, if it has one.
    Returns:
      distinct ids, in order eos, `<|endoftext|>`, `<|user|>`, `<|observation|>`.
    """
    lookup = token_to_id.get if isinstance(token_to_id, Mapping) else token_to_id
    ids: list[int] = []
    for tok in ((eos_token,) if eos_token else ()) + STOP_TOKENS:
        tid = lookup(tok)
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    return ids


# ---------------------------------------------------------------------------------------------
# Built-in template
# ---------------------------------------------------------------------------------------------

# Written for flint_jax; renders what zai-org's GLM-4.7(-Flash) chat_template.jinja renders.
DEFAULT_CHAT_TEMPLATE = r"""{#- Flint built-in chat template: the GLM-4.7 chat format. -#}
{%- macro plain_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part is string -%}
                {{- part -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
    {%- for tool in tools -%}
        {{- tool | tojson(ensure_ascii=False) -}}{{- '\n' -}}
    {%- endfor -%}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n' -}}
    {{- '<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>' -}}
    {{- '<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}
{#- Reasoning is only replayed after the last user message (or always with clear_thinking=false). -#}
{%- set state = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
        {{- '<|system|>' -}}{{- plain_text(m.content) -}}
    {%- elif m.role == 'user' -%}
        {{- '<|user|>' -}}{{- plain_text(m.content) -}}
    {%- elif m.role == 'assistant' -%}
        {%- set text = plain_text(m.content) -%}
        {%- set thought = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set thought = m.reasoning_content -%}
        {%- elif '</think>' in text -%}
            {%- set thought = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|assistant|>' -}}
        {%- if thought and (loop.index0 > state.last_user or (clear_thinking is defined and not clear_thinking)) -%}
            {{- '<think>' + thought.strip() + '</think>' -}}
        {%- else -%}
            {{- '</think>' -}}
        {%- endif -%}
        {{- text.strip() -}}
        {%- for call in (m.tool_calls or []) -%}
            {%- set fn = call.function if call.function else call -%}
            {{- '<tool_call>' + fn.name -}}
            {%- set args = fn.arguments if fn.arguments is mapping else {} -%}
            {%- for key, value in args.items() -%}
                {{- '<arg_key>' -}}{{- key -}}{{- '</arg_key><arg_value>' -}}
                {%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson(ensure_ascii=False) -}}{%- endif -%}
                {{- '</arg_value>' -}}
            {%- endfor -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
    {%- elif m.role == 'tool' -%}
        {%- if m.content is string -%}
            {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
            {{- '<tool_response>' -}}{{- m.content -}}{{- '</tool_response>' -}}
        {%- else -%}
            {{- '<|observation|>' -}}
            {%- for result in m.content -%}
                {{- '<tool_response>' -}}{{- result.output if result.output is defined else result -}}{{- '</tool_response>' -}}
            {%- endfor -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' -}}{{- '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' -}}
{%- endif -%}
"""
"""The GLM-4.7 chat template for checkpoints without one (see the module docstring)."""


# ---------------------------------------------------------------------------------------------
# Rendering (transformers' apply_chat_template, utils/chat_template_utils.py)
# ---------------------------------------------------------------------------------------------

# transformers fills `reasoning_content` from these names (first non-None wins) and `thinking` too.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    """Compiles `template` in transformers' environment (cached, like transformers' compiler)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant
        # mask; for plain rendering it only renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, and json.dumps' options.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # `dict(...)` without access to the dict type itself.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Namespaces refuse underscore names (no way to reach CPython internals).
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def _plain_data(value: Any) -> Any:
    """transformers' `_plain_template_data`: rebuilds inputs from plain JSON-like types."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray" and hasattr(value, "item"):
        return _plain_data(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    import dataclasses
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """transformers' `_alias_reasoning_fields`: `reasoning_content`/`thinking` from any alias."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_arguments_as_dicts(messages: Sequence[Mapping]) -> list:
    """Parses JSON-string tool call arguments into dicts (vLLM chat_utils `_postprocess_messages`).

    Templates iterate `arguments.items()`; OpenAI clients send a JSON string. Missing or empty
    arguments become `{}`; a string that is not JSON is left alone.
    """
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            new_calls = []
            for call in calls:
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping):
                    args = fn.get("arguments")
                    if not args:
                        args = {}
                    elif isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except ValueError:
                            pass
                    call = {**call, "function": {**fn, "arguments": args}}
                new_calls.append(call)
            message = {**message, "tool_calls": new_calls}
        out.append(message)
    return out


def render_chat_template(template: str, messages: Sequence[Mapping], *,
                         tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = True,
                         enable_thinking: bool | None = True, bos_token: str | None = None,
                         eos_token: str | None = None, continue_final_message: bool | str = False,
                         documents: Sequence[Mapping] | None = None,
                         parse_tool_arguments: bool = True, **extra: Any) -> str:
    """Renders a chat like transformers' `apply_chat_template(..., tokenize=False)`.

    Same jinja environment as transformers 5 (`ImmutableSandboxedEnvironment`, `trim_blocks`,
    `lstrip_blocks`, loop controls, `{% generation %}`, its `tojson` filter, `raise_exception`,
    `strftime_now`, `dict`, `namespace`) and the same input handling (message keys whose value is
    None are dropped, inputs rebuilt from plain data, reasoning aliases filled in, template
    variables `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens and
    `**extra`).

    Args:
      template: jinja source.
      messages: OpenAI-style messages (`role`, `content`, `reasoning_content`, `tool_calls`, ...).
      tools: OpenAI-style tool schemas (dicts; transformers' callables are not accepted).
      add_generation_prompt: end with the assistant turn's header (default True, unlike
        transformers).
      enable_thinking: passed to the template; None leaves it undefined.
      bos_token, eos_token: special-token strings (transformers passes the tokenizer's named special
        tokens; pass others, e.g. `pad_token`, through `extra`). None leaves them undefined.
      continue_final_message: render the last message open-ended (True: its `content`; a field
        name: that field), as transformers does.
      documents: RAG documents (list of dicts), passed as `documents`.
      parse_tool_arguments: parse JSON-string tool call arguments into dicts first (vLLM does; a
        flint_jax addition to transformers' behaviour).
      **extra: more template variables (`clear_thinking`, `pad_token`, ...).
    Returns:
      the rendered prompt text.
    Raises:
      ValueError: empty chat, bad `continue_final_message` use; TypeError: a message, tool or
        document that is not a dict; jinja2.TemplateError: from the template.
    """
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. "
                         "Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    compiled = _compile_template(template)
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    if parse_tool_arguments:
        messages = _tool_arguments_as_dicts(messages)
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise TypeError(f"Tools should be JSON schema dicts, but got {tool!r}.")
        tools = list(tools)
    if documents is not None:
        for doc in documents:
            if not isinstance(doc, Mapping):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    kwargs: dict[str, Any] = {}
    if bos_token is not None:
        kwargs["bos_token"] = bos_token
    if eos_token is not None:
        kwargs["eos_token"] = eos_token
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    kwargs.update(extra)  # callers' variables override the special tokens, as in transformers
    tools = _plain_data(tools)
    documents = _plain_data(documents)
    kwargs = _plain_data(kwargs)
    chat = _alias_reasoning(_plain_data(chat))

    tag = "CONTINUE_FINAL_MESSAGE_TAG "
    final_message = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" '
                             "to continue!")
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_message]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an '
                             "accepted field in the chat_template")
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + tag
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to "
                                 "continue in the final message!")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + tag

    rendered = compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        if final_message.strip() not in rendered or tag.strip() not in rendered:
            raise ValueError("continue_final_message is set but the final message does not appear "
                             "in the chat after applying the chat template!")
        loc = rendered.rindex(tag.strip())
        if rendered[loc:loc + len(tag)] == tag:
            rendered = rendered[:loc]
        else:
            rendered = rendered[:loc].rstrip()
    return rendered


# ---------------------------------------------------------------------------------------------
# Argument coercion (vLLM tool_parsers/utils.py: extract_types_from_schema, coerce_to_schema_type)
# ---------------------------------------------------------------------------------------------

_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer",
    "uint32": "integer", "uint64": "integer", "long": "integer", "short": "integer",
    "unsigned": "integer", "float": "number", "float32": "number", "float64": "number",
    "double": "number", "bool": "boolean", "dict": "object", "arr": "array", "list": "array",
    "sequence": "array",
}


def _schema_types(schema: Any) -> set[str]:
    """The normalised JSON types a property schema allows (`{"string"}` when it says nothing)."""
    if not isinstance(schema, Mapping):
        return {"string"}
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for v in enum:
            types.add("null" if v is None else "boolean" if isinstance(v, bool) else
                      "integer" if isinstance(v, int) else "number" if isinstance(v, float) else
                      "string" if isinstance(v, str) else "array" if isinstance(v, list) else
                      "object" if isinstance(v, dict) else "string")
    for choice in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choice), list):
            for sub in schema[choice]:
                types.update(_schema_types(sub))
    if not types:
        return {"string"}
    return {_TYPE_ALIASES.get(x.strip().lower(), x.strip().lower()) for x in types}


def _json_finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (ValueError, TypeError):
        return False


def _literal_container(value: str, kind: type) -> Any:
    """`ast.literal_eval` fallback for Python-style `{'a': True}` / `['x']`; None when unusable."""
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    # Only values that survive a JSON round trip (no tuples, sets, bytes, non-string keys).
    if isinstance(parsed, kind) and _json_finite(parsed) and json.loads(json.dumps(parsed)) == parsed:
        return parsed
    return None


def _coerce(value: str, types: set[str]) -> Any:
    """vLLM's `coerce_to_schema_type` (+ a literal_eval fallback for objects and arrays)."""
    for candidate in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if candidate not in types:
            continue
        if candidate == "null":
            if value.lower() == "null":
                return None
        elif candidate == "string":
            return value
        elif candidate == "integer":
            try:
                return int(value)
            except ValueError:
                pass
        elif candidate == "number":
            try:
                f = float(value)
            except ValueError:
                continue
            if math.isfinite(f):
                return f if f != int(f) else int(f)
        elif candidate == "boolean":
            low = value.lower().strip()
            if low in ("true", "1"):
                return True
            if low in ("false", "0"):
                return False
        else:
            kind = dict if candidate == "object" else list
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = _literal_container(value, kind)
                if parsed is not None:
                    return parsed
            else:
                if _json_finite(parsed):
                    return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _json_finite(parsed) else value


def _fits(value: Any, types: set[str]) -> bool:
    """Whether a coerced value is one of the JSON types (for `argument_type_mismatch`)."""
    checks = {
        "null": lambda v: v is None,
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if not types <= checks.keys():
        return True  # a type we do not know: no complaint
    return any(checks[t](value) for t in types)


def _tool_index(tools: Iterable[Mapping] | None) -> dict[str, dict]:
    """name -> properties (first tool of a name wins, as vLLM's `find_tool_properties`)."""
    index: dict[str, dict] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = fn.get("name")
        if not isinstance(name, str) or name in index:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        index[name] = dict(props) if isinstance(props, Mapping) else {}
    return index


def _random_call_id(index: int) -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's make_tool_call_id(id_type="random")


# ---------------------------------------------------------------------------------------------
# The streaming parser (vLLM parser_engine semantics, see the module docstring)
# ---------------------------------------------------------------------------------------------

_REASONING, _CONTENT, _TOOL_NAME, _TOOL_ARGS, _TOOL_SKIP, _DONE = range(6)
# Argument sub-states inside _TOOL_ARGS.
_A_EXPECT, _A_KEY, _A_AFTER_KEY, _A_VALUE, _A_SKIP_VALUE = range(5)

_ARG_TAGS = (ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END)


class StreamingParser:
    """Incremental GLM-4.7 output parser: `feed` text pieces, then `finish` once.

    Args:
      tools: the request's OpenAI-style tool schemas (names are validated and arguments coerced
        against them); None or empty: any name, arguments stay strings.
      thinking: the prompt ended in `<think>` (the output starts inside reasoning).
      id_factory: `index -> id` for accepted tool calls (default: vLLM-style random ids).
    """

    def __init__(self, tools: Sequence[Mapping] | None = None, thinking: bool = True,
                 id_factory: Callable[[int], str] | None = None):
        self._tools = _tool_index(tools) if tools else None
        self._thinking = bool(thinking)
        self._id_factory = id_factory or _random_call_id
        markers = set(MARKER_TOKENS) - (set() if thinking else {THINK_START, THINK_END})
        # Special tokens without a rule are dropped (vLLM parser engine `_build_drop_info`).
        self._drop = tuple(t for t in SPECIAL_TOKENS if t not in markers)
        self._state = _REASONING if thinking else _CONTENT
        self._buf = ""          # text not yet consumed (a possible partial marker)
        self._out: list[dict] = []
        # reasoning / content whitespace handling (cosmetic; `assemble` normalises again)
        self._reasoning_ws = ""  # trailing whitespace of reasoning, held until more reasoning
        self._content_ws = ""    # leading whitespace-only content, held until real content
        self._content_seen = False
        self._n_calls = 0        # accepted tool calls
        self._reset_call()

    # -- public ---------------------------------------------------------------------------------
    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside a reasoning block."""
        return self._state == _REASONING

    def feed(self, text: str) -> list[dict]:
        """Consumes a piece of generated text; returns the deltas it makes safe to send."""
        if self._state == _DONE:
            raise RuntimeError("StreamingParser.feed after finish()")
        self._buf += text
        self._consume(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        """Ends the text: flushes held text, closes an open tool call; returns the last deltas."""
        if self._state == _DONE:
            return []
        self._consume(final=True)
        if self._state in (_TOOL_NAME, _TOOL_ARGS, _TOOL_SKIP):
            self._end_call(terminated=False)
        if self._content_ws and self._n_calls == 0:
            self._emit("content", self._content_ws)  # whitespace-only content, no tool calls
        self._content_ws = self._reasoning_ws = ""
        self._state = _DONE
        return self._take()

    # -- lexing ---------------------------------------------------------------------------------
    def _active(self) -> tuple[str, ...]:
        """Markers that mean something in the current state; all others are plain text here."""
        s = self._state
        if s in (_REASONING, _CONTENT):
            m = (THINK_START, THINK_END, TOOL_CALL_START) if self._thinking else (TOOL_CALL_START,)
        elif s == _TOOL_NAME:
            m = (ARG_KEY_START, TOOL_CALL_END)
        elif s == _TOOL_SKIP:
            m = (TOOL_CALL_END,)
        elif self._arg_state in (_A_EXPECT, _A_AFTER_KEY):
            m = _ARG_TAGS + (TOOL_CALL_END,)
        elif self._arg_state == _A_KEY:
            m = (ARG_KEY_END, TOOL_CALL_END)
        else:  # inside a value, every tag but its end is value text (vLLM's lazy `(.*?)</arg_value>`)
            m = (ARG_VALUE_END, TOOL_CALL_END)
        return m + self._drop

    def _consume(self, final: bool) -> None:
        buf, pos = self._buf, 0
        while pos < len(buf):
            active = self._active()
            hit, marker = len(buf), None
            for m in active:  # earliest complete marker
                i = buf.find(m, pos, hit + len(m) - 1)
                if i != -1 and i < hit:
                    hit, marker = i, m
            hold = hit
            if not final:  # earliest tail that could still grow into a marker
                longest = max(len(m) for m in active)
                for i in range(max(pos, len(buf) - longest + 1), hit):
                    tail = buf[i:]
                    if any(len(m) > len(tail) and m.startswith(tail) for m in active):
                        hold = i
                        break
            if hold > pos:
                self._text(buf[pos:hold])
            if marker is None or hold < hit:
                pos = hold
                break
            pos = hit + len(marker)
            self._marker(marker)
        self._buf = buf[pos:]

    # -- events ---------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        s = self._state
        if s == _REASONING:
            self._reasoning(text)
        elif s == _CONTENT:
            self._content(text)
        elif s == _TOOL_NAME:
            self._raw += text
            self._name += text
        elif s == _TOOL_SKIP:
            self._raw += text
        else:
            self._arg_text(text)

    def _marker(self, m: str) -> None:
        if m in self._drop:
            return
        s = self._state
        if s in (_REASONING, _CONTENT):
            if m == TOOL_CALL_START:
                self._state = _TOOL_NAME
                self._raw = m
            elif m == THINK_END:
                self._state = _CONTENT  # (a stray one in content is dropped)
            elif m == THINK_START:
                self._state = _REASONING  # (a repeated one in reasoning is dropped)
            return
        self._raw += m
        if m == TOOL_CALL_END:
            if s == _TOOL_NAME:
                self._end_name()
            self._end_call(terminated=True)
        elif s == _TOOL_NAME:  # <arg_key>
            self._end_name()
            if self._state == _TOOL_ARGS:
                self._arg_marker(m)
        else:
            self._arg_marker(m)

    # -- reasoning and content ------------------------------------------------------------------
    def _reasoning(self, text: str) -> None:
        text = self._reasoning_ws + text
        body = text.rstrip()
        self._reasoning_ws = text[len(body):]
        if body:
            self._emit("reasoning_content", body)

    def _content(self, text: str) -> None:
        if self._content_seen:
            self._emit("content", text)
            return
        text = self._content_ws + text
        if not text.strip():
            self._content_ws = text
            return
        self._content_seen, self._content_ws = True, ""
        # With a tool call already made, the final content is stripped: leading whitespace goes.
        self._emit("content", text.lstrip() if self._n_calls else text)

    # -- tool calls -----------------------------------------------------------------------------
    def _reset_call(self) -> None:
        self._raw = ""          # raw text of the current call (for the error of a dropped call)
        self._name = ""
        self._index = -1
        self._props: dict | None = None
        self._arg_state = _A_EXPECT
        self._key = ""
        self._value = ""
        self._gap = ""          # text between </arg_key> and <arg_value>, or stray text
        self._streaming_value = False
        self._args_open = False

    def _end_name(self) -> None:
        name = self._name.strip()
        if not name:
            self._drop_reason = ("empty_tool_name", "tool call without a name dropped")
        elif self._tools is not None and name not in self._tools:
            self._drop_reason = ("unknown_tool", f"tool call to unknown tool {name!r} dropped "
                                 "(not among the request's tools; vLLM drops it the same way)")
        else:
            self._drop_reason = None
        self._name = name
        if self._drop_reason:
            self._state = _TOOL_SKIP
            return
        self._state = _TOOL_ARGS
        self._index = self._n_calls
        self._n_calls += 1
        self._props = self._tools.get(name, {}) if self._tools is not None else {}
        if not self._content_seen:
            self._content_ws = ""  # whitespace-only content before a tool call is dropped
        self._emit_call({"index": self._index, "id": self._id_factory(self._index), "name": name})

    def _end_call(self, terminated: bool) -> None:
        if self._state == _TOOL_NAME:
            self._end_name()
        if self._state == _TOOL_SKIP:
            kind, message = self._drop_reason
            err = {"type": kind, "message": message, "raw": self._raw}
            if kind == "unknown_tool":
                err["name"] = self._name
            self._error(err)
            if not terminated:
                self._error({"type": "unterminated_tool_call", "name": self._name,
                             "message": "text ended inside a tool call"})
        else:
            a = self._arg_state
            if a == _A_EXPECT:
                self._flush_stray()
            elif a == _A_KEY:
                self._arg_error("unterminated_arg_key", "argument key without </arg_key> dropped",
                                key=self._key.strip())
            elif a == _A_AFTER_KEY:
                self._arg_error("missing_arg_value", "argument key without a value dropped",
                                key=self._key.strip())
            elif a == _A_VALUE:
                self._arg_error("unterminated_arg_value",
                                "argument value without </arg_value> kept as if closed",
                                key=self._key.strip())
                self._end_value()
            self._args("}" if self._args_open else "{}")
            if not terminated:
                self._error({"type": "unterminated_tool_call", "index": self._index,
                             "name": self._name, "message": "text ended inside a tool call; "
                             "it is closed there (as vLLM does)"})
        self._state = _CONTENT
        self._reset_call()

    # -- arguments ------------------------------------------------------------------------------
    def _arg_text(self, text: str) -> None:
        a = self._arg_state
        if a == _A_KEY:
            self._key += text
        elif a == _A_VALUE:
            self._value += text
            if self._streaming_value:
                self._args(json.dumps(text, ensure_ascii=False)[1:-1])
        elif a == _A_EXPECT:
            self._gap += text
        elif a == _A_AFTER_KEY:
            self._gap += text
            if self._gap.strip():  # something other than whitespace before <arg_value>
                self._arg_error("missing_arg_value", "argument key without a value dropped",
                                key=self._key.strip())
                self._arg_state = _A_EXPECT  # the text is stray text now
        # _A_SKIP_VALUE: ignored

    def _arg_marker(self, m: str) -> None:
        a = self._arg_state
        if a == _A_AFTER_KEY:
            if m == ARG_VALUE_START:
                self._start_value()
                return
            self._arg_error("missing_arg_value", "argument key without a value dropped",
                            key=self._key.strip())
            self._arg_state, self._gap = _A_EXPECT, ""
            a = _A_EXPECT
        if a == _A_EXPECT:
            self._flush_stray()
            if m == ARG_KEY_START:
                self._arg_state, self._key = _A_KEY, ""
            elif m == ARG_VALUE_START:
                self._arg_error("orphan_arg_value", "argument value without a key ignored")
                self._arg_state = _A_SKIP_VALUE
            else:
                self._arg_error("stray_arg_tag", f"stray {m} ignored", tag=m)
        elif a == _A_KEY:  # </arg_key>
            self._arg_state, self._gap = _A_AFTER_KEY, ""
        elif a == _A_VALUE:  # </arg_value>
            self._end_value()
            self._arg_state = _A_EXPECT
        else:  # _A_SKIP_VALUE, </arg_value>
            self._arg_state = _A_EXPECT

    def _flush_stray(self) -> None:
        if self._gap.strip():
            self._arg_error("stray_arg_text", "text outside <arg_key>/<arg_value> ignored",
                            text=self._gap.strip())
        self._gap = ""

    def _schema_types(self, key: str) -> set[str] | None:
        """The key's schema types; None when it has no schema (the value stays a raw string)."""
        prop = self._props.get(key) if self._props else None
        return _schema_types(prop) if isinstance(prop, Mapping) else None

    def _start_value(self) -> None:
        self._arg_state, self._value, self._gap = _A_VALUE, "", ""
        key = self._key.strip()
        types = self._schema_types(key)
        # Values that stay raw strings can be streamed as they arrive (no coercion can change them).
        self._streaming_value = types is None or types == {"string"}
        if self._streaming_value:
            self._args(("{" if not self._args_open else ", ")
                       + json.dumps(key, ensure_ascii=False) + ': "')
            self._args_open = True

    def _end_value(self) -> None:
        key = self._key.strip()
        if self._streaming_value:
            self._args('"')
        else:
            types = self._schema_types(key)
            value = _coerce(self._value, types)
            if not _fits(value, types):
                self._arg_error("argument_type_mismatch", f"value of {key!r} fits none of the "
                                f"schema types {sorted(types)}; kept as {value!r}", key=key)
            self._args(("{" if not self._args_open else ", ") + json.dumps(key, ensure_ascii=False)
                       + ": " + json.dumps(value, ensure_ascii=False))
            self._args_open = True
        self._streaming_value = False

    # -- output ---------------------------------------------------------------------------------
    def _emit(self, field: str, text: str) -> None:
        if self._out and field in self._out[-1]:  # coalesce with the previous delta
            self._out[-1][field] += text
        else:
            self._out.append({field: text})

    def _emit_call(self, call: dict) -> None:
        self._out.append({"tool_call": call})

    def _args(self, text: str) -> None:
        last = self._out[-1].get("tool_call") if self._out else None
        if last is not None and last["index"] == self._index and "arguments" in last:
            last["arguments"] += text
        else:
            self._out.append({"tool_call": {"index": self._index, "arguments": text}})

    def _error(self, err: dict) -> None:
        self._out.append({"error": err})

    def _arg_error(self, kind: str, message: str, **details: Any) -> None:
        self._error({"type": kind, "index": self._index, "name": self._name, **details,
                     "message": message})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


def assemble(deltas: Iterable[Mapping]) -> dict:
    """Rebuilds the assistant message from all of a `StreamingParser`'s deltas (incl. `finish`).

    Returns:
      `{"role": "assistant", "reasoning_content": str | None, "content": str | None,
      "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}],
      "errors": [dict]}`, normalised as vLLM normalises (reasoning rstripped, content stripped when
      there are tool calls, empty strings become None).
    """
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict] = {}
    errors: list[dict] = []
    for delta in deltas:
        if "reasoning_content" in delta:
            reasoning.append(delta["reasoning_content"])
        if "content" in delta:
            content.append(delta["content"])
        if "error" in delta:
            errors.append(dict(delta["error"]))
        call = delta.get("tool_call")
        if call is not None:
            slot = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": []})
            if "id" in call:
                slot["id"] = call["id"]
            if "name" in call:
                slot["name"] = call["name"]
            if "arguments" in call:
                slot["arguments"].append(call["arguments"])
    tool_calls = []
    for index in sorted(calls):
        slot = calls[index]
        text = "".join(slot["arguments"])
        try:
            arguments = json.loads(text)
        except ValueError:
            arguments = None
            errors.append({"type": "invalid_arguments", "index": index, "name": slot["name"],
                           "message": "argument deltas do not form a JSON object", "text": text})
        tool_calls.append({"id": slot["id"], "type": "function",
                           "function": {"name": slot["name"], "arguments": arguments}})
    text = "".join(content)
    if tool_calls:
        text = text.strip()
    return {"role": "assistant", "reasoning_content": "".join(reasoning).rstrip() or None,
            "content": text or None, "tool_calls": tool_calls, "errors": errors}


def parse_assistant(text: str, *, tools: Sequence[Mapping] | None = None, thinking: bool = True,
                    id_factory: Callable[[int], str] | None = None) -> dict:
    """Parses a whole generated assistant turn (the text after the generation prompt).

    Args:
      text: generated text, decoded with special tokens kept.
      tools: the request's tool schemas (see `StreamingParser`).
      thinking: the prompt ended in `<think>` (thinking on).
      id_factory: `index -> id` for tool calls (default `chatcmpl-tool-<random hex>`).
    Returns:
      the message dict described in `assemble`.
    """
    parser = StreamingParser(tools=tools, thinking=thinking, id_factory=id_factory)
    return assemble(parser.feed(text) + parser.finish())
