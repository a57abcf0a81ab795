"""Pallas Triton kernels launched by flint_jax itself, with programmatic dependent launch.

What it fuses: nothing -- it changes *who launches* a ``pl.pallas_call``. XLA compiles a Pallas
kernel's Triton IR itself and puts ``griddepcontrol.wait`` at the kernel's entry (its InsertPDL
pass, docs/kernels.md "Session 10"), so no instruction of a Pallas kernel, not even a load of
weights no earlier kernel writes, can run before its predecessor has completed. Here the same
kernel body is lowered by Pallas to Triton IR as usual, compiled to a cubin by the ``triton``
package (3.6.0 reads jaxlib 0.11.2's Triton IR), and launched from an XLA FFI custom call
(``csrc/pdl_launch.cc``) with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: its CTAs
may start as soon as the predecessor triggers (``pdl.launch_dependents``) or its CTAs exit, and
the kernel itself places ``pdl.grid_dependency_wait()`` -- after loading its weights, before
touching anything an earlier kernel writes.

``pallas_call(kernel, entry_wait=True, pdl=True, **pallas_call_kwargs)`` has
``pl.pallas_call``'s signature. With ``entry_wait`` it inserts the wait at the kernel's start
(XLA's semantics: safe for any kernel); a kernel that places its own wait passes
``entry_wait=False`` and must execute ``pdl.grid_dependency_wait()`` in every program before it
reads an activation or writes any output. GPU only (CUDA, sm_90); in interpret mode use
``pl.pallas_call``.

Requirements at trace time: the ``triton`` package (the GPU image has 3.6.0), and the launcher
library, built on first use with ``g++`` from ``csrc/pdl_launch.cc`` against jaxlib's FFI headers
and CUDA's ``cuda.h`` (``$CUDA_HOME/include``), or given prebuilt as ``$FLINT_JAX_PDL_LAUNCH_LIB``.

Not supported (checked): kernels that need Triton's global scratch memory; grids beyond 3-D.
The FFI call is not captured into XLA's command buffers: each costs ~5 us of host time.

Measured on the H200 (docs/kernels.md "Session 11", perf log 50-51): the PDL launch works (~1 us
per kernel against a plain launch), which is at parity with XLA's own launch; loading weights
before the wait (into registers, or by the pipeliner's cp.async prologue) gains nothing; and the
triton package compiles some kernels much worse than XLA's bundled Triton (the inline-asm NVFP4
ones). So the decode step keeps XLA's launch (``DecodeOptions.launch="xla"``); this stays as a
tested, opt-in launcher for experiments.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import subprocess
import tempfile

import numpy as np

import jax
from jax._src import config
from jax.experimental import pallas as pl

from flint_jax.pallas import pdl

__all__ = ["pallas_call", "capture_triton", "compile_ttir", "library_path", "register",
           "CompiledKernel", "TARGET", "enabled"]

TARGET = "flint_pdl_launch"

#: Whether ``_common.pallas_call`` routes every flint_jax kernel (outside interpret mode) through
#: ``pallas_call`` below, with the entry wait and a PDL launch: ``with ffi_launch.enabled(True)``
#: around the code that traces the kernels (part of jax's trace context and jit key, as
#: ``pdl.early_trigger``); the decode step sets it from ``DecodeOptions.launch``. For
#: measurements.
enabled = config.bool_state(
    "flint_jax_ffi_launch", default=False, include_in_trace_context=True,
    include_in_jit_key=True,
    help="flint_jax Pallas kernels are compiled by the triton package and launched by flint_jax")
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "pdl_launch.cc")


# ------------------------------------------------------------------------------------------
# The launcher library


def _cuda_include() -> str:
  for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
    if root and os.path.exists(os.path.join(root, "include", "cuda.h")):
      return os.path.join(root, "include")
  raise FileNotFoundError(
      "flint_jax.pallas.ffi_launch: cuda.h not found; set CUDA_HOME to a CUDA toolkit, or set "
      "FLINT_JAX_PDL_LAUNCH_LIB to a prebuilt libflint_pdl_launch.so")


def library_path() -> str:
  """Path of the launcher library, building it (g++, a few seconds) if it is not there yet.
  The build is keyed by the source's hash under ``~/.cache/flint_jax`` (or
  ``$FLINT_JAX_CACHE``)."""
  given = os.environ.get("FLINT_JAX_PDL_LAUNCH_LIB")
  if given:
    return given
  src = open(_SOURCE, "rb").read()
  tag = hashlib.sha256(src).hexdigest()[:16]
  cache = os.environ.get("FLINT_JAX_CACHE", os.path.expanduser("~/.cache/flint_jax"))
  out = os.path.join(cache, f"libflint_pdl_launch-{tag}.so")
  if os.path.exists(out):
    return out
  os.makedirs(cache, exist_ok=True)
  tmp = out + f".tmp{os.getpid()}"
  cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
         f"-I{_cuda_include()}", _SOURCE, "-o", tmp, "-ldl"]
  res = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if res.returncode:
    raise RuntimeError(f"building {out} failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
  os.replace(tmp, out)
  return out


@functools.cache
def register() -> str:
  """Loads the launcher and registers it as the XLA FFI target ``flint_pdl_launch`` (CUDA)."""
  lib = ctypes.CDLL(library_path())
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.FlintPdlLaunch), platform="CUDA")
  return TARGET


# ------------------------------------------------------------------------------------------
# Pallas -> Triton IR -> cubin


def capture_triton(fn, *args):
  """[{name, asm, grid, num_warps, num_stages}] for every pallas_call of jit(fn)(*args), lowered
  for an abstract H200 (no GPU needed): ``asm`` is the kernel's Triton IR as text. ``fn`` must be
  a fresh function object (a jit already lowered hits the cache and captures nothing)."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src.pallas.triton import pallas_call_registration as reg
  from flint_jax.pallas import testing   # pylint: disable=g-import-not-at-top
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
    testing.lower_for_h200(fn, *args)
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = lower_module
    reg.mlir.custom_call = custom_call
  return captured


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
  """A cubin and what its launch needs."""
  cubin: bytes
  name: str           # the kernel's symbol in the cubin
  threads: int        # 32 * num_warps
  shared: int         # dynamic shared memory, bytes
  n_params: int       # kernel parameters (buffers, then the two scratch pointers Triton adds)
  key: int            # a 63-bit hash of the cubin: the launcher's module cache key


@functools.lru_cache(maxsize=None)
def compile_ttir(asm: str, num_warps: int, num_stages: int) -> CompiledKernel:
  """Compiles Triton IR text for sm_90 with the ``triton`` package (cached per IR and options)."""
  try:
    import triton   # pylint: disable=g-import-not-at-top
    from triton.backends.compiler import GPUTarget   # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("flint_jax.pallas.ffi_launch needs the `triton` package (3.6.0 reads "
                      "jaxlib 0.11.2's Triton IR): pip install triton==3.6.0") from e
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "kernel.ttir")
    with open(path, "w") as f:
      f.write(asm)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
  md = k.metadata
  if getattr(md, "global_scratch_size", 0):
    raise NotImplementedError(f"kernel {md.name} needs {md.global_scratch_size} bytes of Triton "
                              "global scratch, which the launcher does not provide")
  # Triton >= 3.5 appends two pointers (global scratch, profile scratch) to every kernel
  ptx = k.asm["ptx"]
  entry = ptx[ptx.index(".entry"):]
  n_params = entry[:entry.index(")")].count(".param")
  cubin = bytes(k.asm["cubin"])
  return CompiledKernel(cubin=cubin, name=md.name, threads=32 * md.num_warps,
                        shared=int(md.shared), n_params=n_params,
                        key=int.from_bytes(hashlib.sha256(cubin).digest()[:8], "little") >> 1)


# ------------------------------------------------------------------------------------------
# The call


def _with_entry_wait(kernel):
  @functools.wraps(kernel)
  def body(*refs, **kw):
    pdl.grid_dependency_wait()
    return kernel(*refs, **kw)
  return body


def pallas_call(kernel, *, entry_wait: bool = True, pdl_launch: bool = True, **kw):
  """``pl.pallas_call(kernel, **kw)``, compiled by the ``triton`` package and launched by
  flint_jax (module docstring). ``entry_wait``: insert ``griddepcontrol.wait`` at the kernel's
  start (else the kernel must wait itself before reading activations). ``pdl_launch``: launch
  with programmatic stream serialization (else a plain launch: the kernel starts after its
  predecessor ends)."""
  body = _with_entry_wait(kernel) if entry_wait else kernel
  out_shape = kw["out_shape"]
  aliases = dict(kw.get("input_output_aliases") or {})

  def call(*args):
    f = pl.pallas_call(body, **kw)
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    mods = capture_triton(lambda *a: f(*a), *sds)
    if len(mods) != 1:
      raise ValueError(f"expected one Triton kernel from {kw.get('name')}, got {len(mods)}")
    m = mods[0]
    ck = compile_ttir(m["asm"], m["num_warps"], m["num_stages"])
    n_out = len(jax.tree.leaves(out_shape))
    if ck.n_params != len(args) + n_out + 2:
      raise ValueError(f"kernel {ck.name}: {ck.n_params} parameters, expected "
                       f"{len(args)} inputs + {n_out} outputs + 2 scratch pointers")
    grid = list(m["grid"]) + [1] * (3 - len(m["grid"]))
    if len(grid) != 3:
      raise NotImplementedError(f"kernel {ck.name}: grid {m['grid']} has more than 3 axes")
    register()
    return jax.ffi.ffi_call(TARGET, out_shape, input_output_aliases=aliases or None)(
        *args, cubin=np.frombuffer(ck.cubin, np.uint8), cubin_hash=np.int64(ck.key), name=ck.name,
        grid_x=np.int64(grid[0]), grid_y=np.int64(grid[1]), grid_z=np.int64(grid[2]),
        threads=np.int64(ck.threads), shared=np.int64(ck.shared), pdl=bool(pdl_launch),
        scratch_params=np.int64(2))

  return call
