"""`flint-jax inspect`: what a checkpoint holds, and whether it matches a config.

    report = inspect("RecursiveSI/flint")                       # HF directory
    report = inspect("flint-nvfp4.gguf", config="RecursiveSI/flint")
    report = inspect("flint-jax-nvfp4")                          # converted checkpoint
    print(format_report(report)); report.ok

Lists tensors (name, dtype or GGML type, shape, bytes; per-expert HF tensors grouped), metadata
(GGUF key/values, the flint_jax manifest, safetensors metadata) and a verdict: every missing,
unexpected, mis-shaped or mis-typed tensor against the config (the directory's own config.json,
or `config=`; a GGUF file uses the config.json beside it, else needs `config=`). A file too
damaged to list (truncated, corrupt header) raises the reader's error instead
(hf_io.CheckpointError, gguf_io.GGUFError: ValueErrors).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import ml_dtypes
import numpy as np

from flint_jax.config import ConfigError, FlintConfig

_FLOATS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float16))


@dataclasses.dataclass
class TensorRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    count: int = 1  # > 1: a group of per-expert tensors ("experts.*.")


@dataclasses.dataclass
class Report:
    path: str
    kind: str  # "hf", "gguf", "flint_jax"
    tensors: list[TensorRow]
    metadata: dict[str, Any]
    config_source: str | None
    problems: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.config_source is not None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_tensors(self) -> int:
        return sum(t.count for t in self.tensors)


def _load_cfg(config: str | None, fallback_dir: str | None, notes: list[str]):
    src = config or (fallback_dir if fallback_dir and
                     os.path.exists(os.path.join(fallback_dir, "config.json")) else None)
    if src is None:
        return None, None
    try:
        return FlintConfig.from_json(src), src
    except ConfigError as e:
        notes.append(f"config not usable: {e}")
        return None, None


def _diff(present: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, tuple[int, ...]],
          where: str, cfg: FlintConfig, dtype_ok=None) -> list[str]:
    problems = []
    missing = [n for n in expected if n not in present]
    unexpected = [n for n in present if n not in expected]
    for n in missing:
        problems.append(f"missing tensor {n!r}")
    for n in unexpected:
        hint = ""
        m = re.search(r"(?:layers|blk)\.(\d+)\.", n)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            hint = f" (the config has {cfg.num_hidden_layers} layers)"
        m = re.search(r"experts\.(\d+)\.", n)
        if m and int(m.group(1)) >= cfg.num_experts:
            hint = f" (the config has {cfg.num_experts} experts)"
        if "e_score_correction_bias" in n:
            hint = " (Flint's router has no selection bias)"
        problems.append(f"unexpected tensor {n!r}{hint}")
    for n, shape in expected.items():
        if n in present:
            got, dt = present[n]
            if tuple(got) != tuple(shape):
                problems.append(f"tensor {n!r} has shape {list(got)}, expected {list(shape)}")
            elif dtype_ok is not None:
                msg = dtype_ok(n, dt)
                if msg:
                    problems.append(f"tensor {n!r} {msg}")
    return problems


# ---- HF ---------------------------------------------------------------------------------------------

def hf_expected(cfg: FlintConfig, fused: bool) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes of `cfg` (sinks as `self_attn.softmax_offset`)."""
    from flint_jax.hf_io import expected_params
    out = {}
    mi = cfg.moe_intermediate_size
    for name, shape in expected_params(cfg).items():
        if name.endswith(".self_attn.sinks"):
            out[name[: -len("sinks")] + "softmax_offset"] = shape
        elif name.endswith("experts.gate_up_proj") and not fused:
            stem = name[: -len("gate_up_proj")]
            for e in range(shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = (mi, shape[2])
                out[f"{stem}{e}.up_proj.weight"] = (mi, shape[2])
        elif name.endswith("experts.down_proj") and not fused:
            stem = name[: -len("down_proj")]
            for e in range(shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = (shape[1], mi)
        else:
            out[name] = shape
    return out


def _inspect_hf(path: str, config: str | None) -> Report:
    from flint_jax import hf_io
    ckpt = hf_io.HFCheckpoint(path)
    rows = [TensorRow(n, str(ckpt.dtype(n)), tuple(ckpt.shape(n)),
                      int(np.prod(ckpt.shape(n), dtype=np.int64)) * ckpt.dtype(n).itemsize)
            for n in ckpt.names()]
    meta: dict[str, Any] = {"files": sorted(ckpt.files)}
    first = next(iter(ckpt.files.values()))
    if first.metadata:
        meta["safetensors metadata"] = dict(first.metadata)
    notes: list[str] = []
    cfg, src = _load_cfg(config, path, notes)
    problems: list[str] = []
    if cfg is not None:
        names = ckpt.names()
        fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        present = {}
        for n in names:
            key = re.sub(r"self_attn\.sinks$", "self_attn.softmax_offset", n)
            if key in present:
                problems.append(f"tensor {n!r} duplicates {key!r} (two sink tensors)")
            present[key] = (ckpt.shape(n), str(ckpt.dtype(n)))
        notes.append(f"layout: {'fused' if fused else 'per-expert'} experts")

        def dtype_ok(n, dt):
            if np.dtype(dt) not in _FLOATS:
                return f"has dtype {dt}, expected bf16, f16 or f32"
            return None

        problems += _diff(present, hf_expected(cfg, fused), path, cfg, dtype_ok)
        if not problems:  # the loader's own validation agrees
            try:
                hf_io.plan(ckpt, cfg)
            except hf_io.CheckpointError as e:
                problems.append(str(e))
    return Report(path, "hf", _group(rows), meta, src, problems, notes)


def _group(rows: list[TensorRow]) -> list[TensorRow]:
    """Per-expert tensors `...experts.{e}.x` of one shape and dtype -> one row `...experts.*.x`."""
    out: list[TensorRow] = []
    groups: dict[tuple, TensorRow] = {}
    for r in rows:
        m = re.search(r"\.experts\.\d+\.", r.name)
        if not m:
            out.append(r)
            continue
        key = (r.name[: m.start()] + ".experts.*." + r.name[m.end():], r.dtype, r.shape)
        if key in groups:
            g = groups[key]
            g.count += 1
            g.nbytes += r.nbytes
        else:
            g = TensorRow(key[0], r.dtype, r.shape, r.nbytes, 1)
            groups[key] = g
            out.append(g)
    return out


# ---- GGUF --------------------------------------------------------------------------------------------

def _inspect_gguf(path: str, config: str | None, check_blocks: bool) -> Report:
    from flint_jax import gguf_io, nvfp4
    ck = gguf_io.open_gguf(path)
    rows = [TensorRow(n, t.tensor_type.name, tuple(int(d) for d in reversed(list(t.shape))),
                      int(t.n_bytes)) for n, t in ck.tensors.items()]
    meta = {}
    for k, v in ck.metadata.items():
        if isinstance(v, list) and len(v) > 16:
            v = f"[{len(v)} items: {', '.join(map(str, v[:8]))}, ...]"
        elif isinstance(v, str) and len(v) > 200:
            v = v[:200] + "..."
        meta[k] = v
    notes: list[str] = []
    types = {}
    for t in ck.tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    notes.append("tensor types: " + ", ".join(f"{k} x{v}" for k, v in sorted(types.items())))
    kinds = [c[1] for c in map(gguf_io.companion_of, ck.tensors) if c]
    if kinds:
        notes.append(f"NVFP4 tensor scales: {kinds.count('scale')} named X.scale"
                     + (f", {kinds.count('legacy_scale')} with flint_jax 0.1's names X.weight.scale"
                        if "legacy_scale" in kinds else "")
                     + (f"; {kinds.count('input_scale')} activation scales X.input_scale (unused: "
                        "W4A16)" if "input_scale" in kinds else ""))
    from flint_jax.gguf_io import find_gguf_config
    cfg, src = _load_cfg(config, find_gguf_config(path) if config is None else None, notes)
    problems: list[str] = []
    if cfg is None:
        notes.append("no config.json beside the file nor given: pass --config DIR (the BF16 repo "
                     "with config.json) to check names and shapes")
    else:
        weights = ck.weights
        present = {n: (tuple(int(d) for d in reversed(list(t.shape))), t.tensor_type.name)
                   for n, t in weights.items()}

        def dtype_ok(n, dt):
            if dt == "NVFP4" and not gguf_io.may_be_nvfp4(n):
                return "is NVFP4; embeddings, router, norms and sinks must be BF16/F32"
            return None

        problems += _diff(present, gguf_io.gguf_expected(cfg), path, cfg, dtype_ok)
        lin = [n for n in weights if gguf_io.may_be_nvfp4(n)]
        nv = [n for n in lin if weights[n].tensor_type == gguf_io.NVFP4]
        if nv and len(nv) != len(lin):
            notes.append(f"mixed linear formats: {len(nv)} NVFP4, {len(lin) - len(nv)} BF16/F32 "
                         "(convert needs --mixed quantize|dequantize)")
    if check_blocks:
        for n, t in ck.tensors.items():
            if t.tensor_type == gguf_io.NVFP4:
                try:
                    nvfp4.validate_gguf_blocks(gguf_io.read_gguf_tensor(ck, n), n)
                except ValueError as e:
                    problems.append(str(e))
        notes.append("NVFP4 block scales checked (no 0xFF)" if not problems else
                     "NVFP4 block scales checked")
    return Report(path, "gguf", rows, meta, src, problems, notes)


# ---- converted ---------------------------------------------------------------------------------------

def _inspect_converted(path: str, config: str | None) -> Report:
    from flint_jax import checkpoint, loading
    manifest = checkpoint.read_manifest(path)
    stored = checkpoint.params_metadata(os.path.join(path, checkpoint.PARAMS_DIR))
    rows = [TensorRow(n, str(dt), tuple(s), int(np.prod(s, dtype=np.int64)) * np.dtype(dt).itemsize)
            for n, (s, dt) in sorted(stored.items(), key=lambda kv: _natural(kv[0]))]
    notes: list[str] = []
    cfg, src = _load_cfg(config, path, notes)
    problems: list[str] = []
    if cfg is not None:
        quant = bool(manifest.get("quant"))
        want = loading.expected_leaves(cfg, quant)
        present = {n: (s, str(dt)) for n, (s, dt) in stored.items()}

        def dtype_ok(n, dt):
            w = want[n][1]
            if n.endswith(("qweight", "weight_scale")):
                return None if np.dtype(dt) == w else f"has dtype {dt}, expected {w}"
            return None if np.dtype(dt) in _FLOATS else f"has dtype {dt}, expected a float"

        problems += _diff(present, {n: s for n, (s, _) in want.items()}, path, cfg, dtype_ok)
    return Report(path, "flint_jax", rows, manifest, src, problems, notes)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def inspect(path: str | os.PathLike, config: str | None = None, *,
            check_blocks: bool = False) -> Report:
    """Inspects a HF directory, a GGUF file or a converted flint_jax checkpoint."""
    from flint_jax import checkpoint, gguf_io
    path = os.fspath(path)
    if os.path.isfile(path):
        if gguf_io.is_gguf(path):
            return _inspect_gguf(path, config, check_blocks)
        if path.endswith(".safetensors"):
            raise ValueError(f"{path}: give the checkpoint directory, not one safetensors file")
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    if checkpoint.is_converted(path):
        return _inspect_converted(path, config)
    return _inspect_hf(path, config)


def _human(n: float) -> str:
    from flint_jax.config import human_bytes
    return human_bytes(n)


def format_report(r: Report, max_tensors: int | None = 80) -> str:
    """A human-readable report; `max_tensors=None` lists every row."""
    kinds = {"hf": "HF safetensors checkpoint", "gguf": "GGUF file",
             "flint_jax": "flint_jax checkpoint (orbax)"}
    lines = [f"{r.path}: {kinds[r.kind]}, {r.n_tensors} tensors, {_human(r.nbytes)}"]
    if r.metadata:
        lines.append("metadata:")
        for k, v in r.metadata.items():
            lines.append(f"  {k}: {v}")
    lines.append("tensors:")
    width = min(64, max((len(t.name) for t in r.tensors), default=10))
    shown = r.tensors if max_tensors is None else r.tensors[:max_tensors]
    for t in shown:
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        count = f" x{t.count}" if t.count > 1 else ""
        lines.append(f"  {t.name:{width}s} {t.dtype:14s} {shape:20s} {_human(t.nbytes):>10s}{count}")
    if len(shown) < len(r.tensors):
        lines.append(f"  ... {len(r.tensors) - len(shown)} more rows (--all lists them)")
    for n in r.notes:
        lines.append(f"note: {n}")
    if r.config_source is None:
        lines.append("verdict: NOT CHECKED (no config: pass --config DIR)")
    elif not r.problems:
        lines.append(f"verdict: OK: matches the config in {r.config_source}")
    else:
        lines.append(f"verdict: INVALID against the config in {r.config_source}: "
                     f"{len(r.problems)} problem(s)")
        for p in r.problems[:40]:
            lines.append(f"  - {p}")
        if len(r.problems) > 40:
            lines.append(f"  ... and {len(r.problems) - 40} more")
    return "\n".join(lines)


__all__ = ["Report", "TensorRow", "format_report", "hf_expected", "inspect"]
