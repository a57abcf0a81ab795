"""How far the bf16 decode paths drift from an fp32 reference as depth grows (CPU, interpret).

One decode step after a prefill, on a small Flint (`small` preset: hidden 256, 16 experts, top-4)
with L layers of random weights: the logits of the XLA path (bf16), the Pallas path (bf16, its
kernels in interpret mode) and the same weights in fp32 (XLA path, "highest" matmul precision).
If the two bf16 paths are about equally far from fp32 and closer to each other than to it, their
difference is bf16 rounding noise amplified by depth, not a kernel error.

    JAX_PLATFORMS=cpu python benchmarks/depth_study.py --layers 10 49 --format bf16 nvfp4
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flint_jax
from flint_jax.decode import prefill
from flint_jax.decode import Flint
from flint_jax.model import FlintForCausalLM


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def one_step_logits(model: Flint, rows, token):
    _, cache = prefill(model, rows, cache_length=256)
    logits, _ = model.decode_logits_fn()(model.leaves, cache, token)
    return np.asarray(logits, np.float32)


def study(layers: int, quant: bool, prompt_len: int, seed: int) -> dict:
    cfg = flint_jax.preset("small", num_hidden_layers=layers)
    mod = FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(seed))
    bf16 = flint_jax.from_module(mod, kernels="xla")
    # The same weights in fp32 (bf16 -> fp32 is exact; NVFP4 blocks and scales are unchanged).
    state32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                           bf16.state)
    f32 = Flint(config=cfg, graphdef=bf16.graphdef, state=state32, dtype=jnp.float32, quant=quant,
                kernels="xla")
    pal = Flint(config=cfg, graphdef=bf16.graphdef, state=bf16.state, dtype=bf16.dtype,
                quant=quant, kernels="pallas")
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, cfg.vocab_size, prompt_len).tolist(),
            rng.integers(0, cfg.vocab_size, prompt_len - 17).tolist()]
    token = jnp.asarray(rng.integers(0, cfg.vocab_size, 2), jnp.int32)
    with jax.default_matmul_precision("highest"):
        ref = one_step_logits(f32, rows, token)
    x = one_step_logits(bf16, rows, token)
    p = one_step_logits(pal, rows, token)
    return {"layers": layers, "format": "nvfp4" if quant else "bf16",
            "xla_vs_fp32": rel(x, ref), "pallas_vs_fp32": rel(p, ref), "pallas_vs_xla": rel(p, x),
            "argmax_xla_fp32": float(np.mean(x.argmax(-1) == ref.argmax(-1))),
            "argmax_pallas_fp32": float(np.mean(p.argmax(-1) == ref.argmax(-1)))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 49])
    ap.add_argument("--format", nargs="+", choices=["bf16", "nvfp4"], default=["bf16", "nvfp4"])
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for fmt in a.format:
        for n in a.layers:
            t0 = time.perf_counter()
            r = study(n, fmt == "nvfp4", a.prompt_len, a.seed)
            r["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
