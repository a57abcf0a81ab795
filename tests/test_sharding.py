"""On 8 fake CPU devices, in one subprocess (the device count is fixed when jax starts, and each
such process costs its start and its compiles):

- the golden tiny_a loaded in fp32 onto a 1-D ("model",) mesh: forward and greedy generate equal
  the unsharded ones;
- checkpoints written by convert (bf16 from HF, NVFP4 from our quantizer) restored onto a 2x4
  ("data", "model") mesh: every leaf bit-identical to the unsharded restore and placed by
  ``param_sharding``; the bf16 one generates the unsharded one's greedy tokens (batch 2).
"""

import os
import subprocess
import sys
import textwrap

from conftest import GOLDEN
from flint_jax import convert, quantize

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax
    from jax.sharding import Mesh
    from flax import nnx
    import flint_jax
    from flint_jax.sharding import ShardingRules, param_sharding
    assert jax.device_count() == 8, jax.devices()
    golden_dir, converted = sys.argv[1], sys.argv[2:]

    # The golden checkpoint on a 1-D model-parallel mesh.
    mesh = jax.make_mesh((8,), ("model",))
    g = np.load(golden_dir + "/golden.npz")
    ref = flint_jax.load(golden_dir, dtype="float32", kernels="xla")
    sh = flint_jax.load(golden_dir, dtype="float32", kernels="xla", mesh=mesh)
    w = sh.state["model"]["layers"][2]["mlp"]["experts"]["gate_up_proj"].value
    assert len(w.sharding.device_set) == 8 and w.addressable_shards[0].data.shape[0] == 1
    q = sh.state["model"]["layers"][0]["self_attn"]["q_proj"]["weight"].value
    assert q.addressable_shards[0].data.shape[0] == q.shape[0] // 8
    a = np.asarray(flint_jax.forward(ref, g["input_ids"]))
    b = np.asarray(flint_jax.forward(sh, g["input_ids"]))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), np.abs(a - b).max()
    ga = flint_jax.generate(ref, g["greedy_prompt"], max_new_tokens=12, temperature=0, stop_token_ids=[])
    gb = flint_jax.generate(sh, g["greedy_prompt"], max_new_tokens=12, temperature=0, stop_token_ids=[])
    np.testing.assert_array_equal(ga, gb)
    print("SHARDED_OK")

    # Converted checkpoints restored onto a 2x4 data x model mesh.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rules = ShardingRules.for_mesh(mesh)
    for path in converted:
        one = flint_jax.load(path, kernels="xla")
        sh = flint_jax.load(path, mesh=mesh, kernels="xla")
        a = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(one.state)}
        b = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(sh.state)}
        n_split = 0
        for k in a:
            want = param_sharding(k, b[k].shape, mesh, rules)
            assert b[k].sharding.is_equivalent_to(want, b[k].ndim), (k, b[k].sharding, want)
            n_split += any(s is not None for s in want.spec)
            np.testing.assert_array_equal(np.atleast_1d(np.asarray(a[k])).view(np.uint8),
                                          np.atleast_1d(np.asarray(b[k])).view(np.uint8))
        assert n_split > 10, n_split
        if not one.quant:  # (generation compiles: once is enough for the test budget)
            g1 = flint_jax.generate(one, [[5, 6, 7, 8], [9, 10, 11, 12]], max_new_tokens=4,
                                    temperature=0.0)
            g2 = flint_jax.generate(sh, [[5, 6, 7, 8], [9, 10, 11, 12]], max_new_tokens=4,
                                    temperature=0.0)
            assert [list(x) for x in g1] == [list(x) for x in g2], (g1, g2)
        print("RESTORE_OK", path, n_split)
""")


def test_sharded_load_forward_generate_and_restore_8_devices(tmp_path):
    conv_bf16, gguf, conv_nvfp4 = tmp_path / "bf16", tmp_path / "tiny_a.gguf", tmp_path / "nvfp4"
    convert.convert(GOLDEN / "tiny_a", conv_bf16, progress=False)
    quantize.quantize(GOLDEN / "tiny_a", gguf)
    convert.convert(gguf, conv_nvfp4, hf_config=GOLDEN / "tiny_a", progress=False)
    # conftest's XLA_FLAGS (unoptimised CPU code) kept, the device count added.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(GOLDEN / "tiny_a"), str(conv_bf16),
                          str(conv_nvfp4)], env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout
    assert res.returncode == 0 and "SHARDED_OK" in out and out.count("RESTORE_OK") == 2, (
        out[-2000:] + res.stderr[-4000:])
