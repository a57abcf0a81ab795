"""End of a layer + the next layer's input RMSNorm + its fused q|k|v GEMVs, one kernel.

``norm_qkv(h, weights, w_norm, y=..., top_logits=...)`` returns ``(s, (q, k, v))``:

  s   = the new residual stream [M, D] (h.dtype), by mode:
          MoE   (y [U+1, M, D], top_logits [M, top_k] f32, U = M * top_k: ``moe_decode_routed``'s
                y and ``route.logits``, the selected router logits in top-k order):
                s = bf16(h + bf16(sum_j w_j f32(y[t*top_k+j, t]) + f32(y[U, t])))
                exactly ``moe.moe_combine_add_rms_norm`` (w_j = sigmoid(l_j) / sum_j sigmoid(l_j)
                in fp32, the sigmoids added in top-k order, fp32 sum in top-k order);
          dense (y [M, D]):      s = bf16(h + y)           (``add_rms_norm``);
          norm  (y None):        s = h                     (``rms_norm``; layer 0's embeddings;
                                                            returned as is, not copied)
  x   = bf16(w_norm * (f32(s) * rsqrt(mean(f32(s)^2) + eps)))   (``add_rms_norm``'s formula)
  out = ``multi_gemv(x, weights)``: out_i [M, N_i] = out_dtype(x @ W_i^T), bf16 weights

What it fuses: ``moe_combine_add_rms_norm`` / ``add_rms_norm`` / ``rms_norm`` in front of
``multi_gemv`` -- one launch per decode layer fewer, and x never goes through HBM.

One ``pallas_call`` with ``multi_gemv``'s grid (``sum_i N_i / block_n`` programs, one
``pl.when`` branch per matrix). Every program

1. (MoE) loads its tokens' top_k selected logits (stored by ``moe_decode_routed``'s gate_up
   kernel; scalar loads at M == 1, [Mp] row vectors when M > 1) and forms the combine weights;
2. runs a pass over D in ``block_d`` chunks: rebuilds s from the h / y chunks (the combine is
   elementwise per column, so every chunk's s is bit-identical to the one-block kernels') and
   accumulates f32(s)^2 per row in an fp32 ``[.., block_d]`` vector, summed at the end
   (program 0 also stores s);
3. runs ``multi_gemv``'s K loop, where each x tile is rebuilt from the h / y / w_norm chunks and
   the row statistic instead of being loaded (Triton cannot slice a register vector
   dynamically; the re-reads hit L1/L2: MoE y is (top_k + 1) * D * 2 bytes per token).

Numerics: s is bit-identical to the unfused ops (elementwise). x equals theirs except for the
summation order of the fp32 row sum of squares (chunked here, one block there: the order of any
two reductions differs anyway, Triton's tree vs XLA's), which can move rsqrt by an fp32 ulp and,
rarely, an x element by one bf16 ulp. Given x, ``out`` is bit-identical to ``multi_gemv(x)`` with
the same tile knobs (same K steps, tile dots and epilogue). ``return_x=True`` also returns the
kernel's x (program 0 writes it in a third pass; for tests).

The decode step runs it for BF16 weights at batch 1 (``DecodePlan.layer_end == "qkv"``): one
launch less per layer, 0.05-0.1 ms per token (H200 runs 13, 20, 22; the kernel 10.2 against
12.2 us for the pair it replaces). Retired after 35c0874: NVFP4 weights (slower: run 38, and at
batch 8, docs at 35c0874) and K slices (``split_k``: 13.4 against 10.4 us, run 48: every program
repeats the statistic pass).

With M == 1 the rows are not padded for the elementwise work: s / x chunks are 1-D and
broadcast to the 16 rows the ``dot`` / ``swap`` tiles need.

Shapes / dtypes: h [M, D] bf16 (f32 with f32 weights), 1 <= M <= 16; w_norm [D] any float;
y [M, D] or [M * top_k + 1, M, D] with h's dtype; top_logits [M, top_k] f32; weights 1..4 bf16
[N_i, D] (h's dtype). Returns (s [M, D] h.dtype, tuple of [M, N_i] out_dtype) (+ x [M, D] with
``return_x``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import add_rms_norm as ARN
from flint_jax.pallas.moe import combine as MOE
from flint_jax.pallas import multi_gemv as MG
G = MG.G

__all__ = ["norm_qkv", "norm_qkv_reference", "default_block_d", "MODES"]

MODES = ("moe", "dense", "norm")


# ------------------------------------------------------------------------------------------
# Kernel


def _norm_qkv_kernel(*refs, names, mode, n_mats, starts, m, mp, d, bn, bk, bd, eps, top_k, u,
                     method, return_x):
  """refs by ``names``: h [M, D], y (dense [M, D] / MoE [(U+1) * M, D]), top_logits [M, top_k],
  w_norm [D], per matrix w, outputs o_0..o_{n-1} [M, N_i], s (unless mode norm), x
  (return_x)."""
  r = dict(zip(names, refs))
  pid = pl.program_id(0)
  first = pid == 0
  one = m == 1
  rows = 0 if one else C.row_load_index(m, mp)          # row index (int or [Mp] vector)
  dt = r["h"].dtype

  coefs = None
  if mode == "moe":
    # the selected logits in top-k order: scalars (M == 1) or [Mp] (padded rows repeat row m-1)
    vals = [r["top_logits"][rows, j] for j in range(top_k)]
    sig = [jax.nn.sigmoid(v) for v in vals]
    den = sig[0]
    for sj in sig[1:]:
      den = den + sj
    coefs = [sj / den for sj in sig]                     # top-k order

  def col(v, nd):
    """A per-row value (scalar / [Mp]) broadcastable against an [Mp, <nd col dims>] tile."""
    return v if one else v.reshape((mp,) + (1,) * nd)

  def s_chunk(hr, yr, cidx, nd):
    """s at the trailing indices cidx of the (possibly viewed) h / y refs."""
    h = hr[(rows, *cidx)]
    if mode == "norm":
      return h
    if mode == "dense":
      y = yr[(rows, *cidx)]
      return (h.astype(jnp.float32) + y.astype(jnp.float32)).astype(dt)
    tot = jnp.zeros(h.shape, jnp.float32)
    for j, c in enumerate(coefs):
      yj = yr[((rows * top_k + j) * m + rows, *cidx)]
      tot = tot + col(c, nd) * yj.astype(jnp.float32)
    ys = yr[(u * m + rows, *cidx)].astype(jnp.float32)
    moe = (tot + ys).astype(dt)
    return (h.astype(jnp.float32) + moe.astype(jnp.float32)).astype(dt)

  def x_chunk(hr, yr, wr, cidx, nd, inv):
    s32 = s_chunk(hr, yr, cidx, nd).astype(jnp.float32)
    w32 = wr[cidx].astype(jnp.float32)
    return (w32 * (s32 * col(inv, nd))).astype(dt)

  def store_rows(o_ref, v, k0):
    cols = k0 + jnp.arange(bd, dtype=jnp.int32)
    if one:
      plgpu.store(o_ref.at[0, cols], v)
    else:
      ri, rmask = C.row_store_index(m, mp)
      plgpu.store(o_ref.at[ri[:, None], cols[None, :]], v, mask=rmask[:, None])

  # Pass 1: the row statistic sum(f32(s)^2) (program 0 stores s).
  def stat_body(i, acc):
    k0 = pl.multiple_of(i * bd, bd)
    s = s_chunk(r["h"], r.get("y"), (pl.ds(k0, bd),), 1)
    if mode != "norm":
      pl.when(first)(lambda: store_rows(r["s"], s, k0))
    s32 = s.astype(jnp.float32)
    return acc + s32 * s32

  acc = lax.fori_loop(0, d // bd, stat_body,
                      jnp.zeros((bd,) if one else (mp, bd), jnp.float32))
  inv = lax.rsqrt(jnp.sum(acc, axis=-1) / d + eps)       # scalar / [Mp]

  if return_x:
    def x_body(i, carry):
      k0 = pl.multiple_of(i * bd, bd)
      store_rows(r["x"], x_chunk(r["h"], r.get("y"), r["w"], (pl.ds(k0, bd),), 1, inv), k0)
      return carry
    @pl.when(first)
    def _():
      lax.fori_loop(0, d // bd, x_body, 0)

  # Pass 2: multi_gemv's K loop on x tiles rebuilt from h / y / w_norm and the statistic.
  o_refs = [r[f"o{i}"] for i in range(n_mats)]

  def matrix(i):
    n0 = pl.multiple_of((pid - starts[i]) * bn, bn)
    w_ref = r[f"w{i}"]

    def body(j, acc):
      k0 = pl.multiple_of(j * bk, bk)
      xt = x_chunk(r["h"], r.get("y"), r["w"], (pl.ds(k0, bk),), 1, inv)
      if one:
        xt = jnp.broadcast_to(xt[None, :], (mp, bk))
      w = w_ref[pl.ds(n0, bn), pl.ds(k0, bk)]                           # [BN, BK]
      return acc + C.mm_tile(xt, w, method)

    n_k = d // bk
    acc = lax.fori_loop(0, n_k, body, C.acc_zeros(mp, bn, method))
    C.store_tile(o_refs[i], (), acc, n0, bn, m, mp, method)

  MG.run_matrix_branches(pid, starts, matrix)


# ------------------------------------------------------------------------------------------
# Wrapper


def default_block_d(d: int, m: int, block_k: int) -> int:
  """Chunk of the statistic pass: at M == 1 the whole row (up to 2048; 1-D, ~16 values per thread
  per load at 4 warps: one round of independent loads before the weight stream starts), else
  ``block_k`` ([16, block_k] tiles, as the K loop's). Not measured."""
  return C.pow2_divisor(d, 2048) if m == 1 else block_k


def _mode(h, y, top_logits, w_norm):
  """(mode, top_k): "moe" (top_k of top_logits), "dense" or "norm" (top_k 0)."""
  C.check(h.ndim == 2, f"h must be [M, D], got {h.shape=}")
  m, d = h.shape
  C.check(1 <= m <= MG.MAX_ROWS, f"norm_qkv handles 1..{MG.MAX_ROWS} rows, got {m=}")
  C.check(jnp.issubdtype(h.dtype, jnp.floating), f"h must be floating, got {h.dtype=}")
  C.check(w_norm.shape == (d,), f"w_norm must be [D={d}], got {w_norm.shape=}")
  if y is None:
    C.check(top_logits is None,
            "top_logits given without y: MoE mode needs y [M*top_k+1, M, D]")
    return "norm", 0
  C.check(y.dtype == h.dtype, f"y must have h's dtype, got {y.dtype=} {h.dtype=}")
  if top_logits is None:
    C.check(y.shape == h.shape,
            f"dense mode: y must be [M, D] = {h.shape} (MoE mode needs top_logits), got {y.shape=}")
    return "dense", 0
  top_k = MOE.check_top_logits(top_logits, m)
  uu = m * top_k
  C.check(y.shape == (uu + 1, m, d),
          f"MoE mode: y must be [M*top_k+1={uu + 1}, M={m}, D={d}] (top_k={top_k} from "
          f"top_logits), got {y.shape=}")
  return "moe", top_k


def _inputs(h, y, top_logits, w_norm, weights, mode, top_k):
  """(names, args, u) of the kernel's inputs: h, y (unless mode "norm"), top_logits (MoE;
  u = M * top_k slots, else 0), w_norm, then per matrix ``w{i}``."""
  names, args, u = ["h"], [h], 0
  if mode != "norm":
    names.append("y")
    args.append(y)
  if mode == "moe":
    names.append("top_logits")
    args.append(top_logits)
    u = h.shape[0] * top_k
  names.append("w")
  args.append(w_norm)
  for i, w in enumerate(weights):
    names.append(f"w{i}")
    args.append(w)
  return names, args, u


@functools.partial(jax.jit, static_argnames=(
    "eps", "out_dtype", "block_n", "block_k", "block_d", "method", "num_warps", "num_stages",
    "return_x", "early_trigger", "interpret"))
def norm_qkv(h, weights, w_norm, *, y=None, top_logits=None, eps: float = 1e-6,
             out_dtype=jnp.bfloat16, block_n: int | None = None, block_k: int | None = None,
             block_d: int | None = None, method: str | None = None,
             num_warps: int | None = None, num_stages: int | None = None,
             return_x: bool = False, early_trigger: bool = True, interpret: bool = False):
  """(s, outs): residual update + RMSNorm + ``multi_gemv`` in one pallas_call (module docstring).

  Mode from the arguments: ``y`` [M*top_k+1, M, D] + ``top_logits`` [M, top_k] f32
  (``moe_decode_routed``'s y and ``route.logits``) -> MoE combine;
  ``y`` [M, D] -> dense residual add; no ``y`` -> RMSNorm of h only (s is h). Tile knobs
  (``block_n``, ``block_k``, ``method``, ``num_warps``, ``num_stages``) and their defaults are
  ``multi_gemv``'s BF16 ones; ``block_d`` (default ``default_block_d``) is the chunk of the
  statistic pass. ``return_x``: also return the kernel's normalised x [M, D] (tests).
  ``early_trigger``: the kernel lets the next one launch first (``pdl``).
  """
  mode, top_k = _mode(h, y, top_logits, w_norm)
  fmt = MG._format(weights)  # pylint: disable=protected-access
  C.check(fmt == "bf16", "norm_qkv takes bf16 weights (its NVFP4 form was retired after "
          "35c0874: slower than the two kernels it replaces)")
  m, d = h.shape
  ns = tuple(MG._n_rows(w, fmt) for w in weights)  # pylint: disable=protected-access
  method, _ = MG.resolve_method(fmt, m, method, "asm", interpret)
  dbn, dbk, dwarps = MG.default_multi_gemv_blocks(ns, d, m=m, fmt=fmt, method=method)
  block_n, block_k = block_n or dbn, block_k or dbk
  block_d = block_d or default_block_d(d, m, block_k)
  num_warps = num_warps or dwarps
  # BF16 at M = 1: 4 stages, as multi_gemv (nqtune, run 25: Flint 9.79 us against 10.40 with 3,
  # 10.11 with 5; block_k 512 with 4 stages exceeds the shared memory)
  num_stages = num_stages or (4 if m == 1 else 3)
  MG._validate(jax.ShapeDtypeStruct((m, d), h.dtype), weights, fmt, block_n, block_k)  # pylint: disable=protected-access
  C.check(C.is_pow2(block_d) and block_d >= 16 and d % block_d == 0,
          f"block_d must be a power of two >= 16 dividing D: {block_d=} {d=}")
  mp = C.pad_rows(m, method)
  n_mats = len(weights)
  starts = tuple(sum(ns[:i]) // block_n for i in range(n_mats + 1))

  y2 = None if mode == "norm" else y.reshape(-1, d)      # MoE: [(U+1) * M, D], free
  names, args, u = _inputs(h, y2, top_logits, w_norm, weights, mode, top_k)
  out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype) for n in ns]
  names += [f"o{i}" for i in range(n_mats)]
  if mode != "norm":
    out_shape.append(jax.ShapeDtypeStruct((m, d), h.dtype))
    names.append("s")
  if return_x:
    out_shape.append(jax.ShapeDtypeStruct((m, d), h.dtype))
    names.append("x")
  kernel = functools.partial(
      _norm_qkv_kernel, names=tuple(names), mode=mode, n_mats=n_mats, starts=starts, m=m, mp=mp,
      d=d, bn=block_n, bk=block_k, bd=block_d, eps=eps, top_k=top_k, u=u, method=method,
      return_x=return_x)
  res = C.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(starts[-1],),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger,
      name=f"flint_norm_qkv{n_mats}_{mode}_bf16_{method}_bn{block_n}_bk{block_k}_bd{block_d}",
  )(*args)
  outs = tuple(res[:n_mats])
  rest = list(res[n_mats:])
  s = h if mode == "norm" else rest.pop(0)
  if return_x:
    return s, outs, rest.pop(0)
  return s, outs


def norm_qkv_reference(h, weights, w_norm, *, y=None, top_logits=None, eps: float = 1e-6,
                       out_dtype=jnp.bfloat16, **unused_tuning):
  """Plain jnp: ``moe_combine_add_rms_norm_reference`` / ``add_rms_norm_reference`` /
  ``rms_norm_reference`` (by mode), then ``multi_gemv_reference``; returns (s, outs)."""
  del unused_tuning
  mode, _ = _mode(h, y, top_logits, w_norm)
  if mode == "norm":
    s, x = h, ARN.rms_norm_reference(h, w_norm, eps=eps)
  elif mode == "dense":
    s, x = ARN.add_rms_norm_reference(h, y, w_norm, eps=eps)
  else:
    s, x = MOE.moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, eps=eps)
  return s, MG.multi_gemv_reference(x, weights, out_dtype=out_dtype)
