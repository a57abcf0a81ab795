"""multi_gemv (fused q|k|v GEMVs sharing x) vs its reference and vs per-matrix nvfp4_gemv.

Interpret mode starts every Pallas output as NaN, so a row block that no program writes (a wrong
branch range) fails the finiteness check of ``assert_close``. The NVFP4 ``asm`` decode runs only
compiled on a GPU (interpret mode falls back to ``fp8``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.multi_gemv import (default_multi_gemv_blocks, multi_gemv,
                                         multi_gemv_reference)
from flint_jax.pallas.nvfp4_gemv import nvfp4_gemv, nvfp4_gemv_reference
from pallas_testing import assert_close, randn, random_nvfp4, rng

INTERPRET = jax.default_backend() == "cpu"
DECODE = "fp8" if INTERPRET else "asm"


def bf16_weights(g, ns, k):
  return tuple(randn(g, (n, k), scale=(i + 1) * k ** -0.5) for i, n in enumerate(ns))


def nvfp4_weights(g, ns, k):
  # Distinct tensor scales per matrix: a swapped weight_scale_2 index shows up as an error.
  return tuple(random_nvfp4(g, (n, k), scale_2=(i + 1) * k ** -0.5) for i, n in enumerate(ns))


def check_all(out, ref, ns, m, what):
  assert isinstance(out, tuple) and len(out) == len(ns), f"{what}: {type(out)} {len(out)}"
  for i, (o, r) in enumerate(zip(out, ref)):
    assert o.shape == (m, ns[i]), f"{what}[{i}]: shape {o.shape}"
    assert_close(o, r, what=f"{what}[{i}]")


@pytest.mark.parametrize("m,ns,k,kw", [
    (1, (256, 64, 64), 256, {}),                                   # default swap
    (1, (128, 64), 256, dict(method="dot", block_k=64)),
    (3, (128, 64), 256, dict(method="rows", block_n=16)),          # CUDA-core rows
    (3, (256, 64, 64), 128, {}),                                   # odd M
    (3, (128, 64), 256, dict(method="swap", block_n=32)),
    (8, (256, 64, 64), 256, {}),
    (16, (128, 64), 128, {}),
    (16, (256, 64, 64), 256, dict(method="swap")),
    (5, (64, 32, 32, 16), 192, {}),                                # 4 matrices, K not pow2
    (2, (96,), 128, dict(block_n=32)),                             # 1 matrix, 3 blocks
])
def test_multi_gemv_bf16(m, ns, k, kw):
  g = rng("bf16", m, ns, k, kw)
  x = randn(g, (m, k))
  ws = bf16_weights(g, ns, k)
  out = multi_gemv(x, ws, interpret=INTERPRET, **kw)
  check_all(out, multi_gemv_reference(x, ws), ns, m, "multi_gemv bf16")


@pytest.mark.parametrize("m,ns,k,kw", [
    (1, (256, 64, 64), 256, {}),                                   # default blocks
    (1, (256, 64, 64), 384, dict(method="blocks", block_k=128)),   # per-block sums, 3 K steps
    (1, (256, 64, 64), 384, dict(block_k=128, post_scale=True)),   # (the asm decode's option)
    (1, (128, 64), 128, dict(method="swap")),
    (3, (256, 64, 64), 128, {}),                                   # odd M: rows
    (3, (128, 64), 256, dict(method="rows", block_n=16)),           # CUDA-core rows
    (8, (256, 64, 64), 256, dict(method="rows", block_n=32, block_k=128)),
    (8, (256, 64, 64), 256, {}),
    (16, (128, 64), 128, dict(method="swap")),
    (16, (256, 64, 64), 256, {}),
    (5, (64, 32, 32, 16), 192, {}),                                # 4 matrices, K = 3 * 64
])
def test_multi_gemv_nvfp4(m, ns, k, kw):
  g = rng("nvfp4", m, ns, k, kw)
  x = randn(g, (m, k))
  ws = nvfp4_weights(g, ns, k)
  out = multi_gemv(x, ws, decode=DECODE, interpret=INTERPRET, **kw)
  check_all(out, multi_gemv_reference(x, ws), ns, m, "multi_gemv nvfp4")


def test_multi_gemv_f32_out():
  g = rng("f32")
  x = randn(g, (4, 128))
  ws = bf16_weights(g, (64, 32), 128)
  out = multi_gemv(x, ws, out_dtype=jnp.float32, interpret=INTERPRET)
  check_all(out, multi_gemv_reference(x, ws, out_dtype=jnp.float32), (64, 32), 4, "f32 out")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_multi_gemv_flint_qkv(fmt):
  """Flint's q|k|v at M = 1: K = 2048, N = 4096, 512, 512, default blocks."""
  ns, k = (4096, 512, 512), 2048
  g = rng("flint", fmt)
  x = randn(g, (1, k))
  ws = bf16_weights(g, ns, k) if fmt == "bf16" else nvfp4_weights(g, ns, k)
  out = multi_gemv(x, ws, decode=DECODE, interpret=INTERPRET)
  check_all(out, multi_gemv_reference(x, ws), ns, 1, f"flint qkv {fmt}")


@pytest.mark.parametrize("m,method", [(1, None), (1, "dot"), (8, None), (8, "swap")])
def test_matches_single_matrix_kernel(m, method):
  """Bit-compatible with nvfp4_gemv per matrix for the same tile knobs (split_k=1)."""
  ns, k = (256, 64, 64), 256
  g = rng("single", "nvfp4", m, method)
  x = randn(g, (m, k))
  bn, bk, warps = default_multi_gemv_blocks(ns, k, m=m, fmt="nvfp4")
  knobs = dict(block_n=bn, block_k=bk, method=method, num_warps=warps, interpret=INTERPRET)
  ws = nvfp4_weights(g, ns, k)
  single = [nvfp4_gemv(x, *w, split_k=1, decode=DECODE, **knobs) for w in ws]
  out = multi_gemv(x, ws, decode=DECODE, **knobs)
  for i, (o, s) in enumerate(zip(out, single)):
    assert_close(o, s, what=f"vs single [{i}]")
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(s, np.float32),
                                  err_msg=f"matrix {i}: not bit-equal to the single kernel")


def test_default_blocks():
  # q_proj-sized defaults, block_n lowered to divide every N_i.
  assert default_multi_gemv_blocks((4096, 512, 512), 2048, m=1) == (64, 256, 4)
  assert default_multi_gemv_blocks((4096, 512, 512), 2048, m=8) == (64, 256, 4)
  assert default_multi_gemv_blocks((4096, 512, 512), 2048, m=1, fmt="nvfp4") == (16, 512, 8)
  assert default_multi_gemv_blocks((4096, 512, 512), 2048, m=1, fmt="nvfp4",
                                   method="blocks") == (16, 1024, 16)
  # NVFP4 at M = 8: 128-wide K steps (H200 run 104: 13.2 us against 16.3 on bk256)
  assert default_multi_gemv_blocks((4096, 512, 512), 2048, m=8, fmt="nvfp4") == (64, 128, 4)
  assert default_multi_gemv_blocks((4096, 48), 2048, m=1)[0] == 16
  # NVFP4 rows (the M = 2..3 default) takes the M = 1 tiles
  assert default_multi_gemv_blocks((4096, 512, 512), 2048, m=4, fmt="nvfp4",
                                   method="rows") == (16, 512, 8)


def test_default_methods():
  """The measured tile-method defaults (runs 25, 30, 84, 85, 108): NVFP4 q|k|v on rows at M =
  2..3 and on blocks at M = 1, NVFP4 single GEMVs on rows at M = 2 below 16384 rows, blocks at
  M = 1; tensor cores otherwise (bf16: swap-AB at M = 1)."""
  from flint_jax.pallas.multi_gemv import resolve_method
  from flint_jax.pallas.nvfp4_gemv import default_method
  assert [resolve_method("nvfp4", m, None, "asm", False)[0]
          for m in (1, 2, 3, 4, 5, 8)] == ["blocks", "rows", "rows", "dot", "dot", "dot"]
  assert [resolve_method("bf16", m, None, "asm", False)[0] for m in (1, 2)] == ["swap", "dot"]
  assert [default_method(m, 2048) for m in (1, 2, 3, 8)] == ["blocks", "rows", "dot", "dot"]
  assert [default_method(m, 150144) for m in (1, 2, 8)] == ["blocks", "swap", "swap"]   # LM head


def test_multi_gemv_rejects_bad_inputs():
  g = rng("bad")
  x = randn(g, (2, 128))
  w = randn(g, (64, 128))
  nw = random_nvfp4(g, (64, 128))
  with pytest.raises(ValueError, match="K shared"):
    multi_gemv(x, (w, randn(g, (64, 256))), interpret=True)
  with pytest.raises(ValueError, match="K shared"):
    multi_gemv(x, (nw, random_nvfp4(g, (64, 256))), interpret=True)
  with pytest.raises(ValueError, match="mix formats"):
    multi_gemv(x, (w, nw), interpret=True)
  with pytest.raises(ValueError, match="rows"):
    multi_gemv(randn(g, (17, 128)), (w, w), interpret=True)
  with pytest.raises(ValueError, match="block_n"):
    multi_gemv(x, (w, randn(g, (40, 128))), block_n=16, interpret=True)
  with pytest.raises(ValueError, match="1..4"):
    multi_gemv(x, (w,) * 5, interpret=True)
  with pytest.raises(ValueError, match="1..4"):
    multi_gemv(x, (), interpret=True)
  with pytest.raises(ValueError, match="wrap"):
    multi_gemv(x, nw, interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    multi_gemv(x, (w, w.astype(jnp.float32)), interpret=True)
  with pytest.raises(ValueError, match="multiple of 64"):
    multi_gemv(randn(g, (2, 96)), (random_nvfp4(g, (32, 96)),), interpret=True)
  with pytest.raises(ValueError, match="method"):
    multi_gemv(x, (w,), method="blocks", interpret=True)


def test_reference_matches_per_matrix():
  g = rng("ref")
  x = randn(g, (3, 128))
  ws = nvfp4_weights(g, (64, 32), 128)
  for r, w in zip(multi_gemv_reference(x, ws), ws):
    np.testing.assert_array_equal(np.asarray(r, np.float32),
                                  np.asarray(nvfp4_gemv_reference(x, *w), np.float32))


def _rms_case(g, k, n_parts, m=1):
  # rows of different scales, so that a row normalised with another row's r is caught
  s = randn(g, (m, k), scale=3.0) * jnp.asarray(2.0 ** np.arange(m), jnp.bfloat16)[:, None]
  w = randn(g, (k,), scale=0.3) + 1
  s32 = np.asarray(s, np.float32)
  sumsq = jnp.asarray((s32 ** 2).reshape(m, n_parts, -1).sum(-1), jnp.float32)
  return s, w, sumsq


@pytest.mark.parametrize("m,ns,k,n_parts,kw", [
    (1, (256, 64, 64), 256, 16, {}),                                # default blocks, 16 blocks
    (1, (256, 64, 64), 384, 3, dict(method="blocks", block_k=128)),  # 3 parts (not a power of 2)
    (1, (128, 64), 256, 1, dict(post_scale=True, block_k=128)),
    (8, (256, 64, 64), 256, 16, {}),                     # batch 8's default: tensor-core dot
    (5, (128, 64), 384, 3, dict(method="dot", block_k=128)),        # padded rows (Mp = 16)
    (3, (128, 64), 256, 4, dict(method="rows")),                    # CUDA-core rows
])
def test_multi_gemv_rms(m, ns, k, n_parts, kw):
  """x given as the residual s with the sums of squares of its column blocks: the kernel's
  output equals the reference of x = bf16(w * (s * rsqrt(mean + eps))) row by row, and that x
  equals add_rms_norm's up to one bf16 ulp (the mean square's fp32 summation order)."""
  from flint_jax.pallas.add_rms_norm import add_rms_norm_reference
  g = rng("rms", m, ns, k, n_parts, kw)
  s, w, sumsq = _rms_case(g, k, n_parts, m)
  ws = nvfp4_weights(g, ns, k)
  rms = dict(rms_sumsq=sumsq, rms_weight=w, rms_eps=1e-5)
  out = multi_gemv(s, ws, decode=DECODE, interpret=INTERPRET, **rms, **kw)
  check_all(out, multi_gemv_reference(s, ws, **rms), ns, m, "multi_gemv rms")
  # the same as multiplying the normalised x (add_rms_norm's), to the GEMV's tolerance
  _, x = add_rms_norm_reference(s, jnp.zeros_like(s), w, eps=1e-5)
  check_all(out, multi_gemv_reference(x, ws), ns, m, "multi_gemv rms vs add_rms_norm x")
  # and not the GEMV of s itself: the normalisation happened
  plain = multi_gemv_reference(s, ws)
  assert not np.allclose(np.asarray(out[0], np.float32), np.asarray(plain[0], np.float32),
                         rtol=0.05, atol=0.05)


def test_multi_gemv_rms_rejects_bad_inputs():
  g = rng("rms-bad")
  s, w, sumsq = _rms_case(g, 256, 4)
  ws = nvfp4_weights(g, (128, 64), 256)
  with pytest.raises(ValueError, match="together"):
    multi_gemv(s, ws, rms_sumsq=sumsq, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"rms_sumsq must be f32 \[M=2"):   # one row of sums
    multi_gemv(jnp.concatenate([s, s]), ws, rms_sumsq=sumsq, rms_weight=w,
               interpret=INTERPRET)
  with pytest.raises(ValueError, match="NVFP4"):
    multi_gemv(s, bf16_weights(g, (128, 64), 256), rms_sumsq=sumsq, rms_weight=w,
               interpret=INTERPRET)
  with pytest.raises(ValueError, match="rms_sumsq must be f32"):
    multi_gemv(s, ws, rms_sumsq=sumsq.astype(jnp.bfloat16), rms_weight=w, interpret=INTERPRET)
  with pytest.raises(ValueError, match="rms_weight"):
    multi_gemv(s, ws, rms_sumsq=sumsq, rms_weight=w[:128], interpret=INTERPRET)


@pytest.mark.parametrize("fmt,m,ns,k,split_k,kw", [
    ("nvfp4", 8, (256, 64, 64), 512, 2, {}),                      # batch 8's dot tile, 2 slices
    ("nvfp4", 5, (128, 64, 64), 768, 3, dict(block_k=128)),         # 3 slices, padded rows
    ("nvfp4", 4, (128, 64), 512, 4, dict(block_k=64)),              # 4 slices of 2 K steps
    ("nvfp4", 2, (128, 64), 256, 2, dict(method="rows", block_n=16)),
    ("nvfp4", 1, (256, 64, 64), 1024, 2, dict(method="blocks")),    # default K step shrinks
    ("bf16", 8, (256, 64, 64), 256, 2, {}),
    ("bf16", 3, (128, 64), 384, 3, dict(block_k=64)),
])
def test_multi_gemv_split_k(fmt, m, ns, k, split_k, kw):
  """split_k programs per tile: fp32 partials [S, M, N_i], partial j equal to the kernel on K
  slice j alone; summed (the default) they equal the reference."""
  g = rng("split", fmt, m, ns, k, split_k, kw)
  x = randn(g, (m, k))
  ws = nvfp4_weights(g, ns, k) if fmt == "nvfp4" else bf16_weights(g, ns, k)
  dec = dict(decode=DECODE) if fmt == "nvfp4" else {}
  parts = multi_gemv(x, ws, split_k=split_k, sum_splits=False, interpret=INTERPRET, **dec, **kw)
  c = k // split_k
  for j in range(split_k):
    xj = x[:, j * c:(j + 1) * c]
    if fmt == "nvfp4":   # codes hold 2 values per byte, block scales one per 16 values
      wj = tuple((q[:, j * c // 2:(j + 1) * c // 2], s[:, j * c // 16:(j + 1) * c // 16], s2)
                 for q, s, s2 in ws)
    else:
      wj = tuple(w[:, j * c:(j + 1) * c] for w in ws)
    ref = multi_gemv_reference(xj, wj, out_dtype=jnp.float32)
    for i, p in enumerate(parts):
      assert p.shape == (split_k, m, ns[i]) and p.dtype == jnp.float32, (p.shape, p.dtype)
      assert_close(p[j], ref[i], what=f"partial {j} of matrix {i}")
  summed = multi_gemv(x, ws, split_k=split_k, interpret=INTERPRET, **dec, **kw)
  check_all(summed, multi_gemv_reference(x, ws), ns, m, f"multi_gemv split_k={split_k}")


def test_multi_gemv_split_k_rms():
  """split_k with the RMSNorm on load: every slice normalises with the whole row's statistic."""
  g = rng("split-rms")
  s, w, sumsq = _rms_case(g, 512, 8, m=8)
  ws = nvfp4_weights(g, (256, 64, 64), 512)
  rms = dict(rms_sumsq=sumsq, rms_weight=w, rms_eps=1e-5)
  out = multi_gemv(s, ws, split_k=4, block_k=64, decode=DECODE, interpret=INTERPRET, **rms)
  check_all(out, multi_gemv_reference(s, ws, **rms), (256, 64, 64), 8, "split_k rms")


def test_multi_gemv_split_k_rejects_bad_slices():
  g = rng("split-bad")
  x = randn(g, (2, 256))
  ws = nvfp4_weights(g, (128, 64), 256)
  with pytest.raises(ValueError, match="block_k \\* split_k dividing K"):
    multi_gemv(x, ws, split_k=3, block_k=64, interpret=INTERPRET)
