"""Training and evaluation data of the shipped demo model (`tools/train_demo.py`). No download.

Two sources, both on every machine:

* **Code**: the running interpreter's standard-library `.py` files (`stdlib_files()`: sorted, no
  `site-packages`, no test suites). A file is held out when the SHA-256 of its path relative to the
  standard library ends in a byte < 8 (about 3%): `split_of(path)`.
* **Chats**: transcripts `chat_transcript(rng)` writes itself in the GLM-4.7 format (the built-in
  template), each with a computed answer: arithmetic, string puzzles, list questions, short Python
  functions, and calls to the made-up tools in `DEMO_TOOLS` (typed arguments, a tool result, an
  answer that uses it). Thinking is on in about half of them (`<think>...</think>` reasoning),
  off in the rest. Held-out chats come from seeds that training never uses (`EVAL_SEED_BASE`).

Only the standard library is imported here: the tokenizer, the trainer and the quality script all
share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from typing import Iterator

EOT = "<|endoftext|>"
EVAL_SEED_BASE = 1_000_000_007
"""Chats for evaluation use seeds from here up; training uses seeds below it."""

CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Madrid", "Seoul", "Nairobi",
          "Toronto", "Berlin", "Sydney", "Mumbai", "Dublin", "Austin", "Rome", "Lagos", "Quito")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "CAD", "INR", "BRL")
RATES = {"USD": 1.0, "EUR": 0.92, "JPY": 151.0, "GBP": 0.79, "CHF": 0.88, "CAD": 1.36,
         "INR": 83.0, "BRL": 5.0}
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
WORDS = ("flint", "river", "garden", "python", "window", "rocket", "silver", "planet", "bridge",
         "lemon", "forest", "candle", "marble", "tiger", "violin", "harbor", "pencil", "castle",
         "orbit", "meadow", "copper", "lantern", "puzzle", "summit")
EXTENSIONS = ("py", "txt", "md", "json", "csv")


def _tool(name, description, properties, required):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


DEMO_TOOLS: tuple[dict, ...] = (
    _tool("get_weather", "Current weather in a city.",
          {"city": {"type": "string", "description": "City name"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ("city",)),
    _tool("convert_currency", "Convert an amount of money between currencies.",
          {"amount": {"type": "number"}, "from_currency": {"type": "string"},
           "to_currency": {"type": "string"}}, ("amount", "from_currency", "to_currency")),
    _tool("search_files", "Find files whose name matches a pattern.",
          {"pattern": {"type": "string"}, "max_results": {"type": "integer"}}, ("pattern",)),
    _tool("add_event", "Add an event to the calendar.",
          {"title": {"type": "string"}, "day": {"type": "string", "enum": list(DAYS)},
           "hour": {"type": "integer", "description": "0-23"}}, ("title", "day", "hour")),
)
"""Made-up tools the demo model learned to call (OpenAI-style schemas, typed arguments)."""

TOOLS_BY_NAME = {t["function"]["name"]: t for t in DEMO_TOOLS}


# ---- code -----------------------------------------------------------------------------------

def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    """The standard library's `.py` files (paths relative to `stdlib_dir()`), sorted."""
    root = stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = set(rel.split(os.sep))
        if parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}:
            dirnames[:] = []
            continue
        dirnames.sort()
        out.extend(os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py"))
    return sorted(out)


def split_of(rel_path: str) -> str:
    """"eval" for about 3% of files (by a hash of the relative path), else "train"."""
    return "eval" if hashlib.sha256(rel_path.encode()).digest()[-1] < 8 else "train"


def code_texts(split: str) -> Iterator[tuple[str, str]]:
    """(relative path, text) of the standard-library files of one split."""
    root = stdlib_dir()
    for rel in stdlib_files():
        if split_of(rel) != split:
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            yield rel, f.read()


# ---- chats ----------------------------------------------------------------------------------

def _num(rng: random.Random, lo=0, hi=99) -> int:
    return rng.randint(lo, hi)


def _arith(rng):
    a, b = _num(rng, 2, 99), _num(rng, 2, 99)
    op = rng.choice("+-*")
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    q = rng.choice((f"What is {a} {op} {b}?", f"What is {a} {word} {b}?", f"Compute {a} {op} {b}.",
                    f"{a} {op} {b} = ?"))
    think = f"{a} {op} {b} = {c}."
    ans = rng.choice((f"{a} {op} {b} = {c}.", f"The answer is {c}."))
    return q, think, ans


def _string_task(rng):
    w = rng.choice(WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"Reverse the word '{w}'.", f"Reading '{w}' backwards gives '{w[::-1]}'.",
                f"'{w}' reversed is '{w[::-1]}'.")
    if kind == 1:
        return (f"How many letters are in the word '{w}'?",
                f"'{w}' is spelled {' '.join(w)}: {len(w)} letters.",
                f"The word '{w}' has {len(w)} letters.")
    if kind == 2:
        return (f"Write '{w}' in capital letters.", f"Uppercase of '{w}' is '{w.upper()}'.",
                w.upper())
    ch = rng.choice(sorted(set(w)))
    n = w.count(ch)
    return (f"How many times does the letter '{ch}' appear in '{w}'?",
            f"Counting '{ch}' in '{w}': {n}.", f"The letter '{ch}' appears {n} time{'s' * (n != 1)} in '{w}'.")


def _list_task(rng):
    xs = [_num(rng) for _ in range(rng.randint(3, 7))]
    kind = rng.randrange(3)
    s = ", ".join(map(str, xs))
    if kind == 0:
        return (f"Sort these numbers: {s}.", f"In increasing order: {', '.join(map(str, sorted(xs)))}.",
                ", ".join(map(str, sorted(xs))))
    if kind == 1:
        return (f"What is the largest of {s}?", f"Comparing them, the largest is {max(xs)}.",
                f"The largest is {max(xs)}.")
    return (f"What is the sum of {s}?", f"{' + '.join(map(str, xs))} = {sum(xs)}.",
            f"The sum is {sum(xs)}.")


_FUNCS = (
    ("returns the square of a number", "square", "def square(x):\n    return x * x"),
    ("adds two numbers", "add", "def add(a, b):\n    return a + b"),
    ("checks whether a number is even", "is_even", "def is_even(n):\n    return n % 2 == 0"),
    ("reverses a string", "reverse", "def reverse(s):\n    return s[::-1]"),
    ("computes a factorial", "factorial",
     "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
    ("returns the largest item of a list", "largest",
     "def largest(items):\n    best = items[0]\n    for item in items[1:]:\n        if item > best:\n            best = item\n    return best"),
    ("counts the vowels in a string", "count_vowels",
     "def count_vowels(text):\n    return sum(1 for c in text.lower() if c in \"aeiou\")"),
    ("computes the n-th Fibonacci number", "fib",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
)


def _code_task(rng):
    what, name, code = rng.choice(_FUNCS)
    q = rng.choice((f"Write a Python function that {what}.", f"Show me a Python function that {what}."))
    return q, f"A short function named {name} does it.", f"```python\n{code}\n```"


def _weather(rng):
    city = rng.choice(CITIES)
    unit = rng.choice(("celsius", "fahrenheit"))
    temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
    cond = rng.choice(CONDITIONS)
    q = rng.choice((f"What's the weather in {city}?", f"Is it warm in {city} right now?",
                    f"Tell me the weather in {city} in {unit}.", f"How is the weather in {city} today?"))
    args = {"city": city, "unit": unit}
    result = {"city": city, "temperature": temp, "unit": unit, "condition": cond}
    answer = f"It is {temp} degrees {unit} and {cond} in {city}."
    return q, f"The user wants the weather in {city}; I will call get_weather.", "get_weather", args, result, answer


def _currency(rng):
    a, b = rng.sample(CURRENCIES, 2)
    amount = rng.choice((5, 10, 20, 50, 100, 250, 1000, rng.randint(1, 999)))
    out = round(amount * RATES[b] / RATES[a], 2)
    q = rng.choice((f"Convert {amount} {a} to {b}.", f"How much is {amount} {a} in {b}?"))
    args = {"amount": amount, "from_currency": a, "to_currency": b}
    return (q, f"I need to convert {amount} {a} to {b} with convert_currency.", "convert_currency",
            args, {"amount": out, "currency": b}, f"{amount} {a} is {out} {b}.")


def _search(rng):
    ext = rng.choice(EXTENSIONS)
    stem = rng.choice(WORDS)
    n = rng.randint(1, 5)
    files = [f"{rng.choice(WORDS)}_{stem}.{ext}" for _ in range(rng.randint(0, n))]
    q = rng.choice((f"Find up to {n} .{ext} files with '{stem}' in the name.",
                    f"Search for {ext} files named like {stem}, at most {n}."))
    args = {"pattern": f"*{stem}*.{ext}", "max_results": n}
    answer = (f"I found {len(files)} file{'s' * (len(files) != 1)}: {', '.join(files)}." if files
              else f"No .{ext} files match '{stem}'.")
    return (q, f"I will search with the pattern *{stem}*.{ext}.", "search_files", args,
            {"files": files}, answer)


def _event(rng):
    title = rng.choice(("Dentist", "Team meeting", "Lunch with Ana", "Gym", "Call mom", "Flight"))
    day = rng.choice(DAYS)
    hour = rng.randint(7, 20)
    q = rng.choice((f"Add '{title}' on {day.title()} at {hour}:00 to my calendar.",
                    f"Schedule {title} for {day} at {hour} o'clock."))
    args = {"title": title, "day": day, "hour": hour}
    return (q, f"I will add the event with add_event for {day} at {hour}.", "add_event", args,
            {"status": "ok", "id": rng.randint(100, 999)},
            f"Done: '{title}' is on your calendar for {day.title()} at {hour}:00.")


_PLAIN = (_arith, _string_task, _list_task, _code_task)
_TOOL_TASKS = ((_weather, "get_weather"), (_currency, "convert_currency"), (_search, "search_files"),
               (_event, "add_event"))


def chat_messages(rng: random.Random) -> tuple[list[dict], list[dict] | None, bool]:
    """One generated conversation: (messages, tools or None, thinking on)."""
    thinking = rng.random() < 0.5
    use_tools = rng.random() < 0.55
    tools = None
    if use_tools:
        tools = rng.sample(DEMO_TOOLS, rng.randint(1, len(DEMO_TOOLS)))
    msgs: list[dict] = []
    if rng.random() < 0.15:
        msgs.append({"role": "system", "content": "You are Flint, a small helpful assistant."})
    for turn in range(1 if rng.random() < 0.8 else 2):
        names = [t["function"]["name"] for t in tools] if tools else []
        tool_tasks = [f for f, name in _TOOL_TASKS if name in names]
        if tool_tasks and rng.random() < 0.75:
            q, think, name, args, result, answer = rng.choice(tool_tasks)(rng)
            call = {"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
            if thinking:
                call["reasoning_content"] = think
            msgs += [{"role": "user", "content": q}, call,
                     {"role": "tool", "content": json.dumps(result)}]
            final = {"role": "assistant", "content": answer}
        else:
            q, think, answer = rng.choice(_PLAIN)(rng)
            msgs.append({"role": "user", "content": q})
            final = {"role": "assistant", "content": answer}
            if thinking:
                final["reasoning_content"] = think
        msgs.append(final)
    return msgs, tools, thinking


def chat_transcript(rng: random.Random) -> str:
    """One conversation rendered with the built-in GLM-4.7 template, ending in `<|endoftext|>`."""
    from flint_jax.chat_format import DEFAULT_CHAT_TEMPLATE, render_chat_template
    msgs, tools, thinking = chat_messages(rng)
    return render_chat_template(DEFAULT_CHAT_TEMPLATE, msgs, tools=tools,
                                add_generation_prompt=False, enable_thinking=thinking) + EOT


def chat_prompts(n: int, seed: int = EVAL_SEED_BASE) -> list[tuple[list[dict], list[dict] | None, bool]]:
    """`n` held-out conversations cut before their first assistant turn: (messages, tools, thinking).
    Used to measure how often generated tool calls parse."""
    out = []
    for i in range(n):
        msgs, tools, thinking = chat_messages(random.Random(seed + i))
        first = next(j for j, m in enumerate(msgs) if m["role"] == "assistant")
        out.append((msgs[:first], tools, thinking))
    return out
