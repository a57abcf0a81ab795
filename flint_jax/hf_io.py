"""HF safetensors checkpoints of Flint: reading, name mapping and validation.

Accepts a single `model.safetensors` or shards with `model.safetensors.index.json`, per-expert
(`mlp.experts.{e}.gate_proj.weight`, ...) or fused (`mlp.experts.gate_up_proj`) expert tensors,
and sinks named `self_attn.softmax_offset` (canonical) or `self_attn.sinks` (transformers'
in-memory name). Safetensors files are parsed here (header + memmap), so a truncated or corrupt
file is reported with its name and the tensor concerned, and nothing is read before it is needed.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from flint_jax.config import FlintConfig


class CheckpointError(ValueError):
    """A checkpoint flint_jax refuses; the message names the file and tensor."""


_ST_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


# ---- safetensors files ----------------------------------------------------------------------

class SafetensorsFile:
    """One safetensors file: header parsed at open, tensors memory-mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8 or n > 100 * 2**20:
                    raise CheckpointError(f"{path}: corrupt safetensors header (header length {n} "
                                          f"for a file of {size} bytes)")
                header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.entries: dict[str, dict[str, Any]] = {}
        for name, e in header.items():
            try:
                dtype = _ST_DTYPES[e["dtype"]]
                shape = tuple(int(x) for x in e["shape"])
                start, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {e!r}") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if end - start != nbytes:
                raise CheckpointError(f"{path}: tensor {name!r}: {end - start} bytes stored for shape "
                                      f"{list(shape)} {e['dtype']}")
            if self.data_start + end > size:
                raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte "
                                      f"{self.data_start + end} but the file has {size}")
            self.entries[name] = {"dtype": dtype, "shape": shape, "offset": self.data_start + start}

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if not e["shape"] or 0 in e["shape"]:
            return np.zeros(e["shape"], e["dtype"])
        return np.memmap(self.path, dtype=e["dtype"], mode="r", offset=e["offset"], shape=e["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """Writes a safetensors file (used by `synth` and tests)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


class HFCheckpoint:
    """All tensors of a HF directory, by name, across shards."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            for name, shard in weight_map.items():
                if shard not in self.files:
                    p = os.path.join(directory, shard)
                    if not os.path.exists(p):
                        raise CheckpointError(f"{index}: shard {shard!r} (holding {name!r}) is missing")
                    self.files[shard] = SafetensorsFile(p)
                if name not in self.files[shard].entries:
                    raise CheckpointError(f"{os.path.join(directory, shard)}: tensor {name!r} listed "
                                          "in the index is not in the shard")
                self.where[name] = shard
        elif os.path.exists(single):
            self.files["model.safetensors"] = SafetensorsFile(single)
            self.where = {n: "model.safetensors" for n in self.files["model.safetensors"].entries}
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or "
                                  "model.safetensors.index.json found")

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].entries[name]["shape"]

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.files[self.where[name]].entries[name]["dtype"])

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].get(name)

    def path_of(self, name: str) -> str:
        return os.path.join(self.directory, self.where[name])


# ---- the name map ---------------------------------------------------------------------------

def expected_params(cfg: FlintConfig) -> dict[str, tuple[int, ...]]:
    """flint_jax parameter names (dotted NNX paths) and shapes of a BF16 model."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, mi, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,),
           "lm_head.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "self_attn.sinks": (h,),
        })
        if cfg.is_moe(i):
            out.update({
                p + "mlp.gate.weight": (e, d),
                p + "mlp.experts.gate_up_proj": (e, 2 * mi, d),
                p + "mlp.experts.down_proj": (e, d, mi),
                p + "mlp.shared_expert.gate_proj.weight": (si, d),
                p + "mlp.shared_expert.up_proj.weight": (si, d),
                p + "mlp.shared_expert.down_proj.weight": (d, si),
            })
        else:
            it = cfg.intermediate_size
            out.update({p + "mlp.gate_proj.weight": (it, d), p + "mlp.up_proj.weight": (it, d),
                        p + "mlp.down_proj.weight": (d, it)})
    return out


_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_SINK_RE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(softmax_offset|sinks)$")


def plan(ckpt: HFCheckpoint, cfg: FlintConfig) -> dict[str, list[tuple[str, Any]]]:
    """Maps every flint_jax parameter to its source tensor(s) and validates the whole checkpoint.

    Returns {param name: [(hf name, role)]}: role None (as is), ("expert", e, part) for stacked
    per-expert tensors. Raises CheckpointError naming the first missing, unexpected or mis-shaped
    tensor.
    """
    expected = expected_params(cfg)
    sources: dict[str, list[tuple[str, Any]]] = {k: [] for k in expected}
    for name in ckpt.names():
        m = _EXPERT_RE.match(name)
        s = _SINK_RE.match(name)
        if m:
            stem, e, part = m.group(1), int(m.group(2)), m.group(3)
            target = stem + (".down_proj" if part == "down" else ".gate_up_proj")
            if target not in sources or not 0 <= e < cfg.num_experts:
                raise CheckpointError(f"{ckpt.path_of(name)}: unexpected tensor {name!r} (the config "
                                      f"has {cfg.num_experts} experts and MoE layers "
                                      f"{list(cfg.moe_layers)})")
            sources[target].append((name, ("expert", e, part)))
        elif s:
            target = s.group(1) + ".sinks"
            if target not in sources:
                raise CheckpointError(f"{ckpt.path_of(name)}: unexpected tensor {name!r}")
            if sources[target]:
                raise CheckpointError(f"{ckpt.path_of(name)}: {name!r} duplicates "
                                      f"{sources[target][0][0]!r} (two sink tensors for one layer)")
            sources[target].append((name, None))
        elif name in sources:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and sources[name]:
                raise CheckpointError(f"{ckpt.path_of(name)}: {name!r} given both fused and per expert")
            sources[name].append((name, None))
        else:
            hint = ""
            if "e_score_correction_bias" in name:
                hint = " (Flint's router has no selection bias)"
            elif re.match(r"^model\.layers\.(\d+)\.", name):
                layer = int(name.split(".")[2])
                if layer >= cfg.num_hidden_layers:
                    hint = f" (the config has {cfg.num_hidden_layers} layers)"
            raise CheckpointError(f"{ckpt.path_of(name)}: unexpected tensor {name!r}{hint}")
    for target, srcs in sources.items():
        if not srcs:
            raise CheckpointError(f"{ckpt.directory}: missing tensor for {target!r}"
                                  + (" (expected self_attn.softmax_offset or self_attn.sinks)"
                                     if target.endswith("sinks") else ""))
        if srcs[0][1] is not None:  # per-expert: every expert, each part, exactly once
            got = {(r[1], r[2]) for _, r in srcs}
            parts = ("down",) if target.endswith("down_proj") else ("gate", "up")
            for e in range(cfg.num_experts):
                for part in parts:
                    if (e, part) not in got:
                        stem = target.rsplit(".", 1)[0]
                        raise CheckpointError(f"{ckpt.directory}: missing tensor "
                                              f"'{stem}.{e}.{part}_proj.weight'")
            if any(r is None for _, r in srcs):
                raise CheckpointError(f"{ckpt.directory}: {target!r} given both fused and per expert")
        _check_shapes(ckpt, cfg, target, srcs, expected[target])
    return sources


def _check_shapes(ckpt, cfg, target, srcs, shape):
    mi = cfg.moe_intermediate_size
    for name, role in srcs:
        got = ckpt.shape(name)
        if role is None:
            want = shape
        elif role[2] == "down":
            want = shape[1:]
        else:
            want = (mi, shape[2])
        if tuple(got) != tuple(want):
            raise CheckpointError(f"{ckpt.path_of(name)}: tensor {name!r} has shape {list(got)}, "
                                  f"expected {list(want)} for this config")
        dt = ckpt.dtype(name)
        if dt not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float16)):
            raise CheckpointError(f"{ckpt.path_of(name)}: tensor {name!r} has dtype {dt}, expected "
                                  "bf16, f16 or f32")


def iter_params(ckpt: HFCheckpoint, cfg: FlintConfig,
                sources: dict | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (param name, array) one parameter at a time (an expert stack counts as one).

    Arrays keep the checkpoint's dtype; per-expert tensors are stacked in expert order, gate
    rows before up rows.
    """
    sources = sources or plan(ckpt, cfg)
    for target, srcs in sources.items():
        if srcs[0][1] is None:
            yield target, np.asarray(ckpt.get(srcs[0][0]))
            continue
        by = {(r[1], r[2]): n for n, r in srcs}
        if target.endswith("down_proj"):
            arr = np.stack([ckpt.get(by[(e, "down")]) for e in range(cfg.num_experts)])
        else:
            arr = np.stack([np.concatenate([ckpt.get(by[(e, "gate")]), ckpt.get(by[(e, "up")])])
                            for e in range(cfg.num_experts)])
        yield target, arr


def param_nbytes(ckpt: HFCheckpoint) -> int:
    return sum(int(np.prod(ckpt.shape(n))) * ckpt.dtype(n).itemsize for n in ckpt.names())


def hf_tensors_of_state(cfg: FlintConfig, named: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """flint_jax parameters -> HF checkpoint tensors (transformers' on-disk names: per-expert
    weights, sinks as `self_attn.softmax_offset`)."""
    mi = cfg.moe_intermediate_size
    for name, arr in named.items():
        if name.endswith(".self_attn.sinks"):
            yield name[: -len("sinks")] + "softmax_offset", arr
        elif name.endswith(".mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for e in range(arr.shape[0]):
                yield f"{stem}{e}.gate_proj.weight", arr[e, :mi]
                yield f"{stem}{e}.up_proj.weight", arr[e, mi:]
        elif name.endswith(".mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(arr.shape[0]):
                yield f"{stem}{e}.down_proj.weight", arr[e]
        else:
            yield name, arr


def save_hf_module(module, directory: str) -> None:
    """Writes a bf16/fp32 flint_jax module as a HF checkpoint (`config.json`, `model.safetensors`)
    that transformers' `FlintForCausalLM.from_pretrained` reads."""
    from flax import nnx
    if module.quant:
        raise ValueError("save_hf_module writes BF16/FP32 models; NVFP4 models go to GGUF "
                         "(flint-jax quantize)")
    cfg = module.cfg
    os.makedirs(directory, exist_ok=True)
    named = {".".join(str(p) for p in path): np.asarray(var.get_value())
             for path, var in nnx.to_flat_state(nnx.state(module))}
    tensors = dict(hf_tensors_of_state(cfg, named))
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors, {"format": "pt"})
    d = cfg.to_dict()
    d["dtype"] = str(module.dtype)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
