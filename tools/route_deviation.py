"""Issue 45: where the Pallas step's logits leave the XLA step's, per step and per MoE layer:
the router top-k sets of both paths and the XLA path's k-th / (k+1)-th sigmoid-score margin.

Both paths' router logits are recorded on the host (``jax.debug.callback``) from the ops that
compute them: ``layers.router_topk`` (XLA) and the Pallas step's ``add_rms_norm_router`` /
``router_logits``. Teacher-forced from copies of one XLA-prefilled cache.

  python tools/route_deviation.py [--std 0.08] [--steps 8] [--seed 0] [--kw "dict(...)"]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flint_jax
from flint_jax import fast_decode, layers
from flint_jax.decode import Flint, prefill

import os, sys  # noqa: E401
sys.path.insert(0, os.path.dirname(__file__))
from shape_sweep import build  # noqa: E402

REC = {"xla": [], "pallas": []}


def _tap(name):
    def cb(lg):
        REC[name].append(np.asarray(lg, np.float32))
    return cb


def patch():
    rt = layers.router_topk

    def router_topk(x, w, k, norm=True):
        lg = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32),
                                 (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
        jax.debug.callback(_tap("xla"), lg)
        return rt(x, w, k, norm)
    layers.router_topk = router_topk
    arn = fast_decode.add_rms_norm_router

    def add_rms_norm_router(*a, **kw):
        out = arn(*a, **kw)
        jax.debug.callback(_tap("pallas"), out[2])
        return out
    fast_decode.add_rms_norm_router = add_rms_norm_router
    rl = fast_decode.router_logits

    def router_logits(*a, **kw):
        out = rl(*a, **kw)
        jax.debug.callback(_tap("pallas"), out)
        return out
    fast_decode.router_logits = router_logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--std", type=float, default=0.08)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kw", default="{}")
    a = ap.parse_args()
    patch()
    cfg = flint_jax.preset("tiny", **eval(a.kw))
    k = cfg.num_experts_per_tok
    module = build(cfg, False, a.seed, a.std)
    graphdef, state = nnx.split(module)
    xla = Flint(config=cfg, graphdef=graphdef, state=state, kernels="xla")
    pal = Flint(config=cfg, graphdef=graphdef, state=state, kernels="pallas")
    rng = np.random.default_rng(a.seed)
    rows = [rng.integers(0, cfg.vocab_size, size=int(rng.integers(5, 60))).tolist()
            for _ in range(a.batch)]
    logits, cache0 = prefill(xla, rows, cache_length=128)
    cx, cp = jax.tree.map(jnp.copy, cache0), jax.tree.map(jnp.copy, cache0)
    fx, fp = xla.decode_logits_fn(), pal.decode_logits_fn()
    t = jnp.argmax(logits, -1).astype(jnp.int32)
    for s in range(a.steps):
        REC["xla"].clear(); REC["pallas"].clear()  # noqa: E702
        lx, cx = fx(xla.leaves, cx, t)
        lp, cp = fp(pal.leaves, cp, t)
        jax.effects_barrier()
        x_, p_ = np.asarray(lx, np.float32), np.asarray(lp, np.float32)
        rel = np.linalg.norm(x_ - p_) / np.linalg.norm(x_)
        top2 = np.sort(x_, -1)[:, -2:]
        print(f"step {s}: rel-L2 {rel:.4f}  XLA top-2 logit margin {(top2[:, 1] - top2[:, 0]).round(3)}")
        for layer, (gx, gp) in enumerate(zip(REC["xla"], REC["pallas"])):
            sx, sp = 1 / (1 + np.exp(-gx)), 1 / (1 + np.exp(-gp))
            for r in range(gx.shape[0]):
                ox, op = np.argsort(-sx[r], kind="stable"), np.argsort(-sp[r], kind="stable")
                setx, setp = set(ox[:k].tolist()), set(op[:k].tolist())
                margin = sx[r, ox[k - 1]] - sx[r, ox[k]] if k < len(ox) else np.inf
                dl = np.abs(gx[r] - gp[r]).max()
                flag = "" if setx == setp else "  <-- FLIP"
                print(f"  moe {layer} row {r}: xla {sorted(setx)} pallas {sorted(setp)} "
                      f"k/k+1 score margin {margin:.2e} max|dlogit| {dl:.2e}{flag}")
        t = jnp.argmax(lx, -1).astype(jnp.int32)


if __name__ == "__main__":
    main()
