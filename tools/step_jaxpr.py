"""The default Pallas decode step as text, for comparing two trees on a CPU (no GPU needed).

For each FORMAT:BATCH (bf16, nvfp4 with pre-scaled block scales as `flint_jax.load` holds them
on a GPU, nvfp4raw with e4m3 scales), at Flint's sizes with LAYERS layers (env, default 7),
writes OUT/<format>_<batch>.ops (the step's ops in order, flattened through jit, every Pallas
kernel by name with its operands) and OUT/<format>_<batch>.kernels (every distinct pallas_call:
name, grid, compiler params, aliases, outputs and its kernel jaxpr). Two trees whose files are
equal launch the same kernels in the same order with the same bodies (the issue-40 redesign was
checked this way against 35c0874 for batch 1-16):

    PYTHONPATH=<tree> python tools/step_jaxpr.py OUT bf16:1,bf16:8,nvfp4:1,nvfp4:8
"""
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp
from jax._src import core
from flax import nnx
from flint_jax.config import preset
from flint_jax.model import FlintForCausalLM
from flint_jax.cache import cache_shapes
from flint_jax import fast_decode

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
combos = sys.argv[2].split(",")
cfg = preset("flint").replace(num_hidden_layers=int(os.environ.get("LAYERS", "7")), layer_types=())

def sub_jaxprs(params):
    for k, v in params.items():
        if isinstance(v, core.ClosedJaxpr):
            yield k, v.jaxpr
        elif isinstance(v, core.Jaxpr):
            yield k, v
        elif isinstance(v, (tuple, list)):
            for x in v:
                if isinstance(x, core.ClosedJaxpr): yield k, x.jaxpr
                elif isinstance(x, core.Jaxpr): yield k, x

def walk(jaxpr, lines, kernels):
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "pallas_call":
            p = eqn.params
            body = str(p["jaxpr"])
            key = (p["name"], str(p["grid_mapping"]), str(p["compiler_params"]), str(p["input_output_aliases"]), str(p["out_avals"]))
            kernels.setdefault(key, body)
            assert kernels[key] == body, ("same key, different body", p["name"])
            lines.append(f"pallas_call {p['name']} in={[str(v.aval) for v in eqn.invars]} out={[str(v.aval) for v in eqn.outvars]}")
            continue
        subs = list(sub_jaxprs(eqn.params))
        if prim in ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"):
            for _, sj in subs:
                walk(sj, lines, kernels)
            continue
        lines.append(f"{prim} in={[str(getattr(v,'aval',v)) for v in eqn.invars]} out={[str(v.aval) for v in eqn.outvars]}")
        for _, sj in subs:
            lines.append("  {")
            walk(sj, lines, kernels)
            lines.append("  }")

for combo in combos:
    fmt, b = combo.split(":")
    b = int(b)
    quant = fmt.startswith("nvfp4")
    abs_model = nnx.eval_shape(lambda: FlintForCausalLM(cfg, quant=quant))
    graphdef, state = nnx.split(abs_model)
    if fmt == "nvfp4":
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) if a.dtype == jnp.float8_e4m3fn else a, state)
    step = fast_decode.make_decode_step(graphdef, cfg)
    cj = jax.make_jaxpr(step)(state, cache_shapes(cfg, b, 1024), jax.ShapeDtypeStruct((b,), jnp.int32))
    lines, kernels = [], {}
    walk(cj.jaxpr, lines, kernels)
    with open(f"{out}/{fmt}_{b}.ops", "w") as f:
        f.write("\n".join(lines))
    with open(f"{out}/{fmt}_{b}.kernels", "w") as f:
        for key in sorted(kernels):
            f.write("=== " + " | ".join(key) + "\n" + kernels[key] + "\n")
    n_calls = sum(l.startswith("pallas_call") for l in lines)
    print(combo, "ops", len(lines), "pallas_calls", n_calls, "unique kernels", len(kernels), flush=True)
