"""benchmarks/host_probe.py on CPU: every part runs, and its `stable` step mode keeps the buffers
where they were (what the mode's figure is meant to isolate)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import host_probe  # noqa: E402


def test_args_and_chain_probes_time_every_setting():
    args = host_probe.args_probe([1, 8], reps=2)
    chain = host_probe.chain_probe([3], reps=2, size=64)
    assert set(args) == {"1", "8"}
    assert set(chain["3"]) == {"fixed", "chain", "donated", "kept"}
    for r in [*args.values(), *chain["3"].values()]:
        assert 0 < r["min_ms"] <= r["median_ms"]


def test_model_probe_tiny_stable_mode_keeps_addresses():
    out = host_probe.model_probe("nvfp4", batch=2, context=40, reps=2, config="tiny")
    assert set(out["step"]) == {"same", "fresh", "stable"}
    assert out["stable_kept_addresses"] is True
    # every weight array of the tiny model is one argument (its scalar tensor scales included)
    assert out["leaves"] > 100
