"""Where the in-loop decode time goes beyond the kernels: host dispatch against GPU time.

Up to run 126 the suite's in-loop figure timed windows of 2 calls of `generate`'s 8-step device
loop, each window starting from an idle device, so the first call's host dispatch was on the
clock (perf log 79). This probe separates the two, for one path at one (batch, context), full-size
random weights built on the device:

- `dispatch_ms`: host time of one call, the device idle before it (the call returns once its
  work is enqueued);
- `call_ms`: the same call waited for (dispatch + whatever GPU time it does not hide);
- `steady_ms[calls]`: per-step time of windows of `calls` back-to-back calls from an idle device
  (calls = 2 was the suite's in-loop figure up to run 126; more calls hide each dispatch under
  the previous call's GPU work);
- `loop_steady_ms`: per-step time with one call always queued ahead, as `stream_generate` runs
  (the suite's in-loop figure from run 128, `decode_bench.time_loop`);
- `generate_ms_per_token`: `flint_jax.generate` itself (greedy, no stop tokens) timed for two
  lengths from the same prompt, per token of the difference (prefill and the first dispatch
  cancel out), medians of 3 runs each after one that compiles;
- `caches` (`--caches`): the steady per-step time and the kernel busy time of the same decode
  loop from a cache that the model prefilled from a random prompt (as `generate` decodes)
  against the suite's random cache (N(0, 0.5) keys and values) at the same context and
  length, each starting from the same token, with the kernels' per-step time from a trace:
  whether what the loop decodes from changes the kernels' speed.

    python3 benchmarks/dispatch_probe.py --format nvfp4 --out $OUT/dispatch.json

Run it once per XLA_FLAGS setting (e.g. `--xla_gpu_enable_command_buffer=` for no graphs): the
flags are read when jax starts. (Runs 127-128 also summarised the loop's optimised HLO,
`--hlo-out`: command buffers are formed on XLA's thunks after the HLO, so it showed none, and the
option is gone.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

import decode_bench
from flint_jax.config import preset
from flint_jax.decode import bucket_length
from flint_jax.sampling import SamplingParams


def _median_ms(xs):
    return statistics.median(xs) * 1e3


def probe(fn, leaves, make_cache, tokens, n_steps: int, calls_list, windows: int) -> dict:
    """Dispatch, waited-call and steady per-step times (ms) of the decode loop `fn`; every
    setting starts from a fresh cache at the same context, so none runs at longer contexts."""
    rng, seen = jax.random.key(0), None
    toks, _, cache, seen, rng = fn(leaves, make_cache(), tokens, rng, seen)  # compile + warm up
    jax.block_until_ready(toks)
    toks, _, cache, seen, rng = fn(leaves, cache, toks[:, -1], rng, seen)
    jax.block_until_ready(toks)
    dispatch, waited = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        toks, _, cache, seen, rng = fn(leaves, cache, toks[:, -1], rng, seen)
        t1 = time.perf_counter()
        jax.block_until_ready(toks)
        dispatch.append(t1 - t0)
        waited.append(time.perf_counter() - t0)
    out = {"n_steps": n_steps, "dispatch_ms": _median_ms(dispatch),
           "dispatch_all_ms": [x * 1e3 for x in dispatch], "call_ms": _median_ms(waited),
           "steady_ms": {}}
    for calls in calls_list:
        del cache
        cache = make_cache()
        toks, _, cache, seen, rng = fn(leaves, cache, toks[:, -1], rng, seen)
        per = []
        for _ in range(windows):
            t0 = time.perf_counter()
            for _ in range(calls):
                toks, _, cache, seen, rng = fn(leaves, cache, toks[:, -1], rng, seen)
            jax.block_until_ready(toks)
            per.append((time.perf_counter() - t0) / (calls * n_steps))
        out["steady_ms"][str(calls)] = _median_ms(per)
    return out


def time_generate(model, batch: int, prompt_len: int, lengths, reps: int = 3) -> dict:
    """Wall time of `generate` (greedy, no stop) at two lengths, ms per token of the difference
    of the medians of `reps` runs each, the lengths interleaved (one run of each first, to
    compile). One run per length (runs 130-131) was not enough: a ~40 ms hiccup in either moves
    the per-token figure by 0.15 ms (run 136)."""
    from flint_jax.decode import generate
    rows = jax.random.randint(jax.random.key(5), (batch, prompt_len), 0,
                              model.config.vocab_size, jnp.int32).tolist()
    walls = {n: [] for n in lengths}
    for rep in range(reps + 1):
        for n in lengths:
            t0 = time.perf_counter()
            out = generate(model, rows, max_new_tokens=n, temperature=0.0, stop_token_ids=[])
            if rep:                 # rep 0 compiles
                walls[n].append(time.perf_counter() - t0)
            assert all(len(o) == n for o in out), [len(o) for o in out]
    lo, hi = min(lengths), max(lengths)
    med = {n: statistics.median(w) for n, w in walls.items()}
    return {"wall_s": {str(n): w for n, w in walls.items()},
            "ms_per_token": (med[hi] - med[lo]) * 1e3 / (hi - lo),
            "ms_per_token_range": [(min(walls[hi]) - max(walls[lo])) * 1e3 / (hi - lo),
                                   (max(walls[hi]) - min(walls[lo])) * 1e3 / (hi - lo)]}


def compare_caches(model, cfg, batch: int, prompt_len: int, block: int, windows: int) -> dict:
    """Steady loop time and kernel busy time from a prefilled cache against a random one (see
    the module docstring). Both caches: context `prompt_len`, the length `generate` would take
    for 289 new tokens; the first token is the prompt's greedy continuation in both."""
    from flint_jax.decode import prefill
    rows = jax.random.randint(jax.random.key(5), (batch, prompt_len), 0, cfg.vocab_size,
                              jnp.int32).tolist()
    length = bucket_length(prompt_len + 289, model.max_length)
    first = None

    def make(kind):
        nonlocal first
        if kind == "random":
            return decode_bench.random_cache(cfg, batch, length, prompt_len)
        logits, cache = prefill(model, rows, length)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        return cache

    out = {"length": length, "prompt_len": prompt_len}
    step = model.decode_logits_fn()
    # the first prefilled pass pays the prefill's compile; kept apart as "prefilled_first"
    for label, kind in (("prefilled_first", "prefilled"), ("random", "random"),
                        ("prefilled", "prefilled")):
        t_start = time.time()     # wall clock, to line up with an nvidia-smi log
        cache = make(kind)
        steady, idle, cache = decode_bench.time_loop(model, cache, first, block, 4, windows)
        del cache
        stats, cache = decode_bench.count_kernels(step, model.leaves, make(kind), first)
        del cache
        out[label] = {"loop_steady_ms": steady, "loop_idle_ms": idle, "t_start": t_start,
                      "t_end": time.time(),
                     **({k: stats[k] for k in ("kernels", "kernel_us", "busy_us", "by_kernel")}
                        if stats else {})}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=("bf16", "nvfp4"), default="nvfp4")
    ap.add_argument("--path", default="pallas", help="a decode_bench path name (default: pallas)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--blocks", default="1,8,32", help="decode steps per device call")
    ap.add_argument("--calls", default="2,6,16", help="calls per timed window")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--generate", default="33,289",
                    help="two max_new_tokens for the generate() timing ('' to skip)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--caches", action="store_true",
                    help="also time the loop from a prefilled cache against a random one")
    ap.add_argument("--config", default="flint", help="model preset (tiny: a CPU smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    cfg = preset(a.config)
    quant = a.format == "nvfp4"
    t0 = time.perf_counter()
    graphdef, state = decode_bench.build_state(cfg, quant)
    model = decode_bench.make_handle(cfg, graphdef, state, quant, a.path)
    blocks = [int(b) for b in a.blocks.split(",")]
    calls_list = [int(c) for c in a.calls.split(",")]
    longest = max(blocks) * (max(calls_list) * a.windows + 20)
    length = bucket_length(a.context + longest + 64, 1 << 30, minimum=256)
    res = {"format": a.format, "path": a.path, "batch": a.batch, "context": a.context,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "weights_s": time.perf_counter() - t0,
           "blocks": {}}
    tokens = jax.random.randint(jax.random.key(3), (a.batch,), 0, cfg.vocab_size, jnp.int32)
    for n in blocks:
        fn = model.decode_fn(SamplingParams(temperature=0.0), False, n)
        def make_cache():
            return decode_bench.random_cache(cfg, a.batch, length, a.context)
        r = probe(fn, model.leaves, make_cache, tokens, n, calls_list, a.windows)
        # The suite's two in-loop figures (decode_bench.time_loop), 4 calls per window.
        r["loop_steady_ms"], r["loop_idle_ms"], _ = decode_bench.time_loop(
            model, make_cache(), tokens, n, 4, a.windows)
        res["blocks"][str(n)] = r
        print(f"[{a.format} {a.path} B={a.batch} ctx={a.context}] {n} steps/call: dispatch "
              f"{r['dispatch_ms']:.3f} ms, waited call {r['call_ms']:.3f} ms, per step at "
              + ", ".join(f"{c} calls {v:.3f}" for c, v in r["steady_ms"].items())
              + f"; one call queued ahead {r['loop_steady_ms']:.3f}", flush=True)
    if a.caches:
        res["caches"] = c = compare_caches(model, cfg, a.batch, a.prompt_len, blocks[0],
                                           a.windows)
        print(f"[{a.format} {a.path} B={a.batch}] caches (context {a.prompt_len}, length "
              f"{c['length']}): " + "; ".join(
                  f"{k} steady {c[k]['loop_steady_ms']:.3f} ms, busy {c[k].get('busy_us', 0):.0f} "
                  f"us" for k in ("prefilled", "random")), flush=True)
    if a.generate:
        t_start = time.time()
        res["generate"] = time_generate(model, a.batch, a.prompt_len,
                                        [int(n) for n in a.generate.split(",")])
        res["generate"].update(t_start=t_start, t_end=time.time())
        print(f"[{a.format} {a.path} B={a.batch}] generate(): {res['generate']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
