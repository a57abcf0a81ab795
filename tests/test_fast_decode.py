"""generate() on the Pallas decode path (interpret mode on CPU) equals the XLA path."""
import dataclasses

import numpy as np
import pytest
from flax import nnx

import flint_jax
from flint_jax import fast_decode
from flint_jax.fast_decode import FUSED_OPTIONS, V1_OPTIONS, DecodeOptions
from flint_jax.model import FlintForCausalLM


def small_cfg():
    # One full (NoPE) and one sliding layer, a dense and a MoE layer, GQA 2, window 9 (ring 64).
    return flint_jax.preset("tiny", num_hidden_layers=3, mlp_only_layers=(0,),
                            layer_types=("full_attention", "sliding_attention", "full_attention"))


def paired_steps(quant, seed, options, other, rows, tokens):
    """Decode steps of one small random model (`small_cfg`) on two `DecodeOptions`, from the
    same empty caches (interpret mode on the CPU, the compiled kernels on a GPU): per step, row
    r decodes token t + r for t in `tokens`; yields (logits of `options`, its cache, logits of
    `other`)."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import init_cache
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(seed)))
    # On a GPU the interpreted kernels would be XLA GPU fusions whose reduction order depends on
    # their neighbours (H200 run 166: the bit-for-bit comparisons failed there); the compiled
    # kernels are what the GPU run must check.
    interpret = jax.default_backend() == "cpu"
    step_a, step_b = (jax.jit(fast_decode.make_decode_step(graphdef, cfg, interpret=interpret,
                                                           options=o)) for o in (options, other))
    cache_a = cache_b = init_cache(cfg, rows, 64)
    for t in tokens:
        toks = jnp.arange(t, t + rows, dtype=jnp.int32)
        logits_a, cache_a = step_a(state, cache_a, toks)
        logits_b, cache_b = step_b(state, cache_b, toks)
        yield np.asarray(logits_a), cache_a, np.asarray(logits_b)


# default: fused q|k|v + routed MoE; v1: separate GEMVs + the "slots" (NVFP4) / "xla" (BF16) MoE;
# fused: the options that are off by default (not yet measured on the GPU).
# attn / attn_atomic: Q/K norm + RoPE + cache write inside the attention kernel, the merge in its
# own kernel / in the last program (with norm_in_qkv for the atomic one).
OPTIONS = {"default": DecodeOptions(), "v1": V1_OPTIONS,
           "fused": FUSED_OPTIONS, "attn": DecodeOptions(attention="fused"),
           "attn_atomic": DecodeOptions(attention="fused_atomic", norm_in_qkv=True),
           "ring1": DecodeOptions(ring_splits=1),
           "ring2_split": DecodeOptions(ring_splits=2, attention="split"),
           # the routed MoE's other slot_rows mode at batch 2 (default: "token"), and
           # the NVFP4 GEMVs (q|k|v, o_proj, dense MLP, LM head) on CUDA-core rows tiles
           "allrows": DecodeOptions(moe_slot_rows="all"),
           "tokrows": DecodeOptions(moe_slot_rows="token"),
           "rows": DecodeOptions(nvfp4_rows=True),
           # the routing once per layer (XLA top_k), the shared expert's programs first
           "tokpresf": DecodeOptions(moe_slot_rows="token", moe_prerouted=True,
                                     moe_shared_first=True),
           # the shared expert's rows on one program per row block (the NVFP4 default
           # before run 102: per token on the M = 1 tiles)
           "shall": DecodeOptions(moe_shared_rows="all"),
           # the NVFP4 q|k|v at batch 2 on the tensor-core tile (its default there: rows)
           "qkvdot": DecodeOptions(nvfp4_qkv_method="dot"),
           # the NVFP4 batch > 1 MoE mode on BF16 experts (bench path pallas_tokshtok)
           "tokshtok": DecodeOptions(moe_slot_rows="token", moe_shared_rows="token")}
# Off by default and measured no faster: compiled on a GPU, interpreted on the CPU only with
# FLINT_TEST_KNOBS=1 (tests/conftest.py).
KNOB_CASES = {"ring1", "ring2_split", "tokpresf", "shall"}
CASES = [pytest.param(fmt, name, marks=[pytest.mark.knob] if name in KNOB_CASES else [])
         for fmt, name in [
             ("bf16", "default"), ("nvfp4", "default"), ("bf16", "v1"), ("nvfp4", "v1"),
             ("bf16", "fused"), ("nvfp4", "fused"), ("nvfp4", "attn"), ("bf16", "attn_atomic"),
             ("bf16", "ring1"), ("nvfp4", "ring2_split"), ("nvfp4", "allrows"),
             ("bf16", "allrows"), ("nvfp4", "rows"), ("nvfp4", "tokpresf"), ("nvfp4", "shall"),
             ("nvfp4", "qkvdot"), ("bf16", "tokshtok")]]


_XLA_TOKENS = {}   # the XLA path's greedy tokens of `small_cfg` models, shared by the cases


def assert_generate_equal(fmt, seed, options, rows, max_new_tokens, cfg=None):
    """Greedy generate() of one random small model on the XLA and the Pallas path: same tokens.
    The XLA path's tokens of the default `small_cfg` are computed once per (format, seed, rows,
    length) in a test process (the many option cases share them)."""
    mod = FlintForCausalLM(cfg or small_cfg(), quant=fmt == "nvfp4", rngs=nnx.Rngs(seed))
    pal = flint_jax.from_module(mod, kernels="pallas")
    if options is not None:
        pal.decode_options = options
    kw = dict(max_new_tokens=max_new_tokens, temperature=0, stop_token_ids=[])
    key = None if cfg else (fmt, seed, tuple(map(tuple, rows)), max_new_tokens)
    want = _XLA_TOKENS.get(key)
    if want is None:
        want = [np.asarray(x) for x in
                flint_jax.generate(flint_jax.from_module(mod, kernels="xla"), rows, **kw)]
        if key:
            _XLA_TOKENS[key] = want
    for x, y in zip(want, flint_jax.generate(pal, rows, **kw)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("fmt,options", CASES)
def test_pallas_generate_equals_xla(fmt, options):
    rows = [list(range(7, 77)), list(range(3, 14))]  # past the window on row 0
    assert_generate_equal(fmt, 3, OPTIONS[options], rows, 6)


def test_norm_in_qkv_default_is_bf16_batch_one():
    """The measured choice (perf log 22): norm_qkv for BF16 weights at batch 1 only."""
    opts = DecodeOptions()
    assert opts.norm_in_qkv_at(1, quant=False)
    assert not opts.norm_in_qkv_at(1, quant=True) and not opts.norm_in_qkv_at(2, quant=False)
    assert not DecodeOptions(norm_in_qkv=False).norm_in_qkv_at(1, quant=False)
    assert DecodeOptions(norm_in_qkv=True).norm_in_qkv_at(8, quant=True)
    assert not DecodeOptions(moe="slots").norm_in_qkv_at(1, quant=False)


def test_router_in_norm_default_is_batch_one():
    """The measured choice (run 34): add + norm + router GEMV in one kernel at batch 1 only."""
    opts = DecodeOptions()
    assert opts.router_in_norm_at(1) and not opts.router_in_norm_at(2)
    assert not DecodeOptions(moe="slots").router_in_norm_at(1)
    assert DecodeOptions(router_in_norm=True).router_in_norm_at(8)
    assert not DecodeOptions(router_in_norm=False).router_in_norm_at(1)


def test_default_step_batch_one_nvfp4_equals_xla():
    """One NVFP4 row on the default step (router in the norm kernel, lanes q|k|v)."""
    assert_generate_equal("nvfp4", 9, DecodeOptions(), [list(range(30, 100))], 5)


@pytest.mark.parametrize("warps", [None, 8])
def test_attention_num_warps_reaches_the_attention_kernels(warps):
    """`attention_num_warps`: the step's fused attention kernels (sliding and full layers,
    lowered for an H200) run on that many warps per program (None: the kernel's 4); no other
    kernel changes."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    mods = {}
    for w in (None, warps):
        step = fast_decode.make_decode_step(graphdef, cfg,
                                            options=DecodeOptions(attention_num_warps=w))
        mods[w] = {m["name"]: m["num_warps"] for m in triton_modules(
            lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
            jax.ShapeDtypeStruct((1,), jnp.int32))}
    attn = {n for n in mods[warps] if n.startswith("flint_qk_norm")}
    assert {n.split("_attn_")[1][:4] for n in attn} == {"ring", "full"}, sorted(attn)
    assert all(mods[warps][n] == (warps or 4) for n in attn)
    assert all(mods[warps][n] == mods[None][n] for n in mods[warps] if n not in attn)


def test_moe_gate_up_split_k_default_is_two_at_batch_one():
    """The measured choice (runs 45-46): two K slices at batch 1, none above; 1 turns it off."""
    assert DecodeOptions().moe_gate_up_split_k_at(1) == 2
    assert DecodeOptions().moe_gate_up_split_k_at(2) == 1
    assert DecodeOptions(moe_gate_up_split_k=1).moe_gate_up_split_k_at(1) == 1
    assert DecodeOptions(moe_gate_up_split_k=4).moe_gate_up_split_k_at(8) == 4


@pytest.mark.parametrize("split_k", [1, 4])
def test_moe_gate_up_split_k_batch_one_equals_xla(split_k):
    """One BF16 row with the MoE gate_up kernel unsplit / in 4 K slices (the last slice of each
    tile finishing h; the default's 2 slices run in test_default_step_batch_one_equals_xla)."""
    assert_generate_equal("bf16", 10, DecodeOptions(moe_gate_up_split_k=split_k),
                          [list(range(40, 110))], 5)


@pytest.mark.parametrize("bf16_dense_pallas", [None, False])
def test_default_step_batch_one_equals_xla(bf16_dense_pallas):
    """One BF16 row: the default step takes the norm_qkv and router_in_norm routes (and the
    Pallas dense gate|up, or XLA's), and equals XLA."""
    opts = DecodeOptions(bf16_dense_pallas=bf16_dense_pallas)
    assert_generate_equal("bf16", 6, opts, [list(range(20, 90))], 5)


@pytest.mark.parametrize("fmt,options", [
    ("bf16", DecodeOptions(qkv_split_k=2)),
    ("nvfp4", DecodeOptions(qkv_split_k=2, norm_in_qkv=True, attention="fused_atomic"))])
def test_qkv_split_k_equals_xla(fmt, options):
    """norm_qkv in K slices, its partials summed by the attention kernel: one BF16 row (the
    default norm_in_qkv route) and two NVFP4 rows (norm_in_qkv forced, atomic merge)."""
    assert options.qkv_split_k_at(1) == options.qkv_split_k
    rows = [list(range(12, 82))] if fmt == "bf16" else [list(range(12, 82)), list(range(3, 9))]
    assert_generate_equal(fmt, 12, options, rows, 5)


@pytest.mark.parametrize("fmt,split_k,n_rows", [("nvfp4", 2, 1), ("nvfp4", 2, 5),
                                                ("nvfp4", 2, 2), ("bf16", 2, 3),
                                                ("bf16", None, 8)])
def test_multi_gemv_qkv_split_k_equals_xla(fmt, split_k, n_rows):
    """The q|k|v multi_gemv in K slices (no layer end folded into it), its fp32 partials summed
    by the attention kernel: NVFP4 batch 1 (the RMSNorm on load, `blocks` tiles), batch 5
    (`dot` tiles) and 2 (`rows`), BF16 batch 3, and BF16 batch 8 by default (4 slices)."""
    rows = [list(range(12 + r, 60 + 5 * r)) for r in range(n_rows)]
    assert_generate_equal(fmt, 10, DecodeOptions(qkv_split_k=split_k), rows, 4)


def test_qkv_split_k_default():
    """None: 8 K slices for the NVFP4 multi_gemv q|k|v at batch >= 4 and 2 at batch 2-3, 4 for
    the BF16 one at batch 8 (fewer where K is short), 1 at batch 1, at smaller BF16 batches,
    for norm_qkv and with the split attention; a value given wins."""
    opts = DecodeOptions()
    assert opts.qkv_split_k_at(8, True, k=2048) == opts.qkv_split_k_at(4, True) == 8
    assert opts.qkv_split_k_at(8, True, k=128) == 2 and opts.qkv_split_k_at(8, True, k=96) == 1
    assert opts.qkv_split_k_at(3, True) == opts.qkv_split_k_at(2, True, k=2048) == 2
    assert opts.qkv_split_k_at(1, True) == opts.qkv_split_k_at(2, True, k=64) == 1
    assert opts.qkv_split_k_at(8, False, k=2048) == 4 and opts.qkv_split_k_at(8, False, k=48) == 1
    assert opts.qkv_split_k_at(4, False) == opts.qkv_split_k_at(8, True, norm_qkv=True) == 1
    assert DecodeOptions(attention="split").qkv_split_k_at(8, True) == 1
    assert DecodeOptions(qkv_split_k=1).qkv_split_k_at(8, True) == 1
    assert DecodeOptions(qkv_split_k=4).qkv_split_k_at(1, False) == 4


@pytest.mark.parametrize("quant,batch", [(True, 1), (True, 2), (True, 5), (False, 3)])
def test_qkv_split_k_reaches_the_multi_gemv(quant, batch):
    """Lowered for an H200: with `qkv_split_k=2` the step's q|k|v kernels are multi_gemv in two
    K slices (`_splitk2`, none unsplit; identical kernels lower once), with `qkv_finish` too
    they finish their outputs (`_splitk2_finish`), with 1 none is split."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(0)))
    for split, finish, tail in ((1, False, "_bk"), (2, False, "_splitk2"),
                                (2, True, "_splitk2_finish")):
        step = fast_decode.make_decode_step(
            graphdef, cfg, options=DecodeOptions(qkv_split_k=split, qkv_finish=finish))
        names = [m["name"] for m in triton_modules(
            lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, batch, 256),
            jax.ShapeDtypeStruct((batch,), jnp.int32))]
        qkv = [n for n in names if n.startswith("flint_multi_gemv3")]
        assert qkv and all(n.rsplit("_", 2 if finish else 1)[0] + tail == n if split > 1
                           else "_splitk" not in n for n in qkv), (tail, names)


@pytest.mark.parametrize("swap", [True, False])
def test_nvfp4_swap_batch_five_equals_xla(swap):
    """Five NVFP4 rows (the MoE on all-rows tiles): the gate_up on swap-AB tiles (the default)
    or on session 11's dot tiles (``nvfp4_swap=False``)."""
    rows = [list(range(5 + r, 40 + 3 * r)) for r in range(5)]
    assert_generate_equal("nvfp4", 12, DecodeOptions(nvfp4_swap=swap), rows, 4)


@pytest.mark.parametrize("method", ["lanes", "reduce", "blocks"])
def test_nvfp4_m1_method_batch_one_equals_xla(method):
    """One NVFP4 row with every NVFP4 GEMV and the MoE on the given M = 1 tile method."""
    assert_generate_equal("nvfp4", 8, DecodeOptions(nvfp4_m1_method=method),
                          [list(range(5, 75))], 5)


@pytest.mark.parametrize("options,want", [("default", [2, 3, 2, 2]), ("fused", [2])])
def test_split_k_partials_into_add_rms_norm(monkeypatch, options, want):
    """NVFP4 with 16 heads: the o_proj (K = 1024) runs split-K 2 and the dense down (K = 192)
    split-K 3; add_rms_norm gets their fp32 partials (`want`: S per call in one step) except
    where norm_qkv takes the output ("fused": layer 0's down folds into layer 1's q|k|v); the
    MoE layers' o_proj goes to add_rms_norm_router there, which gets the partials too. Tokens
    equal XLA's."""
    seen, routed, arn, arnr = [], [], fast_decode.add_rms_norm, fast_decode.add_rms_norm_router

    def spy(h, y, w, **kw):
        seen.append(y.shape[0] if y.ndim == 3 else 0)
        return arn(h, y, w, **kw)

    def spy_router(h, a, w, r, **kw):
        routed.append(a.shape[0] if a.ndim == 3 else 0)
        return arnr(h, a, w, r, **kw)

    monkeypatch.setattr(fast_decode, "add_rms_norm", spy)
    monkeypatch.setattr(fast_decode, "add_rms_norm_router", spy_router)
    cfg = small_cfg().replace(num_attention_heads=16)
    assert_generate_equal("nvfp4", 4, OPTIONS[options], [list(range(5, 30)), [3, 4]], 3, cfg)
    assert seen and seen == want * (len(seen) // len(want)), seen
    assert set(routed) == ({2} if options == "fused" else set()), routed


@pytest.mark.parametrize("kw,match", [
    (dict(moe="einsum"), "routed|slots|xla|v1"),
    (dict(moe="xla", router_in_norm=True), "router_in_norm needs moe='routed'"),
    (dict(fused_qkv=False, norm_in_qkv=True), "norm_in_qkv needs"),
    (dict(moe="slots", norm_in_qkv=True), "norm_in_qkv needs"),
    (dict(attention="flash"), "split|fused|fused_atomic"),
    (dict(ring_splits=3), "power of two"),
    (dict(ring_splits=0), "power of two"),
    (dict(moe_slot_rows="tokens"), "moe_slot_rows"),
    (dict(moe_shared_rows="tokens"), "moe_shared_rows"),
    (dict(attention_num_warps=6), "attention_num_warps"),
    (dict(nvfp4_m1_method="rows"), "nvfp4_m1_method"),
    (dict(qkv_split_k=3), "qkv_split_k"),
    (dict(early_trigger="some"), "early_trigger"),
    (dict(qkv_split_k=2, attention="split"), "qkv_split_k > 1 needs"),
    (dict(nvfp4_asm="raw"), "nvfp4_asm"),
    (dict(nvfp4_qkv_method="blocks"), "nvfp4_qkv_method"),
    (dict(o_proj_split_k=3), "o_proj_split_k"),
    (dict(moe_shared_tokens=0), "moe_shared_tokens"),
    (dict(moe_down_f16=True, moe_gate_up_f16=False), "moe_down_f16 needs"),
    (dict(moe_down_f16=True, moe_shared_rows="all"), "moe_down_f16 needs"),
    (dict(moe_f16_sums="quad"), "moe_f16_sums"),
    (dict(moe_shared_with_topk=True, moe_prerouted=False), "moe_shared_with_topk needs"),
    (dict(moe_tiling=(("block_n_down", 32), ("block_m", 8))), "moe_tiling"),
    (dict(moe_tiling={"block_n": 32}), "moe_tiling"),
    (dict(lm_head_tiling=(("split_k",),)), "lm_head_tiling"),
])
def test_decode_options_reject_inconsistent_choices(kw, match):
    with pytest.raises(ValueError, match=match):
        DecodeOptions(**kw)


@pytest.mark.parametrize("quant,options,want", [
    (False, DecodeOptions(), True), (True, DecodeOptions(), False),
    (True, DecodeOptions(early_trigger=True), True), (False, DecodeOptions(early_trigger=False), False)])
def test_early_trigger_per_format(quant, options, want):
    """The measured default (run 50): BF16 steps' kernels trigger their dependents early, NVFP4
    steps' do not; forced either way. Checked in the Triton IR of the step lowered for an H200."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    assert options.early_trigger_for(quant) == (want, "all")
    cfg = flint_jax.preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,))
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(0)))
    step = fast_decode.make_decode_step(graphdef, cfg, options=options)
    mods = triton_modules(lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
                          jax.ShapeDtypeStruct((1,), jnp.int32))
    assert len(mods) > 5
    assert all(("griddepcontrol.launch_dependents" in m["asm"]) == want for m in mods)


@pytest.mark.parametrize("options,post", [
    (DecodeOptions(moe_gate_up_f16=False), {"multi_gemv3", "moe_down"}),
    (DecodeOptions(moe_gate_up_f16=False, nvfp4_asm="mul"), set()),
    (DecodeOptions(moe_gate_up_f16=False, nvfp4_asm="post"), None)])   # None: every NVFP4 kernel
def test_nvfp4_asm_auto_sites(options, post):
    """``nvfp4_asm="auto"`` (default): the NVFP4 batch-1 step's q|k|v and MoE down kernels lower
    with the "post" decode (no bf16x2 scale multiply), every other NVFP4 kernel with "mul";
    "mul" / "post" apply to every kernel. Checked in the Triton IR lowered for an H200, with the
    MoE's f32 sums (by default its kernels decode to f16 instead: `test_moe_f16_step_at_batch_1`)."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = flint_jax.preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,))
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    step = fast_decode.make_decode_step(graphdef, cfg, options=options)
    mods = triton_modules(lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
                          jax.ShapeDtypeStruct((1,), jnp.int32))
    kinds = ("multi_gemv3", "moe_gate_up", "moe_down", "nvfp4_gemv", "nvfp4_silu_mul")
    decoders = {m["name"]: m["asm"] for m in mods if "mul.lo.u32" in m["asm"]}
    sites = {n: next(k for k in kinds if k in n) for n in decoders}
    assert set(sites.values()) == set(kinds), sorted(decoders)
    scaled_sums = {sites[n] for n, asm in decoders.items() if "mul.rn.bf16x2" not in asm}
    assert scaled_sums == (set(kinds) if post is None else post)


@pytest.mark.parametrize("split_k", [2, 4])
def test_cache_counters_stay_zero_between_steps(split_k):
    """The gate_up kernel's K-slice counters live in the cache (no kernel zeroes them per step):
    every step must hand them back as zeros, with its logits equal to the unsplit step's."""
    from flint_jax.cache import COUNTER_ENTRIES
    for l1, c1, l2 in paired_steps(False, 4, DecodeOptions(moe_gate_up_split_k=split_k),
                                   DecodeOptions(moe_gate_up_split_k=1), 1, (5, 17, 3)):
        assert c1.counters.shape == (COUNTER_ENTRIES,)
        assert not np.asarray(c1.counters).any(), "a counter entry was left non-zero"
        np.testing.assert_allclose(l1, l2, rtol=2e-2, atol=2e-2)
        assert l1.argmax() == l2.argmax()


@pytest.mark.knob
@pytest.mark.parametrize("quant,rows,split", [(True, 5, None), (True, 1, 2), (False, 8, None)])
def test_qkv_finish_equals_partials_in_the_attention(quant, rows, split):
    """`qkv_finish`: the q|k|v kernel's last K slice of each tile sums the partials in slice
    order, as the attention kernel does: the same logits bit for bit, and the counters come back
    zeroed (NVFP4 batch 5 and BF16 batch 8 at their default slices, NVFP4 batch 1 with the
    RMSNorm on load and 2 slices)."""
    for l1, c1, l2 in paired_steps(quant, 21, DecodeOptions(qkv_split_k=split, qkv_finish=True),
                                   DecodeOptions(qkv_split_k=split), rows, (5, 17)):
        assert not np.asarray(c1.counters).any(), "a counter entry was left non-zero"
        np.testing.assert_array_equal(l1, l2)


TILE_OVERRIDES = DecodeOptions(
    o_proj_split_k=2, moe_tiling=(("block_n", 32), ("block_k", 64), ("block_n_down", 32),
                                  ("num_warps_down", 2)),
    lm_head_tiling=(("block_n", 32), ("block_k", 64), ("num_warps", 2)))


@pytest.mark.parametrize("quant,rows", [(True, 3), (False, 2), (True, 1)])
def test_tile_overrides_equal_the_default_step(quant, rows):
    """`o_proj_split_k`, `moe_tiling` and `lm_head_tiling` (at batch > 1; at batch 1 only the
    NVFP4 MoE's f16 kernels take `moe_tiling`, and the LM head its tiles with `lm_head_f16`, off
    here: `test_lm_head_f16_step` tiles it) change only how the kernels tile the same sums: the
    logits agree with the default step's to the summation order. Bit for bit at batch 1 in
    interpret mode; compiled, the f16 K step's sums follow the tile ("pair" or "block" sums of
    f16 products, `f16_sums_for_tile`: 9e-3 on these logits, H200 run 168)."""
    import dataclasses

    import jax
    off = dict(lm_head_f16=False) if rows == 1 else {}
    for l1, _, l2 in paired_steps(quant, 22, dataclasses.replace(TILE_OVERRIDES, **off),
                                  DecodeOptions(**off), rows, (5, 17)):
        if rows == 1 and jax.default_backend() == "cpu":
            np.testing.assert_array_equal(l1, l2)
        else:
            np.testing.assert_allclose(l1, l2, rtol=2e-2, atol=2e-2)
            assert (l1.argmax(-1) == l2.argmax(-1)).all()


@pytest.mark.knob
def test_moe_shared_tokens_equals_the_default_step():
    """`moe_shared_tokens=4` at batch 4 (NVFP4: the shared expert per token): its gate_up
    programs decode each tile once for 4 tokens, the same products and sums: logits bit for
    bit (against the step on the bf16 decode: `moe_shared_tokens` > 1 turns the f16 gate_up
    off)."""
    for l1, _, l2 in paired_steps(True, 23, DecodeOptions(moe_shared_tokens=4),
                                  DecodeOptions(moe_gate_up_f16=False), 4, (5, 17)):
        np.testing.assert_array_equal(l1, l2)


def test_moe_gate_up_f16_step():
    """`moe_gate_up_f16` (the default, NVFP4 per-token slots): the MoE gate_up on f16x2
    products: at batch 3 logits within bf16 noise of the step without it, the same argmax
    (batch 1: `test_moe_f16_step_at_batch_1`)."""
    from flint_jax.pallas.testing import rel_l2
    assert DecodeOptions().gate_up_f16_at(2) and DecodeOptions().gate_up_f16_at(1)
    assert not DecodeOptions(moe_slot_rows="all").gate_up_f16_at(8)
    assert not DecodeOptions(moe_shared_tokens=2).gate_up_f16_at(8)
    assert not DecodeOptions(nvfp4_m1_method="lanes").gate_up_f16_at(1)
    assert not DecodeOptions(moe="v1").gate_up_f16_at(1)
    for l1, _, l2 in paired_steps(True, 29, DecodeOptions(), DecodeOptions(moe_gate_up_f16=False),
                                  3, (5, 17)):
        assert 0 < rel_l2(l1, l2) < 2e-2, rel_l2(l1, l2)
        assert (l1.argmax(-1) == l2.argmax(-1)).all()
    # lowered for an H200 at batch 4: the MoE layers' add_rms_norm writes the f16 operand and
    # their gate_up reads it (no XLA op between them; the capture lists each kernel once)
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    step = fast_decode.make_decode_step(graphdef, cfg, options=DecodeOptions())
    names = [m["name"] for m in triton_modules(lambda s, c, t: step(s, c, t), state,
                                               cache_shapes(cfg, 4, 256),
                                               jax.ShapeDtypeStruct((4,), jnp.int32))]
    gate_ups = [n for n in names if "gate_up" in n]
    assert gate_ups and all("_x16_" in n for n in gate_ups), names
    assert any(n.startswith("flint_add_rms_norm") and n.endswith("_x16") for n in names), names
    assert not any("down" in n and "x16" in n for n in names), names
    # and the down kernel on f16 products (moe_down_f16's default)
    downs = [n for n in names if n.startswith("flint_moe_down")]
    assert downs and all("_h16_" in n for n in downs), names


@pytest.mark.knob
@pytest.mark.parametrize("quant,rows", [(True, 3), (True, 1), (False, 2)])
def test_moe_shared_with_topk_step(quant, rows):
    """`moe_shared_with_topk`: at batch > 1 on NVFP4 experts the shared expert's gate_up in the
    top-k kernel, the gate_up kernel only the routed slots: logits bit for bit the default
    step's, the same number of kernels (the top-k kernel replaced); batch 1 and BF16 experts
    (no top-k kernel there) unchanged."""
    for l1, _, l2 in paired_steps(quant, 37, DecodeOptions(moe_shared_with_topk=True),
                                  DecodeOptions(), rows, (5, 17)):
        np.testing.assert_array_equal(l1, l2)
    if not quant or rows == 1:
        return
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    names = {}
    for key, opts in (("shtopk", DecodeOptions(moe_shared_with_topk=True)),
                      ("default", DecodeOptions())):
        step = fast_decode.make_decode_step(graphdef, cfg, options=opts)
        names[key] = [m["name"] for m in triton_modules(
            lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, rows, 256),
            jax.ShapeDtypeStruct((rows,), jnp.int32))]
    assert len(names["shtopk"]) == len(names["default"]), names
    assert any(n.startswith("flint_moe_topk_shared") for n in names["shtopk"]), names
    assert not any(n.startswith("flint_moe_topk_e") for n in names["shtopk"]), names
    assert any(n.startswith("flint_moe_topk_e") for n in names["default"]), names


@pytest.mark.parametrize("sums", ["pair", "block"])
def test_moe_down_f16_step(sums):
    """`moe_down_f16` at batch 3: the MoE down kernel on f16x2 products too (h as f16 with a
    scale per 16 values), with either `moe_f16_sums`: logits within bf16 noise of the step
    whose MoE sums in f32, the same argmax; on by default (with the block sums where the tiles
    allow), off with `moe_down_f16=False`."""
    from flint_jax.pallas.testing import rel_l2
    opts = DecodeOptions(moe_down_f16=True, moe_f16_sums=sums)
    f32_sums = DecodeOptions(moe_gate_up_f16=False)
    for l1, _, l2 in paired_steps(True, 31, opts, f32_sums, 3, (5, 17)):
        assert 0 < rel_l2(l1, l2) < 2e-2, rel_l2(l1, l2)
        assert (l1.argmax(-1) == l2.argmax(-1)).all()
    # the tiny model's MoE tiles hold < 16 code bytes per thread: both take the pair sums
    # (`moe._f16_sums_for`; the block sums are tested on larger tiles in test_pallas_moe.py)
    other = "pair" if sums == "block" else "block"
    for l1, _, l2 in paired_steps(True, 31, opts, DecodeOptions(moe_down_f16=True,
                                                                moe_f16_sums=other), 3, (5,)):
        np.testing.assert_array_equal(l1, l2)
    assert DecodeOptions().down_f16_at(3, True) and DecodeOptions().down_f16_at(1, True)
    assert not DecodeOptions().down_f16_at(3, False)
    assert not DecodeOptions(moe_down_f16=False).down_f16_at(3, True)
    assert not DecodeOptions(moe_gate_up_f16=False).down_f16_at(3, True)
    assert not DecodeOptions(moe_shared_rows="all").down_f16_at(3, True)
    if sums == "block":   # the default step is this one, bit for bit
        for l1, _, l2 in paired_steps(True, 31, opts, DecodeOptions(), 3, (5,)):
            np.testing.assert_array_equal(l1, l2)


def test_moe_f16_step_at_batch_1():
    """The f16 MoE at batch 1 (the default there since run 160): one-token slots with the
    shared expert per token on the f16 K step, x16 written by the add + norm + router kernel,
    the down kernel on f16 too (unless `moe_down_f16=False`): logits within bf16 noise of the
    step with fp32 sums (`moe_gate_up_f16=False`), the same argmax; lowered for an H200 with
    as many kernels as that step."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import rel_l2, triton_modules
    f32_sums = DecodeOptions(moe_gate_up_f16=False)
    assert DecodeOptions().gate_up_f16_at(1) and not f32_sums.gate_up_f16_at(1)
    for opts in (DecodeOptions(), DecodeOptions(moe_down_f16=False)):
        rels = []
        for l1, _, l2 in paired_steps(True, 29, opts, f32_sums, 1, (5, 17)):
            rels.append(rel_l2(l1, l2))
            assert (l1.argmax(-1) == l2.argmax(-1)).all()
        # h's bf16 rounding may absorb the f16 sums' difference in a step, not in every one
        assert 0 < max(rels) and max(rels) < 2e-2, rels
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    names = {}
    for key, opts in (("f16", DecodeOptions()), ("default", f32_sums)):
        step = fast_decode.make_decode_step(graphdef, cfg, options=opts)
        names[key] = [m["name"] for m in triton_modules(
            lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 1, 256),
            jax.ShapeDtypeStruct((1,), jnp.int32))]
    f16 = names["f16"]
    assert len(f16) == len(names["default"]), names
    assert any(n.startswith("flint_add_rms_norm_router") and n.endswith("_x16") for n in f16)
    assert all("_x16_" in n for n in f16 if n.startswith("flint_moe_gate_up")), f16
    assert all("_h16_" in n for n in f16 if n.startswith("flint_moe_down")), f16


@pytest.mark.parametrize("quant", [True, False])
def test_tile_overrides_reach_the_kernels(quant):
    """Lowered for an H200 at batch 4: the overrides show in the kernels' names (the o_proj in
    2 slices: its add_rms_norm sums 2 partials; the MoE down kernel on 32-row blocks; the NVFP4
    gate_up on bn32 bk64 tiles and the LM head on bn32 bk64)."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=quant, rngs=nnx.Rngs(0)))
    opts = dataclasses.replace(TILE_OVERRIDES, bf16_o_proj_pallas=True)
    step = fast_decode.make_decode_step(graphdef, cfg, options=opts)
    names = [m["name"] for m in triton_modules(
        lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, 4, 256),
        jax.ShapeDtypeStruct((4,), jnp.int32))]
    assert any(n.startswith("flint_add_rms_norm_splits2") for n in names), names
    assert not any(n.startswith("flint_add_rms_norm_splits4") for n in names), names
    down = [n for n in names if n.startswith("flint_moe_down")]
    assert down and all("_bn32" in n for n in down), names
    if quant:
        gate_up = [n for n in names if n.startswith("flint_moe_gate_up")]
        assert gate_up and all("_bn32_bk64" in n for n in gate_up), names
        assert any(n.startswith("flint_nvfp4_gemv") and "_bn32_bk64_" in n for n in names), names


def test_rms_in_qkv_batch_one():
    """`rms_in_qkv` (NVFP4, batch 1, the default): the MoE down kernel stops at the residual and its sums
    of squares, the next q|k|v kernel normalises as it loads. Greedy tokens equal the XLA path's,
    the counters come back zero and the logits stay close to the default step's (the mean
    square's summation order is the only difference)."""
    opts = DecodeOptions()    # the default at batch 1 (runs 125-126)
    assert opts.rms_in_qkv_at(1, quant=True)
    assert not opts.rms_in_qkv_at(2, quant=True) and not opts.rms_in_qkv_at(1, quant=False)
    assert not DecodeOptions(rms_in_qkv=False).rms_in_qkv_at(1, quant=True)
    assert not DecodeOptions(moe_combine_in_down=False).rms_in_qkv_at(1, quant=True)
    assert_generate_equal("nvfp4", 12, opts, [list(range(35, 105))], 5)
    for l1, c1, l2 in paired_steps(True, 13, opts, DecodeOptions(rms_in_qkv=False), 1,
                                   (5, 17, 3)):
        assert not np.asarray(c1.counters).any(), "a counter entry was left non-zero"
        np.testing.assert_allclose(l1, l2, rtol=2e-2, atol=2e-2)


@pytest.mark.knob
def test_rms_in_qkv_batch_above_one():
    """`rms_in_qkv=True` at batch > 1: the combine moves into the down kernel (residual mode)
    and the next q|k|v (tensor-core or rows tiles) normalises each row as it loads it. Greedy
    tokens equal the XLA path's, the counters come back zero, and the logits stay close to the
    default step's (separate combine kernel) over three steps of 3 and 8 rows."""
    opts = DecodeOptions(rms_in_qkv=True)
    assert opts.rms_in_qkv_at(8, quant=True) and opts.rms_in_qkv_at(1, quant=True)
    assert not DecodeOptions().rms_in_qkv_at(8, quant=True)       # not the default there
    assert not DecodeOptions(rms_in_qkv=True, moe_combine_in_down=False).rms_in_qkv_at(
        8, quant=True)
    assert not opts.rms_in_qkv_at(8, quant=False)
    assert_generate_equal("nvfp4", 12, opts, [list(range(35, 105)), list(range(3, 14)),
                                               list(range(50, 61))], 4)
    for rows in (3, 8):
        for l1, c1, l2 in paired_steps(True, 13, opts, DecodeOptions(), rows, (5, 17, 3)):
            assert not np.asarray(c1.counters).any(), "a counter entry was left non-zero"
            np.testing.assert_allclose(l1, l2, rtol=2e-2, atol=2e-2)


def nvfp4_step_kernels(options, rows):
    """Names of the Pallas kernels of a `small_cfg` NVFP4 step at `rows` rows, lowered for an
    H200 (identical kernels are captured once)."""
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    step = fast_decode.make_decode_step(graphdef, cfg, options=options)
    return [m["name"] for m in triton_modules(
        lambda s, c, t: step(s, c, t), state, cache_shapes(cfg, rows, 256),
        jax.ShapeDtypeStruct((rows,), jnp.int32))]


@pytest.mark.parametrize("on", [None, True])
def test_rms_in_qkv_kernels_batch_eight(on):
    """The NVFP4 batch-8 step lowered for an H200: by default every MoE layer ends in
    `moe_combine_add_rms_norm`; with `rms_in_qkv=True` a MoE layer that is not the last ends in
    the down kernel's residual mode and the next q|k|v normalises, the last layer keeping its
    combine kernel (its norm feeds the LM head)."""
    names = nvfp4_step_kernels(DecodeOptions(rms_in_qkv=on), 8)
    # the last layer's combine kernel is there either way
    assert any(n.startswith("flint_moe_combine_add_rms_norm") for n in names), names
    assert any("_residual" in n for n in names) == bool(on), names
    assert any(n.startswith("flint_multi_gemv") and "_rms" in n for n in names) == bool(on)


@pytest.mark.parametrize("on", [None, False])
def test_rms_in_qkv_kernels(on):
    """The NVFP4 batch-1 step lowered for an H200: with `rms_in_qkv` (default) a MoE layer that is not
    the last ends in the down kernel's residual mode and the next q|k|v kernel normalises
    (the last MoE layer keeps the full combine for the LM head); 350-kernel structure kept."""
    names = nvfp4_step_kernels(DecodeOptions(rms_in_qkv=on), 1)
    # (the last one also writing the LM head's f16 operand, `lm_head_f16`'s default)
    assert any(n.startswith("flint_moe_down") and n.endswith(("_combine", "_combine_x16"))
               for n in names), names
    assert any("_residual" in n for n in names) == (on is None), names
    assert any(n.startswith("flint_multi_gemv") and "_rms" in n for n in names) == (on is None)


def test_router_and_o_proj_defaults():
    """router_pallas: the Pallas router GEMV wherever the router is its own op (batch > 1) by
    default (run 59); bf16_o_proj_pallas: off by default, batch > 1 only when on;
    moe_combine_in_down: at batch 1 by default (run 59)."""
    opts = DecodeOptions()
    assert opts.router_pallas_at(2) and opts.router_pallas_at(8)
    assert not DecodeOptions(router_pallas=False).router_pallas_at(8)
    assert opts.combine_in_down_at(1) and not opts.combine_in_down_at(2)
    assert not DecodeOptions(moe_combine_in_down=False).combine_in_down_at(1)
    assert not opts.bf16_o_proj_pallas_at(8)
    on = DecodeOptions(bf16_o_proj_pallas=True)
    assert on.bf16_o_proj_pallas_at(8) and not on.bf16_o_proj_pallas_at(1)


@pytest.mark.parametrize("fmt,options", [
    ("bf16", DecodeOptions(router_pallas=True, bf16_o_proj_pallas=True)),
    ("nvfp4", DecodeOptions(router_pallas=True)),
    ("bf16", DecodeOptions(router_pallas=False, bf16_o_proj_pallas=False))])
def test_router_kernel_and_pallas_o_proj_equal_xla(fmt, options):
    """Two rows: the router GEMV on the Pallas kernel (or XLA's dot), the BF16 o_proj on the
    Pallas gemv with its split-K partials summed by add_rms_norm."""
    rows = [list(range(30, 95)), list(range(2, 11))]
    assert_generate_equal(fmt, 14, options, rows, 5)


@pytest.mark.parametrize("fmt,rows", [("nvfp4", 1), ("bf16", 2), ("nvfp4", 2)])
def test_moe_combine_in_down_equals_three_launches(fmt, rows):
    """The MoE combine + add + norm in the down kernel's last program (where the layer end is
    not folded into the next q|k|v): generate() gives the very tokens of the default step's
    separate combine kernel (in interpret mode the two compute the same values bit for bit;
    the default step's own agreement with XLA is test_pallas_generate_equals_xla's)."""
    opts = DecodeOptions(moe_combine_in_down=True)
    mod = FlintForCausalLM(small_cfg(), quant=fmt == "nvfp4", rngs=nnx.Rngs(15))
    plain = flint_jax.from_module(mod, kernels="pallas")
    plain.decode_options = DecodeOptions(moe_combine_in_down=False)
    fused = flint_jax.from_module(mod, kernels="pallas")
    fused.decode_options = opts
    data = [list(range(17, 88)), list(range(5, 13))][:rows]
    kw = dict(max_new_tokens=5, temperature=0, stop_token_ids=[])
    for x, y in zip(flint_jax.generate(plain, data, **kw), flint_jax.generate(fused, data, **kw)):
        np.testing.assert_array_equal(x, y)


def test_moe_combine_in_down_counters_stay_zero():
    """Three NVFP4 steps with the combine in the down kernel: the cache's counters come back as
    zeros after each, and the logits equal the three-launch step's."""
    for l1, c1, l2 in paired_steps(True, 16,
                                   DecodeOptions(moe_combine_in_down=True, rms_in_qkv=False),
                                   DecodeOptions(moe_combine_in_down=False), 1, (9, 2, 30)):
        assert not np.asarray(c1.counters).any(), "a counter entry was left non-zero"
        np.testing.assert_array_equal(l1, l2)


@pytest.mark.parametrize("extra", [{}, dict(moe_combine_in_down=False, rms_in_qkv=False),
                                   dict(lm_head_tiling=(("block_k", 64), ("num_warps", 2)))])
def test_lm_head_f16_step(extra):
    """`lm_head_f16` at batch 1 (NVFP4): the LM head on the f16 operand, written by the last
    MoE layer's down kernel with the combine (default) or by `x16_operand` (combine not in the
    down kernel): logits within the f16 sums' error of the step without it, the same argmax;
    at batch 2 it changes nothing; lowered for an H200, the LM head reads the combine's f16
    operand."""
    from flint_jax.pallas.testing import rel_l2
    on, off = DecodeOptions(lm_head_f16=True, **extra), DecodeOptions(lm_head_f16=False, **extra)
    assert DecodeOptions().lm_head_f16_at(1) and not DecodeOptions().lm_head_f16_at(2)
    assert not DecodeOptions(nvfp4_m1_method="lanes").lm_head_f16_at(1)
    assert DecodeOptions(lm_head_f16=True, nvfp4_m1_method="lanes").lm_head_f16_at(1)
    for l1, _, l2 in paired_steps(True, 41, on, off, 1, (5, 17)):
        assert 0 < rel_l2(l1, l2) < 5e-3, rel_l2(l1, l2)
        assert (l1.argmax(-1) == l2.argmax(-1)).all()
    if extra:
        return
    for l1, _, l2 in paired_steps(True, 41, on, off, 2, (5,)):
        np.testing.assert_array_equal(l1, l2)
    import jax
    import jax.numpy as jnp
    from flint_jax.cache import cache_shapes
    from flint_jax.pallas.testing import triton_modules
    cfg = small_cfg()
    graphdef, state = nnx.split(FlintForCausalLM(cfg, quant=True, rngs=nnx.Rngs(0)))
    step = fast_decode.make_decode_step(graphdef, cfg, options=on)
    names = [m["name"] for m in triton_modules(lambda s, c, t: step(s, c, t), state,
                                               cache_shapes(cfg, 1, 256),
                                               jax.ShapeDtypeStruct((1,), jnp.int32))]
    assert any(n.startswith("flint_nvfp4_gemv_blocks") and n.endswith("_x16") for n in names), names
    assert any(n.startswith("flint_moe_down") and n.endswith("_combine_x16") for n in names), names


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
        print(sorted((k[0], f._cache_size()) for k, f in h._jit_cache.items()))"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[('chunk', 1), ('decode', 1), ('sample', 1)]"
