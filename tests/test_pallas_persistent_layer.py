"""flint_jax/pallas/persistent_layer.py (issue #43 prototype): the persistent MoE-layer kernel
against its reference (today's chain's references composed) in interpret mode at small shapes,
two calls in a row (the counters come back zeroed), and its lowering for an H200 at Flint size
with the prefetches ahead of their spin loops in the Triton IR."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_testing import assert_close, randn, rng, triton_modules
from flint_jax.pallas import persistent_layer as PL

ON_GPU = jax.default_backend() not in ("cpu", "tpu")


def _inputs(gen, d, e, i, i_s, n):
  a, h = randn(gen, (1, d)), randn(gen, (1, d))
  wp = randn(gen, (d,), scale=0.2, dtype=jnp.float32) + 1.0
  wi = randn(gen, (d,), scale=0.2, dtype=jnp.float32) + 1.0
  rw = randn(gen, (e, d), scale=d ** -0.5, dtype=jnp.float32)
  ex = dict(gate_up_proj=randn(gen, (e, 2 * i, d), scale=2 * d ** -0.5),
            down_proj=randn(gen, (e, d, i), scale=i ** -0.5))
  sh = dict(gate_proj=randn(gen, (i_s, d), scale=2 * d ** -0.5),
            up_proj=randn(gen, (i_s, d), scale=d ** -0.5),
            down_proj=randn(gen, (d, i_s), scale=i_s ** -0.5))
  return a, h, wp.astype(jnp.bfloat16), rw, ex, sh, wi.astype(jnp.bfloat16), \
      randn(gen, (n, d), scale=d ** -0.5)


def _check(out, ref, what):
  s, qkv, ids, top, _ = out
  rs, rqkv, rids, rtop = ref
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids), err_msg=f"{what}: routing")
  assert_close(top, rtop, what=f"{what}: top logits", atol=1e-5, rtol=1e-5)
  assert_close(s, rs, what=f"{what}: s")
  assert_close(qkv, rqkv, what=f"{what}: qkv")


# (D, E, I, I_s, N, top_k, programs, tuning): odd E / N / programs, top-k 2..6
CASES = [
    (64, 12, 16, 32, 96, 3, 3, {}),
    (128, 16, 32, 64, 160, 6, 5, dict(block_gu=2, block_down=8, block_qkv=8, block_router=4)),
    (64, 8, 16, 16, 48, 2, 4, dict(block_gu=2, block_down=32, block_router=1)),
    # more programs than shared-expert groups (late first loads), than q|k|v and down groups
    (64, 8, 16, 16, 32, 2, 6, dict(block_gu=4, block_qkv=8, block_down=16)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_twice(case):
  d, e, i, i_s, n, k, g, tuning = CASES[case]
  gen = rng("persistent", case)
  args = _inputs(gen, d, e, i, i_s, n)
  cnt = jnp.zeros((PL.N_COUNTERS,), jnp.int32)
  run = lambda a, cnt: PL.persistent_moe_layer(  # noqa: E731
      a, *args[1:], cnt, top_k=k, programs=g, interpret=not ON_GPU, **tuning)
  out = run(args[0], cnt)
  _check(out, PL.persistent_moe_layer_reference(*args, top_k=k), "call 1")
  # every wait found its counter at the target (CHECK) and the last arriver zeroed the rest
  np.testing.assert_array_equal(np.asarray(out[4]), 0)
  a2 = randn(gen, (1, d), scale=3.0)             # a second call with the returned counters
  out2 = run(a2, out[4])
  _check(out2, PL.persistent_moe_layer_reference(a2, *args[1:], top_k=k), "call 2")
  np.testing.assert_array_equal(np.asarray(out2[4]), 0)


def test_rejects_bad_configs():
  gen = rng("persistent-bad")
  args = _inputs(gen, 64, 8, 16, 16, 48)
  cnt = jnp.zeros((PL.N_COUNTERS,), jnp.int32)
  with pytest.raises(ValueError, match="programs must be"):
    PL.persistent_moe_layer(*args, cnt, top_k=2, programs=0, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    PL.persistent_moe_layer(*args, cnt, top_k=2, programs=2, block_gu=3, interpret=True)
  with pytest.raises(ValueError, match="counters"):
    PL.persistent_moe_layer(*args, cnt[:8], top_k=2, programs=2, interpret=True)


def _flint_shapes():
  S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  d, e, i, i_s, n = 2048, 256, 512, 1024, 5120
  return (S((1, d), bf), S((1, d), bf), S((d,), bf), S((e, d), jnp.float32),
          dict(gate_up_proj=S((e, 2 * i, d), bf), down_proj=S((e, d, i), bf)),
          dict(gate_proj=S((i_s, d), bf), up_proj=S((i_s, d), bf), down_proj=S((d, i_s), bf)),
          S((d,), bf), S((n, d), bf), S((PL.N_COUNTERS,), jnp.int32))


def _top_level_ops(ir):
  """(kind, line) of the kernel body's ops of interest, in program order."""
  pat = re.compile(r"(scf\.while|elementwise_inline_asm|tt\.atomic_rmw|"
                   r"tt\.load \S+(?:, \S+)* : tensor<(\d+)x(\d+)x!tt\.ptr<bf16>>)")
  out = []
  for ln in ir.splitlines():
    m = pat.search(ln)
    if m:
      op = m.group(1)
      out.append("load" if op.startswith("tt.load") else "asm" if "asm" in op
                 else op.split(".")[-1])
  return out


@pytest.mark.parametrize("hold", [True, False])
def test_lowers_for_h200_with_prefetch_before_waits(hold):
  (mod,) = triton_modules(lambda *a: PL.persistent_moe_layer(*a, hold_prefetch=hold),
                          *_flint_shapes())
  ir = mod["asm"]
  assert mod["grid"] == [132] and mod["num_warps"] == 8
  k = 6
  assert ir.count("scf.while") == k + 3, "waits: routing, shared + 6 slots, the layer's s"
  # arrivals: router, per gate_up group, S, DONE; acquires: one per wait
  assert ir.count("tt.atomic_rmw") == 4 + k + 3
  assert ir.count("isVolatile = true") >= k + 3
  assert ir.count("elementwise_inline_asm") == (3 if hold else 0)
  ops = _top_level_ops(ir)
  whiles = [j for j, o in enumerate(ops) if o == "while"]
  # routing wait: the shared expert's first gate and up rows are loaded (and held) before it
  arrive = ops.index("atomic_rmw")
  assert ops[arrive + 1:whiles[0]] == ["load", "load"] + (["asm", "asm"] if hold else [])
  # down stage (waits 1..k+1: shared, slots 0..k-1): the shared and slot 0 rows are loaded
  # before the first wait, slot j + 1's before the wait on slot j
  assert ops[whiles[1] - 2:whiles[1]] == ["load", "load"]
  for a, b in zip(whiles[1:k], whiles[2:k + 1]):
    assert "load" in ops[a:b], "a down-weight load between two slot waits"
  # the q|k|v wait: its first rows loaded (and held) after the S arrival, before the spin
  last = whiles[-1]
  pre = ops[ops[:last].index("atomic_rmw", whiles[k + 1]):last]
  assert "load" in pre and (("asm" in pre) == hold)


def test_timestamps_output():
  (mod,) = triton_modules(lambda *a: PL.persistent_moe_layer(*a, timestamps=True),
                          *_flint_shapes())
  assert mod["asm"].count("globaltimer_lo") == 7
  args = _inputs(rng("persistent-ts"), 64, 8, 16, 16, 48)
  out = PL.persistent_moe_layer(*args, jnp.zeros((PL.N_COUNTERS,), jnp.int32), top_k=2,
                                programs=2, timestamps=True, interpret=not ON_GPU)
  assert len(out) == 6 and out[5].shape == (2, PL.N_STAMPS) and out[5].dtype == jnp.int32


@pytest.mark.skipif(not ON_GPU, reason="all programs resident at once: needs the GPU")
def test_flint_size_on_gpu():
  gen = rng("persistent-gpu")
  args = _inputs(gen, 2048, 32, 512, 1024, 5120)   # Flint's layer with 32 experts (host RAM)
  out = PL.persistent_moe_layer(*args, jnp.zeros((PL.N_COUNTERS,), jnp.int32))
  _check(out, PL.persistent_moe_layer_reference(*args), "flint size")
  np.testing.assert_array_equal(np.asarray(out[4]), 0)
