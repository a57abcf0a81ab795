"""Logits, kernel count and ms/token of the default Pallas decode step, for comparing two trees.

Run once per source tree (PYTHONPATH=TREE; TREE:TREE/benchmarks for trees before the bench moved
into ``flint_jax.bench``), each writing an .npz of the step's
fp32 logits for fixed inputs and a .json of its kernels per step and median ms per step; then
`--compare A.npz B.npz` says whether the logits are bit-identical. Used to check that a refactor
leaves the default step unchanged (docs/performance.md, "How the redesign was checked"):

    PYTHONPATH=old:old/benchmarks python3 tools/step_fingerprint.py --out $OUT/old
    PYTHONPATH=.                  python3 tools/step_fingerprint.py --out $OUT/new
    python3 tools/step_fingerprint.py --compare $OUT/old $OUT/new

Inputs: full-size random weights (`flint_jax.bench.build_state`, the same on every run), a random
cache of `--context` tokens, and `--steps` steps fed fixed random tokens; BF16 and NVFP4 at batch
1 and 8. `--config tiny` runs a small model (interpret mode on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


def _bench():
    """The decode bench's module: ``flint_jax.bench``, or benchmarks/decode_bench.py in older
    trees."""
    import flint_jax
    # Look in the tree that provides flint_jax (an editable install elsewhere must not answer).
    if os.path.exists(os.path.join(os.path.dirname(flint_jax.__file__), "bench.py")):
        from flint_jax import bench
    else:
        import decode_bench as bench
    return bench


def pallas_step(cfg, graphdef, state, quant):
    """(jitted step (leaves, cache, tokens) -> (logits, cache), leaves) of the default Pallas
    path as `flint_jax.load` sets it up (NVFP4 block scales prescaled on the GPU)."""
    decode_bench = _bench()
    handle = decode_bench.make_handle(cfg, graphdef, state, quant, "pallas")
    return handle.decode_logits_fn(), handle.leaves


def loop_ms(cfg, quant, batch, context, cache_length, built=None):
    """Steady ms per token of `generate`'s loop (blocks of 8 greedy steps, one call queued behind
    the running one: `bench.time_loop`), the figure the performance tables report. `built`:
    (graphdef, state) from `bench.build_state`, to share one format's weights between batches."""
    bench = _bench()
    graphdef, state = built or bench.build_state(cfg, quant)
    handle = bench.make_handle(cfg, graphdef, state, quant, "pallas")
    cache = bench.random_cache(cfg, batch, cache_length, context)
    tokens = jnp.zeros((batch,), jnp.int32)
    steady, idle, cache = bench.time_loop(handle, cache, tokens, 8, 4)
    del handle, state, cache
    return {"loop_ms": steady, "loop_from_idle_ms": idle}


def fingerprint(cfg, quant, batch, context, steps, cache_length, timed_steps):
    decode_bench = _bench()
    graphdef, state = decode_bench.build_state(cfg, quant)
    step, leaves = pallas_step(cfg, graphdef, state, quant)
    rng = np.random.default_rng(7)
    tokens = [jnp.asarray(rng.integers(0, cfg.vocab_size, batch), jnp.int32) for _ in range(steps)]
    cache = decode_bench.random_cache(cfg, batch, cache_length, context)
    spare = jax.tree.map(jnp.copy, cache)
    logits = []
    for t in tokens:
        out, cache = step(leaves, cache, t)
        logits.append(np.asarray(out, np.float32))
    # The same steps again from a copy of the cache: is the step reproducible in one process?
    again = []
    for t in tokens:
        out, spare = step(leaves, spare, t)
        again.append(np.asarray(out, np.float32))
    result = {"reproducible": all(np.array_equal(a, b) for a, b in zip(logits, again))}
    if jax.default_backend() == "gpu":
        ms, windows, _, cache = decode_bench.time_steps(step, leaves, cache, tokens[0], timed_steps)
        stats, cache = decode_bench.count_kernels(step, leaves, cache, tokens[0])
        result.update(ms_per_step=ms, ms_windows=windows,
                      kernels_per_step=stats and stats["kernels"])
    del state, leaves, step, cache, spare
    return np.stack(logits), result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output prefix: writes OUT.npz and OUT.json")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two output prefixes")
    p.add_argument("--config", default="flint", help="preset (default flint; tiny on the CPU)")
    p.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="steps whose logits are kept")
    p.add_argument("--timed-steps", type=int, default=20)
    p.add_argument("--loop", action="store_true",
                   help="only time generate's loop (steady ms/token) per case, no logits")
    a = p.parse_args(argv)
    if a.compare:
        ja, jb = (json.load(open(x + ".json")) for x in a.compare)
        if not os.path.exists(a.compare[0] + ".npz"):   # --loop runs: timings only
            for key in ja:
                print(f"{key:12s} steady ms/token in generate's loop {ja[key]['loop_ms']:.3f} / "
                      f"{jb[key]['loop_ms']:.3f}")
            return 0
        pa, pb = (np.load(x + ".npz") for x in a.compare)
        ok = True
        for key in pa.files:
            same = np.array_equal(pa[key], pb[key])
            diff = float(np.nanmax(np.abs(pa[key] - pb[key])))
            ra, rb = ja[key], jb[key]
            print(f"{key:12s} logits bit-identical: {same} (max |diff| {diff:.3g}); "
                  f"kernels {ra.get('kernels_per_step')} / {rb.get('kernels_per_step')}; "
                  f"ms/step {ra.get('ms_per_step', float('nan')):.3f} / "
                  f"{rb.get('ms_per_step', float('nan')):.3f}; reproducible {ra['reproducible']} / "
                  f"{rb['reproducible']}")
            ok &= same and ra.get("kernels_per_step") == rb.get("kernels_per_step")
        print("SAME" if ok else "DIFFERENT")
        return 0 if ok else 1
    from flint_jax.config import preset
    cfg = preset(a.config)
    arrays, results = {}, {}
    for fmt in a.formats:
        built = _bench().build_state(cfg, fmt == "nvfp4") if a.loop else None
        for b in a.batches:
            key = f"{fmt}_b{b}"
            cache_length = -(-(a.context + 64) // 256) * 256
            if a.loop:
                res = loop_ms(cfg, fmt == "nvfp4", b, a.context, cache_length, built)
            else:
                logits, res = fingerprint(cfg, fmt == "nvfp4", b, a.context, a.steps,
                                          cache_length, a.timed_steps)
                arrays[key] = logits
            results[key] = res
            print(key, json.dumps(res), flush=True)
        del built
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if arrays:
        np.savez(a.out + ".npz", **arrays)
    with open(a.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
