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


# ---- the prefill benchmark (`flint-jax bench --prefill`, flint_jax/bench_prefill.py) ---------

def test_prefill_case_names():
    from flint_jax.bench_prefill import parse_case
    assert parse_case("1x8K") == [8192]
    assert parse_case("8x2K") == [2048] * 8
    assert parse_case("1x32K") == [32768]
    assert parse_case("1x100K") == [100000]          # the named case: 100,000 tokens
    assert parse_case("1x262K") == [262144]
    assert parse_case("2x100") == [100, 100]
    assert parse_case("3x2K") == [2048] * 3
    assert parse_case("1x100k") == [102400]          # generic: K = 1024
    for bad in ["8K", "0x10", "2x0", "1x", "ax2", "1x8M", "1x8K "]:
        with pytest.raises(ValueError, match="bad prefill case") as e:
            parse_case(bad)
        assert repr(bad) in str(e.value) and "\n" not in str(e.value)


def test_prefill_flops_by_hand():
    """A 3-layer tiny config (0: dense + sliding, 1: MoE + full, 2: MoE + sliding; window 9),
    rows of 5 and 20 tokens, every term written out."""
    from flint_jax.bench_prefill import PEAK_FLOPS, prefill_flops
    from flint_jax.config import FULL, SLIDING
    cfg = preset("tiny", num_hidden_layers=3, layer_types=(SLIDING, FULL, SLIDING),
                 mlp_only_layers=(0,))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.vocab_size,
            cfg.sliding_window) == (128, 4, 2, 64, 192, 8, 2, 64, 128, 512, 9)
    # multiply-adds per token and layer
    attn_proj = 128 * 256 + 128 * 128 + 128 * 128 + 256 * 128     # q, k, v, o
    dense = 3 * 128 * 192                                         # gate, up, down
    moe = 8 * 128 + 2 * 3 * 128 * 64 + 3 * 128 * 128              # router, 2 experts, shared
    per_token = (attn_proj + dense) + (attn_proj + moe) + (attn_proj + moe)
    assert per_token == 567296
    matmul = 2 * per_token * 25 + 2 * 2 * 128 * 512               # 25 tokens; lm head per row
    # query-key pairs: causal over every key (full) or the last 9 keys (sliding)
    full_pairs = (1 + 2 + 3 + 4 + 5) + sum(range(1, 21))          # 15 + 210
    slide_pairs = 15 + (sum(range(1, 10)) + 11 * 9)               # row of 20: 45 + 99
    attention = 4 * 4 * 64 * (1 * full_pairs + 2 * slide_pairs)   # QK^T and PV, 2 FLOPs each
    got = prefill_flops(cfg, [5, 20])
    assert got["matmul"] == matmul == 28626944
    assert got["attention"] == attention == 556032
    assert got["floor_ms"] == pytest.approx((matmul + attention) / PEAK_FLOPS * 1e3, rel=1e-12)


def test_cli_bench_prefill_options():
    """--prefill fills its own defaults (smoke: the scaled-down cases, 1 run); the options of the
    other benchmark are refused with a one-line error."""
    from flint_jax import bench_prefill, cli
    parser = cli.build_parser()
    a = cli.prefill_options(parser.parse_args(["bench", "--prefill", "--config", "smoke"]))
    assert (a.config, a.cases, a.reps, a.dtype) == ("smoke", ["1x64", "2x40"], 1,
                                                    ["bf16", "nvfp4"])
    a = cli.prefill_options(parser.parse_args(["bench", "--prefill", "--dtype", "bf16"]))
    assert (a.cases, a.reps, a.dtype) == (bench_prefill.DEFAULT_CASES, 3, ["bf16"])
    assert a.reference_max_tokens == 8192 == bench_prefill.DEFAULT_REFERENCE_MAX_TOKENS
    with pytest.raises(ValueError, match="--batch is an option of the decode benchmark"):
        cli.cmd_bench(parser.parse_args(["bench", "--prefill", "--batch", "8"]))
    with pytest.raises(ValueError, match="--cases is an option of --prefill"):
        cli.cmd_bench(parser.parse_args(["bench", "--cases", "1x8K"]))


def test_prefill_bench_options():
    """--option KEY=VALUE -> PrefillOptions (numbers, "x"-joined tuples, none, booleans); unknown
    fields and items without "=" are refused in one line naming them; --option reaches the
    prefill benchmark through the CLI."""
    from flint_jax import cli, prefill
    from flint_jax.bench_prefill import parse_options
    assert parse_options([]) == prefill.PrefillOptions()
    got = parse_options(["nvfp4_experts=fused", "gate_up_blocks=128x64", "block_m=64",
                         "attn_full=none", "interpret=true"])
    assert got == prefill.PrefillOptions(nvfp4_experts="fused", gate_up_blocks=(128, 64),
                                         block_m=64, attn_full=None, interpret=True)
    with pytest.raises(ValueError, match="PrefillOptions has no field 'warps'"):
        parse_options(["warps=4"])
    with pytest.raises(ValueError, match="want KEY=VALUE"):
        parse_options(["fused"])
    with pytest.raises(ValueError, match="router must be one of"):
        parse_options(["router=fast"])
    a = cli.build_parser().parse_args(["bench", "--prefill", "--option", "attention=pallas"])
    assert a.option == ["attention=pallas"]


def test_cli_bench_prefill_smoke(tmp_path):
    """`flint-jax bench --prefill --config smoke --cases 2x40` on the CPU: both formats x both
    paths on a batch of 2 x 40 tokens (one case: half the compiles of the smoke defaults; the
    prefill itself is tested in tests/test_prefill.py), and the Pallas prefill's
    last-token logits close to the XLA path's."""
    import json
    import subprocess
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "prefill.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "flint_jax.cli", "bench", "--prefill", "--config",
                          "smoke", "--cases", "2x40", "--out", str(out)], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| format | case | path |" in res.stdout
    rows = {(r["format"], r["case"], r["path"]): r for r in json.loads(out.read_text())["cases"]}
    assert set(rows) == {(f, "2x40", p) for f in ("bf16", "nvfp4") for p in ("pallas", "xla")}
    for key, r in rows.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["floor_ms"] > 0, key
        assert r["pct_of_floor"] > 0 and r["finite"], key
        assert r["tokens"] == 80, key
        if r["path"] == "pallas":
            assert r["rel_l2_vs_xla"] < 1e-2, key
            assert r["ttft_s"] > 0, key   # generate(..., return_details=True) on the same rows
        else:   # the reference against its own 512-token chunking (one chunk here: equal)
            assert 0 <= r["rel_l2_vs_chunk512"] < 1e-2, key
