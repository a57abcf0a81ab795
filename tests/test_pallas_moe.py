"""The routed MoE (``pallas.moe``) against its references, on the ``MoEPlan`` of every (format,
batch) the decode step runs and on a few tile overrides.

Interpret mode on the CPU (the NVFP4 ``asm`` decode falls back to ``fp8``), compiled on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C
from flint_jax.pallas.moe import (MoERoute, moe_combine_add_rms_norm,
                                  moe_combine_add_rms_norm_reference, moe_decode_routed,
                                  moe_decode_routed_combine, moe_decode_routed_reference,
                                  moe_plan, moe_route_from_logits, moe_router_logits,
                                  moe_topk_route, moe_topk_route_pallas)
from flint_jax.pallas.moe import routing
from flint_jax.pallas.moe.down import down_reference
from flint_jax.pallas.moe.gate_up import gate_up_reference
from flint_jax.pallas.nvfp4_gemv import x16_operand
from pallas_testing import (assert_close, randn, random_moe_weights, rel_l2, rng, tie_logits,
                            triton_modules)

INTERPRET = jax.default_backend() == "cpu"
DECODE = "fp8" if INTERPRET else "asm"


# ------------------------------------------------------------------------------------------
# Routing


def _topk_ids_kernel(l_ref, ids_ref, vals_ref, *, top_k, n_exp, ep):
  t = pl.program_id(0)
  for j, (idx, v) in enumerate(routing._topk_logits(l_ref, t, top_k, n_exp, ep)):  # pylint: disable=protected-access
    ids_ref[t, j] = idx
    vals_ref[t, j] = v


def kernel_topk(logits, top_k):
  """The in-kernel top-k of the gate_up kernel, as (ids, logits)."""
  m, e = logits.shape
  kern = functools.partial(_topk_ids_kernel, top_k=top_k, n_exp=e, ep=C.next_pow2(e))
  return pl.pallas_call(
      kern, grid=(m,), interpret=True,
      out_shape=(jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((m, top_k), jnp.float32)))(logits)


def assert_route_is_top_k(route, logits, top_k):
  """route == lax.top_k(logits): ids (order, lowest index first among equal logits) and the
  selected logits, bit for bit."""
  m = logits.shape[0]
  assert isinstance(route, MoERoute)
  assert route.ids.shape == route.logits.shape == (m, top_k)
  assert route.ids.dtype == jnp.int32 and route.logits.dtype == jnp.float32
  want_v, want_ids = jax.lax.top_k(logits, top_k)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(route.logits).view(np.uint32),
                                np.asarray(want_v).view(np.uint32))


@pytest.mark.parametrize("m,e,top_k,ties", [(1, 16, 6, False), (3, 20, 4, False),
                                            (8, 256, 6, False), (16, 32, 2, False),
                                            (5, 16, 6, True), (8, 20, 5, True),
                                            (2, 256, 6, True)])
def test_topk_logits_matches_lax_top_k(m, e, top_k, ties):
  """In-kernel ids (and order) == lax.top_k's, lowest index first among equal logits; == the
  top-k of the sigmoid scores when sigmoid keeps the logits distinct."""
  gen = rng("topk", m, e, top_k, ties)
  lg = tie_logits(gen, m, e) if ties else randn(gen, (m, e), jnp.float32, 2.0)
  ids, vals = kernel_topk(lg, top_k)
  assert_route_is_top_k(MoERoute(ids, vals), lg, top_k)
  assert_route_is_top_k(moe_topk_route(lg, top_k=top_k), lg, top_k)
  np.testing.assert_array_equal(np.asarray(moe_route_from_logits(lg, top_k=top_k)[0]),
                                np.asarray(ids))
  if ties:   # lowest index first, explicitly: the all-equal row picks 0, 1, ..., k-1
    np.testing.assert_array_equal(np.asarray(ids)[0], np.arange(top_k))
  _, want_sig = jax.lax.top_k(jax.nn.sigmoid(lg), top_k)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_sig))


@pytest.mark.parametrize("m,e,top_k,ties", [(1, 256, 6, False), (8, 256, 6, True),
                                            (5, 20, 4, True), (3, 16, 16, False)])
def test_moe_topk_route_pallas(m, e, top_k, ties):
  """The one-program-per-token top-k kernel equals lax.top_k bit for bit, E not a power of two
  and top_k = E included."""
  gen = rng("topk", m, e, top_k, ties)
  logits = tie_logits(gen, m, e) if ties else randn(gen, (m, e), jnp.float32)
  assert_route_is_top_k(moe_topk_route_pallas(logits, top_k=top_k, interpret=INTERPRET),
                        logits, top_k)


# ------------------------------------------------------------------------------------------
# gate_up + down on every plan the decode step runs


def _routed_case(fmt, m, e, top_k, d, inter, inter_s, ties, *params):
  gen = rng("routed", fmt, m, e, top_k, d, inter, inter_s, ties, *params)
  experts, shared = random_moe_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  # logits ~ N(0, 1), as a trained router's
  router = randn(gen, (e, d), jnp.float32, d ** -0.5)
  logits = tie_logits(gen, m, e) if ties else moe_router_logits(x, router)
  return gen, experts, shared, x, logits


def used_rows(y, top_k):
  """The rows of y [M * top_k + 1, M, D] every plan defines (and the combine reads):
  y[t * top_k + j, t] for all (t, j), then the shared expert's M rows."""
  m = y.shape[1]
  u = jnp.arange(m * top_k)
  return jnp.concatenate([y[u, u // top_k], y[m * top_k]], axis=0)


def assert_routed_close(y, ref, top_k, plan, what):
  """y vs the reference: every row on all-rows slots, the defined rows on per-token slots."""
  assert y.shape == ref.shape
  if plan.slot_rows == "all":
    assert_close(y, ref, what=what)
  else:
    assert_close(used_rows(y, top_k), used_rows(ref, top_k), what=what)


def _formats(fmt):
  return ("bf16", "nvfp4") if fmt == "mixed" else (fmt, fmt)


# (format, M): the decode step's plans (BF16 all-rows at 1 and 5-16, per-token at 2-4; NVFP4
# per-token f16 everywhere, prerouted from M = 2: M = 3 stands for 2-16, at M = 8 the decode step
# runs it in tests/test_fast_decode.py), and bf16 experts with an NVFP4 shared expert
STEP_CASES = [("bf16", 1), ("bf16", 3), ("bf16", 6), ("nvfp4", 1), ("nvfp4", 3), ("mixed", 2)]


@pytest.mark.parametrize("fmt,m", STEP_CASES)
def test_moe_decode_routed_step_plans(fmt, m):
  """``moe_decode_routed`` on ``moe_plan``'s choices vs the reference routed by lax.top_k of
  the logits (a wrong expert id in either kernel changes whole rows of y); the routing the
  kernels used is lax.top_k's bit for bit, and the plan given explicitly is the default."""
  e, top_k = (20, 4) if m == 3 else (16, 6)     # E not a power of two
  _, experts, shared, x, logits = _routed_case(fmt, m, e, top_k, 256, 64, 128, m == 3)
  plan = moe_plan(*_formats(fmt), m)
  kw = dict(top_k=top_k, decode=DECODE, interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, plan=plan, **kw)
  ref, ref_route = moe_decode_routed_reference(x, logits, experts, shared, top_k=top_k)
  assert y.shape == (m * top_k + 1, m, 256)
  assert_route_is_top_k(route, logits, top_k)
  np.testing.assert_array_equal(np.asarray(ref_route.ids), np.asarray(route.ids))
  assert_routed_close(y, ref, top_k, plan, f"moe routed {fmt} M={m}")
  y_default, _ = moe_decode_routed(x, logits, experts, shared, **kw)
  # the rows the plan defines (per-token slots leave the others unwritten: garbage on a GPU)
  defined = (lambda a: a) if plan.slot_rows == "all" else (lambda a: used_rows(a, top_k))
  np.testing.assert_array_equal(np.asarray(defined(y_default), np.float32),
                                np.asarray(defined(y), np.float32))
  if plan.gate_up_f16:   # the f16 K steps move h by less than its bf16 rounding
    y32, _ = moe_decode_routed(x, logits, experts, shared, plan=moe_plan(fmt, fmt, m, f16=False),
                               **kw)
    assert 0 < rel_l2(used_rows(y, top_k), used_rows(y32, top_k)) < 5e-3
    # the operand given (as add_rms_norm(x16=True) writes it): the same y
    y1, _ = moe_decode_routed(x, logits, experts, shared, plan=plan, x16_rows=x16_operand(x),
                              **kw)
    np.testing.assert_array_equal(np.asarray(used_rows(y1, top_k), np.float32),
                                  np.asarray(used_rows(y, top_k), np.float32))


def test_gate_up_and_down_references():
  """The per-kernel references compose to the whole op's."""
  _, experts, shared, x, logits = _routed_case("nvfp4", 3, 16, 4, 128, 64, 128, False, "refs")
  ref, route = moe_decode_routed_reference(x, logits, experts, shared, top_k=4)
  for slot_rows in ("all", "token"):
    h, hs = gate_up_reference(x, experts, shared, route.ids, slot_rows=slot_rows)
    y = down_reference(h, hs, experts, shared, route.ids, slot_rows=slot_rows)
    got = y if slot_rows == "all" else used_rows(y, 4)
    want = ref if slot_rows == "all" else used_rows(ref, 4)
    if INTERPRET:   # the same XLA ops on the CPU: bit for bit
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    else:           # a GPU's XLA fuses the two compositions differently: bf16 roundings move
      assert_close(got, want, what=f"composed references, slot_rows={slot_rows}")


@pytest.mark.parametrize("m,d,split_k", [(1, 512, 2), (1, 256, 4), (2, 256, 2)])
def test_moe_decode_routed_gate_up_split_k(m, d, split_k):
  """BF16 gate_up in K slices with a counter (the batch-1 step's): the last slice of each tile
  finishes h. The same outputs as the unsplit kernels (up to the fp32 summation order), and the
  counter comes back zeroed, so it can serve the next call (twice here)."""
  _, experts, shared, x, logits = _routed_case("bf16", m, 16, 3, d, 64, 128, False, "fin")
  kw = dict(top_k=3, interpret=INTERPRET)
  counter = jnp.zeros((300,), jnp.int32)
  plan = moe_plan("bf16", "bf16", m, gate_up_split_k=split_k)
  assert plan.slot_rows == "all"
  y1, _ = moe_decode_routed(x, logits, experts, shared, **kw)    # unsplit (default plan)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=3)
  for _ in range(2):
    y, route, counter = moe_decode_routed(x, logits, experts, shared, plan=plan,
                                          gate_up_counter=counter, **kw)
    assert_route_is_top_k(route, logits, 3)
    assert not np.asarray(counter).any(), "the counter must come back zeroed"
    assert_close(y, ref, what="finish vs reference")
    assert_close(used_rows(y, 3), used_rows(y1, 3), what="finish vs unsplit")
  with pytest.raises(ValueError, match="counter must be int32 zeros"):
    moe_decode_routed(x, logits, experts, shared, plan=plan,
                      gate_up_counter=jnp.zeros((3,), jnp.int32), **kw)
  with pytest.raises(ValueError, match="needs its counter"):
    moe_decode_routed(x, logits, experts, shared, plan=plan, **kw)


@pytest.mark.parametrize("fmt,m,tiles", [
    ("bf16", 1, dict(block_n_down=32, block_k_down=64, num_warps_down=2)),
    ("nvfp4", 1, dict(block_n_down=32, num_stages_down=3)),
    ("bf16", 3, dict(block_n=32, block_k=64, num_warps=2)),
    ("nvfp4", 8, dict(block_n=32, block_n_down=64)),
])
def test_moe_plan_tile_overrides(fmt, m, tiles):
  """Tile overrides of ``moe_plan`` (block sizes, warps, stages of either kernel) compute the
  same op: several K steps over I in the down kernel, other column blocks."""
  _, experts, shared, x, logits = _routed_case(fmt, m, 16, 3, 256, 128, 256, False, "tiles")
  plan = moe_plan(fmt, fmt, m, **tiles)
  y, _ = moe_decode_routed(x, logits, experts, shared, top_k=3, plan=plan, decode=DECODE,
                           interpret=INTERPRET)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=3)
  assert_routed_close(y, ref, 3, plan, f"tiles {tiles}")


def test_moe_plan_checks():
  """A plan for other weights or rows, f16 on BF16 experts, K slices on NVFP4: clear errors."""
  _, experts, shared, x, logits = _routed_case("bf16", 2, 16, 3, 128, 64, 128, False, "plan")
  with pytest.raises(ValueError, match="MoEPlan of these weights at M=2"):
    moe_decode_routed(x, logits, experts, shared, top_k=3, plan=moe_plan("bf16", "bf16", 3),
                      interpret=True)
  with pytest.raises(ValueError, match="MoEPlan of these weights"):
    moe_decode_routed(x, logits, experts, shared, top_k=3, plan=moe_plan("nvfp4", "nvfp4", 2),
                      interpret=True)
  with pytest.raises(ValueError, match="f16 needs NVFP4 experts"):
    moe_plan("bf16", "bf16", 2, f16=True)
  with pytest.raises(ValueError, match="gate_up_split_k > 1 needs bf16"):
    moe_plan("nvfp4", "nvfp4", 1, gate_up_split_k=2)
  with pytest.raises(ValueError, match="1..16 rows"):
    moe_plan("bf16", "bf16", 17)


def test_moe_plan_per_token_f16_lowers_for_h200():
  """The NVFP4 plan's kernels compiled for an H200: the gate_up and down kernels multiply in
  f16x2 (``_x16_`` / ``_h16_``), the block sums where the tile holds 16 code bytes per thread
  (M = 8: the accumulating asm), the pair sums below (M = 1, D = 256: 8 bytes)."""
  for m, block_sums in ((8, True), (1, False)):
    _, experts, shared, x, logits = _routed_case("nvfp4", m, 32, 6, 256, 128, 256, False, "gpu")
    mods = triton_modules(lambda x_, l_: moe_decode_routed(
        x_, l_, experts, shared, top_k=6, decode="asm"), x, logits)
    names = [mod["name"] for mod in mods]
    (gate_up,) = [mod for mod in mods if mod["name"].startswith("flint_moe_gate_up")]
    assert "_x16_" in gate_up["name"] and "fma.rn.f16x2" in gate_up["asm"], names
    assert any("down" in n and "_h16_" in n for n in names), names
    assert ("mov.b32 $0, alo" in gate_up["asm"]) == block_sums, m
    assert any(n.startswith("flint_moe_topk") for n in names) == (m > 1), names


# ------------------------------------------------------------------------------------------
# The combine


@pytest.mark.parametrize("m,e,top_k,d,ties", [(1, 16, 6, 256, False), (3, 20, 4, 300, True),
                                              (8, 256, 6, 2048, False), (16, 32, 2, 128, True)])
def test_moe_combine_add_rms_norm(m, e, top_k, d, ties):
  """The combine + residual add + RMSNorm kernel (on the selected logits) vs its reference on
  random expert outputs, and vs the combine written out in numpy."""
  gen = rng("combine", m, e, top_k, d, ties)
  y = randn(gen, (m * top_k + 1, m, d))
  lg = tie_logits(gen, m, e) if ties else randn(gen, (m, e), jnp.float32, 2.0)
  h = randn(gen, (m, d), scale=4.0)
  w = randn(gen, (d,), scale=0.3) + 1
  top = moe_topk_route(lg, top_k=top_k).logits                         # [M, top_k]
  s, xn = moe_combine_add_rms_norm(h, y, top, w, interpret=INTERPRET)
  s_ref, xn_ref = moe_combine_add_rms_norm_reference(h, y, top, w)
  assert_close(s, s_ref, what="s")
  assert_close(xn, xn_ref, what="x_next")
  # moe = bf16(sum_j w_j y[t*k+j, t] + y[-1, t]) in top-k order
  sig = jax.nn.sigmoid(jax.lax.top_k(lg, top_k)[0])
  wt = np.asarray(sig / jnp.sum(sig, -1, keepdims=True))
  y32 = np.asarray(y, np.float32)
  moe = np.stack([sum(wt[t, j] * y32[t * top_k + j, t] for j in range(top_k)) + y32[-1, t]
                  for t in range(m)])
  s_np = np.asarray(h, np.float32) + np.asarray(jnp.asarray(moe, jnp.bfloat16), np.float32)
  assert_close(s, jnp.asarray(s_np, jnp.bfloat16), what="s vs numpy")


def test_moe_combine_add_rms_norm_bad_inputs():
  """The combine takes the selected logits [M, top_k] f32 (top_k from their shape), not the
  router's [M, E]."""
  m, k, d, e = 2, 4, 128, 16
  gen = rng("combine-bad")
  y, h, w = randn(gen, (m * k + 1, m, d)), randn(gen, (m, d)), randn(gen, (d,))
  lg = randn(gen, (m, e), jnp.float32)
  top = moe_topk_route(lg, top_k=k).logits
  with pytest.raises(ValueError, match="y must be"):       # full logits: top_k would be E
    moe_combine_add_rms_norm(h, y, lg, w, interpret=True)
  with pytest.raises(ValueError, match="top_logits must be"):
    moe_combine_add_rms_norm(h, y, top.astype(jnp.bfloat16), w, interpret=True)
  with pytest.raises(ValueError, match="top_logits must be"):
    moe_combine_add_rms_norm(h, y, top[:1], w, interpret=True)


@pytest.mark.parametrize("fmt,m", [("nvfp4", 1), ("bf16", 1), ("bf16", 3)])
def test_moe_decode_routed_combine(fmt, m):
  """The combine + residual add + next RMSNorm in the down kernel's last program: the same
  (s, x_next) as moe_decode_routed -> moe_combine_add_rms_norm (bit for bit in interpret mode:
  the same y values and formulas), the same routing, and the counter entries back at zero
  (twice, so a counter can serve the next call)."""
  _, experts, shared, x, logits = _routed_case(fmt, m, 16, 3, 256, 64, 128, False, "cmb")
  gen = rng("cmb-h")
  h, w_next = randn(gen, (m, 256)), randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, **kw)
  s_want, x_want = moe_combine_add_rms_norm(h, y, route.logits, w_next, interpret=INTERPRET)
  counter = jnp.zeros((64,), jnp.int32)
  for _ in range(2):
    s_got, x_got, route2, counter = moe_decode_routed_combine(
        x, logits, experts, shared, h, w_next, counter, counter_base=20, **kw)
    np.testing.assert_array_equal(np.asarray(route2.ids), np.asarray(route.ids))
    np.testing.assert_array_equal(np.asarray(s_got, np.float32), np.asarray(s_want, np.float32))
    if INTERPRET:
      np.testing.assert_array_equal(np.asarray(x_got, np.float32),
                                    np.asarray(x_want, np.float32))
    else:   # the row's mean square is reduced by another number of warps than the combine's
      assert_close(x_got, x_want, what="x_next")
    assert not np.asarray(counter).any(), "the counter entries must come back zeroed"
  with pytest.raises(ValueError, match="counter"):
    moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter, counter_base=60,
                              **kw)


@pytest.mark.parametrize("fmt,m", [("nvfp4", 1), ("bf16", 3), ("nvfp4", 4)])
def test_moe_decode_routed_combine_without_norm(fmt, m):
  """norm=False (the NVFP4 batch-1 step's): each column block's last program writes that
  block's s and its fp32 sum of squares; s equals the norm=True call's bit for bit, the sums
  equal s's (up to fp32 order), and the counter entries come back zero (twice)."""
  _, experts, shared, x, logits = _routed_case(fmt, m, 16, 3, 256, 64, 128, False, "res")
  gen = rng("res-h")
  h, w_next = randn(gen, (m, 256)), randn(gen, (256,)) + 1.0
  plan = moe_plan(fmt, fmt, m)
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, counter_base=20, plan=plan)
  counter = jnp.zeros((256,), jnp.int32)
  s_want, _, route, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next,
                                                        counter, **kw)
  bn = C.pow2_divisor(256, plan.block_n_down)
  for _ in range(2):
    s_got, sumsq, route2, counter = moe_decode_routed_combine(
        x, logits, experts, shared, h, w_next, counter, norm=False, **kw)
    np.testing.assert_array_equal(np.asarray(route2.ids), np.asarray(route.ids))
    np.testing.assert_array_equal(np.asarray(s_got, np.float32), np.asarray(s_want, np.float32))
    assert sumsq.shape == (m, 256 // bn) and sumsq.dtype == jnp.float32
    s32 = np.asarray(s_got, np.float32)
    np.testing.assert_allclose(np.asarray(sumsq), (s32 ** 2).reshape(m, -1, bn).sum(-1),
                               rtol=1e-5)
    assert not np.asarray(counter).any(), "the counter entries must come back zeroed"


def test_moe_decode_routed_combine_x16_next():
  """x16_next (the NVFP4 batch-1 step's last layer): also x_next's f16 operand, equal to
  ``x16_operand(x_next)`` bit for bit; an error without the norm."""
  _, experts, shared, x, logits = _routed_case("nvfp4", 1, 16, 3, 256, 64, 128, False, "x16n")
  gen = rng("x16n-h")
  h, w_next = randn(gen, (1, 256)), randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, counter_base=20)
  counter = jnp.zeros((64,), jnp.int32)
  s, xn, _, counter, (x16, inv) = moe_decode_routed_combine(
      x, logits, experts, shared, h, w_next, counter, x16_next=True, **kw)
  want16, want_inv = x16_operand(xn)
  np.testing.assert_array_equal(np.asarray(x16).view(np.uint16),
                                np.asarray(want16).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(want_inv))
  assert not np.asarray(counter).any()
  with pytest.raises(ValueError, match="needs norm=True"):
    moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter, x16_next=True,
                              norm=False, **kw)
