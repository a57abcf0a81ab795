"""Small-batch routed MoE decode (M <= 16 tokens): routing in the kernels, expert-indexed
grouped GEMVs, the shared expert; one ``MoEPlan`` drives them.

  out[t] = bf16( sum_k w[t,k] * y_k[t] + y_s[t] )          (fp32 sum, k in top-k order)
  y_k[t] = bf16( down_e(h) * down_scale_2[e] )               e = ids[t, k]
  h      = bf16( silu(g) * u ),  g/u = bf16( fp32 (x[t] . gate|up_e) * gate|up_scale_2[e] )
  y_s[t] = the shared expert (I_s = 1024) with the same rules, never gated

(``*_scale_2`` only with NVFP4 weights; BF16 experts use 1.) The reference model's per-expert
bf16 outputs, combined in fp32 and rounded once (vLLM rounds the routed sum to bf16 before
adding the shared output; we do not). Routing (``routing``): the experts are ``lax.top_k`` of
the fp32 router logits, weighted by sigmoid / sum in fp32.

Rooms, one job each:

| module | kernels | reference |
|---|---|---|
| ``routing`` | ``router_logits`` (the router GEMV), ``moe_topk_route_pallas`` (the top-k) | ``moe_router_logits``, ``moe_topk_route``, ``moe_route_weights`` |
| ``gate_up`` | every slot's and the shared expert's gate / up + SiLU (``gate_up``) | ``gate_up_reference`` |
| ``down`` | every slot's and the shared expert's down projection (``down``), optionally ending in the combine | ``down_reference`` |
| ``combine`` | ``moe_combine_add_rms_norm``; the combine in the down kernel's last programs | ``moe_combine_add_rms_norm_reference`` |
| ``tiling`` | ``MoEPlan`` / ``moe_plan``: slot rows, routing, f16 K steps and tiles per (format, M) | |

Entry points (here): ``moe_decode_routed(x, logits, experts, shared, plan=)`` -> (y, route):
the top-k kernel (``plan.prerouted``), gate_up, down; ``moe_decode_routed_combine``: the same
with the combine, residual add and next RMSNorm in the down kernel. Slot u = t * top_k + j is
token t's j-th expert (no de-duplication; ``moe_block`` / ``moe_decode``'s XLA routing with
de-duplicated slots, the session-1 path, was retired after 35c0874). Never ``ragged_dot``: it
reads every expert. Measured on the H200 (docs/kernels.md): NVFP4 M = 1 the step's MoE 8.2 +
6.4 us per layer (f16 K steps, run 160); M = 8 about 30 + 16 us (runs 158-163).

Expert weights (``experts`` dict), either
  BF16:  ``gate_up_proj`` [E, 2I, D] (gate rows first), ``down_proj`` [E, D, I]
  NVFP4: ``gate_up_qweight`` [E, 2I, D/2], ``gate_up_weight_scale`` [E, 2I, D/16],
         ``gate_up_weight_scale_2`` [E, 2] (gate, up), ``down_qweight`` [E, D, I/2],
         ``down_weight_scale`` [E, D, I/16], ``down_weight_scale_2`` [E]
Shared expert (``shared`` dict): ``gate_proj``, ``up_proj`` [I_s, D], ``down_proj`` [D, I_s], each
either a bf16 array or an ``NVFP4Weight`` / (qweight, weight_scale, weight_scale_2) triple.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flint_jax.pallas import _common as C
from flint_jax.pallas.moe import tiling as T
from flint_jax.pallas.moe.combine import (moe_combine_add_rms_norm,
                                          moe_combine_add_rms_norm_reference)
from flint_jax.pallas.moe.down import down
from flint_jax.pallas.moe.gate_up import ref_linear, selected_experts, gate_up
from flint_jax.pallas.moe.routing import (MoERoute, check_logits, moe_route_from_logits,
                                          moe_route_weights, moe_router_logits, moe_topk_route,
                                          moe_topk_route_pallas, router_logits,
                                          router_logits_reference)
from flint_jax.pallas.moe.tiling import MoEPlan, expert_format, moe_plan

__all__ = ["moe_decode_routed", "moe_decode_routed_combine", "moe_decode_routed_reference",
           "moe_combine_add_rms_norm", "moe_combine_add_rms_norm_reference", "MoEPlan",
           "moe_plan", "MoERoute", "moe_router_logits", "moe_topk_route",
           "moe_topk_route_pallas", "moe_route_weights", "moe_route_from_logits",
           "router_logits", "router_logits_reference", "expert_format"]


def _routed(x, logits, experts, shared, top_k, plan, decode, early_trigger, interpret,
            gate_up_counter=None, x16_rows=None, combine=None):
  """The launches of ``moe_decode_routed`` / ``_combine``: (down's outputs, route, counter)."""
  dims = T.moe_shapes(x, experts, shared)
  fe, fs, m, _, n_exp, _, _ = dims
  check_logits(logits, m, n_exp, top_k)
  plan = plan or moe_plan(fe, fs, m)
  C.check(isinstance(plan, MoEPlan) and (plan.experts, plan.shared, plan.rows) == (fe, fs, m),
          f"plan must be the MoEPlan of these weights at M={m} (experts {fe}, shared {fs}), "
          f"got {plan}")
  kw = dict(decode=decode, early_trigger=early_trigger, interpret=interpret)
  route_ids = None
  if plan.prerouted:   # the top-k once per token in its own kernel
    given = moe_topk_route_pallas(logits, top_k=top_k, early_trigger=early_trigger,
                                  interpret=interpret)
    route_ids = given.ids
  h_parts, ids, top, counter = gate_up(
      x, experts, shared, plan, dims, route=(top_k, n_exp, C.next_pow2(n_exp)),
      route_ids=route_ids, logits=logits, x16_rows=x16_rows, counter=gate_up_counter, **kw)
  route = given if plan.prerouted else MoERoute(ids, top)
  if combine is not None:
    combine = (*combine, route.logits)
  out = down(h_parts, experts, shared, plan, dims, route.ids, top_k=top_k, dtype=x.dtype,
             combine=combine, **kw)
  return out, route, counter


@functools.partial(jax.jit, static_argnames=("top_k", "plan", "decode", "early_trigger",
                                             "interpret"))
def moe_decode_routed(x, logits, experts, shared, *, top_k: int = 6, plan: MoEPlan | None = None,
                      gate_up_counter=None, x16_rows=None, decode: str = "asm",
                      early_trigger: bool = True, interpret: bool = False):
  """(y, route): expert outputs routed *inside* the kernels and the routing.

  x [M, D] bf16 (M <= 16); logits: router logits f32 [M, E] (``moe_router_logits``). ``plan``:
  the ``MoEPlan`` of these weights at M (None: ``moe_plan``'s measured choices). Returns
    y [M * top_k + 1, M, D] bf16: y[t * top_k + j, t] = bf16(expert_{ids[t, j]}(x[t])) (what
      the combine uses); y[M * top_k] = the shared expert's output (all M rows). The other rows
      y[u, t'], t' != u // top_k, are token t''s output through slot u's expert with
      ``slot_rows`` "all" and undefined (never written) with "token".
    route: ``MoERoute(ids [M, top_k] int32, logits [M, top_k] f32)``, equal to
      ``moe_topk_route(logits, top_k=top_k)`` (ties by lowest index); pass ``route.logits`` to
      ``moe_combine_add_rms_norm`` / ``norm_qkv``.
  ``gate_up_counter`` (``plan.gate_up_split_k`` > 1): int32 zeros [>= the gate_up kernel's
  programs]; the last K slice of each tile finishes h and returns its entry to zero; returns
  (y, route, counter) then. ``x16_rows`` (``plan.gate_up_f16``): the f16 operand of x,
  ``(x16, inv) = nvfp4_gemv.x16_operand(x)``, as ``add_rms_norm(x16=True)`` writes it (None: an
  XLA op here). ``decode``: the NVFP4 decode (``nvfp4_gemv``). ``early_trigger``: every kernel
  lets the next one launch first (``pdl``).
  """
  y, route, counter = _routed(x, logits, experts, shared, top_k, plan, decode, early_trigger,
                              interpret, gate_up_counter=gate_up_counter, x16_rows=x16_rows)
  return (y, route) if gate_up_counter is None else (y, route, counter)


@functools.partial(jax.jit, static_argnames=("counter_base", "eps", "norm", "x16_next", "top_k",
                                             "plan", "decode", "early_trigger", "interpret"))
def moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter, *,
                              counter_base: int, eps: float = 1e-6, norm: bool = True,
                              x16_next: bool = False, top_k: int = 6,
                              plan: MoEPlan | None = None, x16_rows=None, decode: str = "asm",
                              early_trigger: bool = True, interpret: bool = False):
  """``moe_decode_routed`` then ``moe_combine_add_rms_norm(h, y, route.logits, w_next)`` in 2
  launches instead of 3: the down kernel's last program does the combine
  (``combine.down_combine_finish``). Returns ``(s, x_next, route, counter)``: s = bf16(h + moe)
  [M, D], x_next its RMSNorm times w_next [M, D], the routing, and ``counter`` (int32 [>=
  counter_base + 1 + D / block_n_down], whose entries counter_base .. counter_base + D /
  block_n_down must be zero on entry) with those entries back at zero. The outputs equal the
  3-launch composition's (same formulas, same rounding points).

  ``norm=False``: no RMSNorm and no second counter level. The last program of each column block
  writes that block's s and its fp32 sum of squares; returns ``(s, sumsq, route, counter)``,
  sumsq f32 [M, D / block_n_down] (``sumsq[t, b] = sum over block b's columns of f32(s[t])^2``),
  for a consumer that normalises as it loads (``multi_gemv(s, ..., rms_sumsq=sumsq,
  rms_weight=w_next)``). s is the same either way; w_next is not read.

  ``x16_next`` (with ``norm``): also x_next's f16 operand, ``nvfp4_gemv.x16_operand(x_next)``
  (x16 [M, D] f16, inv [M] f32), from the same program (e.g. for the LM head's
  ``nvfp4_gemv(x16, ..., x_inv=inv)``); returns ``(s, x_next, route, counter, (x16, inv))``."""
  C.check(norm or not x16_next, "x16_next is the normalised row's operand: needs norm=True")
  (_, s_out, x_out, counter, *x16_rows_out), route, _ = _routed(
      x, logits, experts, shared, top_k, plan, decode, early_trigger, interpret,
      x16_rows=x16_rows, combine=(h, w_next, counter, counter_base, eps, norm, x16_next))
  if x16_next:
    return s_out, x_out, route, counter, tuple(x16_rows_out)
  return s_out, x_out, route, counter


def moe_decode_routed_reference(x, logits, experts, shared, *, top_k: int = 6,
                                **unused_tuning):
  """Plain jnp (y [M * top_k + 1, M, D], route): y[t * top_k + j, t'] =
  bf16(expert_{ids[t, j]}(x[t'])), route = ``moe_topk_route(logits)``; y[-1] = the shared expert
  (``moe_decode_reference``'s per-expert rounding)."""
  del unused_tuning
  return _moe_decode_routed_reference(x, logits, experts, shared, top_k=top_k)


@functools.partial(jax.jit, static_argnames=("top_k",))
def _moe_decode_routed_reference(x, logits, experts, shared, *, top_k):
  fe, fs, m, d, _, inter, _ = T.moe_shapes(x, experts, shared)
  dt = x.dtype
  hi = lax.Precision.HIGHEST
  route = moe_topk_route(logits, top_k=top_k)
  ids = route.ids.reshape(-1)                                         # [U], slot order
  gu, dn, s_gu, s_dn = selected_experts(experts, ids, fe)           # [U, ...]
  g = jnp.einsum("md,uid->umi", x, gu[:, :inter], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[:, None, 0:1]
  u = jnp.einsum("md,uid->umi", x, gu[:, inter:], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[:, None, 1:2]
  h = C.silu_mul_f32(g, u).astype(dt)                                  # [U, M, I]
  y = (jnp.einsum("umi,udi->umd", h, dn, preferred_element_type=jnp.float32, precision=hi)
       * s_dn[:, None, None]).astype(dt)                               # [U, M, D]
  hs = C.silu_mul_f32(ref_linear(x, shared["gate_proj"], fs),
                      ref_linear(x, shared["up_proj"], fs)).astype(dt)
  y_s = ref_linear(hs, shared["down_proj"], fs).astype(dt)
  return jnp.concatenate([y, y_s[None]], axis=0), route
