"""The routed MoE's second kernel: every routed slot's down projection, and the shared expert's.

Grid ``(D / block_n_down, U + shared programs)``: one program per (``block_n_down`` output
columns, slot or shared-expert part) writes the bf16 expert output y [(U + 1) * M, D] (the
caller's [U + 1, M, D]: y[t * top_k + j, t] = bf16(expert_{ids[t, j]}(h)) and y[U] the shared
expert's). Slot u reads its expert id from the routing the gate_up kernel used
(``route_ids``), so the top-k runs once. With per-token slots (``MoEPlan.slot_rows`` "token")
slot u writes only its token's row y[u, u // top_k]; with ``shared_rows`` "token" the shared
expert's part q (grid row U + q) writes token q's row. With ``down_f16`` h / hs arrive as the
gate_up kernel's f16 operands and the products are f16x2 (``nvfp4_gemv.blocks_fma_f16``).

``combine``: the MoE combine + residual add + next RMSNorm done by the kernel's last programs
(``combine.down_combine_finish``): the decode step's at batch 1.

``down_reference``: y in plain jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C
from flint_jax.pallas import nvfp4_gemv as NV
from flint_jax.pallas.moe import tiling as T
from flint_jax.pallas.moe.combine import down_combine_finish
from flint_jax.pallas.moe.gate_up import ref_linear, selected_experts

__all__ = ["down", "down_reference"]


def _down_kernel(*refs, names, m, mp, inter, inter_s, bn, bk, bk_s, n_slots_max, fe, fs,
                 decode, method, route_top_k, token_method=None, combine=None,
                 shared_first=False, shared_token=False, h16=False, f16_sums="block",
                 interpret=False):
  """Grid (D/BN, slots + shared parts): one (slot | shared part) per program. Slot u's expert:
  ``route_ids[u // route_top_k, u % route_top_k]``. token_method: h is [U, 1, I] and slot u
  writes only its token's row y[u, u // route_top_k] (``token_method`` tiles). combine:
  dict(top_k, base, eps, dp, bn, norm, x16) for ``down_combine_finish``. shared_first: the
  shared expert's programs are grid rows 0 .. parts - 1, the slots' after them. shared_token:
  hs arrives as [M, 1, I_s] and the shared expert's part q (q < M) computes token q's row on
  the ``token_method`` tile. h16 (token_method "blocks" and shared_token): h / hs are the gate_up
  kernel's f16 operands, their per-block factors ``hinv5`` / ``hsinv5`` (viewed [., 1, I / 64,
  2, 2])."""
  r = dict(zip(names, refs))
  n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
  dt = r["out"].dtype
  kw = dict(decode=decode, method=method, f16_sums=f16_sums)
  if token_method is None:
    m_u, mp_u, method_u = m, mp, method
  else:
    m_u, mp_u, method_u = 1, C.pad_rows(1), token_method

  def shared_y(n0=n0, bn=bn, t=None):
    """y_s = bf16(hs . Wd^T * scale_2), columns n0 .. n0 + bn: all M rows, or (shared_token)
    token t's row."""
    wsd = [r["sd_w"]] if fs == "bf16" else [r["sd_q"], r["sd_s"]]
    hs = (r["hs"], r["hs5"])
    lead, m_, mp_, method_ = ((), m, mp, method) if t is None else ((t,), m_u, mp_u, method_u)
    kw_s = dict(kw, method=method_, x_scale=r["hsinv5"] if h16 else None)
    body = lambda i, a: T.tile_dot(fs, hs, lead, m_, mp_, wsd, (), n0, bn, i, bk_s, a,  # noqa: E731
                                   **kw_s)
    acc = lax.fori_loop(0, inter_s // bk_s, body, T.acc_zeros(fs, mp_, bn, bk_s, method_))
    acc = C.finish_acc(acc, method_)
    if fs == "nvfp4":
      f = NV.F16_DECODE_FACTOR if h16 else NV.decode_factor(decode)
      acc = acc * (r["sd_s2"][0] * f)
    return acc.astype(dt)

  def slot_y(u):    # y_k = bf16(h_u . Wd_e^T * scale_2[e])
    e = r["route_ids"][u // route_top_k, u % route_top_k]
    wd = [r["dn_w"]] if fe == "bf16" else [r["dn_q"], r["dn_s"]]
    h = (r["h"], r["h5"])
    kw_u = dict(kw, method=method_u, x_scale=r["hinv5"] if h16 else None)
    body = lambda i, a: T.tile_dot(fe, h, (u,), m_u, mp_u, wd, (e,), n0, bn, i, bk, a,  # noqa: E731
                                   **kw_u)
    acc = lax.fori_loop(0, inter // bk, body, T.acc_zeros(fe, mp_u, bn, bk, method_u))
    acc = C.finish_acc(acc, method_u)
    if fe == "nvfp4":
      f = NV.F16_DECODE_FACTOR if h16 else NV.decode_factor(decode)
      acc = acc * (r["dn_s2"][e] * f)
    return acc.astype(dt)

  s_pid = pl.program_id(1)
  n_sh = m if shared_token else 1    # the shared expert's programs per column block
  # the slot (or, from n_slots_max on, the shared expert's part) of this program
  s_id = (jnp.where(s_pid < n_sh, n_slots_max + s_pid, s_pid - n_sh)
          if shared_first else s_pid)

  def routed():
    y = slot_y(s_id)
    row0 = s_id * m + (0 if token_method is None else s_id // route_top_k)
    C.store_tile(r["out"], (), y, n0, bn, m_u, mp_u, method_u, row0=row0)

  def shared():
    if shared_token:
      t = s_id - n_slots_max
      C.store_tile(r["out"], (), shared_y(t=t), n0, bn, m_u, mp_u, method_u,
                   row0=n_slots_max * m + t)
      return
    C.store_tile(r["out"], (), shared_y(), n0, bn, m, mp, method, row0=n_slots_max * m)

  lax.cond(s_id < n_slots_max, routed, shared)
  if combine is not None:
    down_combine_finish(r, m=m, d=r["out"].shape[-1], n_slots=n_slots_max,
                        progs_per_block=n_slots_max + n_sh, interpret=interpret, **combine)


def down(h_parts, experts, shared, plan: T.MoEPlan, dims, route_ids, *, top_k, dtype,
         combine=None, decode="asm", early_trigger=True, interpret=False):
  """Launches the down kernel on the gate_up kernel's ``h_parts`` and routing ``route_ids``
  [M, top_k]. ``dims``: (fe, fs, m, d, n_exp, inter, inter_s); ``dtype``: the MoE input's (that
  of y). ``combine``: (h, w_next, counter, base, eps, norm, x16, top_logits) for the combine in
  the last program(s); see ``moe_decode_routed_combine``. Returns y [U + 1, M, D], or with
  ``combine`` (y, s, x_next | sumsq, counter[, x16, inv])."""
  fe, fs, m, d, _, inter, inter_s = dims
  u = m * top_k
  token, shared_token, h16 = plan.token, plan.shared_token, plan.down_f16
  method_down, token_method = plan.method_down, plan.token_method
  C.check_method(method_down, m)
  bk_dn = C.pow2_divisor(inter, plan.block_k_down)   # down: K = I (512 for Flint)
  bk_s_dn = C.pow2_divisor(inter_s, plan.block_k_down)
  bn_dn = C.pow2_divisor(d, plan.block_n_down)
  C.check(bn_dn >= 16, f"block_n_down too small for the dims ({bn_dn}): D needs 16 | D")
  if "nvfp4" in (fe, fs):
    C.check(min(bk_dn, bk_s_dn) >= 64, "NVFP4 needs D, I, I_s multiples of 64")
  x_dtype = dtype
  if h16:
    h, h_inv, hs, hs_inv = h_parts
    names = ["h", "h5", "hs", "hs5", "hinv5", "hsinv5"]
    args = [h, NV.x_view(h), hs, NV.x_view(hs), h_inv.reshape(u, 1, inter // 64, 2, 2),
            hs_inv.reshape(m, 1, inter_s // 64, 2, 2)]
  else:
    h, hs = h_parts
    names = ["h", "h5", "hs", "hs5"]
    args = [h, NV.x_view(h) if inter % 64 == 0 else h, hs,
            NV.x_view(hs) if inter_s % 64 == 0 else hs]
  names += ["route_ids"]
  args += [route_ids]
  if fe == "bf16":
    names += ["dn_w"]
    args += [experts["down_proj"]]
  else:
    names += ["dn_q", "dn_s", "dn_s2"]
    args += T.weight_args(fe, (experts["down_qweight"], experts["down_weight_scale"]))
    args += [experts["down_weight_scale_2"].astype(jnp.float32)]
  if fs == "bf16":
    names += ["sd_w"]
    args += [shared["down_proj"]]
  else:
    names += ["sd_q", "sd_s", "sd_s2"]
    args += T.weight_args(fs, shared["down_proj"]) + [C.scalar_f32(shared["down_proj"][2])]
  combine_kw = None
  if combine is not None:   # the combine in the last program(s)
    c_h, c_w, c_counter, c_base, c_eps, c_norm, c_x16, c_logits = combine
    C.check(c_norm or not c_x16, "combine: the x16 operand is of the normalised row (norm=True)")
    n_blocks = d // bn_dn
    C.check(c_h.shape == (m, d) and c_h.dtype == dtype and c_w.shape == (d,),
            f"combine: h must be [{m}, {d}] {dtype} and w_next [{d}], got {c_h.shape} "
            f"{c_h.dtype} / {c_w.shape}")
    C.check(c_counter.dtype == jnp.int32 and c_counter.ndim == 1
            and 0 <= c_base and c_base + 1 + n_blocks <= c_counter.shape[0],
            f"combine: the counter must be int32 zeros with entries {c_base} .. "
            f"{c_base + n_blocks} (got shape {c_counter.shape} {c_counter.dtype})")
    names += ["cmb_logits", "cmb_h", "cmb_w", "cmb_counter"]
    args += [c_logits, c_h, c_w, c_counter]
    combine_kw = dict(top_k=top_k, base=c_base, eps=c_eps, dp=C.next_pow2(d), bn=bn_dn,
                      norm=c_norm, x16=c_x16)
  names += ["out"]
  if combine is not None:
    names += ["cmb_s", "cmb_x" if c_norm else "cmb_ss", "cmb_counter_out"]
    names += ["cmb_x16", "cmb_xinv"] if c_x16 else []
  decode = NV.resolve_decode(decode, interpret)
  # small models: fewer warps where the f16 K step's tile is too small for the plan's (issue 45)
  warps = (NV.f16_warps_that_fit(bn_dn, min(bk_dn, bk_s_dn), plan.num_warps_down) if h16
           else plan.num_warps_down)
  kernel = functools.partial(
      _down_kernel, names=names, m=m, mp=C.pad_rows(m, method_down), inter=inter,
      inter_s=inter_s, bn=bn_dn, bk=bk_dn, bk_s=bk_s_dn, n_slots_max=u, fe=fe, fs=fs,
      decode=decode, method=method_down, route_top_k=top_k, token_method=token_method,
      combine=combine_kw, shared_first=plan.shared_first, shared_token=shared_token, h16=h16,
      # the f16 K step's sums as its tiles allow
      f16_sums=(NV.f16_sums_for_tile(bn_dn, min(bk_dn, bk_s_dn), warps) if h16
                else "block"),
      interpret=interpret)
  out_shape = [jax.ShapeDtypeStruct(((u + 1) * m, d), x_dtype)]
  aliases = {}
  if combine is not None:
    out_shape += [jax.ShapeDtypeStruct((m, d), x_dtype),
                  jax.ShapeDtypeStruct((m, d), x_dtype) if c_norm else
                  jax.ShapeDtypeStruct((m, d // bn_dn), jnp.float32),
                  jax.ShapeDtypeStruct(c_counter.shape, jnp.int32)]
    if c_x16:
      out_shape += [jax.ShapeDtypeStruct((m, d), jnp.float16),
                    jax.ShapeDtypeStruct((m,), jnp.float32)]
    aliases = {len(args) - 1: 3}     # the counter, in place
  tag = "_routed" + ("_token" if token else "") + ("_shtok" if shared_token else "")
  res = C.pallas_call(
      kernel, grid=(d // bn_dn, u + (m if shared_token else 1)), out_shape=tuple(out_shape),
      input_output_aliases=aliases,
      compiler_params=C.compiler_params(warps, plan.num_stages_down),
      interpret=interpret, early_trigger=early_trigger,
      name=(f"flint_moe_down_split{tag}{'_h16' if h16 else ''}_{fe}_{fs}_{method_down}_bn{bn_dn}"
            f"{'' if combine is None else '_combine' if c_norm else '_residual'}"
            f"{'_x16' if combine is not None and c_x16 else ''}"),
  )(*args)
  y = res[0].reshape(u + 1, m, d)
  if combine is not None:
    return (y, *res[1:])
  return y


def down_reference(h, hs, experts, shared, ids, *, slot_rows: str = "all"):
  """Plain jnp: y [U + 1, M, D] from ``gate_up_reference``'s (h, hs): y[u, t] =
  bf16(h[u, t] . down_{ids[u]}^T * scale_2) (``slot_rows`` "token": h [U, 1, I], y[u] only at
  token u // top_k, the other rows zero), y[U] = the shared expert's."""
  fe = T.expert_format(experts)
  fs = "bf16" if not isinstance(shared["down_proj"], (tuple, list)) else "nvfp4"
  dt = hs.dtype
  top_k = ids.shape[1]
  m = ids.shape[0]
  _, dn, _, s_dn = selected_experts(experts, ids.reshape(-1), fe)     # [U, D, I]
  y = (jnp.einsum("umi,udi->umd", h, dn, preferred_element_type=jnp.float32,
                  precision=lax.Precision.HIGHEST) * s_dn[:, None, None]).astype(dt)
  if slot_rows == "token":
    uu = m * top_k
    y = jnp.zeros((uu, m, y.shape[-1]), dt).at[jnp.arange(uu), jnp.arange(uu) // top_k].set(y[:, 0])
  y_s = ref_linear(hs, shared["down_proj"], fs).astype(dt)
  return jnp.concatenate([y, y_s[None]], axis=0)
