"""Grouped GEMM of the routed experts for prefill chunks (many tokens), Pallas Triton backend.

A chunk's T tokens each pick k experts: P = T * k (token, expert) pairs. ``group_rows`` (XLA)
sorts the pairs by expert and lays them out in *row tiles* of ``block_m`` rows, each tile holding
rows of one expert only (an expert's last tile is padded):

  row_token   int32 [M_pad]    token of each padded row (pad rows: token 0, never combined)
  tile_expert int32 [n_tiles]  expert of each row tile, -1 for the unused tiles at the end
  pair_row    int32 [T, k]     padded row of each pair (M_pad for a dropped pair)

with ``n_tiles = cdiv(P, block_m) + min(E, P)`` (every expert adds at most one partial tile) and
``M_pad = n_tiles * block_m``: static shapes, one compiled kernel per chunk shape whatever the
routing. Experts with no tokens have no tiles.

Kernels (one program per (row tile, ``block_n`` output columns), columns fastest, so the programs
of one tile run together and share its rows through the L2; tiles of one expert are adjacent,
so its weights are read from HBM about once per chunk):

- ``grouped_matmul(x, w, rows)``: ``y[r] = cast((x[r] @ W[e(r)]^T) * scale_2[e(r)])``, fp32
  accumulation over a pipelined K loop of ``jnp.dot`` tiles (tensor cores). x is either the
  tokens ``[T, K]`` (rows gathered through ``row_token`` inside the kernel: no sorted copy of x)
  or already in padded row order ``[M_pad, K]``.
- ``grouped_matmul_silu_mul(x, w_gate_up, rows)``: the fused gate_up projection ``[E, 2I, K]``
  (gate rows first): each program accumulates gate columns ``n0..n0+BN`` and the same up
  columns ``I+n0..`` and stores ``cast(silu(cast(g)) * cast(u))`` ``[M_pad, I]``.

Weights in the model's own layouts, never copied or transposed per call:

- BF16 (or f32): ``[E, N, K]`` (HF ``[out, in]`` per expert).
- NVFP4 (W4A16): ``NVFP4Weight(qweight uint8 [E, N, K/2], weight_scale float8_e4m3fn or
  pre-scaled bf16 [E, N, K/16], weight_scale_2 f32 [E] (or [E, 2] gate, up for the fused
  gate_up))``, the flint_jax half-split layout (docs/design.md). The K loop decodes the E2M1
  codes with their block scales into exact bf16 tiles (``nvfp4_gemv``'s in-kernel decode: the
  fp8 bit trick, or the PTX one on the GPU), so the dot sees exactly the reference weights; the
  decode's power of two and the tensor scale multiply the fp32 accumulator.
- ``ScaledWeight(weight [E, N, K], weight_scale_2)``: a dense stack with per-expert tensor
  scales, what ``dequantize_experts`` makes of NVFP4 experts for large chunks, where the BF16
  kernels' tensor-core K loop beats the in-loop decode by more than the dequantization costs
  (``NVFP4_MODES``).

``moe_experts(x, weights, ids, experts)`` is the routed-expert sum of a MoE layer built on them:
``out[t] = sum_j w[t, j] * f32(y[pair_row[t, j]])`` (the weighted combine in XLA: a gather and a
sum over k, no scatter), with ``moe_experts_reference`` the model's own XLA math
(``FlintMoE._experts_ragged``): the same roundings (gate and up rounded to the activation dtype
before SiLU, each expert output rounded once, the combine in fp32).

Odd sizes (the tiny test models: K = 57, N = 19) use masked loads with clamped indices; Flint's
sizes take the unmasked path (``pl.ds`` slices, contiguous loads).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import nvfp4_gemv as nv
from flint_jax.pallas.nvfp4_gemv import NVFP4Weight

__all__ = ["GroupedRows", "ScaledWeight", "group_rows", "grouped_matmul",
           "grouped_matmul_silu_mul", "grouped_matmul_reference",
           "grouped_matmul_silu_mul_reference", "moe_experts", "moe_experts_reference",
           "dequantize_experts", "default_block_m", "NVFP4_MODES"]

F32 = jnp.float32


class ScaledWeight(NamedTuple):
  """A dense expert stack with a per-expert fp32 scale on its products: ``weight`` bf16 / f32
  ``[E, N, K]``, ``weight_scale_2`` f32 ``[E]`` (``[E, 2]`` gate, up for a fused gate_up). What
  ``dequantize_experts`` makes of an ``NVFP4Weight``: the same products as the in-kernel
  decode, exactly (every ``e2m1 * e4m3`` is a bf16), summed in another order."""
  weight: jax.Array
  weight_scale_2: jax.Array


class GroupedRows(NamedTuple):
  """Routing metadata of ``group_rows`` (shapes in the module docstring)."""
  row_token: jax.Array     # int32 [M_pad]
  tile_expert: jax.Array   # int32 [n_tiles]
  pair_row: jax.Array      # int32 [T, k]

  @property
  def block_m(self) -> int:
    return self.row_token.shape[0] // self.tile_expert.shape[0]


#: Tuning defaults, measured on the H200 (run "prefill-1", docs/gpu_runs/prefill1): the routed experts of
#: one Flint layer at an 8K-token chunk ran 1.27 ms with (block_m 64, blocks (128, 64), 8 warps,
#: 3 stages), 1.13 ms with block_m 128 and 1.12 ms with block_m 128 and 4 stages (BF16); NVFP4
#: 3.91 ms with block_k 128 / block_m 64 against 2.38 ms with block_k 64, block_m 128, 4 stages.
NUM_WARPS = 8
NUM_STAGES = 4
BLOCK_N = 128
BLOCK_K = 64


def default_block_m(pairs: int, num_experts: int) -> int:
  """Rows per tile: 128 once experts average >= 128 rows (an 8K-token Flint chunk averages 192:
  128 was 11% faster than 64 there, H200 run prefill-1, despite the padding of each expert's last
  tile), else 64 (fewer padded rows for short chunks)."""
  return 128 if pairs >= 128 * num_experts else 64


def group_rows(ids: jax.Array, num_experts: int, block_m: int,
               valid: jax.Array | None = None) -> GroupedRows:
  """Sorts the (token, expert) pairs of ``ids`` int [T, k] by expert into padded row tiles.

  ``valid`` bool [T] (optional): pairs of invalid tokens (chunk padding) are dropped: no row,
  ``pair_row`` = M_pad, a zero output in ``moe_experts``. Pure XLA: argsort, bincount, cumsums.
  """
  C.check(C.is_pow2(block_m) and block_m >= 16, f"block_m must be a power of two >= 16, got "
                                                 f"{block_m=}")
  t, k = ids.shape
  p = t * k
  e_all = num_experts
  flat = ids.reshape(p).astype(jnp.int32)
  if valid is not None:
    flat = jnp.where(jnp.repeat(valid, k), flat, e_all)         # e_all: dropped, sorted last
  sizes = jnp.bincount(flat, length=e_all + 1)[:e_all].astype(jnp.int32)       # [E]
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)                      # [P]
  tiles = (sizes + block_m - 1) // block_m
  tile_end = jnp.cumsum(tiles)
  tile_start = tile_end - tiles                                                 # [E]
  group_start = jnp.cumsum(sizes) - sizes                                       # [E]
  n_tiles = C.cdiv(p, block_m) + min(e_all, p)
  tt = jnp.arange(n_tiles, dtype=jnp.int32)
  # compare_all: one [n_tiles, E] comparison; the default ("scan") is a while loop, which on a
  # GPU waits for the device to hand each iteration's predicate back to the host.
  te = jnp.searchsorted(tile_end, tt, side="right", method="compare_all").astype(jnp.int32)
  tile_expert = jnp.where(te < e_all, te, -1)
  # Padded row j -> its pair (tile j // bm of expert e, rank j - first row of e).
  j = jnp.arange(n_tiles * block_m, dtype=jnp.int32)
  ej = jnp.clip(te[j // block_m], 0, e_all - 1)
  rank = j - tile_start[ej] * block_m
  live = (te[j // block_m] < e_all) & (rank < sizes[ej])
  pair = jnp.clip(group_start[ej] + rank, 0, p - 1)
  row_token = jnp.where(live, order[pair] // k, 0)
  # Sorted pair i -> its padded row; scattered back to pair order (a permutation).
  se = flat[order]
  sec = jnp.clip(se, 0, e_all - 1)
  padded = tile_start[sec] * block_m + jnp.arange(p, dtype=jnp.int32) - group_start[sec]
  padded = jnp.where(se < e_all, padded, n_tiles * block_m)
  pair_row = jnp.zeros((p,), jnp.int32).at[order].set(padded).reshape(t, k)
  return GroupedRows(row_token.astype(jnp.int32), tile_expert, pair_row)


# ------------------------------------------------------------------------------------------
# Kernel


def _dot_nt(a, b):
  """a [M, K] . b [N, K]^T in fp32; f32 operands in IEEE precision (Triton's default is TF32)."""
  prec = lax.Precision.HIGHEST if a.dtype == F32 else None
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                         preferred_element_type=F32)


def _kernel(tile_expert_ref, row_ref, x_ref, *refs, fmt, fused, gather, bm, bn, bk, n_out,
            inter, k, n_col, decode):
  """One (row tile, column block): acc [BM, BN] (and the up half's with ``fused``)."""
  if fmt == "nvfp4":
    q_ref, s_ref, s2_ref, o_ref = refs
  elif fmt == "scaled":
    w_ref, s2_ref, o_ref = refs
  else:
    w_ref, o_ref = refs
  pid = pl.program_id(0)
  t, j = pid // n_col, pid % n_col
  e = tile_expert_ref[t]
  n0 = j * bn
  mask_k = k % bk != 0          # odd sizes only (static): masked, clamped loads
  mask_n = n_out % bn != 0

  @pl.when(e >= 0)
  def _():
    r0 = t * bm
    if gather:                      # row indices (a gather load: each row contiguous in K)
      rows = rows_sel = row_ref[pl.ds(r0, bm)]
    else:
      rows, rows_sel = r0 + jnp.arange(bm, dtype=jnp.int32), pl.ds(r0, bm)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    ncl = jnp.minimum(cols, n_out - 1)

    def w_tile(row_off, k0):        # [BN, BK] weight rows row_off + n0 .., K from k0
      if not (mask_k or mask_n):
        return w_ref[e, pl.ds(row_off + n0, bn), pl.ds(k0, bk)]
      kk = k0 + jnp.arange(bk, dtype=jnp.int32)
      m = (cols < n_out)[:, None] & (kk < k)[None, :]
      idx = (e, (row_off + ncl)[:, None], jnp.minimum(kk, k - 1)[None, :])
      return plgpu.load(w_ref.at[idx], mask=m, other=0)

    def x_tile(k0):                 # [BM, BK]
      if not mask_k:
        return x_ref[rows_sel, pl.ds(k0, bk)]
      kk = k0 + jnp.arange(bk, dtype=jnp.int32)
      idx = (rows[:, None], jnp.minimum(kk, k - 1)[None, :])
      return plgpu.load(x_ref.at[idx], mask=(kk < k)[None, :], other=0)

    def nv_part(x_lo, x_hi, row_off, b0):
      codes = nv.load_codes(q_ref, s_ref, (e,), row_off + n0, bn, b0, bk // 64)
      w_lo, w_hi = nv.decode_codes(codes, decode)              # [BN, nb, 2, 16] bf16
      w_lo = w_lo.reshape(bn, bk // 2).astype(x_lo.dtype)
      w_hi = w_hi.reshape(bn, bk // 2).astype(x_lo.dtype)
      return _dot_nt(x_lo, w_lo) + _dot_nt(x_hi, w_hi)

    def body(i, accs):
      k0 = pl.multiple_of(i * bk, bk)
      if fmt == "nvfp4":            # x viewed [*, K/64, 2 (half), 32]
        b0 = i * (bk // 64)
        x_lo = x_ref[rows_sel, pl.ds(b0, bk // 64), 0, :].reshape(bm, bk // 2)
        x_hi = x_ref[rows_sel, pl.ds(b0, bk // 64), 1, :].reshape(bm, bk // 2)
        parts = [nv_part(x_lo, x_hi, 0, b0)]
        if fused:
          parts.append(nv_part(x_lo, x_hi, inter, b0))
      else:
        xt = x_tile(k0)
        parts = [_dot_nt(xt, w_tile(0, k0).astype(xt.dtype))]
        if fused:
          parts.append(_dot_nt(xt, w_tile(inter, k0).astype(xt.dtype)))
      return tuple(a + p for a, p in zip(accs, parts))

    n_acc = 2 if fused else 1
    accs = lax.fori_loop(0, C.cdiv(k, bk), body,
                         tuple(jnp.zeros((bm, bn), F32) for _ in range(n_acc)))
    if fmt == "nvfp4":
      f = nv.decode_factor(decode)
      if fused:
        accs = (accs[0] * (f * s2_ref[e, 0]), accs[1] * (f * s2_ref[e, 1]))
      else:
        accs = (accs[0] * (f * s2_ref[e]),)
    elif fmt == "scaled":
      if fused:
        accs = (accs[0] * s2_ref[e, 0], accs[1] * s2_ref[e, 1])
      else:
        accs = (accs[0] * s2_ref[e],)
    out = C.silu_mul_f32(*accs, o_ref.dtype) if fused else accs[0]
    ridx = (r0 + jnp.arange(bm, dtype=jnp.int32))[:, None]
    if mask_n:   # unclamped columns, masked (a clamped duplicate would race in interpret mode)
      plgpu.store(o_ref.at[ridx, cols[None, :]], out.astype(o_ref.dtype),
                  mask=(cols < n_out)[None, :])
    else:
      plgpu.store(o_ref.at[ridx, cols[None, :]], out.astype(o_ref.dtype))


def _weight_dims(w, fused):
  """(fmt, E, N_out, K) of a weight (bf16 [E, N, K] or NVFP4Weight)."""
  if isinstance(w, NVFP4Weight):
    e, n, kh = w.qweight.shape
    C.check(w.weight_scale.shape == (e, n, kh // 8),
            f"NVFP4 scales {w.weight_scale.shape} do not match qweight {w.qweight.shape}")
    C.check(nv.is_block_scale_dtype(w.weight_scale.dtype),
            f"block scales must be float8_e4m3fn or pre-scaled bf16, got {w.weight_scale.dtype}")
    want = (e, 2) if fused else (e,)
    C.check(w.weight_scale_2.shape == want,
            f"weight_scale_2 must be {want}, got {w.weight_scale_2.shape}")
    fmt, k = "nvfp4", kh * 2
  elif isinstance(w, ScaledWeight):
    e, n, k = w.weight.shape
    want = (e, 2) if fused else (e,)
    C.check(w.weight_scale_2.shape == want,
            f"weight_scale_2 must be {want}, got {w.weight_scale_2.shape}")
    fmt = "scaled"
  else:
    e, n, k = w.shape
    fmt = "dense"
  if fused:
    C.check(n % 2 == 0, f"a fused gate_up weight needs an even row count, got {n}")
    n //= 2
  return fmt, e, n, k


def _call(x, w, rows: GroupedRows, *, fused, gather, out_dtype, block_n, block_k, num_warps,
          num_stages, decode, interpret):
  fmt, e, n_out, k = _weight_dims(w, fused)
  bm = rows.block_m
  m_pad = rows.row_token.shape[0]
  C.check(x.shape[-1] == k, f"x has K={x.shape[-1]}, the weight K={k}")
  if not gather:
    C.check(x.shape[0] == m_pad, f"x in row order must have M_pad={m_pad} rows, got {x.shape}")
  if fmt == "nvfp4":
    C.check(k % 64 == 0, f"NVFP4 needs K % 64 == 0, got {k=}")
    bk = block_k or min(BLOCK_K, C.pow2_divisor(k, 128))
    C.check(bk % 64 == 0 and k % bk == 0, f"NVFP4 block_k must be 64 * 2^i dividing K: {bk=}")
    bn = min(block_n or BLOCK_N, C.pow2_divisor(n_out, BLOCK_N))   # NVFP4: N % block_n == 0
    C.check(bn >= 16, f"NVFP4 needs N divisible by 16, got N={n_out}")
    decode = nv.resolve_decode(decode, interpret)
    qv, sv = nv.nvfp4_views(w.qweight, w.weight_scale)
    w_args = (qv, sv, w.weight_scale_2.astype(F32))
    x_in = x.reshape(x.shape[0], k // 64, 2, 32)
  else:
    bk = block_k or min(BLOCK_K, max(16, C.next_pow2(k)))
    bn = block_n or min(BLOCK_N, max(16, C.next_pow2(n_out)))
    w_args = (w.weight, w.weight_scale_2.astype(F32)) if fmt == "scaled" else (w,)
    x_in = x
  C.check(C.is_pow2(bn) and C.is_pow2(bk) and bn >= 16 and bk >= 16,
          f"blocks must be powers of two >= 16: {bn=} {bk=}")
  n_col = C.cdiv(n_out, bn)
  n_tiles = rows.tile_expert.shape[0]
  kernel = functools.partial(_kernel, fmt=fmt, fused=fused, gather=gather, bm=bm, bn=bn, bk=bk,
                             n_out=n_out, inter=n_out, k=k, n_col=n_col, decode=decode)
  name = (f"flint_grouped_{'silu_' if fused else ''}{fmt}_{'gather_' if gather else ''}"
          f"bm{bm}_bn{bn}_bk{bk}")
  return C.pallas_call(
      kernel, early_trigger=False, grid=(n_tiles * n_col,),
      out_shape=jax.ShapeDtypeStruct((m_pad, n_out), out_dtype),
      compiler_params=C.compiler_params(num_warps or NUM_WARPS, num_stages or NUM_STAGES),
      interpret=interpret, name=name,
  )(rows.tile_expert, rows.row_token, x_in, *w_args)


_STATIC = ("gather", "out_dtype", "block_n", "block_k", "num_warps", "num_stages", "decode",
           "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul(x, w, rows: GroupedRows, *, gather: bool, out_dtype=None,
                   block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   decode: str = "asm", interpret: bool = False):
  """``y [M_pad, N]``: row r = ``cast((x[r] @ W[e]^T) * scale_2[e])``, e its tile's expert.

  x: ``[T, K]`` tokens (``gather=True``: rows read through ``rows.row_token``) or ``[M_pad, K]``
  in padded row order; w: ``[E, N, K]`` bf16/f32 or ``NVFP4Weight`` (scale_2 ``[E]``).
  Rows of unused tiles are left unwritten (never read by ``moe_experts``).
  """
  return _call(x, w, rows, fused=False, gather=gather, out_dtype=out_dtype or x.dtype,
               block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
               decode=decode, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul_silu_mul(x, w, rows: GroupedRows, *, gather: bool = True, out_dtype=None,
                            block_n: int | None = None, block_k: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            decode: str = "asm", interpret: bool = False):
  """``h [M_pad, I]`` = ``cast(silu(g) * u)``, g / u = ``cast((x[r] @ W[e, :I | I:]^T) *
  scale_2[e, 0 | 1])``: the fused gate_up ``[E, 2I, K]`` (gate rows first) or ``NVFP4Weight``
  (scale_2 ``[E, 2]``). x as in ``grouped_matmul``."""
  return _call(x, w, rows, fused=True, gather=gather, out_dtype=out_dtype or x.dtype,
               block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
               decode=decode, interpret=interpret)


# ------------------------------------------------------------------------------------------
# References (plain jnp, per padded row; small sizes only)


def _dense(w, fused):
  """(dense weight f32 [E, N, K], scale_2 f32 [E] or [E, 2])."""
  if isinstance(w, NVFP4Weight):
    return (nv.dequantize_nvfp4_reference(w.qweight, w.weight_scale).astype(F32),
            w.weight_scale_2.astype(F32))
  if isinstance(w, ScaledWeight):
    return w.weight.astype(F32), w.weight_scale_2.astype(F32)
  e = w.shape[0]
  return w.astype(F32), jnp.ones((e, 2) if fused else (e,), F32)


def _row_products(x, w, rows, gather):
  e_row = jnp.repeat(rows.tile_expert, rows.block_m)
  xr = (x[rows.row_token] if gather else x).astype(F32)
  wr = w[jnp.maximum(e_row, 0)]                                  # [M_pad, N, K]
  y = jnp.einsum("mk,mnk->mn", xr, wr, precision=lax.Precision.HIGHEST)
  return y, e_row


def grouped_matmul_reference(x, w, rows: GroupedRows, *, gather: bool, out_dtype=None,
                             **unused_tuning):
  """``grouped_matmul`` in plain jnp (rows of unused tiles: 0)."""
  del unused_tuning
  wd, s2 = _dense(w, False)
  y, e_row = _row_products(x, wd, rows, gather)
  y = y * s2[jnp.maximum(e_row, 0)][:, None]
  return jnp.where((e_row >= 0)[:, None], y, 0).astype(out_dtype or x.dtype)


def grouped_matmul_silu_mul_reference(x, w, rows: GroupedRows, *, gather: bool = True,
                                      out_dtype=None, **unused_tuning):
  """``grouped_matmul_silu_mul`` in plain jnp (rows of unused tiles: 0)."""
  del unused_tuning
  wd, s2 = _dense(w, True)
  inter = wd.shape[1] // 2
  dt = out_dtype or x.dtype
  y, e_row = _row_products(x, wd, rows, gather)
  s = s2[jnp.maximum(e_row, 0)]
  g = (y[:, :inter] * s[:, :1]).astype(dt).astype(F32)
  u = (y[:, inter:] * s[:, 1:]).astype(dt).astype(F32)
  h = g * jax.nn.sigmoid(g) * u
  return jnp.where((e_row >= 0)[:, None], h, 0).astype(dt)


# ------------------------------------------------------------------------------------------
# The routed experts of a MoE layer


def expert_weights(experts: dict):
  """(gate_up, down) from an experts dict: ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``
  or the NVFP4 leaves ``gate_up_qweight``, ... (``FlintExperts``' names)."""
  if "gate_up_proj" in experts:
    return experts["gate_up_proj"], experts["down_proj"]
  return (NVFP4Weight(experts["gate_up_qweight"], experts["gate_up_weight_scale"],
                      experts["gate_up_weight_scale_2"]),
          NVFP4Weight(experts["down_qweight"], experts["down_weight_scale"],
                      experts["down_weight_scale_2"]))


#: ``moe_experts(nvfp4=...)``: "fused" decodes the NVFP4 codes in the K loop of the grouped GEMMs;
#: "dequant" first dequantizes the layer's experts into bf16 stacks (one XLA loop over every
#: code: ~0.4 GB read, 1.6 GB written for Flint's 256 experts, ~0.5 ms at the H200's copy rate,
#: estimated) and runs the BF16 kernels on them; "auto" dequantizes once the experts average
#: ``DEQUANT_MIN_ROWS`` rows. Measured at an 8K-token chunk (H200 run prefill-1, 192 rows per
#: expert): the in-kernel decode made the kernels 2.38 ms against 1.12 ms in BF16, ~6.6 us per
#: average row, so dequantizing pays from ~85 rows on (the estimate above). End to end at 1 x 8K
#: (192 rows; run 204, one H100): 180.2 ms dequantized against 202.0 ms fused.
NVFP4_MODES = ("auto", "fused", "dequant")
DEQUANT_MIN_ROWS = 96


def dequantize_experts(w: NVFP4Weight, dtype=jnp.bfloat16) -> ScaledWeight:
  """An NVFP4 expert stack as ``ScaledWeight`` (exact ``e2m1 * e4m3`` in ``dtype``, the tensor
  scales kept for the kernels' fp32 epilogue): ``flint_jax.nvfp4.dequantize``, elementwise."""
  from flint_jax import nvfp4   # pylint: disable=g-import-not-at-top
  return ScaledWeight(nvfp4.dequantize(w.qweight, w.weight_scale, dtype), w.weight_scale_2)


def use_dequant(nvfp4: str, pairs: int, num_experts: int) -> bool:
  """Whether ``moe_experts`` dequantizes NVFP4 experts first (``NVFP4_MODES``)."""
  C.check(nvfp4 in NVFP4_MODES, f"nvfp4 must be one of {NVFP4_MODES}, got {nvfp4=}")
  if nvfp4 == "auto":
    return pairs >= DEQUANT_MIN_ROWS * num_experts
  return nvfp4 == "dequant"


def combine(y, rows: GroupedRows, weights):
  """``out [T, D] f32 = sum_j weights[t, j] * f32(y[pair_row[t, j]])`` (dropped pairs: 0): a
  gather, multiply and sum over k that XLA fuses into one loop (no scatter, no [T, k, D] f32
  buffer)."""
  g = jnp.take(y, rows.pair_row, axis=0, mode="fill", fill_value=0)      # [T, k, D]
  return jnp.sum(g.astype(F32) * weights.astype(F32)[:, :, None], axis=1)


@functools.partial(jax.jit, static_argnames=("block_m", "gate_up_blocks", "down_blocks",
                                             "num_warps", "num_stages", "decode", "nvfp4",
                                             "interpret"))
def moe_experts(x, weights, ids, experts: dict, valid=None, *, block_m: int | None = None,
                gate_up_blocks: tuple | None = None, down_blocks: tuple | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                decode: str = "asm", nvfp4: str = "auto", interpret: bool = False):
  """Routed-expert sum of a MoE layer: f32 ``[T, D]`` = ``sum_j w[t,j] * expert_{ids[t,j]}(x[t])``.

  x: ``[T, D]``; weights f32 ``[T, k]``; ids int ``[T, k]``; experts: the ``FlintExperts``
  leaves (``expert_weights``); valid bool ``[T]`` (optional): tokens to compute (others give 0).
  ``*_blocks``: ``(block_n, block_k)`` of the two kernels (None: defaults); ``nvfp4``: NVFP4
  experts decoded in the kernels or dequantized first (``NVFP4_MODES``).
  """
  gu, dn = expert_weights(experts)
  num_experts = (gu.qweight if isinstance(gu, NVFP4Weight) else gu).shape[0]
  t, k = ids.shape
  if isinstance(gu, NVFP4Weight) and use_dequant(nvfp4, t * k, num_experts):
    gu, dn = dequantize_experts(gu), dequantize_experts(dn)
  bm = block_m or default_block_m(t * k, num_experts)
  rows = group_rows(ids, num_experts, bm, valid)
  gbn, gbk = gate_up_blocks or (None, None)
  dbn, dbk = down_blocks or (None, None)
  common = dict(num_warps=num_warps, num_stages=num_stages, decode=decode, interpret=interpret)
  h = grouped_matmul_silu_mul(x, gu, rows, gather=True, block_n=gbn, block_k=gbk, **common)
  y = grouped_matmul(h, dn, rows, gather=False, block_n=dbn, block_k=dbk, **common)
  return combine(y, rows, weights)


def moe_experts_reference(x, weights, ids, experts: dict, valid=None, **unused_tuning):
  """The model's XLA math (``FlintMoE._experts_ragged``): ragged_dot over every expert (f32
  operands in IEEE fp32 on every backend)."""
  del unused_tuning
  from flint_jax import layers   # pylint: disable=g-import-not-at-top
  gu, dn = expert_weights(experts)
  if isinstance(gu, NVFP4Weight):
    gu_s2, dn_s2 = gu.weight_scale_2.astype(F32), dn.weight_scale_2.astype(F32)
    gu = nv.dequantize_nvfp4_reference(gu.qweight, gu.weight_scale).astype(x.dtype)
    dn = nv.dequantize_nvfp4_reference(dn.qweight, dn.weight_scale).astype(x.dtype)
  else:
    gu_s2 = jnp.ones((gu.shape[0], 2), F32)
    dn_s2 = jnp.ones((gu.shape[0],), F32)
  n, k = ids.shape
  inter = gu.shape[1] // 2
  # f32 operands in IEEE fp32, as the kernel's f32 dots: XLA's default precision on a GPU rounds
  # them to TF32 (~5e-4 relative), which would be the reference's error, not the kernel's.
  prec = lax.Precision.HIGHEST if x.dtype == F32 else None
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  tok = order // k
  sizes = jnp.bincount(flat, length=gu.shape[0]).astype(jnp.int32)
  h = layers.ragged_dot(x[tok], gu.transpose(0, 2, 1), sizes, prec)
  e_sorted = flat[order]
  s = gu_s2[e_sorted]
  act = layers.silu_mul((h[:, :inter] * s[:, :1]).astype(x.dtype),
                        (h[:, inter:] * s[:, 1:]).astype(x.dtype))
  y = layers.ragged_dot(act, dn.transpose(0, 2, 1), sizes, prec)
  y = (y * dn_s2[e_sorted][:, None]).astype(x.dtype).astype(F32)
  w = weights.reshape(-1)[order].astype(F32)
  out = jnp.zeros((n, x.shape[1]), F32).at[tok].add(y * w[:, None])
  if valid is not None:
    out = jnp.where(valid[:, None], out, 0.0)
  return out
