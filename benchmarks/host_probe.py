"""Where a decode call's host time goes (perf log 79 left it open: ~4-5 ms per call whatever
its steps, run 127).

Every figure is the host time of one call, from the call to its return (the work enqueued), with
the device idle before it; medians over `--reps` calls.

Part 1, synthetic (no model):
- `args[N]`: a jitted function of N small arrays (all kept: `keep_unused=True`) that adds 1 to
  the first: what each array argument costs the dispatch;
- `chain[K][mode]`: K elementwise kernels in a chain (optimization barriers keep them apart, so
  XLA records K commands into one command buffer), the chain's input and output buffers
  `fixed` (the same input each call, the output dropped before the next), `chain` (each call
  takes the previous output, not donated: the addresses alternate), `donated` (the same, the
  input donated: the output lands where the input was) or `kept` (every output kept alive: a
  new output address each call). If the command buffer is re-recorded when an address changes,
  `kept` and `chain` cost more than `fixed` and `donated` by ~K times a command's update.

Part 2, the model (`--format`, full size, random weights on the device):
- `leaves`: how many arrays a decode call takes;
- `step[mode]`: the one-step decode (`decode_logits_fn`: cache donated) with `fresh` tokens
  (each call's argmax, as a loop passes them) or the `same` token array every call, or `stable`:
  the same tokens and the logits written into a donated buffer, so that no input or output
  changes its address between calls.

Run it once with XLA's default flags and once with `XLA_FLAGS=--xla_gpu_enable_command_buffer=`
(no command buffers) for the comparison (`TF_CPP_VMODULE=command_buffer_thunk=3`, which would
log XLA's command-buffer updates, is not read by jaxlib 0.11.2: run 138 logged nothing):

    python3 benchmarks/host_probe.py --format nvfp4 --out $OUT/host.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp


def _dispatch_ms(call, reps: int) -> dict:
    """Median / min host ms of `call()` (which returns what it dispatched), device idle first."""
    jax.block_until_ready(call())          # compile, warm up, record the command buffer
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}


def args_probe(counts, reps: int) -> dict:
    out = {}
    for n in counts:
        xs = [jnp.full((16,), i, jnp.float32) for i in range(n)]
        f = jax.jit(lambda *a: a[0] + 1, keep_unused=True)
        out[str(n)] = _dispatch_ms(lambda: f(*xs), reps)
    return out


def _chain(x, k: int):
    for _ in range(k):
        x = jax.lax.optimization_barrier(jnp.sin(x) * 0.5 + 0.25)
    return x


def chain_probe(kernels, reps: int, size: int = 4096) -> dict:
    out = {}
    for k in kernels:
        f = jax.jit(lambda x, k=k: _chain(x, k))
        fd = jax.jit(lambda x, k=k: _chain(x, k), donate_argnums=0)
        x0 = jnp.linspace(0, 1, size, dtype=jnp.float32)
        res, state, kept = {}, {"x": x0 + 0}, []
        res["fixed"] = _dispatch_ms(lambda: f(x0), reps)

        def chained(fn):
            state["x"] = fn(state["x"])
            return state["x"]
        res["chain"] = _dispatch_ms(lambda: chained(f), reps)
        res["donated"] = _dispatch_ms(lambda: chained(fd), reps)

        def keep():
            kept.append(f(x0))
            return kept[-1]
        res["kept"] = _dispatch_ms(keep, reps)
        out[str(k)] = res
        print(f"chain K={k}: " + ", ".join(f"{m} {v['median_ms']:.3f}" for m, v in res.items())
              + " ms", flush=True)
    return out


def model_probe(fmt: str, batch: int, context: int, reps: int, config: str = "flint") -> dict:
    import decode_bench
    from flint_jax.config import preset
    cfg = preset(config)
    quant = fmt == "nvfp4"
    graphdef, state = decode_bench.build_state(cfg, quant)
    model = decode_bench.make_handle(cfg, graphdef, state, quant, "pallas")
    step = model.decode_logits_fn()
    length = 1 << (context + 64 * reps).bit_length()
    st = {"cache": decode_bench.random_cache(cfg, batch, length, context)}
    same = jax.random.randint(jax.random.key(3), (batch,), 0, cfg.vocab_size, jnp.int32)
    st["tokens"] = same

    def call(fresh: bool):
        logits, st["cache"] = step(model.leaves, st["cache"], st["tokens"] if fresh else same)
        if fresh:
            st["tokens"] = jnp.argmax(logits, -1).astype(jnp.int32)
        return logits

    # `stable`: the same step with the logits written into a donated buffer of theirs, so with
    # the same tokens every input and output keeps its address from call to call.
    raw, unflatten = model.decode_logits_fn_raw(), model._unflatten()
    # (keep_unused: jit would otherwise drop the unread buffer, and with it the aliasing)
    stable_step = jax.jit(lambda leaves, cache, tokens, buf: raw(unflatten(leaves), cache, tokens),
                          donate_argnums=(1, 3), keep_unused=True)
    st["buf"] = jnp.zeros((batch, cfg.vocab_size), jnp.float32)

    def call_stable():
        st["buf"], st["cache"] = stable_step(model.leaves, st["cache"], same, st["buf"])
        return st["buf"]

    def addresses():
        return (st["buf"].unsafe_buffer_pointer(),
                jax.tree.leaves(st["cache"])[0].unsafe_buffer_pointer())

    out = {"leaves": len(model.leaves), "step": {}}
    for mode in ("same", "fresh", "stable"):
        fn = call_stable if mode == "stable" else (lambda: call(mode == "fresh"))
        if mode == "stable":
            call_stable()
            before = addresses()
        out["step"][mode] = r = _dispatch_ms(fn, reps)
        if mode == "stable":   # what the mode is for: no buffer moved
            out["stable_kept_addresses"] = addresses() == before
        kept = (f"; addresses kept: {out['stable_kept_addresses']}" if mode == "stable" else "")
        print(f"[{fmt} B={batch}] one-step decode, {mode} tokens: dispatch {r['median_ms']:.3f} "
              f"ms (min {r['min_ms']:.3f}); {out['leaves']} array arguments{kept}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--args", default="1,64,256,1024", help="argument counts of part 1")
    ap.add_argument("--kernels", default="8,64,350", help="chain lengths of part 1")
    ap.add_argument("--format", default="nvfp4", help="bf16, nvfp4 or '' (no part 2)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--config", default="flint", help="model preset (tiny: a CPU smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""),
           "vmodule": os.environ.get("TF_CPP_VMODULE", ""), "backend": jax.default_backend()}
    res["args"] = args_probe([int(n) for n in a.args.split(",") if n], a.reps)
    print("args: " + ", ".join(f"{n} {v['median_ms']:.3f}" for n, v in res["args"].items())
          + " ms", flush=True)
    res["chain"] = chain_probe([int(k) for k in a.kernels.split(",") if k], a.reps)
    if a.format:
        res["model"] = model_probe(a.format, a.batch, a.context, a.reps, a.config)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
