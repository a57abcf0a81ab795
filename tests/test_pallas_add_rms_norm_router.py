"""add_rms_norm_router (residual add + RMSNorm + fp32 router GEMV in one kernel) vs its
reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.add_rms_norm import add_rms_norm, add_rms_norm_reference
from flint_jax.pallas.add_rms_norm_router import add_rms_norm_router, add_rms_norm_router_reference
from flint_jax.pallas.moe import moe_router_logits
from pallas_testing import assert_close, randn, rng

INTERPRET = jax.default_backend() == "cpu"
F32_TOL = dict(atol=1e-5, rtol=1e-5)   # fp32 summation order only (relative to max|logit|)


def f32(v):
  return np.asarray(v, np.float32)


def _inputs(m, d, e, *params):
  gen = rng("norm-router", m, d, e, *params)
  h = randn(gen, (m, d), scale=4.0)
  a = randn(gen, (m, d))
  w = randn(gen, (d,), scale=0.3) + 1
  router = randn(gen, (e, d), jnp.float32, d ** -0.5)   # logits ~ N(0, 1), a trained router's
  return gen, h, a, w, router


@pytest.mark.parametrize("m,d,e,kw", [
    (1, 2048, 256, {}),                                 # Flint: 64 programs, whole [4, D] tiles
    (1, 2048, 256, dict(block_e=8, block_d=1024)),      # 32 programs, 2 column chunks
    (3, 320, 40, dict(block_e=16)),                     # odd D, last expert block partial
    (8, 2048, 256, dict(block_e=32, block_d=2048)),     # whole router tile, reused by 8 rows
    (16, 320, 20, dict(block_d=128)),   # 16 rows, chunks partly/fully masked, E % block_e != 0
])
def test_add_rms_norm_router(m, d, e, kw):
  _, h, a, w, router = _inputs(m, d, e, tuple(kw.items()))
  s, x, logits = add_rms_norm_router(h, a, w, router, interpret=INTERPRET, **kw)
  s_ref, x_ref, l_ref = add_rms_norm_router_reference(h, a, w, router)
  assert s.shape == x.shape == (m, d) and s.dtype == x.dtype == jnp.bfloat16
  assert logits.shape == (m, e) and logits.dtype == jnp.float32
  # s, x: add_rms_norm's kernel op for op -> bit-identical
  s_k, x_k = add_rms_norm(h, a, w, interpret=INTERPRET)
  np.testing.assert_array_equal(f32(s), f32(s_k))
  np.testing.assert_array_equal(f32(x), f32(x_k))
  np.testing.assert_array_equal(f32(s), f32(s_ref))
  # x vs plain jnp: the fp32 mean square may differ by summation order (1 ulp), which flips a
  # bf16 rounding of x very rarely; never more than one bf16 ulp
  diff = f32(x) != f32(x_ref)
  assert diff.mean() <= 1e-3, f"{diff.sum()} / {diff.size} x values differ from the reference"
  np.testing.assert_allclose(f32(x), f32(x_ref), rtol=2 ** -7, atol=0)
  # logits: the fp32 dot of the kernel's own (rounded) x, up to the summation order
  assert_close(logits, moe_router_logits(x, router), **F32_TOL, what="logits vs own x")
  if not diff.any():
    assert_close(logits, l_ref, **F32_TOL, what="logits vs reference")
  top = min(6, e)
  np.testing.assert_array_equal(np.sort(np.asarray(jax.lax.top_k(logits, top)[1]), -1),
                                np.sort(np.asarray(jax.lax.top_k(l_ref, top)[1]), -1))


@pytest.mark.parametrize("m,d,e,kw", [(1, 2048, 256, {}), (3, 320, 40, dict(block_d=128))])
def test_add_rms_norm_router_x16(m, d, e, kw):
  """``x16=True``: program 0 also writes ``nvfp4_gemv.x16_operand(x)`` (the f16 MoE gate_up's
  operand) bit for bit, the other outputs unchanged; lowered for an H200 (in column chunks too:
  x is formed whole in each row either way)."""
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  from pallas_testing import triton_modules
  _, h, a, w, router = _inputs(m, d, e, "x16", tuple(kw.items()))
  s, x, logits, x16, inv = add_rms_norm_router(h, a, w, router, x16=True, interpret=INTERPRET,
                                               **kw)
  s0, x0, l0 = add_rms_norm_router(h, a, w, router, interpret=INTERPRET, **kw)
  for got, want in ((s, s0), (x, x0), (logits, l0)):
    np.testing.assert_array_equal(f32(got), f32(want))
  want16, want_inv = x16_operand(x)
  np.testing.assert_array_equal(np.asarray(x16).view(np.uint16),
                                np.asarray(want16).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(want_inv))
  (mod,) = triton_modules(lambda *args: add_rms_norm_router(*args, x16=True, **kw),
                          h, a, w, router)
  assert mod["name"].endswith("_x16"), mod["name"]


@pytest.mark.parametrize("m,d,e,s_parts,kw", [
    (1, 2048, 256, 4, {}),                              # the NVFP4 o_proj's split-K 4 partials
    (3, 320, 40, 2, dict(block_e=8, block_d=128)),      # partials summed per column chunk too
])
def test_add_rms_norm_router_split_k_partials(m, d, e, s_parts, kw):
  """a as fp32 split-K partials [S, M, D]: the kernel sums them (add_rms_norm's rule), so s, x
  equal add_rms_norm's on the same partials and the logits those of its own x."""
  gen, h, _, w, router = _inputs(m, d, e, "parts", s_parts)
  parts = randn(gen, (s_parts, m, d), jnp.float32, 0.5)
  s, x, logits = add_rms_norm_router(h, parts, w, router, interpret=INTERPRET, **kw)
  s_k, x_k = add_rms_norm(h, parts, w, interpret=INTERPRET)
  np.testing.assert_array_equal(f32(s), f32(s_k))
  np.testing.assert_array_equal(f32(x), f32(x_k))
  s_ref, x_ref, _ = add_rms_norm_router_reference(h, parts, w, router)
  np.testing.assert_array_equal(f32(s), f32(s_ref))
  np.testing.assert_allclose(f32(x), f32(x_ref), rtol=2 ** -7, atol=0)
  assert_close(logits, moe_router_logits(x, router), **F32_TOL, what="logits vs own x")
  with pytest.raises(ValueError, match="partials"):
    add_rms_norm_router(h, parts.astype(jnp.bfloat16), w, router, interpret=True)


def test_reference_rounds_s_and_x():
  """The reference normalises the bf16-rounded s and multiplies the router with the rounded x
  (XLA may skip a bf16 round trip under jit; add_rms_norm_reference does): checked in numpy."""
  m, d, e = 2, 256, 8
  _, h, a, w, router = _inputs(m, d, e, "np")
  s, x, logits = add_rms_norm_router_reference(h, a, w, router)
  s64 = f32(jnp.asarray(f32(h) + f32(a), jnp.bfloat16)).astype(np.float64)
  ms = np.mean(s64 ** 2, -1, keepdims=True)
  x_np = f32(jnp.asarray((f32(w) * (s64 / np.sqrt(ms + 1e-6))).astype(np.float32),
                         jnp.bfloat16))
  np.testing.assert_array_equal(f32(s), s64.astype(np.float32))
  np.testing.assert_array_equal(f32(x), x_np)
  np.testing.assert_allclose(f32(logits), x_np.astype(np.float64) @ f32(router).T.astype(
      np.float64), rtol=1e-5, atol=1e-5)


def test_eps_is_used():
  m, d, e = 1, 128, 8
  _, h, a, w, router = _inputs(m, d, e, "eps")
  h, a = h * 1e-3, a * 1e-3
  out = add_rms_norm_router(h, a, w, router, eps=1e-2, interpret=INTERPRET)
  ref = add_rms_norm_router_reference(h, a, w, router, eps=1e-2)
  np.testing.assert_array_equal(f32(out[1]), f32(ref[1]))
  assert not np.array_equal(f32(out[1]), f32(add_rms_norm_router_reference(h, a, w, router)[1]))


@pytest.mark.parametrize("change,msg", [
    (dict(m=17), "1..16 rows"),
    (dict(a_d=100), "a must match h"),
    (dict(a_dtype=jnp.float32), "a must match h"),
    (dict(w_d=100), "w_norm must be"),
    (dict(r_d=100), "router_w must be"),
    (dict(r_dtype=jnp.int32), "router_w must be a float"),
    (dict(h_3d=True), "h must be"),
    (dict(block_e=6), "block_e must be a power of two"),
    (dict(block_d=1024), "block_d must be a power of two <= 512"),
    (dict(block_d=96), "block_d must be a power of two"),
])
def test_bad_inputs(change, msg):
  m, d, e = change.get("m", 2), 320, 16
  h = jnp.zeros((m, d), jnp.bfloat16)
  a = jnp.zeros((m, change.get("a_d", d)), change.get("a_dtype", jnp.bfloat16))
  w = jnp.ones((change.get("w_d", d),), jnp.bfloat16)
  router = jnp.zeros((e, change.get("r_d", d)), change.get("r_dtype", jnp.float32))
  if change.get("h_3d"):
    h = h[None]
  kw = {k: change[k] for k in ("block_e", "block_d") if k in change}
  with pytest.raises(ValueError, match=msg):
    add_rms_norm_router(h, a, w, router, interpret=INTERPRET, **kw)


def test_reference_matches_add_rms_norm_reference_up_to_rounding():
  """Sanity: the reference's (s, x) equal add_rms_norm_reference's s, and x up to the bf16 round
  trip that add_rms_norm_reference lets XLA skip (at most one bf16 ulp)."""
  _, h, a, w, router = _inputs(4, 512, 8, "arn")
  s, x, _ = add_rms_norm_router_reference(h, a, w, router)
  s_a, x_a = add_rms_norm_reference(h, a, w)
  np.testing.assert_array_equal(f32(s), f32(s_a))
  np.testing.assert_allclose(f32(x), f32(x_a), rtol=2 ** -7, atol=0)
