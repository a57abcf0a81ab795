"""Prototype (issue #43): one MoE layer of the batch-1 BF16 decode step as ONE persistent kernel.

``persistent_moe_layer`` replaces today's chain for the part of a layer after attention
(``add_rms_norm_router`` -> ``moe_decode_routed`` (gate_up, down) -> ``norm_qkv``, 3-4 launches)
by one Pallas (Triton backend) ``pallas_call`` of G resident programs (G = the SM count, 132 on
an H200). Math (batch 1, fp32 accumulation, the same rounding points as the chain):

  s1     = bf16(h + a)                      x = bf16(w_post * RMSNorm(s1))     (add_rms_norm)
  logits = f32(x) . router_w^T  [E]         top-k of the logits, c_j = sigmoid(l_j) / sum (fp32)
  act_j  = bf16(silu(bf16(x.Wg_e)) * bf16(x.Wu_e))   for the K routed slots and the shared expert
  y_j    = bf16(act_j . Wd_e^T)             moe = bf16(sum_j c_j y_j + y_shared)  (top-k order)
  s      = bf16(s1 + moe)                   x2 = bf16(w_in * RMSNorm(s))
  qkv    = bf16(x2 . Wqkv^T)                (the next layer's fused q|k|v projection)

Every program runs the stages in order; dependencies are arrival counters in global memory
(``counters``), never a grid barrier between all stages' work:

  A  s1, x (redundantly per program: D = 2048 values), router rows ``p, p+G, ..`` -> logits
     scratch; arrive ROUTER.
  B  issue the loads of the program's first gate_up rows (the shared expert's: their address
     does not depend on the routing; programs p >= I_s / block_gu have none), wait ROUTER == G,
     top-k of the E logits (every program).
  C  gate_up row groups (``block_gu`` rows of gate and of up), round-robin over programs, the
     shared expert's groups first (so every program's first group is prefetchable in B);
     act -> scratch; one arrival per group on the slot's counter (SLOT + j; shared: SLOT + K).
  D  each program owns ``block_down`` output rows: loads the shared down rows, then per slot
     issues the NEXT slot's down rows before waiting for the current slot's activations
     (weights are immutable: they stream while the activation is produced); the combine is a
     local fp32 sum (no atomics on the output); s = bf16(s1 + moe) -> ``s``; arrive S.
  E  issue the loads of the first q|k|v rows, wait S == G, RMSNorm of s, q|k|v row groups.
     (The q|k|v rows are not prefetched as early as B, although their address is known there:
     held in registers through C and D they would cost the stream its double buffer.)
  end  arrive DONE; the last arriver zeroes every counter (all programs are past their last
     wait when they arrive), so ``counters`` is zero between calls, like ``KVCache.counters``.

Within each stage the weight stream is double-buffered by hand (the next group's tiles are
loaded before the current group is reduced: ``_stream``), and the first tiles of stages C and E
come from the prefetch issued before the stage's wait.

Load ordering: a prefetch is written before its spin loop, and the acquire that ends the wait
is an acq_rel atomic, whose release half keeps earlier loads before it -- but a load may still
legally move from before the spin loop to between the loop and that atomic. With
``hold_prefetch`` (default) the stage-boundary prefetches (B, E) pass through a non-pure
inline-asm ``mov`` with a memory clobber (``_hold``) before the spin loop: that pins them for
LLVM, not for ptxas (which sees a plain mov). The CPU lowering test checks the order in the
Triton IR. Checked once by hand (this TTIR compiled on a CPU with pip's triton 3.6.0 for
sm_90a, its ptxas and cuobjdump; XLA's bundled Triton may differ): in the SASS, with and
without the hold, the B and E prefetches' LDG.E.128s precede their spin loops, and each
down-stage wait on slot j is preceded by slot j + 1's tile loads -- except slot 0's tile,
which ptxas sank past the shared expert's wait (issued right after it instead: 16 KB per
program lose their overlap). 172 registers at 8 warps (242 with block_gu = block_qkv = 8), no
spills, so one 256-thread program fits an SM (4 warps spill).

CO-RESIDENCY: every program spins on counters that other programs advance, so ALL G programs
must be resident at once (G <= SMs, one program per SM, nothing else filling the GPU) or the
kernel deadlocks. Do not launch it with an early-triggered successor that could occupy SMs.
Counter values are int32 and reset every call; an aborted call leaves them non-zero.

Interpret mode (CPU) runs programs one after another, so the spin-waits cannot be concurrent:
there the grid is (4 phases, G) -- every program runs phase A, then every program phase B+C, ...
-- with the same code per phase (x and the routing are recomputed per phase), and a wait only
records in ``counters[CHECK * STRIDE]`` whether its counter had already reached the target
(it must: a wrong target or stage order shows there instead of hanging). The GPU run checks
concurrency.

Shapes / dtypes (batch 1): a, h [1, D] bf16; w_post, w_in [D] (any float); router_w [E, D] f32;
experts ``gate_up_proj`` [E, 2I, D] (gate rows first), ``down_proj`` [E, D, I] bf16; shared
``gate_proj``, ``up_proj`` [Is, D], ``down_proj`` [D, Is] bf16; wqkv [N, D] bf16 (q|k|v rows
concatenated once, at load time: N = 5120 for Flint); counters int32 [N_COUNTERS] zeros.
D, I, Is powers of two. Returns (s [1, D] bf16, qkv [1, N] bf16, ids [1, K] int32, top logits
[1, K] f32, counters).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas import _common as C
from flint_jax.pallas import add_rms_norm as ARN
from flint_jax.pallas import pdl
from flint_jax.pallas.add_rms_norm_router import add_rms_norm_router_reference
from flint_jax.pallas.moe import moe_decode_routed_reference
from flint_jax.pallas.moe.routing import topk_select
from flint_jax.pallas.norm_qkv import norm_qkv_reference

__all__ = ["persistent_moe_layer", "persistent_moe_layer_reference", "N_COUNTERS"]

# counters: ROUTER, SLOT + j (j < K routed, K = shared), then S, DONE; CHECK (interpret only)
_normalize = ARN._normalize   # pylint: disable=protected-access  (add_rms_norm's formula)

ROUTER, SLOT = 0, 1
N_SLOTS = 16                       # logical counters; CHECK the last
CHECK = N_SLOTS - 1
STRIDE = 32                        # one 128-byte line per counter: polls of one counter do not
N_COUNTERS = N_SLOTS * STRIDE      # contend with the atomics on another


# ------------------------------------------------------------------------------------------
# Primitives: hold (pins a prefetched tile before a spin loop), arrive, wait

_hold_p = jax_core.Primitive("flint_persistent_hold")
_hold_p.def_impl(lambda x: x)
_hold_p.def_effectful_abstract_eval(lambda x: (x, {pdl.EFFECT}))
mlir.register_lowering(_hold_p, lambda ctx, x: [x])      # interpret / CPU: identity


@triton_lowering.register_lowering(_hold_p)
def _hold_lowering(ctx, x):  # noqa: ARG001
  # non-pure asm with a memory clobber: its operand's load must have completed, and LLVM moves
  # no memory access across it (pdl.py's idiom); bf16 pairs travel as one 32-bit register
  return tt_dialect.elementwise_inline_asm([x.type], "mov.b32 $0, $1;",
                                           constraints="=r,r,~{memory}", pure=False,
                                           packed_element=2, args=[x])


# %globaltimer_lo (ns, wraps every 4.3 s) for ``timestamps``: effectful, memory clobber
_clock_p = pdl._asm_primitive(   # pylint: disable=protected-access
    "flint_persistent_globaltimer_lo", "mov.u32 $0, %globaltimer_lo;", "=r,~{memory}")
N_STAMPS = 8   # start, A done, routing known, C done, D done, s known, end (+1 spare)


def _hold(tile, enabled):
  return _hold_p.bind(tile) if enabled else tile


def _arrive(cnt, idx, interpret, n=1):
  """Counts this program's stores done on counters[idx] (CTA barrier, then one acq_rel atomic)."""
  if not interpret:    # every thread's stores precede the arrival (no CPU lowering)
    plgpu.debug_barrier()
  return plgpu.atomic_add(cnt, (jnp.asarray(idx, jnp.int32) * STRIDE,), jnp.int32(n))


def _wait(cnt, idx, target, interpret):
  """Spins until counters[idx] >= target; -> int32 0, data-dependent on the acquiring atomic
  (add it to the dependent loads' addresses so they cannot move above it). Interpret mode: the
  phases are ordered, so the counter must already be there; if not, the CHECK counter = 1."""
  idx = jnp.asarray(idx, jnp.int32) * STRIDE
  if interpret:
    seen = cnt[idx]

    @pl.when(seen < target)
    def _():
      cnt[CHECK * STRIDE] = jnp.int32(1)
    return jnp.int32(0)
  poll = lambda _: plgpu.load(cnt.at[(idx,)], volatile=True)  # noqa: E731
  seen = lax.while_loop(lambda v: v < target, poll, poll(0))
  acquired = plgpu.atomic_add(cnt, (idx + jnp.minimum(seen, target) - target,), jnp.int32(0))
  return jnp.minimum(acquired, target) - target


def _stream(n, n_max, load, body, first):
  """for i < n (traced, <= n_max static): body(i, tiles_i), the tiles of i + 1 loaded
  (``load(i + 1, valid)``, masked off past the end) before body(i) reduces tile i: a hand-made
  double buffer. (A static trip count: interpret mode cannot discharge this loop as a while.)"""
  def step(i, cur):
    nxt = load(i + 1, i + 1 < n)
    pl.when(i < n)(lambda: body(i, cur))
    return nxt
  lax.fori_loop(0, n_max, step, first)


def _n_mine(n, p, g):
  """How many of the round-robin groups p, p + g, .. < n program p owns (traced)."""
  return jnp.maximum(n - p + g - 1, 0) // g


def _gemv(w, x32):
  """[R, K] weight tile . x [K] f32 -> [R] f32 (CUDA cores, exact products, fp32 sum)."""
  return jnp.sum(w.astype(jnp.float32) * x32[None, :], axis=1)


# ------------------------------------------------------------------------------------------
# Kernel


def _kernel(a_ref, h_ref, wp_ref, rw_ref, gu_ref, dn_ref, sg_ref, su_ref, sd_ref, wi_ref, wq_ref,
            cnt_in, s_ref, qkv_ref, ids_ref, top_ref, cnt, lg_scr, act_scr, *st_ref, g, d,
            n_exp, ep, k, inter, inter_s, n_qkv, bgu, bdn, bq, br, eps, hold, interpret):
  del cnt_in                                      # aliased to cnt
  S_, DONE = SLOT + k + 1, SLOT + k + 2
  p = pl.program_id(1 if interpret else 0)

  def stamp(i):
    """timestamps: this program's %globaltimer_lo at point i (``N_STAMPS``)."""
    if st_ref:
      plgpu.store(st_ref[0].at[p, jnp.int32(i)], _clock_p.bind())
  cols = jnp.arange(d, dtype=jnp.int32)
  n_sh, n_rt = inter_s // bgu, inter // bgu      # gate_up groups: shared expert / per slot
  n_gu = n_sh + k * n_rt
  n_r = C.cdiv(n_exp, br)                        # router groups

  def norm_x():
    """x f32 [D] (its bf16 values): add_rms_norm's formula op for op on s1 = bf16(h + a)."""
    hh = h_ref[0, cols]
    s1 = (hh.astype(jnp.float32) + a_ref[0, cols].astype(jnp.float32)).astype(hh.dtype)
    x = _normalize(s1.astype(jnp.float32), wp_ref[cols].astype(jnp.float32), d, eps)
    return x.astype(hh.dtype).astype(jnp.float32)

  # ---- stage A: router logits of this program's expert rows
  def load_router(i, valid):
    rows = (p + i * g) * br + jnp.arange(br, dtype=jnp.int32)
    ok = valid & (rows < n_exp)
    return plgpu.load(rw_ref.at[jnp.minimum(rows, n_exp - 1)[:, None], cols[None, :]],
                      mask=ok[:, None], other=0.0)

  def stage_a():
    n = _n_mine(n_r, p, g)
    first = load_router(0, n > 0)                # streams under the norm
    x32 = norm_x()

    def body(i, w):
      rows = (p + i * g) * br + jnp.arange(br, dtype=jnp.int32)
      plgpu.store(lg_scr.at[rows], _gemv(w, x32), mask=rows < n_exp)
    _stream(n, C.cdiv(n_r, g), load_router, body, first)
    _arrive(cnt, ROUTER, interpret)
    return x32

  # ---- stage B: the routing (after the ROUTER wait), every program
  def routing(z):
    ec = jnp.arange(ep, dtype=jnp.int32)
    lg = plgpu.load(lg_scr.at[z + jnp.minimum(ec, n_exp - 1)], mask=ec < n_exp,
                    other=-jnp.inf, volatile=True)
    sel = list(topk_select(lg, ec, ec >= n_exp, k, n_exp))
    sig = [jax.nn.sigmoid(v) for _, v in sel]
    den = sig[0]
    for sj in sig[1:]:
      den = den + sj                             # top-k order, as the combine adds them
    return [e for e, _ in sel], [v for _, v in sel], [sj / den for sj in sig]

  # ---- stage C: gate_up row groups gi = p, p + G, ..: shared expert's groups, then slots
  def gu_place(i, ids):
    gi = p + i * g
    is_sh = gi < n_sh
    q = jnp.maximum(gi - n_sh, 0)
    j = jnp.minimum(q // n_rt, k - 1)
    e = None
    if ids is not None:
      e = ids[0]
      for jj in range(1, k):
        e = jnp.where(j == jj, ids[jj], e)
    r_sh = jnp.minimum(gi, n_sh - 1) * bgu
    r_rt = (q % n_rt) * bgu
    return is_sh, j, e, r_sh, r_rt

  def load_gu(ids):
    rr = jnp.arange(bgu, dtype=jnp.int32)

    def load(i, valid):
      is_sh, _, e, r_sh, r_rt = gu_place(i, ids)
      m_sh, m_rt = valid & is_sh, valid & jnp.logical_not(is_sh)
      idx_sh = ((r_sh + rr)[:, None], cols[None, :])
      wg = plgpu.load(sg_ref.at[idx_sh], mask=m_sh, other=0.0)
      wu = plgpu.load(su_ref.at[idx_sh], mask=m_sh, other=0.0)
      if ids is None:                            # before the routing: shared groups only
        return wg, wu
      wg_r = plgpu.load(gu_ref.at[e, (r_rt + rr)[:, None], cols[None, :]], mask=m_rt, other=0.0)
      wu_r = plgpu.load(gu_ref.at[e, (inter + r_rt + rr)[:, None], cols[None, :]], mask=m_rt,
                        other=0.0)
      return jnp.where(m_sh, wg, wg_r), jnp.where(m_sh, wu, wu_r)
    return load

  def stage_c(x32, ids, first):
    rr = jnp.arange(bgu, dtype=jnp.int32)

    def body(i, w):
      is_sh, j, _, r_sh, r_rt = gu_place(i, ids)
      gg = _gemv(w[0], x32).astype(jnp.bfloat16)
      uu = _gemv(w[1], x32).astype(jnp.bfloat16)
      act = C.silu_mul_f32(gg, uu).astype(act_scr.dtype)
      off = jnp.where(is_sh, k * inter + r_sh, j * inter + r_rt)
      plgpu.store(act_scr.at[off + rr], act)
      _arrive(cnt, SLOT + jnp.where(is_sh, k, j), interpret)
    _stream(_n_mine(n_gu, p, g), C.cdiv(n_gu, g), load_gu(ids), body, first)

  # ---- stage D: output rows r0 .. r0 + bdn: down of every slot, combine, residual add
  def stage_d(ids, coefs):
    rr = jnp.arange(bdn, dtype=jnp.int32)
    ic, ics = jnp.arange(inter, dtype=jnp.int32), jnp.arange(inter_s, dtype=jnp.int32)

    def group(i):
      r0 = (p + i * g) * bdn
      rows = r0 + rr
      load_j = lambda j: plgpu.load(dn_ref.at[ids[j], rows[:, None], ic[None, :]])  # noqa: E731
      w_cur = plgpu.load(sd_ref.at[rows[:, None], ics[None, :]])    # the shared expert's
      ys, tot = None, None
      for j in range(-1, k):                     # -1: the shared expert, then top-k order
        w_next = load_j(j + 1) if j + 1 < k else None   # issued BEFORE the wait on slot j
        slot = k if j < 0 else j
        z = _wait(cnt, SLOT + slot, n_sh if j < 0 else n_rt, interpret)
        act = plgpu.load(act_scr.at[z + slot * inter + (ics if j < 0 else ic)], volatile=True)
        y = _gemv(w_cur, act.astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
        if j < 0:
          ys = y
        else:
          tot = coefs[j] * y if tot is None else tot + coefs[j] * y
        w_cur = w_next
      moe = (tot + ys).astype(jnp.bfloat16)
      hh = h_ref[0, rows]
      s1 = (hh.astype(jnp.float32) + a_ref[0, rows].astype(jnp.float32)).astype(hh.dtype)
      plgpu.store(s_ref.at[jnp.int32(0), rows],
                  (s1.astype(jnp.float32) + moe.astype(jnp.float32)).astype(s_ref.dtype))

    n_dn = d // bdn

    def step(i, c):
      pl.when(i < _n_mine(n_dn, p, g))(lambda: group(i))
      return c
    lax.fori_loop(0, C.cdiv(n_dn, g), step, 0)
    _arrive(cnt, S_, interpret)

  # ---- stage E: the next layer's RMSNorm + q|k|v rows, round-robin groups of bq rows
  def load_qkv(i, valid):
    rows = jnp.minimum((p + i * g) * bq, n_qkv - bq) + jnp.arange(bq, dtype=jnp.int32)
    return plgpu.load(wq_ref.at[rows[:, None], cols[None, :]], mask=valid, other=0.0)

  def stage_e(first):
    z = _wait(cnt, S_, g, interpret)
    stamp(5)
    s = plgpu.load(s_ref.at[0, z + cols], volatile=True)
    x2 = _normalize(s.astype(jnp.float32), wi_ref[cols].astype(jnp.float32), d, eps)
    x2 = x2.astype(s.dtype).astype(jnp.float32)

    def body(i, w):
      rows = (p + i * g) * bq + jnp.arange(bq, dtype=jnp.int32)
      plgpu.store(qkv_ref.at[jnp.int32(0), rows], _gemv(w, x2).astype(qkv_ref.dtype))
    _stream(_n_mine(n_qkv // bq, p, g), C.cdiv(n_qkv // bq, g), load_qkv, body, first)
    old = _arrive(cnt, DONE, interpret)
    stamp(6)

    @pl.when(old == g - 1)                       # the last arriver: everyone is past every wait
    def _():
      for c in range(DONE + 1):
        plgpu.store(cnt.at[jnp.int32(c * STRIDE)], jnp.int32(0))

  def stage_bc():
    # the first gate_up group is the shared expert's (p < n_sh; G <= 256 at Flint size with
    # block_gu 4): loaded before the routing wait; a routed first group only after it
    pre = tuple(_hold(t, hold) for t in load_gu(None)(0, p < n_sh))
    z = _wait(cnt, ROUTER, g, interpret)
    stamp(2)
    ids, top, coefs = routing(z)
    if g > n_sh:
      late = load_gu(ids)(0, p >= n_sh)
      pre = tuple(jnp.where(p < n_sh, x, y) for x, y in zip(pre, late))

    @pl.when(p == 0)
    def _():
      for j in range(k):
        plgpu.store(ids_ref.at[jnp.int32(0), jnp.int32(j)], ids[j])
        plgpu.store(top_ref.at[jnp.int32(0), jnp.int32(j)], top[j])
    return ids, coefs, pre

  def prefetch_e():
    return _hold(load_qkv(0, p < n_qkv // bq), hold)

  if interpret:                                  # phases over the grid's first axis
    ph = pl.program_id(0)

    @pl.when(ph == 0)
    def _():
      stage_a()

    @pl.when(ph == 1)
    def _():
      ids, _, pre = stage_bc()
      stage_c(norm_x(), ids, pre)        # x recomputed: phases share no registers

    @pl.when(ph == 2)
    def _():
      ids, coefs, _ = stage_bc()
      stage_d(ids, coefs)

    @pl.when(ph == 3)
    def _():
      stage_e(prefetch_e())
    return

  stamp(0)
  x32 = stage_a()                                # x stays in registers through stage C
  stamp(1)
  ids, coefs, pre = stage_bc()
  stage_c(x32, ids, pre)
  stamp(3)
  stage_d(ids, coefs)
  stamp(4)
  stage_e(prefetch_e())


def _check(a, h, w_post, router_w, experts, shared, w_in, wqkv, counters, top_k, programs, bgu,
           bdn, bq, br):
  C.check(a.shape == h.shape and h.ndim == 2 and h.shape[0] == 1,
          f"a, h must be [1, D] (batch 1), got {a.shape=} {h.shape=}")
  d = h.shape[1]
  n_exp, two_i, _ = experts["gate_up_proj"].shape
  inter, inter_s = two_i // 2, shared["gate_proj"].shape[0]
  C.check(all(C.is_pow2(v) for v in (d, inter, inter_s)),
          f"D, I, I_s must be powers of two, got {d=} {inter=} {inter_s=}")
  C.check(experts["gate_up_proj"].shape == (n_exp, 2 * inter, d)
          and experts["down_proj"].shape == (n_exp, d, inter), "experts: bad shapes")
  C.check(shared["up_proj"].shape == (inter_s, d) and shared["down_proj"].shape == (d, inter_s),
          "shared: bad shapes")
  C.check(router_w.shape == (n_exp, d) and router_w.dtype == jnp.float32,
          f"router_w must be f32 [E, D], got {router_w.shape} {router_w.dtype}")
  C.check(w_post.shape == (d,) and w_in.shape == (d,), "norm weights must be [D]")
  C.check(wqkv.ndim == 2 and wqkv.shape[1] == d, f"wqkv must be [N, D], got {wqkv.shape}")
  C.check(counters.shape == (N_COUNTERS,) and counters.dtype == jnp.int32,
          f"counters must be int32 [{N_COUNTERS}] zeros")
  C.check(1 <= top_k <= min(n_exp, N_SLOTS - 4), f"bad {top_k=}")
  for name, v in (("block_gu", bgu), ("block_down", bdn), ("block_qkv", bq),
                  ("block_router", br)):
    C.check(C.is_pow2(v), f"{name} must be a power of two, got {v}")
  C.check(inter % bgu == 0 and inter_s % bgu == 0 and d % bdn == 0
          and wqkv.shape[0] % bq == 0, "block sizes must divide I, I_s, D and N")
  C.check(programs >= 1, f"programs must be >= 1, got {programs}")
  return d, n_exp, inter, inter_s


@functools.partial(jax.jit, static_argnames=(
    "top_k", "programs", "eps", "block_gu", "block_down", "block_qkv", "block_router",
    "num_warps", "hold_prefetch", "timestamps", "interpret"))
def persistent_moe_layer(a, h, w_post, router_w, experts, shared, w_in, wqkv, counters, *,
                         top_k: int = 6, programs: int = 132, eps: float = 1e-6,
                         block_gu: int = 4, block_down: int = 16, block_qkv: int = 4,
                         block_router: int = 2, num_warps: int = 8,
                         hold_prefetch: bool = True, timestamps: bool = False,
                         interpret: bool = False):
  """(s, qkv, ids, top_logits, counters): the module docstring's layer in one kernel.

  ``programs`` G: the grid; MUST be <= the number of SMs (all programs resident, or the
  spin-waits deadlock): 132 on an H200. ``block_*``: rows per group of gate_up (each of gate
  and up), of the output slice a program owns in the down stage, of q|k|v, of the router.
  ``counters`` int32 [N_COUNTERS] zeros, returned zeroed (aliased; thread it through calls).
  ``timestamps``: also returns int32 [G, N_STAMPS], each program's %globaltimer_lo (ns, mod
  2^32) at its start, stage A's end, the routing known, C's end, D's end, s known, its end
  (zeros in interpret mode): where the time goes.
  """
  d, n_exp, inter, inter_s = _check(a, h, w_post, router_w, experts, shared, w_in, wqkv,
                                    counters, top_k, programs, block_gu, block_down, block_qkv,
                                    block_router)
  n_qkv = wqkv.shape[0]
  kernel = functools.partial(
      _kernel, g=programs, d=d, n_exp=n_exp, ep=C.next_pow2(n_exp), k=top_k, inter=inter,
      inter_s=inter_s, n_qkv=n_qkv, bgu=block_gu, bdn=block_down, bq=block_qkv,
      br=block_router, eps=eps, hold=hold_prefetch, interpret=interpret)
  dt = h.dtype
  out_shape = (jax.ShapeDtypeStruct((1, d), dt), jax.ShapeDtypeStruct((1, n_qkv), dt),
               jax.ShapeDtypeStruct((1, top_k), jnp.int32),
               jax.ShapeDtypeStruct((1, top_k), jnp.float32),
               jax.ShapeDtypeStruct((N_COUNTERS,), jnp.int32),
               jax.ShapeDtypeStruct((n_exp,), jnp.float32),                   # logits scratch
               jax.ShapeDtypeStruct((top_k * inter + inter_s,), dt))          # act scratch
  if timestamps:
    out_shape += (jax.ShapeDtypeStruct((programs, N_STAMPS), jnp.int32),)
  grid = (4, programs) if interpret else (programs,)
  s, qkv, ids, top, cnt, _, _, *st = pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, input_output_aliases={11: 4},
      compiler_params=C.compiler_params(num_warps, 1), interpret=interpret,
      name=f"flint_persistent_moe_layer_g{programs}_d{d}_e{n_exp}_k{top_k}",
  )(a, h, w_post, router_w, experts["gate_up_proj"], experts["down_proj"], shared["gate_proj"],
    shared["up_proj"], shared["down_proj"], w_in, wqkv, counters)
  return (s, qkv, ids, top, cnt, *st)


def persistent_moe_layer_reference(a, h, w_post, router_w, experts, shared, w_in, wqkv, *,
                                   top_k: int = 6, eps: float = 1e-6, **unused_tuning):
  """Plain jnp, composed from today's chain's references: ``add_rms_norm_router_reference`` ->
  ``moe_decode_routed_reference`` -> ``norm_qkv_reference`` (MoE mode). -> (s, qkv, ids,
  top_logits)."""
  del unused_tuning
  s1, x, logits = add_rms_norm_router_reference(h, a, w_post, router_w, eps=eps)
  y, route = moe_decode_routed_reference(x, logits, experts, shared, top_k=top_k)
  s, (qkv,) = norm_qkv_reference(s1, (wqkv,), w_in, y=y, top_logits=route.logits, eps=eps)
  return s, qkv, route.ids, route.logits

