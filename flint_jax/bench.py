"""Decode benchmark: full-size Flint with random weights built on the device (`flint-jax bench`).

For each weight format (bf16, nvfp4), batch and context: the median decode-step time of the
reference XLA path and of the Pallas path (``fast_decode.decode_plan``'s measured plan) in the
same run, tokens/s, the HBM floor (bytes a step must read at 4.3 TB/s, spec section 9) and the
percent of it reached, and (with --trace) the kernels launched per step counted from a profiler
trace. The cache is filled with random keys and values up to the context length (never zeros), so
attention reads real data. A variant of the plan is chosen with ``--option key=value``
(repeatable; ``parse_options``): ``DecodePlan`` fields, ``moe.<MoEPlan field>``, ``scales=e4m3``,
``routing=fixed``.

Run: `flint-jax bench [--dtype bf16 nvfp4] [--batch 1 8] [--context 1024 8192 100000]
[--paths xla pallas] [--option early_trigger=false ...]` (GPU), or `flint-jax bench --config
smoke` on a CPU. Results: a table on stdout and JSON with --out. benchmarks/gpu_suite.py builds on
the same functions (parity and the suite's cases).
"""

from __future__ import annotations

import functools
import gzip
import glob
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flint_jax.cache import KVCache, cache_shapes
from flint_jax.config import FlintConfig, preset
from flint_jax.decode import Flint
from flint_jax.model import FlintForCausalLM

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (spec section 9)


def rel_l2(a, b) -> float:
    """Relative L2 error of logits b against reference logits a (both taken as f32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def step_bytes(cfg: FlintConfig, batch: int, context: int, quant: bool) -> float:
    """Bytes one decode step must read at least: active weights and the KV cache in use.

    NVFP4 linear weights cost 36/64 bytes per value (codes + E4M3 scales); the router stays fp32.
    With several rows, the distinct experts touched per layer are counted by their expectation
    under uniform routing: E * (1 - (1 - k/E)^B).
    """
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    wb = 36 / 64 if quant else 2.0
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    experts = e * (1 - (1 - k / e) ** batch)
    attn = (h * hd * d * 2 + kv * hd * d * 2) * wb
    total = cfg.vocab_size * d * wb + batch * d * 2  # lm_head + embedding rows
    for i in range(cfg.num_hidden_layers):
        total += attn
        if cfg.is_moe(i):
            total += e * d * 4 + 3 * d * cfg.shared_expert_intermediate_size * wb
            total += experts * 3 * d * cfg.moe_intermediate_size * wb
        else:
            total += 3 * d * cfg.intermediate_size * wb
    kv_token = 2 * kv * hd * 2
    total += batch * kv_token * (len(cfg.full_layers) * context
                                 + len(cfg.sliding_layers) * min(context, cfg.sliding_window))
    return total


def _leaf_kind(name: str) -> str:
    if name.endswith("qweight"):
        return "codes"
    if name.endswith("weight_scale"):
        return "block_scale"
    if name.endswith("weight_scale_2"):
        return "tensor_scale"
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith("self_attn.sinks"):
        return "sinks"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if name.endswith("embed_tokens.weight"):
        return "embedding"
    return "linear"


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind", "hidden"))
def _random_leaf(key, *, shape, dtype, kind, hidden):
    # The value ranges of model.py's initialisers, one small compiled generator per distinct
    # (shape, kind): jitting the whole module's init at full size took 4 minutes to compile.
    f32 = jnp.float32
    if kind == "codes":
        return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(dtype)
    if kind == "block_scale":
        return jax.random.uniform(key, shape, f32, 64.0, 448.0).astype(dtype)
    if kind == "tensor_scale":
        return jnp.full(shape, 0.02 / (2.93 * 256.0), dtype)
    if kind == "norm":
        return (1.0 + 0.1 * jax.random.normal(key, shape, f32)).astype(dtype)
    if kind == "sinks":
        return jax.random.normal(key, shape, dtype)
    if kind == "router":
        return (0.5 / hidden ** 0.5) * jax.random.normal(key, shape, dtype)
    std = 1.0 if kind == "embedding" else 0.02
    return jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)


def build_state(cfg: FlintConfig, quant: bool, seed: int = 0):
    """Random full-size weights generated on the device, leaf by leaf (no host copy)."""
    abstract = nnx.eval_shape(lambda: FlintForCausalLM(cfg, dtype=jnp.bfloat16, quant=quant,
                                                       rngs=nnx.Rngs(seed)))
    graphdef, abs_state = nnx.split(abstract)
    pairs = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abs_state)):
        sds = var.get_value()
        name = ".".join(str(p) for p in path)
        value = _random_leaf(jax.random.key(seed * 100003 + i), shape=tuple(sds.shape),
                             dtype=jnp.dtype(sds.dtype), kind=_leaf_kind(name),
                             hidden=cfg.hidden_size)
        pairs.append((path, var.replace(value=value)))
    return graphdef, nnx.from_flat_state(pairs)


def random_cache(cfg: FlintConfig, batch: int, length: int, context: int, seed: int = 1) -> KVCache:
    shapes = cache_shapes(cfg, batch, length, jnp.bfloat16)

    @jax.jit
    def make():
        keys = jax.random.split(jax.random.key(seed), 4)
        # Drawn directly in bf16: an fp32 temporary of a 100K-token batch-8 cache is 30 GB.
        arrs = [jax.random.normal(kk, s.shape, s.dtype) * jnp.asarray(0.5, s.dtype)
                for kk, s in zip(keys, (shapes.full_k, shapes.full_v, shapes.ring_k, shapes.ring_v))]
        return KVCache(*arrs, lengths=jnp.full((batch,), context, jnp.int32),
                       counters=jnp.zeros(shapes.counters.shape, jnp.int32))

    return make()


def time_steps(step, state, cache, tokens, steps: int, windows: int = 5):
    """Median per-step time (ms) of `steps` back-to-back asynchronous steps, over `windows`."""
    logits, cache = step(state, cache, tokens)  # compile + warm up
    logits, cache = step(state, cache, tokens)
    jax.block_until_ready(logits)
    per_step = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(state, cache, tokens)
        jax.block_until_ready(logits)
        per_step.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(per_step), per_step, logits, cache


def time_loop(model, cache, tokens, block: int, calls: int, windows: int = 5):
    """Per-step time (ms) of greedy decoding `block` steps per device call (the `generate` loop:
    a fori_loop of steps with sampling inside), two ways, medians over `windows`.

    steady: as `stream_generate` runs, one call always queued behind the one running; the clock
    runs between the completions of calls `calls` apart, so the host's per-call dispatch (~5 ms
    for the full-size Pallas step, run 127) hides under the GPU's work whenever it is shorter.
    This is the per-token time of a long generation.
    idle: windows of `calls` calls started from an idle device (the suite's in-loop figure up to
    run 126), so the first call's dispatch is on the clock: with 2 calls of 8 steps it adds
    ~0.3 ms per step (run 127). This is closer to the latency of a short generation.

    Returns (steady_ms, idle_ms, cache).
    """
    from flint_jax.sampling import SamplingParams
    fn = model.decode_fn(SamplingParams(temperature=0.0), False, block)
    state = {"cache": cache, "rng": jax.random.key(0)}

    def call(last):
        toks, _, state["cache"], _, state["rng"] = fn(model.leaves, state["cache"], last,
                                                       state["rng"], None)
        return toks

    toks = call(tokens)  # compile + warm up
    jax.block_until_ready(toks)
    idle = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            toks = call(toks[:, -1])
        jax.block_until_ready(toks)
        idle.append((time.perf_counter() - t0) * 1e3 / (calls * block))
    running = call(toks[:, -1])
    queued = call(running[:, -1])
    jax.block_until_ready(running)
    steady = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            nxt = call(queued[:, -1])   # queued behind the call the device is running
            jax.block_until_ready(queued)
            queued = nxt
        steady.append((time.perf_counter() - t0) * 1e3 / (calls * block))
    jax.block_until_ready(queued)
    return statistics.median(steady), statistics.median(idle), state["cache"]


def count_kernels(step, state, cache, tokens, steps: int = 3, top: int = 40):
    """GPU kernels per step from a profiler trace, and where the device time goes.

    Returns ({"kernels": launches per step, "kernel_us": summed kernel durations per step,
    "by_kernel": the `top` kernel names by time: [name, launches/step, us/step]}, cache).
    XLA turns command buffers off while profiling, so the trace's gaps between kernels are not
    the real ones (time without the profiler); the kernel durations are.
    """
    logdir = tempfile.mkdtemp(prefix="flint-trace-")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(steps):
            logits, cache = step(state, cache, tokens)
        jax.block_until_ready(logits)
    files = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return None, cache
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    return kernel_stats(trace, steps, top), cache


def kernel_stats(trace, steps: int, top: int = 40) -> dict:
    """Launches and durations per step of the GPU kernels in a perfetto trace (dict or list of
    events): kernels are complete ("X") events on threads whose name starts with "Stream"."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    stream_tids = set()
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            if str(ev.get("args", {}).get("name", "")).startswith("Stream"):
                stream_tids.add((ev.get("pid"), ev.get("tid")))
    by_name: dict[str, list] = {}
    n = 0
    total = 0.0
    spans = []
    for ev in events:
        if ev.get("ph") == "X" and (ev.get("pid"), ev.get("tid")) in stream_tids:
            n += 1
            dur = float(ev.get("dur", 0.0))
            total += dur
            spans.append((float(ev.get("ts", 0.0)), dur))
            rec = by_name.setdefault(str(ev.get("name", "?")), [0, 0.0])
            rec[0] += 1
            rec[1] += dur
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": n / steps, "kernel_us": total / steps, "busy_us": busy_time(spans) / steps,
            "by_kernel": [[name, c / steps, round(d / steps, 2)] for name, (c, d) in ranked]}


def busy_time(spans) -> float:
    """Length of the union of (start, duration) intervals: the time some kernel was on the GPU.
    Unlike the sum of durations it does not count twice a kernel launched early by programmatic
    dependent launch, whose CTAs sit at their entry wait while their predecessor runs."""
    busy, end = 0.0, float("-inf")
    for start, dur in sorted(spans):
        stop = start + dur
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


_PRESCALED: list = []   # [(state, its prescaled copy)]: one copy per benchmark state


def _prescaled(state):
    from flint_jax.nvfp4 import prescale_state
    if not _PRESCALED or _PRESCALED[0][0] is not state:
        _PRESCALED[:] = [(state, prescale_state(state))]
    return _PRESCALED[0][1]


def _fixed_routing(state):
    """The state with every MoE router weight zeroed: all logits 0, so every token selects
    experts 0 .. top_k - 1 (ties go to the lowest index) in every layer and step."""
    pairs = []
    for path, var in nnx.to_flat_state(state):
        if ".".join(str(p) for p in path).endswith("mlp.gate.weight"):
            var = var.replace(value=jnp.zeros_like(var.get_value()))
        pairs.append((path, var))
    return nnx.from_flat_state(pairs)


BENCH_OPTIONS = {"scales": ("bf16", "e4m3"), "routing": ("router", "fixed")}


def _value(v: str):
    if v.lstrip("-").isdigit():
        return int(v)
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def parse_options(options) -> tuple[dict, dict, dict]:
    """``--option key=value`` strings -> (DecodePlan fields, MoEPlan fields, bench options).

    Keys: a ``fast_decode.DecodePlan`` field (``early_trigger=false``, ``layer_end=norm``,
    ``qkv_split_k=2``, ...), ``moe.`` + a ``MoEPlan`` field (``moe.slot_rows=all``,
    ``moe.block_n_down=32``), or one of the bench's own: ``scales=e4m3`` (NVFP4: the Pallas step
    reads the state's e4m3 block scales; by default they are pre-scaled to bf16,
    ``nvfp4.prescale_state``, as ``flint_jax.load`` holds them on a GPU) and ``routing=fixed``
    (every router weight zeroed, for both paths: every token of every step selects experts
    0 .. top_k - 1, so the step reads the same expert pages each time). Unknown keys and items
    without "=" are refused."""
    import dataclasses
    from flint_jax.fast_decode import DecodePlan
    from flint_jax.pallas.moe.tiling import MoEPlan
    plan_fields = {f.name for f in dataclasses.fields(DecodePlan)} - {"moe"}
    moe_fields = {f.name for f in dataclasses.fields(MoEPlan)}
    top, moe, own = {}, {}, {}
    for item in options or ():
        for part in item.split(","):
            key, sep, v = part.partition("=")
            if not sep:
                raise ValueError(f"bad --option {part!r}: want key=value")
            if key.startswith("moe."):
                if key[4:] not in moe_fields:
                    raise ValueError(f"--option {key}: MoEPlan has no field {key[4:]!r} "
                                     f"(fields: {', '.join(sorted(moe_fields))})")
                moe[key[4:]] = _value(v)
            elif key in BENCH_OPTIONS:
                if v not in BENCH_OPTIONS[key]:
                    raise ValueError(f"--option {key}={v}: want one of {BENCH_OPTIONS[key]}")
                own[key] = v
            elif key in plan_fields:
                top[key] = _value(v)
            else:
                raise ValueError(f"--option {key}: not a DecodePlan field, moe.<MoEPlan field>, "
                                 f"scales or routing (DecodePlan fields: "
                                 f"{', '.join(sorted(plan_fields))})")
    return top, moe, own


def plan_variant(top: dict, moe: dict):
    """A function (quant, batch) -> DecodePlan for ``Flint.decode_plan``: ``decode_plan``'s
    measured choice with the given DecodePlan / MoEPlan fields replaced; None without any."""
    import dataclasses
    from flint_jax.fast_decode import decode_plan
    if not top and not moe:
        return None

    def plan(quant: bool, batch: int):
        p = decode_plan(quant, batch)
        fields = dict(top)
        if moe:
            fields["moe"] = dataclasses.replace(p.moe, **moe)
        return dataclasses.replace(p, **fields)

    plan.variant = ",".join([f"{k}={v}" for k, v in top.items()]
                            + [f"moe.{k}={v}" for k, v in moe.items()])
    return plan


def make_handle(cfg, graphdef, state, quant, path: str, options=()) -> Flint:
    """A model handle for a benchmark path: "xla" (the reference) or "pallas" (the plan:
    ``fast_decode.decode_plan``, the measured choices, changed by ``options``: see
    ``parse_options``). The Pallas path of NVFP4 weights gets its block scales pre-scaled to
    bf16 unless ``scales=e4m3``."""
    if path not in ("xla", "pallas"):
        raise ValueError(f"bad path {path!r}: xla or pallas (variants: --option key=value)")
    top, moe, own = parse_options(options)
    if path == "pallas" and quant and own.get("scales", "bf16") == "bf16":
        state = _prescaled(state)   # as `flint_jax.load` holds it for the Pallas path on a GPU
    if own.get("routing") == "fixed":    # shares every other array with the state
        state = _fixed_routing(state)
    plan = plan_variant(top, moe) if path == "pallas" else None
    return Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels=path,
                 decode_plan=plan)


def run_case(cfg, graphdef, state, quant, batch, context, paths, steps, trace, loop_block=8,
             options=()):
    """One (batch, context) case for every path; a path that fails records its error and the
    others still run."""
    from flint_jax.decode import bucket_length
    # Room for the warm-up, the timed windows and the parity logits after `context`.
    length = bucket_length(context + steps * 14 + 64, 1 << 30, minimum=256)
    tokens = jax.random.randint(jax.random.key(3), (batch,), 0, cfg.vocab_size, jnp.int32)
    floor_ms = step_bytes(cfg, batch, context, quant) / HBM_BYTES_PER_S * 1e3
    row = {"format": "nvfp4" if quant else "bf16", "batch": batch, "context": context,
           "floor_ms": floor_ms, "floor_gb": step_bytes(cfg, batch, context, quant) / 1e9}
    logits_by_path = {}
    for path in paths:
        try:
            model = make_handle(cfg, graphdef, state, quant, path, options)
            step = model.decode_logits_fn()
            cache = random_cache(cfg, batch, length, context)
            t0 = time.perf_counter()
            ms, windows, logits, cache = time_steps(step, model.leaves, cache, tokens, steps)
            row[f"{path}_step_s_incl_compile"] = time.perf_counter() - t0
            row[f"{path}_ms"] = ms
            row[f"{path}_windows_ms"] = windows
            row[f"{path}_tok_s"] = batch / ms * 1e3
            row[f"{path}_pct_floor"] = 100 * floor_ms / ms
            if loop_block:
                (row[f"{path}_loop_ms"], row[f"{path}_loop_idle_ms"],
                 cache) = time_loop(model, cache, tokens, loop_block, max(2, steps // loop_block))
                row[f"{path}_loop_pct_floor"] = 100 * floor_ms / row[f"{path}_loop_ms"]
            if trace and jax.default_backend() == "gpu":
                stats, cache = count_kernels(step, model.leaves, cache, tokens)
                if stats:
                    row[f"{path}_kernels"] = stats["kernels"]
                    row[f"{path}_kernel_us"] = stats["kernel_us"]
                    row[f"{path}_busy_us"] = stats["busy_us"]
                    row[f"{path}_by_kernel"] = stats["by_kernel"]
            # Same inputs for every path: the logits of one step from the same cache contents.
            del cache, logits
            cache = random_cache(cfg, batch, length, context)
            logits_by_path[path], cache = step(model.leaves, cache, tokens)
            del cache
        except Exception as e:  # noqa: BLE001 (a benchmark reports, then goes on)
            row[f"{path}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"[{path}] FAILED: {row[f'{path}_error'][:500]}", flush=True)
    if "xla" in logits_by_path:
        a = np.asarray(logits_by_path["xla"], np.float32)
        for p, lg in logits_by_path.items():
            if p == "xla":
                continue
            b = np.asarray(lg, np.float32)
            tag = "" if p == "pallas" else f"_{p}"
            row[f"rel_l2_pallas_vs_xla{tag}"] = rel_l2(a, b)
            row[f"argmax_equal{tag}"] = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    elif "pallas" in logits_by_path:  # a run without the XLA path: compare with the default step
        a = np.asarray(logits_by_path["pallas"], np.float32)
        for p, lg in logits_by_path.items():
            if p != "pallas":
                b = np.asarray(lg, np.float32)
                row[f"rel_l2_{p}_vs_pallas"] = rel_l2(a, b)
    if options:
        row["options"] = list(options)
    return row


def format_row(r, paths):
    parts = [f"{r['format']:5s} B={r['batch']} ctx={r['context']:6d} floor {r['floor_ms']:.3f} ms"]
    for p in paths:
        if f"{p}_ms" not in r:
            parts.append(f"{p} FAILED")
            continue
        parts.append(f"{p} {r[f'{p}_ms']:.3f} ms ({r[f'{p}_pct_floor']:.0f}% of floor"
                     + (f", {r[f'{p}_kernels']:.0f} kernels" if r.get(f"{p}_kernels") else "") + ")"
                     + (f" loop {r[f'{p}_loop_ms']:.3f} ms (from idle {r[f'{p}_loop_idle_ms']:.3f})"
                        if r.get(f"{p}_loop_ms") else ""))
    if "rel_l2_pallas_vs_xla" in r:
        parts.append(f"rel-L2 {r['rel_l2_pallas_vs_xla']:.2e}")
    return " | ".join(parts)


def table(rows, paths):
    paths = [p for p in dict.fromkeys(paths) if any(f"{p}_ms" in r for r in rows)]
    head = "| format | batch | context | floor ms |" + "".join(
        f" {p} ms/step | {p} in-loop ms/step | {p} tok/s (loop) | {p} % floor (loop) | {p} kernels |"
        for p in paths)
    sep = "|" + "---|" * (4 + 5 * len(paths))
    lines = [head, sep]
    for r in rows:
        cells = [r["format"], str(r["batch"]), str(r["context"]), f"{r['floor_ms']:.3f}"]
        for p in paths:
            if f"{p}_ms" not in r:
                cells += ["-"] * 5
                continue
            k = r.get(f"{p}_kernels")
            loop = r.get(f"{p}_loop_ms")
            cells += [f"{r[f'{p}_ms']:.3f}", f"{loop:.3f}" if loop else "-",
                      f"{r['batch'] / (loop or r[f'{p}_ms']) * 1e3:.0f}",
                      f"{100 * r['floor_ms'] / (loop or r[f'{p}_ms']):.0f}", f"{k:.0f}" if k else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args) -> int:
    cfg = preset(args.config)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    options = list(getattr(args, "option", None) or ())
    parse_options(options)   # a bad option fails before any weights are built
    results = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
               "config": args.config, "layers": cfg.num_hidden_layers, "options": options,
               "cases": []}
    print(f"device {results['device']}; {cfg.num_hidden_layers} layers; steps/window {args.steps}")
    for fmt in args.dtype:
        quant = fmt == "nvfp4"
        t0 = time.perf_counter()
        graphdef, state = build_state(cfg, quant)
        jax.block_until_ready(state)
        print(f"[{fmt}] random weights built on device in {time.perf_counter() - t0:.1f} s")
        for batch in args.batch:
            for context in args.context:
                row = run_case(cfg, graphdef, state, quant, batch, context, args.paths,
                               args.steps, args.trace, options=options)
                results["cases"].append(row)
                print(format_row(row, args.paths), flush=True)
        del state
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results["cases"], args.paths))
    return 0


