"""Several small-batch GEMVs sharing one input in one kernel (fused q|k|v projections).

``multi_gemv``: ``y_i[M, N_i] = out_dtype(x[M, K] @ W_i[N_i, K]^T)`` for 1 to 4 matrices
``W_i`` that share ``x`` and ``K`` (the attention ``q_proj``, ``k_proj``, ``v_proj`` at decode:
Flint K = 2048, N = 4096, 512, 512), all bf16 (like ``gemv.gemv``) or all NVFP4 (like
``nvfp4_gemv.nvfp4_gemv``, each matrix with its own fp32 ``weight_scale_2`` applied to its fp32
accumulator). What it fuses: the per-matrix launches (three GPU kernels -> one ``pallas_call``
with one output per matrix); the math of every output is that of the single-matrix kernel with
the same ``method`` / ``block_k`` (fp32 accumulation over the same K steps, one rounding), so the
results are bit-compatible with ``gemv`` / ``nvfp4_gemv`` run with ``split_k=1`` and the same
tile knobs.

Grid: ``(sum_i N_i / block_n,)``, the row blocks of all matrices one after the other: programs
``[0, N_0/BN)`` compute rows of ``W_0``, the next ``N_1/BN`` programs rows of ``W_1``, and so on.
Each program picks its matrix with one ``pl.when`` per matrix (static program ranges; Triton
``scf.if``), runs the K loop of the single-matrix kernel (``_common.mm_tile`` for bf16,
``nvfp4_gemv.nvfp4_tile_dot`` for NVFP4) and stores into its own output. ``block_n`` is shared by
all matrices and must divide every ``N_i``. ``split_k=S`` adds a second grid axis: program
(t, s) runs the K steps of the contiguous slice s and stores fp32 partials ``[S, M, N_i]``
(NVFP4: times the tensor scale), summed by XLA or, with ``sum_splits=False``, by the consumer
(``qk_norm_rope_attention`` sums q / k / v partials as it loads them). Why: at M = 8 the NVFP4
q|k|v on ``dot`` tiles is 80 programs of 16 K steps each for 132 SMs.

Tile method (knob ``method``): ``dot`` / ``swap`` / ``rows`` as in ``_common.mm_tile``, NVFP4
``blocks`` at M = 1; defaults follow the single-matrix kernels: bf16 ``swap`` at M = 1 and
``dot`` above, NVFP4 ``blocks`` at M = 1, ``rows`` at M = 2-3, ``dot`` above (``resolve_method``). Block defaults are those measured on the H200 for the *largest* matrix alone
(``default_gemv_blocks`` / ``default_nvfp4_blocks`` without split-K: q_proj-sized bf16 bn64 bk256,
NVFP4 M = 1 bn32 bk512, M > 1 bn64 bk128), with block_n lowered to the largest power of two that
divides every ``N_i``. Measured for the fused kernel on the H200: NVFP4 M = 1 (``blocks``, run
85) and M = 8 (run 104-105: bn64 bk128 4 stages 13.2 us against 16.3 on bk256 3 stages; bn32
22.9, bn16 45.8, bn128 19.4, bk64 23.2, 8 warps 21.9).

K: like the single-matrix kernels, K is not masked: bf16 needs ``block_k`` (a power of two >= 16)
to divide K, so any K % 16 == 0 works (K = 2880 -> block_k 64); NVFP4 needs K % 64 == 0.

Shapes / dtypes:
  x: [M, K] bf16 (or f32 with f32 weights, bf16 path only), 1 <= M <= 16.
  weights: tuple of 1..4 bf16 [N_i, K] arrays, or of 1..4 ``NVFP4Weight`` (qweight uint8
    [N_i, K/2], weight_scale float8_e4m3fn [N_i, K/16], weight_scale_2 f32 scalar).
  returns: tuple of [M, N_i] ``out_dtype`` (bf16 default).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import gemv as G
from flint_jax.pallas import nvfp4_gemv as NV

__all__ = ["multi_gemv", "multi_gemv_reference", "default_multi_gemv_blocks", "MAX_MATRICES"]

MAX_ROWS = 16
MAX_MATRICES = 4


def _is_nvfp4(w) -> bool:
  return isinstance(w, (tuple, list))


def _format(weights) -> str:
  """'bf16' or 'nvfp4' for a tuple of weights of one format; ValueError otherwise."""
  C.check(isinstance(weights, (tuple, list)) and 1 <= len(weights) <= MAX_MATRICES,
          f"weights must be a tuple of 1..{MAX_MATRICES} matrices, got "
          f"{type(weights).__name__} of length {len(weights) if hasattr(weights, '__len__') else '?'}")
  C.check(not isinstance(weights, NV.NVFP4Weight),
          "weights must be a tuple of matrices: wrap a single NVFP4Weight as (w,)")
  kinds = {_is_nvfp4(w) for w in weights}
  C.check(len(kinds) == 1, "weights mix formats: all must be bf16 arrays or all NVFP4Weight")
  return "nvfp4" if kinds.pop() else "bf16"


def _n_rows(w, fmt) -> int:
  return (w[0] if fmt == "nvfp4" else w).shape[0]


def default_multi_gemv_blocks(ns, k: int, *, m: int = 1, fmt: str = "bf16",
                              method: str | None = None):
  """(block_n, block_k, num_warps) for the fused GEMV of matrices with row counts ``ns``.

  BF16, and NVFP4 at M > 1: the single-matrix H200 defaults of the largest matrix (no split-K),
  block_n lowered to the largest power of two <= that default dividing every N_i (the H200 sweep
  of runs 9-11 found nothing faster for Flint's q|k|v: BF16 M=1 swap bn64 bk256 9.8 us).
  NVFP4 at M = 1: 16-row blocks, K steps of 512, 8 warps (Flint q|k|v 6.35 us against 10.4 us
  at bn32 bk512 w4: the CUDA-core decode needs many warps per SM, docs at 35c0874); ``blocks``
  K steps of 1024 with 16 warps (run 85: 5.33 us against 5.76 at bk512 w8). NVFP4 ``rows`` (M
  row sums per decoded tile) takes the M = 1 tiles.
  """
  nmax = max(ns)
  if fmt == "bf16":
    bn, bk, _, warps = G.default_gemv_blocks(nmax, k, m=m)
  elif method == "blocks":   # q|k|v 5.33 us at bk1024 w16 against 5.76 at bk512 w8 (run 85)
    bn, bk, warps = 16, C.pow2_divisor(k, 1024), 16
  elif m == 1 or method == "rows":
    bn, bk, warps = 16, C.pow2_divisor(k, 512), 8
  else:
    bn, bk, _, warps = NV.default_nvfp4_blocks(nmax, k, m=m)
  bn = C.pow2_divisor(math.gcd(*ns), bn)
  return bn, bk, warps


def resolve_method(fmt: str, m: int, method, decode: str, interpret: bool):
  """(tile method, NVFP4 decode) after defaults and checks, shared with ``norm_qkv``."""
  if fmt == "bf16":
    method = method or G.default_method(m)
    C.check_method(method, m, ("dot", "swap", "rows"))
    return method, decode
  decode = NV.resolve_decode(decode, interpret)
  # rows at M = 2..3: Flint q|k|v 9.9 / 13.6 us against 14.1 / 13.8 for the tensor-core tile
  # on its bk128 tiles (H200 run 108; 3x1K step 3.797 against 3.847 ms); dot from M = 4: 13.7
  # against 17.7 (4x1K step 4.132 against 4.325; run 25 had rows ahead at M = 4 when the dot
  # tile took 23.1 us); blocks at M = 1 (q|k|v 5.33 against 5.70 us for lanes, run 85, and
  # lanes 5.92 against 6.34 for reduce, run 32: both retired after 35c0874)
  method = method or ("rows" if 2 <= m <= 3 else NV.default_method(m))
  C.check_method(method, m)
  return method, decode


def _validate(x, weights, fmt, block_n, block_k):
  C.check(x.ndim == 2, f"x must be [M, K], got {x.shape=}")
  m, k = x.shape
  C.check(1 <= m <= MAX_ROWS, f"multi_gemv handles 1..{MAX_ROWS} rows, got {m=}")
  ns = []
  for i, w in enumerate(weights):
    if fmt == "bf16":
      C.check(w.ndim == 2 and w.shape[1] == k,
              f"weights[{i}] must be [N, K={k}] (K shared with x), got {w.shape=}")
      C.check(w.dtype == x.dtype,
              f"x and weights[{i}] must share a dtype, got {x.dtype=} {w.dtype=}")
    else:
      C.check(len(w) == 3, f"weights[{i}] must be NVFP4Weight(qweight, weight_scale, "
              f"weight_scale_2), got {len(w)} arrays")
      q, s, s2 = w
      C.check(x.dtype == jnp.bfloat16, f"NVFP4 multi_gemv needs bf16 x, got {x.dtype=}")
      C.check(k % 64 == 0, f"NVFP4 needs K to be a multiple of 64, got {k=}")
      C.check(q.dtype == jnp.uint8 and q.ndim == 2 and q.shape[1] * 2 == k,
              f"weights[{i}].qweight must be uint8 [N, K/2={k // 2}] (K shared with x), got "
              f"{q.shape=} {q.dtype=}")
      C.check(NV.is_block_scale_dtype(s.dtype) and s.shape == (q.shape[0], k // 16),
              f"weights[{i}].weight_scale must be float8_e4m3fn (or pre-scaled bf16) "
              f"[N, K/16], got {s.shape=} {s.dtype=}")
      C.check(math.prod(jnp.shape(s2)) == 1,
              f"weights[{i}].weight_scale_2 must be a scalar, got {jnp.shape(s2)=}")
    ns.append(_n_rows(w, fmt))
  for i, n in enumerate(ns):
    C.check(n > 0, f"weights[{i}] has no rows")
    C.check(C.is_pow2(block_n) and block_n >= 16 and n % block_n == 0,
            f"block_n must be a power of two >= 16 dividing every N_i: {block_n=} N={ns} "
            f"(weights[{i}])")
  kmin = 16 if fmt == "bf16" else 64
  C.check(C.is_pow2(block_k) and block_k >= kmin and k % block_k == 0,
          f"block_k must be a power of two >= {kmin} dividing K: {block_k=} {k=}")
  return m, k, tuple(ns)


class _NormedRow:
  """The x operand of ``multi_gemv(rms_sumsq=...)``: indexed like the x view [M, K/64, 2, 2, 16]
  (by one row, a Python int, or by the [Mp] row index of a tensor-core tile), it loads the
  residual s there and the norm weight w at the same columns and returns bf16(w * (f32(s) * r)),
  ``add_rms_norm``'s formula with each row's r = rsqrt(mean square + eps): ``r_rows[i]`` for
  row i, ``r_vec`` [Mp] for the row index's rows."""

  def __init__(self, s_ref, w_ref, r_rows, r_vec=None):
    self.s_ref, self.w_ref, self.r_rows, self.r_vec = s_ref, w_ref, r_rows, r_vec

  def __getitem__(self, idx):
    s = self.s_ref[idx]
    w = self.w_ref[idx[1:]]                 # the same columns of w [K/64, 2, 2, 16]
    if isinstance(idx[0], int):
      r = self.r_rows[idx[0]]
    else:                                   # [Mp, ...]: one r per loaded row
      r = self.r_vec.reshape((self.r_vec.shape[0],) + (1,) * (s.ndim - 1))
    return (w.astype(jnp.float32) * (s.astype(jnp.float32) * r)).astype(s.dtype)


def _row_rms(ss_ref, m, mp, k, eps, per_row_index):
  """Each row's r = rsqrt(sum of its partial sums of squares / K + eps) from ss_ref [M, P]: a
  list of M scalars, and with ``per_row_index`` also [Mp] along ``row_load_index(m, mp)``."""
  n_parts = ss_ref.shape[1]
  idx = jnp.arange(C.next_pow2(n_parts), dtype=jnp.int32)
  r_rows = [lax.rsqrt(jnp.sum(plgpu.load(ss_ref.at[i, idx], mask=idx < n_parts, other=0)) / k
                      + eps) for i in range(m)]
  if not per_row_index:
    return r_rows, None
  rows = C.row_load_index(m, mp)
  r_vec = jnp.zeros((mp,), jnp.float32)
  for i, r in enumerate(r_rows):          # padded rows repeat the last real row, as x's do
    r_vec = jnp.where(rows == i, r, r_vec)
  return r_rows, r_vec


def _multi_gemv_kernel(*refs, fmt, n_mats, starts, m, mp, bn, bk, n_iter, decode, method,
                       rms_eps=None, split_k=1, post=False):
  """Programs [starts[i], starts[i+1]) compute BN-row tiles of matrix i into output i; with
  ``split_k`` > 1, program (t, s) the ``n_iter`` K steps of slice s into partial s of output i.

  refs (bf16): x [M, K], w_0..w_{n-1} [N_i, K], o_0..o_{n-1} [M, N_i].
  refs (nvfp4): x view [M, K/64, 2, 2, 16], (codes, scales) views per matrix, then one [1] f32
  tensor scale per matrix (separate inputs: stacking them would be an XLA launch per call),
  then with ``rms_eps`` the sums of squares [M, P] and the norm weight view [K/64, 2, 2, 16],
  o_0..o_{n-1}.
  """
  pid = pl.program_id(0)
  ks = pl.program_id(1) if split_k > 1 else 0           # this program's K slice
  j0 = ks * n_iter                                      # its first K step
  x_ref = refs[0]
  if fmt == "bf16":
    w_refs = [(r,) for r in refs[1:1 + n_mats]]
    s2_refs = None
  else:
    w_refs = [tuple(refs[1 + 2 * i:3 + 2 * i]) for i in range(n_mats)]
    s2_refs = refs[1 + 2 * n_mats:1 + 3 * n_mats]
  o_refs = refs[len(refs) - n_mats:]
  if rms_eps is not None:   # x is the residual s: normalised as it is loaded
    ss_ref, wn_ref = refs[1 + 3 * n_mats:3 + 3 * n_mats]
    tensor_core = method not in ("blocks", "rows")
    x_ref = _NormedRow(x_ref, wn_ref, *_row_rms(ss_ref, m, mp, split_k * n_iter * bk,
                                                 rms_eps, tensor_core))

  def matrix(i):
    n0 = pl.multiple_of((pid - starts[i]) * bn, bn)
    if fmt == "bf16":
      (w_ref,) = w_refs[i]

      def body(j, acc):
        k0 = pl.multiple_of((j0 + j) * bk, bk)
        xt = C.load_x(x_ref, (), m, mp, pl.ds(k0, bk))          # [Mp, BK]
        w = w_ref[pl.ds(n0, bn), pl.ds(k0, bk)]                # [BN, BK]
        return acc + C.mm_tile(xt, w, method)
      lanes = ()
    else:
      q_ref, s_ref = w_refs[i]
      nb = bk // 64
      lanes = NV.lanes_shape(bk)

      def body(j, acc):
        b0 = pl.multiple_of((j0 + j) * nb, nb)
        return NV.nvfp4_tile_dot(x_ref, (), m, mp, q_ref, s_ref, (), n0, bn, b0, nb,
                                 decode=decode, method=method, acc=acc, post=post)

    acc = lax.fori_loop(0, n_iter, body, C.acc_zeros(mp, bn, method, lanes))
    acc = C.finish_acc(acc, method)
    if fmt == "nvfp4":
      acc = acc * (s2_refs[i][0] * NV.decode_factor(decode))
    C.store_tile(o_refs[i], (ks,) if split_k > 1 else (), acc, n0, bn, m, mp, method)

  run_matrix_branches(pid, starts, matrix)


def run_matrix_branches(pid, starts, matrix):
  """Calls ``matrix(i)`` under ``pl.when`` for the programs [starts[i], starts[i + 1]) of each
  matrix i (no branch for a single matrix)."""
  n_mats = len(starts) - 1
  for i in range(n_mats):
    if n_mats == 1:
      matrix(i)
    elif i == 0:
      pl.when(pid < starts[1])(functools.partial(matrix, i))
    elif i == n_mats - 1:
      pl.when(pid >= starts[i])(functools.partial(matrix, i))
    else:
      pl.when((pid >= starts[i]) & (pid < starts[i + 1]))(functools.partial(matrix, i))


@functools.partial(jax.jit, static_argnames=(
    "out_dtype", "block_n", "block_k", "method", "decode", "num_warps", "num_stages", "rms_eps",
    "split_k", "sum_splits", "post_scale", "early_trigger", "interpret"))
def multi_gemv(x, weights, *, out_dtype=jnp.bfloat16, block_n: int | None = None,
               block_k: int | None = None, method: str | None = None, decode: str = "asm",
               num_warps: int | None = None, num_stages: int | None = None, rms_sumsq=None,
               rms_weight=None, rms_eps: float = 1e-6, split_k: int = 1,
               sum_splits: bool = True, post_scale: bool = False, early_trigger: bool = True,
               interpret: bool = False):
  """(y_0, ..., y_{n-1}), y_i[M, N_i] = out_dtype(x @ W_i^T [* weight_scale_2_i]), one kernel.

  weights: tuple of 1..4 bf16 [N_i, K] arrays, or tuple of 1..4 ``NVFP4Weight``. ``method``:
  "dot" / "swap" / "rows", or "blocks" (NVFP4, M == 1); default ``gemv.default_method`` (bf16)
  or, for NVFP4, "rows" at M = 2..3 and ``nvfp4_gemv.default_method`` otherwise
  (``resolve_method``).
  ``decode``: NVFP4 only (see ``nvfp4_gemv``; ``decode="asm"`` falls back to ``"fp8"`` in
  interpret mode). Block defaults: ``default_multi_gemv_blocks``.
  ``post_scale`` (NVFP4 ``blocks`` tiles with the asm decode): each 16-value block's sum is
  scaled instead of each decoded weight (``nvfp4_gemv.blocks_fma_post``; the same products
  summed in another order: H200 run 91, the batch-1 q|k|v 5.43 against 5.61 us in the step).
  ``early_trigger``: the kernel lets the next one launch first (``pdl``).

  ``rms_sumsq`` f32 [M, P] and ``rms_weight`` [K] (NVFP4): x is a residual s, and
  the kernel multiplies its RMSNorm instead, row by row x' = bf16(w * (f32(s) *
  rsqrt(sum(rms_sumsq[row]) / K + rms_eps))), computed as each K step loads x; ``rms_sumsq``
  holds the sums of squares of s over any P column blocks
  (``moe_decode_routed_combine(norm=False)``). Equal to ``add_rms_norm``'s x' up to the fp32
  summation order of the mean square.

  ``split_k`` > 1: ``split_k`` programs per output tile, program s running the K steps of
  [s K/split_k, (s+1) K/split_k) and storing fp32 partials [split_k, M, N_i]; ``sum_splits``
  (default) sums them in XLA and casts to ``out_dtype``, ``sum_splits=False`` returns the
  partials (for ``qk_norm_rope_attention``, which sums them as it loads q / k / v). The default
  K step shrinks until the slices divide K into at least 4 steps each (or to its minimum).
  """
  fmt = _format(weights)
  C.check(x.ndim == 2, f"x must be [M, K], got {x.shape=}")
  m, k = x.shape
  ns = tuple(_n_rows(w, fmt) for w in weights)
  method, decode = resolve_method(fmt, m, method, decode, interpret)
  dbn, dbk, dwarps = default_multi_gemv_blocks(ns, k, m=m, fmt=fmt, method=method)
  if block_k is None and split_k > 1:   # the default K step, shrunk to fit a slice 4 times
    # (H200 run 142, NVFP4 q|k|v at M = 8: S = 8 on 4 steps of 64 8.88 us, S = 4 on 4 of 128
    # 11.62, S = 2 on 8 of 128 13.34, unsplit 16 of 128 13.17)
    dbk = C.split_block_k(dbk, k, split_k, fmt, min_steps=4)
  block_n, block_k = block_n or dbn, block_k or dbk
  num_warps = num_warps or dwarps
  # BF16 at M = 1: 4 stages (Flint q|k|v 8.8 us against 9.8 with 3, session-3 sweep round 2);
  # NVFP4 dot at M > 1 (its 128-wide K steps): 4 (H200 run 104, q|k|v at M = 8 13.2 us)
  nv_dot = fmt == "nvfp4" and method == "dot" and m > 1
  num_stages = num_stages or (4 if (fmt == "bf16" and m == 1) or nv_dot else 3)
  m, k, ns = _validate(x, weights, fmt, block_n, block_k)
  C.check(split_k >= 1 and k % (block_k * split_k) == 0,
          f"split_k must be >= 1 with block_k * split_k dividing K: {split_k=} {block_k=} {k=}")
  rms = rms_sumsq is not None
  if rms or rms_weight is not None:
    C.check(rms and rms_weight is not None, "give rms_sumsq and rms_weight together")
    C.check(fmt == "nvfp4", f"rms_sumsq needs NVFP4 weights, got {fmt=}")
    C.check(rms_sumsq.ndim == 2 and rms_sumsq.shape[0] == m
            and rms_sumsq.dtype == jnp.float32 and rms_weight.shape == (k,),
            f"rms_sumsq must be f32 [M={m}, P] and rms_weight [K={k}], got {rms_sumsq.shape} "
            f"{rms_sumsq.dtype} / {rms_weight.shape}")
  mp = C.pad_rows(m, method)
  n_mats = len(weights)
  starts = tuple(sum(ns[:i]) // block_n for i in range(n_mats + 1))

  if fmt == "bf16":
    args = (x, *weights)
    tag = f"bf16_{method}"
  else:
    args = [NV.x_view(x)]
    for w in weights:
      args += NV.nvfp4_views(w[0], w[1])
    args += [C.scalar_f32(w[2]) for w in weights]
    tag = f"nvfp4_{method}_{decode}_tile"
    if rms:
      args += [rms_sumsq, NV.x_view(rms_weight.astype(x.dtype)[None])[0]]
      tag += "_rms"
  kernel = functools.partial(_multi_gemv_kernel, fmt=fmt, n_mats=n_mats, starts=starts, m=m,
                             mp=mp, bn=block_n, bk=block_k, n_iter=k // block_k // split_k,
                             decode=decode, method=method, rms_eps=rms_eps if rms else None,
                             split_k=split_k, post=post_scale and fmt == "nvfp4")
  out_shape = tuple(jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if split_k > 1
                    else jax.ShapeDtypeStruct((m, n), out_dtype) for n in ns)
  outs = tuple(C.pallas_call(
      kernel, out_shape=out_shape, grid=(starts[-1], split_k) if split_k > 1 else (starts[-1],),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger,
      name=f"flint_multi_gemv{n_mats}_{tag}_bn{block_n}_bk{block_k}"
           + (f"_splitk{split_k}" if split_k > 1 else ""),
  )(*args))
  if split_k > 1 and sum_splits:
    outs = tuple(jnp.sum(o, axis=0).astype(out_dtype) for o in outs)
  return outs


def multi_gemv_reference(x, weights, *, out_dtype=jnp.bfloat16, rms_sumsq=None,
                         rms_weight=None, rms_eps: float = 1e-6, **unused_tuning):
  """Plain jnp: per matrix the fp32 dot (NVFP4: exact dequantisation, times weight_scale_2),
  rounded once to ``out_dtype``; returns a tuple. With ``rms_sumsq``: of x normalised first
  (``multi_gemv``'s formula)."""
  del unused_tuning
  if rms_sumsq is not None:
    r = lax.rsqrt(jnp.sum(rms_sumsq, axis=-1, keepdims=True) / x.shape[-1] + rms_eps)
    x = (rms_weight.astype(jnp.float32) * (x.astype(jnp.float32) * r)).astype(x.dtype)
  fmt = _format(weights)
  if fmt == "bf16":
    return tuple(G.gemv_reference(x, w, out_dtype=out_dtype) for w in weights)
  return tuple(NV.nvfp4_gemv_reference(x, *w, out_dtype=out_dtype) for w in weights)
