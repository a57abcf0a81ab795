"""flint_jax.chat_format: template rendering vs transformers goldens, GLM-4.7 output parsing, streaming.

Rendering goldens come from `tools/make_chat_goldens.py` (transformers 5 `apply_chat_template`). The
parser expectations follow vLLM's glm47 parser (vllm/frontend/processing/parser/glm47_moe.py on
parser/engine/parser_engine.py and streaming_parser_engine.py; coercion from
tool_parsers/utils.py `coerce_to_schema_type`); comments name the vLLM function a rule follows.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    # By path: flint_jax/__init__ imports jax, chat_format must not need it.
    spec = importlib.util.spec_from_file_location(
        "flint_chat_format_under_test", os.path.join(ROOT, "flint_jax", "chat_format.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cf = _load()
GOLDEN = os.path.join(ROOT, "tests", "golden", "chat_template_cases.json")


def ids(i: int) -> str:
    return f"call_{i}"


def parse(text, tools=None, thinking=True):
    return cf.parse_assistant(text, tools=tools, thinking=thinking, id_factory=ids)


def stream(pieces, tools=None, thinking=True):
    """All deltas of a StreamingParser fed `pieces`, then finished."""
    p = cf.StreamingParser(tools=tools, thinking=thinking, id_factory=ids)
    out = []
    for piece in pieces:
        out += p.feed(piece)
    return out + p.finish()


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

with open(GOLDEN) as f:
    GOLDENS = json.load(f)


def test_goldens_match_current_template():
    sha = hashlib.sha256(cf.DEFAULT_CHAT_TEMPLATE.encode()).hexdigest()
    assert GOLDENS["default_template_sha256"] == sha, (
        "DEFAULT_CHAT_TEMPLATE changed: rerun /tmp/venv311/bin/python tools/make_chat_goldens.py")


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=lambda c: c["name"])
def test_render_matches_transformers(case):
    import jinja2
    template = cf.DEFAULT_CHAT_TEMPLATE if case["template"] == "default" else GOLDENS["probe_template"]
    kwargs = dict(case["kwargs"])
    special = dict(GOLDENS["special_tokens"])
    call = lambda: cf.render_chat_template(  # noqa: E731
        template, case["messages"], tools=case["tools"], documents=case.get("documents"),
        add_generation_prompt=case["add_generation_prompt"],
        continue_final_message=case.get("continue_final_message", False),
        enable_thinking=kwargs.pop("enable_thinking", None),  # None: undefined, as in transformers
        bos_token=special.pop("bos_token", None), eos_token=special.pop("eos_token", None),
        **special, **kwargs)
    expected = case["expected"]
    if "error" in expected:
        with pytest.raises(jinja2.TemplateError, match=re.escape(expected["message"])):
            call()
    else:
        assert call() == expected["text"]


def test_render_defaults_and_generation_prompt():
    msgs = [{"role": "user", "content": "Hi"}]
    t = cf.DEFAULT_CHAT_TEMPLATE
    assert cf.render_chat_template(t, msgs) == "[gMASK]<sop><|user|>Hi<|assistant|><think>"
    assert cf.render_chat_template(t, msgs, enable_thinking=False).endswith("<|assistant|></think>")
    assert cf.render_chat_template(t, msgs, add_generation_prompt=False) == "[gMASK]<sop><|user|>Hi"


def test_render_json_string_arguments_like_dicts():
    # vLLM chat_utils._postprocess_messages parses OpenAI's JSON-string arguments before rendering.
    def convo(args):
        return [{"role": "user", "content": "w"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]
    as_dict = cf.render_chat_template(cf.DEFAULT_CHAT_TEMPLATE, convo({"a": 1, "b": "x"}))
    as_str = convo(json.dumps({"a": 1, "b": "x"}))
    assert cf.render_chat_template(cf.DEFAULT_CHAT_TEMPLATE, as_str) == as_dict
    assert "<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>x</arg_value>" in as_dict
    assert as_str[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": "x"}'  # not mutated
    # the real GLM-4.7-Flash rule for non-mapping arguments: no arguments rendered
    raw = cf.render_chat_template(cf.DEFAULT_CHAT_TEMPLATE, as_str, parse_tool_arguments=False)
    assert "<tool_call>f</tool_call>" in raw


def test_render_environment_guards():
    import jinja2
    t = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        cf.render_chat_template(t, [{"role": "user", "content": "x"}])
    year = cf.render_chat_template("{{ strftime_now('%Y') }}", [{"role": "user", "content": "x"}])
    assert re.fullmatch(r"\d{4}", year)
    with pytest.raises(ValueError):
        cf.render_chat_template(cf.DEFAULT_CHAT_TEMPLATE, [])
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox
        cf.render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])


def test_special_and_stop_tokens():
    assert len(cf.SPECIAL_TOKENS) == 17 and len(set(cf.SPECIAL_TOKENS)) == 17
    with open(os.path.join(ROOT, "tests", "golden", "tiny_a", "tokenizer.json")) as f:
        added = [t["content"] for t in json.load(f)["added_tokens"]]
    assert set(cf.SPECIAL_TOKENS) == set(added)  # Flint's tokenizer has exactly these
    vocab = {t: i for i, t in enumerate(added, start=360)}
    assert cf.stop_token_ids(vocab) == [360, 364, 366]  # tiny_a's generation_config eos ids
    assert cf.stop_token_ids(vocab.get, eos_token="<|user|>") == [364, 360, 366]
    assert cf.stop_token_ids({}) == []


# ---------------------------------------------------------------------------------------------
# parse_assistant
# ---------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
SINK = {"name": "sink", "parameters": {"type": "object", "properties": {  # bare (Responses) form
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
    "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
    "z": {"type": ["string", "null"]}, "e": {"enum": [1, 2, 3]},
    "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "f": {"type": "float"},
    "nothing": {}}}}


def call(name, arguments, index=0):
    return {"id": ids(index), "type": "function", "function": {"name": name, "arguments": arguments}}


def msg(reasoning=None, content=None, tool_calls=(), errors=()):
    return {"role": "assistant", "reasoning_content": reasoning, "content": content,
            "tool_calls": list(tool_calls), "errors": list(errors)}


def err_types(m):
    return [e["type"] for e in m["errors"]]


# (name, text, tools, thinking, expected message or a check function)
CASES = [
    # -- reasoning / content split (parser_engine: initial state REASONING with thinking on) --
    ("plain_thinking_off", "Hello there.", None, False, msg(content="Hello there.")),
    ("no_end_is_all_reasoning", "Still thinking", None, True, msg(reasoning="Still thinking")),
    ("reasoning_then_content", "Let me think.\n</think>\n\nThe answer is 4.", None, True,
     msg(reasoning="Let me think.", content="\n\nThe answer is 4.")),  # content not stripped w/o tools
    ("leading_think_tolerated", "<think>Plan.</think>Done.", None, True,
     msg(reasoning="Plan.", content="Done.")),
    ("empty_reasoning", "</think>Answer", None, True, msg(content="Answer")),
    ("whitespace_reasoning_is_none", "  \n</think>Answer", None, True, msg(content="Answer")),
    ("reasoning_leading_ws_kept", "\nI think.  </think>x", None, True,
     msg(reasoning="\nI think.", content="x")),  # _strip_trailing_reasoning: rstrip only
    ("think_reentry", "a </think>x<think>b</think>y", None, True, msg(reasoning="a b", content="xy")),
    ("stray_end_think_in_content", "r</think>x</think>y", None, True, msg(reasoning="r", content="xy")),
    ("thinking_off_think_tags_dropped", "<think>r</think>c", None, False, msg(content="rc")),
    ("empty_text_thinking", "", None, True, msg()),
    ("empty_text_no_thinking", "", None, False, msg()),
    ("whitespace_only_content_kept", "  \n", None, False, msg(content="  \n")),
    ("control_tokens_dropped", "Ans<|user|>wer<|endoftext|>", None, False, msg(content="Answer")),
    ("partial_looking_text", "a < b, <tool and </thin <arg_key", None, False,
     msg(content="a < b, <tool and </thin <arg_key")),
    ("arg_tags_in_content_are_text", "x<arg_key>k</arg_key>", None, False,
     msg(content="x<arg_key>k</arg_key>")),
    ("tool_end_in_content_is_text", "x</tool_call>y", None, False, msg(content="x</tool_call>y")),
    # -- tool calls (glm47_moe.py transitions; arguments by _glm47_arg_converter) --
    ("tool_call_ends_reasoning",
     "I need the weather.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>", [WEATHER], True,
     msg(reasoning="I need the weather.", tool_calls=[call("get_weather", {"city": "Paris", "days": 3})])),
    ("content_then_call_stripped",
     "r</think>\n Let me check. \n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
     "</arg_value></tool_call><|observation|>", [WEATHER], True,
     msg(reasoning="r", content="Let me check.", tool_calls=[call("get_weather", {"city": "Rome"})])),
    ("ws_content_around_call_is_none",
     "r</think>\n\n<tool_call>get_time</tool_call>\n", [TIME], True,
     msg(reasoning="r", tool_calls=[call("get_time", {})])),
    ("several_calls",
     "Checking both.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "</tool_call>\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value>"
     "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>", [WEATHER], False,
     msg(content="Checking both.", tool_calls=[call("get_weather", {"city": "Paris"}),
                                               call("get_weather", {"city": "Lyon", "days": 2}, 1)])),
    ("newline_style_glm45",  # name ends at "\n", whitespace between tags ignored (glm47 `\s*`)
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value> 3 </arg_value>\n</tool_call>", [WEATHER], False,
     msg(tool_calls=[call("get_weather", {"city": "Paris", "days": 3})])),
    ("no_arguments", "<tool_call>get_time</tool_call>", [TIME], False,
     msg(tool_calls=[call("get_time", {})])),
    ("tool_without_parameters_keeps_strings",
     "<tool_call>get_time<arg_key>tz</arg_key><arg_value>5</arg_value></tool_call>", [TIME], False,
     msg(tool_calls=[call("get_time", {"tz": "5"})])),
    ("no_tools_any_name_raw_strings",  # no schema: no coercion (parser_engine._fix_arg_types)
     "<tool_call>anything<arg_key> k </arg_key><arg_value>  42  </arg_value></tool_call>", None, False,
     msg(tool_calls=[call("anything", {"k": "  42  "})])),
    ("content_after_call_kept", "A<tool_call>get_time</tool_call>B", [TIME], False,
     msg(content="AB", tool_calls=[call("get_time", {})])),
    ("string_value_escapes",
     "<tool_call>f<arg_key>code</arg_key><arg_value>print(\"a\\\\b\")\n\t中文 \x01 </arg_value>"
     "</tool_call>", None, False,
     msg(tool_calls=[call("f", {"code": "print(\"a\\\\b\")\n\t中文 \x01 "})])),
    ("duplicate_key_last_value_wins",
     "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>x"
     "</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>", None, False,
     msg(tool_calls=[call("f", {"a": "2", "b": "x"})])),
    ("tags_inside_value_are_text",  # vLLM's lazy `<arg_value>(.*?)</arg_value>`
     "<tool_call>f<arg_key>k</arg_key><arg_value>x<arg_key>y<think>z</think><tool_call></arg_value>"
     "</tool_call>", None, True, msg(tool_calls=[call("f", {"k": "x<arg_key>y<think>z</think><tool_call>"})])),
    ("control_token_inside_value_dropped",
     "<tool_call>f<arg_key>k</arg_key><arg_value>a<|user|>b</arg_value></tool_call>", None, False,
     msg(tool_calls=[call("f", {"k": "ab"})])),
    ("typed_arguments",
     "<tool_call>sink<arg_key>s</arg_key><arg_value>  keep  spaces\n</arg_value>"
     "<arg_key>i</arg_key><arg_value> 42 </arg_value><arg_key>n</arg_key><arg_value>2.5</arg_value>"
     "<arg_key>f</arg_key><arg_value>3.0</arg_value><arg_key>b</arg_key><arg_value>true</arg_value>"
     "<arg_key>o</arg_key><arg_value>{\"a\": [1, \"é\"], \"t\": null}</arg_value>"
     "<arg_key>a</arg_key><arg_value>[1, \"x\", false]</arg_value>"
     "<arg_key>z</arg_key><arg_value>null</arg_value><arg_key>e</arg_key><arg_value>2</arg_value>"
     "<arg_key>u</arg_key><arg_value>abc</arg_value><arg_key>nothing</arg_key><arg_value>7</arg_value>"
     "<arg_key>extra</arg_key><arg_value>5</arg_value></tool_call>", [SINK], False,
     msg(tool_calls=[call("sink", {
         "s": "  keep  spaces\n", "i": 42, "n": 2.5, "f": 3, "b": True, "o": {"a": [1, "é"], "t": None},
         "a": [1, "x", False], "z": None, "e": 2, "u": "abc", "nothing": "7", "extra": "5"})])),
    ("typed_arguments_alternatives",  # boolean "0", python-literal containers, string "null"-able
     "<tool_call>sink<arg_key>b</arg_key><arg_value>0</arg_value>"
     "<arg_key>o</arg_key><arg_value>{'k': True, 'l': [1, None]}</arg_value>"
     "<arg_key>a</arg_key><arg_value>('no', 'tuples')</arg_value>"
     "<arg_key>z</arg_key><arg_value>text</arg_value><arg_key>u</arg_key><arg_value>5</arg_value>"
     "<arg_key>n</arg_key><arg_value>-1e2</arg_value></tool_call>", [SINK], False,
     msg(tool_calls=[call("sink", {"b": False, "o": {"k": True, "l": [1, None]},
                                   "a": "('no', 'tuples')", "z": "text", "u": 5, "n": -100})],
         errors=[{"type": "argument_type_mismatch", "index": 0, "name": "sink", "key": "a"}])),
    ("type_mismatch_kept",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
     "<arg_value>many</arg_value></tool_call>", [WEATHER], False,
     msg(tool_calls=[call("get_weather", {"city": "Oslo", "days": "many"})],
         errors=[{"type": "argument_type_mismatch", "index": 0, "name": "get_weather", "key": "days"}])),
    ("nonfinite_number_stays_string",
     "<tool_call>sink<arg_key>n</arg_key><arg_value>inf</arg_value><arg_key>i</arg_key>"
     "<arg_value>1e400</arg_value></tool_call>", [SINK], False,
     msg(tool_calls=[call("sink", {"n": "inf", "i": "1e400"})],
         errors=[{"type": "argument_type_mismatch", "index": 0, "name": "sink", "key": "n"},
                 {"type": "argument_type_mismatch", "index": 0, "name": "sink", "key": "i"}])),
    # -- malformed and unterminated calls --
    ("unknown_tool_dropped",  # validate_tool_names=True in glm47_moe_config
     "Sure.<tool_call>get_stock<arg_key>sym</arg_key><arg_value>X</arg_value></tool_call>Done", [WEATHER], False,
     msg(content="Sure.Done", errors=[{"type": "unknown_tool", "name": "get_stock", "raw":
         "<tool_call>get_stock<arg_key>sym</arg_key><arg_value>X</arg_value></tool_call>"}])),
    ("unknown_tool_then_known",
     "<tool_call>nope</tool_call><tool_call>get_time</tool_call>", [TIME], False,
     msg(tool_calls=[call("get_time", {})], errors=[{"type": "unknown_tool", "name": "nope"}])),
    ("name_swallows_other_tags",  # TOOL_NAME has no rule for <arg_value>: it is name text
     "<tool_call>get_weather<arg_value>Paris</arg_value></tool_call>", [WEATHER], False,
     msg(errors=[{"type": "unknown_tool", "name": "get_weather<arg_value>Paris</arg_value>"}])),
    ("empty_name_dropped",
     "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>ok", None, False,
     msg(content="ok", errors=[{"type": "empty_tool_name"}])),
    ("unterminated_value_and_call",  # finish() closes the call (streaming_parser_engine.finish)
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", [WEATHER], False,
     msg(tool_calls=[call("get_weather", {"city": "Par"})],
         errors=[{"type": "unterminated_arg_value", "key": "city"}, {"type": "unterminated_tool_call"}])),
    ("unterminated_typed_value",
     "<tool_call>get_weather<arg_key>days</arg_key><arg_value>12", [WEATHER], False,
     msg(tool_calls=[call("get_weather", {"days": 12})],
         errors=[{"type": "unterminated_arg_value", "key": "days"}, {"type": "unterminated_tool_call"}])),
    ("unterminated_in_name_no_tools", "Sure<tool_call>get_wea", None, False,
     msg(content="Sure", tool_calls=[call("get_wea", {})], errors=[{"type": "unterminated_tool_call"}])),
    ("unterminated_in_name_with_tools", "Sure<tool_call>get_wea", [WEATHER], True,
     msg(reasoning="Sure", errors=[{"type": "unknown_tool", "name": "get_wea"},
                                   {"type": "unterminated_tool_call"}])),
    ("unterminated_key", "<tool_call>f<arg_key>ci", None, False,
     msg(tool_calls=[call("f", {})], errors=[{"type": "unterminated_arg_key"},
                                              {"type": "unterminated_tool_call"}])),
    ("end_inside_value_closes_call",
     "<tool_call>f<arg_key>k</arg_key><arg_value>abc</tool_call>rest", None, False,
     msg(content="rest", tool_calls=[call("f", {"k": "abc"})],
         errors=[{"type": "unterminated_arg_value", "key": "k"}])),
    ("key_without_value",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_key>days</arg_key><arg_value>2</arg_value>"
     "</tool_call>", [WEATHER], False,
     msg(tool_calls=[call("get_weather", {"days": 2})],
         errors=[{"type": "missing_arg_value", "key": "city"}])),
    ("key_then_text",
     "<tool_call>f<arg_key>a</arg_key> oops <arg_key>b</arg_key><arg_value>1</arg_value></tool_call>",
     None, False, msg(tool_calls=[call("f", {"b": "1"})], errors=[
         {"type": "missing_arg_value", "key": "a"}, {"type": "stray_arg_text", "text": "oops"}])),
    ("key_at_end", "<tool_call>f<arg_key>a</arg_key>\n</tool_call>", None, False,
     msg(tool_calls=[call("f", {})], errors=[{"type": "missing_arg_value", "key": "a"}])),
    ("orphan_value_and_stray_tag",
     "<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value><arg_value>x</arg_value></arg_key>"
     "</tool_call>", None, False,
     msg(tool_calls=[call("f", {"k": "v"})], errors=[{"type": "orphan_arg_value"},
                                                      {"type": "stray_arg_tag", "tag": "</arg_key>"}])),
    ("stray_text_in_args",
     "<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value> junk \n</tool_call>", None, False,
     msg(tool_calls=[call("f", {"k": "v"})], errors=[{"type": "stray_arg_text", "text": "junk"}])),
    ("call_inside_reasoning_no_tools",
     "think<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>after", None, True,
     msg(reasoning="think", content="after", tool_calls=[call("f", {"k": "v"})])),
]


def _matches(got: dict, want: dict) -> None:
    """Equality, where each expected error only lists the fields it cares about."""
    assert {k: v for k, v in got.items() if k != "errors"} == {k: v for k, v in want.items() if k != "errors"}
    assert len(got["errors"]) == len(want["errors"]), got["errors"]
    for g, w in zip(got["errors"], want["errors"]):
        assert {k: g.get(k) for k in w} == w, g
        assert isinstance(g["message"], str) and g["message"]


@pytest.mark.parametrize("name,text,tools,thinking,want", CASES, ids=[c[0] for c in CASES])
def test_parse_assistant(name, text, tools, thinking, want):
    _matches(parse(text, tools, thinking), want)


def test_default_ids_like_vllm():
    # vLLM make_tool_call_id(id_type="random"): f"chatcmpl-tool-{uuid4().hex}"
    m = cf.parse_assistant("<tool_call>a</tool_call><tool_call>b</tool_call>", thinking=False)
    got = [c["id"] for c in m["tool_calls"]]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in got) and len(set(got)) == 2


def test_parse_never_raises_on_garbage():
    rng = random.Random(1)
    alphabet = list(cf.SPECIAL_TOKENS) + ["<", "</", "<tool", ">", "x", " ", "\n", "{", "\"", "\\"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for tools in (None, [WEATHER], [SINK]):
            m = cf.parse_assistant(text, tools=tools, thinking=rng.random() < 0.5)
            assert set(m) == {"role", "reasoning_content", "content", "tool_calls", "errors"}
            json.dumps(m)  # plain JSON data


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------

DELTA_KEYS = {"reasoning_content", "content", "tool_call", "error"}


def check_deltas(deltas):
    for d in deltas:
        assert len(d) == 1 and next(iter(d)) in DELTA_KEYS, d
        if "tool_call" in d:
            tc = d["tool_call"]
            assert set(tc) in ({"index", "id", "name"}, {"index", "arguments"}), tc
        elif "error" not in d:
            assert isinstance(next(iter(d.values())), str) and next(iter(d.values()))


def property_holds(text, tools, thinking, rng, n_random=4):
    """assemble(deltas) == parse_assistant(text) for every 2-piece split, random splits, 1 char."""
    want = parse(text, tools, thinking)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    splits.append(list(text))
    for pieces in splits:
        deltas = stream(pieces, tools, thinking)
        check_deltas(deltas)
        got = cf.assemble(deltas)
        assert got == want, (pieces, got, want)


@pytest.mark.parametrize("name,text,tools,thinking,want", CASES, ids=[c[0] for c in CASES])
def test_streaming_equals_parse(name, text, tools, thinking, want):
    property_holds(text, tools, thinking, random.Random(name))


def test_streaming_property_fuzz():
    rng = random.Random(7)
    atoms = list(cf.MARKER_TOKENS) * 3 + ["<|user|>", "[gMASK]", "<tool_response>", "<", "</", "<tool_",
             "<arg_", "</arg_val", "think>", "get_weather", "sink", "f", "city", "days", "i", "o", "b",
             "Paris", "3", "true", "{\"a\": 1}", "[1,", " ", "  ", "\n", "é中", "\"", "\\"]
    for _ in range(120):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 24)))
        tools = rng.choice([None, [WEATHER], [WEATHER, SINK, TIME]])
        property_holds(text, tools, rng.random() < 0.6, rng, n_random=2)


def test_streams_text_early_holding_only_partial_markers():
    p = cf.StreamingParser(thinking=True, id_factory=ids)
    assert p.in_reasoning
    assert p.feed("I am thinking") == [{"reasoning_content": "I am thinking"}]
    assert p.feed(" about <") == [{"reasoning_content": " about"}]  # " " and "<" held
    assert p.feed("/thi") == []
    assert p.feed("nk>Hel") == [{"content": "Hel"}]
    assert not p.in_reasoning
    assert p.feed("lo <b> and <tool_ca") == [{"content": "lo <b> and "}]
    assert p.feed("ll>get_weather\n<arg") == []  # the name is not complete yet
    out = p.feed("_key>city</arg_key><arg_value>Par")
    # name known at <arg_key>; the string value streams before </arg_value> (no schema, no tools)
    assert out == [{"tool_call": {"index": 0, "id": "call_0", "name": "get_weather"}},
                   {"tool_call": {"index": 0, "arguments": '{"city": "Par'}}]
    assert p.feed("is</arg_val") == [{"tool_call": {"index": 0, "arguments": "is"}}]
    assert p.feed("ue></tool_call>") == [{"tool_call": {"index": 0, "arguments": '"}'}}]
    assert p.finish() == []
    assert p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed("more")


def test_typed_values_wait_for_their_end_and_string_values_stream():
    p = cf.StreamingParser(tools=[WEATHER], thinking=False, id_factory=ids)
    out = p.feed("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1")
    assert out == [{"tool_call": {"index": 0, "id": "call_0", "name": "get_weather"}}]
    assert p.feed("2</arg_value><arg_key>city</arg_key><arg_value>Ro") == [
        {"tool_call": {"index": 0, "arguments": '{"days": 12, "city": "Ro'}}]
    assert p.feed("me\"</arg_value>") == [{"tool_call": {"index": 0, "arguments": 'me\\""'}}]
    deltas = p.finish()
    assert deltas == [{"tool_call": {"index": 0, "arguments": "}"}},
                      {"error": deltas[1]["error"]}] and deltas[1]["error"]["type"] == "unterminated_tool_call"


def test_streaming_whitespace_is_deferred_like_vllm():
    # parser_engine._events_to_delta defers whitespace-only content and drops it before tool calls;
    # _strip_trailing_reasoning defers trailing reasoning whitespace.
    deltas = stream(["r  ", "\n", "</think>", "\n\n", "<tool_call>get_time</tool_call>", "\n"], [TIME])
    assert [d for d in deltas if "content" in d] == []
    assert [d["reasoning_content"] for d in deltas if "reasoning_content" in d] == ["r"]
    deltas = stream(["</think>", "\n\n", "Hi"], None)
    assert [d["content"] for d in deltas if "content" in d] == ["\n\nHi"]
    assert stream(["  "], None, thinking=False) == [{"content": "  "}]
