"""The decode benchmark's helpers: kernel statistics from a trace, and one case end to end on CPU."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import gpu_suite  # noqa: E402
import numpy as np  # noqa: E402

from flint_jax import bench  # noqa: E402
from flint_jax.config import preset  # noqa: E402


def test_kernel_stats_counts_stream_kernels_only():
    meta = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #1(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "python3"}},
    ]
    kernels = [("gemv", 4.0), ("attn", 10.0), ("gemv", 6.0), ("attn", 12.0), ("norm", 1.0),
               ("gemv", 5.0)]
    events = meta + [{"ph": "X", "pid": 1, "tid": 7, "name": n, "dur": d} for n, d in kernels]
    events += [{"ph": "X", "pid": 1, "tid": 8, "name": "host_op", "dur": 100.0},   # not a kernel
               {"ph": "i", "pid": 1, "tid": 7, "name": "marker"}]                  # not complete
    stats = bench.kernel_stats({"traceEvents": events}, steps=2, top=2)
    assert stats["kernels"] == 3.0
    assert stats["kernel_us"] == pytest.approx(19.0)
    assert stats["by_kernel"] == [["attn", 1.0, 11.0], ["gemv", 1.5, 7.5]]


def test_busy_time_counts_overlaps_once():
    """Kernels launched early (PDL) overlap their predecessors: the union, not the sum."""
    assert bench.busy_time([]) == 0.0
    assert bench.busy_time([(0.0, 4.0), (10.0, 2.0)]) == 6.0            # a gap
    assert bench.busy_time([(0.0, 4.0), (3.0, 5.0), (3.5, 1.0)]) == 8.0  # overlaps
    assert bench.busy_time([(5.0, 1.0), (0.0, 10.0)]) == 10.0           # unsorted, nested


def test_run_case_tiny_on_cpu():
    cfg = preset("tiny", num_hidden_layers=2, mlp_only_layers=())   # two MoE layers
    graphdef, state = bench.build_state(cfg, quant=False)
    row = bench.run_case(cfg, graphdef, state, False, batch=2, context=40,
                                paths=["xla", "pallas"], steps=1, trace=False, loop_block=1)
    for p in ("xla", "pallas"):
        assert f"{p}_error" not in row, row.get(f"{p}_error")
        assert row[f"{p}_ms"] > 0 and row[f"{p}_loop_ms"] > 0 and row[f"{p}_loop_idle_ms"] > 0
    assert row["floor_ms"] > 0
    # Same cache contents and token for both paths: the logits agree to bf16 accuracy.
    assert row["rel_l2_pallas_vs_xla"] < 2e-2
    assert "| bf16 | 2 | 40 |" in bench.table([row], ["xla", "pallas"])


def test_choice_gap_reports_the_first_disagreeing_row():
    a = np.array([[0.0, 5.0, 4.9], [1.0, 2.0, 3.0], [9.0, 0.0, 8.0]], np.float32)
    assert gpu_suite.choice_gap(a, a.copy()) is None
    b = a.copy()
    b[1, 0] = 3.5          # row 1 now picks token 0 (margin 0.5 over the reference's token 2)
    b[2, 2] = 9.5          # row 2 too, but row 1 comes first
    gap = gpu_suite.choice_gap(a, b)
    assert gap["row"] == 1
    assert gap["ref_margin"] == pytest.approx(2.0)       # a[1, 2] - a[1, 0]
    assert gap["pallas_margin"] == pytest.approx(0.5)    # b[1, 0] - b[1, 2]
    assert gap["max_abs_diff"] == pytest.approx(2.5)
    assert gap["logit_scale"] == pytest.approx(3.0)


def test_parity_tiny_on_cpu():
    cfg = preset("tiny", num_hidden_layers=2, mlp_only_layers=())
    graphdef, state = bench.build_state(cfg, quant=True)
    p = gpu_suite.parity(cfg, graphdef, state, True, steps=2, batch=2, prompt_len=45)
    assert p["steps"] == 2 and p["prompt_lens"] == [45, 8]
    assert 0.0 <= p["teacher_forced_argmax_agreement"] <= 1.0
    assert p["teacher_forced_rel_l2_max"] < 5e-2
    own = p["xla_batch1_vs_batch"]   # the XLA path against itself (row 0 alone)
    assert own is not None and own["rel_l2_median"] is not None and own["rel_l2_median"] < 5e-2
    # on the CPU the two XLA decodes differ by ~1e-8: every step's argmax agrees, which also
    # checks that each step is compared with the reference logits of the same input token
    assert own["teacher_forced_argmax_agreement"] == 1.0
    if p["tokens_identical"]:
        assert p["first_divergence"] is None and p["first_divergence_near_tie"] is None
    else:
        assert p["first_divergence_near_tie"]["ref_margin"] >= 0


def test_fixed_routing_zeroes_only_the_routers():
    """`--option routing=fixed`'s state: every router weight zero (so every token selects experts
    0 .. top_k - 1), every other leaf the very same array."""
    from flax import nnx
    cfg = preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,))
    _, state = bench.build_state(cfg, quant=False)
    fixed = bench._fixed_routing(state)
    before = dict(nnx.to_flat_state(state))
    routers = 0
    for path, var in nnx.to_flat_state(fixed):
        name = ".".join(str(p) for p in path)
        if name.endswith("mlp.gate.weight"):
            routers += 1
            assert not np.asarray(var.get_value()).any()
            assert np.asarray(before[path].get_value()).any()
        else:
            assert var.get_value() is before[path].get_value(), name
    assert routers == 1


def test_make_handle_options():
    """`--option key=value`: "pallas" is the measured plan (``decode_plan``) unless options
    change it (``DecodePlan`` fields, ``moe.`` + ``MoEPlan`` fields, comma-joined or repeated);
    the xla path ignores plan fields; unknown keys, values and paths are refused."""
    from flint_jax.fast_decode import decode_plan
    cfg = preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,))
    graphdef, state = bench.build_state(cfg, quant=False)
    assert bench.make_handle(cfg, graphdef, state, False, "pallas").decode_plan is None
    opts = ["early_trigger=false,qkv_split_k=2", "moe.slot_rows=all"]
    h = bench.make_handle(cfg, graphdef, state, False, "pallas", opts)
    p = h.decode_plan(False, 8)
    want = decode_plan(False, 8)
    assert (p.early_trigger, p.qkv_split_k, p.moe.slot_rows) == (False, 2, "all")
    assert p.layer_end == want.layer_end and p.moe.block_n == want.moe.block_n
    assert bench.make_handle(cfg, graphdef, state, False, "xla", opts).decode_plan is None
    for bad, match in [(["notrig"], "want key=value"), (["no_such_field=1"], "not a DecodePlan"),
                       (["moe.nope=1"], "MoEPlan has no field"), (["scales=fp8"], "want one of")]:
        with pytest.raises(ValueError, match=match):
            bench.make_handle(cfg, graphdef, state, False, "pallas", bad)
    with pytest.raises(ValueError, match="bad path"):
        bench.make_handle(cfg, graphdef, state, False, "pallas_early_trigger=false")


def test_cli_bench_parses_options():
    """`flint-jax bench` takes --option (repeatable) and only xla / pallas as --paths; the bench
    code is imported from the package (no sys.path editing: it works from a wheel)."""
    from flint_jax import cli
    a = cli.build_parser().parse_args(["bench", "--config", "smoke", "--paths", "pallas",
                                       "--option", "early_trigger=false",
                                       "--option", "moe.slot_rows=all"])
    assert a.option == ["early_trigger=false", "moe.slot_rows=all"] and a.paths == ["pallas"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--paths", "pallas_early_trigger=false"])
    src = open(cli.__file__).read()
    assert "sys.path" not in src


def test_step_kernel_bytes_add_up_to_the_step_floor():
    """tools/step_kernel_tbps.py's per-kernel byte model, summed over a step's kernels, is the
    floor's byte count (bench.step_bytes) less the embedding rows, for BF16 where both
    count 2 B per weight; kernels without a model (merge, top-k) count nothing."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import step_kernel_tbps  # noqa: E402

    cfg = preset("flint")
    step = [("flint_moe_gate_up_routed_bf16", 47), ("flint_moe_down_split_routed_bf16", 47),
            ("flint_norm_qkv3_moe_bf16", 49), ("input_reduce_fusion_48", 49),
            ("flint_gemv_silu_mul_swap", 2), ("gemm_fusion_dot_55", 2), ("gemm_fusion_dot_54", 1),
            ("flint_add_rms_norm_router_d2048", 47), ("flint_qk_norm_rope_attn_ring_bk64", 35),
            ("flint_qk_norm_attn_full_bk128", 14), ("flint_decode_attn_merge_ns16", 49),
            ("flint_moe_topk_e256_k6", 47)]
    for batch, context in [(1, 1024), (8, 100_000), (3, 300)]:
        total = sum(calls * (step_kernel_tbps.kernel_bytes(name, calls, cfg, "bf16", batch, context)
                             or 0.0) for name, calls in step)
        want = bench.step_bytes(cfg, batch, context, quant=False) - batch * cfg.hidden_size * 2
        assert total == pytest.approx(want, rel=1e-12), (batch, context)
    assert step_kernel_tbps.kernel_bytes("flint_decode_attn_merge_ns16", 49, cfg, "bf16", 1, 1024) is None
    # NVFP4 weights as held on the device: 4-bit codes and a bf16 block scale per 16 values.
    o_proj = step_kernel_tbps.kernel_bytes("flint_nvfp4_gemv_blocks", 49, cfg, "nvfp4", 1, 1024)
    assert o_proj == cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim * (0.5 + 2 / 16)
