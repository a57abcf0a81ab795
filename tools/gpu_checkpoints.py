"""Checkpoint pipeline at full scale on the H200 machine (entry of tools/gpu_checkpoints.sh).

    python3 tools/gpu_checkpoints.py run --mode nvfp4          # 1 GPU: 49-layer NVFP4 GGUF
    python3 tools/gpu_checkpoints.py run --mode bf16 --bf16-layers 12
    python3 tools/gpu_checkpoints.py run --mode sharded        # 2 GPUs: sharded == single
    JAX_PLATFORMS=cpu python3 tools/gpu_checkpoints.py run --mode all --config tiny   # local check

Each stage runs in its own child process (synth, convert, load + generate), so its peak host
memory (VmHWM and getrusage max RSS, reported by the child itself) and wall time are its own.
Results go to $OUT/checkpoints.json (rewritten after every stage, so a run cut short still
reports what it finished). Disk: sources are deleted once converted unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- helpers ------------------------------------------------------------------------------------

def host_peak() -> dict:
    """This process's peak host memory: VmHWM (Linux) and getrusage max RSS, in bytes."""
    out = {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    k, v = line.split(":")
                    out[k.strip()] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def gib(n) -> float:
    return round(n / 2**30, 3)


class Results:
    def __init__(self, out_dir: str, meta: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "checkpoints.json")
        self.data = {"meta": meta, "stages": []}
        self.save()

    def add(self, stage: dict):
        self.data["stages"].append(stage)
        self.save()
        print(json.dumps(stage, default=str), flush=True)

    def save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)


def child(args: list[str], env_extra: dict | None = None, timeout: int = 3000) -> dict:
    """Runs a phase of this script in a child process; returns its JSON report + wall time."""
    report = _report_path()
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "phase", *args,
                        "--report", report], env=env, timeout=timeout)
    wall = time.time() - t0
    data = {}
    if os.path.exists(report):
        with open(report) as f:
            data = json.load(f)
        os.unlink(report)
    data["wall_s"] = round(wall, 2)
    data["returncode"] = r.returncode
    return data


def _report_path() -> str:
    import tempfile
    fd, p = tempfile.mkstemp(prefix="gpu_ckpt_", suffix=".json")
    os.close(fd)
    os.unlink(p)
    return p


# ---- phases (each in its own process) ---------------------------------------------------------------

def phase_synth(a) -> dict:
    from flint_jax import synth
    cfg = synth.resolve_config(a.config, layers=a.layers)
    t0 = time.time()
    info = synth.synth(a.path, fmt=a.format, config=cfg, seed=a.seed, workers=a.workers,
                       overwrite=True, progress=False)
    return {"seconds": round(time.time() - t0, 2), "path": info["path"], "bytes": du(a.path),
            "tensors": info["tensors"], "layers": cfg.num_hidden_layers,
            "params_total": cfg.param_count()["total"]}


def phase_convert(a) -> dict:
    from flint_jax import checkpoint, convert
    t0 = time.time()
    convert.convert(a.src, a.path, hf_config=a.hf_config, overwrite=True, progress=False,
                    workers=a.workers)
    sec = time.time() - t0
    m = checkpoint.read_manifest(a.path)
    return {"seconds": round(sec, 2), "bytes": du(a.path), "num_params": m["num_params"],
            "quant": m["quant"], "GB_per_s": round(m["nbytes"] / 1e9 / max(sec, 1e-9), 3)}


def phase_load(a) -> dict:
    import jax
    import numpy as np
    import flint_jax
    t0 = time.time()
    model = flint_jax.load(a.path, kernels="xla", hf_config=a.hf_config,
                           max_length=a.prompt_len + a.new_tokens + 64)
    jax.block_until_ready(jax.tree.leaves(model.state))
    load_s = time.time() - t0
    after_load = {k: gib(v) for k, v in host_peak().items()}  # before any XLA compilation
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, (1, a.prompt_len)).tolist()
    t1 = time.time()
    g1 = flint_jax.generate(model, prompt, max_new_tokens=a.new_tokens, temperature=0.0)
    first_s = time.time() - t1
    t2 = time.time()
    g2 = flint_jax.generate(model, prompt, max_new_tokens=a.new_tokens, temperature=0.0)
    second_s = time.time() - t2
    toks = [int(t) for t in g1[0]]
    return {"load_s": round(load_s, 2), "host_peak_after_load_gib": after_load,
            "device": str(dev), "quant": model.quant,
            "device_bytes_in_use": stats.get("bytes_in_use"),
            "device_peak_bytes": stats.get("peak_bytes_in_use"),
            "generate_first_s (compile included)": round(first_s, 2),
            "generate_second_s": round(second_s, 2),
            "ms_per_token_second_run": round(1000 * second_s / a.new_tokens, 2),
            "tokens": toks, "deterministic": toks == [int(t) for t in g2[0]]}


def phase_sharded(a) -> dict:
    """Restore the same checkpoint on 1 device and sharded over 2; compare logits, per-layer
    hidden states and the routed expert sets (a near-tie flip of one expert explains a large
    logit difference; the per-layer figures show where differences start)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    import flint_jax
    devs = jax.devices()
    if len(devs) < 2:
        raise SystemExit(f"sharded mode needs 2 devices, found {len(devs)}")
    rng = np.random.default_rng(1)
    out = {"devices": [str(d) for d in devs[:2]]}
    mesh = Mesh(np.array(devs[:2]), ("model",))
    cap = ("hidden_states", "router_ids")
    # fp32 with "highest" matmul precision (no TF32), then the checkpoint's own bf16.
    for dtype, prec in (("float32", "highest"), ("bfloat16", "default")):
        with jax.default_matmul_precision(prec):
            one = flint_jax.load(a.path, dtype=dtype, kernels="xla", max_length=256)
            ids = rng.integers(0, one.config.vocab_size, (2, 32))
            t0 = time.time()
            l1, c1 = flint_jax.forward(one, ids, capture=cap)
            l1 = np.asarray(l1, np.float32)
            t_one = time.time() - t0
            g1 = flint_jax.generate(one, ids[:, :8].tolist(), max_new_tokens=8, temperature=0.0)
            c1 = {k: np.asarray(v, np.float32 if k == "hidden_states" else np.int32)
                  for k, v in c1.items()}
            del one
            t0 = time.time()
            sh = flint_jax.load(a.path, dtype=dtype, kernels="xla", mesh=mesh, max_length=256)
            jax.block_until_ready(jax.tree.leaves(sh.state))
            load_s = time.time() - t0
            split = sum(1 for x in jax.tree.leaves(sh.state)
                        if any(s is not None for s in getattr(x.sharding, "spec", ())))
            per_dev = [d.memory_stats().get("bytes_in_use") if d.memory_stats() else None
                       for d in devs[:2]]
            l2, c2 = flint_jax.forward(sh, ids, capture=cap)
            l2 = np.asarray(l2, np.float32)
            g2 = flint_jax.generate(sh, ids[:, :8].tolist(), max_new_tokens=8, temperature=0.0)
            c2 = {k: np.asarray(v, np.float32 if k == "hidden_states" else np.int32)
                  for k, v in c2.items()}
            del sh
        diff = float(np.abs(l1 - l2).max())
        h1, h2 = c1["hidden_states"], c2["hidden_states"]
        hid = [float(np.abs(h1[i] - h2[i]).max() / max(np.abs(h1[i]).max(), 1e-30))
               for i in range(h1.shape[0])]
        r1, r2 = np.sort(c1["router_ids"], -1), np.sort(c2["router_ids"], -1)
        same_sets = (r1 == r2).all(-1)                                 # [L_moe, B, T]
        out[dtype] = {"matmul_precision": prec, "max_abs_diff": diff,
                      "rel_diff": diff / float(np.abs(l1).max()),
                      "bit_identical": bool((l1 == l2).all()),
                      "argmax_agreement": float((l1.argmax(-1) == l2.argmax(-1)).mean()),
                      "hidden_rel_diff_per_layer (embeddings, then each layer's output)": hid,
                      "routed_sets_equal_per_moe_layer": [float(x.mean()) for x in same_sets],
                      "tokens_with_any_routing_difference": int((~same_sets).any(0).sum()),
                      "tokens": int(np.prod(ids.shape)),
                      "sharded_leaves": split, "sharded_load_s": round(load_s, 2),
                      "bytes_in_use_per_device": per_dev, "forward_one_s": round(t_one, 2),
                      "greedy_equal": [list(map(int, x)) for x in g1] == [list(map(int, x)) for x in g2]}
    return out


PHASES = {"synth": phase_synth, "convert": phase_convert, "load": phase_load,
          "sharded": phase_sharded}


def run_phase(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name", choices=sorted(PHASES))
    p.add_argument("--report", required=True)
    p.add_argument("--path")
    p.add_argument("--src")
    p.add_argument("--hf-config")
    p.add_argument("--format", default="gguf")
    p.add_argument("--config", default="flint")
    p.add_argument("--layers", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(16, os.cpu_count() or 1)))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    a = p.parse_args(argv)
    data = PHASES[a.name](a)
    data["host_peak"] = {k: gib(v) for k, v in host_peak().items()}
    with open(a.report, "w") as f:
        json.dump(data, f, default=str)
    return 0


# ---- the orchestrator ---------------------------------------------------------------------------------

def run_pipeline(a, res: Results, fmt: str, layers: int | None, tag: str) -> None:
    src = os.path.join(a.workdir, f"{tag}-src")
    dst = os.path.join(a.workdir, f"{tag}-flint-jax")
    for p in (src, dst):
        shutil.rmtree(p, ignore_errors=True)
    common = ["--workers", str(a.workers)]
    s = child(["synth", "--path", src, "--format", fmt, "--config", a.config, "--seed", "0",
               *(["--layers", str(layers)] if layers else []), *common])
    res.add({"stage": f"{tag}: synth {fmt}", "disk_free_gib": gib(disk_free(a.workdir)), **s})
    if s["returncode"]:
        return
    hf_config = src if fmt == "gguf" else None
    c = child(["convert", "--src", s["path"], "--path", dst, *common,
               *(["--hf-config", hf_config] if hf_config else [])])
    res.add({"stage": f"{tag}: convert", "disk_free_gib": gib(disk_free(a.workdir)), **c})
    if c["returncode"]:
        return
    if not a.keep:
        shutil.rmtree(src, ignore_errors=True)
    ld = child(["load", "--path", dst, "--new-tokens", str(a.new_tokens)])
    res.add({"stage": f"{tag}: load + generate {a.new_tokens} tokens (kernels=xla)", **ld})
    if not a.keep:
        shutil.rmtree(dst, ignore_errors=True)


def run_sharded(a, res: Results) -> None:
    src = os.path.join(a.workdir, "sharded-src")
    dst = os.path.join(a.workdir, "sharded-flint-jax")
    for p in (src, dst):
        shutil.rmtree(p, ignore_errors=True)
    env = {}
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":  # local check: 2 fake devices
        env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=2").strip()
    layers = a.sharded_layers if a.config == "flint" else None
    common = ["--workers", str(a.workers)]
    s = child(["synth", "--path", src, "--format", "hf", "--config", a.config,
               *(["--layers", str(layers)] if layers else []), *common])
    res.add({"stage": "sharded: synth hf", **s})
    c = child(["convert", "--src", s["path"], "--path", dst, *common])
    res.add({"stage": "sharded: convert", **c})
    if not a.keep:
        shutil.rmtree(src, ignore_errors=True)
    r = child(["sharded", "--path", dst], env)
    res.add({"stage": "sharded: restore on 1 and on 2 devices, logits compared", **r})
    if not a.keep:
        shutil.rmtree(dst, ignore_errors=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "phase":
        return run_phase(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["run"])
    p.add_argument("--mode", default="nvfp4",
                   help="nvfp4, bf16, sharded, all, or a comma-separated list (bf16,sharded)")
    p.add_argument("--config", default="flint", help="flint (full size) or a tiny preset")
    p.add_argument("--bf16-layers", type=int, default=12,
                   help="full-size BF16 layers (each MoE layer ~1.6 GB, twice on disk)")
    p.add_argument("--sharded-layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/flint_ckpt")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/flint_ckpt_out")
    p.add_argument("--workers", type=int, default=max(1, min(16, os.cpu_count() or 1)))
    p.add_argument("--keep", action="store_true", help="keep sources and conversions")
    a = p.parse_args(argv)
    modes = {"nvfp4", "bf16", "sharded"} if a.mode == "all" else set(a.mode.split(","))
    if not modes or not modes <= {"nvfp4", "bf16", "sharded"}:
        p.error(f"--mode: expected nvfp4, bf16, sharded, all or a comma-separated list, got {a.mode!r}")
    os.makedirs(a.workdir, exist_ok=True)
    import platform
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "mode": a.mode, "config": a.config,
            "disk_free_gib": gib(disk_free(a.workdir)), "python": sys.version.split()[0],
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import jax
        import orbax.checkpoint
        meta.update(jax=jax.__version__, orbax=getattr(orbax.checkpoint, "__version__", "?"),
                    devices=[str(d) for d in jax.devices()])
        with open("/proc/meminfo") as f:
            meta["host_mem_gib"] = gib(int(f.readline().split()[1]) * 1024)
    except Exception as e:  # the report still says what was seen
        meta["env_error"] = repr(e)
    res = Results(a.out, meta)
    t0 = time.time()
    if "nvfp4" in modes:
        run_pipeline(a, res, "gguf", None, "nvfp4")
    if "bf16" in modes:
        run_pipeline(a, res, "hf", a.bf16_layers if a.config == "flint" else None, "bf16")
    if "sharded" in modes:
        run_sharded(a, res)
    res.data["meta"]["total_s"] = round(time.time() - t0, 1)
    res.save()
    bad = [s["stage"] for s in res.data["stages"] if s.get("returncode")]
    print(f"wrote {res.path}" + (f"; FAILED stages: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
