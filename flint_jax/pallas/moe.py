"""Small-batch MoE decode (M <= 8 tokens): routing, expert-indexed grouped GEMVs, shared expert.

``moe_block(x, router_w, experts, shared)`` = ``moe_route`` (XLA) + ``moe_decode`` (2 Pallas kernels):

  out[t] = bf16( sum_k w[t,k] * y_k[t] + y_s[t] )          (fp32 sum, k in top-k order)
  y_k[t] = bf16( down_e(h) * down_scale_2[e] )               e = ids[t, k]
  h      = bf16( silu(g) * u ),  g/u = bf16( fp32 (x[t] . gate|up_e) * gate|up_scale_2[e] )
  y_s[t] = the shared expert (I_s = 1024) with the same rules, never gated

(``*_scale_2`` only with NVFP4 weights; BF16 experts use 1.) This is the rounding rule of
``moe_decode_reference``: the reference model's per-expert bf16 outputs, combined in fp32 and
rounded once (vLLM rounds the routed sum to bf16 before adding the shared output; we do not).

Routing (``moe_route``, XLA): ``logits = f32(x) f32(W_router)^T``, ``sigmoid``, ``top_k`` (6), weights
renormalised to sum 1, in fp32. Triton cannot lower top_k; this is 3-4 small XLA kernels.

Kernels (never ``ragged_dot``: it reads every expert):

1. ``gate_up``: one program per (slot, ``block_n`` rows of the intermediate dim), plus programs
   for the shared expert's gate/up. A slot is one expert: the program loads its id from an int32
   input and indexes the stacked weight ``w[e]`` (dynamic ref indexing), so only the selected
   experts' weights are read. Every program multiplies *all* M tokens (padded to 16 rows for the
   tensor cores, free at decode) and writes ``h [slots, M, I]`` / ``h_s [M, I_s]``.
2. ``down`` (default ``down_split=True``): one program per (``block_n_down`` output columns,
   slot or shared expert) writes the bf16 expert output ``y [slots + 1, M, D]``; one XLA fusion
   forms ``bf16(sum_k w_k y_k + y_s)``. With ``down_split=False`` one program per column block
   loops over the slots and combines in its epilogue (one kernel, no XLA op, but each program
   streams the slots one after another: 1.3-2x slower on the H200, docs/kernels.md).

Measured on the H200 (docs/kernels.md, device time without routing): NVFP4 M=1 30 us vs 58 us
for XLA's gather + dequantise + einsum, M=8 138-144 vs 306 us; BF16 M=1 23.5 vs 21.9 us (parity),
M=8 109 vs 84 us (XLA's einsum over the gathered weights streams better).

Slots and de-duplication (``dedupe``): without it, slot ``t*k + j`` is token t's j-th expert and
its coefficient row is ``w[t, j]`` for token t, 0 elsewhere (an expert picked by two tokens is read
twice; the second read usually hits L2). With ``dedupe=True`` (default when M > 1) the slots are
the *distinct* experts of the step (sorted; XLA sort + compaction of M*k ids), each read from HBM
exactly once, and ``coef[slot, t]`` is token t's weight for that expert (0 if not chosen).
Unused slots repeat the first expert with zero coefficients; kernel 1 skips them, kernel 2 stops
at the number of distinct experts. De-duplicated sums run in slot (expert id) order instead of
top-k order: the fp32 result can differ in the last bit, so ``dedupe=False`` is the bit-faithful
mode.

Routed path, 4 launches per MoE layer (``moe_block_add_rms_norm``; the old path above is
``moe_route`` 3-4 XLA kernels + ``moe_slots`` 1-2 + 2 Pallas + 1 XLA combine + ``add_rms_norm``):

1. ``moe_router_logits``: ``f32(x) . f32(W_router)^T`` [M, E], one XLA dot (precision HIGHEST;
   the cast of x to f32 is an elementwise producer XLA may or may not fuse into the dot).
2. + 3. ``moe_decode_routed``: the same gate_up and down (split) kernels. Every gate_up program
   computes its slot's expert id from the logits row of its token (``_topk_logits``: repeated
   max + lowest-index argmax over E (padded to a power of two), the set and order of
   ``lax.top_k``; sigmoid is monotonic, so no sigmoid is needed for the ids), and the first
   row block (j == 0) of each slot stores the result: ``route.ids [M, top_k]`` int32 and
   ``route.logits [M, top_k]`` f32 (the selected logits), two extra gate_up outputs. The down
   kernel loads its slot's id from ``route.ids`` (the top-k is computed once, in gate_up; the
   down kernel is launched after it). No de-duplication: slot u = t * top_k + j is token t's
   j-th expert, all U = M * top_k slots live. Returns ``(y, route)``: y [U + 1, M, D] bf16
   (last = shared expert) and the ``MoERoute``. NVFP4 experts at M > 1 (the default since
   session 15): each slot multiplies only its own token (``slot_rows="token"``, M = 1 tiles),
   the top-k runs once per token in its own kernel first (``moe_topk_route_pallas``,
   ``prerouted``: the 1600 gate_up programs at M = 8 would each repeat it), and the shared
   expert's programs are launched first (``shared_first``): 5 launches per layer.
4. ``moe_combine_add_rms_norm(h, y, route.logits, w_norm)``: one program per token loads its
   top_k selected logits, forms the weights w_j = sigmoid(l_j) / sum sigmoid (fp32),
   ``moe = bf16(sum_j w_j y_j + y_s)`` in top-k order, ``s = bf16(h + moe)`` and ``x_next`` with
   ``add_rms_norm``'s formula; returns (s, x_next).

The routed path selects by ``lax.top_k`` of the *logits* (``moe_route_from_logits``), the old path
by ``lax.top_k`` of the sigmoid *scores*: identical except where fp32 sigmoid maps distinct
logits to one value (logits above ~17 all round to 1.0; adjacent-ulp logits), where the old path
breaks the tie by index and the routed path keeps the logit order (the exact order).

Expert weights (``experts`` dict), either
  BF16:  ``gate_up_proj`` [E, 2I, D] (gate rows first), ``down_proj`` [E, D, I]
  NVFP4: ``gate_up_qweight`` [E, 2I, D/2], ``gate_up_weight_scale`` [E, 2I, D/16],
         ``gate_up_weight_scale_2`` [E, 2] (gate, up), ``down_qweight`` [E, D, I/2],
         ``down_weight_scale`` [E, D, I/16], ``down_weight_scale_2`` [E]
Shared expert (``shared`` dict): ``gate_proj``, ``up_proj`` [I_s, D], ``down_proj`` [D, I_s], each
either a bf16 array or an ``NVFP4Weight`` / (qweight, weight_scale, weight_scale_2) triple.

x [M, D] bf16, M <= 8 (up to 16 works); returns [M, D] bf16.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
import flint_jax.pallas.add_rms_norm  # noqa: F401  (modules, not the functions the package
import flint_jax.pallas.nvfp4_gemv  # noqa: F401    re-exports under the same names)

NV = sys.modules["flint_jax.pallas.nvfp4_gemv"]
ARN = sys.modules["flint_jax.pallas.add_rms_norm"]

__all__ = ["moe_route", "moe_slots", "moe_decode", "moe_decode_reference", "moe_block",
           "moe_block_reference", "expert_format", "moe_router_logits", "moe_route_from_logits",
           "MoERoute", "moe_topk_route", "moe_topk_route_pallas", "moe_route_weights",
           "moe_decode_routed", "moe_decode_routed_reference", "moe_decode_routed_combine",
           "moe_combine_add_rms_norm", "default_slot_rows", "default_shared_rows",
           "moe_combine_add_rms_norm_reference", "moe_block_add_rms_norm",
           "moe_block_add_rms_norm_reference"]

MAX_ROWS = 16
_UNROLL_SLOTS = 12   # down kernel: Python-unroll the slot loop up to this many slots


# ------------------------------------------------------------------------------------------
# Routing (XLA)


def moe_router_logits(x, router_w):
  """Router logits f32 [M, E] = f32(x) . f32(W_router)^T (one XLA dot, precision HIGHEST);
  x [M, D], router_w [E, D] (fp32 or bf16)."""
  return lax.dot_general(x.astype(jnp.float32), router_w.astype(jnp.float32),
                         (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)


class MoERoute(NamedTuple):
  """The routing of the routed path, per token, in ``lax.top_k`` order (descending logit, lowest
  expert id first among equal logits): ``ids`` [M, top_k] int32 the selected experts, ``logits``
  [M, top_k] f32 their router logits (the weights are ``moe_route_weights(logits)``).
  ``moe_decode_routed`` returns the one its gate_up kernel computed; ``moe_topk_route`` is the
  XLA reference."""
  ids: jax.Array
  logits: jax.Array


def moe_route(x, router_w, *, top_k: int = 6):
  """(ids [M, k] int32, weights [M, k] f32): sigmoid scores, top-k, renormalised (fp32)."""
  scores = jax.nn.sigmoid(moe_router_logits(x, router_w))
  w, ids = lax.top_k(scores, top_k)
  return ids.astype(jnp.int32), w / jnp.sum(w, axis=-1, keepdims=True)


def moe_slots(ids, weights, *, dedupe: bool):
  """(slot_expert [U] int32, coef [U, M] f32, n_slots [1] int32), U = M * k."""
  m, k = ids.shape
  u = m * k
  flat = ids.reshape(u).astype(jnp.int32)
  wf = weights.astype(jnp.float32)
  if not dedupe:
    owner = jnp.arange(u, dtype=jnp.int32) // k
    coef = jnp.where(owner[:, None] == jnp.arange(m)[None, :], wf.reshape(u)[:, None], 0.0)
    return flat, coef, jnp.full((1,), u, jnp.int32)
  srt = jnp.sort(flat)
  first = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
  pos = jnp.cumsum(first.astype(jnp.int32)) - 1
  n = pos[-1] + 1
  slot_expert = jnp.full((u,), srt[0], jnp.int32).at[jnp.where(first, pos, u)].set(
      srt, mode="drop")
  hit = (ids[None, :, :] == slot_expert[:, None, None]) & (jnp.arange(u) < n)[:, None, None]
  coef = jnp.sum(jnp.where(hit, wf[None], 0.0), axis=-1)             # [U, M]
  return slot_expert, coef, n.reshape(1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------
# Weight formats


def expert_format(experts) -> str:
  if "gate_up_proj" in experts:
    return "bf16"
  if "gate_up_qweight" in experts:
    return "nvfp4"
  raise ValueError(f"unknown expert weights: keys {sorted(experts)}")


def _lin_format(w) -> str:
  if isinstance(w, (tuple, list)) and len(w) == 3:
    return "nvfp4"
  if isinstance(w, dict):
    raise ValueError("pass an NVFP4 linear as NVFP4Weight(qweight, weight_scale, weight_scale_2)")
  return "bf16"


def _tile_dot(fmt, xs, x_idx, m, mp, ws, w_idx, n0, bn, i, bk, acc, decode, layout, method,
              x_scale=None, codes=None):
  """acc + one K step (index i) of x[.., :m] . W[.., n0:n0+bn]^T, fp32 in the
  ``_acc_zeros(fmt, mp, bn, bk, method)`` layout (decode factor included for NVFP4); ``codes``
  (NVFP4, tile layout): that step's weight tile already loaded (``_load_step_codes``)."""
  if fmt == "bf16":
    x_ref, _ = xs
    (w_ref,) = ws
    k0 = pl.multiple_of(i * bk, bk)
    x = C.load_x(x_ref, x_idx, m, mp, pl.ds(k0, bk), method)           # [Mp, BK] / [BK]
    w = w_ref[(*w_idx, pl.ds(n0, bn), pl.ds(k0, bk))]                   # [BN, BK]
    return acc + C.mm_tile(x, w, method)
  _, x5_ref = xs
  q_ref, s_ref = ws
  nb = bk // 64
  return NV.nvfp4_tile_dot(x5_ref, x_idx, m, mp, q_ref, s_ref, w_idx, n0, bn, _block0(i, nb), nb, decode=decode, layout=layout,
                           method=method, acc=acc, x_scale_ref=x_scale, codes=codes)


def _load_step_codes(ws, w_idx, n0, bn, i, bk):
  """The NVFP4 weight tile (``nvfp4_gemv.load_codes``) of K step i, for ``_tile_dot(codes=)``."""
  nb = bk // 64
  return NV.load_codes(*ws, w_idx, n0, bn, _block0(i, nb), nb)


def _block0(i, nb):
  """The first 64-value block of K step i (nb blocks per step); a Python int stays one (Triton
  takes no alignment hint on a constant)."""
  return i * nb if isinstance(i, int) else pl.multiple_of(i * nb, nb)


def _acc_zeros(fmt, mp, bn, bk, method):
  return C.acc_zeros(mp, bn, method, (bk,) if fmt == "bf16" else NV.lanes_shape(bk))


def _coef(c_ref, u, m, mp, method):
  """Routing coefficients of slot u broadcastable against an accumulator tile."""
  if method in C.CUDA_CORE_M1:
    return c_ref[u, 0]
  c = c_ref[u, C.row_load_index(m, mp)]                                 # [Mp]
  return c[None, :] if method == "swap" else c[:, None]


def _factor(fmt, decode):
  return 1.0 if fmt == "bf16" else NV.decode_factor(decode)


def _weight_args(fmt, w, name):
  """Kernel inputs for one weight: bf16 -> [w]; nvfp4 -> [codes view, scales view]."""
  if fmt == "bf16":
    return [w]
  q4, s4 = NV.nvfp4_views(w[0], w[1])
  return [q4, s4]


# ------------------------------------------------------------------------------------------
# Kernels


def _topk_logits(l_ref, t, top_k, n_exp, ep):
  """In-kernel top-k of row t of the router logits l_ref [M, E] f32 (E padded to ep = next_pow2
  by a masked load): [(id, logit)] * top_k in ``lax.top_k`` order (descending, lowest index first
  among equal values), by repeated max + masked argmin-of-index (Triton has no top_k / sort).
  Sigmoid is monotonic, so these are the experts of the top-k sigmoid scores. A NaN logit is never
  selected except as a clamped id (routing on NaN logits is unspecified, reads stay in bounds)."""
  cols = jnp.arange(ep, dtype=jnp.int32)
  if ep == n_exp:
    lg = l_ref[t, pl.ds(0, ep)]
  else:
    lg = plgpu.load(l_ref.at[t, cols], mask=cols < n_exp, other=-jnp.inf)
  return list(topk_select(lg, cols, cols >= n_exp, top_k, n_exp))


def topk_select(lg, cols, taken, top_k, n_exp):
  """The top-k selection inside a kernel: (ids, logits) of each of ``top_k`` rounds, in
  ``lax.top_k`` order (the max of the columns not yet taken, the lowest such index among equal
  values), along the last axis of ``lg`` f32 [Ep] (scalars out) or [R, Ep] ([R] out), Ep =
  next_pow2(E); ``cols`` = arange(Ep) int32, ``taken`` (bool, lg's shape) marks the padding
  columns >= E."""
  ep = cols.shape[0]
  col = (lambda a: a) if lg.ndim == 1 else (lambda a: a[:, None])  # noqa: E731 (per-row value)
  for _ in range(top_k):
    v = jnp.where(taken, -jnp.inf, lg)
    mx = jnp.max(v, axis=-1)
    idx = jnp.min(jnp.where((v == col(mx)) & jnp.logical_not(taken), cols, ep), axis=-1)
    idx = jnp.minimum(idx, n_exp - 1)
    taken = taken | (cols == col(idx))
    yield idx, mx


def _slot_route(l_ref, u, route):
  """(expert id, its logit) of slot u = t * top_k + rank from the logits l_ref [M, E]
  (route = (top_k, n_exp, ep)): token t's rank-th ``_topk_logits`` pair."""
  top_k, n_exp, ep = route
  sel = _topk_logits(l_ref, u // top_k, top_k, n_exp, ep)
  rank = u % top_k
  e, lg = sel[0]
  for it in range(1, top_k):
    e = jnp.where(rank == it, sel[it][0], e)
    lg = jnp.where(rank == it, sel[it][1], lg)
  return e, lg


def _gate_up_kernel(*refs, names, m, mp, inter, inter_s, bn, bk, bk_s, d, fe, fs, n_slots_max,
                    decode, layout, method, route=None, token_method=None, split_k=1,
                    finish=False, shared_first=False, shared_token=False, shared_tokens=1,
                    x16=False, h16=False, part="all", codes_ahead=False, interpret=False):
  """route None: slot u's expert is ``slot_expert[u]`` (slots u >= ``n_slots`` are skipped).
  route = (top_k, n_exp, ep): slot u's expert is computed from the ``logits`` (``_slot_route``),
  every slot is live, and the slot's j == 0 program stores the (id, logit) pair at
  ``route_ids`` / ``route_logits`` [u // top_k, u % top_k]; with a ``route_ids_in`` input
  (``prerouted``) slot u's expert is ``route_ids_in[u // top_k, u % top_k]`` instead (no top-k,
  nothing stored). shared_first: the shared expert's programs take the first program ids (they
  are launched first, so their longer work does not trail the routed slots'). shared_token (with
  token_method): the shared expert as M one-token parts too, one program per (token, row
  block) on the ``token_method`` tile writing hs [M, 1, I_s] row t (``shared_tokens`` > 1: one
  program per (group of that many tokens, row block), the tile decoded once for the group);
  otherwise one program per row block for all M rows (``method``).
  token_method (routed only): slot u multiplies only its own token t = u // top_k (x row t, the
  tile method ``token_method`` at M = 1) and writes h [U, 1, I]; otherwise all M rows.
  split_k > 1 (bf16): grid axis 1 is the K slice s; the program writes fp32 partial g and u
  (``hg`` / ``hu`` [S, U, M, I], ``hsg`` / ``hsu`` [S, M, I_s]) instead of h, and the down
  kernel forms h from them. finish (with split_k > 1): the partials stay internal; each
  program then counts itself done on ``counter_out[pid]`` (acq_rel atomic after a CTA
  barrier) and the last slice's program sums the S partials (volatile loads, slice order),
  writes h = bf16(silu(g) * u) and resets its counter entry to 0 (the counter returns zeroed, so
  one zeroed counter serves every layer of a step).
  x16 (with token_method "blocks"): the one-token operands ``xt5`` are ``nvfp4_gemv.x16_operand``'s
  f16 rows (the f16 products of ``blocks_fma_f16``), ``xinv`` [M] their row factors. h16 (with
  x16 and shared_token): h is written as the down kernel's f16 operand instead
  (``nvfp4_gemv.store_x16_blocks``: ``h16`` / ``hs16`` [., 1, I] f16 and ``hinv`` / ``hsinv``
  [., 1, I / 16] f32, one scale per 16 values of bf16(h)).
  part: "all" (the routed slots' and the shared expert's programs); "routed" (only the routed
  slots', ``shared_first`` ignored); "topk_shared" (with route and shared_token: programs
  0 .. M - 1 run token t = pid's top-k of the ``logits`` and store ``route_ids`` /
  ``route_logits`` row t, the rest are the shared expert's: ``moe_topk_route_pallas`` and the
  shared gate_up in one launch, the routing's latency under the shared expert's weight
  stream).
  codes_ahead (NVFP4 tile layout, split_k 1): the K loop unrolled, each step's weight tiles
  loaded before the previous step's decode (Triton's pipeliner stages only loads feeding a
  dot: without this a program waits for each step's loads before decoding them)."""
  r = dict(zip(names, refs))
  pid = pl.program_id(0)
  ks = pl.program_id(1) if split_k > 1 else 0
  n_i = inter // bn
  n_routed = n_slots_max * n_i
  n_sj = inter_s // bn                     # the shared expert's row blocks
  n_shared = n_sj * (m // shared_tokens if shared_token else 1)
  xs = (r["x"], r["x5"])
  all_rows = dict(xs=xs, x_idx=(), m=m, mp=mp, method=method)   # every token's row of x
  # one token's row of x as a one-row operand (x viewed as [M, 1, D]), on the M = 1 tiles
  token_operand = lambda t: dict(xs=(r["xt"], r["xt5"]), x_idx=(t,), m=1,  # noqa: E731
                                 mp=C.pad_rows(1), method=token_method)

  def gemv2(wg, wu, w_idx, ng, nu, fmt, step, xs=xs, x_idx=(), m=m, mp=mp, method=method):
    kw = dict(decode=decode, layout=layout, method=method)
    z = _acc_zeros(fmt, mp, bn, step, method)
    n_k = d // step // split_k                      # K steps of this program's slice
    lo, hi = ks * n_k, (ks + 1) * n_k
    if codes_ahead and fmt == "nvfp4" and layout == "tile" and split_k == 1:
      # unrolled (Python) so that no uint8 tile crosses a loop boundary (a loop-carried tile
      # is repacked byte by byte: +50% instructions, 244 registers in the SASS)
      def load(i):    # step i's gate and up tiles
        return (_load_step_codes(wg, w_idx, ng, bn, i, step),
                _load_step_codes(wu, w_idx, nu, bn, i, step))

      ag = au = z
      cur = load(0)
      for i in range(n_k):
        nxt = load(i + 1) if i + 1 < n_k else None
        ag = _tile_dot(fmt, xs, x_idx, m, mp, wg, w_idx, ng, bn, i, step, ag, codes=cur[0],
                       **kw)
        au = _tile_dot(fmt, xs, x_idx, m, mp, wu, w_idx, nu, bn, i, step, au, codes=cur[1],
                       **kw)
        cur = nxt
      return C.finish_acc(ag, method), C.finish_acc(au, method)

    def body(i, carry):
      ag, au = carry
      ag = _tile_dot(fmt, xs, x_idx, m, mp, wg, w_idx, ng, bn, i, step, ag, **kw)
      au = _tile_dot(fmt, xs, x_idx, m, mp, wu, w_idx, nu, bn, i, step, au, **kw)
      return ag, au
    ag, au = lax.fori_loop(lo, hi, body, (z, z))
    return C.finish_acc(ag, method), C.finish_acc(au, method)

  def store_h(h_name, lead, ag, au, n0, m_, mp_, method_):
    """h = bf16(silu(g) * u), or (split_k > 1) the fp32 partials g, u of slice ks (finish: and
    the last slice's program sums them into h)."""
    if split_k == 1 and h16:      # h as bf16 (the model's rounding), then its f16 operand
      h = C.silu_mul_f32(ag, au).astype(jnp.bfloat16)
      NV.store_x16_blocks(r[h_name + "16"], r[h_name + "inv"], (*lead, 0), h, n0, bn)
      return
    if split_k == 1:
      C.store_tile(r[h_name], lead, C.silu_mul_f32(ag, au), n0, bn, m_, mp_, method_)
      return
    C.store_tile(r[h_name + "g"], (ks, *lead), ag, n0, bn, m_, mp_, method_)
    C.store_tile(r[h_name + "u"], (ks, *lead), au, n0, bn, m_, mp_, method_)
    if not finish:
      return
    if not interpret:   # every thread's stores precede the atomic (no CPU lowering)
      plgpu.debug_barrier()
    old = plgpu.atomic_add(r["counter_out"], (pid,), jnp.int32(1))

    @pl.when(old == split_k - 1)
    def _():
      g = u = None
      for sk in range(split_k):
        gs = C.load_tile(r[h_name + "g"], (sk, *lead), n0, bn, m_, mp_, method_)
        us = C.load_tile(r[h_name + "u"], (sk, *lead), n0, bn, m_, mp_, method_)
        g, u = (gs, us) if g is None else (g + gs, u + us)
      C.store_tile(r[h_name], lead, C.silu_mul_f32(g, u), n0, bn, m_, mp_, method_)
      plgpu.store(r["counter_out"].at[pid], jnp.int32(0))

  def routed(p):
    u = p // n_i
    j = p % n_i
    # slot u's token only, or every token
    operand = all_rows if token_method is None else token_operand(u // route[0])

    def slot():
      if route is None:
        e = r["slot_expert"][u]
      elif "route_ids_in" in r:
        e = r["route_ids_in"][u // route[0], u % route[0]]
      else:
        e, lg = _slot_route(r["logits"], u, route)
        top_k = route[0]

        @pl.when((j == 0) & (ks == 0))  # one program per slot stores the routing (scalars)
        def _():
          r["route_ids"][u // top_k, u % top_k] = e
          r["route_logits"][u // top_k, u % top_k] = lg

      wgu = [r["gu_w"]] if fe == "bf16" else [r["gu_q"], r["gu_s"]]
      ag, au = gemv2(wgu, wgu, (e,), j * bn, inter + j * bn, fe, bk, **operand)
      if fe == "nvfp4":
        t = u // route[0] if x16 else None
        f = NV.F16_DECODE_FACTOR * r["xinv"][t] if x16 else NV.decode_factor(decode)
        ag = ag * (r["gu_s2"][e, 0] * f)
        au = au * (r["gu_s2"][e, 1] * f)
      store_h("h", (u,), ag, au, j * bn, operand["m"], operand["mp"], operand["method"])

    if route is None:
      pl.when(u < r["n_slots"][0])(slot)
    else:            # routing from logits: no de-duplication, every slot is live
      slot()

  def shared_tokens_group(j):
    """Tokens g T .. g T + T - 1 (T = shared_tokens, g = j // n_sj) for row block j % n_sj: each
    K step's weight tile decoded once, its block sums formed for every token."""
    g, j = j // n_sj, j % n_sj
    tokens = [g * shared_tokens + i for i in range(shared_tokens)]
    x_idxs = [(t,) for t in tokens]
    nb = bk_s // 64

    def body(i, carry):
      ags, aus = carry
      b0 = pl.multiple_of(i * nb, nb)
      ags = NV.blocks_tile_dot_tokens(r["xt5"], x_idxs, r["sg_q"], r["sg_s"], (), j * bn, bn,
                                      b0, nb, decode=decode, accs=ags)
      aus = NV.blocks_tile_dot_tokens(r["xt5"], x_idxs, r["su_q"], r["su_s"], (), j * bn, bn,
                                      b0, nb, decode=decode, accs=aus)
      return ags, aus

    z = _acc_zeros(fs, 1, bn, bk_s, "blocks")
    ags, aus = lax.fori_loop(0, d // bk_s, body, ([z] * shared_tokens, [z] * shared_tokens))
    f = NV.decode_factor(decode)
    for t, ag, au in zip(tokens, ags, aus):
      ag = C.finish_acc(ag, "blocks") * (r["sg_s2"][0] * f)
      au = C.finish_acc(au, "blocks") * (r["su_s2"][0] * f)
      store_h("hs", (t,), ag, au, j * bn, 1, C.pad_rows(1), "blocks")

  def shared(j):
    if shared_tokens > 1:
      shared_tokens_group(j)
      return
    if shared_token:     # part j: token j // n_sj, row block j % n_sj
      operand, lead = token_operand(j // n_sj), (j // n_sj,)
      j = j % n_sj
    else:
      operand, lead = all_rows, ()
    if fs == "bf16":
      wg, wu = [r["sg_w"]], [r["su_w"]]
    else:
      wg, wu = [r["sg_q"], r["sg_s"]], [r["su_q"], r["su_s"]]
    ag, au = gemv2(wg, wu, (), j * bn, j * bn, fs, bk_s, **operand)
    if fs == "nvfp4":
      f = (NV.F16_DECODE_FACTOR * r["xinv"][lead[0]] if x16 and shared_token
           else NV.decode_factor(decode))
      ag = ag * (r["sg_s2"][0] * f)
      au = au * (r["su_s2"][0] * f)
    store_h("hs", lead, ag, au, j * bn, operand["m"], operand["mp"], operand["method"])

  def topk(t):      # token t's routing, as ``_topk_kernel``
    for jj, (e, lg) in enumerate(_topk_logits(r["logits"], t, *route)):
      r["route_ids"][t, jj] = e
      r["route_logits"][t, jj] = lg

  if part == "routed":
    routed(pid)
  elif part == "topk_shared":
    lax.cond(pid < m, lambda: topk(pid), lambda: shared(pid - m))
  elif shared_first:
    lax.cond(pid < n_shared, lambda: shared(pid), lambda: routed(pid - n_shared))
  else:
    lax.cond(pid < n_routed, lambda: routed(pid), lambda: shared(pid - n_routed))


def _down_kernel(*refs, names, m, mp, inter, inter_s, bn, bk, bk_s, n_slots_max, fe, fs,
                 decode, layout, unroll, method, split, route_top_k=None, token_method=None,
                 gu_split_k=1, shared_cols=1, combine=None, shared_first=False,
                 shared_token=False, h16=False, interpret=False):
  """split=False: grid (D/BN,), every slot + shared + combine in one program, out [M, D].
  split=True: grid (D/BN, slots + 1), one (slot | shared) per program, y [(slots + 1) * M, D]
  bf16 (the caller's [slots + 1, M, D]; the combine is one XLA fusion, or
  ``moe_combine_add_rms_norm``). Slot u's expert: ``slot_expert[u]`` (route_top_k None; slots
  u >= ``n_slots`` write zeros), or ``route_ids[u // route_top_k, u % route_top_k]`` (the gate_up
  kernel's routing; split only, every slot live). token_method (routed only): h is [U, 1, I]
  and slot u writes only its token's row y[u, u // route_top_k] (``token_method`` tiles).
  gu_split_k > 1 (bf16): h arrives as the gate_up kernel's fp32 partials (``hg`` / ``hu``,
  ``hsg`` / ``hsu``); each K step forms its h tile = bf16(silu(sum_s g) * sum_s u).
  shared_cols > 1 (split only): the shared expert's BN columns are cut over that many programs
  (grid (D/BN, slots + shared_cols)), BN / shared_cols columns each, so that its longer K
  (I_s > I) does not leave its programs running alone at the end.
  combine (split, routed only): dict(top_k, base, eps, dp): the MoE combine + residual add +
  next RMSNorm (``moe_combine_add_rms_norm``) done by the kernel's last program. Every program
  stores its y tile, then counts itself done on its column block's counter entry
  (``base + 1 + block``); the last of a block counts the block done on entry ``base``; the last
  block's program reads all of y back (volatile) and writes (s, x) for every token. Each entry
  returns to zero, so the counters are zeros again after the call. shared_first (split only):
  the shared expert's programs are grid rows 0 .. shared_cols - 1, the slots' after them.
  shared_token (split, with token_method): hs arrives as [M, 1, I_s] and the shared expert's
  part q (grid row slots + q, q < M) computes token q's row on the ``token_method`` tile (grid
  (D/BN, slots + M); shared_cols must be 1). h16 (with token_method "blocks" and shared_token):
  h / hs are the gate_up kernel's f16 operands, their per-block factors ``hinv5`` / ``hsinv5``
  (viewed [., 1, I / 64, 2, 2]); the f16 products of ``nvfp4_gemv.blocks_fma_f16``."""
  r = dict(zip(names, refs))
  n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
  dt = r["out"].dtype
  kw = dict(decode=decode, layout=layout, method=method)
  zeros = C.acc_zeros(mp, bn, C.finish_method(method))   # a finished accumulator's shape
  if token_method is None:
    m_u, mp_u, method_u = m, mp, method
  else:
    m_u, mp_u, method_u = 1, C.pad_rows(1), token_method

  def parts_dot(name, lead, m_, mp_, w_ref, w_idx, bk_, method_, n0=n0, bn=bn):
    """K step i of h . W^T with h formed from the gate_up kernel's split-K partials (at M = 1
    the one real row, broadcast to the tile's padded rows after the SiLU)."""
    one_row = m_ == 1 and method_ not in C.CUDA_CORE_M1

    def step(i, a):
      cols = pl.ds(pl.multiple_of(i * bk_, bk_), bk_)
      load = "reduce" if one_row else method_
      g = u = None
      for sk in range(gu_split_k):    # the partials summed in slice order
        gs = C.load_x(r[name + "g"], (sk, *lead), m_, mp_, cols, load)
        us = C.load_x(r[name + "u"], (sk, *lead), m_, mp_, cols, load)
        g, u = (gs, us) if g is None else (g + gs, u + us)
      x = C.silu_mul_f32(g, u).astype(w_ref.dtype)
      if one_row:
        x = jnp.broadcast_to(x[None, :], (mp_, bk_))
      w = w_ref[(*w_idx, pl.ds(n0, bn), cols)]
      return a + C.mm_tile(x, w, method_)
    return step

  def shared_y(n0=n0, bn=bn, t=None):
    """y_s = bf16(hs . Wd^T * scale_2), columns n0 .. n0 + bn: all M rows, or (shared_token)
    token t's row."""
    wsd = [r["sd_w"]] if fs == "bf16" else [r["sd_q"], r["sd_s"]]
    hs = (r["hs"], r["hs5"]) if gu_split_k == 1 else None
    lead, m_, mp_, method_ = ((), m, mp, method) if t is None else ((t,), m_u, mp_u, method_u)
    kw_s = dict(kw, method=method_, x_scale=r["hsinv5"] if h16 else None)
    body = (parts_dot("hs", (), m, mp, r["sd_w"], (), bk_s, method, n0, bn) if gu_split_k > 1
            else lambda i, a: _tile_dot(fs, hs, lead, m_, mp_, wsd, (), n0, bn, i, bk_s, a,
                                        **kw_s))
    acc = lax.fori_loop(0, inter_s // bk_s, body, _acc_zeros(fs, mp_, bn, bk_s, method_))
    acc = C.finish_acc(acc, method_)
    if fs == "nvfp4":
      f = NV.F16_DECODE_FACTOR if h16 else NV.decode_factor(decode)
      acc = acc * (r["sd_s2"][0] * f)
    return acc.astype(dt)

  def slot_y(u):    # y_k = bf16(h_u . Wd_e^T * scale_2[e])
    if route_top_k is None:
      e = r["slot_expert"][u]
    else:
      e = r["route_ids"][u // route_top_k, u % route_top_k]
    wd = [r["dn_w"]] if fe == "bf16" else [r["dn_q"], r["dn_s"]]
    h = (r["h"], r["h5"]) if gu_split_k == 1 else None
    kw_u = dict(kw, method=method_u, x_scale=r["hinv5"] if h16 else None)
    body = (parts_dot("h", (u,), m_u, mp_u, r["dn_w"], (e,), bk, method_u) if gu_split_k > 1
            else lambda i, a: _tile_dot(fe, h, (u,), m_u, mp_u, wd, (e,), n0, bn, i, bk, a,
                                        **kw_u))
    acc = lax.fori_loop(0, inter // bk, body, _acc_zeros(fe, mp_u, bn, bk, method_u))
    acc = C.finish_acc(acc, method_u)
    if fe == "nvfp4":
      f = NV.F16_DECODE_FACTOR if h16 else NV.decode_factor(decode)
      acc = acc * (r["dn_s2"][e] * f)
    return acc.astype(dt)

  if split:
    s_pid = pl.program_id(1)
    n_sh = m if shared_token else shared_cols    # the shared expert's programs per column block
    # the slot (or, from n_slots_max on, the shared expert's part) of this program
    s_id = (jnp.where(s_pid < n_sh, n_slots_max + s_pid, s_pid - n_sh)
            if shared_first else s_pid)

    def routed():
      if route_top_k is None:
        y = lax.cond(s_id < r["n_slots"][0], lambda: slot_y(s_id), lambda: zeros.astype(dt))
      else:
        y = slot_y(s_id)
      row0 = s_id * m + (0 if token_method is None else s_id // route_top_k)
      C.store_tile(r["out"], (), y, n0, bn, m_u, mp_u, method_u, row0=row0)

    def shared():
      if shared_token:
        t = s_id - n_slots_max
        C.store_tile(r["out"], (), shared_y(t=t), n0, bn, m_u, mp_u, method_u,
                     row0=n_slots_max * m + t)
        return
      if shared_cols == 1:
        C.store_tile(r["out"], (), shared_y(), n0, bn, m, mp, method, row0=n_slots_max * m)
        return
      bn_s = bn // shared_cols
      n0_s = pl.multiple_of(n0 + (s_id - n_slots_max) * bn_s, bn_s)
      C.store_tile(r["out"], (), shared_y(n0_s, bn_s), n0_s, bn_s, m, mp, method,
                   row0=n_slots_max * m)

    lax.cond(s_id < n_slots_max, routed, shared)
    if combine is not None:
      # per-token arrival counters (residual mode, every program one token's): the last of a
      # token's top_k + 1 programs of a block combines that token's columns, in parallel with
      # the other tokens' instead of all M rows in one program
      token = (jnp.where(s_id < n_slots_max, s_id // route_top_k, s_id - n_slots_max)
               if combine["per_token"] else None)
      _down_combine_finish(r, m=m, d=r["out"].shape[-1], n_slots=n_slots_max,
                           progs_per_block=n_slots_max + n_sh, interpret=interpret,
                           token=token, **combine)
    return

  y_s = shared_y().astype(jnp.float32)

  def slot(u, tot):
    y = slot_y(u).astype(jnp.float32)
    c = _coef(r["coef"], u, m, mp, method)
    return tot + jnp.where(c != 0.0, c * y, 0.0)   # 0 * (garbage of an unused slot) stays 0

  if unroll:
    tot = zeros
    for u in range(n_slots_max):      # static: all slots' weight loads can be issued early
      tot = slot(u, tot)
  else:
    tot = lax.fori_loop(0, r["n_slots"][0], slot, zeros)
  C.store_tile(r["out"], (), tot + y_s, n0, bn, m, mp, method)


def _down_combine_finish(r, *, m, d, n_slots, progs_per_block, top_k, base, eps, dp,
                         interpret, bn=None, norm=True, per_token=False, token=None, x16=False):
  """The tail of the down kernel with ``combine``: see ``_down_kernel``. ``per_token`` (residual
  mode with per-token slots): ``token`` is this program's token; its block's arrivals are
  counted per token on entry ``base + 1 + block * M + token`` and the last of its top_k + 1
  writes that token's block of s and its sum of squares."""
  cnt = r["cmb_counter_out"]
  n_blocks = pl.num_programs(0)
  jb = pl.program_id(0)
  if not interpret:   # every thread's stores precede the atomic (no CPU lowering)
    plgpu.debug_barrier()
  if per_token:
    entry = base + 1 + jb * m + token
    old = plgpu.atomic_add(cnt, (entry,), jnp.int32(1))

    @pl.when(old == top_k)
    def _():
      plgpu.store(cnt.at[entry], jnp.int32(0))
      _combine_block(r, token, jb, m=m, top_k=top_k, n_slots=n_slots, bn=bn)
    return
  old = plgpu.atomic_add(cnt, (base + 1 + jb,), jnp.int32(1))

  @pl.when(old == progs_per_block - 1)
  def _():
    plgpu.store(cnt.at[base + 1 + jb], jnp.int32(0))
    if not norm:   # this block's columns of s and their sum of squares; no second level
      for t in range(m):
        _combine_block(r, jnp.int32(t), jb, m=m, top_k=top_k, n_slots=n_slots, bn=bn)
      return
    old2 = plgpu.atomic_add(cnt, (jnp.int32(base),), jnp.int32(1))

    @pl.when(old2 == n_blocks - 1)
    def _():
      plgpu.store(cnt.at[jnp.int32(base)], jnp.int32(0))
      for t in range(m):
        _combine_row_flat(r, t, m=m, top_k=top_k, n_slots=n_slots, d=d, dp=dp, eps=eps,
                          x16=x16)


def _combine_block(r, t, jb, *, m, top_k, n_slots, bn):
  """Token t's s = bf16(h + moe) at the columns of block jb, stored with its fp32 sum of
  squares ``cmb_ss[t, jb]`` (the combine with ``norm=False``; y read back volatile)."""
  y_ref = r["out"]
  cols = pl.multiple_of(jb * bn, bn) + jnp.arange(bn, dtype=jnp.int32)

  def y_row(u, cols, mask):   # y[u, t] of the [U + 1, M, D] view
    return plgpu.load(y_ref.at[u * m + t, cols], mask=mask, volatile=True)

  # every column of a block is real (D % bn == 0): no mask
  s = _combine_s(y_row, r["cmb_logits"], r["cmb_h"], t, cols, None, top_k=top_k, u=n_slots,
                 dtype=r["cmb_s"].dtype)
  plgpu.store(r["cmb_s"].at[t, cols], s)
  s32 = s.astype(jnp.float32)
  r["cmb_ss"][t, jb] = jnp.sum(s32 * s32)


def _combine_row_flat(r, t, *, m, top_k, n_slots, d, dp, eps, x16=False):
  """``moe_combine_add_rms_norm``'s row code for token t, reading y from the down kernel's own
  output [(U + 1) * M, D] (volatile: other programs wrote it during this kernel); ``x16``: also
  x_next's f16 operand (``cmb_x16`` / ``cmb_xinv``, ``nvfp4_gemv.x16_operand``)."""
  y_ref = r["out"]
  t = jnp.int32(t)

  def y_row(u, cols, mask):   # y[u, t] of the [U + 1, M, D] view
    return plgpu.load(y_ref.at[u * m + t, cols], mask=mask, other=0, volatile=True)

  _combine_row(y_row, r["cmb_logits"], r["cmb_h"], r["cmb_w"], r["cmb_s"], r["cmb_x"], t,
               top_k=top_k, u=n_slots, d=d, dp=dp, eps=eps,
               x16_refs=(r["cmb_x16"], r["cmb_xinv"]) if x16 else ())


# ------------------------------------------------------------------------------------------
# Wrapper


def _shapes(x, experts, shared):
  fe = expert_format(experts)
  fs = _lin_format(shared["gate_proj"])
  C.check(_lin_format(shared["up_proj"]) == fs == _lin_format(shared["down_proj"]),
          "shared gate/up/down must share a format")
  C.check(x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS,
          f"x must be [M <= {MAX_ROWS}, D], got {x.shape=}")
  m, d = x.shape
  if fe == "bf16":
    e, i2, dd = experts["gate_up_proj"].shape
    C.check(experts["down_proj"].shape == (e, d, i2 // 2),
            f"down_proj must be [E, D, I], got {experts['down_proj'].shape}")
  else:
    e, i2, dh = experts["gate_up_qweight"].shape
    dd = dh * 2
    C.check(experts["down_qweight"].shape == (e, d, i2 // 4),
            f"down_qweight must be [E, D, I/2], got {experts['down_qweight'].shape}")
    C.check(experts["gate_up_weight_scale_2"].shape == (e, 2),
            "gate_up_weight_scale_2 must be [E, 2]")
    C.check(experts["down_weight_scale_2"].shape == (e,), "down_weight_scale_2 must be [E]")
  C.check(dd == d, f"expert input dim {dd} != D={d}")
  sg = shared["gate_proj"] if fs == "bf16" else shared["gate_proj"][0]
  inter_s = sg.shape[0]
  return fe, fs, m, d, e, i2 // 2, inter_s


def default_slot_rows(fe: str, m: int, gate_up_split_k: int | None = None) -> str:
  """``slot_rows`` of the routed MoE for expert format ``fe`` at M tokens: "token" for NVFP4
  experts at M >= 2 and BF16 experts at M = 2..4, "all" otherwise (always with the gate_up in K
  slices, ``gate_up_split_k`` > 1, which needs "all"). H200, Flint sizes, gate_up + down (runs
  28-29, 99): NVFP4 "token" 37.8 / 52.7 / 74.9 us at M = 2 / 3 / 4 against 59.5 / 78.9 / 87.7
  for "all"; at M = 8 "token" lost (192 against 133.5) until the routing moved out of its
  programs and the shared expert's programs went first (``prerouted``, ``shared_first``, on with
  it by default): 114.5 against 163; in the step (run 100) NVFP4 8x1K 7.20 against 8.16 ms, 4x1K
  4.98 against 5.84. BF16 (run 109, with the same two options; equal at M = 8 without them, run
  29): 103.1 / 67.9 / 38.7 us at M = 8 / 4 / 2 against 113.3 / 81.7 / 40.5 for "all"; in the
  step (run 110, kernel busy time, the top-k kernel included) 4x1K 4048 against 4207 us, 2x1K
  3130 against 3184, but 8x1K 5900 against 5875 (in-loop 6.264 against 6.102 ms): "all" at
  M >= 5."""
  token = m >= 2 and (fe == "nvfp4" or m <= 4)
  return "token" if token and (gate_up_split_k or 1) == 1 else "all"


def _routed_defaults(fe, m, slot_rows, prerouted, shared_first, gate_up_split_k=None):
  """(slot_rows, prerouted, shared_first) with the defaults filled in: the per-token slots at
  M > 1 get the routing from ``moe_topk_route_pallas`` and the shared expert's programs first
  (their 1600 gate_up programs at M = 8 would each run the 12-reduction top-k before any
  weight load, and the shared expert's M rows on ``rows`` tiles are the longest programs)."""
  slot_rows = slot_rows or default_slot_rows(fe, m, gate_up_split_k)
  token = m > 1 and slot_rows == "token"
  return (slot_rows, token if prerouted is None else prerouted,
          token if shared_first is None else shared_first)


def default_shared_rows(fe: str, fs: str, token: bool, down_shared_cols: int | None) -> str:
  """``shared_rows`` of the routed MoE: "token" with per-token slots (``token``: slot_rows
  "token" at M > 1) when the experts and the shared expert are both NVFP4 and the shared down
  columns are not cut (``down_shared_cols`` None / 1), "all" otherwise. H200 run 102, both
  kernels at M = 8 / 4 / 2: 77.4 / 45.3 / 23.6 us against 107.7 / 58.0 / 33.1 with "all"; in the
  step NVFP4 8x1K 5.661 against 7.240 ms, 4x1K 4.384 against 4.942, 2x1K 3.166 against 3.425
  (the ``rows`` tile's [M, BN, BK] products gave the gate_up a 6.6 KB stack frame per thread).
  BF16 per-token slots (run 109): the shared expert per token on BF16's M = 1 tiles needs
  smaller K steps to fit the shared memory and is slower then (114.7 against 103.1 us at M = 8
  with the shared expert's rows on one ``dot`` program): "all"."""
  cut = down_shared_cols not in (None, 1)
  return "token" if token and fe == fs == "nvfp4" and not cut else "all"


def default_moe_tiling(fe: str, m: int, token: bool = False, shared_token: bool = False,
                       f16: bool = False) -> dict:
  """Tile sizes of the two MoE kernels for expert format ``fe`` and M tokens on an H200;
  ``token``: the per-token slots of ``slot_rows="token"`` (M = 1 tiles, except the NVFP4
  gate_up at M >= 5: bn16 bk512 with 4 warps; H200 runs 96 and 99, both kernels at M = 8: 288 us
  on the M = 1 tile (bn16 bk1024, 16 warps), 180 with 8 warps; with the routing given and the
  shared expert first 231 / 123, and **114.5** on bn16 bk512 w4; and the NVFP4 down kernel at
  M >= 4 on 32-row blocks, measured in the step, runs 148-149: 20.9 -> 18.9 us per layer at
  8x1K, 11.9 -> 11.1 at 4x1K, equal at 2x1K; bn64 w8 19.2-19.5, bn16 w2 19.2, bn32 w8 20.8,
  bn32 bk256 19.4; the gate_up's w8 / w2 / bn32 / bk256 / bk1024 / 3 stages no faster).
  ``f16`` (NVFP4 per-token slots with ``gate_up_f16``): the f16 gate_up has 72 registers
  instead of 126, and other tiles win: bn32 at M >= 5 (8x1K: 33.9 us per layer against 34.3 on
  bn16, 37.3 for the default decode), 8 warps below (4x1K: 18.4 against 23.1 on 4 warps, and
  21.7 for the default decode on 8 warps; 2x1K: 10.5 against 12.4); the down kernel as without.
  With the block sums (runs 162-163, in the step): at M = 4 bk512 on 4 warps, 16.7 against
  17.5 us per layer (4x1K 3.254 / 3.270 against 3.301 / 3.290 ms); at M = 2 it is slower (11.7
  against 9.8); at M = 8 bn16, bk256 and a K step loaded ahead (``codes_ahead``) are slower.
  ``shared_token``: the shared expert per token too (``shared_rows="token"``): BF16's gate_up
  then on bk128 with 4 stages (its M = 1 tile, bn64 bk256 3 stages, asks for 288 KB of shared
  memory, the H200 has 227 KB; run 109).

  From the session-3 sweep (docs/kernels.md; Flint sizes, device us of gate_up + down):
  - BF16 M=1: gate_up bn64 bk256 w4 (13.0); down bn64 bk128 (7.7, against 10.8 with the old
    single 512-wide K step: a one-iteration loop cannot pipeline its loads).
  - BF16 M=8: bn64 bk128 w4 4 stages for both (54.8 + 34.2, against 59.7 + 62.2).
  - NVFP4 M=1 (CUDA-core ``reduce``): gate_up bn16 bk512 w8 (11.0, against 19.9 at bn32 bk256
    w4: the decode needs many warps per SM); down bn16 bk512 w4 (6.1, against 8.4). Round 2:
    gate_up bk1024 w16 2 stages, down 2 stages: 16.2 us for both (17.3 with round 1's).
  - NVFP4 M=8: gate_up bn64 bk256 w4 (98); down bn64 bk128 w4 (37.6, against 43.0).
  - BF16 M=8, round 2: 64-wide K steps, 5 / 4 stages: 84.5 us for both (89.5 at bk128).
  - NVFP4 M=8, session 12 (pre-scaled scales, the ``mul`` decode; kernels.py --groups moetune /
    m8swap, runs 79-80): gate_up on swap-AB tiles (the decoded weights as wgmma's register A
    operand) bn128 bk256 w8: 144.5 / 144.7 us for both kernels against 160.3 / 160.2 (dot
    bn64 bk256 w4); the down kernel's swap tiles gain under 4 us: it stays ``dot``. ``method`` /
    ``method_down`` keys: the tile methods where they differ from the format's default.
  """
  methods = {}
  if token and fe == "nvfp4" and f16:       # gate_up_f16 (H200 runs 154-155, in the step)
    tiles = default_moe_tiling(fe, m, token, shared_token)
    return {**tiles, **(dict(block_n=32) if m >= 5 else
                        dict(block_k=512, num_warps=4) if m == 4 else dict(num_warps=8))}
  if token and fe == "nvfp4" and m >= 5:
    gu, dn = (16, 512, 4, 2), (32, 512, 4, 2)
  elif token and shared_token and fe == "bf16":
    gu, dn = (64, 128, 4, 4), (64, 128, 4, 3)
  elif token and fe == "nvfp4" and m >= 4:
    return {**default_moe_tiling(fe, 1), "block_n_down": 32}
  elif token:
    return default_moe_tiling(fe, 1)
  elif fe == "nvfp4" and m == 1:
    gu, dn = (16, 1024, 16, 2), (16, 512, 4, 2)
  elif fe == "nvfp4":
    gu, dn = (128, 256, 8, 3), (64, 128, 4, 3)
    methods = dict(method="swap", method_down="dot")
  elif m == 1:
    gu, dn = (64, 256, 4, 3), (64, 128, 4, 3)
  else:
    gu, dn = (64, 64, 4, 5), (64, 64, 4, 4)
  return dict(zip(("block_n", "block_k", "num_warps", "num_stages", "block_n_down",
                   "block_k_down", "num_warps_down", "num_stages_down"), gu + dn), **methods)


_TUNING = ("block_n", "block_k", "block_n_down", "block_k_down", "decode", "layout",
           "unroll_slots", "method", "method_down", "num_warps", "num_stages", "num_warps_down",
           "num_stages_down", "gate_up_split_k", "down_shared_cols", "codes_ahead", "interpret")


def _f16_sums_for(bn, bk, num_warps, f16=True):
  """``nvfp4_gemv.f16_sums_for_tile``: the f16 K step's sums for [bn, bk / 64, 2, 16]-byte code
  tiles on ``num_warps`` warps ("pair" below 16 bytes per thread; an error below 4); nothing
  unless the kernel runs that step (``f16``)."""
  return NV.f16_sums_for_tile(bn, bk, num_warps) if f16 else contextlib.nullcontext()


def _launch_topk_shared_then_routed(in_names, in_args, h_out, hs_out, gu_kw, *, m, u, n_i,
                                    n_shared, num_warps, num_stages, tag, suffix, interpret):
  """The gate_up stage of ``shared_with_topk`` as two launches of ``_gate_up_kernel``: first
  the top-k of each token's ``logits`` (programs 0 .. M - 1) beside the shared expert's
  per-token programs (``part="topk_shared"``), then the routed slots alone (``part="routed"``,
  the ids from the first). in_names / in_args: the gate_up kernel's inputs (with "logits");
  h_out / hs_out: {name: ShapeDtypeStruct} of the routed / shared h outputs. Returns
  (MoERoute, h_parts) with h_parts in the one-launch order (h outputs, then hs outputs)."""
  top_k = gu_kw["route"][0]
  params = C.compiler_params(num_warps, num_stages)
  route_shapes = [jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                  jax.ShapeDtypeStruct((m, top_k), jnp.float32)]
  names_a = in_names + [*hs_out, "route_ids", "route_logits"]
  with _f16_sums_for(gu_kw["bn"], gu_kw["bk"], num_warps, gu_kw["x16"]):
    res_a = C.pallas_call(
        functools.partial(_gate_up_kernel, names=names_a, part="topk_shared", **gu_kw),
        grid=(m + n_shared,), out_shape=(*hs_out.values(), *route_shapes),
        compiler_params=params, interpret=interpret,
        name=f"flint_moe_topk_shared{tag}{suffix}")(*in_args)
    route_out = MoERoute(*res_a[-2:])
    names_b = ["route_ids_in" if n == "logits" else n for n in in_names] + [*h_out]
    args_b = [route_out.ids if n == "logits" else a for n, a in zip(in_names, in_args)]
    res_b = C.pallas_call(
        functools.partial(_gate_up_kernel, names=names_b, part="routed", **gu_kw),
        grid=(u * n_i,), out_shape=tuple(h_out.values()),
        compiler_params=params, interpret=interpret,
        name=f"flint_moe_gate_up{tag}_shtopk{suffix}")(*args_b)
  return route_out, [*res_b, *res_a[:-2]]


def _launch(x, experts, shared, fe, fs, m, d, inter, inter_s, u, route_names, route_args, *,
            route, coef, down_split, block_n, block_k, block_n_down, decode, layout,
            unroll_slots, method, method_down, num_warps, num_stages, interpret,
            block_k_down=None, num_warps_down=None, num_stages_down=None, slot_rows=None,
            token_method=None, gate_up_split_k=None, gate_up_counter=None,
            down_shared_cols=None, combine=None, asm_down=None, route_given=None,
            shared_first=False, shared_rows=None, shared_tokens=None,
            gate_up_f16=None, x16_rows=None, down_f16=None, shared_with_topk=None,
            codes_ahead=None):
  """The gate_up and down pallas_calls. route None: route_names/route_args are the slot inputs
  of both kernels (["slot_expert", "n_slots"]); route = (top_k, n_exp, ep): they are ["logits"]
  (gate_up only), gate_up also outputs the routing (ids, logits [M, top_k]) and the down kernel
  reads the ids. coef [U, M] only for down_split=False. slot_rows: see ``moe_decode_routed``.
  gate_up_split_k, gate_up_counter, asm_down: see ``moe_decode_routed``. Returns (y / out, route,
  counter) (counter None unless ``gate_up_counter`` was given). route_given (routed only): the
  ``MoERoute`` computed outside (route_names/route_args then ["route_ids_in"] / [its ids]): the
  gate_up kernel reads the ids, outputs no routing, and route_given is returned. shared_rows:
  see ``moe_decode_routed``. shared_with_topk: see ``moe_decode_routed``
  (route_names/route_args then ["logits"]).
  y [U + 1, M, D] (down_split) or out [M, D]; MoERoute or None."""
  C.check(slot_rows in (None, "all", "token"),
          f"slot_rows must be 'all' or 'token', got {slot_rows!r}")
  C.check(slot_rows != "token" or route is not None, "slot_rows='token' needs the routed path")
  slot_rows = slot_rows or default_slot_rows(fe, m, gate_up_split_k)
  # per-token slots at M > 1; at M = 1 only for the f16 gate_up (x16 operand), where the
  # one-token slots are the M = 1 path's programs on the f16 K step
  token = route is not None and slot_rows == "token" and (m > 1 or bool(gate_up_f16))
  C.check(token_method is None or token,
          f"token_method={token_method!r} needs slot_rows='token' at M > 1 on the routed path")
  # routed slots of one token each: an M = 1 GEMV per slot, on the M = 1 tile method (NVFP4:
  # the CUDA-core decode, ``blocks`` in the tile layout)
  if token:
    token_method = token_method or (NV.default_method(1, layout=layout) if fe == "nvfp4"
                                    else "dot")
    C.check_method(token_method, 1, allowed=C.CUDA_CORE_M1 + ("dot",) if fe == "nvfp4"
                   else ("dot", "reduce"))
  C.check(shared_rows in (None, "all", "token"),
          f"shared_rows must be 'all' or 'token', got {shared_rows!r}")
  shared_rows = shared_rows or default_shared_rows(fe, fs, token, down_shared_cols)
  shared_token = shared_rows == "token"
  C.check(not shared_token or (token and fs == fe and down_shared_cols in (None, 1)),
          "shared_rows='token' needs slot_rows='token' at M > 1 on the routed path, the shared "
          "expert in the experts' format and down_shared_cols None")
  nv_m1 = fe == "nvfp4" and m == 1
  # NVFP4 token mode: the shared expert's M rows on CUDA-core rows tiles too (tensor-core tiles
  # at the NVFP4 M = 1 tiling (bn16, bk1024, 16 warps) made the call 4x slower at M = 2, run 25;
  # BF16's M = 1 tiling is the tensor-core one, where rows spills: 4.4 ms at M = 8, run 28)
  tiling = default_moe_tiling(fe, m, token=token, shared_token=shared_token,
                              f16=bool(gate_up_f16))
  # NVFP4 M = 1: per-block sums (run 84: gate_up 8.77 / down 8.69 us in the step against 9.44 /
  # 8.87 for reduce)
  base_method = (NV.default_method(1, layout=layout) if nv_m1
                 else "rows" if token and fe == "nvfp4" else "dot")
  method_down = method_down or method or tiling.get("method_down", base_method)
  method = method or tiling.get("method", base_method)
  block_n, block_k = block_n or tiling["block_n"], block_k or tiling["block_k"]
  num_warps, num_stages = num_warps or tiling["num_warps"], num_stages or tiling["num_stages"]
  block_n_down = block_n_down or tiling["block_n_down"]
  block_k_down = block_k_down or tiling["block_k_down"]
  num_warps_down = num_warps_down or tiling["num_warps_down"]
  num_stages_down = num_stages_down or tiling["num_stages_down"]
  C.check(down_split or route is None, "the routed path needs down_split=True")
  C.check_method(method, m)
  C.check_method(method_down, m)
  decode = NV.resolve_decode(decode, interpret)
  C.check(layout in NV.LAYOUTS, f"layout must be one of {NV.LAYOUTS}")
  bk = min(block_k, C.pow2_divisor(d, block_k))
  bk_dn = C.pow2_divisor(inter, block_k_down)   # down: K = I (512 for Flint)
  bk_s_dn = C.pow2_divisor(inter_s, block_k_down)
  bn = C.pow2_divisor(min(inter, inter_s), block_n)
  bn_dn = C.pow2_divisor(d, block_n_down)
  for name, v in [("block_n", bn), ("block_n_down", bn_dn)]:
    C.check(v >= 16, f"{name} too small for the dims ({v}): I, I_s and D need 16 | dim")
  if "nvfp4" in (fe, fs):
    C.check(min(bk, bk_dn, bk_s_dn) >= 64 and d % 64 == 0 and inter % 64 == 0,
            "NVFP4 needs D, I, I_s multiples of 64")
  tag = "_routed" if route is not None else ""
  sk = gate_up_split_k or 1
  if sk > 1:
    C.check(fe == fs == "bf16" and not token,
            "gate_up_split_k > 1 needs bf16 experts and shared expert (and not slot_rows='token')")
    C.check(d % sk == 0 and C.is_pow2(sk), f"gate_up_split_k={sk} must be a power of two "
            f"dividing D={d}")
    bk = min(bk, C.pow2_divisor(d // sk, bk))     # whole K steps in every slice
    C.check(bk >= 16, f"gate_up_split_k={sk} leaves K slices of {d // sk} < 16 values")
  finish = sk > 1 and gate_up_counter is not None
  # shared-expert tokens per gate_up program: the largest divisor of M not above the request
  n_tok = 1
  if shared_tokens not in (None, 1):
    C.check(shared_tokens >= 1, f"shared_tokens must be >= 1, got {shared_tokens}")
    C.check(shared_token and fs == "nvfp4" and token_method == "blocks" and layout == "tile",
            f"shared_tokens={shared_tokens} needs shared_rows='token' with NVFP4 experts on "
            f"the 'blocks' tiles (tile layout), got shared_rows={shared_rows!r}, {fs=}, "
            f"{token_method=}, {layout=}")
    n_tok = max(t for t in range(1, min(shared_tokens, m) + 1) if m % t == 0)
  n_prog = u * (inter // bn) + (inter_s // bn) * (m // n_tok if shared_token else 1)
  x16 = bool(gate_up_f16)
  if x16:
    C.check(token and fe == "nvfp4" and token_method == "blocks" and layout == "tile"
            and n_tok == 1 and d % 64 == 0,
            f"gate_up_f16 needs NVFP4 experts on per-token slots (slot_rows='token') with "
            f"token_method 'blocks' in the tile layout and shared_tokens 1, got {fe=}, "
            f"{token=}, {token_method=}, {layout=}, shared_tokens={n_tok}")
  C.check(not x16 or interpret or decode == "asm",
          f"gate_up_f16 compiled for the GPU needs decode='asm' (the f16 K step's jnp form is "
          f"for interpret mode), got {decode=}")
  h16 = bool(down_f16)
  C.check(not h16 or (x16 and shared_token and inter % 64 == 0 and inter_s % 64 == 0),
          "down_f16 needs gate_up_f16 and shared_rows='token' (the per-token shared expert)")
  C.check(x16_rows is None or (x16 and x16_rows[0].shape == (m, d)
                               and x16_rows[0].dtype == jnp.float16
                               and x16_rows[1].shape == (m,)
                               and x16_rows[1].dtype == jnp.float32),
          "x16_rows must be (x16 [M, D] f16, inv [M] f32) from nvfp4_gemv.x16_operand(x) "
          "(or add_rms_norm(x16=True)), with gate_up_f16")
  if gate_up_counter is not None:
    C.check(sk > 1, "gate_up_counter is only for gate_up_split_k > 1")
    C.check(gate_up_counter.dtype == jnp.int32 and gate_up_counter.ndim == 1
            and gate_up_counter.shape[0] >= n_prog,
            f"gate_up_counter must be int32 zeros [>= {n_prog}] (the gate_up programs), got "
            f"{gate_up_counter.shape} {gate_up_counter.dtype}")

  # ---- kernel 1: gate_up (+ shared gate/up)
  names = ["x", "x5"] + route_names
  args = [x, NV.x_view(x) if d % 64 == 0 else x] + route_args
  if token:
    xt = x.reshape(m, 1, d)
    names += ["xt", "xt5"]
    if x16:    # f16 one-token rows (scaled per row) for the f16 products, and their factors
      x16_x, x_inv = NV.x16_operand(x) if x16_rows is None else x16_rows
      args += [xt, NV.x_view(x16_x.reshape(m, 1, d))]
      names += ["xinv"]
      args += [x_inv]
    else:
      args += [xt, NV.x_view(xt) if d % 64 == 0 else xt]
  if fe == "bf16":
    names += ["gu_w"]
    args += [experts["gate_up_proj"]]
  else:
    names += ["gu_q", "gu_s", "gu_s2"]
    args += _weight_args(fe, (experts["gate_up_qweight"], experts["gate_up_weight_scale"]), "")
    args += [experts["gate_up_weight_scale_2"].astype(jnp.float32)]
  if fs == "bf16":
    names += ["sg_w", "su_w"]
    args += [shared["gate_proj"], shared["up_proj"]]
  else:
    names += ["sg_q", "sg_s", "su_q", "su_s", "sg_s2", "su_s2"]
    args += _weight_args(fs, shared["gate_proj"], "") + _weight_args(fs, shared["up_proj"], "")
    args += [C.scalar_f32(shared["gate_proj"][2]), C.scalar_f32(shared["up_proj"][2])]
  if sk == 1 and h16:    # the down kernel's f16 operands and their per-block factors
    h_out = {"h16": jax.ShapeDtypeStruct((u, 1, inter), jnp.float16),
             "hinv": jax.ShapeDtypeStruct((u, 1, inter // 16), jnp.float32)}
    hs_out = {"hs16": jax.ShapeDtypeStruct((m, 1, inter_s), jnp.float16),
              "hsinv": jax.ShapeDtypeStruct((m, 1, inter_s // 16), jnp.float32)}
  elif sk == 1:
    h_out = {"h": jax.ShapeDtypeStruct((u, 1 if token else m, inter), x.dtype)}
    hs_out = {"hs": jax.ShapeDtypeStruct((m, 1, inter_s) if shared_token else (m, inter_s),
                                         x.dtype)}
  if sk == 1:
    in_names, in_args = list(names), list(args)
    names += [*h_out, *hs_out]
    out_shape = [*h_out.values(), *hs_out.values()]
  else:      # fp32 partial g and u per K slice (finish: then h itself, and the counter)
    names += ["hg", "hu", "hsg", "hsu"]
    out_shape = [jax.ShapeDtypeStruct((sk, u, m, inter), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((sk, m, inter_s), jnp.float32)] * 2
    if finish:
      names += ["h", "hs"]
      out_shape += [jax.ShapeDtypeStruct((u, m, inter), x.dtype),
                    jax.ShapeDtypeStruct((m, inter_s), x.dtype)]
  if route is not None:
    top_k = route[0]
    C.check(u == m * top_k, f"routed: {u=} slots != M * top_k = {m * top_k}")
  if route is not None and route_given is None:
    names += ["route_ids", "route_logits"]
    out_shape += [jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                  jax.ShapeDtypeStruct((m, top_k), jnp.float32)]
  aliases = {}
  if finish:   # the counter: an input aliased to the last output
    names.insert(len(args), "counter")
    aliases = {len(args): len(out_shape)}
    args.append(gate_up_counter)
    names.append("counter_out")
    out_shape.append(jax.ShapeDtypeStruct(gate_up_counter.shape, jnp.int32))
  gu_kw = dict(m=m, mp=C.pad_rows(m, method), inter=inter, inter_s=inter_s, bn=bn, bk=bk,
               bk_s=bk, d=d, fe=fe, fs=fs, n_slots_max=u, decode=decode, layout=layout,
               method=method, route=route, token_method=token_method, split_k=sk,
               finish=finish, shared_first=shared_first, shared_token=shared_token,
               shared_tokens=n_tok, x16=x16, h16=h16, codes_ahead=bool(codes_ahead),
               interpret=interpret)
  tag += ("_token" if token else "") + ("_shtok" if shared_token else "")
  tag += f"{n_tok}" if n_tok > 1 else ""
  suffix = f"{'_x16' if x16 else ''}_{fe}_{fs}_{method}_bn{bn}_bk{bk}"
  down_parts = 1 if finish else sk  # the down kernel reads h (or h finished) or the partials
  if shared_with_topk:
    C.check(route is not None and route_given is None and route_names == ["logits"]
            and token and shared_token and sk == 1 and n_tok == 1,
            "shared_with_topk needs the routed path with per-token slots and the shared expert "
            "per token (slot_rows and shared_rows 'token'), the routing computed here (no "
            "route given, prerouted not False), shared_tokens 1 and gate_up_split_k 1")
    route_out, h_parts = _launch_topk_shared_then_routed(
        in_names, in_args, h_out, hs_out, gu_kw, m=m, u=u, n_i=inter // bn,
        n_shared=(inter_s // bn) * m, num_warps=num_warps, num_stages=num_stages,
        tag=tag, suffix=suffix, interpret=interpret)
    counter_out = None
  else:
    with _f16_sums_for(bn, bk, num_warps, x16):   # the kernel body is traced inside the call
      res = C.pallas_call(
          functools.partial(_gate_up_kernel, names=names, **gu_kw),
          grid=(n_prog, sk) if sk > 1 else (n_prog,), out_shape=tuple(out_shape),
          input_output_aliases=aliases,
          compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
          name=f"flint_moe_gate_up{tag}{suffix}"
               + (f"_splitk{sk}" if sk > 1 else "") + ("_finish" if finish else ""),
      )(*args)
    res = list(res)
    counter_out = res.pop() if finish else None
    n_h = len(out_shape) - (2 if route is not None and route_given is None else 0) - finish
    route_out = (route_given if route_given is not None
                 else None if route is None else MoERoute(*res[n_h:]))
    # (h16: h, its factors, hs, its factors)
    h_parts = res[n_h - 4:n_h] if h16 else res[n_h - 2:n_h] if down_parts == 1 else res[:4]

  # ---- kernel 2: down (+ routing-weighted combine unless split) + shared down
  # The shared expert's K (I_s) is longer than a routed one's (I): its columns may be cut over
  # several programs so that they end with the routed ones (measured no faster: run 58).
  down_shared_cols = down_shared_cols or 1
  C.check(down_shared_cols == 1 or (down_split and C.is_pow2(down_shared_cols)
                                    and bn_dn // down_shared_cols >= 16),
          f"down_shared_cols={down_shared_cols} needs the split down kernel and "
          f"block_n_down / down_shared_cols >= 16 (block_n_down={bn_dn})")
  if route is None:
    dn_names, dn_args = route_names, route_args
  else:   # the gate_up kernel's routing: no top-k here
    dn_names, dn_args = ["route_ids"], [route_out.ids]
  if h16:
    h, h_inv, hs, hs_inv = h_parts
    names = ["h", "h5", "hs", "hs5", "hinv5", "hsinv5"]
    args = [h, NV.x_view(h), hs, NV.x_view(hs), h_inv.reshape(u, 1, inter // 64, 2, 2),
            hs_inv.reshape(m, 1, inter_s // 64, 2, 2)]
  elif down_parts == 1:
    h, hs = h_parts
    names = ["h", "h5", "hs", "hs5"]
    args = [h, NV.x_view(h) if inter % 64 == 0 else h, hs,
            NV.x_view(hs) if inter_s % 64 == 0 else hs]
  else:
    names, args = ["hg", "hu", "hsg", "hsu"], list(h_parts)
  names += dn_names + (["coef"] if coef is not None else [])
  args += dn_args
  args += [coef] if coef is not None else []
  if fe == "bf16":
    names += ["dn_w"]
    args += [experts["down_proj"]]
  else:
    names += ["dn_q", "dn_s", "dn_s2"]
    args += _weight_args(fe, (experts["down_qweight"], experts["down_weight_scale"]), "")
    args += [experts["down_weight_scale_2"].astype(jnp.float32)]
  if fs == "bf16":
    names += ["sd_w"]
    args += [shared["down_proj"]]
  else:
    names += ["sd_q", "sd_s", "sd_s2"]
    args += _weight_args(fs, shared["down_proj"], "") + [C.scalar_f32(shared["down_proj"][2])]
  combine_kw = None
  if combine is not None:   # (h, w_next, counter, base, eps, norm, x16): the combine in the
    c_h, c_w, c_counter, c_base, c_eps, c_norm, c_x16 = combine      # last program(s)
    C.check(c_norm or not c_x16, "combine: the x16 operand is of the normalised row (norm=True)")
    n_blocks = d // bn_dn
    C.check(route is not None and down_split, "the combine needs the routed, split down kernel")
    C.check(c_h.shape == (m, d) and c_h.dtype == x.dtype and c_w.shape == (d,),
            f"combine: h must be [{m}, {d}] {x.dtype} and w_next [{d}], got {c_h.shape} "
            f"{c_h.dtype} / {c_w.shape}")
    per_token = not c_norm and m > 1 and token_method is not None and shared_token
    n_entries = n_blocks * (m if per_token else 1)
    C.check(c_counter.dtype == jnp.int32 and c_counter.ndim == 1
            and 0 <= c_base and c_base + 1 + n_entries <= c_counter.shape[0],
            f"combine: the counter must be int32 zeros with entries {c_base} .. "
            f"{c_base + n_entries} (got shape {c_counter.shape} {c_counter.dtype})")
    names += ["cmb_logits", "cmb_h", "cmb_w", "cmb_counter"]
    args += [route_out.logits, c_h, c_w, c_counter]
    combine_kw = dict(top_k=route[0], base=c_base, eps=c_eps, dp=C.next_pow2(d), bn=bn_dn,
                      norm=c_norm, per_token=per_token, x16=c_x16)
  names += ["out"]
  if combine is not None:
    names += ["cmb_s", "cmb_x" if c_norm else "cmb_ss", "cmb_counter_out"]
    names += ["cmb_x16", "cmb_xinv"] if c_x16 else []
  kernel = functools.partial(
      _down_kernel, names=names, m=m, mp=C.pad_rows(m, method_down), inter=inter,
      inter_s=inter_s, bn=bn_dn, bk=bk_dn, bk_s=bk_s_dn, n_slots_max=u, fe=fe, fs=fs,
      decode=decode, layout=layout,
      unroll=(u <= _UNROLL_SLOTS) if unroll_slots is None else unroll_slots,
      method=method_down, split=down_split, route_top_k=None if route is None else route[0],
      token_method=token_method, gu_split_k=down_parts, shared_cols=down_shared_cols,
      combine=combine_kw, shared_first=shared_first and down_split, shared_token=shared_token,
      h16=h16, interpret=interpret)
  if down_split:
    out_shape = [jax.ShapeDtypeStruct(((u + 1) * m, d), x.dtype)]
    aliases = {}
    if combine is not None:
      out_shape += [jax.ShapeDtypeStruct((m, d), x.dtype),
                    jax.ShapeDtypeStruct((m, d), x.dtype) if c_norm else
                    jax.ShapeDtypeStruct((m, d // bn_dn), jnp.float32),
                    jax.ShapeDtypeStruct(c_counter.shape, jnp.int32)]
      if c_x16:
        out_shape += [jax.ShapeDtypeStruct((m, d), jnp.float16),
                      jax.ShapeDtypeStruct((m,), jnp.float32)]
      aliases = {len(args) - 1: 3}     # the counter, in place
    # the down kernel's body is traced inside this call: ``asm_down`` picks its decode sequence
    with NV.asm_decode(asm_down or NV.asm_decode.value), \
        _f16_sums_for(bn_dn, min(bk_dn, bk_s_dn), num_warps_down, h16):
      res = C.pallas_call(
          kernel, grid=(d // bn_dn, u + (m if shared_token else down_shared_cols)),
          out_shape=tuple(out_shape),
          input_output_aliases=aliases,
          compiler_params=C.compiler_params(num_warps_down, num_stages_down), interpret=interpret,
          name=(f"flint_moe_down_split{tag}{'_h16' if h16 else ''}_{fe}_{fs}_{method_down}_bn{bn_dn}"
                f"{f'_sc{down_shared_cols}' if down_shared_cols > 1 else ''}"
                f"{'' if combine is None else '_combine' if c_norm else '_residual'}"
                f"{'_x16' if combine is not None and c_x16 else ''}"),
      )(*args)
    y = res[0].reshape(u + 1, m, d)
    if combine is not None:
      return (y, *res[1:]), route_out, counter_out
    return y, route_out, counter_out
  return C.pallas_call(
      kernel, grid=(d // bn_dn,), out_shape=jax.ShapeDtypeStruct((m, d), x.dtype),
      compiler_params=C.compiler_params(num_warps_down, num_stages_down), interpret=interpret,
      name=f"flint_moe_down_combine_{fe}_{fs}_{method_down}_bn{bn_dn}",
  )(*args), None, counter_out


@functools.partial(jax.jit, static_argnames=("dedupe", "down_split") + _TUNING)
def moe_decode(x, ids, weights, experts, shared, *, dedupe: bool | None = None,
               block_n: int | None = None, block_k: int | None = None,
               block_n_down: int | None = None,
               decode: str = "asm", layout: str = "tile", unroll_slots: bool | None = None,
               method: str | None = None, method_down: str | None = None,
               down_split: bool = True, num_warps: int | None = None,
               num_stages: int | None = None,
               block_k_down: int | None = None, num_warps_down: int | None = None,
               num_stages_down: int | None = None, gate_up_split_k: int | None = None,
               down_shared_cols: int | None = None, codes_ahead: bool | None = None,
               interpret: bool = False):
  """out [M, D] = sum_k w_k expert_{ids_k}(x) + shared(x); see the module docstring.

  ``unroll_slots`` (default: when M * top_k <= 12) unrolls the down kernel's loop over slots in
  Python so the compiler can issue every slot's weight loads before the first dot; otherwise a
  ``fori_loop`` runs up to the number of (distinct) slots. ``method`` / ``method_down``: the tile
  method of each kernel (``_common.mm_tile``). ``down_split``: one program per (column block,
  slot) writing bf16 expert outputs, combined by one XLA fusion, instead of one program per
  column block looping over the slots. ``gate_up_split_k`` (bf16 weights; None = 1): the
  gate_up kernel's K (= D) in that many slices, each a program writing fp32 partial g / u (S x
  the programs: Flint's M = 1 gate_up has only 64 of them for 132 SMs); the down kernel sums
  them and applies bf16(silu(g) * u) as it loads each h tile. H200, Flint, M = 1 (run 44):
  gate_up 11.7 us at S = 2 against 13.5, but the down kernel 17.8 against 7.6 (each of its
  programs rebuilds its slot's h): slower overall, off by default. ``codes_ahead`` (NVFP4
  weights in the tile layout): the gate_up kernel loads each K step's weight tiles one step
  ahead (``_gate_up_kernel``); the same values. None / False = off.
  """
  fe, fs, m, d, _, inter, inter_s = _shapes(x, experts, shared)
  C.check(ids.shape == weights.shape and ids.shape[0] == m,
          f"ids/weights must be [M={m}, k], got {ids.shape=} {weights.shape=}")
  if dedupe is None:
    dedupe = m > 1
  slot_expert, coef, n_slots = moe_slots(ids, weights, dedupe=dedupe)
  u = slot_expert.shape[0]
  out, _, _ = _launch(x, experts, shared, fe, fs, m, d, inter, inter_s, u,
                   ["slot_expert", "n_slots"], [slot_expert, n_slots], route=None,
                   coef=None if down_split else coef, down_split=down_split, block_n=block_n,
                   block_k=block_k, block_n_down=block_n_down, decode=decode, layout=layout,
                   unroll_slots=unroll_slots, method=method, method_down=method_down,
                   num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                   block_k_down=block_k_down, num_warps_down=num_warps_down,
                   num_stages_down=num_stages_down, gate_up_split_k=gate_up_split_k,
                   down_shared_cols=down_shared_cols, codes_ahead=codes_ahead)
  if not down_split:
    return out
  yk = out[:u].astype(jnp.float32)                                      # [U, M, D]
  tot = jnp.sum(jnp.where(coef[..., None] != 0.0, coef[..., None] * yk, 0.0), axis=0)
  return (tot + out[u].astype(jnp.float32)).astype(x.dtype)


def _check_logits(logits, m, n_exp, top_k):
  C.check(logits.shape == (m, n_exp) and logits.dtype == jnp.float32,
          f"logits must be f32 [M={m}, E={n_exp}], got {logits.shape=} {logits.dtype=}")
  C.check(1 <= top_k <= n_exp, f"need 1 <= top_k <= E, got {top_k=} {n_exp=}")


def _route_inputs(logits, top_k, prerouted, interpret, route=None):
  """(route_given, route_names, route_args) of the routed ``_launch``: the logits (top-k in the
  gate_up kernel), or (``prerouted``) the ids of ``route`` when given, else of
  ``moe_topk_route_pallas``."""
  if route is not None:
    m = logits.shape[0]
    C.check(isinstance(route, MoERoute) and route.ids.shape == (m, top_k)
            and route.ids.dtype == jnp.int32 and route.logits.shape == (m, top_k)
            and route.logits.dtype == jnp.float32,
            f"route must be a MoERoute(ids int32 [M={m}, top_k={top_k}], logits f32 [M, top_k])"
            f" (router_logits_topk), got {jax.tree.map(lambda a: (a.shape, a.dtype), route)}")
    return route, ["route_ids_in"], [route.ids]
  if not prerouted:
    return None, ["logits"], [logits]
  given = moe_topk_route_pallas(logits, top_k=top_k, interpret=interpret)
  return given, ["route_ids_in"], [given.ids]


def _check_top_logits(top_logits, m) -> int:
  """Checks the selected logits [M, top_k] f32 (``MoERoute.logits``); returns top_k."""
  C.check(top_logits.ndim == 2 and top_logits.shape[0] == m and top_logits.shape[1] >= 1
          and top_logits.dtype == jnp.float32,
          f"top_logits must be the selected router logits f32 [M={m}, top_k] (MoERoute.logits), "
          f"got {top_logits.shape=} {top_logits.dtype=}")
  return top_logits.shape[1]


_ROUTED_KNOBS = ("top_k", "slot_rows", "token_method", "asm_down", "prerouted", "shared_first",
                 "shared_rows", "shared_tokens", "gate_up_f16", "down_f16", "shared_with_topk")


def _launch_routed(x, logits, experts, shared, options, **extra):
  """``_launch`` for ``moe_decode_routed`` / ``_combine``: ``options`` are the entry point's
  arguments (its ``locals()``); the routing knobs resolved here (``_routed_defaults``, the
  routing inputs), the tuning knobs passed through, ``extra`` added (the combine)."""
  opts = {k: v for k, v in options.items()
          if k in _ROUTED_KNOBS + _TUNING + ("gate_up_counter", "x16_rows")}
  top_k = opts.pop("top_k")
  fe, fs, m, d, n_exp, inter, inter_s = _shapes(x, experts, shared)
  _check_logits(logits, m, n_exp, top_k)
  route = options["route"]      # the routing given: prerouted by definition
  C.check(route is None or opts["prerouted"] is not False,
          "route given with prerouted=False: leave prerouted None")
  opts["slot_rows"], prerouted, opts["shared_first"] = _routed_defaults(
      fe, m, opts["slot_rows"], opts.pop("prerouted"), opts["shared_first"],
      opts["gate_up_split_k"])
  if opts["shared_with_topk"]:   # the top-k runs in the shared expert's launch (``_launch``)
    C.check(route is None and prerouted is not False,
            "shared_with_topk computes the routing itself: no route given, prerouted not False")
    given, r_names, r_args = None, ["logits"], [logits]
  else:
    given, r_names, r_args = _route_inputs(logits, top_k, prerouted, opts["interpret"], route)
  return _launch(x, experts, shared, fe, fs, m, d, inter, inter_s, m * top_k, r_names, r_args,
                 route=(top_k, n_exp, C.next_pow2(n_exp)), route_given=given, coef=None,
                 down_split=True, **opts, **extra)


@functools.partial(jax.jit, static_argnames=_ROUTED_KNOBS + _TUNING)
def moe_decode_routed(x, logits, experts, shared, *, top_k: int = 6, slot_rows: str | None = None,
                      token_method: str | None = None,
                      block_n: int | None = None, block_k: int | None = None,
                      block_n_down: int | None = None,
                      decode: str = "asm", layout: str = "tile",
                      unroll_slots: bool | None = None, method: str | None = None,
                      method_down: str | None = None, num_warps: int | None = None,
                      num_stages: int | None = None,
                      block_k_down: int | None = None, num_warps_down: int | None = None,
                      num_stages_down: int | None = None, gate_up_split_k: int | None = None,
                      gate_up_counter=None,
                      down_shared_cols: int | None = None, asm_down: str | None = None,
                      prerouted: bool | None = None, shared_first: bool | None = None,
                      shared_rows: str | None = None, route: MoERoute | None = None,
                      shared_tokens: int | None = None,
                      gate_up_f16: bool | None = None, x16_rows=None,
                      down_f16: bool | None = None, shared_with_topk: bool | None = None,
                      codes_ahead: bool | None = None, interpret: bool = False):
  """(y, route): expert outputs routed *inside* the kernels (2 pallas_calls; 3 with ``prerouted``,
  the default for NVFP4 experts at M > 1) and the routing.

  logits: router logits f32 [M, E] (``moe_router_logits``). Slot u = t * top_k + j is token t's
  j-th expert in ``lax.top_k`` order (no de-duplication). The gate_up kernel computes each
  slot's expert id from logits row t (``_topk_logits``) and stores the routing; the down kernel
  reads the stored ids. Returns
    y [M * top_k + 1, M, D] bf16: y[t * top_k + j, t] = bf16(expert_{ids[t, j]}(x[t])) (what
      the combine uses); y[M * top_k] = the shared expert's output (all M rows). The other rows
      y[u, t'], t' != u // top_k, are token t''s output through slot u's expert with
      ``slot_rows="all"`` and undefined (never written) with ``"token"``.
    route: ``MoERoute(ids [M, top_k] int32, logits [M, top_k] f32)``, equal to
      ``moe_topk_route(logits, top_k=top_k)`` (ties by lowest index); pass ``route.logits`` to
      ``moe_combine_add_rms_norm`` / ``norm_qkv``.
  ``slot_rows`` (M > 1): ``"all"`` multiplies every slot's expert with all M tokens
  (tensor-core tiles); ``"token"`` only with the slot's own token, as M * top_k GEMVs at M = 1
  with the M = 1 tiling (NVFP4: the CUDA-core decode; the shared expert see ``shared_rows``).
  Weight bytes are the same either way. None: the measured choice, ``default_slot_rows`` ("token"
  for NVFP4 experts at M >= 2, "all" otherwise).
  Tuning knobs as ``moe_decode`` (split down kernel only). ``gate_up_counter`` (with
  ``gate_up_split_k`` > 1): int32 zeros [>= the gate_up kernel's programs]; the gate_up kernel
  then finishes h itself (the last K slice of each tile sums the partials) and the down kernel
  loads h as usual; returns (y, route, counter), the counter zeroed again for the next call.
  ``down_shared_cols``: the shared expert's down columns of each block cut over this many
  programs (its K is I_s / I times a routed expert's), each >= 16 columns wide; None = 1 (2
  measured no faster in the step, H200 run 58).
  ``token_method`` (``slot_rows="token"`` only): the routed slots' M = 1 tile method; None = the
  M = 1 default (NVFP4: ``blocks`` in the tile layout, ``reduce`` before session 15; BF16:
  ``dot``).
  ``asm_down``: the down kernel's NVFP4 ``asm`` decode sequence (``nvfp4_gemv.asm_decode``:
  "mul", "post", ...); None = the one in effect (the gate_up kernel always uses that one).
  H200 run 91, batch 1: "post" down 8.39 us against 8.65 with "mul", while gate_up is slower
  with "post" (9.10 against 8.77), hence the separate knob.
  ``prerouted``: the routing computed once per token by ``moe_topk_route_pallas`` (one more
  kernel) instead of in every gate_up program (12 cross-warp reductions before its first weight
  load: under 1 us at M = 1, but paid by every one of the token mode's 1600 programs at
  M = 8); the outputs are the same. ``shared_first``: the shared expert's programs are launched
  first in both kernels (at M > 1 on ``rows`` tiles they are the longest and would otherwise end
  last). None (both): on with per-token slots at M > 1 (``_routed_defaults``; H200 run 99, NVFP4
  M = 8 token mode: 185 us, 172 with the routing given, 139 with the shared expert first, 123
  with both). ``shared_rows`` (with ``slot_rows="token"``, the shared expert in the experts'
  format): "all" / None = one program per row block for all M tokens (``rows`` tiles for NVFP4);
  "token" = one program per (token, row block) on the routed slots' M = 1 tiles, the shared
  weights read M times (from the L2 after the first). Why: the ``rows`` tile at M = 8 keeps
  [M, BN, BK] products and gives both kernels a 6.6 KB stack frame per thread (the gate_up) or
  137 registers (the down kernel); the M = 1 tiles need neither (``tools/triton_sass.py``).
  None: ``default_shared_rows`` ("token" with per-token slots when both are NVFP4; H200 run 102,
  both kernels at M = 8: 77.4 us against 107.7 with "all").
  ``route``: the routing already computed (``router.router_logits_topk``: the router kernel's
  last program runs the top-k of these logits); the kernels take its ids as with ``prerouted``
  (which must not be False) and return it; no top-k kernel of their own.
  ``shared_tokens`` (with ``shared_rows="token"`` on NVFP4 ``blocks`` tiles): each shared-expert
  gate_up program takes this many tokens (the largest divisor of M not above it) for its row
  block: the weight tile is decoded once per K step and its per-block sums formed for each
  token (``nvfp4_gemv.blocks_tile_dot_tokens``), so the shared weights are decoded M / T
  times instead of M times. None / 1 = one token per program. Same values (the same products
  and sums per token).
  ``gate_up_f16`` (per-token NVFP4 slots on ``blocks`` tiles, ``slot_rows="token"``; at M = 1
  too, where it makes the one-token slots the M = 1 path): the gate_up kernel multiplies in
  f16x2 (``nvfp4_gemv.blocks_fma_f16``: about 3.4 instructions per weight instead of 4.8, 2.7
  with ``f16_sums`` "block") against x scaled per row into f16 (``nvfp4_gemv.x16_operand``);
  the products are summed in f16 (pairs, or whole 16-value blocks: ``nvfp4_gemv.f16_sums``)
  before the f32 block sums, so h differs from the default's within bf16 rounding. None /
  False = off. ``x16_rows``: that operand already
  computed, ``(x16, inv) = nvfp4_gemv.x16_operand(x)`` (e.g. by ``add_rms_norm(x16=True)``, the
  kernel that wrote x); None = an XLA op here (three small kernels on the H200).
  ``down_f16`` (with ``gate_up_f16`` and ``shared_rows="token"``): the down kernel multiplies in
  f16x2 too: the gate_up kernel writes bf16(h) as f16 with one scale per 16 values
  (``nvfp4_gemv.store_x16_blocks``) instead of h. None / False = off.
  ``shared_with_topk`` (per-token slots with the shared expert per token, the routing not
  given): the shared expert's gate_up programs leave the gate_up kernel for the top-k kernel,
  whose M programs then run beside them (``_launch_topk_shared_then_routed``): the same number
  of launches, the routing's dependent latency under the shared weights' stream, and a gate_up
  kernel of only the routed slots (M * top_k one-token slots; the shared expert was a quarter
  of its programs at M = 8). Same values. None / False = off. H200 run 162, 8x1K: slower,
  4.328 against 4.233 ms (the gate_up 29.6 -> 24.3 us per layer, but the top-k kernel 2.2 ->
  9.8: the shared programs alone are a latency chain, hidden beside the routed ones before).
  ``codes_ahead``: see ``moe_decode``.
  """
  options = locals()    # first statement: exactly the arguments
  y, route_out, counter = _launch_routed(x, logits, experts, shared, options)
  return (y, route_out) if gate_up_counter is None else (y, route_out, counter)


@functools.partial(jax.jit,
                   static_argnames=("counter_base", "eps", "norm", "x16_next") + _ROUTED_KNOBS
                   + _TUNING)
def moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter, *,
                              counter_base: int, eps: float = 1e-6, norm: bool = True,
                              x16_next: bool = False,
                              top_k: int = 6,
                              slot_rows: str | None = None, token_method: str | None = None,
                              block_n: int | None = None,
                              block_k: int | None = None, block_n_down: int | None = None,
                              decode: str = "asm", layout: str = "tile",
                              unroll_slots: bool | None = None, method: str | None = None,
                              method_down: str | None = None, num_warps: int | None = None,
                              num_stages: int | None = None, block_k_down: int | None = None,
                              num_warps_down: int | None = None,
                              num_stages_down: int | None = None,
                              gate_up_split_k: int | None = None,
                              down_shared_cols: int | None = None,
                              asm_down: str | None = None, prerouted: bool | None = None,
                              shared_first: bool | None = None, shared_rows: str | None = None,
                              route: MoERoute | None = None,
                              shared_tokens: int | None = None,
                              gate_up_f16: bool | None = None, x16_rows=None,
                              down_f16: bool | None = None,
                              shared_with_topk: bool | None = None,
                              codes_ahead: bool | None = None, interpret: bool = False):
  """``moe_decode_routed`` then ``moe_combine_add_rms_norm(h, y, route.logits, w_next)`` in 2
  launches instead of 3: the down kernel's last program does the combine (``_down_kernel``'s
  ``combine``). Returns ``(s, x_next, route, counter)``: s = bf16(h + moe) [M, D], x_next its
  RMSNorm times w_next [M, D], the routing, and ``counter`` (int32 [>= counter_base + 1 +
  D / block_n_down], whose entries counter_base .. counter_base + D / block_n_down must be zero
  on entry) with those entries back at zero. The outputs equal the 3-launch composition's (same
  formulas, same rounding points; the y rows the combine reads are the same values).

  ``norm=False``: no RMSNorm and no second counter level. The last program of each column block
  writes that block's s and its fp32 sum of squares; returns ``(s, sumsq, route, counter)``,
  sumsq f32 [M, D / block_n_down] (``sumsq[t, b] = sum over block b's columns of f32(s[t])^2``),
  for a consumer that normalises as it loads (``multi_gemv(s, ..., rms_sumsq=sumsq,
  rms_weight=w_next)``). s is the same either way; w_next is not read.

  ``x16_next`` (with ``norm``): also x_next's f16 operand, ``nvfp4_gemv.x16_operand(x_next)``
  (x16 [M, D] f16, inv [M] f32), from the same program (e.g. for the LM head's
  ``nvfp4_gemv(x16, ..., x_inv=inv)``); returns ``(s, x_next, route, counter, (x16, inv))``."""
  options = locals()    # first statement: exactly the arguments
  options.pop("norm")
  C.check(norm or not x16_next, "x16_next is the normalised row's operand: needs norm=True")
  (_, s_out, x_out, counter, *x16_rows), route_out, _ = _launch_routed(
      x, logits, experts, shared, options,
      combine=(h, w_next, counter, counter_base, eps, norm, x16_next))
  if x16_next:
    return s_out, x_out, route_out, counter, tuple(x16_rows)
  return s_out, x_out, route_out, counter


def _combine_add_rms_norm_kernel(y_ref, l_ref, h_ref, w_ref, s_ref, o_ref, *, top_k, u, d, dp,
                                 eps):
  _combine_add_rms_norm_row(y_ref, l_ref, h_ref, w_ref, s_ref, o_ref, pl.program_id(0),
                            top_k=top_k, u=u, d=d, dp=dp, eps=eps)


def _combine_add_rms_norm_row(y_ref, l_ref, h_ref, w_ref, s_ref, o_ref, t, *, top_k, u, d, dp,
                              eps):
  """Token t of ``moe_combine_add_rms_norm`` (also a producer of ``layer_end_qkv``)."""
  def y_row(slot, cols, mask):
    return plgpu.load(y_ref.at[slot, t, cols], mask=mask, other=0)

  _combine_row(y_row, l_ref, h_ref, w_ref, s_ref, o_ref, t, top_k=top_k, u=u, d=d, dp=dp,
               eps=eps)


def _combine_s(y_row, l_ref, h_ref, t, cols, mask, *, top_k, u, dtype):
  """s = bf16(h + moe) of token t at columns ``cols`` (``mask``: the real ones, the others 0;
  None: all real);
  ``y_row(slot, cols, mask)`` loads y[slot, t] (slot t * top_k + j: the token's j-th expert;
  slot u: the shared expert)."""
  # the selected logits, top-k order (scalar loads: stored by the gate_up kernel)
  sig = [jax.nn.sigmoid(l_ref[t, j]) for j in range(top_k)]
  den = sig[0]
  for sj in sig[1:]:
    den = den + sj
  tot = jnp.zeros(cols.shape, jnp.float32)
  for j, sj in enumerate(sig):                                          # top-k order
    tot = tot + (sj / den) * y_row(t * top_k + j, cols, mask).astype(jnp.float32)
  ys = y_row(u, cols, mask)
  moe = (tot + ys.astype(jnp.float32)).astype(ys.dtype)                 # rounded as y is
  h = plgpu.load(h_ref.at[t, cols], mask=mask, other=None if mask is None else 0)
  return (h.astype(jnp.float32) + moe.astype(jnp.float32)).astype(dtype)


def _combine_row(y_row, l_ref, h_ref, w_ref, s_ref, o_ref, t, *, top_k, u, d, dp, eps,
                 x16_refs=()):
  """The combine + residual add + RMSNorm of token t (``_combine_s``, then ``add_rms_norm``'s
  normalisation); ``x16_refs``: (x16 [M, D] f16, inv [M] f32), the normalised row's
  ``x16_operand`` (as ``add_rms_norm(x16=True)`` writes it)."""
  cols = jnp.arange(dp, dtype=jnp.int32)
  mask = cols < d
  s = _combine_s(y_row, l_ref, h_ref, t, cols, mask, top_k=top_k, u=u, dtype=s_ref.dtype)
  w = plgpu.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
  out = ARN._normalize(s.astype(jnp.float32), w, d, eps)
  plgpu.store(s_ref.at[t, cols], s, mask=mask)
  out = out.astype(o_ref.dtype)
  plgpu.store(o_ref.at[t, cols], out, mask=mask)
  if x16_refs:
    ARN._store_x16(*x16_refs, t, out, cols, mask)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def moe_combine_add_rms_norm(h, y, top_logits, w_norm, *, eps: float = 1e-6,
                             num_warps: int | None = None, interpret: bool = False):
  """(s, x_next): MoE combine + residual add + RMSNorm in one pallas_call (grid (M,)).

  h [M, D] residual (bf16), y [M * top_k + 1, M, D] and top_logits [M, top_k] f32 (its
  ``route.logits``: the selected router logits in top-k order) from ``moe_decode_routed``,
  w_norm [D] (the next block's norm weight); top_k is top_logits.shape[1]. Per token t, with
  l_j = top_logits[t, j] and w_j = sigmoid(l_j) / sum_j sigmoid(l_j) in fp32 (the sigmoids added
  in top-k order):
    moe  = bf16(sum_j w_j f32(y[t * top_k + j, t]) + f32(y[-1, t]))   (fp32, top-k order)
    s    = bf16(h + moe)                         (``add_rms_norm``'s rules from here on)
    x_next = bf16(w_norm * (f32(s) * rsqrt(mean(f32(s)^2) + eps)))
  """
  C.check(h.ndim == 2, f"h must be [M, D], got {h.shape=}")
  m, d = h.shape
  top_k = _check_top_logits(top_logits, m)
  u = m * top_k
  C.check(y.shape == (u + 1, m, d) and y.dtype == h.dtype,
          f"y must be [{u + 1}, {m}, {d}] {h.dtype}, got {y.shape=} {y.dtype=}")
  C.check(w_norm.shape == (d,), f"w_norm must be [D={d}], got {w_norm.shape=}")
  dp = C.next_pow2(d)
  kernel = functools.partial(_combine_add_rms_norm_kernel, top_k=top_k, u=u, d=d, dp=dp, eps=eps)
  out_shape = (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, h.dtype))
  return C.pallas_call(
      kernel, out_shape=out_shape, grid=(m,),
      compiler_params=C.compiler_params(num_warps or ARN._num_warps(dp), 1),
      interpret=interpret, name=f"flint_moe_combine_add_rms_norm_d{d}_k{top_k}",
  )(y, top_logits, h, w_norm)


def moe_block_add_rms_norm(x, h, router_w, experts, shared, w_norm, *, top_k: int = 6,
                           eps: float = 1e-6, interpret: bool = False, **tuning):
  """(s, x_next) = add_rms_norm(h, moe_block(x, ...), w_norm) in 4 launches: the router dot (XLA),
  gate_up and down (``moe_decode_routed``), ``moe_combine_add_rms_norm`` (on the routing the
  gate_up kernel stored)."""
  logits = moe_router_logits(x, router_w)
  y, route = moe_decode_routed(x, logits, experts, shared, top_k=top_k, interpret=interpret,
                               **tuning)
  return moe_combine_add_rms_norm(h, y, route.logits, w_norm, eps=eps, interpret=interpret)


# ------------------------------------------------------------------------------------------
# Reference


def _ref_linear(x, w, fmt):
  """fp32 x . W^T (times scale_2 for NVFP4); w: bf16 [N, K] or (q, s, s2)."""
  if fmt == "bf16":
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)
  return NV.nvfp4_gemv_reference(x, *w, out_dtype=jnp.float32)


def _selected_experts(experts, ids, fe):
  """Dense weights of the experts ``ids`` (any int shape S): gate_up [*S, 2I, D], down
  [*S, D, I] (NVFP4 decoded exactly) and their fp32 tensor scales [*S, 2], [*S] (ones for bf16)."""
  if fe == "bf16":
    one = jnp.ones(ids.shape, jnp.float32)
    return (experts["gate_up_proj"][ids], experts["down_proj"][ids],
            jnp.stack([one, one], axis=-1), one)
  gu = NV.dequantize_nvfp4_reference(experts["gate_up_qweight"][ids],
                                     experts["gate_up_weight_scale"][ids])
  dn = NV.dequantize_nvfp4_reference(experts["down_qweight"][ids],
                                     experts["down_weight_scale"][ids])
  return (gu, dn, experts["gate_up_weight_scale_2"][ids].astype(jnp.float32),
          experts["down_weight_scale_2"][ids].astype(jnp.float32))


def moe_decode_reference(x, ids, weights, experts, shared, **unused_tuning):
  """Plain jnp with the module docstring's rounding: per (token, k) expert in fp32, y_k rounded
  to bf16, then ``bf16(sum_k w_k y_k + y_s)`` summed in top-k order in fp32."""
  del unused_tuning
  return _moe_decode_reference(x, ids, weights, experts, shared)


@jax.jit
def _moe_decode_reference(x, ids, weights, experts, shared):
  fe, fs, m, d, _, inter, _ = _shapes(x, experts, shared)
  dt = x.dtype
  hi = lax.Precision.HIGHEST
  gu, dn, s_gu, s_dn = _selected_experts(experts, ids, fe)           # [M, k, ...]
  g = jnp.einsum("md,mkid->mki", x, gu[:, :, :inter], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[..., 0:1]
  u = jnp.einsum("md,mkid->mki", x, gu[:, :, inter:], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[..., 1:2]
  h = C.silu_mul_f32(g, u).astype(dt)                                  # [M, k, I]
  y = (jnp.einsum("mki,mkdi->mkd", h, dn, preferred_element_type=jnp.float32, precision=hi)
       * s_dn[..., None]).astype(dt)                                   # y_k = bf16(...)
  w = weights.astype(jnp.float32)
  tot = jnp.zeros((m, d), jnp.float32)
  for j in range(ids.shape[1]):                                        # top-k order
    tot = tot + w[:, j:j + 1] * y[:, j].astype(jnp.float32)
  hs = C.silu_mul_f32(_ref_linear(x, shared["gate_proj"], fs),
                      _ref_linear(x, shared["up_proj"], fs)).astype(dt)
  y_s = _ref_linear(hs, shared["down_proj"], fs).astype(dt)
  return (tot + y_s.astype(jnp.float32)).astype(dt)


def moe_block(x, router_w, experts, shared, *, top_k: int = 6, **kw):
  """Routing (XLA) + ``moe_decode`` (Pallas)."""
  ids, w = moe_route(x, router_w, top_k=top_k)
  return moe_decode(x, ids, w, experts, shared, **kw)


def moe_block_reference(x, router_w, experts, shared, *, top_k: int = 6, **unused_tuning):
  ids, w = moe_route(x, router_w, top_k=top_k)
  return moe_decode_reference(x, ids, w, experts, shared)


def moe_topk_route(logits, *, top_k: int = 6) -> MoERoute:
  """``MoERoute`` from router logits f32 [M, E] by ``lax.top_k`` (XLA): the routed kernels'
  contract (the ids and selected logits ``moe_decode_routed`` returns)."""
  top, ids = lax.top_k(logits, top_k)
  return MoERoute(ids.astype(jnp.int32), top)


def _topk_kernel(l_ref, ids_ref, lg_ref, *, top_k, n_exp, ep):
  t = pl.program_id(0)
  for j, (e, lg) in enumerate(_topk_logits(l_ref, t, top_k, n_exp, ep)):
    ids_ref[t, j] = e
    lg_ref[t, j] = lg


@functools.partial(jax.jit, static_argnames=("top_k", "num_warps", "interpret"))
def moe_topk_route_pallas(logits, *, top_k: int = 6, num_warps: int = 1,
                          interpret: bool = False) -> MoERoute:
  """``moe_topk_route`` as one Pallas kernel (one program per token: the gate_up kernel's
  in-kernel top-k, ``_topk_logits``, run once per token): the routing ``moe_decode_routed(
  prerouted=True)`` hands its kernels, in one launch where XLA's top_k takes three.
  logits f32 [M, E] -> ``MoERoute(ids [M, top_k] int32, logits [M, top_k] f32)``, equal to
  ``moe_topk_route``'s (ties: lowest index first)."""
  m, n_exp = logits.shape
  _check_logits(logits, m, n_exp, top_k)
  ids, top = C.pallas_call(
      functools.partial(_topk_kernel, top_k=top_k, n_exp=n_exp, ep=C.next_pow2(n_exp)),
      grid=(m,),
      out_shape=(jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((m, top_k), jnp.float32)),
      compiler_params=C.compiler_params(num_warps, 1), interpret=interpret,
      name=f"flint_moe_topk_e{n_exp}_k{top_k}")(logits)
  return MoERoute(ids, top)


def moe_route_weights(top_logits):
  """Routing weights [M, k] f32 of the selected logits [M, k] f32 (``MoERoute.logits``):
  sigmoid, renormalised to sum 1 (fp32, ``jnp.sum``; the kernels add the k sigmoids in order)."""
  s = jax.nn.sigmoid(top_logits)
  return s / jnp.sum(s, axis=-1, keepdims=True)


def moe_route_from_logits(logits, *, top_k: int = 6):
  """(ids [M, k] int32, weights [M, k] f32) from router logits f32 [M, E]: ``lax.top_k`` of the
  logits (the routed kernels' contract; equals ``moe_route``'s top-k of the sigmoid scores
  unless sigmoid rounds distinct logits to one fp32 value), w = sigmoid / sum (fp32)."""
  ids, top = moe_topk_route(logits, top_k=top_k)
  return ids, moe_route_weights(top)


def moe_decode_routed_reference(x, logits, experts, shared, *, top_k: int = 6,
                                **unused_tuning):
  """Plain jnp (y [M * top_k + 1, M, D], route): y[t * top_k + j, t'] =
  bf16(expert_{ids[t, j]}(x[t'])), route = ``moe_topk_route(logits)``; y[-1] = the shared expert
  (``moe_decode_reference``'s per-expert rounding)."""
  del unused_tuning
  return _moe_decode_routed_reference(x, logits, experts, shared, top_k=top_k)


@functools.partial(jax.jit, static_argnames=("top_k",))
def _moe_decode_routed_reference(x, logits, experts, shared, *, top_k):
  fe, fs, m, d, _, inter, _ = _shapes(x, experts, shared)
  dt = x.dtype
  hi = lax.Precision.HIGHEST
  route = moe_topk_route(logits, top_k=top_k)
  ids = route.ids.reshape(-1)                                         # [U], slot order
  gu, dn, s_gu, s_dn = _selected_experts(experts, ids, fe)           # [U, ...]
  g = jnp.einsum("md,uid->umi", x, gu[:, :inter], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[:, None, 0:1]
  u = jnp.einsum("md,uid->umi", x, gu[:, inter:], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[:, None, 1:2]
  h = C.silu_mul_f32(g, u).astype(dt)                                  # [U, M, I]
  y = (jnp.einsum("umi,udi->umd", h, dn, preferred_element_type=jnp.float32, precision=hi)
       * s_dn[:, None, None]).astype(dt)                               # [U, M, D]
  hs = C.silu_mul_f32(_ref_linear(x, shared["gate_proj"], fs),
                      _ref_linear(x, shared["up_proj"], fs)).astype(dt)
  y_s = _ref_linear(hs, shared["down_proj"], fs).astype(dt)
  return jnp.concatenate([y, y_s[None]], axis=0), route


def moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, *, eps: float = 1e-6,
                                       **unused_tuning):
  """Plain jnp: moe = bf16(sum_j w_j y[t*k+j, t] + y[-1, t]) (fp32, top-k order, weights
  ``moe_route_weights(top_logits)``), then ``add_rms_norm_reference(h, moe, w_norm)``."""
  del unused_tuning
  return _moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def _moe_combine_add_rms_norm_reference(h, y, top_logits, w_norm, *, eps):
  m, d = h.shape
  top_k = _check_top_logits(top_logits, m)
  w = moe_route_weights(top_logits)
  yk = y[:m * top_k].reshape(m, top_k, m, d)[jnp.arange(m), :, jnp.arange(m)]   # [M, k, D]
  tot = jnp.zeros((m, d), jnp.float32)
  for j in range(top_k):                                               # top-k order
    tot = tot + w[:, j:j + 1] * yk[:, j].astype(jnp.float32)
  moe = (tot + y[m * top_k].astype(jnp.float32)).astype(y.dtype)
  return ARN.add_rms_norm_reference(h, moe, w_norm, eps=eps)


def moe_block_add_rms_norm_reference(x, h, router_w, experts, shared, w_norm, *, top_k: int = 6,
                                     eps: float = 1e-6, **unused_tuning):
  """``moe_block_reference`` followed by ``add_rms_norm_reference`` (the old path's contract)."""
  del unused_tuning
  y = moe_block_reference(x, router_w, experts, shared, top_k=top_k)
  return ARN.add_rms_norm_reference(h, y, w_norm, eps=eps)
