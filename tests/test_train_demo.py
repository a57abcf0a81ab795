"""tools/train_demo.py and what it relies on: the blocked grouped matmul, the data, resuming,
the export; at toy sizes on a few files (the shipped model's own tests: test_demo_model.py)."""

import json
import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from flint_jax import demo_data, layers  # noqa: E402


@pytest.mark.parametrize("n,g,k,m,block", [(37, 5, 24, 16, 8), (300, 16, 64, 48, 32), (5, 9, 16, 8, 4)])
def test_blocked_ragged_dot_equals_ragged_dot(n, g, k, m, block):
    gen = np.random.default_rng(n + g)
    x = jnp.asarray(gen.standard_normal((n, k)), jnp.float32)
    w = jnp.asarray(gen.standard_normal((g, k, m)), jnp.float32)
    sizes = np.diff(np.r_[0, np.sort(gen.integers(0, n + 1, g - 1)), n])
    sizes[min(2, g - 1)] += sizes[1]
    sizes[1] = 0  # an empty group
    sizes = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(layers.blocked_ragged_dot(x, w, sizes, block),
                               layers.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)

    def grads(fn):
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))(x, w)

    for a, b in zip(grads(lambda x, w: layers.blocked_ragged_dot(x, w, sizes, block)),
                    grads(lambda x, w: layers.ragged_dot(x, w, sizes))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_blocked_experts_give_the_models_logits():
    from flax import nnx
    from flint_jax.cache import init_cache
    from flint_jax.config import preset
    from flint_jax.model import FlintForCausalLM, use_blocked_experts
    cfg = preset("tiny")
    model = FlintForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
    n = jnp.asarray([40, 31], jnp.int32)
    ref, _, _ = model(tokens, init_cache(cfg, 2, 64, jnp.float32), n)
    use_blocked_experts(model)
    got, _, _ = model(tokens, init_cache(cfg, 2, 64, jnp.float32), n)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_data_is_deterministic_and_split():
    files = demo_data.stdlib_files()
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f or f.startswith("test" + os.sep) for f in files)
    held = [f for f in files if demo_data.split_of(f) == "eval"]
    assert 0.01 < len(held) / len(files) < 0.06
    a = [demo_data.chat_transcript(random.Random(i)) for i in range(40)]
    assert a == [demo_data.chat_transcript(random.Random(i)) for i in range(40)]
    assert all(t.startswith("[gMASK]<sop>") and t.endswith("<|endoftext|>") for t in a)
    assert any("<tool_call>" in t for t in a) and any("<think>" in t for t in a)
    assert any("<|assistant|></think>" in t for t in a)  # thinking off
    # A generated tool call is one the parser accepts against the tools' schemas.
    from flint_jax.chat_format import parse_assistant
    for msgs, tools, thinking in (demo_data.chat_messages(random.Random(i)) for i in range(200)):
        for m in msgs:
            for call in m.get("tool_calls", []):
                name = call["function"]["name"]
                assert name in {t["function"]["name"] for t in tools}
                text = "<tool_call>" + name + "".join(
                    f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                    for k, v in call["function"]["arguments"].items()) + "</tool_call>"
                got = parse_assistant(text, tools=tools, thinking=False)
                assert not got["errors"]
                assert got["tool_calls"][0]["function"]["arguments"] == call["function"]["arguments"]


def _train(work, *extra):
    import train_demo
    train_demo.main(["--work", str(work), "--size", "tiny", "--vocab", "320", "--max-files", "4",
                     "--batch", "2", "--seq", "32", "--eval-every", "1000", "--save-every", "1000",
                     "--warmup", "2", "--steps", "4", *extra])


def _state(work):
    with np.load(os.path.join(work, "state.npz")) as z:
        return [z[f] for f in sorted(z.files)]


def test_resume_continues_the_same_run_and_export_loads(tmp_path):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    _train(straight)
    _train(resumed, "--stop-after", "2")
    with open(resumed / "state.json") as f:
        assert json.load(f)["step"] == 2
    _train(resumed, "--out", str(tmp_path / "ckpt"))
    for a, b in zip(_state(straight), _state(resumed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    ckpt = tmp_path / "ckpt"
    names = sorted(os.listdir(ckpt))
    for need in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "model.safetensors.index.json", "train_log.json", "README.md"):
        assert need in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert shards and all(os.path.getsize(ckpt / s) <= 16 * 2**20 for s in shards)
    import flint_jax
    model = flint_jax.load(ckpt, dtype="float32", kernels="xla")
    assert model.config.num_experts == 4 and model.config.is_moe(2) and model.config.is_sliding(2)
    out = flint_jax.generate(model, "def f(x):", max_new_tokens=3, temperature=0.0)
    assert isinstance(out, str)
