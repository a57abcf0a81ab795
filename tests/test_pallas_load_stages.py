"""pallas.load_stages: ``tt.num_stages`` on the dot-free K loops of the selected kernels.

The names and the Triton IR are checked here on the CPU (lowered for an abstract H200); that the
pipelined kernels compute the same bits is checked by the decode-step comparison, which runs the
compiled kernels on a GPU (``tools/gpu_kernels.sh tests``) and is a no-op in interpret mode.
"""

import importlib

import numpy as np
import pytest
from flax import nnx

from flint_jax import fast_decode
from flint_jax.fast_decode import DecodeOptions
from flint_jax.model import FlintForCausalLM
from flint_jax.pallas import load_stages
from test_fast_decode import paired_steps, small_cfg


def test_names_are_tagged_only_under_stages():
    name = "flint_moe_gate_up_routed_token_bn16"
    assert load_stages.tagged_name(name) == name            # off by default
    with load_stages.stages(1):
        assert load_stages.tagged_name(name) == name        # one stage: nothing to pipeline
    with load_stages.stages(3):
        assert load_stages.tagged_name(name) == name + "_ls3"
        assert load_stages.tagged_name(name + "_ls3") == name + "_ls3"
        assert load_stages.tagged_name(None) is None
        with load_stages.kinds("gemv"):
            assert load_stages.tagged_name(name) == name
            assert load_stages.tagged_name("flint_nvfp4_gemv_blocks") == \
                "flint_nvfp4_gemv_blocks_ls3"
        with load_stages.kinds("moe"):
            assert load_stages.tagged_name("flint_moe_down_split_bn32") == \
                "flint_moe_down_split_bn32_ls3"
            assert load_stages.tagged_name("flint_qk_norm_attn_full") == \
                "flint_qk_norm_attn_full"
    assert load_stages.requested_stages(name + "_ls4") == 4
    assert load_stages.requested_stages(name) == 0


def _loop_attrs(asm: str):
    """The ``tt.num_stages`` values of every scf.for of a Triton module's text (None: untagged)."""
    import re
    out = []
    lines = asm.split("\n")
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        for later in lines[i + 1:]:
            if later.strip().startswith("}") and len(later) - len(later.lstrip()) == indent:
                m = re.search(r"tt.num_stages = (\d+)", later)
                out.append(int(m.group(1)) if m else None)
                break
    return out


def _nvfp4_gemv_modules(n_stages, method="blocks"):
    import jax
    import jax.numpy as jnp
    from flint_jax.pallas import testing
    NV = importlib.import_module("flint_jax.pallas.nvfp4_gemv")   # the package exports the function
    w = testing.random_nvfp4(np.random.default_rng(0), (96, 1024))
    with load_stages.stages(n_stages):
        return testing.triton_modules(
            lambda x, *w_: NV.nvfp4_gemv(x, *w_, method=method, block_n=16, block_k=256),
            jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16), *w)


def test_dot_free_k_loop_is_tagged_in_the_triton_ir():
    """The NVFP4 GEMV's K loop (CUDA-core blocks tiles: no dot) carries tt.num_stages only
    under stages(n), with n; its name says so."""
    (off,) = _nvfp4_gemv_modules(0)
    (on,) = _nvfp4_gemv_modules(3)
    assert not off["name"].endswith("_ls3") and on["name"] == off["name"] + "_ls3"
    assert _loop_attrs(off["asm"]) and set(_loop_attrs(off["asm"])) == {None}
    assert set(_loop_attrs(on["asm"])) == {3}


def test_loops_with_a_dot_are_left_alone():
    """A GEMV on tensor-core tiles (a dot in its K loop, already pipelined at the kernel's
    num_stages) keeps its loop untagged even under stages(n)."""
    (on,) = _nvfp4_gemv_modules(3, method="dot")
    assert "tt.dot" in on["asm"]
    assert set(_loop_attrs(on["asm"])) == {None}


@pytest.mark.parametrize("kinds, tagged_prefixes", [
    ("moe", ("flint_moe_gate_up", "flint_moe_down")),
    ("gemv", ("flint_nvfp4_gemv", "flint_multi_gemv", "flint_nvfp4_silu_mul"))])
def test_decode_step_tags_the_selected_kernels(kinds, tagged_prefixes):
    """The NVFP4 decode step at batch 1 under DecodeOptions(load_stages=2, load_stage_kernels=):
    exactly the selected kinds' kernels are named ``_ls2``, and only theirs carry the attribute."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    step = fast_decode.make_decode_step(
        graphdef, cfg, options=DecodeOptions(load_stages=2, load_stage_kernels=kinds))
    mods = triton_modules(lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
                          jax.ShapeDtypeStruct((1,), jnp.int32))
    tagged = [m for m in mods if m["name"].endswith("_ls2")]
    assert tagged and all(m["name"].startswith(tagged_prefixes) for m in tagged)
    assert all(not m["name"].startswith(tagged_prefixes) for m in mods if m not in tagged)
    assert all(2 in _loop_attrs(m["asm"]) for m in tagged)
    assert all(2 not in _loop_attrs(m["asm"]) for m in mods if m not in tagged)


def test_options_are_checked():
    with pytest.raises(ValueError, match="load_stage_kernels"):
        DecodeOptions(load_stages=3, load_stage_kernels="attention")
    with pytest.raises(ValueError, match="load_stages"):
        DecodeOptions(load_stages=-1)


@pytest.mark.parametrize("quant, rows", [(True, 1), (True, 3), (False, 2)])
def test_pipelined_step_equals_the_default_step(quant, rows):
    """Pipelining moves loads, not arithmetic: three decode steps with every kernel's dot-free
    loops in 3 stages give the default step's logits bit for bit (compiled: H200 run 171)."""
    import jax
    if jax.default_backend() == "cpu":
        pytest.skip("compiled only: interpreted, only the kernels' names differ "
                    "(test_decode_step_tags_the_selected_kernels checks the names and the IR)")
    for l1, _, l2 in paired_steps(quant, 17, DecodeOptions(load_stages=3), DecodeOptions(),
                                  rows, (9, 40, 3)):
        np.testing.assert_array_equal(l1, l2)
