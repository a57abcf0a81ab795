# Run from the repository root (it was at the root in run 168): is the compiled step deterministic
# run to run, and how far do TILE_OVERRIDES move the logits from the default step?
"""Run-to-run determinism of the compiled batch-1 NVFP4 step on the GPU (tiny model)."""
import sys, dataclasses
sys.path.insert(0, 'tests')
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from flint_jax import fast_decode
from flint_jax.fast_decode import DecodeOptions
from flint_jax.model import FlintForCausalLM
from flint_jax.cache import init_cache
from test_fast_decode import small_cfg, TILE_OVERRIDES
cfg = small_cfg()
interp = jax.default_backend() == "cpu"
for quant, rows in [(True, 1), (False, 1), (True, 2)]:
  graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(22)))
  for name, o in [("default", DecodeOptions(lm_head_f16=False)),
                  ("overrides", dataclasses.replace(TILE_OVERRIDES, lm_head_f16=False))]:
    step = jax.jit(fast_decode.make_decode_step(graphdef, cfg, interpret=interp, options=o))
    res = []
    for rep in range(4):
      cache = init_cache(cfg, rows, 64)
      outs = []
      for t in (5, 17):
        lg, cache = step(state, cache, jnp.arange(t, t + rows, dtype=jnp.int32))
        outs.append(np.asarray(lg))
      res.append(outs)
    same = [all(np.array_equal(a, b) for a, b in zip(res[0], r)) for r in res[1:]]
    d = max(float(np.abs(a - b).max()) for r in res[1:] for a, b in zip(res[0], r))
    print(f"quant={quant} rows={rows} {name}: repeats bit-equal {same}, max diff {d:.2e}")
    if name == "default":
      base = res[0]
    else:
      print("   overrides vs default max diff",
            max(float(np.abs(a - b).max()) for a, b in zip(base, res[0])))
