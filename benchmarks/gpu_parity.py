"""Full-size Flint (49 layers, random weights built on the GPU): the Pallas decode path against
the XLA path, for BF16 and NVFP4 weights.

Both paths start from the same prefilled cache (prefill runs on the XLA path) and decode greedily,
each feeding back its own tokens: the report gives the logits' relative L2 error at every step and
whether the greedy tokens are identical for all steps.

    python benchmarks/gpu_parity.py --steps 32 --out parity.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax.config import preset
from flint_jax.engine import Flint

import decode_bench


def run(fmt: str, cfg, steps: int, batch: int, prompt_len: int):
    quant = fmt == "nvfp4"
    t0 = time.perf_counter()
    graphdef, state = decode_bench.build_state(cfg, quant)
    jax.block_until_ready(state)
    built = time.perf_counter() - t0
    xla = Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels="xla")
    pal = Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels="pallas")
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, size=prompt_len).tolist() for _ in range(batch)]
    from flint_jax.decode import prefill
    out = {"format": fmt, "batch": batch, "prompt_len": prompt_len, "build_s": built}
    tokens = {}
    errs = []
    caches = {}
    for name in ("xla", "pallas"):
        logits, caches[name] = prefill(xla, rows, cache_length=1024, chunk_size=256)
        tokens[name] = [np.asarray(jnp.argmax(logits, -1))]
    steps_x, steps_p = xla.decode_logits_fn(), pal.decode_logits_fn()
    tx = jnp.asarray(tokens["xla"][0], jnp.int32)
    tp = jnp.asarray(tokens["pallas"][0], jnp.int32)
    for i in range(steps):
        lx, caches["xla"] = steps_x(state, caches["xla"], tx)
        lp, caches["pallas"] = steps_p(state, caches["pallas"], tp)
        a, b = np.asarray(lx, np.float32), np.asarray(lp, np.float32)
        if np.array_equal(np.asarray(tx), np.asarray(tp)):  # same inputs so far: compare logits
            errs.append(float(np.linalg.norm(a - b) / np.linalg.norm(a)))
        tx, tp = jnp.argmax(lx, -1).astype(jnp.int32), jnp.argmax(lp, -1).astype(jnp.int32)
        tokens["xla"].append(np.asarray(tx))
        tokens["pallas"].append(np.asarray(tp))
    same = [bool(np.array_equal(x, p)) for x, p in zip(tokens["xla"], tokens["pallas"])]
    out.update(steps=steps, tokens_identical=all(same),
               first_divergence=None if all(same) else same.index(False),
               rel_l2_per_step=errs, rel_l2_max=max(errs) if errs else None,
               xla_tokens=np.stack(tokens["xla"], 1).tolist())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--config", default="flint")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = preset(a.config)
    if a.layers:
        cfg = cfg.replace(num_hidden_layers=a.layers)
    results = []
    for fmt in a.formats:
        r = run(fmt, cfg, a.steps, a.batch, a.prompt_len)
        results.append(r)
        print(f"[{fmt}] tokens identical over {a.steps} steps: {r['tokens_identical']} "
              f"(first divergence {r['first_divergence']}); logits rel-L2 max {r['rel_l2_max']:.2e}",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
