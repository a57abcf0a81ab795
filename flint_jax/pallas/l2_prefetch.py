"""Prefetch a later kernel's weights into the L2 from inside a Pallas Triton kernel.

``prefetch_l2(ref, start, nbytes, chunks)`` asks the H200's TMA unit to bring bytes
``[start, start + nbytes)`` of ``ref``'s buffer into the L2 (``cp.async.bulk.prefetch.L2``,
sm_90): ``chunks`` requests of ``nbytes / chunks`` bytes each, spread over the CTA's threads. The
instruction is fire-and-forget: no registers, no shared memory, no completion to wait for, so a
latency-bound kernel (attention, a norm) can pull the next GEMV's weights from HBM while it
works, and that GEMV then streams them from the L2. (Session 4 tried the same with extra
programs issuing ordinary loads, perf log 14: the loads cost the host kernel more than the L2
saved. The bulk prefetch is one instruction per chunk.)

Why it may pay: every kernel of the decode step waits at its entry for its predecessor (XLA's
PDL wait, ``pdl`` module docstring), so a GEMV cannot start its weight stream early itself. A
16.8 MB BF16 GEMV takes 5.5 us from HBM and 4.0 us with its weights already in the L2
(perf log 14).

The primitive reads ``ref``'s address (it must be a kernel argument, not a slice of one) and
changes nothing: in interpret mode and in the jaxpr's state discharge it is a no-op. Returns an
int32 [chunks] of zeros (ignore it).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith as arith_dialect
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.state import discharge as state_discharge
from jax._src.state import types as state_types

from flint_jax.pallas import pdl

__all__ = ["prefetch_l2", "prefetch_slice", "chunk_plan", "slice_bytes", "touch_pages",
           "page_plan", "PAGE_BYTES"]

#: The GPU page size ``touch_pages`` assumes by default: the CUDA driver maps large device
#: allocations (XLA's memory pool) with 2 MiB pages.
PAGE_BYTES = 2 << 20

_prefetch_p = jax_core.Primitive("flint_prefetch_l2")


@_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref_aval, offsets_aval, sizes_aval):
  del ref_aval, sizes_aval
  # the read of the ref, and pdl's effect: a read alone is dead code to jaxpr DCE
  return (jax_core.ShapedArray(offsets_aval.shape, jnp.int32),
          {state_types.ReadEffect(0), pdl.EFFECT})


@state_discharge.register_discharge_rule(_prefetch_p)
def _discharge(ctx, ref, offsets, sizes):
  del ctx, ref, sizes
  return (None, None, None), jnp.zeros(offsets.shape, jnp.int32)


mlir.register_lowering(
    _prefetch_p, lambda ctx, ref, offsets, sizes: [
        mlir.ir_constant(np.zeros(ctx.avals_in[1].shape, np.int32))])

# One request per element: skipped when its size is 0 (a chunk past the end of the array).
_ASM = """{
.reg .pred p;
setp.ne.u32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""


@triton_lowering.register_lowering(_prefetch_p)
def _lower(ctx, ptr, offsets, sizes):
  del ctx
  i64 = ir.IntegerType.get_signless(64)
  shape = ir.RankedTensorType(offsets.type).shape
  vec64 = ir.RankedTensorType.get(shape, i64)
  base = tt_dialect.splat(vec64, tt_dialect.ptr_to_int(i64, ptr))          # byte address
  addr = arith_dialect.addi(base, arith_dialect.extsi(vec64, offsets))
  return tt_dialect.elementwise_inline_asm(
      [ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32))], _ASM,
      constraints="=r,l,r", pure=False, packed_element=1, args=[addr, sizes])


def _nbytes(ref) -> int:
  return int(np.prod(ref.shape)) * np.dtype(ref.dtype).itemsize


def chunk_plan(total: int, start, nbytes: int, chunks: int):
  """(offsets, sizes) int32 [chunks] of the requests that cover bytes [start, start + nbytes) of
  a ``total``-byte buffer: equal chunks (a multiple of 16 bytes) from ``start``, the ones past
  the end of the buffer shortened or of size 0 (skipped)."""
  chunk = -(-max(nbytes, 16) // chunks)
  chunk = -(-chunk // 16) * 16                  # bytes per request, a multiple of 16
  start = jnp.asarray(start, jnp.int32)
  offs = start + jnp.arange(chunks, dtype=jnp.int32) * chunk
  sizes = jnp.clip(jnp.minimum(total, start + nbytes) - offs, 0, chunk)
  return offs, sizes


def prefetch_l2(ref, start, nbytes: int, chunks: int = 128):
  """Prefetch bytes [start, start + nbytes) of ``ref``'s buffer (a kernel argument) into the L2,
  as ``chunks`` requests spread over the CTA's threads; the part past the end of the array is
  skipped. ``start``: int32 byte offset, may be traced, a multiple of 16; ``nbytes`` static.
  Returns None (and does nothing) for a buffer whose size is not a multiple of 16 bytes."""
  total = _nbytes(ref)
  if total % 16:
    return None                   # the bulk copy unit works in 16-byte granules
  return _prefetch_p.bind(ref, *chunk_plan(total, start, nbytes, chunks))


def prefetch_slice(ref, part, parts: int, chunks: int = 128):
  """Prefetch part ``part`` (traced int32, 0 <= part < parts) of ``parts`` (about) equal,
  16-byte aligned parts of the whole of ``ref`` (a kernel argument): what one program of a
  ``parts``-program grid takes on."""
  per = slice_bytes(_nbytes(ref), parts, chunks)
  return prefetch_l2(ref, part * per, per, chunks)


def slice_bytes(total: int, parts: int, chunks: int = 128) -> int:
  """Bytes per part in ``prefetch_slice``: total / parts rounded up to 16 * chunks."""
  per = -(-total // parts)
  return -(-per // (16 * chunks)) * (16 * chunks)


def touch_pages(ref, part, parts: int, page_bytes: int = PAGE_BYTES):
  """Ask the L2 for 16 bytes at every ``page_bytes`` of ``ref``'s buffer (a kernel argument):
  pages ``part, part + parts, ...`` of it, this program's share of a ``parts``-program grid.
  What it is for: the address translations of a buffer a later kernel reads only in part (the
  MoE's stacked experts, of which a step reads 6 of 256) are then in the GPU's TLBs before that
  kernel's first load, instead of a page walk on its critical path; the bytes themselves are
  negligible (16 per page). ``part``: traced int32. Returns None (and does nothing) for a
  buffer whose size is not a multiple of 16 bytes."""
  total = _nbytes(ref)
  if total % 16:
    return None
  if total >= 2 ** 31:
    raise ValueError(f"touch_pages: int32 byte offsets need a buffer under 2 GiB, got "
                     f"{total} bytes ({ref.shape} {ref.dtype})")
  return _prefetch_p.bind(ref, *page_plan(total, part, parts, page_bytes))


def page_plan(total: int, part, parts: int, page_bytes: int = PAGE_BYTES):
  """(offsets, sizes) int32 [ceil(pages / parts)] of ``touch_pages``' requests for part
  ``part`` of ``parts``: 16 bytes at the start of pages part, part + parts, ... of a
  ``total``-byte buffer; requests past its last page have size 0 (skipped)."""
  n_pages = -(-total // page_bytes)
  page = jnp.asarray(part, jnp.int32) + parts * jnp.arange(-(-n_pages // parts), dtype=jnp.int32)
  offsets = jnp.minimum(page, n_pages - 1) * page_bytes
  sizes = jnp.where(page < n_pages, 16, 0).astype(jnp.int32)
  return offsets, sizes
