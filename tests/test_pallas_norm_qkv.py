"""norm_qkv (residual update + RMSNorm folded into the fused q|k|v GEMV) vs the unfused ops.

The contract is bit-level against the unfused Pallas kernels (``moe_combine_add_rms_norm`` /
``add_rms_norm`` / ``rms_norm``, then ``multi_gemv`` with the same tile knobs): s, the kernel's x
(``return_x``) and the GEMV outputs are equal bit for bit. The plain-jnp references are only
*close*: XLA (``xla_allow_excess_precision``, on by default) may keep the fused ``h + y`` in fp32
before the norm instead of rounding s to bf16 first (a quarter of the x elements differ by a
bf16 ulp on these inputs), and ``moe_route_weights`` sums the top-k sigmoids with ``jnp.sum``
where the kernels add them in order (tied logits expose it in s).

MoE mode takes the selected router logits [M, top_k] (``moe_decode_routed``'s ``route.logits``,
here ``moe_topk_route``'s: equal bit for bit, tests/test_pallas_moe.py).

Interpret mode starts every Pallas output as NaN, so a tile or a row no program writes fails the
equality checks. BF16 weights only (the NVFP4 form was retired after 35c0874).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.add_rms_norm import add_rms_norm, rms_norm
from flint_jax.pallas.moe import moe_combine_add_rms_norm, moe_topk_route
from flint_jax.pallas.multi_gemv import multi_gemv
from flint_jax.pallas.norm_qkv import norm_qkv, norm_qkv_reference
from pallas_testing import assert_close, randn, random_nvfp4, rng, tie_logits

INTERPRET = jax.default_backend() == "cpu"
QKV_SMALL = (128, 64, 64)


def make_case(fmt, mode, m, d, e, top_k, ns, ties, *params):
  gen = rng("norm_qkv", fmt, mode, m, d, e, top_k, ns, ties, *params)
  ws = tuple(randn(gen, (n, d), scale=(i + 1) * d ** -0.5) for i, n in enumerate(ns))
  h = randn(gen, (m, d), scale=4.0)
  w = randn(gen, (d,), scale=0.3) + 1
  kw = {}
  if mode == "moe":
    lg = tie_logits(gen, m, e) if ties else randn(gen, (m, e), jnp.float32, 2.0)
    kw = dict(y=randn(gen, (m * top_k + 1, m, d)),
              top_logits=moe_topk_route(lg, top_k=top_k).logits)
  elif mode == "dense":
    kw = dict(y=randn(gen, (m, d)))
  return h, ws, w, kw


def unfused(mode, h, w, kw):
  """(s, x) of the unfused Pallas kernels."""
  if mode == "moe":
    return moe_combine_add_rms_norm(h, kw["y"], kw["top_logits"], w, interpret=INTERPRET)
  if mode == "dense":
    return add_rms_norm(h, kw["y"], w, interpret=INTERPRET)
  return h, rms_norm(h, w, interpret=INTERPRET)


def assert_equal(a, b, what):
  assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} {b.shape} {b.dtype}"
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.isfinite(a).all(), f"{what}: non-finite values"
  bad = a != b
  assert not bad.any(), (f"{what}: {bad.sum()} / {bad.size} values differ, first at "
                         f"{np.argwhere(bad)[0].tolist()}: {a[bad][0]} vs {b[bad][0]}")


CASES = [
    # fmt, mode, m, d, e, top_k, ns, ties, kw
    ("bf16", "moe", 1, 256, 16, 6, QKV_SMALL, False, {}),                         # swap
    ("bf16", "moe", 3, 256, 20, 4, QKV_SMALL, True, dict(method="dot", block_d=64)),
    ("bf16", "moe", 8, 256, 16, 2, QKV_SMALL, False, dict(block_k=64, block_d=128)),
    ("bf16", "dense", 3, 256, 0, 0, QKV_SMALL, False, {}),
    ("bf16", "dense", 8, 192, 0, 0, (64, 32, 32, 16), False, dict(method="swap", block_d=64)),
    ("bf16", "norm", 1, 256, 0, 0, QKV_SMALL, False, dict(method="dot")),
    ("bf16", "dense", 1, 128, 0, 0, (64, 32), False, dict(block_k=64, block_d=32)),
    ("bf16", "norm", 3, 192, 0, 0, (64, 32, 32), False, {}),
]


@pytest.mark.parametrize("fmt,mode,m,d,e,top_k,ns,ties,kw", CASES)
def test_norm_qkv(fmt, mode, m, d, e, top_k, ns, ties, kw):
  h, ws, w, ykw = make_case(fmt, mode, m, d, e, top_k, ns, ties, kw)
  s, outs, x = norm_qkv(h, ws, w, **ykw, return_x=True, interpret=INTERPRET, **kw)
  s_ref, outs_ref = norm_qkv_reference(h, ws, w, **ykw)
  s_k, x_k = unfused(mode, h, w, ykw)
  assert_equal(s, s_k, "s vs unfused kernel")
  # vs the plain-jnp reference: equal up to its summation order of the top-k sigmoids
  # (jnp.sum there, a sequential sum in the kernels: tied logits show the difference) and XLA's
  # excess precision
  assert_close(s, s_ref, what="s vs reference")
  assert_equal(x, x_k, "x vs unfused kernel")
  want = multi_gemv(x_k, ws, interpret=INTERPRET,
                    **{k: v for k, v in kw.items() if k != "block_d"})
  assert isinstance(outs, tuple) and len(outs) == len(ns)
  for i, (o, r, wr) in enumerate(zip(outs, outs_ref, want)):
    assert o.shape == (m, ns[i])
    assert_equal(o, wr, f"out[{i}] vs multi_gemv(x)")
    assert_close(o, r, what=f"out[{i}] vs reference")


def test_norm_qkv_f32_out():
  """out_dtype f32, without return_x (the production kernel)."""
  h, ws, w, ykw = make_case("bf16", "moe", 3, 128, 16, 4, (64, 32), False)
  s, outs = norm_qkv(h, ws, w, **ykw, out_dtype=jnp.float32, interpret=INTERPRET)
  s_k, x_k = unfused("moe", h, w, ykw)
  assert_equal(s, s_k, "s")
  for a, b in zip(outs, multi_gemv(x_k, ws, out_dtype=jnp.float32, interpret=INTERPRET)):
    assert_equal(a, b, "f32 out")


def test_norm_qkv_norm_mode_returns_h():
  h, ws, w, _ = make_case("bf16", "norm", 2, 128, 0, 0, (32,), False)
  s, _ = norm_qkv(h, ws, w, interpret=INTERPRET)
  assert s is h or np.array_equal(np.asarray(s, np.float32), np.asarray(h, np.float32))


def test_norm_qkv_flint_size():
  """Flint's q|k|v (D = 2048, N = 4096, 512, 512), MoE mode over 256 experts, M = 1, BF16."""
  h, ws, w, ykw = make_case("bf16", "moe", 1, 2048, 256, 6, (4096, 512, 512), False)
  s, outs = norm_qkv(h, ws, w, **ykw, interpret=INTERPRET)
  s_k, x_k = unfused("moe", h, w, ykw)
  assert_equal(s, s_k, "s")
  for i, (o, r) in enumerate(zip(outs, multi_gemv(x_k, ws, interpret=INTERPRET))):
    assert_equal(o, r, f"out[{i}]")


def test_norm_qkv_bad_inputs():
  h, ws, w, ykw = make_case("bf16", "moe", 2, 128, 16, 4, (64, 32), False)
  y, lg = ykw["y"], ykw["top_logits"]
  full = randn(rng("bad-full"), (2, 16), jnp.float32)           # the router's [M, E] logits
  bad = [
      (dict(top_logits=lg), "top_logits given without y"),
      (dict(y=y), "dense mode"),                                 # MoE y without top_logits
      (dict(y=h, top_logits=lg), "MoE mode: y must be"),
      (dict(y=y[:-1], top_logits=lg), "MoE mode: y must be"),
      (dict(y=y, top_logits=lg[:, :3]), "top_k=3"),
      (dict(y=y, top_logits=full), "top_k=16"),
      (dict(y=y, top_logits=lg[:1]), "top_logits must be"),
      (dict(y=y, top_logits=lg.astype(jnp.bfloat16)), "top_logits must be"),
      (dict(y=h.astype(jnp.float32)), "y must have h's dtype"),
      (dict(block_d=96), "block_d"),
      (dict(block_k=48), "block_k"),
      (dict(method="blocks"), "method"),
  ]
  for kw, msg in bad:
    with pytest.raises(ValueError, match=msg):
      norm_qkv(h, ws, w, interpret=True, **kw)
  with pytest.raises(ValueError, match="w_norm"):
    norm_qkv(h, ws, w[:64], interpret=True)
  with pytest.raises(ValueError, match="1..16 rows"):
    norm_qkv(jnp.zeros((17, 128), jnp.bfloat16), ws, w, interpret=True)
  with pytest.raises(ValueError, match="K shared"):
    norm_qkv(h, (ws[0][:, :64],), w, interpret=True)
  with pytest.raises(ValueError, match="mix formats"):
    norm_qkv(h, (ws[0], random_nvfp4(rng("mix"), (32, 128))), w, interpret=True)
  with pytest.raises(ValueError, match="bf16 weights"):
    norm_qkv(h, (random_nvfp4(rng("nv"), (32, 128)),), w, interpret=True)
