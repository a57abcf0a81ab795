"""Pallas kernels launched by flint_jax itself (flint_jax.pallas.ffi_launch).

CPU (needs the ``triton`` package and ``g++`` + ``cuda.h``, else skipped): the launcher library
builds; a kernel traced under ``ffi_launch.enabled`` lowers to the ``flint_pdl_launch`` FFI call
with its cubin, grid and parameter count, and not to XLA's Triton call; the decode step with
``DecodeOptions(launch="ffi")`` has no Triton call left. Always: bad options are refused.
GPU: kernels launched this way (entry wait, or weights loaded before their own wait; with and
without PDL; an in-place output) equal the same kernels launched by XLA on fresh inputs, and the
tiny model's decode step gives the same logits.
"""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

import flint_jax
from flint_jax import fast_decode
from flint_jax.fast_decode import DecodeOptions
from flint_jax.model import FlintForCausalLM
from flint_jax.pallas import _common as C
from flint_jax.pallas import ffi_launch, gemv, testing

S = jax.ShapeDtypeStruct
BF, F32 = jnp.bfloat16, jnp.float32
ON_GPU = jax.default_backend() not in ("cpu", "tpu")


def _has_triton():
  import importlib.util   # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec("triton") is not None


def _can_build():
  try:
    ffi_launch._cuda_include()   # pylint: disable=protected-access
  except FileNotFoundError:
    return False
  return shutil.which("g++") is not None


needs_triton = pytest.mark.skipif(not _has_triton(), reason="needs the triton package")
needs_build = pytest.mark.skipif(not _can_build(), reason="needs g++ and cuda.h")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


def test_launch_option_validated():
  with pytest.raises(ValueError, match="launch"):
    DecodeOptions(launch="cuda")


@needs_build
def test_library_builds(tmp_path, monkeypatch):
  monkeypatch.setenv("FLINT_JAX_CACHE", str(tmp_path))
  monkeypatch.delenv("FLINT_JAX_PDL_LAUNCH_LIB", raising=False)
  path = ffi_launch.library_path()
  assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
  assert ffi_launch.library_path() == path     # built once, keyed by the source's hash


# ------------------------------------------------------------------------------------------
# A GEMV whose programs may load their weight tiles before waiting for x.


def _probe_gemv(x, w, *, launch, preload=0, pdl_launch=True, bn=32, bk=128):
  n, k = w.shape
  kern = functools.partial(testing.preload_gemv_kernel, bn=bn, bk=bk, k=k, preload=preload,
                           trigger=False)
  kw = dict(out_shape=S((1, n), F32), grid=(n // bn,), compiler_params=C.compiler_params(4, 3),
            name="ffi_test_gemv")
  if launch == "xla":
    return pl.pallas_call(kern, **kw)(x, w)
  return ffi_launch.pallas_call(kern, entry_wait=False, pdl_launch=pdl_launch, **kw)(x, w)


def _add_kernel(a_ref, b_ref, o_ref):
  o_ref[...] = a_ref[...] + b_ref[...]


def _inplace_add(a, b, *, launch):
  """a + b written over a (input_output_aliases {0: 0})."""
  kw = dict(out_shape=S(a.shape, a.dtype), grid=(1,), input_output_aliases={0: 0},
            name="ffi_test_add")
  if launch == "xla":
    return pl.pallas_call(_add_kernel, **kw)(a, b)
  return ffi_launch.pallas_call(_add_kernel, **kw)(a, b)


@needs_triton
@needs_build
def test_lowers_to_the_ffi_call():
  args = (S((1, 256), BF), S((96, 256), BF))
  txt = testing.lower_for_h200(lambda x, w: _probe_gemv(x, w, launch="ffi", preload=1),
                               *args).as_text()
  assert "flint_pdl_launch" in txt and "__gpu$xla.gpu.triton" not in txt
  assert "grid_x = 3 : i64" in txt and "threads = 128 : i64" in txt and "pdl = true" in txt
  # the routing switch of _common.pallas_call: the same kernel through XLA unless enabled
  fn = lambda x, w: gemv(x, w)   # noqa: E731
  assert "flint_pdl_launch" not in testing.lower_for_h200(fn, *args).as_text()
  with ffi_launch.enabled(True):
    txt = testing.lower_for_h200(lambda x, w: gemv(x, w), *args).as_text()
  assert "flint_pdl_launch" in txt and "__gpu$xla.gpu.triton" not in txt


@needs_triton
@needs_build
@pytest.mark.parametrize("quant", [False, True])
def test_decode_step_has_no_xla_triton_call(quant):
  from flint_jax.cache import cache_shapes   # pylint: disable=g-import-not-at-top
  cfg = flint_jax.preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,))
  graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(0)))
  step = fast_decode.make_decode_step(graphdef, cfg, options=DecodeOptions(launch="ffi"))
  txt = testing.lower_for_h200(lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
                               S((1,), jnp.int32)).as_text()
  assert txt.count("flint_pdl_launch(") > 8
  assert "__gpu$xla.gpu.triton" not in txt


# ------------------------------------------------------------------------------------------
# GPU


@gpu
@pytest.mark.parametrize("n,k,preload,pdl_launch", [
    (96, 384, 0, True), (96, 384, 2, True), (160, 640, 1, False), (2048, 2048, 2, True)])
def test_gemv_equals_xla_launch(n, k, preload, pdl_launch):
  gen = testing.rng("ffi_gemv", n, k, preload, pdl_launch)
  x, w = testing.randn(gen, (1, k)), testing.randn(gen, (n, k), scale=k ** -0.5)
  ref = jax.jit(functools.partial(_probe_gemv, launch="xla"))(x, w)
  out = jax.jit(functools.partial(_probe_gemv, launch="ffi", preload=preload,
                                  pdl_launch=pdl_launch))(x, w)
  testing.assert_close(out, ref, what="ffi gemv")


@gpu
def test_chain_reads_fresh_activations():
  """A chain of producer -> GEMV layers: a GEMV that loads its weights before its wait still
  reads its producer's x of this layer (a stale read would change the output)."""
  gen = testing.rng("ffi_chain")
  ws = [testing.randn(gen, (256, 256), scale=256 ** -0.5) for _ in range(6)]
  y0 = testing.randn(gen, (1, 256), F32)

  def chain(ws, y, launch):
    for w in ws:
      x = (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(BF)
      y = _probe_gemv(x, w, launch=launch, preload=1 if launch == "ffi" else 0)
    return y

  ref = jax.jit(functools.partial(chain, launch="xla"))(ws, y0)
  out = jax.jit(functools.partial(chain, launch="ffi"))(ws, y0)
  testing.assert_close(out, ref, what="ffi chain")


@gpu
def test_in_place_output():
  gen = testing.rng("ffi_add")
  a, b = testing.randn(gen, (8, 128), F32), testing.randn(gen, (8, 128), F32)
  want = np.asarray(a) + np.asarray(b)
  out = jax.jit(functools.partial(_inplace_add, launch="ffi"), donate_argnums=0)(a + 0, b)
  np.testing.assert_array_equal(np.asarray(out), want)


@gpu
@pytest.mark.parametrize("quant", [False, True])
def test_decode_step_equals_xla_launch(quant):
  from flint_jax.cache import init_cache   # pylint: disable=g-import-not-at-top
  cfg = flint_jax.preset("tiny", num_hidden_layers=3, mlp_only_layers=(0,))
  graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(7)))
  ref_step = jax.jit(fast_decode.make_decode_step(graphdef, cfg))
  ffi_step = jax.jit(fast_decode.make_decode_step(graphdef, cfg,
                                                  options=DecodeOptions(launch="ffi")))
  c1 = c2 = init_cache(cfg, 2, 64)
  for t in ([5, 9], [17, 2], [3, 30]):
    tokens = jnp.array(t, jnp.int32)
    l1, c1 = ref_step(state, c1, tokens)
    l2, c2 = ffi_step(state, c2, tokens)
    np.testing.assert_allclose(np.asarray(l2, np.float32), np.asarray(l1, np.float32),
                               rtol=2e-2, atol=2e-2)
