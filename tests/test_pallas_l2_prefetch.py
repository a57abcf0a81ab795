"""The L2 prefetch primitive (``pallas.l2_prefetch``) and ``_common.pallas_call(prefetch=,
touch=)``.

On the CPU: the request plan covers exactly the asked bytes in 16-byte granules, a kernel with
prefetch inputs computes what it computes without them (interpret mode: the prefetch is a
no-op), and the PTX request is in the kernel lowered for an H200. On the GPU
(``JAX_PLATFORMS=cuda``): the compiled kernels, including a prefetch of odd-sized arrays whose
last requests are shortened, give the same results.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C
from flint_jax.pallas import l2_prefetch
from flint_jax.pallas.testing import triton_modules

ON_GPU = jax.default_backend() not in ("cpu", "tpu")


@pytest.mark.parametrize("total,parts,chunks", [
    (2048 * 4096 * 2, 64, 128), (96000, 7, 128), (4096, 3, 4), (1 << 20, 224, 128), (48, 5, 2)])
def test_chunk_plan_covers_the_buffer_once(total, parts, chunks):
  per = l2_prefetch.slice_bytes(total, parts, chunks)
  assert per % (16 * chunks) == 0 and per * parts >= total
  covered = np.zeros(total, np.int32)
  for part in range(parts):
    offs, sizes = (np.asarray(a) for a in l2_prefetch.chunk_plan(total, part * per, per, chunks))
    assert (offs % 16 == 0).all() and (sizes % 16 == 0).all() and (sizes >= 0).all()
    for o, n in zip(offs, sizes):
      if n:
        assert o + n <= total
        covered[o:o + n] += 1
  assert (covered == 1).all()


@pytest.mark.parametrize("total,parts,page", [
    (256 << 20, 64, 2 << 20), (288 << 20, 7, 2 << 20), (5 * 4096 + 48, 3, 4096),
    (4096, 16, 4096), (96000, 448, 1024)])
def test_page_plan_touches_every_page_once(total, parts, page):
  n_pages = -(-total // page)
  seen = np.zeros(n_pages, np.int32)
  for part in range(parts):
    offs, sizes = (np.asarray(a) for a in l2_prefetch.page_plan(total, part, parts, page))
    assert len(offs) == -(-n_pages // parts) and set(sizes.tolist()) <= {0, 16}
    for o, n in zip(offs, sizes):
      if n:
        assert o % page == 0 and o + n <= total
        seen[o // page] += 1
  assert (seen == 1).all()


def _kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + 1.0


def _call(x, *prefetch, interpret, touch=()):
  return C.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(3, 2),
                       in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
                       out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
                       prefetch=len(prefetch), touch=len(touch), touch_page=1024,
                       interpret=interpret, name="l2pf_test")(x, *prefetch, *touch)


def _prefetched():
  gen = np.random.default_rng(0)
  x = jnp.asarray(gen.standard_normal((24, 256)), jnp.float32)
  w1 = jnp.asarray(gen.standard_normal((1000, 48)), jnp.bfloat16)   # 96000 B: uneven parts
  w2 = jnp.asarray(gen.integers(0, 255, (333, 16)), jnp.uint8)       # 5328 B
  return x, w1, w2


def test_prefetch_inputs_change_nothing():
  x, w1, w2 = _prefetched()
  want = x * 2.0 + 1.0
  for pf in ((), (w1,), (w1, w2)):
    np.testing.assert_array_equal(np.asarray(_call(x, *pf, interpret=not ON_GPU)), want)


def test_touch_inputs_change_nothing():
  x, w1, w2 = _prefetched()
  want = x * 2.0 + 1.0
  for pf, touch in (((), (w1,)), ((w2,), (w1, w2))):
    np.testing.assert_array_equal(
        np.asarray(_call(x, *pf, touch=touch, interpret=not ON_GPU)), want)


def test_touch_in_the_lowered_kernel():
  """One 16-byte request per page: the touched buffers each add one request site."""
  x, w1, w2 = _prefetched()
  (mod,) = triton_modules(lambda a, b, c: _call(a, touch=(b, c), interpret=False), x, w1, w2)
  assert mod["asm"].count("cp.async.bulk.prefetch.L2.global") == 2
  (both,) = triton_modules(lambda a, b, c: _call(a, b, touch=(c,), interpret=False), x, w1, w2)
  assert both["asm"].count("cp.async.bulk.prefetch.L2.global") == 2


def test_touch_of_a_buffer_over_2_gib_refused():
  ref = jax.ShapeDtypeStruct((1 << 31,), jnp.uint8)
  with pytest.raises(ValueError, match="under 2 GiB"):
    l2_prefetch.touch_pages(ref, 0, 4)


def test_prefetch_in_the_lowered_kernel():
  x, w1, w2 = _prefetched()
  (mod,) = triton_modules(lambda a, b, c: _call(a, b, c, interpret=False), x, w1, w2)
  assert mod["asm"].count("cp.async.bulk.prefetch.L2.global") == 2
  (plain,) = triton_modules(lambda a: _call(a, interpret=False), x)
  assert "cp.async.bulk.prefetch" not in plain["asm"]


def test_buffer_not_a_multiple_of_16_bytes_is_skipped():
  x, _, _ = _prefetched()
  odd = jnp.zeros((7,), jnp.uint8)
  (mod,) = triton_modules(lambda a, b: _call(a, b, interpret=False), x, odd)
  assert "cp.async.bulk.prefetch" not in mod["asm"]
  np.testing.assert_array_equal(np.asarray(_call(x, odd, interpret=not ON_GPU)), x * 2.0 + 1.0)


def test_prefetch_count_checked():
  x, _, _ = _prefetched()
  call = C.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                       prefetch=2, interpret=True, name="l2pf_bad")
  with pytest.raises(ValueError, match="prefetch"):
    call(x)
