"""Programmatic dependent launch (PDL) from inside Pallas Triton kernels: ``griddepcontrol``.

A kernel launched with programmatic stream serialization (XLA launches its kernels that way on
Hopper, ``--xla_gpu_enable_pdl``) may start before its predecessor has finished: as soon as
every CTA of the predecessor has executed ``griddepcontrol.launch_dependents`` (or exited).
Before it reads anything an earlier kernel wrote, it must execute ``griddepcontrol.wait``,
which blocks until the predecessor grids have completed and their writes are visible.

- ``grid_dependency_wait()``: ``griddepcontrol.wait``. Everything a kernel does before it must
  depend only on data no kernel of the same step writes (weights, constants, the KV cache
  slots of earlier steps).
- ``launch_dependents()``: ``griddepcontrol.launch_dependents``: lets the next kernel's CTAs
  start (and run up to their own wait) while this one works. Call it only *after*
  ``grid_dependency_wait()``: then at most one kernel ahead is resident and waiting, so a
  chain of kernels cannot fill the GPU with waiting CTAs (a deadlock for a predecessor with
  CTAs still to place).
- ``global_timer_lo()``: the low 32 bits of ``%globaltimer`` (ns), for probes.

Both griddepcontrol ops are no-ops in a kernel launched without PDL. Each returns an int32 zero
*token*: use it (e.g. add it to a scalar index) so that jax's dead-code elimination keeps the op
in the kernel jaxpr; the ops are lowered as side-effecting inline asm with a memory clobber, so
neither LLVM nor Triton moves loads or stores across them. In interpret mode (CPU) they are
zeros and the timer is 0.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.lib.triton import dialect as tt_dialect

__all__ = ["grid_dependency_wait", "launch_dependents", "global_timer_lo"]


def _asm_primitive(name: str, asm: str, constraints: str):
  """A nullary primitive -> int32 scalar, lowered for Triton to non-pure inline asm."""
  prim = jax_core.Primitive(name)
  prim.def_impl(lambda: np.int32(0))
  prim.def_abstract_eval(lambda: jax_core.ShapedArray((), jnp.int32))
  # interpret mode / any non-Triton lowering: a constant zero
  mlir.register_lowering(prim, lambda ctx: [mlir.ir_constant(np.int32(0))])

  @triton_lowering.register_lowering(prim)
  def _lower(ctx):  # noqa: ARG001
    i32 = ir.IntegerType.get_signless(32)
    return tt_dialect.elementwise_inline_asm([i32], asm, constraints=constraints, pure=False,
                                             packed_element=1, args=[])

  return prim


_wait_p = _asm_primitive("flint_griddepcontrol_wait",
                         "griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r,~{memory}")
_launch_p = _asm_primitive("flint_griddepcontrol_launch_dependents",
                           "griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;",
                           "=r,~{memory}")
_timer_p = _asm_primitive("flint_globaltimer_lo", "mov.u32 $0, %globaltimer_lo;", "=r")


def grid_dependency_wait():
  """``griddepcontrol.wait`` in a Pallas Triton kernel; returns an int32 0 token (use it)."""
  return _wait_p.bind()


def launch_dependents():
  """``griddepcontrol.launch_dependents``; returns an int32 0 token (use it). Call after
  ``grid_dependency_wait`` (module docstring)."""
  return _launch_p.bind()


def global_timer_lo():
  """Low 32 bits of the GPU's global nanosecond timer (int32; 0 in interpret mode)."""
  return _timer_p.bind()
