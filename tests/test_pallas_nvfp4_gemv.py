"""nvfp4_gemv / nvfp4_gemv_silu_mul vs the exact-dequantisation reference.

The ``asm`` decode (inline PTX) runs only compiled on a GPU; interpret mode falls back to the
``fp8`` decode, so the CPU run skips the duplicate ``asm`` cases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.nvfp4_gemv import (_e2m1_to_bf16, dequantize_nvfp4_reference, nvfp4_gemv,
                                         nvfp4_gemv_reference, nvfp4_gemv_silu_mul,
                                         nvfp4_gemv_silu_mul_reference)
from pallas_testing import assert_close, randn, random_nvfp4, rng

INTERPRET = jax.default_backend() == "cpu"
DECODES = ["fp8"] if INTERPRET else ["fp8", "asm"]


def test_dequantize_reference_layout():
  """Half-split layout: byte 32b + j -> k = 64b + j (low), 64b + 32 + j (high); scale per 16."""
  n, k = 2, 128
  codes = np.random.default_rng(0).integers(0, 16, (n, k)).astype(np.uint8)
  q = np.zeros((n, k // 2), np.uint8)
  for b in range(k // 64):
    for j in range(32):
      q[:, 32 * b + j] = codes[:, 64 * b + j] | (codes[:, 64 * b + 32 + j] << 4)
  scale = jnp.asarray(np.linspace(0.25, 4, n * k // 16).reshape(n, k // 16), jnp.float8_e4m3fn)
  want = (np.asarray(_e2m1_to_bf16(jnp.asarray(codes)), np.float32)
          * np.repeat(np.asarray(scale, np.float32), 16, axis=1))
  got = np.asarray(dequantize_nvfp4_reference(jnp.asarray(q), scale), np.float32)
  np.testing.assert_array_equal(got, want)
  assert list(np.asarray(_e2m1_to_bf16(jnp.arange(8, dtype=jnp.uint8)), np.float32)) == [
      0, .5, 1, 1.5, 2, 3, 4, 6]


def test_dequantize_matches_codec():
  """Cross-check with flint_jax.nvfp4 (the converter's codec), when present."""
  nvfp4 = pytest.importorskip("flint_jax.nvfp4")
  w = random_nvfp4(rng(1), (48, 256))
  np.testing.assert_array_equal(
      np.asarray(nvfp4.dequantize(w.qweight, w.weight_scale), np.float32),
      np.asarray(dequantize_nvfp4_reference(w.qweight, w.weight_scale), np.float32))


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("m,n,k,out_dtype,kw", [
    (1, 64, 256, jnp.bfloat16, {}),                         # default: blocks
    (1, 48, 384, jnp.bfloat16, dict(method="blocks", block_n=16, block_k=128)),
    (1, 64, 512, jnp.float32, dict(method="blocks", split_k=2, block_k=128)),
    (1, 32, 2048, jnp.bfloat16, dict(block_k=1024)),       # one K step
    (1, 32, 256, jnp.bfloat16, dict(method="dot", split_k=2, block_k=64)),
    (3, 64, 256, jnp.bfloat16, dict(method="swap")),
    (3, 48, 256, jnp.bfloat16, dict(method="rows", block_n=16, block_k=128)),
    (8, 64, 512, jnp.float32, dict(method="rows", split_k=2, block_k=128)),
    (8, 64, 512, jnp.float32, dict(block_k=128, split_k=2)),
    (8, 256, 2048, jnp.bfloat16, {}),
    (2, 96, 4096, jnp.bfloat16, {}),                      # M = 2 default: rows, split-K
    (1, 2048, 2048, jnp.bfloat16, {}),                    # Flint size
])
def test_nvfp4_gemv(decode, m, n, k, out_dtype, kw):
  g = rng(decode, m, n, k, kw)
  x = randn(g, (m, k))
  w = random_nvfp4(g, (n, k))
  out = nvfp4_gemv(x, *w, out_dtype=out_dtype, decode=decode, interpret=INTERPRET, **kw)
  assert_close(out, nvfp4_gemv_reference(x, *w, out_dtype=out_dtype), what="nvfp4_gemv")


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("m,n,k,block_k,method", [(1, 64, 256, None, None),
                                                  (8, 96, 512, 64, None),
                                                  (2, 64, 512, None, None),   # rows
                                                  (1, 48, 256, 64, "blocks")])
def test_nvfp4_gemv_silu_mul(decode, m, n, k, block_k, method):
  gen = rng(decode, m, n, k, method)
  x = randn(gen, (m, k))
  g, u = random_nvfp4(gen, (n, k)), random_nvfp4(gen, (n, k))
  out = nvfp4_gemv_silu_mul(x, g, u, decode=decode, interpret=INTERPRET,
                            block_n=16 if n % 32 else None, block_k=block_k, method=method)
  assert_close(out, nvfp4_gemv_silu_mul_reference(x, g, u), what="nvfp4_gemv_silu_mul")


def test_default_tiles_at_batch_one():
  """The M = 1 defaults measured on the H200 (runs 84-85): the blocks method with its own tiles:
  LM head bn16 bk256 w4, o_proj / dense down K steps of 512 with split-K, dense gate|up bn16
  bk1024 w8 (the rows tiles at M = 2 take the M = 1 row sums' tiles: bk1024 o_proj)."""
  from flint_jax.pallas.nvfp4_gemv import default_method, default_nvfp4_blocks
  assert default_method(1, 150144) == "blocks" and default_method(2, 2048) == "rows"
  assert default_nvfp4_blocks(150144, 2048, method="blocks") == (16, 256, 1, 4)
  # the f16 operand (run 164): bk512 on 4 warps for the LM head
  assert default_nvfp4_blocks(150144, 2048, method="blocks", x16=True) == (16, 512, 1, 4)
  assert default_nvfp4_blocks(2048, 4096, method="blocks") == (16, 512, 4, 8)
  assert default_nvfp4_blocks(2048, 4096, m=2, method="rows") == (16, 1024, 4, 8)


def test_default_tiles_at_batch_eight():
  """The M > 1 defaults measured on the H200 (runs 80, 104-105): single matrices on 128-wide K
  steps (the o_proj and dense down with split-K 4, the LM head on swap tiles, the dense gate|up
  pair: run 109)."""
  from flint_jax.pallas.nvfp4_gemv import default_method, default_nvfp4_blocks
  assert default_nvfp4_blocks(2048, 4096, m=8, method="dot") == (64, 128, 4, 4)
  assert default_nvfp4_blocks(2048, 6144, m=8, method="dot") == (64, 128, 4, 4)
  assert default_method(8, 150144) == "swap"
  assert default_nvfp4_blocks(150144, 2048, m=8, method="swap") == (128, 128, 1, 8)
  assert default_nvfp4_blocks(6144, 2048, m=8, n_mats=2, method="dot") == (64, 128, 1, 4)
  assert default_nvfp4_blocks(2048, 6144, method="blocks") == (16, 512, 4, 8)
  assert default_nvfp4_blocks(6144, 2048, n_mats=2, method="blocks") == (16, 1024, 1, 8)
  # odd sizes: the tiles shrink to divide N and K
  assert default_nvfp4_blocks(48, 384, n_mats=2, method="blocks") == (16, 128, 1, 8)


def test_nvfp4_rejects_bad_shapes():
  x = jnp.zeros((2, 96), jnp.bfloat16)
  w = random_nvfp4(rng(0), (32, 96))
  with pytest.raises(ValueError, match="multiple of 64"):
    nvfp4_gemv(x, *w, interpret=True)


@pytest.mark.parametrize("m,n,k,kw", [
    (1, 2048, 4096, {}),                                  # o_proj: default split-K 4
    (1, 64, 192, dict(block_k=64)),                       # split-K 3 (a tiny dense down)
    (2, 96, 4096, {}),                                    # M = 2 default: rows, split-K
    (8, 64, 512, dict(block_k=128, split_k=2)),           # dot
    (8, 64, 512, dict(split_k=8)),         # a given split: K steps shrink to 64 to fit it
    (1, 2048, 4096, dict(split_k=8)),      # blocks tiles, bk512 in 8 slices of 512
])
def test_nvfp4_gemv_partials(m, n, k, kw):
  """sum_splits=False: fp32 partials [S, M, N], one per contiguous K range, whose sum (rounded
  to out_dtype) is the default output exactly."""
  g = rng("partials", m, n, k, kw)
  x = randn(g, (m, k))
  w = random_nvfp4(g, (n, k))
  parts = nvfp4_gemv(x, *w, sum_splits=False, interpret=INTERPRET, **kw)
  assert parts.ndim == 3 and parts.shape[0] > 1 and parts.shape[1:] == (m, n), parts.shape
  assert parts.dtype == jnp.float32
  ref = nvfp4_gemv_reference(x, *w, split_k=parts.shape[0], sum_splits=False)
  assert_close(parts, ref, what="nvfp4_gemv partials")
  full = nvfp4_gemv(x, *w, interpret=INTERPRET, **kw)
  np.testing.assert_array_equal(np.asarray(jnp.sum(parts, axis=0).astype(full.dtype), np.float32),
                                np.asarray(full, np.float32))
  assert_close(full, nvfp4_gemv_reference(x, *w), what="nvfp4_gemv")


def test_nvfp4_gemv_sum_splits_without_split_k():
  """split_k == 1: [M, N] out_dtype whatever sum_splits says (kernel and reference)."""
  g = rng("nosplit")
  x = randn(g, (1, 256))
  w = random_nvfp4(g, (64, 256))
  out = nvfp4_gemv(x, *w, split_k=1, sum_splits=False, interpret=INTERPRET)
  assert out.shape == (1, 64) and out.dtype == jnp.bfloat16
  ref = nvfp4_gemv_reference(x, *w, split_k=1, sum_splits=False)
  assert ref.shape == (1, 64) and ref.dtype == jnp.bfloat16
  assert_close(out, ref, what="nvfp4_gemv split_k=1")


def _rel_l2(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.skipif(INTERPRET, reason="the asm decode runs only compiled on a GPU")
@pytest.mark.parametrize("scales", ["e4m3", "bf16"])
@pytest.mark.parametrize("n,k,kw", [(256, 1024, {}), (48, 384, dict(block_n=16, block_k=128)),
                                    (2048, 4096, {}), (64, 512, dict(split_k=2, block_k=128))])
def test_post_scale_multi_gemv(scales, n, k, kw):
  """``multi_gemv(post_scale=True)`` (the batch-1 NVFP4 q|k|v): the blocks tiles decode without
  the scale multiply (the code 0.5 as an f32 subnormal) and scale each 16-value block's sum.
  Same products, summed in another order: within f32 rounding of the scaled decode and of the
  reference -- a flushed subnormal (every code +-0.5, 1 in 8) would be a percent-level error."""
  from flint_jax.nvfp4 import prescale_block_scales
  from flint_jax.pallas.multi_gemv import multi_gemv, multi_gemv_reference
  g = rng("post", n, k, scales, tuple(kw.items()))
  x = randn(g, (1, k))
  w = random_nvfp4(g, (n, k))
  s = w.weight_scale if scales == "e4m3" else prescale_block_scales(w.weight_scale)
  ws = ((w.qweight, s, w.weight_scale_2),)
  outs = {post: multi_gemv(x, ws, decode="asm", method="blocks", out_dtype=jnp.float32,
                           post_scale=post, **kw)[0] for post in (False, True)}
  assert _rel_l2(outs[True], outs[False]) < 1e-5
  assert_close(outs[True], multi_gemv_reference(x, (tuple(w),), out_dtype=jnp.float32)[0],
               what="post-scaled blocks decode")


@pytest.mark.skipif(INTERPRET, reason="the asm decode runs only compiled on a GPU")
@pytest.mark.parametrize("m,kw", [(1, {}), (8, {}), (2, {}), (3, dict(method="rows"))])
def test_asm_decode_scales_bit_identical(m, kw):
  """The ``asm`` decode gives the same bits with e4m3 and with pre-scaled block scales, every
  code and sign included."""
  from flint_jax.nvfp4 import prescale_block_scales
  g = rng("asm_seq", m, kw)
  x = randn(g, (m, 1024))
  w = random_nvfp4(g, (256, 1024))
  outs = [np.asarray(nvfp4_gemv(x, w.qweight, s, w.weight_scale_2, decode="asm",
                                out_dtype=jnp.float32, **kw))
          for s in (w.weight_scale, prescale_block_scales(w.weight_scale))]
  np.testing.assert_array_equal(*outs)
  assert_close(outs[1], nvfp4_gemv_reference(x, *w, out_dtype=jnp.float32), what="asm decode")


def test_x16_operand():
  """x16 = x * 2^c per row in f16 (exact; the row's largest magnitude in [2^14, 2^15)), groups
  of four stored x0, x2, x1, x3; inv = 2^-c; an all-zero row gets c = 0."""
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  gen = rng("x16")
  x = randn(gen, (4, 128)).astype(jnp.float32)
  x = x * jnp.array([1.0, 300.0, 2.0 ** -20, 0.0])[:, None]
  x = x.astype(jnp.bfloat16)
  x16, inv = x16_operand(x)
  assert x16.dtype == jnp.float16 and x16.shape == x.shape and inv.shape == (4,)
  xv = np.asarray(x16, np.float64).reshape(4, 32, 2, 2).swapaxes(-1, -2).reshape(4, 128)
  back = xv * np.asarray(inv, np.float64)[:, None]
  np.testing.assert_array_equal(back, np.asarray(x, np.float64))
  amax = np.abs(xv).max(axis=1)
  assert np.all((amax[:3] >= 2.0 ** 14) & (amax[:3] < 2.0 ** 15)), amax
  assert amax[3] == 0 and float(inv[3]) == 1.0
  np.testing.assert_array_equal(np.log2(np.asarray(inv)), np.round(np.log2(np.asarray(inv))))


@pytest.mark.parametrize("n", [16, 64])
def test_store_x16_blocks(n):
  """``store_x16_blocks`` (in a kernel, interpret mode) writes what ``x16_blocks_reference``
  gives: f16 values in x16 order with one exact power-of-two scale per 16 values; the scaled
  values times their factors are the bf16 inputs again."""
  import functools
  from jax.experimental import pallas as pl
  from flint_jax.pallas.nvfp4_gemv import store_x16_blocks, x16_blocks_reference
  gen = rng("x16b", n)
  v = randn(gen, (2, 128)) * jnp.repeat(jnp.exp2(jnp.arange(16.0) - 8), 16)[None, :128]
  v = v.astype(jnp.bfloat16)

  def kernel(v_ref, o_ref, i_ref):
    row, j = pl.program_id(0), pl.program_id(1)
    store_x16_blocks(o_ref, i_ref, (row,), v_ref[row, pl.ds(j * n, n)], j * n, n)

  x16, inv = pl.pallas_call(
      kernel, grid=(2, 128 // n), interpret=True,
      out_shape=(jax.ShapeDtypeStruct((2, 128), jnp.float16),
                 jax.ShapeDtypeStruct((2, 8), jnp.float32)))(v)
  want16, want_inv = x16_blocks_reference(v)
  np.testing.assert_array_equal(np.asarray(x16).view(np.uint16), np.asarray(want16).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(want_inv))
  back = np.asarray(x16, np.float64).reshape(2, 32, 2, 2).swapaxes(-1, -2).reshape(2, 8, 16)
  np.testing.assert_array_equal((back * np.asarray(inv, np.float64)[..., None]).reshape(2, 128),
                                np.asarray(v, np.float64))


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("n,k,scale,sums,kw", [
    (48, 384, 1.0, "pair", dict(block_n=16, block_k=128, num_warps=4)),   # 3 K steps; 8
    # bytes of codes per thread: the pair sums (f16_sums_for_tile)
    (64, 512, 1e-3, "pair", dict(block_k=128, split_k=2)),       # split-K, small values
    (96, 2048, 37.0, "block", {}),                               # the default (LM head) tiles
    (2048, 2048, 1.0, "block", dict(out_dtype=jnp.bfloat16)),   # Flint size, bf16 out
])
def test_nvfp4_gemv_x16(decode, n, k, scale, sums, kw):
  """``x_inv``: the M = 1 GEMV on the f16 operand (``x16_operand``) matches the reference on the
  bf16 x it holds like the f32 ``blocks`` tiles do (within a few bf16 ulps of them), at row
  scales far from 1; ``from_x16`` gives x back exactly; the kernel lowers for an H200 with the
  f16x2 products."""
  from flint_jax.pallas.nvfp4_gemv import from_x16, x16_operand
  from pallas_testing import rel_l2, triton_modules
  g = rng("x16gemv", n, k, scale, sums, kw)
  x = (randn(g, (1, k)).astype(jnp.float32) * scale).astype(jnp.bfloat16)
  w = random_nvfp4(g, (n, k))
  kw = dict(dict(out_dtype=jnp.float32), **kw)
  x16, inv = x16_operand(x)
  if decode == "fp8" and not INTERPRET:   # the f16 K step's jnp form is for interpret mode
    with pytest.raises(ValueError, match="needs decode='asm'"):
      nvfp4_gemv(x16, *w, x_inv=inv, decode=decode, **kw)
    return
  np.testing.assert_array_equal(np.asarray(from_x16(x16, inv), np.float32),
                                np.asarray(x, np.float32))
  out = nvfp4_gemv(x16, *w, x_inv=inv, decode=decode, interpret=INTERPRET, **kw)
  ref = nvfp4_gemv_reference(x, *w, out_dtype=kw["out_dtype"])
  np.testing.assert_array_equal(
      np.asarray(nvfp4_gemv_reference(x16, *w, x_inv=inv, out_dtype=kw["out_dtype"])),
      np.asarray(ref))
  # f32 outputs: the f16 sums' error (~2^-11 of a block's sum), not f32's
  tol = dict(atol=3e-3, rtol=0.0) if kw["out_dtype"] == jnp.float32 else {}
  assert_close(out, ref, what=f"nvfp4_gemv x16 ({sums})", **tol)
  f32_tiles = nvfp4_gemv(x, *w, method="blocks", decode=decode, interpret=INTERPRET, **kw)
  # measured (interpret): rel. L2 2-4e-4 (f32 out) / 1.1e-3 (bf16 out) against ~1e-7 / 0
  bound = 1e-3 if kw["out_dtype"] == jnp.float32 else 5e-3
  assert rel_l2(out, ref) < bound and rel_l2(f32_tiles, ref) < 1e-5, (
      rel_l2(out, ref), rel_l2(f32_tiles, ref))
  mods = triton_modules(lambda a, b: nvfp4_gemv(a, *w, x_inv=b, decode="asm", **kw), x16, inv)
  (mod,) = mods
  assert mod["name"].endswith("_x16") and "fma.rn.f16x2" in mod["asm"], mod["name"]
  # the sums the tile takes: the block sums keep one f16 lane sum per block (fma chains)
  assert ("mul.rn.f16x2 plo" in mod["asm"]) == (sums == "pair"), sums


def test_nvfp4_gemv_x16_rejects():
  """The f16 operand needs its factor, one row and the blocks tiles; errors say so."""
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  from pallas_testing import triton_modules
  w = random_nvfp4(rng("x16rej"), (32, 128))
  x = randn(rng("x16rej", 1), (2, 128))
  x16, inv = x16_operand(x)
  with pytest.raises(ValueError, match="needs its x_inv"):
    nvfp4_gemv(x16[:1], *w, interpret=True)
  with pytest.raises(ValueError, match="needs its x_inv"):
    nvfp4_gemv(x[:1], *w, x_inv=inv[:1], interpret=True)
  with pytest.raises(ValueError, match="for one row"):
    nvfp4_gemv(x16, *w, x_inv=inv, interpret=True)
  with pytest.raises(ValueError, match="'blocks' tiles"):
    nvfp4_gemv(x16[:1], *w, x_inv=inv[:1], method="dot", interpret=True)
  with pytest.raises(ValueError, match="too small for 8 warps"):   # 2 code bytes per thread
    nvfp4_gemv(x16[:1], *w, x_inv=inv[:1], block_n=16, block_k=64, num_warps=8, interpret=True)
  with pytest.raises(ValueError, match="needs decode='asm'"):
    nvfp4_gemv(x16[:1], *w, x_inv=inv[:1], decode="fp8")
  # default warps shrink to fit small tiles (32 x 128: bn16 bk64, 8 warps by default -> 4)
  mods = triton_modules(lambda a, b: nvfp4_gemv(a, *w, x_inv=b, block_k=64), x16[:1], inv[:1])
  assert [m["num_warps"] for m in mods] == [4], mods


def test_f16_sums_for_tile():
  """The f16 K step's sums by code bytes per thread: "block" from 16, "pair" from 4 (the
  asm's packs of four), an error below."""
  from flint_jax.pallas.nvfp4_gemv import f16_sums_for_tile
  for bn, bk, warps, want in [(16, 512, 4, "block"), (16, 256, 8, "pair"), (16, 128, 8, "pair"),
                              (32, 1024, 16, "block")]:
    assert f16_sums_for_tile(bn, bk, warps) == want, (bn, bk, warps)
  with pytest.raises(ValueError, match="too small"):
    f16_sums_for_tile(16, 64, 8)
