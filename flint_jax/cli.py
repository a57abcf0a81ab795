"""`flint-jax`: run, chat with, convert and benchmark Flint.

Examples:
  flint-jax demo                                   # the shipped small trained Flint (no download)
  flint-jax generate demo "Once upon a time" --max-new-tokens 32 --seed 1
  flint-jax generate /ckpt/flint "2 + 2 =" --temperature 0 --json
  flint-jax chat /ckpt/flint --tools tools.json
  flint-jax convert /hf/flint /ckpt/flint          # HF safetensors -> flint_jax checkpoint
  flint-jax convert flint.gguf /ckpt/flint-nvfp4 --hf-config /hf/flint
  flint-jax inspect flint.gguf --config /hf/flint
  flint-jax bench --config smoke                   # a CPU smoke run (~35 s on 2 cores)
  flint-jax bench --dtype bf16 --batch 1 8 --context 1024 8192
  flint-jax bench --dtype nvfp4 --batch 8 --paths pallas --option qkv_split_k=4
  flint-jax bench --prefill --config smoke         # prefill benchmark, CPU smoke run
  flint-jax bench --prefill --cases 1x8K 8x2K 1x32K --dtype bf16 --reps 3

MODEL is a local HF directory, a converted checkpoint, a .gguf file, or `demo`. A .gguf file
takes its config.json and tokenizer from its own directory, else from --hf-config DIR.

Real weights: flint-jax reads local files only (a hub ID such as RecursiveSI/flint is not
fetched). Download the published checkpoints first, e.g. with huggingface_hub's CLI:
  hf download RecursiveSI/flint --local-dir /hf/flint                  # BF16 safetensors
  hf download RecursiveSI/flint-nvfp4-gguf --local-dir /hf/flint-gguf  # NVFP4 GGUF
and pass the local paths.

The first generate / chat for a new batch size or cache length compiles the model's steps
(tens of seconds on a CPU): a notice says so on stderr, and a line of timings (time to first
token, prompt and generation tokens/s) follows each answer. FLINT_JAX_QUIET=1 (or --quiet)
silences both. Set FLINT_JAX_DEBUG=1 (or pass --debug, before or after the command) for full
tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

DEMO = "demo"
DEMO_RANDOM = "demo-random"


def _add_debug(p: argparse.ArgumentParser):
    # SUPPRESS: no default here, so `flint-jax --debug CMD ...` (the main parser's flag) is not
    # overwritten by the subparser's default; `flint-jax CMD ... --debug` works as well.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show full tracebacks (also FLINT_JAX_DEBUG=1)")


def _add_quiet(p: argparse.ArgumentParser):
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no compile notice nor timing line on stderr (also FLINT_JAX_QUIET=1)")


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("model", help="a local HF directory, converted checkpoint or .gguf file, or "
                                 "'demo' (the shipped small trained model) or 'demo-random' "
                                 "(random weights) (hub IDs are not fetched: download first; "
                                 "`flint-jax --help` says how)")
    p.add_argument("--hf-config", metavar="DIR",
                   help="for a .gguf file: the directory with config.json and the tokenizer "
                        "(default: the .gguf file's own directory, when config.json is there)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="activation / weight dtype (default bfloat16)")
    p.add_argument("--kernels", default="auto", choices=["auto", "pallas", "xla"],
                   help="decode kernels: Pallas on GPU by default, XLA elsewhere")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest sequence (prompt + new tokens) a cache may hold (default: the "
                        "config's max_position_embeddings)")


def _add_sampling_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling (defaults: generation_config.json, else temperature 1.0, "
                             "top-p 0.95, top-k 20)")
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens to generate at most (default 256; thinking counts); lowered, "
                        "with a warning, to what --max-length leaves after the prompt")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = off")
    g.add_argument("--top-p", type=float, default=None, help="1 = off")
    g.add_argument("--min-p", type=float, default=None, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=None, help="1 = off")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed (default 0): the same seed gives the same text")


def _sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                top_p=a.top_p, min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed)


def _quiet(a) -> bool:
    return bool(getattr(a, "quiet", False) or os.environ.get("FLINT_JAX_QUIET"))


def _setup_output(a):
    """The library's INFO notices (compiles) as `[flint-jax] ...` lines on stderr, its warnings
    as `flint-jax CMD: warning: ...`, and messages naming the CLI's flags."""
    log = logging.getLogger("flint_jax")
    if not _quiet(a) and not any(getattr(h, "_flint_cli", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[flint-jax] %(message)s"))
        h._flint_cli = True
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("flint_jax"):
            print(f"flint-jax {a.command}: warning: {message}", file=sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    from flint_jax import decode
    decode.MAX_LENGTH_HINT.set("--max-length N")


def _print_stats(a, stats):
    if stats is not None and not _quiet(a):
        sys.stdout.flush()
        print(f"[flint-jax] {stats.summary()}", file=sys.stderr, flush=True)


def _load(a):
    import flint_jax
    if a.model == DEMO:
        from flint_jax.demo import demo_checkpoint
        path = demo_checkpoint()
        if not _quiet(a):
            print(f"[flint-jax] demo model: a small Flint trained on Python's standard library and "
                  f"generated chats ({path})", file=sys.stderr)
    elif a.model == DEMO_RANDOM:
        from flint_jax.demo import random_checkpoint
        path = random_checkpoint()
        if not _quiet(a):
            print(f"[flint-jax] demo-random: a small Flint with RANDOM weights ({path}); its text is "
                  "meaningless.", file=sys.stderr)
    else:
        path = a.model
    return flint_jax.load(path, dtype=a.dtype, kernels=a.kernels, max_length=a.max_length,
                          hf_config=a.hf_config)


# ---- commands ---------------------------------------------------------------------------------

def cmd_generate(a) -> int:
    import flint_jax
    model = _load(a)
    kw = _sampling_kwargs(a)
    stop = a.stop or None
    if a.json:
        out = flint_jax.generate(model, a.prompt, stop=stop, logprobs=True, return_details=True,
                                 **kw)
        print(json.dumps({"prompt": a.prompt, "text": out.text,
                          "token_ids": out.token_ids.tolist(),
                          "finish_reason": out.finish_reason,
                          "logprobs": [round(float(x), 6) for x in out.logprobs],
                          "stats": out.stats.as_dict()}, ensure_ascii=False))
        return 0
    events = flint_jax.generate(model, a.prompt, stop=stop, stream=True, **kw)
    for ev in events:
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(a, events.stats)
    return 0


def _print_delta(d, state):
    """Reasoning goes to the terminal dimmed (or prefixed), the answer plainly."""
    dim, reset = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    if "reasoning_content" in d:
        if state.get("mode") != "reasoning":
            sys.stdout.write(f"{dim}[thinking] ")
            state["mode"] = "reasoning"
        sys.stdout.write(d["reasoning_content"])
    elif "content" in d:
        if state.get("mode") != "content":
            sys.stdout.write(f"{reset}\n[answer] " if state.get("mode") else "[answer] ")
            state["mode"] = "content"
        sys.stdout.write(d["content"])
    elif "tool_call" in d:
        tc = d["tool_call"]
        if "name" in tc:
            sys.stdout.write(f"{reset}\n[tool call] {tc['name']}(")
            state["mode"] = "tool"
        if "arguments" in tc:
            sys.stdout.write(tc["arguments"])
    elif "error" in d:
        sys.stdout.write(f"{reset}\n[parse error] {d['error']}")
    sys.stdout.flush()


def cmd_chat(a) -> int:
    import flint_jax
    from flint_jax import chat_format
    model = _load(a)
    tools = None
    if a.tools:
        with open(a.tools) as f:
            tools = json.load(f)
        if not isinstance(tools, list):
            raise ValueError(f"{a.tools}: expected a JSON list of tool schemas")
    history: list[dict] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("flint-jax chat: type a message; /reset clears the conversation, /exit quits.")
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            print("[conversation cleared]")
            continue
        if line.startswith("/tool "):  # a tool result for the last call: /tool {json or text}
            history.append({"role": "tool", "content": line[len("/tool "):]})
        else:
            history.append({"role": "user", "content": line})
        deltas, state, stats = [], {}, None
        for d in flint_jax.chat(model, history, tools=tools, enable_thinking=not a.no_think,
                                stream=True, **_sampling_kwargs(a)):
            if "finish_reason" in d:
                stats = d.get("stats")
                continue
            deltas.append(d)
            _print_delta(d, state)
        sys.stdout.write("\033[0m\n" if sys.stdout.isatty() else "\n")
        if stats:
            from flint_jax.decode import GenerationStats
            _print_stats(a, GenerationStats(**stats))
        msg = chat_format.assemble(deltas)
        history.append({k: v for k, v in msg.items() if k in ("role", "content",
                                                                "reasoning_content", "tool_calls")
                        and v})
    return 0


# The prompt ends after the docstring's closing quotes, not after a newline: the tokenizer merges
# a newline with the next line's indentation, so a prompt ending in "\n" starts the body at a
# boundary the model never saw (it then writes unindented code).
DEMO_CODE_PROMPT = ('import os\n\n\ndef list_python_files(root):\n'
                    '    """Return the paths of the .py files under root."""')
# A 12M-parameter model loops under greedy decoding (`name, name, name, ...`); a mild repetition
# penalty on the completion (not on the chat turns, whose tool calls copy values) keeps it code.
DEMO_CODE_REPETITION_PENALTY = 1.1
# The model computes nothing (it answers "What is 17 + 25?" with 46; docs/demo_model.md): the chat
# turn asks a task of its training chats that it answers right under greedy decoding (every
# word of demo_data.WORDS reversed right; the smallest top-2 margin on the answer is 6.6).
DEMO_CHAT = "Reverse the word 'flint'."
DEMO_TOOL_REQUEST = "What's the weather in Oslo?"


def cmd_demo(a) -> int:
    import flint_jax
    from flint_jax.demo import demo_checkpoint
    from flint_jax.demo_data import DEMO_TOOLS
    path = demo_checkpoint()
    print("flint-jax demo: a small Flint (12M parameters: 6 layers, 16 experts top-4, sliding and "
          f"full attention) shipped with flint_jax at\n{path}. It was trained on Python's standard "
          "library and generated chats: it completes Python, follows the chat format and calls "
          "four made-up tools; it knows nothing else (docs/demo_model.md).\n")
    model = flint_jax.load(path, kernels=a.kernels)
    print(model)
    greedy = dict(temperature=a.temperature, seed=a.seed)
    print(f"\n[complete] {DEMO_CODE_PROMPT!r} ->")
    events = flint_jax.generate(model, DEMO_CODE_PROMPT, max_new_tokens=a.max_new_tokens,
                                stream=True, repetition_penalty=DEMO_CODE_REPETITION_PENALTY,
                                **greedy)
    prompt = DEMO_CODE_PROMPT   # written with the first token: below the compile notice
    for ev in events:
        sys.stdout.write(prompt + ev.text)
        sys.stdout.flush()
        prompt = ""
    sys.stdout.write(prompt + "\n")
    _print_stats(a, events.stats)
    show = ("reasoning_content", "content", "tool_calls", "finish_reason")
    print(f"\n[chat] user: {DEMO_CHAT}")
    msg = flint_jax.chat(model, [{"role": "user", "content": DEMO_CHAT}],
                         max_new_tokens=a.max_new_tokens, **greedy)
    print(json.dumps({k: msg[k] for k in show}, ensure_ascii=False, indent=1))
    names = ", ".join(t["function"]["name"] for t in DEMO_TOOLS)
    print(f"\n[tool call] tools: {names}; user: {DEMO_TOOL_REQUEST}")
    msg = flint_jax.chat(model, [{"role": "user", "content": DEMO_TOOL_REQUEST}], tools=DEMO_TOOLS,
                         enable_thinking=False, max_new_tokens=a.max_new_tokens, **greedy)
    print(json.dumps({k: msg[k] for k in show}, ensure_ascii=False, indent=1))
    if msg.get("stats"):
        from flint_jax.decode import GenerationStats
        _print_stats(a, GenerationStats(**msg["stats"]))
    print("\nNext: `flint-jax chat demo`, `flint-jax generate MODEL \"prompt\"` on a real "
          "checkpoint, or `flint-jax convert` to convert one (see README).")
    return 0


# `bench --config smoke`: the tiny config cut to 2 layers, one case per format, a few steps: both
# weight formats on the XLA and Pallas (interpret mode) paths in ~35 s on 2 CPU cores (measured).
SMOKE = dict(config="tiny", layers=2, dtype=["bf16", "nvfp4"], batch=[1], context=[64], steps=2)
BENCH_DEFAULTS = dict(dtype=["bf16", "nvfp4"], batch=[1, 8], context=[1024, 8192, 100_000],
                      steps=50)


def bench_options(a):
    """Fills the options left unset: from the smoke preset for `--config smoke`, else the full
    grid's defaults."""
    base = SMOKE if a.config == "smoke" else BENCH_DEFAULTS
    for k, v in base.items():
        if k == "config":
            a.config = v
        elif getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


# `bench --prefill`: the options only one of the two benchmarks takes (unset = None or empty).
DECODE_ONLY = ("batch", "context", "steps")
PREFILL_ONLY = ("cases", "reps")


def prefill_options(a):
    """Fills the prefill benchmark's options left unset: `--config smoke` (kept: bench_prefill
    makes its 2-layer tiny config) gets its scaled-down cases and 1 timed run, any other config
    the issue's cases and 3 runs; both weight formats."""
    from flint_jax import bench_prefill
    smoke = a.config == "smoke"
    a.cases = a.cases or (bench_prefill.SMOKE_CASES if smoke else bench_prefill.DEFAULT_CASES)
    a.reps = a.reps or (1 if smoke else 3)
    a.dtype = a.dtype or ["bf16", "nvfp4"]
    return a


def cmd_bench(a) -> int:
    mixed = [k for k in (DECODE_ONLY if a.prefill else PREFILL_ONLY) if getattr(a, k)]
    if a.prefill and a.trace:
        mixed.append("trace")
    if mixed:
        which = "the decode benchmark (without --prefill)" if a.prefill else "--prefill"
        raise ValueError(f"--{mixed[0].replace('_', '-')} is an option of {which}")
    if a.prefill:
        from flint_jax import bench_prefill
        return bench_prefill.main(prefill_options(a))
    bench_options(a)
    from flint_jax import bench
    return bench.main(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flint-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show full tracebacks (also FLINT_JAX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="run the shipped small trained model (no download)",
                       description="Loads the small Flint shipped with flint_jax (trained on "
                       "Python's standard library and generated chats) and shows a Python "
                       "completion, a chat answer and a parsed tool call. The model name `demo` "
                       "works in every other command too (`demo-random`: random weights).")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate in each part (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    p.add_argument("--kernels", default="auto", choices=["auto", "pallas", "xla"],
                   help="decode kernels: Pallas on GPU by default, XLA elsewhere (pallas runs in "
                        "interpret mode on a CPU: slow)")
    _add_quiet(p)
    _add_debug(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of PROMPT (streamed to stdout).")
    _add_model_args(p)
    p.add_argument("prompt", help="the prompt text")
    _add_sampling_args(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, finish_reason, logprobs, and "
                        "stats: time to first token, prompt and generation tokens/s)")
    _add_quiet(p)
    _add_debug(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat (GLM-4.7 format, streaming)",
                       description="Chat on stdin/stdout. Reasoning is shown apart from the "
                       "answer. Commands: /reset, /exit, /tool RESULT (a tool's result).")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--tools", help="JSON file with a list of OpenAI-style tool schemas")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--no-think", action="store_true", help="disable thinking")
    _add_quiet(p)
    _add_debug(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="decode or (--prefill) prefill benchmark (GPU; `--config "
                       "smoke` on a CPU)",
                       description="Times the decode step of a Flint with random weights, XLA "
                       "and Pallas paths side by side, for every weight format x batch x "
                       "context (see docs/performance.md). The full-size default is for a GPU; "
                       "on a CPU run `--config smoke` (about 35 s on 2 cores). A variant of the "
                       "Pallas plan: --option KEY=VALUE (repeatable). With --prefill: times whole "
                       "prompts through the Pallas prefill kernels (ms, tokens/s, % of the "
                       "compute floor) beside the XLA path where the prompt is short enough "
                       "(--reference-max-tokens), for every weight format x --cases (see "
                       "docs/prefill.md).")
    p.add_argument("--dtype", nargs="+", default=None, choices=["bf16", "nvfp4"],
                   help="weight formats (default both)")
    p.add_argument("--batch", nargs="+", type=int, default=None,
                   help="batch sizes (default 1 8)")
    p.add_argument("--context", nargs="+", type=int, default=None,
                   help="context lengths the cache is filled to (default 1024 8192 100000)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (quick runs)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed decode steps per window (default 50)")
    p.add_argument("--paths", nargs="+", default=["xla", "pallas"], choices=["xla", "pallas"],
                   help="decode paths to time side by side: xla (the reference) and pallas "
                        "(the plan: fast_decode.decode_plan, changed by --option)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="change the Pallas plan (repeatable): a DecodePlan field "
                        "(early_trigger=false, layer_end=norm, qkv_split_k=2, ...), "
                        "moe.<MoEPlan field> (moe.slot_rows=all), scales=e4m3 (NVFP4 block "
                        "scales not pre-scaled) or routing=fixed (router weights zeroed, both "
                        "paths); see flint_jax/bench.py parse_options. With --prefill: a "
                        "PrefillOptions field (nvfp4_experts=fused, attention=pallas, "
                        "gate_up_blocks=128x64, ...; flint_jax/bench_prefill.py parse_options)")
    p.add_argument("--config", default="flint",
                   help="flint (full size, the default; a GPU), a smaller preset (tiny, "
                        "tiny-gqa8, small: every case of the grid, minutes on a CPU), or smoke: "
                        "tiny with 2 layers, bf16 and nvfp4, batch 1, context 64, 2 steps; about "
                        "35 s on 2 CPU cores (options given explicitly still apply); with "
                        "--prefill, smoke is tiny with 2 layers (one dense, one MoE), cases 1x64 "
                        "2x40, 1 timed run")
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--trace", action="store_true", help="count kernels with the profiler (GPU)")
    g = p.add_argument_group("prefill benchmark (--prefill)")
    g.add_argument("--prefill", action="store_true",
                   help="time prefill instead of decode: flint_jax/bench_prefill.py (--dtype, "
                        "--config, --layers and --out apply too)")
    g.add_argument("--cases", nargs="+", default=None, metavar="CASE",
                   help="prompts: BxN rows x tokens, K = 1024 (default 1x8K 8x2K 1x32K 1x100K "
                        "1x262K, where 1x100K is 100,000 tokens; smoke: 1x64 2x40)")
    g.add_argument("--reps", type=int, default=None,
                   help="timed prefills per case and path after the first (compiling) one "
                        "(default 3; smoke: 1)")
    g.add_argument("--reference-max-tokens", type=int, default=8192,   # bench_prefill's default
                   help="also time the reference XLA path (256-token chunks) and compare its "
                        "logits on cases of at most this many tokens in all (default 8192; it "
                        "takes ~8 s per 8K tokens on the H200); 0: never")
    _add_debug(p)
    p.set_defaults(func=cmd_bench)

    try:
        from flint_jax import cli_checkpoints
        cli_checkpoints.register(sub)
    except ImportError:
        pass
    return parser


def main(argv=None) -> int:
    # A Ctrl-C gives one line and status 130, no traceback, from the command's first instant:
    # `import flint_jax` loads nothing heavy (its names load on first use), the libraries load
    # under `starting`, and later the writing commands clean up and say so themselves
    # (cli_checkpoints._guard, output_path).
    import signal
    command = "flint-jax"

    def starting(signum, frame):
        # Nothing is written yet, and a KeyboardInterrupt raised inside the imports can be
        # swallowed by a library's callback (Python then prints "Exception ignored ..."): end now.
        print(f"{command}: interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, starting)
    try:
        parser = build_parser()
        a = parser.parse_args(argv)
        if not getattr(a, "func", None):
            parser.print_help()
            return 2
        command = f"flint-jax {a.command}"
        debug = a.debug or os.environ.get("FLINT_JAX_DEBUG")
        _setup_output(a)
        _import_libraries()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        return _run(a, debug)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


def _import_libraries():
    """The seconds of importing jax, flax and orbax, done while a Ctrl-C ends the process at once
    (`main`)."""
    import flint_jax.checkpoint  # noqa: F401
    import flint_jax.decode  # noqa: F401


def _run(a, debug) -> int:
    try:
        return a.func(a) or 0
    except (ValueError, OSError, MemoryError) as e:
        if debug:
            raise
        print(f"flint-jax {a.command}: error: {e}", file=sys.stderr)
        print("(run with --debug for the full traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
