"""MoE routing: the router GEMV, the top-k, the routing weights.

Routing contract (fp32 throughout): ``logits = f32(x) . f32(W_router)^T`` [M, E]
(``moe_router_logits``, one XLA dot at precision HIGHEST: the reference); the selected experts
are ``lax.top_k`` of the *logits* (``moe_topk_route``: sigmoid is monotonic, so these are the
experts of the top-k sigmoid scores; the order is the exact logit order, lowest index first among
equal logits); their weights ``w_j = sigmoid(l_j) / sum_j sigmoid(l_j)`` (``moe_route_weights``).

Kernels:

- ``router_logits(x, router_w)``: the router GEMV for M = 1..16 tokens, the decode step's at
  batch > 1 (at batch 1 the router is in ``add_rms_norm_router``). Why a kernel: at batch 8 XLA
  emits a split-K Triton GEMM plus a reduce kernel for this 2 MB fp32 matrix, 7.1 + 1.3 us per
  MoE layer on the H200 (run 51), where the bytes take 0.5 us; the kernel 3.5 us (run 59). Grid
  ``(E / block_e,)``; each program streams ``block_e`` router rows over K = D in ``block_k``
  steps and multiplies them with all M rows of x (padded to a power of two by repeating the
  last row) on the CUDA cores in exact fp32 (``tl.dot`` would round fp32 inputs to TF32). The
  products accumulate lane by lane in ``block_e`` tiles ``[Mp, block_k]``, one per router row,
  each a ``[block_k]`` weight vector broadcast over the rows (FFMAs, no reduction inside the K
  loop), and are summed once at the end; the result differs from XLA's dot only in the fp32
  summation order.
- ``moe_topk_route_pallas(logits)``: the top-k of each token's logits, one program per token
  (``_topk_logits``: repeated max + lowest-index argmax over E padded to a power of two;
  Triton has no top_k / sort). The decode step's MoE runs it once per layer with per-token
  slots at batch > 1 (``MoEPlan.prerouted``); elsewhere every gate_up program computes its
  slot's expert itself (``slot_route``). (Its fusion into the router kernel's last program,
  ``router_logits_topk``, measured slower and was retired after 35c0874: run 107.)

Shapes: x [M, D] (bf16 or f32), router_w [E, D] (fp32, or bf16 upcast); logits f32 [M, E].
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

__all__ = ["MoERoute", "moe_router_logits", "router_logits", "router_logits_reference",
           "moe_topk_route", "moe_topk_route_pallas", "moe_route_weights",
           "moe_route_from_logits", "topk_select", "default_router_blocks"]

MAX_ROWS = 16


# ------------------------------------------------------------------------------------------
# References


def moe_router_logits(x, router_w):
  """Router logits f32 [M, E] = f32(x) . f32(W_router)^T (one XLA dot, precision HIGHEST);
  x [M, D], router_w [E, D] (fp32 or bf16)."""
  return lax.dot_general(x.astype(jnp.float32), router_w.astype(jnp.float32),
                         (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)


def router_logits_reference(x, router_w, **unused_tuning):
  """Plain jnp: ``moe_router_logits`` (one XLA dot at precision HIGHEST)."""
  del unused_tuning
  return moe_router_logits(x, router_w)


class MoERoute(NamedTuple):
  """The routing of the routed path, per token, in ``lax.top_k`` order (descending logit, lowest
  expert id first among equal logits): ``ids`` [M, top_k] int32 the selected experts, ``logits``
  [M, top_k] f32 their router logits (the weights are ``moe_route_weights(logits)``).
  ``moe_decode_routed`` returns the one its kernels used; ``moe_topk_route`` is the XLA
  reference."""
  ids: jax.Array
  logits: jax.Array


def moe_topk_route(logits, *, top_k: int = 6) -> MoERoute:
  """``MoERoute`` from router logits f32 [M, E] by ``lax.top_k`` (XLA): the routed kernels'
  contract (the ids and selected logits ``moe_decode_routed`` returns)."""
  top, ids = lax.top_k(logits, top_k)
  return MoERoute(ids.astype(jnp.int32), top)


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


# ------------------------------------------------------------------------------------------
# The router GEMV


def _router_kernel(x_ref, w_ref, o_ref, *, m, mp, block_e, block_k, d):
  """One program: block_e router rows times all M rows of x."""
  e0 = pl.multiple_of(pl.program_id(0) * block_e, block_e)
  rows = C.row_load_index(m, mp)

  def body(i, accs):
    k0 = pl.multiple_of(i * block_k, block_k)
    x = x_ref[rows, pl.ds(k0, block_k)].astype(jnp.float32)               # [Mp, BK]
    # one router row at a time: a [BK] vector broadcast over the rows (no 3-D layouts)
    return tuple(acc + x * w_ref[e0 + e, pl.ds(k0, block_k)].astype(jnp.float32)[None, :]
                 for e, acc in enumerate(accs))

  zeros = jnp.zeros((mp, block_k), jnp.float32)
  accs = lax.fori_loop(0, d // block_k, body, (zeros,) * block_e)
  r, rmask = C.row_store_index(m, mp)
  for e, acc in enumerate(accs):
    plgpu.store(o_ref.at[r, e0 + e], jnp.sum(acc, axis=1), mask=rmask)      # [Mp]


def default_router_blocks(m: int, n_exp: int, d: int) -> tuple[int, int]:
  """(block_e, block_k): one router row per program (E programs) and an accumulator [Mp,
  block_k] of 8192 fp32 elements (64 registers per thread with 4 warps). H200, E = 256,
  D = 2048, weights warm in the L2 (run 58, ``kernels.py --groups router``): block_e = 1 takes
  1.89 / 2.40 / 3.49 us at M = 2 / 4 / 8, block_e = 2 2.32 / 3.01 / 4.67, block_e = 4 3.01 /
  4.45 / 7.94; XLA's dot 5.6."""
  mp = C.next_pow2(m)
  block_e = 1
  block_k = C.pow2_divisor(d, max(16, 8192 // (mp * block_e)))
  return block_e, block_k


@functools.partial(jax.jit, static_argnames=("block_e", "block_k", "num_warps", "num_stages",
                                             "early_trigger", "interpret"))
def router_logits(x, router_w, *, block_e: int | None = None, block_k: int | None = None,
                  num_warps: int = 4, num_stages: int = 3, early_trigger: bool = True,
                  interpret: bool = False):
  """f32 [M, E] = f32(x) . f32(router_w)^T on the CUDA cores in exact fp32 (module docstring);
  ``early_trigger``: the kernel lets the next one launch first (``pdl``)."""
  C.check(x.ndim == 2, f"x must be [M, D], got {x.shape=}")
  m, d = x.shape
  C.check(1 <= m <= MAX_ROWS, f"router_logits handles 1..{MAX_ROWS} rows, got M={m}")
  C.check(router_w.ndim == 2 and router_w.shape[1] == d,
          f"router_w must be [E, D={d}], got {router_w.shape=}")
  C.check(jnp.issubdtype(router_w.dtype, jnp.floating),
          f"router_w must be a float array (fp32), got {router_w.dtype=}")
  n_exp = router_w.shape[0]
  dbe, dbk = default_router_blocks(m, n_exp, d)
  block_e, block_k = block_e or dbe, block_k or dbk
  C.check(C.is_pow2(block_e) and n_exp % block_e == 0,
          f"block_e must be a power of two dividing E={n_exp}, got {block_e=}")
  C.check(C.is_pow2(block_k) and d % block_k == 0,
          f"block_k must be a power of two dividing D={d}, got {block_k=}")
  mp = C.next_pow2(m)
  kernel = functools.partial(_router_kernel, m=m, mp=mp, block_e=block_e, block_k=block_k, d=d)
  return C.pallas_call(
      kernel, grid=(n_exp // block_e,), out_shape=jax.ShapeDtypeStruct((m, n_exp), jnp.float32),
      compiler_params=C.compiler_params(num_warps, num_stages), interpret=interpret,
      early_trigger=early_trigger, name=f"flint_router_m{m}_be{block_e}_bk{block_k}")(x, router_w)


# ------------------------------------------------------------------------------------------
# The top-k


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


def slot_route(l_ref, u, route):
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


def check_logits(logits, m, n_exp, top_k):
  C.check(logits.shape == (m, n_exp) and logits.dtype == jnp.float32,
          f"logits must be f32 [M={m}, E={n_exp}], got {logits.shape=} {logits.dtype=}")
  C.check(1 <= top_k <= n_exp, f"need 1 <= top_k <= E, got {top_k=} {n_exp=}")


def _topk_kernel(l_ref, ids_ref, lg_ref, *, top_k, n_exp, ep):
  t = pl.program_id(0)
  for j, (e, lg) in enumerate(_topk_logits(l_ref, t, top_k, n_exp, ep)):
    ids_ref[t, j] = e
    lg_ref[t, j] = lg


@functools.partial(jax.jit, static_argnames=("top_k", "num_warps", "early_trigger", "interpret"))
def moe_topk_route_pallas(logits, *, top_k: int = 6, num_warps: int = 1,
                          early_trigger: bool = True, interpret: bool = False) -> MoERoute:
  """``moe_topk_route`` as one Pallas kernel (one program per token: the gate_up kernel's
  in-kernel top-k, ``_topk_logits``, run once per token): the routing the MoE hands its kernels
  with ``MoEPlan.prerouted``, in one launch where XLA's top_k takes three.
  logits f32 [M, E] -> ``MoERoute(ids [M, top_k] int32, logits [M, top_k] f32)``, equal to
  ``moe_topk_route``'s (ties: lowest index first)."""
  m, n_exp = logits.shape
  check_logits(logits, m, n_exp, top_k)
  ids, top = C.pallas_call(
      functools.partial(_topk_kernel, top_k=top_k, n_exp=n_exp, ep=C.next_pow2(n_exp)),
      grid=(m,),
      out_shape=(jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((m, top_k), jnp.float32)),
      compiler_params=C.compiler_params(num_warps, 1), interpret=interpret,
      early_trigger=early_trigger, name=f"flint_moe_topk_e{n_exp}_k{top_k}")(logits)
  return MoERoute(ids, top)
