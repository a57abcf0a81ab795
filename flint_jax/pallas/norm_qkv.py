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
  out = ``multi_gemv(x, weights)``: out_i [M, N_i] = out_dtype(x @ W_i^T [* weight_scale_2_i])

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
   NVFP4 rebuilds x directly in the ``nvfp4_gemv.x_view`` layout (h, y, w_norm are read through
   the same free [.., D/64, 2, 2, 16] views).

Numerics: s is bit-identical to the unfused ops (elementwise). x equals theirs except for the
summation order of the fp32 row sum of squares (chunked here, one block there: the order of any
two reductions differs anyway, Triton's tree vs XLA's), which can move rsqrt by an fp32 ulp and,
rarely, an x element by one bf16 ulp. Given x, ``out`` is bit-identical to ``multi_gemv(x)`` with
the same tile knobs (same K steps, tile dots and epilogue). ``return_x=True`` also returns the
kernel's x (program 0 writes it in a third pass; for tests).

``split_k=S`` runs S programs per output tile over contiguous K ranges and returns fp32
partials (summed by XLA, or with ``sum_splits=False`` by the consumer: the fused attention
kernel). Measured slower for Flint's BF16 q|k|v at M = 1 (13.4 against 10.4 us, H200 run 48:
every program repeats the statistic pass); kept off by the decode step.

With M == 1 the rows are not padded for the elementwise work: s / x chunks are 1-D and
broadcast to the 16 rows the ``dot`` / ``swap`` tiles need.

Shapes / dtypes: h [M, D] bf16 (f32 with bf16-path f32 weights), 1 <= M <= 16; w_norm [D] any
float; y [M, D] or [M * top_k + 1, M, D] with h's dtype; top_logits [M, top_k] f32; weights as
``multi_gemv`` (1..4 bf16 [N_i, D] or ``NVFP4Weight``). Returns (s [M, D] h.dtype,
tuple of [M, N_i] out_dtype) (+ x [M, D] with ``return_x``).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
import flint_jax.pallas.add_rms_norm  # noqa: F401  (modules, not the functions the package
import flint_jax.pallas.moe  # noqa: F401           re-exports under the same names)
import flint_jax.pallas.multi_gemv  # noqa: F401
import flint_jax.pallas.nvfp4_gemv  # noqa: F401

ARN = sys.modules["flint_jax.pallas.add_rms_norm"]
MOE = sys.modules["flint_jax.pallas.moe"]
MG = sys.modules["flint_jax.pallas.multi_gemv"]
NV = sys.modules["flint_jax.pallas.nvfp4_gemv"]
G = MG.G

__all__ = ["norm_qkv", "norm_qkv_reference", "default_block_d", "layer_end_inputs", "MODES"]

MODES = ("moe", "dense", "norm")


# ------------------------------------------------------------------------------------------
# In-kernel pieces


def _nvfp4_tile_dot_x(xfn, m, mp, q_ref, s_ref, n0, bn, b0, nb, *, decode, layout, method,
                      acc):
  """``nvfp4_gemv.nvfp4_tile_dot`` with the x tiles from ``xfn(col_index)`` instead of a ref;
  returns ``acc`` plus this K step's partial.

  ``xfn(cidx, nd)`` returns x at the trailing indices ``cidx`` (nd result dims) of the
  [.., D/64, 2, 2, 16] view, for the one row (M == 1: no row dim) or the mp padded rows (leading
  [Mp] dim). Same decode, tile dots, ``lanes`` FFMAs and summation order as ``nvfp4_tile_dot``,
  so the same fp32 partials for the same x."""
  if method == "lanes":   # M == 1, tile layout: two FFMAs per code byte, as nvfp4_tile_dot
    C.check(m == 1 and layout == "tile", "method='lanes' needs M == 1 and layout='tile'")
    ds, blk = slice(None), pl.ds(b0, nb)
    w_lo, w_hi = NV.decode_tile(q_ref, s_ref, (), n0, bn, b0, nb, decode, f32=True)
    return NV.lanes_fma(acc, w_lo, w_hi, lambda h: xfn((blk, h, ds, ds), 3))
  return acc + _nvfp4_part_x(xfn, m, mp, q_ref, s_ref, n0, bn, b0, nb, decode=decode,
                             layout=layout, method=method)


def _nvfp4_part_x(xfn, m, mp, q_ref, s_ref, n0, bn, b0, nb, *, decode, layout, method):
  """This K step's fp32 partial for the dot / swap / reduce / rows tiles."""
  ds = slice(None)
  nrow = pl.ds(n0, bn)
  one = m == 1

  def rows2(x, width):   # x tile as the [Mp, width] operand of a dot / swap tile
    if one:
      return jnp.broadcast_to(x.reshape(1, width), (mp, width))
    return x.reshape(mp, width)

  if layout == "tile":
    blk = pl.ds(b0, nb)
    w_lo, w_hi = NV.decode_tile(q_ref, s_ref, (), n0, bn, b0, nb, decode,
                                f32=method == "reduce")
    if method == "reduce":
      acc = None
      for half, w in ((0, w_lo), (1, w_hi)):
        x = xfn((blk, half, ds, ds), 3).astype(jnp.float32)                # [nb, 2, 16]
        p = jnp.sum(w.astype(jnp.float32) * x[None], axis=3)            # [BN, nb, 2]
        p = jnp.sum(jnp.sum(p, axis=2), axis=1)                          # [BN]
        acc = p if acc is None else acc + p
      return acc
    x_lo = rows2(xfn((blk, 0, ds, ds), 3), nb * 32)                         # [Mp, 32 nb]
    x_hi = rows2(xfn((blk, 1, ds, ds), 3), nb * 32)
    w_lo, w_hi = w_lo.reshape(bn, nb * 32), w_hi.reshape(bn, nb * 32)
    return C.mm_tile(x_lo, w_lo, method) + C.mm_tile(x_hi, w_hi, method)
  acc = None
  for bb in range(nb):
    for h in range(2):
      q = q_ref[nrow, b0 + bb, h, ds]                                    # [BN, 16]
      s_lo = NV.load_scale(s_ref[nrow, b0 + bb, 0, h])[:, None]         # [BN, 1]
      s_hi = NV.load_scale(s_ref[nrow, b0 + bb, 1, h])[:, None]
      w_lo, w_hi = NV._decode_pair(  # pylint: disable=protected-access
          q, s_lo, s_hi, decode, f32=method == "reduce")
      x_lo = xfn((b0 + bb, 0, h, ds), 1)                                    # [16] / [Mp, 16]
      x_hi = xfn((b0 + bb, 1, h, ds), 1)
      if method != "reduce":
        x_lo, x_hi = rows2(x_lo, 16), rows2(x_hi, 16)
      part = C.mm_tile(x_lo, w_lo, method) + C.mm_tile(x_hi, w_hi, method)
      acc = part if acc is None else acc + part
  return acc


def _norm_qkv_kernel(*refs, names, mode, fmt, n_mats, starts, m, mp, d, bn, bk, bd, eps,
                     top_k, u, decode, layout, method, return_x, split_k):
  """refs by ``names``: h [M, D], y (dense [M, D] / MoE [(U+1) * M, D]), top_logits [M, top_k],
  w_norm [D], (NVFP4: hv, yv, wv views [.., D/64, 2, 2, 16]), per matrix w (bf16) or (q, s)
  views and s2 f32 [1] (NVFP4), outputs o_0..o_{n-1} ([M, N_i], or f32 [split_k, M, N_i]
  partials), s (unless mode norm), x (return_x)."""
  r = dict(zip(names, refs))
  pid = pl.program_id(0)
  ks = pl.program_id(1) if split_k > 1 else 0           # this program's K slice
  first = (pid == 0) & (ks == 0) if split_k > 1 else pid == 0
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
    if fmt == "bf16":
      w_ref = r[f"w{i}"]

      def body(j, acc):
        k0 = pl.multiple_of(j * bk, bk)
        xt = x_chunk(r["h"], r.get("y"), r["w"], (pl.ds(k0, bk),), 1, inv)
        if one and method not in C.CUDA_CORE_M1:
          xt = jnp.broadcast_to(xt[None, :], (mp, bk))
        w = w_ref[pl.ds(n0, bn), pl.ds(k0, bk)]                         # [BN, BK]
        return acc + C.mm_tile(xt, w, method)
      lanes = (bk,)
    else:
      q_ref, s_ref = r[f"q{i}"], r[f"sc{i}"]
      nb = bk // 64

      def xfn(cidx, nd):
        return x_chunk(r["hv"], r.get("yv"), r["wv"], cidx, nd, inv)

      def body(j, acc):
        b0 = pl.multiple_of(j * nb, nb)
        return _nvfp4_tile_dot_x(xfn, m, mp, q_ref, s_ref, n0, bn, b0, nb, decode=decode,
                                 layout=layout, method=method, acc=acc)
      lanes = NV.lanes_shape(bk)

    n_k = d // bk // split_k                               # K steps of this slice
    acc = lax.fori_loop(ks * n_k, (ks + 1) * n_k, body, C.acc_zeros(mp, bn, method, lanes))
    acc = C.finish_acc(acc, method)
    if fmt == "nvfp4":
      acc = acc * (r[f"s2_{i}"][0] * NV.decode_factor(decode))
    C.store_tile(o_refs[i], (ks,) if split_k > 1 else (), acc, n0, bn, m, mp, method)

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
  top_k = MOE._check_top_logits(top_logits, m)  # pylint: disable=protected-access
  uu = m * top_k
  C.check(y.shape == (uu + 1, m, d),
          f"MoE mode: y must be [M*top_k+1={uu + 1}, M={m}, D={d}] (top_k={top_k} from "
          f"top_logits), got {y.shape=}")
  return "moe", top_k


def layer_end_inputs(h, y, top_logits, w_norm, weights, mode, top_k, fmt):
  """(names, args, u) of the inputs ``norm_qkv`` and ``layer_end_qkv`` share: h, y (unless mode
  "norm"), top_logits (MoE; u = M * top_k slots, else 0), w_norm, then per matrix ``w{i}``
  (bf16) or the ``q{i}`` / ``sc{i}`` views and ``s2_{i}`` (NVFP4: one f32 [1] input per tensor
  scale, a free reshape, where stacking them as ``multi_gemv`` does is one more XLA launch)."""
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
  if fmt == "bf16":
    for i, w in enumerate(weights):
      names.append(f"w{i}")
      args.append(w)
    return names, args, u
  for i, w in enumerate(weights):
    names += [f"q{i}", f"sc{i}"]
    args += list(NV.nvfp4_views(w[0], w[1]))
  for i, w in enumerate(weights):
    names.append(f"s2_{i}")
    args.append(C.scalar_f32(w[2]))
  return names, args, u


@functools.partial(jax.jit, static_argnames=(
    "eps", "out_dtype", "block_n", "block_k", "block_d", "method", "decode", "layout",
    "num_warps", "num_stages", "return_x", "split_k", "sum_splits", "interpret"))
def norm_qkv(h, weights, w_norm, *, y=None, top_logits=None, eps: float = 1e-6,
             out_dtype=jnp.bfloat16, block_n: int | None = None, block_k: int | None = None,
             block_d: int | None = None, method: str | None = None, decode: str = "asm",
             layout: str = "tile", num_warps: int | None = None, num_stages: int | None = None,
             return_x: bool = False, split_k: int = 1, sum_splits: bool = True,
             interpret: bool = False):
  """(s, outs): residual update + RMSNorm + ``multi_gemv`` in one pallas_call (module docstring).

  Mode from the arguments: ``y`` [M*top_k+1, M, D] + ``top_logits`` [M, top_k] f32
  (``moe_decode_routed``'s y and ``route.logits``) -> MoE combine;
  ``y`` [M, D] -> dense residual add; no ``y`` -> RMSNorm of h only (s is h). Tile knobs
  (``block_n``, ``block_k``, ``method``, ``decode``, ``layout``, ``num_warps``, ``num_stages``)
  and their defaults are ``multi_gemv``'s; ``block_d`` (default ``default_block_d``) is the chunk
  of the statistic pass. ``return_x``: also return the kernel's normalised x [M, D] (tests).

  ``split_k`` > 1: ``split_k`` programs per output tile, program s running the K steps of the
  contiguous range [s D/split_k, (s+1) D/split_k) (every program still forms the whole row's
  statistic) and storing fp32 partials [split_k, M, N_i] (NVFP4: times the tensor scale). Why:
  at M = 1 a bf16 q|k|v has 80 tiles for 132 SMs. ``sum_splits`` (default) sums them in XLA and
  casts to ``out_dtype``; ``sum_splits=False`` returns the partials, for a consumer that sums
  them itself (``qk_norm_rope_attention`` takes them).
  """
  mode, top_k = _mode(h, y, top_logits, w_norm)
  fmt = MG._format(weights)  # pylint: disable=protected-access
  m, d = h.shape
  ns = tuple(MG._n_rows(w, fmt) for w in weights)  # pylint: disable=protected-access
  method, decode = MG.resolve_method(fmt, m, method, layout, decode, interpret,
                                     allowed=tuple(x for x in C.METHODS if x != "blocks"))
  dbn, dbk, dwarps = MG.default_multi_gemv_blocks(ns, d, m=m, fmt=fmt, method=method)
  if block_k is None and split_k > 1:        # the default K step, shrunk to fit a slice
    dbk = C.split_block_k(dbk, d, split_k, fmt)
  block_n, block_k = block_n or dbn, block_k or dbk
  block_d = block_d or default_block_d(d, m, block_k)
  num_warps = num_warps or dwarps
  # BF16 at M = 1: 4 stages, as multi_gemv (nqtune, run 25: Flint 9.79 us against 10.40 with 3,
  # 10.11 with 5; block_k 512 with 4 stages exceeds the shared memory)
  num_stages = num_stages or (4 if fmt == "bf16" and m == 1 else 3)
  MG._validate(jax.ShapeDtypeStruct((m, d), h.dtype), weights, fmt, block_n, block_k)  # pylint: disable=protected-access
  C.check(split_k >= 1 and d % (block_k * split_k) == 0,
          f"split_k must be >= 1 with block_k * split_k dividing D: {split_k=} {block_k=} {d=}")
  C.check(C.is_pow2(block_d) and block_d >= 16 and d % block_d == 0,
          f"block_d must be a power of two >= 16 dividing D: {block_d=} {d=}")
  mp = C.pad_rows(m, method)
  n_mats = len(weights)
  starts = tuple(sum(ns[:i]) // block_n for i in range(n_mats + 1))

  y2 = None if mode == "norm" else y.reshape(-1, d)      # MoE: [(U+1) * M, D], free
  names, args, u = layer_end_inputs(h, y2, top_logits, w_norm, weights, mode, top_k, fmt)
  if fmt == "bf16":
    tag = f"bf16_{method}"
  else:
    names.append("hv")
    args.append(NV.x_view(h))
    if mode != "norm":
      names.append("yv")
      args.append(NV.x_view(y2))
    names.append("wv")
    args.append(w_norm.reshape(d // 64, 2, 2, 16))
    tag = f"nvfp4_{method}_{decode}_{layout}"
  out_shape = [jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if split_k > 1
               else jax.ShapeDtypeStruct((m, n), out_dtype) for n in ns]
  names += [f"o{i}" for i in range(n_mats)]
  if mode != "norm":
    out_shape.append(jax.ShapeDtypeStruct((m, d), h.dtype))
    names.append("s")
  if return_x:
    out_shape.append(jax.ShapeDtypeStruct((m, d), h.dtype))
    names.append("x")
  kernel = functools.partial(
      _norm_qkv_kernel, names=tuple(names), mode=mode, fmt=fmt, n_mats=n_mats, starts=starts,
      m=m, mp=mp, d=d, bn=block_n, bk=block_k, bd=block_d, eps=eps, top_k=top_k, u=u,
      decode=decode, layout=layout, method=method, return_x=return_x, split_k=split_k)
  grid = (starts[-1], split_k) if split_k > 1 else (starts[-1],)
  res = C.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=grid,
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      name=(f"flint_norm_qkv{n_mats}_{mode}_{tag}_bn{block_n}_bk{block_k}_bd{block_d}"
            f"{f'_splitk{split_k}' if split_k > 1 else ''}"),
  )(*args)
  outs = tuple(res[:n_mats])
  if split_k > 1 and sum_splits:
    outs = tuple(jnp.sum(o, axis=0).astype(out_dtype) for o in outs)
  rest = list(res[n_mats:])
  s = h if mode == "norm" else rest.pop(0)
  if return_x:
    return s, outs, rest.pop(0)
  return s, outs


def norm_qkv_reference(h, weights, w_norm, *, y=None, top_logits=None, eps: float = 1e-6,
                       out_dtype=jnp.bfloat16, split_k: int = 1, sum_splits: bool = True,
                       **unused_tuning):
  """Plain jnp: ``moe_combine_add_rms_norm_reference`` / ``add_rms_norm_reference`` /
  ``rms_norm_reference`` (by mode), then ``multi_gemv_reference``; returns (s, outs). With
  ``split_k`` > 1 and ``sum_splits=False``: fp32 partials [split_k, M, N_i], one
  ``multi_gemv_reference`` per contiguous K range of x and the weights."""
  del unused_tuning
  mode, _ = _mode(h, y, top_logits, w_norm)
  if mode == "norm":
    s, x = h, ARN.rms_norm_reference(h, w_norm, eps=eps)
  elif mode == "dense":
    s, x = ARN.add_rms_norm_reference(h, y, w_norm, eps=eps)
  else:
    s, x = MOE.moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, eps=eps)
  if split_k == 1 or sum_splits:
    return s, MG.multi_gemv_reference(x, weights, out_dtype=out_dtype)
  d = x.shape[1]
  c = d // split_k
  parts = [MG.multi_gemv_reference(x[:, j * c:(j + 1) * c],
                                   tuple(_k_slice(w, j * c, (j + 1) * c) for w in weights),
                                   out_dtype=jnp.float32) for j in range(split_k)]
  return s, tuple(jnp.stack([p[i] for p in parts]) for i in range(len(weights)))


def _k_slice(w, k0, k1):
  """Columns [k0, k1) of a bf16 [N, K] weight or an ``NVFP4Weight`` (packed K/2, scales K/16)."""
  if isinstance(w, tuple):                               # NVFP4Weight or a (q, s, s2) tuple
    q, sc, s2 = w
    return NV.NVFP4Weight(q[:, k0 // 2:k1 // 2], sc[:, k0 // 16:k1 // 16], s2)
  return w[:, k0:k1]
