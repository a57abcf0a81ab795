"""The Pallas decode step (interpret mode on CPU, compiled on a GPU) equals the XLA path, on the
``decode_plan`` of each (format, batch) and its plan variants."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flint_jax
from flint_jax import fast_decode
from flint_jax.cache import init_cache
from flint_jax.fast_decode import DecodePlan, decode_plan
from flint_jax.model import FlintForCausalLM


def small_cfg():
    # One full (NoPE) and one sliding layer, a dense and a MoE layer, GQA 2, window 9 (ring 64).
    return flint_jax.preset("tiny", num_hidden_layers=3, mlp_only_layers=(0,),
                            layer_types=("full_attention", "sliding_attention", "full_attention"))


_XLA_TOKENS = {}   # the XLA path's greedy tokens of `small_cfg` models, shared by the cases


def assert_generate_equal(fmt, seed, rows, max_new_tokens, plan=None):
    """Greedy generate() of one random small model on the XLA and the Pallas path (with
    ``plan``, a function (quant, batch) -> DecodePlan, or the default): the same tokens. The XLA
    path's tokens are computed once per (format, seed, rows, length) in a test process."""
    mod = FlintForCausalLM(small_cfg(), quant=fmt == "nvfp4", rngs=nnx.Rngs(seed))
    pal = flint_jax.from_module(mod, kernels="pallas")
    pal.decode_plan = plan
    kw = dict(max_new_tokens=max_new_tokens, temperature=0, stop_token_ids=[])
    key = (fmt, seed, tuple(map(tuple, rows)), max_new_tokens)
    want = _XLA_TOKENS.get(key)
    if want is None:
        want = [np.asarray(x) for x in
                flint_jax.generate(flint_jax.from_module(mod, kernels="xla"), rows, **kw)]
        _XLA_TOKENS[key] = want
    for x, y in zip(want, flint_jax.generate(pal, rows, **kw)):
        np.testing.assert_array_equal(x, y)


def _rows(n):
    """n prompts, the first past the sliding window."""
    return [list(range(7 + r, 77 - 5 * r)) for r in range(n)]


# (format, batch): batch 1 and 8 for both formats (the bar), and the plans in between:
# NVFP4 rows tiles with a 2-way split q|k|v (2-3); BF16's per-token MoE slots (2-4) are
# tests/test_shape_sweep.py's bf16_b3_std08 (the same step, teacher-forced against XLA's)
@pytest.mark.parametrize("fmt,batch", [("bf16", 1), ("nvfp4", 1), ("bf16", 8), ("nvfp4", 8),
                                       ("nvfp4", 2)])
def test_default_step_equals_xla(fmt, batch):
    assert_generate_equal(fmt, 3, _rows(batch), 5)


def paired_logits(quant, seed, rows, tokens, plan_a, plan_b=None):
    """Per step, the logits of the Pallas step on ``plan_a`` and on ``plan_b`` (default: the XLA
    step), from the same empty caches, and plan_a's cache: row r decodes token t + r."""
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(seed)))
    # On a GPU interpreted kernels would be XLA GPU fusions whose reduction order depends on
    # their neighbours: the compiled kernels are what the GPU run must check.
    interpret = jax.default_backend() == "cpu"

    def xla_step(st, cache, toks):
        n = jnp.ones(toks.shape, jnp.int32)
        logits, cache, _ = nnx.merge(graphdef, st)(toks[:, None], cache, n, logits="last")
        return logits, cache

    step_a = jax.jit(fast_decode.make_decode_step(graphdef, cfg, interpret=interpret,
                                                  plan=plan_a))
    step_b = jax.jit(xla_step if plan_b is None else fast_decode.make_decode_step(
        graphdef, cfg, interpret=interpret, plan=plan_b))
    cache_a = cache_b = init_cache(cfg, rows, 64)
    for t in tokens:
        toks = jnp.arange(t, t + rows, dtype=jnp.int32)
        logits_a, cache_a = step_a(state, cache_a, toks)
        logits_b, cache_b = step_b(state, cache_b, toks)
        yield np.asarray(logits_a), cache_a, np.asarray(logits_b)


@pytest.mark.parametrize("quant", [False, True])
def test_cache_counters_stay_zero_between_steps(quant):
    """The counting kernels of the batch-1 plans (BF16: the MoE gate_up's K slices; NVFP4: the
    combine in the MoE down kernel) keep their counters in the cache: every step hands them
    back zeroed, and the steps' logits stay close to the XLA step's."""
    for logits, cache, want in paired_logits(quant, 4, 1, (5, 17, 3), None):
        assert not np.asarray(cache.counters).any(), "the cache's counters must stay zero"
        assert np.argmax(logits) == np.argmax(want)
        np.testing.assert_allclose(logits, want, atol=0.05 * np.abs(want).max())


def _variant(**changes):
    """A plan function: ``decode_plan`` with ``changes`` (its MoE plan without K slices when
    the layer end leaves the q|k|v kernel)."""
    def plan(quant, batch):
        p = decode_plan(quant, batch)
        moe = p.moe if changes.get("layer_end", "qkv") == "qkv" else dataclasses.replace(
            p.moe, gate_up_split_k=1)
        return dataclasses.replace(p, moe=moe, **changes)
    return plan


@pytest.mark.parametrize("quant,rows,changes", [
    (False, 1, dict(layer_end="norm", router_in_norm=False, bf16_dense_pallas=False)),
    (True, 1, dict(layer_end="norm", qkv_split_k=2, lm_head_f16=False, early_trigger=True)),
])
def test_plan_variants_equal_the_default_step(quant, rows, changes):
    """Plan fields are choices between implemented alternatives: the batch-1 plans with the
    layer end in its own kernels (the batch > 1 form), the router on its own kernel, the
    XLA dense gate|up / the f32 LM head tiles give the default step's logits up to rounding
    (the same argmax)."""
    for logits, _, want in paired_logits(quant, 7, rows, (5, 17), _variant(**changes), None):
        assert np.argmax(logits) == np.argmax(want)
        np.testing.assert_allclose(logits, want, atol=0.05 * np.abs(want).max())


def test_decode_plan_checks():
    """Plans the step cannot run are refused when built."""
    p = decode_plan(False, 1)
    for changes, match in [(dict(layer_end="down"), "needs NVFP4 weights at batch 1"),
                           (dict(layer_end="fold"), "layer_end must be one of"),
                           (dict(qkv_split_k=3), "power of two"),
                           (dict(qkv_split_k=2), "needs the multi_gemv"),
                           (dict(lm_head_f16=True), "lm_head_f16 needs NVFP4"),
                           (dict(batch=2), "moe is for 1 rows")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(p, **changes)
    with pytest.raises(ValueError, match="needs BF16 weights"):
        dataclasses.replace(decode_plan(True, 1), layer_end="qkv", qkv_split_k=1)
    with pytest.raises(ValueError, match="1..16 rows"):
        decode_plan(True, 17)
    assert isinstance(decode_plan(True, 16), DecodePlan)


def test_batches_above_the_limit_go_to_the_fallback():
    """Above MAX_BATCH rows the step is the fallback's; without one it refuses."""
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, rngs=nnx.Rngs(0)))
    called = []
    step = fast_decode.make_decode_step(graphdef, cfg, interpret=True,
                                        fallback=lambda *a: called.append(a) or "fallback")
    assert step(state, None, jnp.zeros((17,), jnp.int32)) == "fallback" and called
    step = fast_decode.make_decode_step(graphdef, cfg, interpret=True)
    with pytest.raises(ValueError, match="at most 16 rows"):
        step(state, None, jnp.zeros((17,), jnp.int32))


def test_decode_compiles_once():
    """In a fresh process, generate() on the Pallas path traces and compiles its decode call
    once: in interpret mode jax 0.11.2's Pallas lowering defined a jit-keyed config state during
    the first trace, so the second decode call missed the cache and compiled the step again
    (flint_jax.pallas now defines it at import; compiled for the GPU it never did, H200 run
    170). Fresh process: in this one an earlier test has defined it."""
    import subprocess
    import sys
    code = """if True:
        import flint_jax
        from flax import nnx
        from flint_jax.model import FlintForCausalLM
        cfg = flint_jax.preset("tiny", num_hidden_layers=1)
        h = flint_jax.from_module(FlintForCausalLM(cfg, rngs=nnx.Rngs(0)), kernels="pallas")
        flint_jax.generate(h, [[1, 2, 3]], max_new_tokens=4, temperature=0, stop_token_ids=[])
        print(h.pallas_prefill, sorted((k[0], f._cache_size()) for k, f in h.steps.items()))"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    pallas_prefill, steps = out.stdout.strip().splitlines()[-1].split(" ", 1)
    chunk = "prefill_chunk" if pallas_prefill == "True" else "chunk"   # on a GPU / the CPU
    assert steps == str(sorted([(chunk, 1), ("decode", 1), ("sample", 1)]))
