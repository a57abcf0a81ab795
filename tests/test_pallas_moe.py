"""moe_decode (and routing / slot building) vs the token-by-token reference, BF16 and NVFP4."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from flint_jax.pallas import (MoERoute, add_rms_norm_reference, moe_block,
                              moe_block_add_rms_norm, moe_block_add_rms_norm_reference,
                              moe_block_reference, moe_combine_add_rms_norm,
                              moe_combine_add_rms_norm_reference, moe_decode,
                              moe_decode_reference, moe_decode_routed,
                              moe_decode_routed_reference, moe_route_from_logits,
                              moe_route_weights, moe_router_logits, moe_topk_route)
from flint_jax.pallas import _common as C
from flint_jax.pallas.moe import moe_decode_routed_combine, moe_route, moe_slots
from flint_jax.pallas.moe import default_slot_rows, moe_topk_route_pallas
from flint_jax.pallas.testing import (abstract_moe_weights, assert_close, lower_for_h200, randn,
                                     random_moe_weights, rng, tie_logits)

INTERPRET = jax.default_backend() == "cpu"
DECODE = "fp8" if INTERPRET else "asm"
moe_mod = sys.modules["flint_jax.pallas.moe"]


def test_route_and_slots():
  m, e, d = 5, 32, 64
  gen = rng("route")
  x = randn(gen, (m, d))
  router = randn(gen, (e, d), jnp.float32)
  ids, w = moe_route(x, router, top_k=6)
  assert ids.shape == (m, 6) and ids.dtype == jnp.int32
  np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
  s = np.asarray(x, np.float32) @ np.asarray(router).T          # sigmoid is monotonic
  np.testing.assert_array_equal(np.sort(np.asarray(ids), -1),
                                np.sort(np.argsort(-s, -1)[:, :6], -1))
  ids = jnp.array([[3, 1, 7], [7, 2, 3]], jnp.int32)
  w = jnp.array([[.5, .3, .2], [.6, .3, .1]], jnp.float32)
  se, coef, n = moe_slots(ids, w, dedupe=True)
  assert int(n[0]) == 4 and list(np.asarray(se)[:4]) == [1, 2, 3, 7]
  np.testing.assert_allclose(np.asarray(coef)[:4], [[.3, 0], [0, .3], [.5, .1], [.2, .6]])
  assert np.all(np.asarray(coef)[4:] == 0)
  se, coef, n = moe_slots(ids, w, dedupe=False)
  assert int(n[0]) == 6 and list(np.asarray(se)) == [3, 1, 7, 7, 2, 3]
  np.testing.assert_allclose(np.asarray(coef)[:, 0], [.5, .3, .2, 0, 0, 0])


@pytest.mark.parametrize("fmt,m,dedupe,unroll,kw", [
    ("bf16", 1, None, True, dict(down_split=False)),    # fused combine, unrolled slot loop
    ("bf16", 3, True, False, dict(down_split=False, method="swap")),  # dedupe, fori_loop
    ("nvfp4", 1, None, None, {}),                       # defaults: reduce tiles, split down
    ("nvfp4", 1, None, True, dict(method="lanes", down_split=False)),   # lanes, fused combine
    ("mixed", 1, None, None, dict(method="lanes")),     # bf16 experts' lanes: [BN, BK] lanes
    ("nvfp4", 1, None, None, dict(method="blocks")),    # per-block sums, split down
    ("nvfp4", 8, True, None, {}),                       # 48 slots, tokens share experts
    ("mixed", 2, False, None, dict(method="swap", method_down="dot")),
    ("nvfp4", 3, True, None, dict(method="rows")),      # CUDA-core rows, Mp = 4, both kernels
    ("nvfp4", 2, False, None, dict(method="rows", method_down="dot")),  # mixed row padding
])
def test_moe_decode(fmt, m, dedupe, unroll, kw):
  e, d, inter, inter_s = 16, 256, 64, 128
  gen = rng(fmt, m, dedupe)
  experts, shared = random_moe_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  ids, w = moe_route(x, randn(gen, (e, d), jnp.float32))
  if dedupe:   # force experts shared across tokens: de-duplication must merge them
    ids = ids.at[1:, 0].set(ids[0, 0])
  out = moe_decode(x, ids, w, experts, shared, dedupe=dedupe, decode=DECODE,
                   unroll_slots=unroll, interpret=INTERPRET, **kw)
  ref = moe_decode_reference(x, ids, w, experts, shared)
  assert_close(out, ref, what=f"moe {fmt}")


@pytest.mark.skipif(INTERPRET, reason="Flint-sized MoE (256 experts) is slow in interpret mode")
@pytest.mark.parametrize("fmt,m", [("bf16", 1), ("nvfp4", 1), ("bf16", 8), ("nvfp4", 8)])
def test_moe_block_flint_size(fmt, m):
  e, d, inter, inter_s = 256, 2048, 512, 1024
  gen = rng("flint", fmt, m)
  experts, shared = random_moe_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  router = randn(gen, (e, d), jnp.float32, d ** -0.5)
  out = moe_block(x, router, experts, shared, decode=DECODE, interpret=INTERPRET)
  assert_close(out, moe_block_reference(x, router, experts, shared), what=f"moe {fmt}")


# ------------------------------------------------------------------------------------------
# Routed path: expert ids from the router logits inside the kernels, fused combine + add + norm


def _topk_ids_kernel(l_ref, ids_ref, vals_ref, *, top_k, n_exp, ep):
  t = pl.program_id(0)
  for j, (idx, v) in enumerate(moe_mod._topk_logits(l_ref, t, top_k, n_exp, ep)):
    ids_ref[t, j] = idx
    vals_ref[t, j] = v


def kernel_topk(logits, top_k):
  """The in-kernel top-k of moe_decode_routed's gate_up kernel, as (ids, logits)."""
  m, e = logits.shape
  kern = functools.partial(_topk_ids_kernel, top_k=top_k, n_exp=e, ep=C.next_pow2(e))
  return pl.pallas_call(
      kern, grid=(m,), interpret=True,
      out_shape=(jax.ShapeDtypeStruct((m, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((m, top_k), jnp.float32)))(logits)


@pytest.mark.parametrize("m,e,top_k,ties", [(1, 16, 6, False), (3, 20, 4, False),
                                            (8, 256, 6, False), (16, 32, 2, False),
                                            (5, 16, 6, True), (8, 20, 5, True),
                                            (2, 256, 6, True)])
def test_topk_logits_matches_lax_top_k(m, e, top_k, ties):
  """In-kernel ids (and order) == lax.top_k's, lowest index first among equal logits; == the
  ids of moe_route (top-k of the sigmoid scores) when sigmoid keeps the logits distinct."""
  gen = rng("topk", m, e, top_k, ties)
  lg = tie_logits(gen, m, e) if ties else randn(gen, (m, e), jnp.float32, 2.0)
  ids, vals = kernel_topk(lg, top_k)
  want_v, want_ids = jax.lax.top_k(lg, top_k)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))
  np.testing.assert_array_equal(np.asarray(moe_route_from_logits(lg, top_k=top_k)[0]),
                                np.asarray(want_ids))
  route = moe_topk_route(lg, top_k=top_k)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(route.logits), np.asarray(want_v))
  if ties:   # lowest index first, explicitly: the all-equal row picks 0, 1, ..., k-1
    np.testing.assert_array_equal(np.asarray(ids)[0], np.arange(top_k))
  _, want_sig = jax.lax.top_k(jax.nn.sigmoid(lg), top_k)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_sig))


def _routed_case(fmt, m, e, top_k, d, inter, inter_s, ties, *params):
  gen = rng("routed", fmt, m, e, top_k, d, inter, inter_s, ties, *params)
  experts, shared = random_moe_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  # logits ~ N(0, 1), as a trained router's: logits above ~17 round sigmoid to 1.0 in fp32, where
  # moe_route's top-k of the scores breaks the tie by index (see moe_route_from_logits)
  router = randn(gen, (e, d), jnp.float32, d ** -0.5)
  if ties:
    logits = tie_logits(gen, m, e)
  else:
    logits = moe_router_logits(x, router)
  return gen, experts, shared, x, router, logits


def used_rows(y, top_k):
  """The rows of moe_decode_routed's y [M * top_k + 1, M, D] that every slot_rows mode defines
  (and the combine reads): y[t * top_k + j, t] for all (t, j), then the shared expert's M rows."""
  m = y.shape[1]
  u = jnp.arange(m * top_k)
  return jnp.concatenate([y[u, u // top_k], y[m * top_k]], axis=0)


def assert_routed_close(y, ref, top_k, slot_rows, what):
  """y vs the reference: every row with slot_rows "all", the defined rows with "token"."""
  assert y.shape == ref.shape
  if slot_rows == "all":
    assert_close(y, ref, what=what)
  else:
    assert_close(used_rows(y, top_k), used_rows(ref, top_k), what=what)


@pytest.mark.parametrize("fmt,m,e,top_k,d,inter,inter_s,ties,slot_rows", [
    ("bf16", 1, 16, 6, 128, 64, 128, False, None),
    ("bf16", 3, 20, 4, 256, 64, 128, True, "all"),    # E not a power of two, tied logits
    ("bf16", 3, 20, 4, 256, 64, 128, True, "token"),
    ("nvfp4", 1, 16, 6, 128, 64, 128, False, None),   # reduce tiles
    ("nvfp4", 2, 32, 3, 256, 128, 64, True, None),     # the default at M = 2..4: token
    ("nvfp4", 2, 32, 3, 256, 128, 64, True, "all"),
    ("mixed", 8, 16, 2, 128, 64, 128, False, None),  # tokens share experts: no de-duplication
    ("mixed", 5, 16, 3, 128, 64, 128, False, "token"),
    ("bf16", 16, 16, 2, 128, 64, 64, False, None),
])
def test_moe_decode_routed(fmt, m, e, top_k, d, inter, inter_s, ties, slot_rows):
  """Every slot's output (all M token rows, or each slot's own token's with slot_rows "token")
  vs the reference routed by lax.top_k of the logits: a wrong expert id in either kernel changes
  whole rows of y. The routing the gate_up kernel stores is lax.top_k's, bit for bit."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, e, top_k, d, inter, inter_s, ties)
  y, route = moe_decode_routed(x, logits, experts, shared, top_k=top_k, decode=DECODE,
                               slot_rows=slot_rows, interpret=INTERPRET)
  ref, ref_route = moe_decode_routed_reference(x, logits, experts, shared, top_k=top_k)
  assert y.shape == (m * top_k + 1, m, d)
  assert_route_is_top_k(route, logits, top_k)
  np.testing.assert_array_equal(np.asarray(ref_route.ids), np.asarray(route.ids))
  mode = slot_rows or default_slot_rows(fmt, m)
  assert_routed_close(y, ref, top_k, mode, f"moe routed {fmt} {slot_rows}")


@pytest.mark.skipif(INTERPRET, reason="the asm decode runs only compiled on a GPU")
@pytest.mark.parametrize("ambient,asm_down", [("post", None), ("mul", "post"), ("post", "mul")])
def test_moe_decode_routed_post_scaled_decode(ambient, asm_down):
  """The NVFP4 routed MoE at M = 1 (blocks tiles) with the "post" decode (the block scales
  applied to each 16-value block's sum) in both kernels, or in one of them (``asm_down``, what
  ``DecodeOptions(nvfp4_asm="auto")`` runs), against the reference."""
  from flint_jax.pallas.nvfp4_gemv import asm_decode
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 1, 16, 6, 256, 128, 256, False,
                                                  "post")
  with asm_decode(ambient):
    y, _ = moe_decode_routed(x, logits, experts, shared, top_k=6, decode="asm",
                             asm_down=asm_down)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "all", f"moe routed nvfp4 {ambient} / down {asm_down}")


@pytest.mark.parametrize("m,d,split_k,kw", [
    (1, 512, 2, {}),                                # the BF16 M = 1 default tiles (bk 256)
    (1, 256, 2, {}),                                # slices narrower than block_k: bk 128
    (3, 256, 4, dict(block_k=32, block_k_down=32)),  # 4 slices of 2 K steps; several down steps
])
def test_moe_decode_routed_gate_up_split_k(m, d, split_k, kw):
  """gate_up in K slices (fp32 partial g / u, summed by the down kernel): the same outputs as the
  reference and as the unsplit kernels (up to the fp32 summation order), the same routing."""
  _, experts, shared, x, _, logits = _routed_case("bf16", m, 16, 3, d, 64, 128, False, "sk")
  args = dict(top_k=3, interpret=INTERPRET, **kw)
  y, route = moe_decode_routed(x, logits, experts, shared, gate_up_split_k=split_k, **args)
  # unsplit on all rows, as the split kernels: BF16 per-token slots (the default at M = 2..4)
  # leave the other tokens' rows of y undefined (garbage on the H200, run 166)
  y1, route1 = moe_decode_routed(x, logits, experts, shared, slot_rows="all", **args)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=3)
  assert_route_is_top_k(route, logits, 3)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route1.ids))
  assert_close(y, ref, what=f"split_k={split_k} vs reference")
  assert_close(y, y1, what=f"split_k={split_k} vs unsplit")
  # the unrouted kernels (moe_decode) with the same split, on the same routing
  w = moe_route_weights(route.logits)
  out = moe_decode(x, route.ids, w, experts, shared, gate_up_split_k=split_k,
                   interpret=INTERPRET, **kw)
  assert_close(out, moe_decode_reference(x, route.ids, w, experts, shared),
               what=f"moe_decode split_k={split_k}")


@pytest.mark.parametrize("m,d,split_k", [(1, 512, 2), (2, 256, 4)])
def test_moe_decode_routed_gate_up_finish(m, d, split_k):
  """gate_up in K slices with a counter: the last slice of each tile finishes h itself. Same
  outputs as the unsplit kernels (up to the fp32 summation order) and the partials-to-down
  mode, and the counter comes back zeroed, so it can serve the next call (twice here)."""
  _, experts, shared, x, _, logits = _routed_case("bf16", m, 16, 3, d, 64, 128, False, "fin")
  args = dict(top_k=3, interpret=INTERPRET)
  counter = jnp.zeros((300,), jnp.int32)
  # unsplit on all rows, as the split kernels (per-token slots leave the other rows undefined)
  y1, _ = moe_decode_routed(x, logits, experts, shared, slot_rows="all", **args)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=3)
  for _ in range(2):
    y, route, counter = moe_decode_routed(x, logits, experts, shared, gate_up_split_k=split_k,
                                          gate_up_counter=counter, **args)
    assert_route_is_top_k(route, logits, 3)
    assert not np.asarray(counter).any(), "the counter must come back zeroed"
    assert_close(y, ref, what="finish vs reference")
    assert_close(y, y1, what="finish vs unsplit")
  y_parts, _ = moe_decode_routed(x, logits, experts, shared, gate_up_split_k=split_k, **args)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_parts, np.float32))
  with pytest.raises(ValueError, match="gate_up_counter must be int32 zeros"):
    moe_decode_routed(x, logits, experts, shared, gate_up_split_k=split_k,
                      gate_up_counter=jnp.zeros((3,), jnp.int32), **args)


def test_moe_gate_up_split_k_rejects_nvfp4_and_bad_slices():
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 1, 16, 2, 128, 64, 64, False, "skb")
  with pytest.raises(ValueError, match="bf16 experts"):
    moe_decode_routed(x, logits, experts, shared, top_k=2, gate_up_split_k=2, interpret=True)
  _, experts, shared, x, _, logits = _routed_case("bf16", 1, 16, 2, 128, 64, 64, False, "skc")
  with pytest.raises(ValueError, match="gate_up_split_k=3 must be a power of two"):
    moe_decode_routed(x, logits, experts, shared, top_k=2, gate_up_split_k=3, interpret=True)


def test_moe_decode_routed_token_rows_equal_all_rows():
  """slot_rows "token" and "all" agree on the rows both define (NVFP4, M = 4): the per-token
  blocks tiles and the all-rows tensor-core tiles compute the same expert outputs."""
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 4, 16, 3, 128, 64, 128, False, "eq")
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET)
  y_tok, r_tok = moe_decode_routed(x, logits, experts, shared, slot_rows="token", **kw)
  y_all, r_all = moe_decode_routed(x, logits, experts, shared, slot_rows="all", **kw)
  np.testing.assert_array_equal(np.asarray(r_tok.ids), np.asarray(r_all.ids))
  assert_close(used_rows(y_tok, 3), used_rows(y_all, 3), what="token vs all rows")


@pytest.mark.parametrize("fmt,m,token_method", [("nvfp4", 8, None), ("nvfp4", 5, "reduce"),
                                                ("nvfp4", 3, "lanes"), ("nvfp4", 2, "dot"),
                                                ("bf16", 8, "reduce"), ("bf16", 3, None)])
def test_moe_decode_routed_token_methods(fmt, m, token_method):
  """Per-token slots (slot_rows "token") on each M = 1 tile method, including M = 8 (the NVFP4
  default there is "all") and the default (None: blocks for NVFP4, dot for BF16), against the
  reference: each slot's own token's rows and the shared expert's rows."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 32, 6, 256, 128, 256, False,
                                                  f"tm{token_method}")
  y, route = moe_decode_routed(x, logits, experts, shared, top_k=6, decode=DECODE,
                               slot_rows="token", token_method=token_method,
                               interpret=INTERPRET)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_route_is_top_k(route, logits, 6)
  assert_routed_close(y, ref, 6, "token", f"token slots {fmt} M={m} {token_method}")


@pytest.mark.parametrize("fmt,m,slot_rows,prerouted,shared_first", [
    ("nvfp4", 8, "token", True, True), ("nvfp4", 8, "token", True, False),
    ("nvfp4", 3, None, False, True), ("nvfp4", 1, None, True, True),
    ("bf16", 5, "all", True, True), ("mixed", 2, "token", False, True),
    ("bf16", 1, None, True, False)])
def test_moe_decode_routed_prerouted_shared_first(fmt, m, slot_rows, prerouted, shared_first):
  """The routing computed once outside the kernels (``prerouted``: the gate_up kernel loads each
  slot's id) and the shared expert's programs launched first (``shared_first``, both kernels)
  change no value: y and the routing equal the default call's bit for bit, and the reference."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 32, 6, 256, 128, 256, m == 3,
                                                  f"pre{prerouted}{shared_first}")
  kw = dict(top_k=6, decode=DECODE, slot_rows=slot_rows, interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, prerouted=prerouted,
                               shared_first=shared_first, **kw)
  y0, route0 = moe_decode_routed(x, logits, experts, shared, **kw)
  assert_route_is_top_k(route, logits, 6)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route0.ids))
  mode = slot_rows or default_slot_rows(fmt, m)
  np.testing.assert_array_equal(np.asarray(used_rows(y, 6), np.float32),
                                np.asarray(used_rows(y0, 6), np.float32))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, mode, f"prerouted={prerouted} shared_first={shared_first}")


def assert_combine_as_prerouted(x, logits, experts, shared, kw, seed, **option):
  """``moe_decode_routed_combine`` with ``option`` against the prerouted call on the same
  random (h, w_next): s and x_next bit for bit; returns the option's routing."""
  m = x.shape[0]
  gen = rng(seed, m)
  h = randn(gen, (m, 256))
  w_next = randn(gen, (256,)) + 1.0
  counter = jnp.zeros((64,), jnp.int32)
  ckw = dict(kw, block_n_down=32)
  s1, x1, r1, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                                  counter_base=20, **option, **ckw)
  s0, x0, _, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                                 counter_base=20, prerouted=True, **ckw)
  np.testing.assert_array_equal(np.asarray(s1, np.float32), np.asarray(s0, np.float32))
  np.testing.assert_array_equal(np.asarray(x1, np.float32), np.asarray(x0, np.float32))
  return r1


@pytest.mark.parametrize("fmt,m,slot_rows", [("nvfp4", 8, None), ("nvfp4", 1, None),
                                              ("bf16", 3, "all"), ("mixed", 2, "token")])
def test_moe_decode_routed_route_given(fmt, m, slot_rows):
  """The routing handed in (``route=``, as ``router_logits_topk`` computes it): y bit-identical
  to the prerouted call's, the given routing returned; the combine entry point too; a malformed
  route or prerouted=False rejected."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 32, 6, 256, 128, 256, False, "rg")
  kw = dict(top_k=6, decode=DECODE, slot_rows=slot_rows, interpret=INTERPRET)
  given = moe_topk_route_pallas(logits, top_k=6, interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, route=given, **kw)
  y0, route0 = moe_decode_routed(x, logits, experts, shared, prerouted=True, **kw)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(given.ids))
  np.testing.assert_array_equal(np.asarray(route.logits), np.asarray(given.logits))
  np.testing.assert_array_equal(np.asarray(route0.ids), np.asarray(given.ids))
  np.testing.assert_array_equal(np.asarray(used_rows(y, 6), np.float32),
                                np.asarray(used_rows(y0, 6), np.float32))
  r1 = assert_combine_as_prerouted(x, logits, experts, shared, kw, f"rg-h{fmt}", route=given)
  np.testing.assert_array_equal(np.asarray(r1.ids), np.asarray(given.ids))
  with pytest.raises(ValueError, match="prerouted=False"):
    moe_decode_routed(x, logits, experts, shared, route=given, prerouted=False, **kw)
  bad = MoERoute(given.ids[:, :3], given.logits[:, :3])
  with pytest.raises(ValueError, match="route must be a MoERoute"):
    moe_decode_routed(x, logits, experts, shared, route=bad, **kw)


@pytest.mark.parametrize("m,e,top_k,ties", [(1, 256, 6, False), (8, 256, 6, True),
                                            (5, 20, 4, True), (3, 16, 16, False)])
def test_moe_topk_route_pallas(m, e, top_k, ties):
  """The one-program-per-token top-k kernel equals lax.top_k bit for bit (ids, lowest index
  first among equal logits, and the selected logits), E not a power of two and top_k = E
  included."""
  gen = rng("topk", m, e, top_k, ties)
  logits = tie_logits(gen, m, e) if ties else randn(gen, (m, e), jnp.float32)
  assert_route_is_top_k(moe_topk_route_pallas(logits, top_k=top_k, interpret=INTERPRET),
                        logits, top_k)


@pytest.mark.parametrize("m,shared_cols", [(1, 1), (4, 2)])
def test_moe_decode_routed_combine_prerouted_shared_first(m, shared_cols):
  """The down kernel's combine with the shared expert's programs first (over 1 or 2 programs
  per column block) and the routing given: the same (s, x_next) and routing as the default."""
  _, experts, shared, x, _, logits = _routed_case("nvfp4", m, 16, 3, 256, 64, 128, False, "cpf")
  gen = rng("cpf-h")
  h = randn(gen, (m, 256))
  w_next = randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, block_n_down=32,
            down_shared_cols=shared_cols)
  counter = jnp.zeros((64,), jnp.int32)
  s0, x0, r0, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                                  counter_base=20, **kw)
  s1, x1, r1, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                                  counter_base=20, prerouted=True,
                                                  shared_first=True, **kw)
  np.testing.assert_array_equal(np.asarray(r1.ids), np.asarray(r0.ids))
  np.testing.assert_array_equal(np.asarray(s1, np.float32), np.asarray(s0, np.float32))
  np.testing.assert_array_equal(np.asarray(x1, np.float32), np.asarray(x0, np.float32))
  assert not np.asarray(counter).any(), "the counter entries must come back zeroed"


@pytest.mark.parametrize("fmt,m,shared_first,prerouted", [
    ("nvfp4", 8, True, True), ("nvfp4", 4, True, True), ("nvfp4", 3, False, False),
    ("bf16", 5, True, False)])
def test_moe_decode_routed_shared_rows_token(fmt, m, shared_first, prerouted):
  """The shared expert as one program per (token, row block) on the M = 1 tiles
  (``shared_rows="token"``, with per-token slots; the NVFP4 default) against the reference, and
  the routed slots' rows bit-identical to the call with the shared expert on one program per row
  block (``"all"``), which matches the reference too."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 32, 6, 256, 128, 256, False,
                                                  f"sht{shared_first}{prerouted}")
  kw = dict(top_k=6, decode=DECODE, slot_rows="token", shared_first=shared_first,
            prerouted=prerouted, interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, shared_rows="token", **kw)
  y0, _ = moe_decode_routed(x, logits, experts, shared, shared_rows="all", **kw)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_route_is_top_k(route, logits, 6)
  assert_routed_close(y, ref, 6, "token", f"shared_rows=token {fmt} M={m}")
  assert_routed_close(y0, ref, 6, "token", f"shared_rows=all {fmt} M={m}")
  n = m * 6
  np.testing.assert_array_equal(np.asarray(used_rows(y, 6)[:n], np.float32),
                                np.asarray(used_rows(y0, 6)[:n], np.float32))


@pytest.mark.parametrize("m,shared_tokens,want", [(8, 4, 4), (6, 4, 3), (5, 8, 5), (3, 2, 1)])
def test_moe_decode_routed_shared_tokens(m, shared_tokens, want):
  """``shared_tokens``: the shared expert's gate_up programs each take ``want`` tokens (the
  largest divisor of M not above the request), the tile decoded once for them: y equals the
  one-token-per-program call's bit for bit (NVFP4 per-token slots and shared expert)."""
  _, experts, shared, x, _, logits = _routed_case("nvfp4", m, 32, 6, 256, 128, 256, False,
                                                  f"shtk{m}")
  kw = dict(top_k=6, decode=DECODE, slot_rows="token", shared_rows="token", interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, shared_tokens=shared_tokens, **kw)
  y1, route1 = moe_decode_routed(x, logits, experts, shared, **kw)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route1.ids))
  n = m * 6
  np.testing.assert_array_equal(np.asarray(used_rows(y, 6), np.float32),
                                np.asarray(used_rows(y1, 6), np.float32))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "token", f"shared_tokens={shared_tokens} M={m}")
  # lowered for an H200: the gate_up grid has the routed slots' programs plus I_s / 16 per
  # group of `want` tokens
  from flint_jax.pallas.testing import triton_modules
  gpu_kw = dict(kw, decode="asm", interpret=False)
  mods = triton_modules(lambda x_, l_: moe_decode_routed(
      x_, l_, experts, shared, shared_tokens=shared_tokens, **gpu_kw), x, logits)
  (gate_up,) = [mod for mod in mods if mod["name"].startswith("flint_moe_gate_up")]
  assert "_shtok" + (str(want) if want > 1 else "") + "_nvfp4" in gate_up["name"], gate_up
  assert gate_up["grid"][0] == n * (128 // 16) + (256 // 16) * (m // want), gate_up["grid"]


def test_moe_decode_routed_shared_tokens_needs_the_token_blocks_tiles():
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 4, 32, 6, 256, 128, 256, False, "shtx")
  with pytest.raises(ValueError, match="shared_tokens=2 needs shared_rows='token'"):
    moe_decode_routed(x, logits, experts, shared, top_k=6, slot_rows="token",
                      shared_rows="all", shared_tokens=2, decode=DECODE, interpret=INTERPRET)


def test_default_moe_tiling_token_down_rows():
  """The NVFP4 per-token down kernel runs 32-row blocks from M = 4 (H200 runs 148-149) and the
  M = 1 tile's 16 below; the gate_up keeps bn16 (bk512 from M = 5, bk1024 below)."""
  from flint_jax.pallas.moe import default_moe_tiling
  for m, bn_down, bk in ((8, 32, 512), (5, 32, 512), (4, 32, 1024), (3, 16, 1024),
                         (2, 16, 1024)):
    t = default_moe_tiling("nvfp4", m, token=True, shared_token=True)
    assert (t["block_n_down"], t["block_n"], t["block_k"]) == (bn_down, 16, bk), (m, t)
  assert default_moe_tiling("nvfp4", 1)["block_n_down"] == 16
  assert default_moe_tiling("bf16", 4, token=True)["block_n_down"] == 64
  # the f16 gate_up (gate_up_f16): bn32 from M = 5, bk512 on 4 warps at M = 4 (runs 162-163),
  # 8 warps below; the down kernel unchanged
  for m, bn, bk, warps in ((8, 32, 512, 4), (5, 32, 512, 4), (4, 16, 512, 4), (3, 16, 1024, 8),
                           (2, 16, 1024, 8)):
    t = default_moe_tiling("nvfp4", m, token=True, shared_token=True, f16=True)
    t0 = default_moe_tiling("nvfp4", m, token=True, shared_token=True)
    assert (t["block_n"], t["block_k"], t["num_warps"]) == (bn, bk, warps), (m, t)
    assert {k: v for k, v in t.items() if k.endswith("_down")} == {
        k: v for k, v in t0.items() if k.endswith("_down")}


def test_moe_decode_routed_combine_shared_rows_token():
  """The down kernel's combine waits for all M shared-expert programs of each column block:
  (s, x_next) equal the 3-launch composition's on the same y."""
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 4, 16, 3, 256, 64, 128, False, "cst")
  gen = rng("cst-h")
  h = randn(gen, (4, 256))
  w_next = randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, block_n_down=32, slot_rows="token",
            shared_rows="token")
  y, route = moe_decode_routed(x, logits, experts, shared, **kw)
  s_want, x_want = moe_combine_add_rms_norm(h, y, route.logits, w_next, interpret=INTERPRET)
  counter = jnp.zeros((64,), jnp.int32)
  s_got, x_got, _, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next,
                                                       counter, counter_base=20, **kw)
  np.testing.assert_array_equal(np.asarray(s_got, np.float32), np.asarray(s_want, np.float32))
  if INTERPRET:
    np.testing.assert_array_equal(np.asarray(x_got, np.float32), np.asarray(x_want, np.float32))
  else:
    assert_close(x_got, x_want, what="x_next")
  assert not np.asarray(counter).any(), "the counter entries must come back zeroed"


@pytest.mark.parametrize("m,kw", [(1, dict(gate_up_f16=True, down_f16=True)), (3, {})])
def test_moe_decode_routed_combine_x16_next(m, kw):
  """``x16_next``: the combine's program also writes x_next's f16 operand, equal bit for bit to
  ``x16_operand(x_next)``; s and x_next as without it; the kernel lowers for an H200."""
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  from flint_jax.pallas.testing import triton_modules
  _, experts, shared, x, _, logits = _routed_case("nvfp4", m, 16, 3, 256, 64, 128, False,
                                                  f"x16n{m}")
  gen = rng("x16n-h", m)
  h = randn(gen, (m, 256))
  w_next = randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, block_n_down=32, slot_rows="token",
            shared_rows="token", **kw)
  counter = jnp.zeros((64,), jnp.int32)
  s0, x0, _, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                                 counter_base=20, **kw)
  s1, x1, _, counter, (x16, inv) = moe_decode_routed_combine(
      x, logits, experts, shared, h, w_next, counter, counter_base=20, x16_next=True, **kw)
  assert not np.asarray(counter).any(), "the counter entries must come back zeroed"
  np.testing.assert_array_equal(np.asarray(s1, np.float32), np.asarray(s0, np.float32))
  np.testing.assert_array_equal(np.asarray(x1, np.float32), np.asarray(x0, np.float32))
  want16, want_inv = x16_operand(x1)
  assert x16.dtype == jnp.float16 and x16.shape == (m, 256) and inv.shape == (m,)
  np.testing.assert_array_equal(np.asarray(x16).view(np.uint16),
                                np.asarray(want16).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(want_inv))
  with pytest.raises(ValueError, match="needs norm=True"):
    moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter, counter_base=20,
                              x16_next=True, norm=False, **kw)
  gpu_kw = dict(kw, decode="asm", interpret=False)
  mods = triton_modules(lambda x_, l_: moe_decode_routed_combine(
      x_, l_, experts, shared, h, w_next, counter, counter_base=20, x16_next=True, **gpu_kw),
      x, logits)
  assert any(mod["name"].endswith("_combine_x16") for mod in mods), [m_["name"] for m_ in mods]


def test_moe_decode_routed_rejects_bad_shared_rows():
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 4, 16, 2, 128, 64, 64, False, "bsr")
  for kw, match in [(dict(slot_rows="all", shared_rows="token"), "needs slot_rows='token'"),
                    (dict(slot_rows="token", shared_rows="token", down_shared_cols=2),
                     "down_shared_cols None"),
                    (dict(shared_rows="tokens"), "shared_rows must be")]:
    with pytest.raises(ValueError, match=match):
      moe_decode_routed(x, logits, experts, shared, top_k=2, interpret=True, **kw)


def test_moe_decode_routed_rejects_bad_token_method():
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 4, 16, 2, 128, 64, 64, False, "btm")
  with pytest.raises(ValueError, match="needs slot_rows='token'"):
    moe_decode_routed(x, logits, experts, shared, top_k=2, slot_rows="all",
                      token_method="blocks", interpret=True)
  with pytest.raises(ValueError, match="method must be one of"):
    moe_decode_routed(x, logits, experts, shared, top_k=2, slot_rows="token",
                      token_method="rows", interpret=True)


def test_moe_decode_routed_rejects_bad_slot_rows():
  _, experts, shared, x, _, logits = _routed_case("bf16", 2, 16, 2, 128, 64, 64, False, "bad")
  with pytest.raises(ValueError, match="slot_rows"):
    moe_decode_routed(x, logits, experts, shared, top_k=2, slot_rows="tokens",
                      interpret=INTERPRET)


def assert_route_is_top_k(route, logits, top_k):
  """route (moe_decode_routed's) == lax.top_k(logits): ids (order, lowest index first among
  equal logits) and the selected logits, bit for bit."""
  m = logits.shape[0]
  assert isinstance(route, MoERoute)
  assert route.ids.shape == route.logits.shape == (m, top_k)
  assert route.ids.dtype == jnp.int32 and route.logits.dtype == jnp.float32
  want_v, want_ids = jax.lax.top_k(logits, top_k)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(route.logits).view(np.uint32),
                                np.asarray(want_v).view(np.uint32))


@pytest.mark.parametrize("fmt,m,e,top_k", [("bf16", 5, 16, 6), ("nvfp4", 2, 256, 6),
                                           ("bf16", 8, 20, 5), ("bf16", 1, 256, 6)])
def test_moe_decode_routed_route_ties(fmt, m, e, top_k):
  """The stored routing on tied logits (a 3-level set, an all-equal row, -inf entries; E up to
  256): ids == lax.top_k's (lowest index first), the all-equal row routes to experts 0..k-1,
  and the combine weights from the stored logits equal moe_route_from_logits'."""
  gen = rng("route-ties", fmt, m, e, top_k)
  experts, shared = random_moe_weights(fmt, e, 128, 64, 64, gen)
  x = randn(gen, (m, 128))
  logits = tie_logits(gen, m, e)
  y, route = moe_decode_routed(x, logits, experts, shared, top_k=top_k, decode=DECODE,
                               interpret=INTERPRET)
  assert_route_is_top_k(route, logits, top_k)
  np.testing.assert_array_equal(np.asarray(route.ids)[0], np.arange(top_k))
  ids, w = moe_route_from_logits(logits, top_k=top_k)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(ids))
  np.testing.assert_array_equal(np.asarray(moe_route_weights(route.logits)), np.asarray(w))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=top_k)
  mode = default_slot_rows(fmt, m)
  assert_routed_close(y, ref, top_k, mode, f"moe routed ties {fmt}")


@pytest.mark.parametrize("fmt,m,slot_rows", [("bf16", 1, None), ("nvfp4", 1, None),
                                              ("nvfp4", 3, None), ("nvfp4", 3, "all")])
def test_moe_decode_routed_down_tiling(fmt, m, slot_rows):
  """The down kernel's own tiling knobs (several K steps over I, its own warps / stages) give the
  same outputs as the reference."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 16, 4, 128, 128, 256, False, "dn")
  y, route = moe_decode_routed(x, logits, experts, shared, top_k=4, decode=DECODE,
                               block_n=16, block_n_down=16, block_k_down=64, num_warps_down=2,
                               num_stages_down=2, slot_rows=slot_rows, interpret=INTERPRET)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=4)
  assert_route_is_top_k(route, logits, 4)
  mode = slot_rows or default_slot_rows(fmt, m)
  assert_routed_close(y, ref, 4, mode, f"down tiling {fmt} {slot_rows}")


@pytest.mark.parametrize("m,e,top_k,d,ties", [(1, 16, 6, 256, False), (3, 20, 4, 300, True),
                                              (8, 256, 6, 2048, False), (16, 32, 2, 128, True)])
def test_moe_combine_add_rms_norm(m, e, top_k, d, ties):
  """The fused combine + residual add + RMSNorm (on the selected logits, lax.top_k's values as
  moe_decode_routed stores them) vs its reference on random expert outputs."""
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
  # the combine alone, written out: moe = bf16(sum_j w_j y[t*k+j, t] + y[-1, t]) in top-k order
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
  y = randn(gen, (m * k + 1, m, d))
  h = randn(gen, (m, d))
  w = randn(gen, (d,))
  lg = randn(gen, (m, e), jnp.float32)
  top = moe_topk_route(lg, top_k=k).logits
  with pytest.raises(ValueError, match="y must be"):       # full logits: top_k would be E
    moe_combine_add_rms_norm(h, y, lg, w, interpret=True)
  with pytest.raises(ValueError, match="top_logits must be"):
    moe_combine_add_rms_norm(h, y, top.astype(jnp.bfloat16), w, interpret=True)
  with pytest.raises(ValueError, match="top_logits must be"):
    moe_combine_add_rms_norm(h, y, top[:1], w, interpret=True)


@pytest.mark.parametrize("fmt,m,e,top_k,d,inter,inter_s", [
    ("bf16", 1, 16, 6, 128, 64, 128),
    ("bf16", 3, 32, 6, 256, 64, 128),
    ("nvfp4", 2, 16, 4, 128, 64, 128),
    ("nvfp4", 8, 16, 2, 128, 64, 64),
    ("mixed", 3, 20, 6, 128, 64, 128),
])
def test_moe_block_add_rms_norm(fmt, m, e, top_k, d, inter, inter_s):
  """The 4-launch path vs moe_block_reference followed by add_rms_norm_reference."""
  gen, experts, shared, x, router, _ = _routed_case(fmt, m, e, top_k, d, inter, inter_s, False,
                                                    "block")
  h = randn(gen, (m, d), scale=4.0)
  w = randn(gen, (d,), scale=0.3) + 1
  s, xn = moe_block_add_rms_norm(x, h, router, experts, shared, w, top_k=top_k, decode=DECODE,
                                 interpret=INTERPRET)
  y_ref = moe_block_reference(x, router, experts, shared, top_k=top_k)
  s_ref, xn_ref = add_rms_norm_reference(h, y_ref, w)
  ref2 = moe_block_add_rms_norm_reference(x, h, router, experts, shared, w, top_k=top_k)
  np.testing.assert_array_equal(np.asarray(s_ref, np.float32), np.asarray(ref2[0], np.float32))
  assert_close(s, s_ref, what=f"s {fmt}")
  assert_close(xn, xn_ref, what=f"x_next {fmt}")


@pytest.mark.parametrize("fmt,m", [("bf16", 1), ("nvfp4", 1), ("bf16", 8), ("nvfp4", 8)])
def test_moe_block_add_rms_norm_flint_size(fmt, m):
  """Flint sizes (E=256, top-6, D=2048, I=512, I_s=1024). In interpret mode only bf16 M=1 runs
  (~12 s, 2.5 GB: cheap integer-valued weights); the rest needs a GPU."""
  if INTERPRET and (fmt, m) != ("bf16", 1):
    pytest.skip("Flint-sized NVFP4 / M=8 MoE is slow in interpret mode")
  e, d, inter, inter_s = 256, 2048, 512, 1024
  gen = rng("flint-routed", fmt, m)
  if fmt == "bf16":
    def ri(shape, scale):   # integer-valued bf16 weights: 20x faster to draw than normals
      q = jnp.asarray(gen.integers(-8, 9, shape, dtype=np.int8))
      return q.astype(jnp.bfloat16) * jnp.bfloat16(scale / 5)
    experts = dict(gate_up_proj=ri((e, 2 * inter, d), 2 * d ** -0.5),
                   down_proj=ri((e, d, inter), inter ** -0.5))
    _, shared = random_moe_weights("bf16", 1, d, 64, inter_s, gen)
  else:
    experts, shared = random_moe_weights(fmt, e, d, inter, inter_s, gen)
  x = randn(gen, (m, d))
  h = randn(gen, (m, d), scale=4.0)
  router = randn(gen, (e, d), jnp.float32, d ** -0.5)
  w = randn(gen, (d,), scale=0.3) + 1
  s, xn = moe_block_add_rms_norm(x, h, router, experts, shared, w, decode=DECODE,
                                 interpret=INTERPRET)
  s_ref, xn_ref = moe_block_add_rms_norm_reference(x, h, router, experts, shared, w)
  assert_close(s, s_ref, what=f"s {fmt}")
  assert_close(xn, xn_ref, what=f"x_next {fmt}")


@pytest.mark.parametrize("m,shared_cols", [(1, 1), (1, 2), (1, 4), (3, 2)])
def test_moe_decode_routed_down_shared_cols(m, shared_cols):
  """The shared expert's down columns cut over 1 / 2 / 4 programs per block (its K is 2x a routed
  expert's here): the same outputs as the reference, and the kernel lowered for an H200 carries
  the cut; a cut below 16 columns is refused."""
  _, experts, shared, x, _, logits = _routed_case("bf16", m, 16, 3, 256, 64, 128, False, "sc")
  args = dict(top_k=3, interpret=INTERPRET)
  y, _ = moe_decode_routed(x, logits, experts, shared, down_shared_cols=shared_cols, **args)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=3)
  assert_routed_close(y, ref, 3, default_slot_rows("bf16", m), f"down_shared_cols={shared_cols}")
  with pytest.raises(ValueError, match="down_shared_cols"):
    moe_decode_routed(x, logits, experts, shared, down_shared_cols=8, **args)
  s = jax.ShapeDtypeStruct
  text = lower_for_h200(functools.partial(moe_decode_routed, top_k=3, down_shared_cols=2),
                        s(x.shape, x.dtype), s(logits.shape, logits.dtype),
                        jax.tree.map(lambda a: s(a.shape, a.dtype), experts),
                        jax.tree.map(lambda a: s(a.shape, a.dtype), shared)).as_text()
  assert "_sc2" in text


@pytest.mark.parametrize("fmt,m,block_n_down", [("nvfp4", 1, None), ("bf16", 1, None),
                                                ("bf16", 3, 32), ("nvfp4", 2, None)])
def test_moe_decode_routed_combine(fmt, m, block_n_down):
  """The combine + residual add + next RMSNorm in the down kernel's last program: the same
  (s, x_next) as moe_decode_routed -> moe_combine_add_rms_norm (bit for bit: the same y values
  and formulas), the same routing, and the counter entries back at zero (twice, so a counter can
  serve the next call)."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 16, 3, 256, 64, 128, False, "cmb")
  gen = rng("cmb-h")
  h = randn(gen, (m, 256))
  w_next = randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, block_n_down=block_n_down)
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


@pytest.mark.parametrize("fmt,m,block_n_down", [("nvfp4", 1, None), ("bf16", 3, 32),
                                                ("nvfp4", 8, None)])   # per-token slots
def test_moe_decode_routed_combine_without_norm(fmt, m, block_n_down):
  """norm=False: each column block's last program writes that block's s and its fp32 sum of
  squares (with per-token slots at M > 1, the last of each token's programs of the block, on
  per-token counters); s equals the norm=True call's bit for bit, the sums equal s's (up to
  fp32 order), and the counter entries come back zero (twice)."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, 16, 3, 256, 64, 128, False, "res")
  gen = rng("res-h")
  h = randn(gen, (m, 256))
  w_next = randn(gen, (256,)) + 1.0
  kw = dict(top_k=3, decode=DECODE, interpret=INTERPRET, block_n_down=block_n_down,
            counter_base=20)
  counter = jnp.zeros((256,), jnp.int32)
  if fmt == "nvfp4" and m > 1:   # per-token counters: 8 blocks x M entries, not 16
    with pytest.raises(ValueError, match="counter"):
      moe_decode_routed_combine(x, logits, experts, shared, h, w_next,
                                jnp.zeros((20 + 1 + 16 + 1,), jnp.int32), norm=False, **kw)
  s_want, _, route, counter = moe_decode_routed_combine(x, logits, experts, shared, h, w_next,
                                                        counter, **kw)
  bn = block_n_down or (32 if fmt == "nvfp4" and m >= 4 else 16)   # default_moe_tiling
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


@pytest.mark.parametrize("fmt,m,norm", [("nvfp4", 1, True), ("bf16", 8, True),
                                        ("nvfp4", 1, False), ("nvfp4", 8, False)])
def test_moe_decode_routed_combine_lowers_for_h200(fmt, m, norm):
  """At Flint sizes: the down kernel with the combine (or, norm=False, the residual mode)
  lowers for an H200."""
  s = jax.ShapeDtypeStruct
  experts, shared = abstract_moe_weights(fmt, 256, 2048, 512, 1024)
  text = lower_for_h200(
      functools.partial(moe_decode_routed_combine, top_k=6, counter_base=2048, norm=norm),
      s((m, 2048), jnp.bfloat16), s((m, 256), jnp.float32), experts, shared,
      s((m, 2048), jnp.bfloat16), s((2048,), jnp.bfloat16), s((4096,), jnp.int32)).as_text()
  assert ("_combine" if norm else "_residual") in text


@pytest.mark.parametrize("m,scale,sums", [(2, 1.0, "pair"), (5, 37.0, "block"),
                                          (8, 1e-3, "pair"), (8, 1e-3, "block")])
def test_moe_decode_routed_gate_up_f16(m, scale, sums):
  """``gate_up_f16``: the per-token NVFP4 gate_up on f16x2 products (x scaled per row into f16,
  pairs of exact products rounded once to f16, or with ``f16_sums="block"`` a block's sums in
  f16) matches the reference like the default does, at row scales far from 1, and its kernel
  lowers for an H200 with the x16 inputs."""
  from flint_jax.pallas.nvfp4_gemv import f16_sums
  _, experts, shared, x, _, logits = _routed_case("nvfp4", m, 32, 6, 256, 128, 256, False,
                                                  f"gu16{m}")
  x = (x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
  kw = dict(top_k=6, decode=DECODE, slot_rows="token", shared_rows="token", interpret=INTERPRET)
  with f16_sums(sums):
    y, route = moe_decode_routed(x, logits, experts, shared, gate_up_f16=True, **kw)
  if sums == "block":   # the block sums round more often: not the pair sums' values
    with f16_sums("pair"):
      yp, _ = moe_decode_routed(x, logits, experts, shared, gate_up_f16=True, **kw)
    assert not np.array_equal(np.asarray(used_rows(y, 6), np.float32),
                              np.asarray(used_rows(yp, 6), np.float32))
  y0, route0 = moe_decode_routed(x, logits, experts, shared, **kw)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route0.ids))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "token", f"gate_up_f16 M={m}")
  from flint_jax.pallas.testing import rel_l2, triton_modules
  # the f16 sums move h by less than its bf16 rounding: y within a few bf16 ulps of the default
  assert rel_l2(used_rows(y, 6), used_rows(y0, 6)) < 5e-3
  # the operand given (as add_rms_norm(x16=True) writes it): the same y
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  with f16_sums(sums):
    y1, _ = moe_decode_routed(x, logits, experts, shared, gate_up_f16=True,
                              x16_rows=x16_operand(x), **kw)
  np.testing.assert_array_equal(np.asarray(used_rows(y1, 6), np.float32),
                                np.asarray(used_rows(y, 6), np.float32))
  gpu_kw = dict(kw, decode="asm", interpret=False)
  with f16_sums(sums):
    mods = triton_modules(lambda x_, l_: moe_decode_routed(
        x_, l_, experts, shared, gate_up_f16=True, **gpu_kw), x, logits)
  (gate_up,) = [mod for mod in mods if mod["name"].startswith("flint_moe_gate_up")]
  assert "_x16_" in gate_up["name"] and "fma.rn.f16x2" in gate_up["asm"], gate_up["name"]
  assert ("mov.b32 $0, alo" in gate_up["asm"]) == (sums == "block")   # the accumulating asm


@pytest.mark.parametrize("sums", ["pair", "block"])
def test_moe_decode_routed_f16_one_token(sums):
  """M = 1 with ``gate_up_f16`` (one-token slots, the shared expert per token) and the f16 down
  kernel: y matches the reference like the M = 1 default does, within bf16 noise of it, also
  with the combine in the down kernel (``moe_decode_routed_combine(norm=False)``, the batch-1
  step's); lowered for an H200."""
  from flint_jax.pallas.nvfp4_gemv import f16_sums
  from flint_jax.pallas.testing import rel_l2, triton_modules
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 1, 32, 6, 256, 128, 256, False,
                                                  "gu16one")
  kw = dict(top_k=6, decode=DECODE, interpret=INTERPRET)
  f16 = dict(slot_rows="token", shared_rows="token", gate_up_f16=True, down_f16=True)
  with f16_sums(sums):
    y, route = moe_decode_routed(x, logits, experts, shared, **kw, **f16)
  y0, route0 = moe_decode_routed(x, logits, experts, shared, **kw)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route0.ids))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "token", f"f16 M=1 {sums}")
  assert 0 < rel_l2(used_rows(y, 6), used_rows(y0, 6)) < 5e-3
  # the batch-1 step's form: the combine (no norm) in the down kernel's last programs
  gen = rng("gu16one-h")
  h = randn(gen, x.shape, jnp.bfloat16, 4.0)
  counter = jnp.zeros((4096,), jnp.int32)
  w_next = jnp.ones((x.shape[1],), jnp.bfloat16)
  ckw = dict(kw, top_k=6, counter_base=2048, norm=False)
  with f16_sums(sums):
    s1, ss1, _, c1 = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                               **ckw, **f16)
  s0, ss0, _, _ = moe_decode_routed_combine(x, logits, experts, shared, h, w_next, counter,
                                            **ckw)
  assert not np.asarray(c1).any()
  assert rel_l2(s1, s0) < 5e-3 and rel_l2(ss1, ss0) < 5e-3
  gpu_kw = dict(kw, decode="asm", interpret=False)
  with f16_sums(sums):
    names = [mod["name"] for mod in triton_modules(lambda x_, l_: moe_decode_routed(
        x_, l_, experts, shared, **gpu_kw, **f16), x, logits)]
  assert any("gate_up" in n and "_x16_" in n for n in names), names
  assert any("down" in n and "_h16_" in n for n in names), names
  # D = 256 on the M = 1 gate_up tile (bn16, 8 warps): 8 code bytes per thread, too few for the
  # block sums' four-word split (NaNs on the H200, run 160): that kernel takes the pair sums
  with f16_sums(sums):
    mods = triton_modules(lambda x_, l_: moe_decode_routed(
        x_, l_, experts, shared, **gpu_kw, **f16), x, logits)
  (gate_up,) = [mod for mod in mods if mod["name"].startswith("flint_moe_gate_up")]
  assert "mov.b32 $0, alo" not in gate_up["asm"]


def test_f16_block_sums_need_16_bytes_per_thread():
  """``_f16_sums_for``: the block sums stay where each thread holds >= 16 bytes of a code tile
  (every Flint tile), the pair sums below; "pair" is never upgraded."""
  from flint_jax.pallas.moe import _f16_sums_for
  from flint_jax.pallas.nvfp4_gemv import f16_sums
  for bn, bk, warps, want in [(16, 1024, 8, "block"), (32, 512, 4, "block"), (16, 512, 4, "block"),
                              (16, 256, 8, "pair"), (32, 128, 4, "block"), (16, 128, 4, "pair")]:
    with f16_sums("block"), _f16_sums_for(bn, bk, warps):
      assert f16_sums.value == want, (bn, bk, warps)
    with f16_sums("pair"), _f16_sums_for(bn, bk, warps):
      assert f16_sums.value == "pair"


def test_moe_decode_routed_gate_up_f16_needs_per_token_blocks():
  _, experts, shared, x, _, logits = _routed_case("nvfp4", 4, 32, 6, 256, 128, 256, False, "gu16x")
  with pytest.raises(ValueError, match="gate_up_f16 needs NVFP4 experts on per-token slots"):
    moe_decode_routed(x, logits, experts, shared, top_k=6, slot_rows="all", gate_up_f16=True,
                      decode=DECODE, interpret=INTERPRET)
  with pytest.raises(ValueError, match="gate_up_f16 needs"):
    moe_decode_routed(x, logits, experts, shared, top_k=6, slot_rows="token",
                      shared_rows="token", shared_tokens=2, gate_up_f16=True, decode=DECODE,
                      interpret=INTERPRET)
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  with pytest.raises(ValueError, match="x16_rows must be"):
    moe_decode_routed(x, logits, experts, shared, top_k=6, slot_rows="token", gate_up_f16=True,
                      x16_rows=x16_operand(x[:2]), decode=DECODE, interpret=INTERPRET)


@pytest.mark.parametrize("m,sums", [(3, "pair"), (8, "pair"), (8, "block")])
def test_moe_decode_routed_down_f16(m, sums):
  """``down_f16``: the gate_up kernel writes bf16(h) as f16 with a scale per 16 values and the
  down kernel multiplies in f16x2 too: y matches the reference like the default does, within
  bf16 noise of the f16 gate_up alone (with the same ``f16_sums``); lowered for an H200."""
  from flint_jax.pallas.nvfp4_gemv import f16_sums
  _, experts, shared, x, _, logits = _routed_case("nvfp4", m, 32, 6, 256, 128, 256, False,
                                                  f"dn16{m}")
  kw = dict(top_k=6, decode=DECODE, slot_rows="token", shared_rows="token", gate_up_f16=True,
            interpret=INTERPRET)
  with f16_sums(sums):
    y, _ = moe_decode_routed(x, logits, experts, shared, down_f16=True, **kw)
    y0, _ = moe_decode_routed(x, logits, experts, shared, **kw)
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "token", f"down_f16 M={m}")
  from flint_jax.pallas.testing import rel_l2, triton_modules
  assert 0 < rel_l2(used_rows(y, 6), used_rows(y0, 6)) < 5e-3
  gpu_kw = dict(kw, decode="asm", interpret=False)
  with f16_sums(sums):
    mods = triton_modules(lambda x_, l_: moe_decode_routed(
        x_, l_, experts, shared, down_f16=True, **gpu_kw), x, logits)
  (down,) = [mod for mod in mods if mod["name"].startswith("flint_moe_down")]
  assert "_h16_" in down["name"] and "fma.rn.f16x2" in down["asm"], down["name"]
  assert ("mov.b32 $0, alo" in down["asm"]) == (sums == "block")
  with pytest.raises(ValueError, match="down_f16 needs gate_up_f16"):
    moe_decode_routed(x, logits, experts, shared, down_f16=True,
                      **dict(kw, gate_up_f16=False))


@pytest.mark.parametrize("fmt,m,e,f16,ties", [("nvfp4", 8, 32, "down", False),
                                              ("nvfp4", 3, 20, "gate_up", True),
                                              ("nvfp4", 2, 32, None, False),
                                              ("bf16", 5, 32, None, True)])
def test_moe_decode_routed_shared_with_topk(fmt, m, e, f16, ties):
  """``shared_with_topk``: the top-k and the shared expert's gate_up in one launch, then the
  routed slots alone: the routing and y bit-identical to the one-launch gate_up (prerouted),
  E not a power of two and tied logits included; the combine entry point too; both kernels
  lower for an H200; misuse rejected."""
  _, experts, shared, x, _, logits = _routed_case(fmt, m, e, 6, 256, 128, 256, ties, "shtopk")
  kw = dict(top_k=6, decode=DECODE, slot_rows="token", shared_rows="token",
            gate_up_f16=f16 is not None, down_f16=f16 == "down", interpret=INTERPRET)
  y, route = moe_decode_routed(x, logits, experts, shared, shared_with_topk=True, **kw)
  y0, route0 = moe_decode_routed(x, logits, experts, shared, prerouted=True, **kw)
  assert_route_is_top_k(route, logits, 6)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route0.ids))
  np.testing.assert_array_equal(np.asarray(route.logits), np.asarray(route0.logits))
  np.testing.assert_array_equal(np.asarray(used_rows(y, 6), np.float32),
                                np.asarray(used_rows(y0, 6), np.float32))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "token", f"shared_with_topk {fmt} M={m}")
  r1 = assert_combine_as_prerouted(x, logits, experts, shared, kw, f"shtopk-h{fmt}",
                                   shared_with_topk=True)
  np.testing.assert_array_equal(np.asarray(r1.ids), np.asarray(route0.ids))
  from flint_jax.pallas.testing import triton_modules
  gpu_kw = dict(kw, decode="asm", interpret=False)
  mods = triton_modules(lambda x_, l_: moe_decode_routed(
      x_, l_, experts, shared, shared_with_topk=True, **gpu_kw), x, logits)
  names = sorted(mod["name"] for mod in mods)
  assert [n.split("_")[2] for n in names] == ["down", "gate", "topk"], names
  assert "_shtopk" in names[1] and "topk_shared" in names[2], names
  with pytest.raises(ValueError, match="shared_with_topk computes the routing"):
    moe_decode_routed(x, logits, experts, shared, shared_with_topk=True, prerouted=False, **kw)
  with pytest.raises(ValueError, match="shared_with_topk needs"):
    moe_decode_routed(x, logits, experts, shared, shared_with_topk=True,
                      **dict(kw, shared_rows="all", gate_up_f16=False, down_f16=False))


@pytest.mark.parametrize("m,kw", [(8, dict(slot_rows="token", gate_up_f16=True, down_f16=True)),
                                  (3, dict(slot_rows="token")),
                                  (2, dict(slot_rows="all")),
                                  (1, dict(slot_rows="token", shared_rows="token",
                                           gate_up_f16=True, num_warps=4))])
def test_moe_decode_routed_codes_ahead(m, kw):
  """``codes_ahead``: the gate_up kernel's K loop unrolled with each step's weight tiles loaded
  before the previous step's decode: y bit-identical to the looped kernel's (the same products
  in the same order); lowered for an H200."""
  _, experts, shared, x, _, logits = _routed_case("nvfp4", m, 32, 6, 256, 128, 256, False,
                                                  f"ahead{m}")
  kw = dict(kw, top_k=6, decode=DECODE, block_k=64, interpret=INTERPRET)   # 4 K steps
  y, route = moe_decode_routed(x, logits, experts, shared, codes_ahead=True, **kw)
  y0, route0 = moe_decode_routed(x, logits, experts, shared, **kw)
  np.testing.assert_array_equal(np.asarray(route.ids), np.asarray(route0.ids))
  np.testing.assert_array_equal(np.asarray(used_rows(y, 6), np.float32),
                                np.asarray(used_rows(y0, 6), np.float32))
  ref, _ = moe_decode_routed_reference(x, logits, experts, shared, top_k=6)
  assert_routed_close(y, ref, 6, "token", f"codes_ahead M={m}")
  from flint_jax.pallas.testing import triton_modules
  gpu_kw = dict(kw, decode="asm", interpret=False)
  for ahead in (True, False):
    mods = triton_modules(lambda x_, l_: moe_decode_routed(
        x_, l_, experts, shared, codes_ahead=ahead, **gpu_kw), x, logits)
    (gate_up,) = [mod for mod in mods if mod["name"].startswith("flint_moe_gate_up")]
    assert ("scf.for" in gate_up["asm"]) != ahead, ahead    # the K loop unrolled or not
