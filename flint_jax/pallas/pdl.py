"""Programmatic dependent launch (PDL) from inside Pallas Triton kernels: ``griddepcontrol``.

On Hopper, XLA launches every kernel it compiles -- its own fusions and the Triton kernels of
``pl.pallas_call`` alike -- with programmatic stream serialization (programmatic edges in a
command buffer), and inserts ``griddepcontrol.wait`` at the *entry* of each of them
(``--xla_gpu_enable_pdl``, on by default; XLA's InsertPDL pass). So a kernel may be launched
before its predecessor has finished -- as soon as every CTA of the predecessor has executed
``griddepcontrol.launch_dependents`` or exited -- and then waits at its entry until the
predecessor has completed and its writes are visible. Measured on the H200 (run 47,
``benchmarks/pdl_triton_probe.py``): a kernel's first instruction after that wait runs
0.6-0.8 us after its predecessor's last one, with or without an early trigger; a Pallas kernel
cannot run anything (e.g. its weight loads) before the wait XLA puts in front of it. (The
probe and its ``griddepcontrol.wait`` / ``%globaltimer`` primitives were retired after 35c0874.)

What is left to a kernel is to *trigger early*: ``launch_dependents()`` at its start lets the
next kernel's CTAs be placed and reach their entry wait while this one works (a chain of
norm -> GEMV kernels: -0.1 us per kernel, run 47). ``_common.pallas_call`` does that for a
kernel whose wrapper is called with ``early_trigger=True`` (every kernel wrapper's static
argument; the decode step passes ``DecodePlan.early_trigger``: on for BF16 weights, off for
NVFP4). It is
safe because every kernel XLA launches with PDL waits at its entry before touching memory, and
a kernel launched without PDL (a memset, a library GEMM) starts after its predecessor ends
anyway; and because the trigger comes after the entry wait, at most one kernel ahead is placed
and waiting (no chain of waiting CTAs can crowd out a predecessor's unplaced CTAs).
``tests/test_pallas_pdl.py`` checks the entry wait on the GPU: a consumer that does not wait
itself still reads what its triggering producer wrote last.

``launch_dependents()`` is ``griddepcontrol.launch_dependents``: a side-effecting jaxpr primitive
(kept by dead-code elimination) lowered to non-pure inline asm with a memory clobber, so neither
LLVM nor Triton moves memory accesses across it; it returns an int32 zero, and is a no-op (a
zero) in interpret mode.
"""

from __future__ import annotations

import functools

import numpy as np

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import effects
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.lib.triton import dialect as tt_dialect

__all__ = ["launch_dependents", "with_early_trigger"]

class GridDependencyEffect(effects.Effect):
  """griddepcontrol / timer reads: not pure, so jaxpr dead-code elimination keeps them."""

  def __str__(self):
    return "GridDependency"


EFFECT = _EFFECT = GridDependencyEffect()
for _allowed in (effects.lowerable_effects, effects.control_flow_allowed_effects,
                 effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
  _allowed.add_type(GridDependencyEffect)


def _asm_primitive(name: str, asm: str, constraints: str):
  """A nullary effectful primitive -> int32 scalar, lowered for Triton to non-pure inline asm."""
  prim = jax_core.Primitive(name)
  prim.def_impl(lambda: np.int32(0))
  prim.def_effectful_abstract_eval(lambda: (jax_core.ShapedArray((), jnp.int32), {_EFFECT}))
  # interpret mode / any non-Triton lowering: a constant zero
  mlir.register_lowering(prim, lambda ctx: [mlir.ir_constant(np.int32(0))])

  @triton_lowering.register_lowering(prim)
  def _lower(ctx):  # noqa: ARG001
    i32 = ir.IntegerType.get_signless(32)
    return tt_dialect.elementwise_inline_asm([i32], asm, constraints=constraints, pure=False,
                                             packed_element=1, args=[])

  return prim


_launch_p = _asm_primitive("flint_griddepcontrol_launch_dependents",
                           "griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;",
                           "=r,~{memory}")


def launch_dependents():
  """``griddepcontrol.launch_dependents`` in a Pallas Triton kernel; returns an int32 0."""
  return _launch_p.bind()


def with_early_trigger(kernel):
  """``kernel`` (a Pallas kernel body) that first executes ``launch_dependents``."""

  @functools.wraps(kernel)
  def body(*refs, **kw):
    launch_dependents()
    return kernel(*refs, **kw)

  return body
