"""Decode steps for Nsight Compute: the Pallas kernels of a full-width step, one at a time.

Builds full-size random weights for a few layers (`--layers 6` covers both dense layers, three
sliding and one full MoE layer: the batch-1 step's every kernel), compiles the step, then runs
`--steps` steps with a device sync after each, so that `ncu` can profile the kernels of a
chosen step by launch index. Run it under ncu, for example (the kernels of the second step):

    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none -k regex:flint_ \
      --launch-skip 0 --launch-count 200 --section SpeedOfLight ... \
      -o $OUT/b1 python3 benchmarks/ncu_step.py --format nvfp4 --batch 1

The step itself is `decode_bench.make_handle(...).decode_logits_fn()`, the benchmark's step;
`--path` takes decode_bench's path names (default "pallas"). It prints one line per step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import decode_bench
from flint_jax.config import preset
from flint_jax.decode import bucket_length


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--format", choices=["bf16", "nvfp4"], required=True)
  ap.add_argument("--config", default="flint", help="config preset (flint = real sizes)")
  ap.add_argument("--layers", type=int, default=6, help="decoder layers to build")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
  ap.add_argument("--path", default="pallas", help="decode_bench.make_handle path name")
  ap.add_argument("--steps", type=int, default=2, help="steps after the compile")
  a = ap.parse_args()
  cfg = preset(a.config).replace(num_hidden_layers=a.layers)
  quant = a.format == "nvfp4"
  t0 = time.perf_counter()
  graphdef, state = decode_bench.build_state(cfg, quant)
  model = decode_bench.make_handle(cfg, graphdef, state, quant, a.path)
  step = model.decode_logits_fn()
  length = bucket_length(a.context + 64 * (a.steps + 2), 1 << 30, minimum=256)
  cache = decode_bench.random_cache(cfg, a.batch, length, a.context)
  tokens = jax.random.randint(jax.random.key(3), (a.batch,), 0, cfg.vocab_size, jnp.int32)
  jax.block_until_ready(model.leaves)
  print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
  for i in range(a.steps):
    t1 = time.perf_counter()
    logits, cache = step(model.leaves, cache, tokens)
    jax.block_until_ready(logits)
    print(f"step {i}: {1e3 * (time.perf_counter() - t1):.1f} ms (host wall, first incl. "
          f"compile); logits {tuple(logits.shape)} finite {bool(jnp.isfinite(logits).all())}",
          flush=True)


if __name__ == "__main__":
  main()
