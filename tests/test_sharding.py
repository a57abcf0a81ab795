"""Sharded forward and generate on 8 fake CPU devices equal the unsharded ones."""

import os
import subprocess
import sys
import textwrap

from conftest import GOLDEN

SCRIPT = textwrap.dedent("""
    import numpy as np, jax
    import flint_jax
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("model",))
    path = {path!r}
    g = np.load(path + "/golden.npz")
    ref = flint_jax.load(path, dtype="float32", kernels="xla")
    sh = flint_jax.load(path, dtype="float32", kernels="xla", mesh=mesh)
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
""")


def test_sharded_forward_and_generate_equal_unsharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", SCRIPT.format(path=str(GOLDEN / "tiny_a"))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert "SHARDED_OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
