"""add_rms_norm / rms_norm vs references (Flint's RMSNorm: weight multiplied in fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas.add_rms_norm import (add_rms_norm, add_rms_norm_reference, rms_norm,
                                           rms_norm_reference)
from pallas_testing import assert_close, randn, rng

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize("m,d,dtype", [(8, 2048, jnp.bfloat16), (3, 300, jnp.bfloat16),
                                       (1, 256, jnp.float32)])
def test_add_rms_norm(m, d, dtype):
  gen = rng(m, d, str(dtype))
  h, y = randn(gen, (m, d), dtype, 4.0), randn(gen, (m, d), dtype)
  w = randn(gen, (d,), jnp.bfloat16, 0.3) + 1
  s, out = add_rms_norm(h, y, w, interpret=INTERPRET)
  s_ref, out_ref = add_rms_norm_reference(h, y, w)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
  assert_close(out, out_ref, what="add_rms_norm")
  assert_close(rms_norm(h, w, interpret=INTERPRET), rms_norm_reference(h, w), what="rms_norm")


def test_weight_multiplied_before_cast():
  """out = bf16(w * normed) in fp32, not bf16(w * bf16(normed)) (FLINT_SPEC section 3)."""
  x = jnp.full((1, 256), 1.0, jnp.bfloat16).at[0, 0].set(3.0)
  w = jnp.full((256,), 1.0 + 2 ** -7, jnp.bfloat16)
  out = rms_norm(x, w, interpret=INTERPRET)
  x32 = np.asarray(x, np.float32)
  normed = x32 / np.sqrt(np.mean(x32 ** 2) + 1e-6)
  want = jnp.asarray(np.float32(1 + 2 ** -7) * normed, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("d", [2048, 1001])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_add_rms_norm_split_k_partials(parts, m, d):
  """y as fp32 split-K partials [S, M, D]: summed in the kernel, rounded to bf16, then added."""
  gen = rng("parts", parts, m, d)
  h = randn(gen, (m, d), jnp.bfloat16, 4.0)
  y = randn(gen, (parts, m, d), jnp.float32)
  w = randn(gen, (d,), jnp.bfloat16, 0.3) + 1
  s, out = add_rms_norm(h, y, w, interpret=INTERPRET)
  s_ref, out_ref = add_rms_norm_reference(h, y, w)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
  assert_close(out, out_ref, what="add_rms_norm partials")
  # the unfused path it replaces: XLA sum + cast, then add_rms_norm on [M, D]
  s2, out2 = add_rms_norm(h, jnp.sum(y, axis=0).astype(h.dtype), w, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s2, np.float32))
  assert_close(out, out2, what="add_rms_norm partials vs summed")


def test_add_rms_norm_rejects_bad_partials():
  h, w = jnp.zeros((2, 256), jnp.bfloat16), jnp.ones((256,), jnp.bfloat16)
  with pytest.raises(ValueError, match="float32"):
    add_rms_norm(h, jnp.zeros((2, 2, 256), jnp.bfloat16), w, interpret=True)
  with pytest.raises(ValueError, match="S, M, D"):
    add_rms_norm(h, jnp.zeros((2, 3, 256), jnp.float32), w, interpret=True)
  with pytest.raises(ValueError, match="must match h"):
    add_rms_norm(h, jnp.zeros((2, 256), jnp.float32), w, interpret=True)


@pytest.mark.parametrize("m,d,scale", [(8, 2048, 1.0), (3, 300, 1e3), (2, 256, 1e-4)])
def test_add_rms_norm_x16(m, d, scale):
  """``x16=True``: the kernel also writes ``nvfp4_gemv.x16_operand(out)`` (the MoE gate_up's
  f16 operand, permuted and scaled per row) bit for bit, with s and out unchanged (D = 300: a
  padded row); lowered for an H200."""
  from flint_jax.pallas.nvfp4_gemv import x16_operand
  from pallas_testing import triton_modules
  gen = rng("x16", m, d)
  h, y = randn(gen, (m, d), jnp.bfloat16, 4.0), randn(gen, (m, d), jnp.bfloat16)
  w = (randn(gen, (d,), jnp.float32, 0.3) + 1) * scale
  s, out, x16, inv = add_rms_norm(h, y, w, x16=True, interpret=INTERPRET)
  s0, out0 = add_rms_norm(h, y, w, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s0, np.float32))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out0, np.float32))
  want16, want_inv = x16_operand(out)
  np.testing.assert_array_equal(np.asarray(x16).view(np.uint16), np.asarray(want16).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(want_inv))
  mods = triton_modules(lambda *a: add_rms_norm(*a, x16=True), h, y, w)
  assert [mod["name"] for mod in mods] == [f"flint_add_rms_norm_d{d}_x16"]
