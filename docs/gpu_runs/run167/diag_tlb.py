# Run from the repository root (it was at the root in run 167): the tiny NVFP4 model of
# test_tlb_touch_step_equals_xla (seed 13, 2 rows), greedy tokens of the XLA path, the default
# Pallas step and the tlb_touch step, and the XLA path's top-2 margin at each generated token.
import sys
sys.path.insert(0, 'tests')
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
import flint_jax
from flint_jax.fast_decode import DecodeOptions
from flint_jax.model import FlintForCausalLM
from test_fast_decode import small_cfg
mod = FlintForCausalLM(small_cfg(), quant=True, rngs=nnx.Rngs(13))
data = [list(range(21, 91)), list(range(4, 12))]
kw = dict(max_new_tokens=4, temperature=0, stop_token_ids=[])
out = {}
for name, kern, opts in [("xla", "xla", None), ("pallas", "pallas", DecodeOptions()),
                         ("tlb", "pallas", DecodeOptions(tlb_touch="attn,router,gate_up"))]:
  h = flint_jax.from_module(mod, kernels=kern)
  if opts is not None:
    h.decode_options = opts
  out[name] = [np.asarray(t) for t in flint_jax.generate(h, data, **kw)]
  print(name, [t.tolist() for t in out[name]])
h = flint_jax.from_module(mod, kernels="xla")
# the XLA model's logits for each row after its generated tokens: the margins per step
for r in range(2):
  seq = data[r] + out["xla"][r].tolist()
  lg = np.asarray(flint_jax.forward(h, jnp.asarray(seq, jnp.int32)), np.float32)[-5:-1]
  for j, row in enumerate(lg):
    top = np.sort(row)[::-1]
    print(f"xla row {r} step {j}: argmax {row.argmax()} margin {top[0]-top[1]:.5f} scale {np.abs(row).max():.3f}",
          "pallas tok", out["pallas"][r][j], "tlb tok", out["tlb"][r][j])
