"""benchmarks/host_probe.py on CPU, run as a script in its own process (as on the GPU machine):
every part runs, and its `stable` step mode keeps the buffers where they were (what the mode's
figure is meant to isolate)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_probe_tiny_runs_every_part(tmp_path):
    out = tmp_path / "host.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")])}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_probe.py"),
                    "--config", "tiny", "--args", "1,8", "--kernels", "3", "--reps", "2",
                    "--batch", "2", "--context", "40", "--out", str(out)],
                   env=env, check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert set(res["args"]) == {"1", "8"}
    assert set(res["chain"]["3"]) == {"fixed", "chain", "donated", "kept"}
    for r in [*res["args"].values(), *res["chain"]["3"].values()]:
        assert 0 < r["min_ms"] <= r["median_ms"]
    model = res["model"]
    assert set(model["step"]) == {"same", "fresh", "stable"}
    assert model["stable_kept_addresses"] is True
    assert model["leaves"] > 100      # every weight array of the tiny model is one argument
