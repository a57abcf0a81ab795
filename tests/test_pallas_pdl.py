"""Programmatic dependent launch from the Pallas kernels (flint_jax.pallas.pdl).

CPU: a flint_jax kernel called with ``early_trigger=True`` (every wrapper's static argument)
triggers its dependents first (the Triton IR of a few kernels has
``griddepcontrol.launch_dependents`` as its first side effect), with ``early_trigger=False`` not;
the griddepcontrol op survives dead-code elimination; interpret mode runs it as a no-op.
GPU: the assumption the early trigger rests on -- XLA makes every Triton kernel wait at its entry
for its predecessor -- holds: a consumer that does not wait itself still reads what a producer
that triggered early wrote last.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas import _common as C
from flint_jax.pallas import pdl
from flint_jax.pallas.add_rms_norm import add_rms_norm
from flint_jax.pallas.attention_block import qk_norm_rope_attention
from flint_jax.pallas.gemv import gemv_silu_mul
from pallas_testing import triton_modules

S = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
ON_GPU = jax.default_backend() not in ("cpu", "tpu")
TRIGGER = "griddepcontrol.launch_dependents"
# %globaltimer (ns) for the GPU test's spinning producer: a test-only primitive
_timer_p = pdl._asm_primitive("flint_test_globaltimer_lo", "mov.u32 $0, %globaltimer_lo;", "=r")


def global_timer_lo():
  return _timer_p.bind()


def kernels_ir(fn, *args):
  mods = triton_modules(fn, *args)
  assert mods, "no pallas_call captured"
  return [m["asm"] for m in mods]


def _attention(q, k, v, wq, wk, pos, kc, vc, sinks, **kw):
  return qk_norm_rope_attention(q, k, v, wq, wk, pos, kc, vc, sinks, rope=True, ring=True,
                                window=33, **kw)


CASES = [
    ("add_rms_norm", lambda h, y, w, **kw: add_rms_norm(h, y, w, **kw),
     (S((2, 256), BF),) * 2 + (S((256,), BF),)),
    ("gemv_silu_mul", lambda x, w, **kw: gemv_silu_mul(x, w, w, **kw),
     (S((1, 256), BF), S((128, 256), BF))),
    ("attention", lambda *a, **kw: _attention(*a, **kw),
     (S((1, 8, 64), BF), S((1, 2, 64), BF), S((1, 2, 64), BF), S((64,), BF), S((64,), BF),
      S((1,), I32), S((1, 2, 64, 64), BF), S((1, 2, 64, 64), BF), S((8,), F32))),
]


@pytest.mark.parametrize("name,fn,args", CASES, ids=[c[0] for c in CASES])
def test_kernels_trigger_first(name, fn, args):
  irs = kernels_ir(lambda *a: fn(*a), *args)
  for ir in irs:
    assert TRIGGER in ir, f"{name}: no early trigger"
    first_effect = min(i for i in (ir.find("tt.load"), ir.find("tt.store"), ir.find(TRIGGER))
                       if i >= 0)
    assert ir.find(TRIGGER) == first_effect, f"{name}: the trigger is not the first memory op"
  # a static argument: the jitted wrapper caches the two kernels apart
  assert all(TRIGGER not in ir for ir in kernels_ir(lambda *a: fn(*a, early_trigger=False),
                                                   *args))
  assert all(TRIGGER in ir for ir in kernels_ir(lambda *a: fn(*a, early_trigger=True), *args))


def test_ops_survive_dce_and_interpret_as_noops():
  """Unused results: the ops stay in the IR (effectful); interpret mode computes zeros."""
  def kernel(x_ref, o_ref):
    pdl.launch_dependents()
    o_ref[...] = x_ref[...] + global_timer_lo().astype(jnp.float32)

  call = functools.partial(C.pallas_call, kernel, out_shape=S((16,), F32), name="pdl_ops",
                           early_trigger=True)
  (ir,) = kernels_ir(lambda x: call()(x), S((16,), F32))
  assert ir.count(TRIGGER) == 2 and "%globaltimer_lo" in ir
  x = jnp.arange(16, dtype=F32)
  np.testing.assert_array_equal(np.asarray(call(interpret=True)(x)), np.asarray(x))


def _producer(k_ref, flag_ref, *, spin_ns):
  t0 = global_timer_lo()
  jax.lax.while_loop(lambda t: (t - t0) < spin_ns, lambda _: global_timer_lo(), t0)
  flag_ref[0] = k_ref[0]


def _consumer(flag_ref, o_ref):
  o_ref[0] = flag_ref[0]                      # no wait of its own


@pytest.mark.skipif(not ON_GPU, reason="launch order needs the GPU")
def test_xla_waits_at_kernel_entry():
  """Producer triggers at its start (C.pallas_call) and writes k after spinning 20 us; the
  consumer (no wait, also triggering) reads it at once. Four pairs per call (a command buffer)
  and one (stream launches); every read must see this call's k."""
  def pair(k):
    flag = C.pallas_call(functools.partial(_producer, spin_ns=20000), out_shape=S((1,), I32),
                         compiler_params=C.compiler_params(1, 1), name="pdl_test_producer",
                         early_trigger=True)(k)
    return C.pallas_call(_consumer, out_shape=S((1,), I32),
                         compiler_params=C.compiler_params(1, 1), name="pdl_test_consumer",
                         early_trigger=True)(flag)

  for pairs in (1, 4):
    run = jax.jit(lambda k, pairs=pairs: [pair(k + i) for i in range(pairs)])
    for call in range(20):
      k = 1000 * (call + 1)
      got = [int(np.asarray(o)[0]) for o in run(jnp.array([k], I32))]
      assert got == [k + i for i in range(pairs)], (pairs, call, got)
