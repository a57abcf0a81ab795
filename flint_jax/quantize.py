"""`flint-jax quantize`: a BF16 HF checkpoint -> an NVFP4 GGUF file in Flint's naming.

    rows = flint_jax.quantize.quantize("RecursiveSI/flint", "flint-nvfp4.gguf")

Every linear layer (attention, dense MLP, shared and routed experts, lm_head) becomes NVFP4 with
the ModelOpt recipe (`nvfp4.quantize_nvfp4`: fp32 tensor scale `amax / (6 * 448)` per tensor and
per expert, one E4M3 block scale per 16 values, nearest E2M1 with ties to even); the tensor scale
is the F32 companion `X.scale` of `X.weight` (`[1]`, or `[E]` for `*_exps`). Embeddings, norms and sinks
keep their dtype (BF16, or F32 from an fp32 source); the router is F32.

Output: OUT ending in `.gguf` is one GGUF file (its config and tokenizer stay in the source:
`--hf-config HF_DIR` wherever it is used); any other OUT is a directory, usable on its own:
`OUT/model.gguf` plus the source's `config.json`, `generation_config.json` and tokenizer files
(as `flint-jax synth --format gguf` writes; `flint-jax convert OUT/model.gguf DST` finds them).

Streaming: the GGUF header (names, types, shapes) is known from the config before any data is
read, so `GGUFStreamWriter` writes header and tensor infos first and then each tensor as soon as
it is quantized (no spool file, no second copy on disk); a few tensors are quantized ahead in
threads. The output is written beside OUT and renamed at the end (`flint_jax.output_path`: the
destinations refused, `overwrite`, interrupts); on error nothing is left.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from flint_jax import checkpoint, hf_io
from flint_jax.config import FlintConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
GGUF_NAME = "model.gguf"  # the GGUF file of a directory output


class QuantizeError(ValueError):
    """A quantization flint_jax refuses (the message names the file and tensor)."""


# ---- streaming GGUF writer ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GGUFTensorSpec:
    """One GGUF tensor: name, GGML type (F32 / BF16 / NVFP4) and numpy element shape."""
    name: str
    qtype: Any
    shape: tuple[int, ...]

    @property
    def data_shape(self) -> tuple[int, ...]:
        """numpy shape of the data array: NVFP4 blocks are uint8 `[..., N, K/64*36]`."""
        from flint_jax import gguf_io
        if self.qtype == gguf_io.NVFP4:
            return (*self.shape[:-1], self.shape[-1] // 64 * 36)
        return self.shape

    @property
    def data_dtype(self) -> np.dtype:
        from flint_jax import gguf_io
        return {gguf_io.NVFP4: np.dtype(np.uint8), gguf_io.BF16: BF16, gguf_io.F32: F32}[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data_shape, dtype=np.int64)) * self.data_dtype.itemsize


class GGUFStreamWriter:
    """Writes a GGUF file whose tensor list is known up front, one tensor at a time, in order.

    `write(name, array)` checks the array against the spec (dtype, shape; NVFP4 blocks validated).
    Output goes to `path` itself (callers write into a temporary output: `output_path.staging`);
    `abort()` removes the partial file.
    """

    def __init__(self, path: str, specs: Sequence[GGUFTensorSpec], metadata: dict[str, Any]):
        from gguf import GGUFWriter
        from flint_jax import gguf_io
        self.path, self.specs = os.fspath(path), list(specs)
        meta = dict(metadata)
        arch = meta.pop("general.architecture", gguf_io.DEFAULT_ARCH)
        self._next = 0
        try:
            w = GGUFWriter(self.path, arch=arch)
            for key, value in meta.items():
                v, vtype = gguf_io._value_type(key, value)
                w.add_key_value(key, v, vtype)
            for s in self.specs:
                gguf_io.gguf_to_hf_name(s.name)  # a Flint name, or ValueError
                raw = s.qtype if s.qtype != gguf_io.F32 else None
                w.add_tensor_info(s.name, s.data_shape, s.data_dtype, s.nbytes, raw_dtype=raw)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            self._w = w
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, array: np.ndarray) -> None:
        from flint_jax import gguf_io, nvfp4
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path}: tensor {name!r} is beyond the planned tensor list")
        s = self.specs[self._next]
        if name != s.name:
            raise ValueError(f"{self.path}: tensor {name!r} written where {s.name!r} is planned")
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        if array.dtype != s.data_dtype or array.shape != s.data_shape:
            raise ValueError(f"{self.path}: tensor {name!r}: got {array.dtype}{list(array.shape)}, "
                             f"planned {s.data_dtype}{list(s.data_shape)}")
        if s.qtype == gguf_io.NVFP4:
            nvfp4.validate_gguf_blocks(array, name)
        self._w.write_tensor_data(array)
        self._next += 1

    def finish(self) -> str:
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: only {self._next} of {len(self.specs)} tensors written")
        self._w.close()
        return self.path

    def abort(self) -> None:
        try:
            if getattr(self, "_w", None) is not None:
                self._w.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


def write_gguf_stream(path: str, specs: Sequence[GGUFTensorSpec], metadata: dict[str, Any],
                      produce: Callable[[Any], tuple[list[tuple[str, np.ndarray]], Any]],
                      items: Sequence[Any], *, workers: int = 2,
                      on_item: Callable[[Any, list, Any], None] | None = None) -> str:
    """Writes `path` from `produce(item) -> ([(name, array), ...], info)` over `items` (in order,
    at most `workers` items produced ahead); `on_item(item, arrays, info)` after each is written."""
    writer = GGUFStreamWriter(path, specs, metadata)
    try:
        for item, (arrays, info) in zip(items, checkpoint.ordered_map(produce, items, workers)):
            for name, arr in arrays:
                writer.write(name, arr)
            if on_item is not None:
                on_item(item, arrays, info)
            del arrays
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


def gguf_metadata(cfg: FlintConfig, name: str = "flint", **extra) -> dict[str, Any]:
    """GGUF key/values describing a Flint model (llama.cpp-style `flint.*` keys)."""
    from gguf import GGUFValueType
    a = "flint."
    meta: dict[str, Any] = {
        "general.architecture": "flint",
        "general.name": name,
        "general.quantization_version": 2,
        a + "vocab_size": cfg.vocab_size,
        a + "block_count": cfg.num_hidden_layers,
        a + "context_length": cfg.max_position_embeddings,
        a + "embedding_length": cfg.hidden_size,
        a + "feed_forward_length": cfg.intermediate_size,
        a + "attention.head_count": cfg.num_attention_heads,
        a + "attention.head_count_kv": cfg.num_key_value_heads,
        a + "attention.key_length": cfg.head_dim,
        a + "attention.value_length": cfg.head_dim,
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        a + "attention.sliding_window": cfg.sliding_window,
        a + "rope.freq_base": float(cfg.rope_theta),
        a + "expert_count": cfg.num_experts,
        a + "expert_used_count": cfg.num_experts_per_tok,
        a + "expert_feed_forward_length": cfg.moe_intermediate_size,
        a + "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
        a + "expert_weights_norm": bool(cfg.norm_topk_prob),
        a + "expert_gating_func": cfg.router_score_function,
    }
    if cfg.full_layers:
        meta[a + "full_attention_layers"] = ([int(i) for i in cfg.full_layers], GGUFValueType.ARRAY)
    if cfg.dense_layers:
        meta[a + "dense_layers"] = ([int(i) for i in cfg.dense_layers], GGUFValueType.ARRAY)
    meta.update(extra)
    return meta


# ---- BF16 HF -> NVFP4 GGUF ------------------------------------------------------------------------

def _source_loader(ckpt: hf_io.HFCheckpoint, cfg: FlintConfig, sources: dict):
    """gguf weight name -> a function returning the HF weight as numpy (gate / up / down expert
    stacks `[E, out, in]` built from per-expert or fused tensors, reading only what is needed)."""
    from flint_jax import gguf_io
    mi = cfg.moe_intermediate_size

    def load(g: str) -> np.ndarray:
        hf = gguf_io.gguf_to_hf_name(g)
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate|up|down)_proj\.weight", hf)
        if not m:
            param = re.sub(r"self_attn\.softmax_offset$", "self_attn.sinks", hf)
            return np.asarray(ckpt.get(sources[param][0][0]))
        stem, part = m.group(1), m.group(2)
        target = stem + (".down_proj" if part == "down" else ".gate_up_proj")
        srcs = sources[target]
        if srcs[0][1] is None:  # fused [E, 2I, D] / [E, D, I]
            arr = ckpt.get(srcs[0][0])
            if part == "gate":
                return np.array(arr[:, :mi])
            if part == "up":
                return np.array(arr[:, mi:])
            return np.array(arr)
        by = {(r[1], r[2]): n for n, r in srcs}
        return np.stack([ckpt.get(by[(e, part)]) for e in range(cfg.num_experts)])

    return load


def plan_specs(cfg: FlintConfig, src_dtype: Callable[[str], np.dtype]) -> list[GGUFTensorSpec]:
    """The NVFP4 file's tensor list: linear layers NVFP4 + their `X.scale`, router F32, others keep a
    BF16 / F32 type from `src_dtype(gguf_name)`."""
    from flint_jax import gguf_io
    from flint_jax.gguf_io import gguf_expected
    specs = []
    for g, shape in gguf_expected(cfg).items():
        if gguf_io.may_be_nvfp4(g):
            if shape[-1] % 64:
                raise QuantizeError(f"tensor {g!r}: row length {shape[-1]} is not a multiple of 64; "
                                    "NVFP4 needs K % 64 == 0")
            specs.append(GGUFTensorSpec(g, gguf_io.NVFP4, tuple(shape)))
            n_scale = shape[0] if len(shape) == 3 else 1
            specs.append(GGUFTensorSpec(gguf_io.scale_name(g), gguf_io.F32, (n_scale,)))
        elif g.endswith(("ffn_gate_inp.weight", "attn_sinks.weight")):
            specs.append(GGUFTensorSpec(g, gguf_io.F32, tuple(shape)))
        else:
            t = gguf_io.BF16 if np.dtype(src_dtype(g)) == BF16 else gguf_io.F32
            specs.append(GGUFTensorSpec(g, t, tuple(shape)))
    return specs


def output_gguf(out: str | os.PathLike) -> str:
    """The GGUF file `quantize(hf_dir, out)` writes: `out` itself when it ends in `.gguf`, else
    `out/model.gguf` (a directory output, with the config and tokenizer beside it)."""
    from flint_jax import output_path
    out = output_path.normalize(out)
    return os.path.join(out, GGUF_NAME) if writes_directory(out) else out


def writes_directory(out: str | os.PathLike) -> bool:
    """True when `quantize(hf_dir, out)` writes a directory (`out` not ending in `.gguf`)."""
    from flint_jax import output_path
    return not output_path.normalize(out).lower().endswith(".gguf")


def _copy_meta(hf_dir: str, out_dir: str) -> list[str]:
    """config.json, generation_config.json and the tokenizer files of the source, copied."""
    from flint_jax.convert import META_FILES
    copied = []
    for f in ("config.json", *META_FILES):
        p = os.path.join(hf_dir, f)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(out_dir, f))
            copied.append(f)
    return copied


class _ByteProgress:
    """A tqdm bar over the source's bytes, advanced from worker threads while a tensor is read,
    quantized and checked (its error statistics), not only when it is written: at full size an
    expert stack takes tens of seconds, most of it in these phases."""

    # Shares of a tensor's bytes credited once read, quantized, checked; the rest when written.
    LOADED, QUANTIZED, CHECKED = 0.1, 0.5, 0.95

    def __init__(self, bar):
        self.bar, self._lock, self._given = bar, threading.Lock(), {}

    def to(self, key: str, n: float) -> None:
        if self.bar is None:
            return
        with self._lock:
            d = int(n) - self._given.get(key, 0)
            if d > 0:
                self._given[key] = int(n)
                self.bar.update(d)


def quantize(hf_dir: str, out: str, *, overwrite: bool = False, workers: int | None = None,
             on_tensor: Callable[[dict], None] | None = None, progress: bool = False,
             name: str | None = None) -> list[dict]:
    """Quantizes a BF16 HF checkpoint to an NVFP4 GGUF file.

    `out` ending in `.gguf`: that one file. Otherwise a directory `out` with `model.gguf` and the
    source's config.json, generation_config.json and tokenizer files, usable on its own
    (`output_gguf(out)` is the GGUF path). `out` is refused when it is or contains `hf_dir` or the
    working directory, or exists without `overwrite` (`flint_jax.output_path`).

    Returns one row per GGUF weight: {"name", "type", "shape", "max_abs" (of the weight),
    "max_abs_err", "rel_rms_err"} (errors 0 for tensors stored as they are). `on_tensor(row)` is
    called as each tensor is written (the CLI prints its table from it). `progress`: a tqdm bar
    over the source's bytes, moving while each tensor is read and quantized.
    """
    from flint_jax import gguf_io, nvfp4, output_path
    hf_dir = os.fspath(hf_dir)
    out = output_path.normalize(out)
    kind = "dir" if writes_directory(out) else "file"
    inputs = [("the source", hf_dir)]
    out = output_path.check(out, inputs=inputs, overwrite=overwrite, kind=kind)
    cfg = FlintConfig.from_json(hf_dir)
    ckpt = hf_io.HFCheckpoint(hf_dir)
    sources = hf_io.plan(ckpt, cfg)
    load = _source_loader(ckpt, cfg, sources)

    def src_dtype(g):
        hf = re.sub(r"self_attn\.softmax_offset$", "self_attn.sinks", gguf_io.gguf_to_hf_name(g))
        return ckpt.dtype(sources[hf][0][0])

    specs = plan_specs(cfg, src_dtype)
    by_name = {s.name: s for s in specs}
    weights = [s.name for s in specs if not gguf_io.is_companion(s.name)]
    workers = workers or min(4, os.cpu_count() or 1)
    rows: list[dict] = []

    def src_itemsize(g):
        hf = gguf_io.gguf_to_hf_name(g)
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate|up|down)_proj\.weight", hf)
        if m:  # an expert stack, from per-expert or fused source tensors
            target = m.group(1) + (".down_proj" if m.group(2) == "down" else ".gate_up_proj")
            return np.dtype(ckpt.dtype(sources[target][0][0])).itemsize
        return np.dtype(src_dtype(g)).itemsize

    src_bytes = {g: int(np.prod(by_name[g].shape, dtype=np.int64)) * src_itemsize(g)
                 for g in weights}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(src_bytes.values()), unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"quantize {os.path.basename(out)}", dynamic_ncols=True)
    prog = _ByteProgress(bar)

    def produce(g):
        spec = by_name[g]
        nb = src_bytes[g]
        w = load(g)
        w32 = w if w.dtype == F32 else w.astype(np.float32)
        prog.to(g, nb * prog.LOADED)
        row = {"name": g, "type": spec.qtype.name, "shape": list(spec.shape),
               "max_abs": float(max(w32.max(), -w32.min())) if w.size else 0.0,
               "max_abs_err": 0.0, "rel_rms_err": 0.0}
        if spec.qtype == gguf_io.NVFP4:
            del w

            def phase(lo, hi):
                def on_rows(done, total):
                    if output_path.interrupt_requested():  # Ctrl-C: stop this worker too
                        raise KeyboardInterrupt
                    prog.to(g, nb * (lo + (hi - lo) * done / max(1, total)))
                return on_rows

            q, s, ts = nvfp4.quantize_nvfp4(w32, on_rows=phase(prog.LOADED, prog.QUANTIZED))
            row.update(nvfp4.quantization_error(w32, q, s, ts,
                                                on_rows=phase(prog.QUANTIZED, prog.CHECKED)))
            del w32
            return [(g, nvfp4.kernel_to_gguf(q, s, g)),
                    (gguf_io.scale_name(g), ts.reshape(-1).astype(np.float32))], row
        if w.dtype == spec.data_dtype:
            arr = w
        elif spec.data_dtype == BF16:
            arr = w32.astype(BF16)
        else:
            arr = w.astype(spec.data_dtype)
        return [(g, arr)], row

    def done(g, arrays, row):
        rows.append(row)
        prog.to(g, src_bytes[g])
        if on_tensor is not None:
            on_tensor(row)

    meta = gguf_metadata(cfg, name or os.path.basename(os.path.abspath(hf_dir)),
                         **{"flint.quantization.recipe":
                            "NVFP4 W4A16: ts = amax/(6*448) per tensor and per expert, "
                            "E4M3 block scale per 16, nearest E2M1 (ties to even)"})
    try:
        with output_path.staging(out, inputs=inputs, overwrite=overwrite, kind=kind) as tmp:
            if kind == "dir":
                _copy_meta(hf_dir, tmp)
                path = os.path.join(tmp, GGUF_NAME)
            else:
                path = tmp
            write_gguf_stream(path, specs, meta, produce, weights, workers=workers, on_item=done)
    finally:
        if bar is not None:
            bar.close()
    return rows


def format_table(rows: Iterable[dict]) -> str:
    """The per-tensor error table printed by `flint-jax quantize`."""
    lines = [f"{'tensor':44s} {'type':6s} {'shape':22s} {'max|w|':>9s} {'max err':>9s} "
             f"{'rel rms':>8s}"]
    for r in rows:
        lines.append(format_row(r))
    return "\n".join(lines)


def format_row(r: dict) -> str:
    shape = "x".join(str(d) for d in r["shape"])
    err = (f"{r['max_abs_err']:9.3g} {r['rel_rms_err']:8.4f}" if r["type"] == "NVFP4"
           else f"{'-':>9s} {'-':>8s}")
    return f"{r['name']:44s} {r['type']:6s} {shape:22s} {r['max_abs']:9.3g} {err}"


__all__ = ["GGUFStreamWriter", "GGUFTensorSpec", "QuantizeError", "format_table", "gguf_metadata",
           "output_gguf", "plan_specs", "quantize", "write_gguf_stream", "writes_directory"]
