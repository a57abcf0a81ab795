"""The routed MoE's first kernel: every routed slot's gate|up + SiLU, and the shared expert's.

One program per (slot, ``block_n`` rows of the intermediate dim), plus programs for the shared
expert's gate / up. Slot u = t * top_k + j is token t's j-th expert (no de-duplication): the
program picks its expert from the routing (``route_ids_in`` with ``MoEPlan.prerouted``, else
token t's top-k of the router ``logits``, ``routing.slot_route``, whose first row block stores
the routing as two more outputs), indexes the stacked weight ``w[e]`` (dynamic ref indexing:
only the selected experts' weights are read) and writes

  h[u] = bf16(silu(g) * u),  g / u = bf16(fp32 (x . gate|up_e) * gate|up_scale_2[e])

(``*_scale_2`` only with NVFP4 weights), for all M tokens (``slot_rows`` "all": [U, M, I]) or
only its own token (``slot_rows`` "token": [U, 1, I]); the shared expert likewise into hs.
With ``MoEPlan.gate_up_f16`` the NVFP4 products are f16x2 against x scaled per row into f16
(``nvfp4_gemv.blocks_fma_f16``), and with ``down_f16`` h is written as the down kernel's f16
operand (one scale per 16 values, ``nvfp4_gemv.store_x16_blocks``).

``gate_up_split_k`` S > 1 (BF16): grid axis 1 is the K slice s; each program writes its fp32
partial g and u, counts itself done on ``counter[pid]`` (an acq_rel atomic after a CTA barrier)
and the last slice's program sums the S partials (volatile loads, slice order), writes h and
resets its counter entry to zero (so the counter comes back zeroed: the decode step keeps it in
``KVCache.counters``). H200 runs 45-46: the BF16 batch-1 gate_up 12.9 against 13.4 us.

``gate_up_reference``: the same h in plain jnp.
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
from flint_jax.pallas import nvfp4_gemv as NV
from flint_jax.pallas.moe import tiling as T
from flint_jax.pallas.moe.routing import slot_route

__all__ = ["gate_up", "gate_up_reference"]


def _gate_up_kernel(*refs, names, m, mp, inter, inter_s, bn, bk, bk_s, d, fe, fs, n_slots_max,
                    decode, method, route, token_method=None, split_k=1, finish=False,
                    shared_first=False, shared_token=False, x16=False, h16=False,
                    f16_sums="block", interpret=False):
  """route = (top_k, n_exp, ep): slot u's expert is ``route_ids_in[u // top_k, u % top_k]``
  when that input is given, else computed from the ``logits`` (``slot_route``) and stored by
  the slot's j == 0 program at ``route_ids`` / ``route_logits`` [u // top_k, u % top_k].
  shared_first: the shared expert's programs take the first program ids. shared_token (with
  token_method): the shared expert as M one-token parts, one program per (token, row block) on
  the ``token_method`` tile writing hs [M, 1, I_s] row t; otherwise one program per row block
  for all M rows (``method``). token_method: slot u multiplies only its own token
  t = u // top_k (x row t, at M = 1) and writes h [U, 1, I]; otherwise all M rows.
  split_k > 1 (bf16, with finish): see the module docstring. x16 (token_method "blocks"): the
  one-token operands ``xt5`` are ``nvfp4_gemv.x16_operand``'s f16 rows, ``xinv`` [M] their row
  factors. h16 (with x16 and shared_token): h is written as the down kernel's f16 operand
  (``h16`` / ``hs16`` [., 1, I] f16 and ``hinv`` / ``hsinv`` [., 1, I / 16] f32)."""
  r = dict(zip(names, refs))
  pid = pl.program_id(0)
  ks = pl.program_id(1) if split_k > 1 else 0
  n_i = inter // bn
  n_routed = n_slots_max * n_i
  n_sj = inter_s // bn                     # the shared expert's row blocks
  n_shared = n_sj * (m if shared_token else 1)
  xs = (r["x"], r["x5"])
  all_rows = dict(xs=xs, x_idx=(), m=m, mp=mp, method=method)   # every token's row of x
  # one token's row of x as a one-row operand (x viewed as [M, 1, D]), on the M = 1 tiles
  token_operand = lambda t: dict(xs=(r["xt"], r["xt5"]), x_idx=(t,), m=1,  # noqa: E731
                                 mp=C.pad_rows(1), method=token_method)

  def gemv2(wg, wu, w_idx, ng, nu, fmt, step, xs=xs, x_idx=(), m=m, mp=mp, method=method):
    kw = dict(decode=decode, method=method, f16_sums=f16_sums)
    z = T.acc_zeros(fmt, mp, bn, step, method)
    n_k = d // step // split_k                      # K steps of this program's slice
    lo, hi = ks * n_k, (ks + 1) * n_k

    def body(i, carry):
      ag, au = carry
      ag = T.tile_dot(fmt, xs, x_idx, m, mp, wg, w_idx, ng, bn, i, step, ag, **kw)
      au = T.tile_dot(fmt, xs, x_idx, m, mp, wu, w_idx, nu, bn, i, step, au, **kw)
      return ag, au
    ag, au = lax.fori_loop(lo, hi, body, (z, z))
    return C.finish_acc(ag, method), C.finish_acc(au, method)

  def store_h(h_name, lead, ag, au, n0, m_, mp_, method_):
    """h = bf16(silu(g) * u), or (split_k > 1) the fp32 partials g, u of slice ks, the last
    slice's program summing them into h."""
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
    if "route_ids_in" in r:
      e = r["route_ids_in"][u // route[0], u % route[0]]
    else:
      e, lg = slot_route(r["logits"], u, route)
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

  def shared(j):
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

  if shared_first:
    lax.cond(pid < n_shared, lambda: shared(pid), lambda: routed(pid - n_shared))
  else:
    lax.cond(pid < n_routed, lambda: routed(pid), lambda: shared(pid - n_routed))


def gate_up(x, experts, shared, plan: T.MoEPlan, dims, *, route, route_ids=None,
            logits=None, x16_rows=None, counter=None, decode="asm", early_trigger=True,
            interpret=False):
  """Launches the gate_up kernel. ``dims``: (fe, fs, m, d, n_exp, inter, inter_s) of the weights
  (``tiling.moe_shapes``); ``route`` = (top_k, n_exp, ep). The routing comes as ``route_ids``
  [M, top_k] (``plan.prerouted``: the top-k kernel's) or is computed from ``logits`` [M, E] and
  returned. ``x16_rows``: (x16 [M, D] f16, inv [M] f32), the f16 operand of x
  (``add_rms_norm(x16=True)``; None: an XLA op here). ``counter`` (``plan.gate_up_split_k`` >
  1): int32 zeros [>= programs]. Returns (h_parts, route_ids, route_logits, counter): h_parts
  the down kernel's inputs ((h, hs), or with ``plan.down_f16`` (h16, hinv, hs16, hsinv)); the
  routing outputs None when given; counter None unless given."""
  fe, fs, m, d, _, inter, inter_s = dims
  top_k = route[0]
  u = m * top_k
  token, shared_token, sk = plan.token, plan.shared_token, plan.gate_up_split_k
  method, token_method = plan.method, plan.token_method
  C.check_method(method, m)
  bk = min(plan.block_k, C.pow2_divisor(d, plan.block_k))
  # one row block for the routed and the shared experts' programs: it must divide both I and
  # I_s (issue 45: a block dividing only min(I, I_s) left the tail rows of the larger one
  # unwritten, and the down kernel read them: NaN logits at I = 32, I_s = 48)
  bn = C.pow2_divisor(math.gcd(inter, inter_s), plan.block_n)
  C.check(bn >= 16 and inter % bn == 0 and inter_s % bn == 0,
          f"block_n too small for the dims ({bn}): I={inter} and I_s={inter_s} need 16 | both")
  if "nvfp4" in (fe, fs):
    C.check(bk >= 64 and d % 64 == 0 and inter % 64 == 0,
            "NVFP4 needs D, I, I_s multiples of 64")
  if sk > 1:
    C.check(d % sk == 0, f"gate_up_split_k={sk} must divide D={d}")
    bk = min(bk, C.pow2_divisor(d // sk, bk))     # whole K steps in every slice
    C.check(bk >= 16, f"gate_up_split_k={sk} leaves K slices of {d // sk} < 16 values")
    C.check(counter is not None, "gate_up_split_k > 1 needs its counter (int32 zeros)")
  else:
    C.check(counter is None, "the counter is only for gate_up_split_k > 1")
  n_prog = u * (inter // bn) + (inter_s // bn) * (m if shared_token else 1)
  x16, h16 = plan.gate_up_f16, plan.down_f16
  C.check(not x16 or interpret or decode == "asm",
          f"gate_up_f16 compiled for the GPU needs decode='asm' (the f16 K step's jnp form is "
          f"for interpret mode), got {decode=}")
  C.check(not h16 or (inter % 64 == 0 and inter_s % 64 == 0), "down_f16 needs I, I_s % 64 == 0")
  C.check(x16_rows is None or (x16 and x16_rows[0].shape == (m, d)
                               and x16_rows[0].dtype == jnp.float16
                               and x16_rows[1].shape == (m,)
                               and x16_rows[1].dtype == jnp.float32),
          "x16_rows must be (x16 [M, D] f16, inv [M] f32) from nvfp4_gemv.x16_operand(x) "
          "(or add_rms_norm(x16=True)), with gate_up_f16")
  if counter is not None:
    C.check(counter.dtype == jnp.int32 and counter.ndim == 1 and counter.shape[0] >= n_prog,
            f"the gate_up counter must be int32 zeros [>= {n_prog}] (the gate_up programs), "
            f"got {counter.shape} {counter.dtype}")

  names = ["x", "x5"] + (["route_ids_in"] if route_ids is not None else ["logits"])
  args = [x, NV.x_view(x) if d % 64 == 0 else x]
  args += [route_ids if route_ids is not None else logits]
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
    args += T.weight_args(fe, (experts["gate_up_qweight"], experts["gate_up_weight_scale"]))
    args += [experts["gate_up_weight_scale_2"].astype(jnp.float32)]
  if fs == "bf16":
    names += ["sg_w", "su_w"]
    args += [shared["gate_proj"], shared["up_proj"]]
  else:
    names += ["sg_q", "sg_s", "su_q", "su_s", "sg_s2", "su_s2"]
    args += T.weight_args(fs, shared["gate_proj"]) + T.weight_args(fs, shared["up_proj"])
    args += [C.scalar_f32(shared["gate_proj"][2]), C.scalar_f32(shared["up_proj"][2])]
  if sk == 1 and h16:    # the down kernel's f16 operands and their per-block factors
    out = {"h16": jax.ShapeDtypeStruct((u, 1, inter), jnp.float16),
           "hinv": jax.ShapeDtypeStruct((u, 1, inter // 16), jnp.float32),
           "hs16": jax.ShapeDtypeStruct((m, 1, inter_s), jnp.float16),
           "hsinv": jax.ShapeDtypeStruct((m, 1, inter_s // 16), jnp.float32)}
  elif sk == 1:
    out = {"h": jax.ShapeDtypeStruct((u, 1 if token else m, inter), x.dtype),
           "hs": jax.ShapeDtypeStruct((m, 1, inter_s) if shared_token else (m, inter_s),
                                      x.dtype)}
  else:      # fp32 partial g and u per K slice, then h itself (finished), and the counter
    out = {"hg": jax.ShapeDtypeStruct((sk, u, m, inter), jnp.float32),
           "hu": jax.ShapeDtypeStruct((sk, u, m, inter), jnp.float32),
           "hsg": jax.ShapeDtypeStruct((sk, m, inter_s), jnp.float32),
           "hsu": jax.ShapeDtypeStruct((sk, m, inter_s), jnp.float32),
           "h": jax.ShapeDtypeStruct((u, m, inter), x.dtype),
           "hs": jax.ShapeDtypeStruct((m, inter_s), x.dtype)}
  names += list(out)
  out_shape = list(out.values())
  if route_ids is None:
    names += ["route_ids", "route_logits"]
    out_shape += [jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                  jax.ShapeDtypeStruct((m, top_k), jnp.float32)]
  aliases = {}
  if sk > 1:   # the counter: an input aliased to the last output
    names.insert(len(args), "counter")
    aliases = {len(args): len(out_shape)}
    args.append(counter)
    names.append("counter_out")
    out_shape.append(jax.ShapeDtypeStruct(counter.shape, jnp.int32))
  decode = NV.resolve_decode(decode, interpret)
  # small models (D or I of 64..192): fewer warps where the f16 K step's tile is too small for
  # the plan's (issue 45; every Flint tile fits the plan's warps)
  warps = NV.f16_warps_that_fit(bn, bk, plan.num_warps) if x16 else plan.num_warps
  kernel = functools.partial(
      _gate_up_kernel, names=names, m=m, mp=C.pad_rows(m, method), inter=inter,
      inter_s=inter_s, bn=bn, bk=bk, bk_s=bk, d=d, fe=fe, fs=fs, n_slots_max=u, decode=decode,
      method=method, route=route, token_method=token_method, split_k=sk, finish=sk > 1,
      shared_first=plan.shared_first, shared_token=shared_token, x16=x16, h16=h16,
      # the f16 K step's sums as its tiles allow
      f16_sums=NV.f16_sums_for_tile(bn, bk, warps) if x16 else "block",
      interpret=interpret)
  tag = "_routed" + ("_token" if token else "") + ("_shtok" if shared_token else "")
  res = list(C.pallas_call(
      kernel, grid=(n_prog, sk) if sk > 1 else (n_prog,), out_shape=tuple(out_shape),
      input_output_aliases=aliases,
      compiler_params=C.compiler_params(warps, plan.num_stages), interpret=interpret,
      early_trigger=early_trigger,
      name=(f"flint_moe_gate_up{tag}{'_x16' if x16 else ''}_{fe}_{fs}_{method}_bn{bn}_bk{bk}"
            + (f"_splitk{sk}_finish" if sk > 1 else "")),
  )(*args))
  counter = res.pop() if sk > 1 else None
  ids = top = None
  if route_ids is None:
    ids, top = res[-2:]
    res = res[:-2]
  h_parts = res[-2:] if sk > 1 else res     # split-K: the finished h, hs after the partials
  return h_parts, ids, top, counter


def gate_up_reference(x, experts, shared, ids, *, slot_rows: str = "all"):
  """Plain jnp: (h [U, M | 1, I], hs [M, I_s]) for the slots ``ids`` [M, top_k] (slot
  u = t * top_k + j): h[u] = bf16(silu(g) * u) of expert ids[t, j] for every token (``slot_rows``
  "all") or token t only ("token": [U, 1, I]), g / u each rounded to bf16; hs the shared
  expert's (the contract of ``gate_up`` before the f16 operand's rounding)."""
  fe, fs, m, _, _, inter, _ = T.moe_shapes(x, experts, shared)
  dt = x.dtype
  hi = lax.Precision.HIGHEST
  gu, _, s_gu, _ = selected_experts(experts, ids.reshape(-1), fe)     # [U, ...]
  g = jnp.einsum("md,uid->umi", x, gu[:, :inter], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[:, None, 0:1]
  u = jnp.einsum("md,uid->umi", x, gu[:, inter:], preferred_element_type=jnp.float32,
                 precision=hi) * s_gu[:, None, 1:2]
  h = C.silu_mul_f32(g, u).astype(dt)                                  # [U, M, I]
  if slot_rows == "token":
    top_k = ids.shape[1]
    h = h[jnp.arange(m * top_k), jnp.arange(m * top_k) // top_k][:, None]
  hs = C.silu_mul_f32(ref_linear(x, shared["gate_proj"], fs),
                      ref_linear(x, shared["up_proj"], fs)).astype(dt)
  return h, hs


def ref_linear(x, w, fmt):
  """fp32 x . W^T (times scale_2 for NVFP4); w: bf16 [N, K] or (q, s, s2)."""
  if fmt == "bf16":
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)
  return NV.nvfp4_gemv_reference(x, *w, out_dtype=jnp.float32)


def selected_experts(experts, ids, fe):
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
