"""Grouped GEMM of the routed experts (prefill): interpret mode against the references, routing
metadata invariants, and lowering for an H200 at Flint sizes."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import grouped_matmul as gm
from flint_jax.pallas.nvfp4_gemv import NVFP4Weight
from pallas_testing import assert_close, lower_for_h200, randn, random_nvfp4, rng

S = jax.ShapeDtypeStruct
INTERPRET = jax.default_backend() == "cpu"   # compiled kernels on a GPU
BF, F32 = jnp.bfloat16, jnp.float32


def _ids(gen, t, k, e, used=None):
  """[t, k] distinct experts per token drawn from ``used`` (default all e): others get none."""
  pool = np.arange(e) if used is None else np.asarray(used)
  return jnp.asarray(np.stack([gen.choice(pool, k, replace=False) for _ in range(t)]), jnp.int32)


@pytest.mark.parametrize("t,k,e,bm", [(7, 2, 8, 16), (33, 3, 12, 16), (50, 6, 40, 32),
                                      (1, 1, 4, 16)])
def test_group_rows_invariants(t, k, e, bm):
  gen = rng("rows", t, k, e, bm)
  used = gen.choice(e, max(k, e // 2), replace=False)          # about half the experts idle
  ids = _ids(gen, t, k, e, used)
  valid = jnp.asarray(gen.random(t) < 0.8).at[0].set(True)
  rows = gm.group_rows(ids, e, bm, valid)
  m_pad = rows.row_token.shape[0]
  n_tiles = rows.tile_expert.shape[0]
  assert n_tiles == -(-t * k // bm) + min(e, t * k) and m_pad == n_tiles * bm
  ids_np, pr = np.asarray(ids), np.asarray(rows.pair_row)
  te, rt = np.asarray(rows.tile_expert), np.asarray(rows.row_token)
  v = np.asarray(valid)
  live = pr[v].reshape(-1)
  assert len(set(live.tolist())) == live.size                   # one row per live pair
  assert (pr[~v] == m_pad).all()                                 # dropped pairs
  for tok in np.nonzero(v)[0]:
    for j in range(k):
      r = pr[tok, j]
      assert rt[r] == tok and te[r // bm] == ids_np[tok, j]
  # Tiles: used ones first, each expert's tiles adjacent, unused tiles -1, idle experts absent.
  n_used = int((te >= 0).sum())
  assert (te[:n_used] >= 0).all() and (te[n_used:] == -1).all()
  assert np.all(np.diff(te[:n_used]) >= 0)
  counts = np.bincount(ids_np[v].reshape(-1), minlength=e)
  assert n_used == int(np.sum(-(-counts // bm)))
  assert set(te[:n_used].tolist()) == set(np.nonzero(counts)[0].tolist())


def _weights(gen, fmt, e, n, k, fused, dtype=BF):
  if fmt == "nvfp4":
    s2 = gen.uniform(0.5, 2.0, (e, 2) if fused else (e,)).astype(np.float32) / np.sqrt(k)
    return random_nvfp4(gen, (e, n, k), scale_2=s2)
  return randn(gen, (e, n, k), dtype, scale=k ** -0.5)


CASES = [  # (fmt, t, k_top, e, n, kdim, bm, dtype)
    ("dense", 13, 2, 6, 32, 64, 16, BF),
    ("dense", 9, 3, 5, 19, 57, 16, F32),        # odd N and K: masked loads
    ("dense", 40, 2, 8, 48, 96, 32, BF),        # N not a multiple of the 32-row block
    ("nvfp4", 11, 2, 6, 32, 128, 16, BF),
    ("nvfp4", 21, 3, 7, 64, 192, 32, F32),      # K = 3 NVFP4 blocks
]


@pytest.mark.parametrize("fmt,t,k_top,e,n,kdim,bm,dtype", CASES)
@pytest.mark.parametrize("fused", [False, True])
def test_grouped_matmul_matches_reference(fmt, t, k_top, e, n, kdim, bm, dtype, fused):
  gen = rng("gm", fmt, t, k_top, e, n, kdim, fused)
  ids = _ids(gen, t, k_top, e, used=np.arange(e)[np.arange(e) % 3 != 0])   # experts 0, 3, .. idle
  rows = gm.group_rows(ids, e, bm)
  w = _weights(gen, fmt, e, 2 * n if fused else n, kdim, fused, dtype)
  x = randn(gen, (t, kdim), dtype)
  if fused:
    fn, ref = gm.grouped_matmul_silu_mul, gm.grouped_matmul_silu_mul_reference
    kw = dict(block_n=32 if n == 48 else None)
  else:
    fn, ref = gm.grouped_matmul, gm.grouped_matmul_reference
    kw = dict(block_n=32 if n == 48 else None)
  out = fn(x, w, rows, gather=True, interpret=INTERPRET, **kw)
  want = ref(x, w, rows, gather=True)
  live = np.asarray(jnp.repeat(rows.tile_expert, bm) >= 0)
  tol = dict(atol=2e-6, rtol=2e-6) if dtype == F32 else {}
  assert_close(out[live], want[live], what=f"{fmt} fused={fused}", **tol)
  # The row-order input (the down projection's) gives the same rows.
  xr = x[rows.row_token]
  out2 = fn(xr, w, rows, gather=False, interpret=INTERPRET, **kw)
  np.testing.assert_array_equal(np.asarray(out2[live]), np.asarray(out[live]))


@pytest.mark.parametrize("fmt,dtype", [("dense", BF), ("dense", F32), ("nvfp4", BF),
                                       ("nvfp4", F32), ("nvfp4-dequant", BF),
                                       ("nvfp4-dequant", F32)])
def test_moe_experts_matches_model_math(fmt, dtype):
  # The model's XLA routed-expert sum (FlintMoE._experts_ragged), with idle experts and a
  # padded (invalid) token.
  t, k, e, d, inter = 37, 3, 10, 64, 64
  fmt, _, mode = fmt.partition("-")     # nvfp4-dequant: the experts dequantized first
  gen = rng("moe", fmt, dtype)
  ids = _ids(gen, t, k, e, used=[0, 2, 3, 7, 8, 9])
  weights = jax.nn.softmax(jnp.asarray(gen.standard_normal((t, k)), F32), axis=-1)
  x = randn(gen, (t, d), dtype)
  if fmt == "dense":
    experts = dict(gate_up_proj=randn(gen, (e, 2 * inter, d), dtype, scale=2 * d ** -0.5),
                   down_proj=randn(gen, (e, d, inter), dtype, scale=inter ** -0.5))
  else:
    g = _weights(gen, "nvfp4", e, 2 * inter, d, True)
    dn = _weights(gen, "nvfp4", e, d, inter, False)
    experts = dict(gate_up_qweight=g.qweight, gate_up_weight_scale=g.weight_scale,
                   gate_up_weight_scale_2=g.weight_scale_2, down_qweight=dn.qweight,
                   down_weight_scale=dn.weight_scale, down_weight_scale_2=dn.weight_scale_2)
  valid = jnp.ones((t,), bool).at[t - 1].set(False)
  out = gm.moe_experts(x, weights, ids, experts, valid, block_m=16, nvfp4=mode or "fused",
                       interpret=INTERPRET)
  want = gm.moe_experts_reference(x, weights, ids, experts, valid)
  tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(dtype=BF)
  assert_close(out, want, what=f"moe {fmt} {mode} {dtype}", **tol)
  assert float(jnp.abs(out[t - 1]).max()) == 0.0


def test_nvfp4_mode_choice():
  # auto: dequantize once the experts average DEQUANT_MIN_ROWS rows (Flint: 4096-token chunks).
  assert not gm.use_dequant("auto", 4095 * 6, 256) and gm.use_dequant("auto", 4096 * 6, 256)
  assert gm.use_dequant("dequant", 1, 256) and not gm.use_dequant("fused", 10 ** 6, 256)
  with pytest.raises(ValueError, match="nvfp4 must be one of"):
    gm.use_dequant("bf16", 1, 1)


def test_scaled_weight_equals_nvfp4_rows():
  # The dequantized stack (ScaledWeight) gives the in-kernel decode's rows up to summation order.
  gen = rng("scaled")
  t, k_top, e, n, kdim = 19, 2, 5, 32, 128
  ids = _ids(gen, t, k_top, e)
  rows = gm.group_rows(ids, e, 16)
  x = randn(gen, (t, kdim))
  live = np.asarray(jnp.repeat(rows.tile_expert, 16) >= 0)
  for fused in (False, True):
    w = _weights(gen, "nvfp4", e, 2 * n if fused else n, kdim, fused)
    fn = gm.grouped_matmul_silu_mul if fused else gm.grouped_matmul
    a = fn(x, w, rows, gather=True, interpret=INTERPRET)
    b = fn(x, gm.dequantize_experts(w), rows, gather=True, interpret=INTERPRET)
    assert_close(b[live], a[live], what=f"scaled fused={fused}")


def test_moe_experts_prescaled_scales_bit_identical():
  from flint_jax.nvfp4 import prescale_block_scales
  t, k, e, d, inter = 20, 2, 4, 64, 64
  gen = rng("prescaled")
  ids = _ids(gen, t, k, e)
  weights = jnp.full((t, k), 0.5, F32)
  x = randn(gen, (t, d))
  g = _weights(gen, "nvfp4", e, 2 * inter, d, True)
  dn = _weights(gen, "nvfp4", e, d, inter, False)
  experts = dict(gate_up_qweight=g.qweight, gate_up_weight_scale=g.weight_scale,
                 gate_up_weight_scale_2=g.weight_scale_2, down_qweight=dn.qweight,
                 down_weight_scale=dn.weight_scale, down_weight_scale_2=dn.weight_scale_2)
    
  pre = dict(experts, gate_up_weight_scale=prescale_block_scales(g.weight_scale),
             down_weight_scale=prescale_block_scales(dn.weight_scale))
  a = gm.moe_experts(x, weights, ids, experts, block_m=16, interpret=INTERPRET)
  b = gm.moe_experts(x, weights, ids, pre, block_m=16, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------
# Lowering for an H200 at Flint sizes (8K-token chunk: 49152 pairs over 256 experts)

D, I, E, TOP = 2048, 512, 256, 6


def _lower(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    text = lower_for_h200(fn, *args).as_text()
  assert "__gpu$xla.gpu.triton" in text
  return text


def _abstract_experts(fmt, prescaled=False):
  if fmt == "bf16":
    return dict(gate_up_proj=S((E, 2 * I, D), BF), down_proj=S((E, D, I), BF))
  sd = BF if prescaled else jnp.float8_e4m3fn
  return dict(gate_up_qweight=S((E, 2 * I, D // 2), jnp.uint8),
              gate_up_weight_scale=S((E, 2 * I, D // 16), sd),
              gate_up_weight_scale_2=S((E, 2), F32),
              down_qweight=S((E, D, I // 2), jnp.uint8),
              down_weight_scale=S((E, D, I // 16), sd), down_weight_scale_2=S((E,), F32))


@pytest.mark.parametrize("fmt,prescaled,mode", [("bf16", False, "auto"),
                                               ("nvfp4", False, "fused"),
                                               ("nvfp4", True, "fused"),
                                               ("nvfp4", True, "dequant")])
@pytest.mark.parametrize("t", [8192, 2048])
def test_moe_experts_lowers_for_h200(fmt, prescaled, mode, t):
  fn = functools.partial(gm.moe_experts, nvfp4=mode, interpret=False)
  _lower(fn, S((t, D), BF), S((t, TOP), F32), S((t, TOP), jnp.int32),
         _abstract_experts(fmt, prescaled), S((t,), bool))


@pytest.mark.parametrize("bm,bn,bk", [(64, 64, 64), (128, 128, 64), (128, 64, 128)])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_grouped_matmul_block_choices_lower(bm, bn, bk, fmt):
  ex = _abstract_experts(fmt)
  fn = functools.partial(gm.moe_experts, block_m=bm, gate_up_blocks=(bn, bk),
                         down_blocks=(bn, bk), interpret=False)
  _lower(fn, S((4096, D), BF), S((4096, TOP), F32), S((4096, TOP), jnp.int32), ex)
