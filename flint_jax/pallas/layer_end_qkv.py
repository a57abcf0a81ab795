"""End of a layer + the next layer's q|k|v GEMVs in one kernel, as producer and consumers.

``layer_end_qkv(h, weights, w_norm, counter, y=..., top_logits=...)`` computes exactly what
``norm_qkv`` computes -- ``(s, (q, k, v))`` with s the new residual stream (MoE combine + add,
dense add, or h itself) and q|k|v = ``multi_gemv(RMSNorm(s) * w_norm, weights)`` -- and returns
the counter as a third output. What differs is how the work is split, to hide the GEMV's ramp
(its launch and first weight loads: ~2 us of a 5-9 us GEMV, docs/kernels.md session 4) under
the latency-bound layer end, which is what vLLM gets from programmatic dependent launch:

- ``norm_qkv`` repeats the layer end in every GEMV program (its prologue) before the weights
  stream: cheap at batch 1, expensive at batch 8.
- Here each program first takes a *ticket* (``atomic_add`` on ``counter[i, 0]``). Tickets
  ``0 .. M-1`` are **producers**: ticket t computes row t's s and normalised x exactly like
  ``moe_combine_add_rms_norm`` / ``add_rms_norm`` / ``rms_norm``, stores them (x into a scratch
  output), then, after a CTA barrier, increments ``counter[i, 1]``. The other tickets are
  **consumers**: each owns ``block_n`` rows of one matrix, loads all its weights (NVFP4: and
  decodes them) into registers *first*, then polls ``counter[i, 1]`` (volatile loads) until all
  M producers are done, reads x (volatile) and finishes the GEMV from registers.
- Tickets, not program ids, pick the roles: a program only gets a consumer ticket after every
  producer ticket was taken by a program that is already running, so waiting consumers can never
  keep a producer from being scheduled (no deadlock whatever the dispatch order).

``counter``: int32 ``[L, 2]`` (or ``[2]``) **zeros on entry**, row ``counter_index``; aliased
input -> output and returned (its row ends at ``(M + GEMV programs, M)``), so a decode step
passes one zeroed array for all its layers (one memset), as ``attention="fused_atomic"`` does.
Interpret mode runs the programs in grid order, so the tickets come in that order and every
producer has finished before the first consumer polls.

Register budget (why ``block_n`` is small): a consumer holds ``block_n x K`` bf16 weights:
16 x 2048 = 64 KB per program, 64 registers per thread at 8 warps. Tile method: ``reduce`` at
M = 1 (CUDA cores, fp32), ``dot`` for M > 1.

Measured on the H200 (docs/kernels.md, session 5): correct, but slower than the pair of kernels
it replaces (M = 1: BF16 14.1 vs 12.2 us, NVFP4 12.7 vs 10.2; M = 8 about 2x): after the counter
flips the consumers still need a whole GEMV's time, and the producer -> release -> poll ->
acquire chain is longer than the ramp it hides. Off by default (``DecodeOptions.qkv_wait``).

Numerics: s is bit-identical to the unfused kernels; x is ``add_rms_norm``'s (one-block
statistic); the GEMV sums each row in K steps of ``block_k`` like ``multi_gemv`` with the same
method (``reduce`` / ``dot``), so given x it matches ``multi_gemv``'s fp32 partial sums up to
the order within a tile.

Shapes / dtypes: as ``norm_qkv`` (h [M, D] bf16, 1 <= M <= 16; y [M, D] or
[M * top_k + 1, M, D]; top_logits [M, top_k] f32; weights 1..4 bf16 [N_i, D] or
``NVFP4Weight``, D % 64 == 0 for NVFP4).
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
import flint_jax.pallas.norm_qkv  # noqa: F401
import flint_jax.pallas.nvfp4_gemv  # noqa: F401

ARN = sys.modules["flint_jax.pallas.add_rms_norm"]
MOE = sys.modules["flint_jax.pallas.moe"]
MG = sys.modules["flint_jax.pallas.multi_gemv"]
NQ = sys.modules["flint_jax.pallas.norm_qkv"]
NV = sys.modules["flint_jax.pallas.nvfp4_gemv"]

__all__ = ["layer_end_qkv", "layer_end_qkv_reference"]


def _produce_row(r, t, *, mode, top_k, u, d, dp, eps):
  """Row t's s (stored unless mode "norm") and normalised x (stored to the scratch ``x``): the
  row code of ``moe_combine_add_rms_norm`` / ``add_rms_norm`` / ``rms_norm``."""
  # pylint: disable=protected-access
  kw = dict(d=d, dp=dp, eps=eps)
  if mode == "norm":
    ARN._rms_norm_row(r["h"], r["w"], r["x"], t, **kw)
  elif mode == "dense":
    ARN._add_rms_norm_row(r["h"], r["y"], r["w"], r["s"], r["x"], t, **kw)
  else:
    MOE._combine_add_rms_norm_row(r["y"], r["top_logits"], r["h"], r["w"], r["s"], r["x"], t,
                                  top_k=top_k, u=u, **kw)


def _kernel(*refs, names, mode, fmt, starts, m, mp, d, dp, bn, bk, eps, top_k, u, decode,
            method, stacked, preload, interpret):
  r = dict(zip(names, refs))
  cnt = r["counter_out"]
  ci = (r["counter_index"][0],) if stacked else ()
  slot = lambda k: (*ci, jnp.int32(k))     # noqa: E731  (array indices: interpret mode needs them)
  ticket = plgpu.atomic_add(cnt, slot(0), jnp.int32(1))

  @pl.when(ticket < m)
  def _():
    _produce_row(r, ticket, mode=mode, top_k=top_k, u=u, d=d, dp=dp, eps=eps)
    if not interpret:      # every thread's stores precede the release (no CPU lowering)
      plgpu.debug_barrier()
    plgpu.atomic_add(cnt, slot(1), jnp.int32(1))

  def consumer(i):
    n0 = pl.multiple_of((ticket - m - starts[i]) * bn, bn)
    nb = bk // 64

    def weight_tile(j):   # K step j's weights: bf16 [BN, BK] or decoded NVFP4 (w_lo, w_hi)
      if fmt == "bf16":
        return r[f"w{i}"][pl.ds(n0, bn), pl.ds(j * bk, bk)]
      blk = pl.ds(j * nb, nb)
      q = r[f"q{i}"][pl.ds(n0, bn), blk, :, :]                          # [BN, nb, 2, 16]
      s_lo = NV.load_scale(r[f"sc{i}"][pl.ds(n0, bn), blk, 0, :])[..., None]
      s_hi = NV.load_scale(r[f"sc{i}"][pl.ds(n0, bn), blk, 1, :])[..., None]
      return NV._decode_pair(q, s_lo, s_hi, decode)  # pylint: disable=protected-access

    # 1. The weights first: the first ``preload`` K steps' tiles, loaded (NVFP4: decoded) into
    # registers; the other steps are loaded after the wait.
    tiles = [weight_tile(j) for j in range(preload)]
    # 2. Wait for the M producers (volatile polls), then one acquire.
    # Every result below depends on the one before it: a poll loop whose value is unused is
    # dead code to jax (DCE removed it in the first GPU run, so nothing waited), and the x loads
    # take their address from the acquire's result, so they cannot move above it.
    done = lambda: plgpu.load(cnt.at[slot(1)], volatile=True)  # noqa: E731
    seen = lax.while_loop(lambda v: v < m, lambda v: done(), done())
    acquired = plgpu.atomic_add(cnt, (*ci, jnp.minimum(seen, m) - m + 1), jnp.int32(0))
    zero = jnp.minimum(acquired, m) - m         # 0: the producers' count never exceeds m
    # 3. x (volatile: written by another CTA during this kernel) times the tiles.
    rows = C.row_load_index(m, mp) + zero
    if fmt == "nvfp4":   # the half-split layout: block b, nibble half h -> k = 64 b + 32 h + ..
      ar = lambda n: jnp.arange(n, dtype=jnp.int32)  # noqa: E731
      nvfp4_k = 64 * ar(nb)[:, None, None] + 16 * ar(2)[None, :, None] + ar(16)[None, None, :]
    acc = jnp.zeros(C.acc_shape(mp, bn, method), jnp.float32)
    for j in range(d // bk):
      tile = tiles[j] if j < preload else weight_tile(j)
      if fmt == "bf16":
        kk = j * bk + zero + jnp.arange(bk, dtype=jnp.int32)
        if method == "reduce":
          xt = plgpu.load(r["x"].at[0, kk], volatile=True)                 # [BK]
        else:
          xt = plgpu.load(r["x"].at[rows[:, None], kk[None, :]], volatile=True)  # [Mp, BK]
        acc = acc + C.mm_tile(xt, tile, method)
        continue
      w_lo, w_hi = tile
      for half, w in ((0, w_lo), (1, w_hi)):
        base = j * bk + half * 32 + zero
        kk = base + nvfp4_k                                              # [nb, 2, 16]
        if method == "reduce":
          xt = plgpu.load(r["x"].at[0, kk], volatile=True).astype(jnp.float32)
          p = jnp.sum(w.astype(jnp.float32) * xt[None], axis=3)            # [BN, nb, 2]
          acc = acc + jnp.sum(jnp.sum(p, axis=2), axis=1)
        else:
          xt = plgpu.load(r["x"].at[rows[:, None], kk.reshape(1, nb * 32)], volatile=True)
          acc = acc + C.mm_tile(xt, w.reshape(bn, nb * 32), method)
    if fmt == "nvfp4":
      acc = acc * (r[f"s2_{i}"][0] * NV.decode_factor(decode))
    C.store_tile(r[f"o{i}"], (), acc, n0, bn, m, mp, method)

  @pl.when(ticket >= m)
  def _():
    MG.run_matrix_branches(ticket - m, starts, consumer)


@functools.partial(jax.jit, static_argnames=(
    "eps", "out_dtype", "block_n", "block_k", "method", "decode", "num_warps", "preload",
    "interpret"))
def layer_end_qkv(h, weights, w_norm, counter, *, y=None, top_logits=None, counter_index=None,
                  eps: float = 1e-6, out_dtype=jnp.bfloat16, block_n: int = 16,
                  block_k: int | None = None, method: str | None = None, decode: str = "asm",
                  num_warps: int = 8, preload: int | None = None, interpret: bool = False):
  """(s, outs, counter): ``norm_qkv``'s result, computed by producer and consumer programs (see
  the module docstring). counter: int32 zeros ``[2]``, or ``[L, 2]`` with ``counter_index``.
  preload: K steps (of ``block_k``) whose weights a GEMV program loads before it waits; the rest
  after (default all: ``block_n`` x D weights held in registers; fewer frees registers for more
  programs per SM)."""
  mode, top_k = NQ._mode(h, y, top_logits, w_norm)  # pylint: disable=protected-access
  fmt = MG._format(weights)  # pylint: disable=protected-access
  m, d = h.shape
  ns = tuple(MG._n_rows(w, fmt) for w in weights)  # pylint: disable=protected-access
  block_k = block_k or C.pow2_divisor(d, 512)
  MG._validate(jax.ShapeDtypeStruct((m, d), h.dtype), weights, fmt, block_n, block_k)  # pylint: disable=protected-access
  stacked = counter_index is not None
  C.check(counter.dtype == jnp.int32 and counter.shape[-1] == 2
          and counter.ndim == (2 if stacked else 1),
          f"counter must be int32 zeros {'[L, 2] (with counter_index)' if stacked else '[2]'}, "
          f"got {counter.shape} {counter.dtype}")
  steps = d // block_k
  preload = steps if preload is None else preload
  C.check(0 <= preload <= steps, f"preload must be 0..{steps} K steps, got {preload=}")
  method = method or ("reduce" if m == 1 else "dot")
  C.check_method(method, m, allowed=C.NO_LANES)
  C.check(method != "swap", "layer_end_qkv: method must be reduce (M == 1) or dot")
  decode = NV.resolve_decode(decode, interpret)
  mp, dp = C.pad_rows(m), C.next_pow2(d)
  n_mats = len(weights)
  starts = tuple(sum(ns[:i]) // block_n for i in range(n_mats + 1))

  names, args, u = NQ.layer_end_inputs(h, y, top_logits, w_norm, weights, mode, top_k, fmt)
  if stacked:
    names.append("counter_index")
    args.append(C.as_index_array(counter_index, "counter_index"))
  names.append("counter_in")
  n_in = len(args)
  args.append(counter)
  out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype) for n in ns]
  names += [f"o{i}" for i in range(n_mats)]
  out_shape.append(jax.ShapeDtypeStruct((m, d), h.dtype))           # x, the consumers' input
  names.append("x")
  if mode != "norm":
    out_shape.append(jax.ShapeDtypeStruct((m, d), h.dtype))
    names.append("s")
  out_shape.append(jax.ShapeDtypeStruct(counter.shape, counter.dtype))
  names.append("counter_out")
  kernel = functools.partial(
      _kernel, names=tuple(names), mode=mode, fmt=fmt, starts=starts, m=m, mp=mp, d=d, dp=dp,
      bn=block_n, bk=block_k, eps=eps, top_k=top_k, u=u, decode=decode, method=method,
      stacked=stacked, preload=preload, interpret=interpret)
  res = C.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(m + starts[-1],),
      input_output_aliases={n_in: len(out_shape) - 1},
      compiler_params=C.compiler_params(num_warps, 1), interpret=interpret,
      name=(f"flint_layer_end_qkv{n_mats}_{mode}_{fmt}_{method}_bn{block_n}_bk{block_k}"
            f"_pre{preload}"),
  )(*args)
  outs = tuple(res[:n_mats])
  s = h if mode == "norm" else res[n_mats + 1]
  return s, outs, res[-1]


def layer_end_qkv_reference(h, weights, w_norm, counter=None, *, y=None, top_logits=None,
                            eps: float = 1e-6, out_dtype=jnp.bfloat16, **unused_tuning):
  """Plain jnp: ``norm_qkv_reference``; returns (s, outs) (no counter)."""
  del counter, unused_tuning
  return NQ.norm_qkv_reference(h, weights, w_norm, y=y, top_logits=top_logits, eps=eps,
                               out_dtype=out_dtype)
