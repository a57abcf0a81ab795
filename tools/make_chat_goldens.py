"""Renders chat-template cases with transformers' `apply_chat_template` -> tests/golden/chat_template_cases.json.

Run from the repository root with the oracle environment (transformers, jinja2; no jax needed):

    /tmp/venv311/bin/python tools/make_chat_goldens.py
    /tmp/venv311/bin/python tools/make_chat_goldens.py --reference path/to/GLM-4.7/chat_template.jinja

Two templates are rendered: flint_jax's `DEFAULT_CHAT_TEMPLATE` (a suite of GLM-4.7 conversations:
plain, system prompt, multi-turn with earlier reasoning, tools, typed tool calls, tool results,
thinking on/off, generation prompt on/off) and a small "probe" template that exercises transformers'
jinja environment (its `tojson` options, loop controls, `namespace`, `dict`, `{% generation %}`,
`raise_exception`, special-token variables, dropped None keys, reasoning aliases, documents,
`continue_final_message`). Each case stores its inputs and transformers' output (or its error).
`tests/test_chat_format.py` checks `render_chat_template` against every case.

`--reference` also renders every DEFAULT_CHAT_TEMPLATE case, plus a few hundred random
conversations, with the given real GLM-4.7 template and reports any difference (nothing is
written from it; the real template is not stored in the repository). The output is deterministic.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _load_chat_format():
    """flint_jax/chat_format.py by path: the package's __init__ imports jax, this module does not."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "flint_chat_format", os.path.join(ROOT, "flint_jax", "chat_format.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEFAULT_CHAT_TEMPLATE = _load_chat_format().DEFAULT_CHAT_TEMPLATE

OUT = os.path.join(ROOT, "tests", "golden", "chat_template_cases.json")


def make_tokenizer():
    """A minimal tokenizer with Flint's special-token map (eos = pad = <|endoftext|>, no bos)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city (°C, «quoted» & <tagged>).",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "number"}, "safe": {"type": "boolean"},
        "filters": {"type": "object"}, "sites": {"type": "array", "items": {"type": "string"}}}}}}
TOOLS = [WEATHER, SEARCH]

TYPED_CALL = {"type": "function", "function": {"name": "search", "arguments": {
    "query": "  multi\nline \"quoted\" 中文 ", "limit": 2.5, "safe": False, "nothing": None,
    "filters": {"lang": "fr", "nested": [1, 2.0, True, None, "é"]}, "sites": ["a.org", "b.net"],
    "count": 7}}}


def glm_cases() -> list[dict]:
    """The DEFAULT_CHAT_TEMPLATE suite."""
    user = {"role": "user", "content": "What's the weather in Paris?"}
    call_turn = {"role": "assistant", "reasoning_content": "\nI should call the tool.\n",
                 "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}
    cases = [
        dict(name="plain", messages=[{"role": "user", "content": "Hello!"}]),
        dict(name="plain_no_generation_prompt", messages=[{"role": "user", "content": "Hello!"}],
             add_generation_prompt=False),
        dict(name="thinking_on_explicit", messages=[{"role": "user", "content": "Hi"}],
             kwargs={"enable_thinking": True}),
        dict(name="thinking_off", messages=[{"role": "user", "content": "Hi"}],
             kwargs={"enable_thinking": False}),
        dict(name="system_prompt", messages=[
            {"role": "system", "content": "You are Flint, a careful assistant."},
            {"role": "user", "content": "Summarise: a b c"}]),
        dict(name="multi_turn_earlier_reasoning_dropped", messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]),
        dict(name="multi_turn_clear_thinking_false", messages=[
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "  4  "},
            {"role": "user", "content": "And 3+3?"}], kwargs={"clear_thinking": False}),
        dict(name="multi_turn_thinking_off", messages=[
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Simple.", "content": "4"},
            {"role": "user", "content": "3+3?"}], kwargs={"enable_thinking": False}),
        dict(name="inline_think_in_content_last_turn", messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello there!"}],
             add_generation_prompt=False),
        dict(name="inline_think_in_content_earlier_turn", messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>Greet back.</think>Hello there!"},
            {"role": "user", "content": "Bye"}]),
        dict(name="reasoning_alias_field", messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning": "Aliased reasoning.", "content": "Hello"}],
             add_generation_prompt=False),
        dict(name="whitespace_reasoning_and_empty_content", messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "   ", "content": "   "}],
             add_generation_prompt=False),
        dict(name="tools_given", messages=[user], tools=TOOLS),
        dict(name="tools_and_system", messages=[{"role": "system", "content": "Use tools."}, user],
             tools=[WEATHER]),
        dict(name="tool_call_and_result", messages=[
            user, call_turn, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21°C"}],
             tools=[WEATHER]),
        dict(name="tool_call_typed_arguments", messages=[
            {"role": "user", "content": "search"},
            {"role": "assistant", "content": "Searching now.", "tool_calls": [TYPED_CALL]},
            {"role": "tool", "content": "{\"results\": []}"}], tools=TOOLS),
        dict(name="tool_call_content_none", messages=[
            user, {"role": "assistant", "content": None, "tool_calls": [{
                "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "content": "Rain"}], tools=[WEATHER]),
        dict(name="several_calls_and_results", messages=[
            user,
            {"role": "assistant", "reasoning_content": "Two cities.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"name": "get_weather", "arguments": {"city": "Lyon", "days": 1}}]},
            {"role": "tool", "content": "Paris: sun"}, {"role": "tool", "content": "Lyon: rain"},
            {"role": "assistant", "reasoning_content": "Both known.", "content": "Sun in Paris, rain in Lyon."},
            {"role": "user", "content": "Thanks"}], tools=[WEATHER]),
        dict(name="tool_loop_reasoning_kept_no_prompt", messages=[
            user, call_turn, {"role": "tool", "content": "Sunny"},
            {"role": "assistant", "reasoning_content": "Answer now.", "content": "It is sunny."}],
             tools=[WEATHER], add_generation_prompt=False),
        dict(name="tool_call_thinking_off", messages=[
            user, {"role": "assistant", "content": "", "tool_calls": [{
                "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
            {"role": "tool", "content": "Sunny"}], tools=[WEATHER], kwargs={"enable_thinking": False}),
        dict(name="tool_result_list_content", messages=[
            user, call_turn, {"role": "tool", "content": [{"output": "first"}, "second"]}],
             tools=[WEATHER]),
        dict(name="content_parts", messages=[
            {"role": "system", "content": [{"type": "text", "text": "Sys "}, "part"]},
            {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image", "image": "x.png"},
                                         {"type": "text", "text": "what is it?"}]}]),
        dict(name="unicode_and_markup_in_content", messages=[
            {"role": "user", "content": "Écris «ceci» en 中文 & <b>gras</b>\n\n  indented"}]),
        dict(name="unknown_role_ignored", messages=[
            {"role": "developer", "content": "ignored by GLM"}, {"role": "user", "content": "Hi"}]),
    ]
    for case in cases:
        case.setdefault("tools", None)
        case.setdefault("add_generation_prompt", True)
        case.setdefault("kwargs", {})
        case["template"] = "default"
    return cases


PROBE_TEMPLATE = """\
{%- set ns = namespace(n=0, seen=[]) -%}
{%- for m in messages -%}
{%- if m.role == 'skip' %}{% continue %}{% endif -%}
{%- if m.role == 'stop' %}{% break %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
[{{ m.role }}|{{ m.content if m.content is defined else 'UNDEFINED' }}|{{ m.reasoning_content | default('-') }}|{{ m.thinking | default('-') }}]
{%- if m.role == 'assistant' %}{% generation %}<gen>{{ m.content }}</gen>{% endgeneration %}{% endif -%}
{%- if m.role == 'boom' %}{{ raise_exception('boom: ' ~ m.content) }}{% endif -%}
{%- endfor %}
n={{ ns.n }} bos={{ bos_token | default('NONE') }} eos={{ eos_token | default('NONE') }} pad={{ pad_token | default('NONE') }}
think={{ enable_thinking if enable_thinking is defined else 'UNDEF' }} gp={{ add_generation_prompt }}
{% if tools %}{% for t in tools %}{{ t | tojson }}
{{ t | tojson(indent=2) }}
{{ t | tojson(ensure_ascii=True, sort_keys=True) }}
{{ t | tojson(separators=(',', ':')) }}
{% endfor %}{% endif -%}
{%- if documents %}{% for d in documents %}<doc {{ d.title }}>{{ d.text }}</doc>{% endfor %}{% endif %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ extra_var | default('no-extra') }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


def probe_cases() -> list[dict]:
    tool = {"type": "function", "function": {"name": "f", "description": "é <x> & \"q\"",
                                             "parameters": {"type": "object", "properties": {}}}}
    base = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "reasoning": "why"}]
    cases = [
        dict(name="probe_basic", messages=base),
        dict(name="probe_tools_tojson", messages=base, tools=[tool]),
        dict(name="probe_loop_controls", messages=[
            {"role": "user", "content": "a"}, {"role": "skip", "content": "s"},
            {"role": "user", "content": "b"}, {"role": "stop", "content": "x"},
            {"role": "user", "content": "never"}]),
        dict(name="probe_none_keys_dropped", messages=[
            {"role": "user", "content": None}, {"role": "assistant", "content": "c", "thinking": "t"}]),
        dict(name="probe_thinking_and_extra", messages=base,
             kwargs={"enable_thinking": False, "extra_var": "yes"}),
        dict(name="probe_documents", messages=base,
             documents=[{"title": "T1", "text": "body 1"}, {"title": "T2", "text": "body 2"}]),
        dict(name="probe_no_generation_prompt", messages=base, add_generation_prompt=False),
        dict(name="probe_raise_exception", messages=[{"role": "boom", "content": "bad input"}]),
        dict(name="probe_continue_final_message", messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial ans"}],
             add_generation_prompt=False, continue_final_message=True),
    ]
    for case in cases:
        case.setdefault("tools", None)
        case.setdefault("documents", None)
        case.setdefault("add_generation_prompt", True)
        case.setdefault("kwargs", {})
        case["template"] = "probe"
    return cases


def render(tok, template: str, case: dict) -> dict:
    kwargs = dict(case.get("kwargs", {}))
    if case.get("documents") is not None:
        kwargs["documents"] = case["documents"]
    if case.get("continue_final_message"):
        kwargs["continue_final_message"] = case["continue_final_message"]
    try:
        text = tok.apply_chat_template(case["messages"], tools=case["tools"], chat_template=template,
                                       tokenize=False, add_generation_prompt=case["add_generation_prompt"],
                                       **kwargs)
    except Exception as e:  # recorded: the test expects the same error
        return {"error": type(e).__name__, "message": str(e)}
    return {"text": text}


def random_conversation(rng: random.Random) -> dict:
    """A random GLM conversation for the --reference comparison."""
    words = ["alpha", "  beta ", "\n", "中文", "é", "<b>", "x y", "", "</think>", "42"]

    def text():
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 4)))

    msgs = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": text()})
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": text() if rng.random() < 0.8 else
                     [{"type": "text", "text": text()}, text()]})
        for _ in range(rng.randint(0, 2)):
            a = {"role": "assistant", "content": text()}
            r = rng.random()
            if r < 0.4:
                a["reasoning_content"] = text()
            elif r < 0.6:
                a["content"] = "<think>" + text() + "</think>" + text()
            if rng.random() < 0.5:
                a["tool_calls"] = [{"type": "function", "function": {
                    "name": rng.choice(["get_weather", "search"]),
                    "arguments": {k: rng.choice([text(), 3, 2.5, True, None, [1, "a"], {"k": text()}])
                                  for k in rng.sample(["city", "days", "q", "opts"], rng.randint(0, 3))}}}
                    for _ in range(rng.randint(1, 2))]
                msgs.append(a)
                for _ in range(rng.randint(1, 2)):
                    msgs.append({"role": "tool", "content": text()})
            else:
                msgs.append(a)
    kwargs = {}
    if rng.random() < 0.3:
        kwargs["enable_thinking"] = rng.random() < 0.5
    if rng.random() < 0.2:
        kwargs["clear_thinking"] = False
    return dict(messages=msgs, tools=TOOLS if rng.random() < 0.5 else None,
                add_generation_prompt=rng.random() < 0.7, kwargs=kwargs)


def compare_with_reference(tok, reference: str, cases: list[dict]) -> int:
    rng = random.Random(0)
    extra = [random_conversation(rng) for _ in range(400)]
    bad = 0
    for i, case in enumerate(cases + extra):
        ours, real = render(tok, DEFAULT_CHAT_TEMPLATE, case), render(tok, reference, case)
        if ours != real:
            bad += 1
            print(f"DIFF in {case.get('name', f'random #{i}')}:\n  ours: {ours!r}\n  real: {real!r}")
    print(f"reference comparison: {len(cases) + len(extra) - bad}/{len(cases) + len(extra)} identical")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", help="a real GLM-4.7 chat_template.jinja to compare against")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()

    import transformers
    tok = make_tokenizer()
    glm, probe = glm_cases(), probe_cases()
    if args.reference:
        with open(args.reference) as f:
            sys.exit(1 if compare_with_reference(tok, f.read(), glm) else 0)
    for case in glm:
        case["expected"] = render(tok, DEFAULT_CHAT_TEMPLATE, case)
    for case in probe:
        case["expected"] = render(tok, PROBE_TEMPLATE, case)
    golden = {
        "generator": "tools/make_chat_goldens.py",
        "transformers_version": transformers.__version__,
        "default_template_sha256": hashlib.sha256(DEFAULT_CHAT_TEMPLATE.encode()).hexdigest(),
        "special_tokens": tok.special_tokens_map,
        "probe_template": PROBE_TEMPLATE,
        "cases": glm + probe,
    }
    with open(args.out, "w") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)  # key order is data (tools)
        f.write("\n")
    errors = sum("error" in c["expected"] for c in golden["cases"])
    print(f"wrote {args.out}: {len(golden['cases'])} cases ({errors} expected errors), "
          f"transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
