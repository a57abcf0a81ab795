"""Register, spill and instruction counts of the Pallas kernels for the H200, without a GPU.

Lowers a flint_jax kernel for an abstract H200 (``pallas.testing.lower_for_h200``), captures
the Triton IR of every ``pallas_call`` on the way, compiles it for sm_90 with the ``triton`` pip
package (its bundled ``ptxas`` / ``cuobjdump``), and prints per kernel: registers, local memory
(spills), shared memory, and the SASS opcode histogram of each loop (a backward branch), i.e.
what one K step costs per thread. The TTGIR, PTX and SASS land in ``--out`` for reading.

Caveat: XLA compiles the same IR with its own bundled Triton, whose passes may differ a little
from the pip release's; use the counts to compare variants of a kernel, and time on the GPU.

Needs a Python 3.12 environment with jax 0.11.2 (the project's) *and* ``triton`` (3.6.0 matches
jaxlib 0.11.2's dialects; install it into a separate venv and point ``--triton-python`` at it, or
into the same one). Example::

  JAX_PLATFORMS=cpu PYTHONPATH=. python tools/triton_sass.py --out /tmp/sass \\
      --kernel nvfp4_gemv --m 1 --n 4096 --k 2048 --kw method=lanes block_n=16 block_k=1024
  (``--kw x16=1``: the GEMV on the f16 operand, ``nvfp4_gemv(x16, ..., x_inv=)``;
  ``--load-stages 3``: the dot-free K loops software-pipelined, ``pallas.load_stages``)
  JAX_PLATFORMS=cpu PYTHONPATH=. python tools/triton_sass.py --kernel moe --m 8

Kernels: nvfp4_gemv, multi_gemv (NVFP4 q|k|v), moe / moe_bf16 (routed, NVFP4 / BF16 experts,
Flint sizes), attn_ring / attn_full (``qk_norm_rope_attention``, the step's attention kernel;
``--k`` is the full cache's length).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def capture_triton_modules(fn, *args):
  """[{name, asm, grid, num_warps, num_stages}] for every pallas_call of jit(fn)(*args)."""
  from flint_jax.pallas import testing   # pylint: disable=g-import-not-at-top
  return testing.triton_modules(fn, *args)


_COMPILE = r'''
import json, os, re, subprocess, sys, collections
import triton
from triton.backends.compiler import GPUTarget
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
for base in sys.argv[1:]:
  meta = json.load(open(base + ".json"))
  k = triton.compile(base + ".ttir", target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=meta["num_warps"], num_stages=meta["num_stages"]))
  open(base + ".ttgir", "w").write(k.asm["ttgir"])
  open(base + ".ptx", "w").write(k.asm["ptx"])
  open(base + ".cubin", "wb").write(k.asm["cubin"])
  sass = subprocess.run([BIN + "/cuobjdump", "-sass", base + ".cubin"], capture_output=True,
                        text=True).stdout
  open(base + ".sass", "w").write(sass)
  res = subprocess.run([BIN + "/cuobjdump", "-res-usage", base + ".cubin"], capture_output=True,
                       text=True).stdout
  r = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", res, re.S)
  print(json.dumps(dict(base=base, regs=int(r.group(1)), stack=int(r.group(2)),
                        shared=int(r.group(3)), local=int(r.group(4)))))
'''


def loop_histograms(sass: str):
  """[(n_instructions, Counter of opcodes)] of each loop (a branch to an earlier address)."""
  ins = []
  for line in sass.splitlines():
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
      ins.append((int(m.group(1), 16), m.group(2)))
  index = {a: i for i, (a, _) in enumerate(ins)}
  loops = []
  for i, (addr, text) in enumerate(ins):
    m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
    if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
      body = ins[index[int(m.group(1), 16)]:i + 1]
      ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                for _, t in body)
      loops.append((len(body), ops))
  return loops


def _parse_kw(items):
  kw = {}
  for item in items or ():
    k, v = item.split("=", 1)
    kw[k] = int(v) if v.lstrip("-").isdigit() else v
  return kw


def build(kernel: str, m: int, n: int, k: int, kw: dict, prescaled: bool = False):
  """(fn, args) of one kernel call at Flint sizes (abstract shapes; weights as numpy).
  ``prescaled``: NVFP4 block scales as pre-scaled bf16 (``nvfp4_gemv.prescale_block_scales``)."""
  import jax   # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  import numpy as np   # pylint: disable=g-import-not-at-top
  from flint_jax.pallas import testing   # pylint: disable=g-import-not-at-top
  gen = np.random.default_rng(0)
  S = jax.ShapeDtypeStruct
  from flint_jax.nvfp4 import prescale_state   # pylint: disable=g-import-not-at-top
  pre = prescale_state if prescaled else (lambda tree: tree)

  def random_nvfp4(shape):
    return pre(testing.random_nvfp4(gen, shape))
  if kernel == "nvfp4_gemv":
    mod = importlib.import_module("flint_jax.pallas.nvfp4_gemv")
    w = random_nvfp4((n, k))
    if kw.pop("x16", False):   # the f16 operand (x16_operand) with its factor x_inv
      return (lambda x, inv, *w_: mod.nvfp4_gemv(x, *w_, x_inv=inv, **kw),
              (S((m, k), jnp.float16), S((m,), jnp.float32), *w))
    return functools.partial(mod.nvfp4_gemv, **kw), (S((m, k), jnp.bfloat16), *w)
  if kernel == "multi_gemv":
    mod = importlib.import_module("flint_jax.pallas.multi_gemv")
    ws = tuple(random_nvfp4((rows, 2048)) for rows in (4096, 512, 512))
    return functools.partial(mod.multi_gemv, **kw), (S((m, 2048), jnp.bfloat16), ws)
  if kernel in ("moe", "moe_bf16"):
    mod = importlib.import_module("flint_jax.pallas.moe")
    fmt = "bf16" if kernel == "moe_bf16" else "nvfp4"
    experts, shared = testing.random_moe_weights(fmt, 256, 2048, 512, 1024, gen)
    experts, shared = pre((experts, shared))
    return (functools.partial(mod.moe_decode_routed, **kw),
            (S((m, 2048), jnp.bfloat16), S((m, 256), jnp.float32), experts, shared))
  if kernel in ("attn_ring", "attn_full"):
    # one decode token per row (m rows), the step's layer-stacked caches (7 layers here),
    # 576-slot ring (513 rounded up to 64) or an n-slot full cache (n = --k rounded up to 256)
    mod = importlib.import_module("flint_jax.pallas.attention_block")
    ring = kernel == "attn_ring"
    s_len = 576 if ring else -(-k // 256) * 256   # ring: FlintConfig.ring_size
    # (--kw cos_sin_input=1: RoPE's cos / sin loaded, ``rope_cos_sin=``, as the later
    # sliding layers of the step run it)
    cache = S((7, m, 4, s_len, 128), jnp.bfloat16)
    cs = S((m, 2, 64), jnp.float32) if kw.pop("cos_sin_input", 0) else None
    fn = functools.partial(mod.qk_norm_rope_attention, rope=ring, ring=ring,
                           window=513 if ring else None, **kw)
    args = (S((m, 32, 128), jnp.bfloat16), S((m, 4, 128), jnp.bfloat16),
            S((m, 4, 128), jnp.bfloat16), S((128,), jnp.bfloat16), S((128,), jnp.bfloat16),
            S((m,), jnp.int32), cache, cache, S((32,), jnp.float32), S((), jnp.int32))
    if cs is None:
      return fn, args
    return (lambda *a: fn(*a[:-1], rope_cos_sin=a[-1])), (*args, cs)
  raise SystemExit(f"unknown --kernel {kernel!r}: nvfp4_gemv, multi_gemv, moe, moe_bf16, "
                   f"attn_ring or attn_full")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--kernel", default="nvfp4_gemv",
                  help="nvfp4_gemv | multi_gemv | moe | moe_bf16 | attn_ring | attn_full")
  ap.add_argument("--m", type=int, default=1, help="tokens (rows of x)")
  ap.add_argument("--n", type=int, default=4096, help="output rows (nvfp4_gemv)")
  ap.add_argument("--k", type=int, default=2048, help="input features (nvfp4_gemv)")
  ap.add_argument("--kw", nargs="*", help="kernel keyword arguments, e.g. method=lanes block_n=16")
  ap.add_argument("--prescaled", action="store_true",
                  help="NVFP4 block scales pre-scaled to bf16 (prescale_block_scales)")
  ap.add_argument("--asm", default="mul",
                  help="the NVFP4 asm decode's sequence (nvfp4_gemv.asm_decode): mul | "
                       "mul_bf16 | shift | post")
  ap.add_argument("--f16-sums", default="block",
                  help="how the f16 blocks K step sums (nvfp4_gemv.f16_sums): pair | block")
  ap.add_argument("--x16-loads", default="tile",
                  help="how the f16 K step loads its operand (nvfp4_gemv.x16_loads): tile | words")
  ap.add_argument("--load-stages", type=int, default=0,
                  help="tt.num_stages on the dot-free K loops (pallas.load_stages; 0: off)")
  ap.add_argument("--load-stage-kernels", default="all",
                  help="which kernels --load-stages applies to: all | moe | gemv")
  ap.add_argument("--out", default="/tmp/flint_sass", help="directory for TTIR/TTGIR/PTX/SASS")
  ap.add_argument("--triton-python", default=sys.executable,
                  help="a Python with the triton package (default: this one)")
  args = ap.parse_args()
  fn, fargs = build(args.kernel, args.m, args.n, args.k, _parse_kw(args.kw), args.prescaled)
  os.makedirs(args.out, exist_ok=True)
  bases = []
  nv = importlib.import_module("flint_jax.pallas.nvfp4_gemv")
  ls = importlib.import_module("flint_jax.pallas.load_stages")
  with nv.asm_decode(args.asm), nv.f16_sums(args.f16_sums), ls.stages(args.load_stages), \
      ls.kinds(args.load_stage_kernels), nv.x16_loads(args.x16_loads):
    modules = capture_triton_modules(fn, *fargs)
  for i, c in enumerate(modules):
    base = os.path.join(args.out, f"{i}_{c['name']}")
    with open(base + ".ttir", "w") as f:
      f.write(c["asm"])
    with open(base + ".json", "w") as f:
      json.dump({key: v for key, v in c.items() if key != "asm"}, f)
    bases.append((base, c))
  res = subprocess.run([args.triton_python, "-c", _COMPILE, *[b for b, _ in bases]],
                       capture_output=True, text=True)
  if res.returncode:
    raise SystemExit(f"triton compile failed (is triton installed in {args.triton_python}?):\n"
                     f"{res.stderr[-3000:]}")
  stats = {json.loads(line)["base"]: json.loads(line) for line in res.stdout.splitlines()}
  for base, c in bases:
    st = stats[base]
    print(f"{c['name']}: grid {c['grid']} warps {c['num_warps']} stages {c['num_stages']} "
          f"regs {st['regs']} stack {st['stack']} B (spills: LDL / STL) local {st['local']} B "
          f"shared {st['shared']} B")
    with open(base + ".sass") as f:
      for n_ins, ops in loop_histograms(f.read()):
        top = ", ".join(f"{op} {cnt}" for op, cnt in ops.most_common(12))
        print(f"  loop: {n_ins} instructions / thread / iteration: {top}")


if __name__ == "__main__":
  main()
