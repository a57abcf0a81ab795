"""Test helpers for the Pallas kernels (random inputs, tolerances, lowering for an H200 on a
CPU host): ``import pallas_testing`` from the tests (pytest puts ``tests/`` on the path).
"""

from __future__ import annotations

import zlib

import numpy as np

import jax
import jax.numpy as jnp

from flint_jax.pallas.nvfp4_gemv import NVFP4Weight

# Tolerances by output dtype (JAX:tests/pallas/gpu_ops_test.py style): kernel and reference
# differ only in fp32 summation order and in where intermediates are rounded, so bf16 outputs
# may differ by one bf16 rounding step (2^-8 relative) of the largest terms.
TOLERANCES = {
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=1.6e-2),
    jnp.dtype(jnp.float32): dict(atol=1e-4, rtol=1e-4),
}


def assert_close(out, ref, *, dtype=None, scale=None, atol=None, rtol=None, what=""):
  """Element-wise |out - ref| <= atol * scale + rtol * |ref|, shapes/dtypes equal, no NaN.

  ``scale`` defaults to max|ref| so that atol is relative to the output's magnitude.
  """
  out, ref = jnp.asarray(out), jnp.asarray(ref)
  assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
  assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
  tol = TOLERANCES[jnp.dtype(dtype or ref.dtype)]
  atol = tol["atol"] if atol is None else atol
  rtol = tol["rtol"] if rtol is None else rtol
  o = np.asarray(out, np.float64)
  r = np.asarray(ref, np.float64)
  assert np.isfinite(o).all(), f"{what}: non-finite output ({np.sum(~np.isfinite(o))} values)"
  scale = float(np.max(np.abs(r))) if scale is None else scale
  err = np.abs(o - r)
  bound = atol * max(scale, 1e-30) + rtol * np.abs(r)
  bad = err > bound
  assert not bad.any(), (
      f"{what}: {bad.sum()} / {bad.size} values off; max err {err.max():.3g} "
      f"(scale {scale:.3g}); first at {np.argwhere(bad)[0].tolist()}")


def rel_l2(out, ref) -> float:
  o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def rng(*params) -> np.random.Generator:
  """A numpy Generator seeded from the test parameters (fresh inputs per parametrization;
  numpy, not jax.random, so that no eager XLA compilations slow the CPU tests down)."""
  return np.random.default_rng(zlib.crc32(repr(params).encode()))


def randn(gen: np.random.Generator, shape, dtype=jnp.bfloat16, scale=1.0):
  return jnp.asarray((scale * gen.standard_normal(shape)).astype(np.float32), dtype)


def random_nvfp4(gen: np.random.Generator, shape, *, scale_2=None, scale_lo=0x28,
                 scale_hi=0x40):
  """Random NVFP4 weight of logical shape [..., N, K]: every code byte value, finite e4m3 scales
  (bytes scale_lo..scale_hi-1: 2^-5 .. 0.875 with the defaults), tensor scale ~ K^-1/2 unless
  given. Returns NVFP4Weight."""
  *lead, n, k = shape
  q = gen.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)
  sb = gen.integers(scale_lo, scale_hi, (*lead, n, k // 16), dtype=np.uint8)
  s = jnp.asarray(sb.view(jnp.float8_e4m3fn))
  if scale_2 is None:
    scale_2 = gen.uniform(0.5, 2.0, tuple(lead)).astype(np.float32) / np.sqrt(k)
  return NVFP4Weight(jnp.asarray(q), s, jnp.asarray(scale_2, jnp.float32))


def random_kv_caches(gen: np.random.Generator, shape, *, dead=None, stacked: bool = False):
  """bf16 K/V caches of ``shape`` [B, KVH, S, Dh] (keys scaled 2x) -> (k_cache, v_cache, layer).

  ``dead`` [B, S] bool: those slots hold NaN keys and inf values, garbage a kernel must never
  let leak into its output. ``stacked``: the caches are layer 1 of a 3-layer stack whose other
  layers are NaN (``layer`` = 1; else None)."""
  kc = np.asarray(randn(gen, shape, scale=2.0), np.float32)
  vc = np.asarray(randn(gen, shape), np.float32)
  if dead is not None:
    d = np.asarray(dead)[:, None, :, None]
    kc, vc = np.where(d, np.nan, kc), np.where(d, np.inf, vc)
  kc, vc = jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16)
  if not stacked:
    return kc, vc, None
  kc = jnp.stack([jnp.full_like(kc, jnp.nan), kc, jnp.full_like(kc, jnp.nan)])
  vc = jnp.stack([jnp.full_like(vc, jnp.nan), vc, jnp.full_like(vc, jnp.nan)])
  return kc, vc, 1


def random_moe_weights(fmt: str, e: int, d: int, inter: int, inter_s: int,
                       gen: np.random.Generator):
  """(experts, shared) in the kernels' layout. fmt: 'bf16' (all bf16), 'nvfp4' (all NVFP4),
  'mixed' (bf16 experts, NVFP4 shared expert)."""
  if fmt in ("bf16", "mixed"):
    experts = dict(gate_up_proj=randn(gen, (e, 2 * inter, d), scale=2 * d ** -0.5),
                   down_proj=randn(gen, (e, d, inter), scale=inter ** -0.5))
  else:
    g = random_nvfp4(gen, (e, 2 * inter, d), scale_2=np.ones((e, 2)))
    s2 = gen.uniform(0.5, 2.0, (e, 2)).astype(np.float32) * 2 * d ** -0.5
    dn = random_nvfp4(gen, (e, d, inter))
    experts = dict(gate_up_qweight=g.qweight, gate_up_weight_scale=g.weight_scale,
                   gate_up_weight_scale_2=jnp.asarray(s2), down_qweight=dn.qweight,
                   down_weight_scale=dn.weight_scale, down_weight_scale_2=dn.weight_scale_2)
  if fmt == "bf16":
    shared = dict(gate_proj=randn(gen, (inter_s, d), scale=2 * d ** -0.5),
                  up_proj=randn(gen, (inter_s, d), scale=d ** -0.5),
                  down_proj=randn(gen, (d, inter_s), scale=inter_s ** -0.5))
  else:
    shared = dict(gate_proj=random_nvfp4(gen, (inter_s, d)),
                  up_proj=random_nvfp4(gen, (inter_s, d)),
                  down_proj=random_nvfp4(gen, (d, inter_s)))
  return experts, shared


def abstract_moe_weights(fmt: str, e: int, d: int, inter: int, inter_s: int):
  """``random_moe_weights``' (experts, shared) as shapes and dtypes only (ShapeDtypeStruct),
  for lowering at Flint sizes without building gigabytes of random weights on the host."""
  experts, shared = random_moe_weights(fmt, 1, d, inter, inter_s, np.random.default_rng(0))
  experts = {k: jax.ShapeDtypeStruct((e, *a.shape[1:]), a.dtype) for k, a in experts.items()}
  return experts, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shared)


def tie_logits(gen: np.random.Generator, m: int, e: int):
  """[m, e] f32 router logits with many exact ties (a 3-level set, a row of all-equal logits,
  -inf entries): routing must break them as ``lax.top_k`` does (lowest index first)."""
  lg = gen.integers(0, 3, (m, e)).astype(np.float32) * 0.5 - 0.5
  lg[0] = 0.25
  if m > 1:
    lg[1, ::3] = -np.inf
  return jnp.asarray(lg)


def h200_abstract_mesh():
  """Abstract single-device mesh of an H200, for lowering on a CPU-only host."""
  from jax._src.mesh import AbstractDevice  # pylint: disable=g-import-not-at-top
  dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


def lower_for_h200(fn, *args):
  """Lowers jit(fn)(*args) for CUDA (Pallas -> Triton IR) without a GPU. args may be
  ShapeDtypeStruct. Returns the Lowered object; raises if a kernel cannot lower."""
  with jax.sharding.use_abstract_mesh(h200_abstract_mesh()):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_modules(fn, *args):
  """[{name, asm, grid, num_warps, num_stages}] for every pallas_call of jit(fn)(*args), lowered
  for an abstract H200 (``lower_for_h200``, no GPU needed): ``asm`` is the kernel's Triton IR as
  text. Lowers afresh (a jit of ``fn`` already lowered would hit the cache and capture nothing:
  pass a new function object)."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src.pallas.triton import pallas_call_registration as reg
  captured = []
  lower_module, custom_call = reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call

  def lower_and_keep(*a, **k):
    res = lower_module(*a, **k)
    captured.append(dict(asm=res.module.operation.get_asm(enable_debug_info=False),
                         grid=[int(g) for g in res.grid]))
    return res

  def custom_call_and_keep(*a, backend_config=None, **k):
    if backend_config and "num_warps" in backend_config and captured:
      c = captured[-1]
      c.setdefault("num_warps", int(str(backend_config["num_warps"]).split(":")[0]))
      c.setdefault("num_stages", int(str(backend_config["num_stages"]).split(":")[0]))
      c.setdefault("name", str(backend_config["name"]).strip('"'))
    return custom_call(*a, backend_config=backend_config, **k)

  reg.lowering.lower_jaxpr_to_triton_module = lower_and_keep
  reg.mlir.custom_call = custom_call_and_keep
  try:
    lower_for_h200(fn, *args)
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = lower_module
    reg.mlir.custom_call = custom_call
  return captured
