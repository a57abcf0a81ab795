"""The full-size GPU suite for one weight format, in one process (weights built once):

1. parity: Pallas path vs XLA path from copies of one prefilled cache, greedy for `--parity-steps`
   steps (logits' relative L2 error per step while the inputs agree; identical tokens?), the
   XLA path against itself (row 0 alone: other GEMM shapes, so another summation order), then
   teacher-forced (both paths fed the XLA path's greedy tokens: relative L2 and argmax agreement
   at every step, which a single early near-tie cannot end);
2. bench: decode ms/step of both paths (median of windows of back-to-back steps), tokens/s,
   percent of the HBM floor, kernels per step from a profiler trace, for each (batch, context);
3. prefill (time to first token): `--prefill-cases` (default 1x8K 8x2K) through the Pallas
   prefill kernels, ms, tokens/s and percent of the compute floor, beside the XLA path (when
   `--paths` has it) on cases of at most 8,192 tokens (`flint_jax.bench_prefill.run_case`).

Results are rewritten to `--out` after every case, so a run cut short still reports what it
measured; `--budget-s` stops starting new cases past that many seconds.

    python benchmarks/gpu_suite.py --format bf16 --out $OUT/bf16.json
    python benchmarks/gpu_suite.py --format nvfp4 --paths pallas --option early_trigger=true ...

`--paths` chooses between the reference (xla) and the plan (pallas); `--option KEY=VALUE`
(repeatable) changes the plan, as for `flint-jax bench` (``flint_jax.bench.parse_options``).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax import bench, bench_prefill
from flint_jax.config import preset
from flint_jax.decode import prefill
from flint_jax.decode import Flint


def copy_tree(tree):
    """A fresh copy of every array (the decode steps donate their cache)."""
    return jax.tree.map(jnp.copy, tree)


def choice_gap(a, b):
    """For logits a (reference path) and b [B, V]: None if every row's argmax agrees, else for
    the first row where they differ, each path's logit margin between its own choice and the
    other's, with the row's largest |logit| and largest |a - b| for scale."""
    diff = np.flatnonzero(a.argmax(-1) != b.argmax(-1))
    if not diff.size:
        return None
    r = int(diff[0])
    ia, ib = int(a[r].argmax()), int(b[r].argmax())
    return {"row": r, "ref_margin": float(a[r, ia] - a[r, ib]),
            "pallas_margin": float(b[r, ib] - b[r, ia]),
            "logit_scale": float(np.abs(a[r]).max()),
            "max_abs_diff": float(np.abs(a[r] - b[r]).max())}


def parity(cfg, graphdef, state, quant, steps, batch=2, prompt_len=600, options=()):
    xla = bench.make_handle(cfg, graphdef, state, quant, "xla", options)
    pal = bench.make_handle(cfg, graphdef, state, quant, "pallas", options)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, size=prompt_len - 37 * i).tolist() for i in range(batch)]
    # One prefill, copied for each path and loop: XLA's GPU prefill is not bit-reproducible
    # by default (run 181: two prefills' caches differ by up to 0.30, their logits by rel-L2
    # 1.7e-2, as much as the paths differ), while each decode step is.
    logits, cache0 = prefill(xla, rows, cache_length=1024)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    cache_x, cache_p = copy_tree(cache0), copy_tree(cache0)
    fx, fp = xla.decode_logits_fn(), pal.decode_logits_fn()
    tx = tp = first
    toks_x, toks_p, errs = [np.asarray(first)], [np.asarray(first)], []
    ref_logits_x = []   # the XLA path's greedy logits, for the self-check below
    near_tie = None   # at the first divergence: how close the two paths' choices were
    for _ in range(steps):
        lx, cache_x = fx(xla.leaves, cache_x, tx)
        lp, cache_p = fp(pal.leaves, cache_p, tp)
        a, b = np.asarray(lx, np.float32), np.asarray(lp, np.float32)
        ref_logits_x.append(a)
        if np.array_equal(np.asarray(tx), np.asarray(tp)):
            errs.append(bench.rel_l2(a, b))
            near_tie = near_tie or choice_gap(a, b)
        tx, tp = jnp.argmax(lx, -1).astype(jnp.int32), jnp.argmax(lp, -1).astype(jnp.int32)
        toks_x.append(np.asarray(tx))
        toks_p.append(np.asarray(tp))
    same = [bool(np.array_equal(x, p)) for x, p in zip(toks_x, toks_p)]
    # The reference against itself: row 0 decoded alone (batch 1) by the XLA path. Its GEMMs
    # have another shape, so only the summation order differs: how soon two correct
    # implementations part on these random weights, the yardstick for the Pallas path's result.
    self_check = None
    if batch > 1:
        _, cache_1 = prefill(xla, rows[:1], cache_length=1024)
        cache_1tf = copy_tree(cache_1)
        t1, toks_1, errs_1, tie_1 = first[:1], [np.asarray(first[:1])], [], None
        tx0 = [t[:1] for t in toks_x]
        for i in range(steps):
            l1, cache_1 = fx(xla.leaves, cache_1, t1)
            a1 = np.asarray(l1, np.float32)
            if np.array_equal(np.asarray(t1), tx0[i]):
                ref_row = ref_logits_x[i][:1]
                errs_1.append(bench.rel_l2(ref_row, a1))
                tie_1 = tie_1 or choice_gap(ref_row, a1)
            t1 = jnp.argmax(l1, -1).astype(jnp.int32)
            toks_1.append(np.asarray(t1))
        same_1 = [bool(np.array_equal(x, y)) for x, y in zip(tx0, toks_1)]
        # Teacher-forced as well (fed the batch's greedy tokens of row 0): how often two
        # correct implementations pick the same token, the yardstick for the Pallas path's
        # teacher-forced agreement below.
        agree_1 = []
        for i in range(steps):
            l1, cache_1tf = fx(xla.leaves, cache_1tf, jnp.asarray(tx0[i]))
            agree_1.append(float(np.asarray(l1, np.float32)[0].argmax()
                                 == ref_logits_x[i][0].argmax()))
        self_check = {"tokens_identical": all(same_1),
                      "teacher_forced_argmax_agreement": float(np.mean(agree_1)),
                      "first_divergence": None if all(same_1) else same_1.index(False),
                      "first_divergence_near_tie": tie_1,
                      "rel_l2_median": float(np.median(errs_1)) if errs_1 else None}
    # Teacher forcing: both paths get the XLA path's tokens.
    cache_x, cache_p = copy_tree(cache0), copy_tree(cache0)
    tf_errs, tf_agree, tf_ties = [], [], []
    t = first
    for _ in range(steps):
        lx, cache_x = fx(xla.leaves, cache_x, t)
        lp, cache_p = fp(pal.leaves, cache_p, t)
        a, b = np.asarray(lx, np.float32), np.asarray(lp, np.float32)
        tf_errs.append(bench.rel_l2(a, b))
        tf_agree.append(float(np.mean(a.argmax(-1) == b.argmax(-1))))
        gap = choice_gap(a, b)
        if gap is not None:   # how close the reference's own choice was where they differ
            tf_ties.append({"step": len(tf_errs) - 1, **gap})
        t = jnp.argmax(lx, -1).astype(jnp.int32)
    return {"teacher_forced_rel_l2_median": float(np.median(tf_errs)),
            "teacher_forced_rel_l2_max": max(tf_errs),
            "teacher_forced_argmax_agreement": float(np.mean(tf_agree)),
            "teacher_forced_disagreements": tf_ties,
            "teacher_forced_rel_l2_per_step": tf_errs,
            "options": list(options), "batch": batch, "prompt_lens": [len(r) for r in rows], "steps": steps,
            "tokens_identical": all(same),
            "first_divergence": None if all(same) else same.index(False),
            # The two tokens' logit gap in each path where they first chose differently,
            # against the largest logit difference between the paths on that row.
            "first_divergence_near_tie": near_tie,
            "xla_batch1_vs_batch": self_check,
            "rel_l2_max": max(errs), "rel_l2_median": float(np.median(errs)),
            "rel_l2_per_step": errs}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--format", choices=["bf16", "nvfp4"], required=True)
    ap.add_argument("--config", default="flint")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--parity-steps", type=int, default=32)
    ap.add_argument("--parity-batch", type=int, default=2)
    ap.add_argument("--cases", default="1x1024,8x1024,1x100000,8x100000,1x8192,8x8192",
                    help="comma-separated BATCHxCONTEXT, in order")
    ap.add_argument("--paths", default="xla,pallas",
                    help="paths every case runs (xla = the reference path, pallas = the plan, "
                         "changed by --option); drop xla for a quick diagnostic run")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="change the Pallas plan (repeatable): DecodePlan fields, "
                         "moe.<MoEPlan field>, scales=e4m3, routing=fixed "
                         "(flint_jax.bench.parse_options)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timing window")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--prefill-cases", nargs="*", default=["1x8K", "8x2K"], metavar="CASE",
                    help="prefill cases after the decode cases (flint_jax.bench_prefill: BxN, "
                         "K = 1024, e.g. 1x32K); none given: no prefill stage")
    ap.add_argument("--budget-s", type=float, default=470)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    bench.parse_options(a.option)   # a bad option fails before the weights are built
    for case in a.prefill_cases:
        bench_prefill.parse_case(case)
    if not set(a.paths.split(",")) <= {"xla", "pallas"}:
        ap.error("--paths: xla, pallas or xla,pallas (variants: --option KEY=VALUE)")
    t_start = time.perf_counter()
    cfg = preset(a.config)
    if a.layers:
        cfg = cfg.replace(num_hidden_layers=a.layers)
    quant = a.format == "nvfp4"
    res = {"device": jax.devices()[0].device_kind, "format": a.format,
           "layers": cfg.num_hidden_layers, "options": a.option, "timeline": {}, "cases": []}

    def save():
        res["timeline"]["elapsed_s"] = time.perf_counter() - t_start
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    graphdef, state = bench.build_state(cfg, quant)
    jax.block_until_ready(state)
    res["timeline"]["weights_built_s"] = time.perf_counter() - t_start
    print(f"[{a.format}] weights built in {res['timeline']['weights_built_s']:.1f} s", flush=True)
    save()
    if a.parity_steps:
        t0 = time.perf_counter()
        try:
            res["parity"] = parity(cfg, graphdef, state, quant, a.parity_steps,
                                   batch=a.parity_batch, options=a.option)
        except Exception as e:  # noqa: BLE001 (report, then run the benchmark cases)
            res["parity"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        res["timeline"]["parity_s"] = time.perf_counter() - t0
        p = res["parity"]
        if "error" in p:
            print(f"[{a.format}] parity FAILED: {p['error'][:500]}", flush=True)
            save()
    if a.parity_steps and "error" not in p:
        print(f"[{a.format}] parity (pallas{''.join(' ' + o for o in p['options'])}, batch {p['batch']}): tokens identical over {p['steps']} steps: "
              f"{p['tokens_identical']} (first divergence {p['first_divergence']}, "
              f"{p['first_divergence_near_tie']}); logits rel-L2 "
              f"max {p['rel_l2_max']:.2e} median {p['rel_l2_median']:.2e}; teacher-forced: "
              f"argmax agreement {p['teacher_forced_argmax_agreement']:.3f}, rel-L2 median "
              f"{p['teacher_forced_rel_l2_median']:.2e} max {p['teacher_forced_rel_l2_max']:.2e} "
              f"({res['timeline']['parity_s']:.0f} s); the XLA path against itself at batch 1: "
              f"{p['xla_batch1_vs_batch']}", flush=True)
        save()
    for case in a.cases.split(","):
        if time.perf_counter() - t_start > a.budget_s:
            print(f"[{a.format}] budget reached: skipping {case} and later cases", flush=True)
            res.setdefault("skipped", []).append(case)
            continue
        batch, context = (int(v) for v in case.split("x"))
        t0 = time.perf_counter()
        paths = a.paths.split(",")
        row = bench.run_case(cfg, graphdef, state, quant, batch, context, paths,
                                    a.steps, a.trace, options=a.option)
        row["case_s"] = time.perf_counter() - t0
        res["cases"].append(row)
        print(bench.format_row(row, paths) + f" [{row['case_s']:.0f} s]", flush=True)
        save()
    print(bench.table(res["cases"], a.paths.split(",")))
    save()
    if a.prefill_cases:
        prefill_stage(a, res, bench_prefill.model_handle(cfg, graphdef, state, quant), t_start,
                      save)


def prefill_stage(a, res, model, t_start, save):
    """The prefill cases (3 timed runs each), results into ``res["prefill"]``; the XLA path
    beside them when ``--paths`` has it."""
    ref_max = bench_prefill.DEFAULT_REFERENCE_MAX_TOKENS if "xla" in a.paths.split(",") else 0
    res["prefill"] = []
    for case in a.prefill_cases:
        if time.perf_counter() - t_start > a.budget_s:
            print(f"[{a.format}] budget reached: skipping prefill {case}", flush=True)
            res.setdefault("skipped", []).append(f"prefill {case}")
            continue
        res["prefill"] += bench_prefill.run_case(model, case, 3, ref_max)
        save()
    print(bench_prefill.table(res["prefill"]))


if __name__ == "__main__":
    main()
