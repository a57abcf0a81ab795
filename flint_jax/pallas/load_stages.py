"""Software pipelining of the K loops that feed no dot: ``tt.num_stages`` on their ``scf.for``.

Triton's pipeliner stages a loop's loads into shared memory (``cp.async``, issued ``stages - 1``
iterations ahead) only when they feed a dot -- unless the loop carries a ``tt.num_stages``
attribute (what ``tl.range(..., num_stages=n)`` writes in Triton's own frontend): then it
pipelines the other loads of a dot-free loop too (``AssignLatencies``: ``pipelineWithoutDot``).
Pallas Triton lowers ``lax.fori_loop`` to an ``scf.for`` without that attribute, so the
CUDA-core kernels (the NVFP4 GEMVs and MoE, whose K steps decode weights in registers) wait
for each K step's weight loads before decoding them; the compiler's ``num_stages`` does
nothing there (perf log 97 loaded a step ahead by hand instead, at the cost of registers).

Under ``stages(n)`` (n >= 2; read when a kernel is traced, as ``pdl.early_trigger``),
``_common.pallas_call`` appends ``_ls<n>`` to the name of every kernel that ``kinds`` selects;
the Pallas Triton lowering, wrapped once by ``install()``, then sets ``tt.num_stages = n`` on
each innermost ``scf.for`` of that kernel that holds no ``tt.dot`` (a loop with a dot is
pipelined already, at the kernel's ``num_stages``). Nothing changes in interpret mode.

Checked without a GPU with the triton package (3.6.0, sm_90): the batch-8 f16 MoE gate_up's
weight loads become ``LDGSTS`` (cp.async) + ``LDS``, registers 127 -> 119
(``tests/test_pallas_load_stages.py``; ``tools/triton_sass.py --load-stages``).

**Measured slower, so off** (H200 run 171, perf log 99): XLA's Triton honours the attribute (the
pipelined steps give the same logits bit for bit), but every NVFP4 kernel slows down, more with
more stages: NVFP4 1x1K 1.707 -> 2.090 / 2.164 / 2.253 ms at 2 / 3 / 4 stages, 8x1K 4.219 ->
5.932 / 6.455 / 7.340 (the 8x gate_up 29.5 -> 60.8 us per layer at 2 stages). The staged form
synchronises the CTA and reads the codes back from shared memory at every K step, and its
buffers take programs off the SM, where the register form lets each warp run its loop alone.
"""

from __future__ import annotations

import re

from jax._src import config

#: Pipeline stages of the dot-free K loops (0 or 1: off, the default until measured).
stages = config.int_state(
    "flint_jax_load_stages", default=0, include_in_trace_context=True,
    include_in_jit_key=True,
    help="tt.num_stages on the dot-free K loops of flint_jax kernels (0: off)")

#: Which kernels ``stages`` applies to: "all", "moe" (the MoE gate_up and down kernels) or
#: "gemv" (the dense NVFP4 GEMVs: q|k|v, o_proj, dense gate|up / down, LM head).
kinds = config.enum_state(
    "flint_jax_load_stage_kernels", ["all", "moe", "gemv"], default="all",
    include_in_trace_context=True, include_in_jit_key=True,
    help="which flint_jax kernels get load_stages")

KIND_PREFIXES = {"moe": ("flint_moe_gate_up", "flint_moe_down"),
                 "gemv": ("flint_nvfp4_gemv", "flint_multi_gemv", "flint_nvfp4_silu_mul")}

_TAG = re.compile(r"_ls(\d+)$")


def tagged_name(name: str | None) -> str | None:
  """``name`` with ``_ls<n>`` appended when the current ``stages`` / ``kinds`` select it."""
  n = stages.value
  if not name or n < 2 or _TAG.search(name):
    return name
  kind = kinds.value
  if kind != "all" and not name.startswith(KIND_PREFIXES[kind]):
    return name
  return f"{name}_ls{n}"


def requested_stages(name: str | None) -> int:
  """The stages a kernel name asks for (0: none)."""
  m = _TAG.search(name or "")
  return int(m.group(1)) if m else 0


def _ops(op):
  for region in op.regions:
    for block in region.blocks:
      yield from block.operations


def _contains(op, names) -> bool:
  return any(o.operation.name in names or _contains(o.operation, names) for o in _ops(op))


def tag_loops(module, n: int) -> int:
  """Set ``tt.num_stages = n`` on every innermost, dot-free ``scf.for`` of a Triton-dialect
  ``module`` (an ``ir.Module``). Returns how many loops were tagged."""
  from jax._src.lib.mlir import ir   # pylint: disable=g-import-not-at-top
  tagged = []

  def visit(op):
    for o in _ops(op):
      o = o.operation
      if o.name == "scf.for" and not _contains(o, ("scf.for", "scf.while", "tt.dot")):
        tagged.append(o)
      else:
        visit(o)

  with module.context:
    visit(module.operation)
    for o in tagged:
      o.attributes["tt.num_stages"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), n)
  return len(tagged)


_installed = False


def install():
  """Wrap Pallas Triton's ``lower_jaxpr_to_triton_module`` (once) so that a kernel named
  ``..._ls<n>`` has its dot-free loops tagged (``tag_loops``)."""
  global _installed
  if _installed:
    return
  from jax._src.pallas.triton import lowering   # pylint: disable=g-import-not-at-top
  lower = lowering.lower_jaxpr_to_triton_module

  def lower_with_load_stages(jaxpr, *args, **kwargs):
    result = lower(jaxpr, *args, **kwargs)
    n = requested_stages(getattr(jaxpr.debug_info, "func_name", None))
    if n >= 2:
      tag_loops(result.module, n)
    return result

  lowering.lower_jaxpr_to_triton_module = lower_with_load_stages
  _installed = True
