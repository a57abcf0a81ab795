"""Issue 45: random valid Flint configurations, the Pallas step (interpret mode on CPU) against
the XLA step, teacher-forced from copies of one XLA-prefilled cache. Per step: the logits'
relative L2 distance and, per MoE layer, the router top-k sets of both paths and the XLA
path's k-th / (k+1)-th sigmoid-score margin.

  python tools/shape_sweep.py N [START] [--std 0.08]
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flint_jax
from flint_jax import loading
from flint_jax.decode import Flint, prefill
from flint_jax.model import FlintForCausalLM


def sample_cfg(rng, quant):
    """A random Flint configuration (3-4 layers, the first dense). 8 query heads per KV head
    is Flint's ratio; expert counts need not be powers of two (no kernel blocks E); about half
    the NVFP4 vocabularies are multiples of 16, so the NVFP4 LM head kernel runs."""
    pick = lambda xs: int(rng.choice(xs))  # noqa: E731
    q64 = [64, 128, 192] if quant else None
    hd = pick([16, 32, 64, 128])
    kvh = pick([1, 2, 4])
    grp = pick([1, 2, 4, 8])
    e = pick([4, 6, 8, 12, 16, 24, 32])
    k = int(rng.integers(1, min(8, e) + 1))
    kw = dict(hidden_size=pick(q64 or [32, 48, 64, 96, 128, 160]), head_dim=hd,
              num_key_value_heads=kvh, num_attention_heads=kvh * grp, num_experts=e,
              num_experts_per_tok=k, moe_intermediate_size=pick(q64 or [16, 32, 48, 64, 96]),
              shared_expert_intermediate_size=pick(q64 or [16, 32, 48, 64, 96, 128]),
              intermediate_size=pick(q64 or [32, 64, 96, 192]),
              vocab_size=int(rng.integers(100, 400)), sliding_window=int(rng.integers(3, 40)),
              num_hidden_layers=pick([3, 4]), mlp_only_layers=(0,), layer_types=())
    if quant and rng.random() < 0.5:   # drawn last: the fields above keep their draws
        kw["vocab_size"] = kw["vocab_size"] // 16 * 16
    return flint_jax.preset("tiny", **kw)


def realistic(state, rng, std):
    """Weights at std ``std``; norm weights 1 + 0.3 N(0, 1), sinks 2 N(0, 1) (std > 0.02)."""
    flat = nnx.to_flat_state(state)
    out = []
    for path, v in flat:
        name = "/".join(map(str, path))
        a = v[...]
        if a.dtype in (jnp.bfloat16, jnp.float32) and std != 0.02:
            if name.endswith("norm/weight") or "layernorm" in name:
                a = (1 + 0.3 * rng.standard_normal(a.shape)).astype(a.dtype)
            elif name.endswith("sinks"):
                a = (2 * rng.standard_normal(a.shape)).astype(a.dtype)
            elif a.ndim >= 2:
                a = (std * rng.standard_normal(a.shape)).astype(a.dtype)
        out.append((path, v.replace(jnp.asarray(a))))
    return nnx.from_flat_state(out)


def build(cfg, quant, seed, std=0.02):
    module = FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(seed))
    if std != 0.02:
        if quant:   # draw BF16 weights at the scale, then quantize as the project does
            raise NotImplementedError("std != 0.02 with NVFP4")
        graphdef, state = nnx.split(module)
        state = realistic(state, np.random.default_rng(seed), std)
        module = nnx.merge(graphdef, state)
    return module


def run(cfg, quant, *, seed=0, steps=4, batch=1, std=0.02, cache_length=128):
    module = build(cfg, quant, seed, std)
    graphdef, state = nnx.split(module)
    kernels = loading.resolve_kernels("pallas", cfg, quant=quant, dtype=module.dtype)
    xla = Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels="xla")
    pal = Flint(config=cfg, graphdef=graphdef, state=state, quant=quant, kernels=kernels)
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, cfg.vocab_size, size=int(rng.integers(5, 60))).tolist()
            for _ in range(batch)]
    logits, cache0 = prefill(xla, rows, cache_length=cache_length)
    cx = jax.tree.map(jnp.copy, cache0)
    cp = jax.tree.map(jnp.copy, cache0)
    fx, fp = xla.decode_logits_fn(), pal.decode_logits_fn()
    t = jnp.argmax(logits, -1).astype(jnp.int32)
    out = []
    for _ in range(steps):
        lx, cx = fx(xla.leaves, cx, t)
        lp, cp = fp(pal.leaves, cp, t)
        a, b = np.asarray(lx, np.float32), np.asarray(lp, np.float32)
        if np.isnan(b).any():
            out.append(float("nan"))
        else:
            out.append(float(np.linalg.norm(a - b) / np.linalg.norm(a)))
        t = jnp.argmax(lx, -1).astype(jnp.int32)
    return out


def describe(cfg, quant):
    return dict(quant=quant, h=cfg.hidden_size, hd=cfg.head_dim, H=cfg.num_attention_heads,
                kvh=cfg.num_key_value_heads, E=cfg.num_experts, k=cfg.num_experts_per_tok,
                mi=cfg.moe_intermediate_size, si=cfg.shared_expert_intermediate_size,
                di=cfg.intermediate_size, V=cfg.vocab_size, w=cfg.sliding_window,
                L=cfg.num_hidden_layers)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("start", type=int, nargs="?", default=0)
    ap.add_argument("--std", type=float, default=0.02)
    a = ap.parse_args()
    for i in range(a.start, a.start + a.n):
        rng = np.random.default_rng(1000 + i)
        quant = bool(i % 2) and a.std == 0.02
        cfg = sample_cfg(rng, quant)
        t0 = time.time()
        try:
            res = [round(r, 5) for r in run(cfg, quant, batch=1 + 2 * (i % 3 == 0), std=a.std)]
        except Exception as e:  # noqa: BLE001
            res = "ERR " + str(e).splitlines()[0][:200]
        print(i, json.dumps(describe(cfg, quant)), res, f"{time.time() - t0:.0f}s", flush=True)
