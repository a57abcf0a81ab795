"""`flint-jax convert`: a HF directory or an NVFP4 GGUF file -> a flint_jax (orbax) checkpoint.

    from flint_jax import convert
    convert.convert("RecursiveSI/flint", "flint-jax-bf16")
    convert.convert("flint-nvfp4.gguf", "flint-jax-nvfp4", hf_config="RecursiveSI/flint")
    model = flint_jax.load("flint-jax-nvfp4", mesh=mesh)   # loading.load_converted

The format is described in `flint_jax.checkpoint`. Conversion streams: every parameter is a
`LazyTensor` read (and for GGUF, repacked) only when orbax writes it, a few at a time, so a 40B
checkpoint converts with a few GiB of host memory. The result goes to a temporary directory beside
DST, renamed at the end; on any error or interrupt nothing is left behind (`flint_jax.output_path`:
also the destinations refused, such as one containing the source). (Loading a converted checkpoint or a
GGUF file directly is `flint_jax.loading`'s: `load_converted`, `load_gguf`.)

Sources:

* **HF** (`hf_io`): single or sharded safetensors, per-expert or fused experts, either sink name,
  router fp32 or bf16. Weights are stored as they are (`dtype="auto"`), or cast (`"bf16"`,
  `"f32"`); the router, sinks and NVFP4 tensor scales are always fp32 in memory (spec section 3).
* **NVFP4 GGUF** (`gguf_io`), with `hf_config=` naming the BF16 repo directory (config.json,
  generation_config.json and tokenizer files are copied along). NVFP4 blocks are repacked
  losslessly into the flint_jax layout (`nvfp4.gguf_to_kernel`); tensor scales (`X.scale` of `X.weight`,
  missing = 1.0) stay fp32: `[]` per linear layer, `[E]` for `down_proj`, `[E, 2]` (gate, up)
  for the fused `gate_up`. BF16 and F32 tensors are carried as they are. A GGUF whose linear
  layers are all NVFP4 gives a `quant=True` checkpoint (every linear layer NVFP4, lm_head
  included, as in Flint's file); all BF16/F32 gives a `quant=False` one.

  **Mixed files** (some linear layers NVFP4, others BF16 -- e.g. a BF16 `output.weight`): the
  NNX model has one weight format for all linear layers, so `mixed=` decides:
  `"refuse"` (default: a clear error naming the BF16 tensors), `"quantize"` (quant=True; the BF16
  linear layers are quantized to NVFP4 with the ModelOpt recipe: lossy, reported), or
  `"dequantize"` (quant=False; NVFP4 layers decoded exactly, `e2m1 * e4m3 * tensor_scale` in
  fp32, stored fp32 with `dtype="auto"`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from typing import Any

import ml_dtypes
import numpy as np

from flint_jax import checkpoint, gguf_io, hf_io, nvfp4
from flint_jax.checkpoint import LazyTensor, TensorGroup
from flint_jax.config import ConfigError, FlintConfig
from flint_jax.gguf_io import GGUFError, gguf_expected, is_gguf, read_gguf_tensor


BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
FLOAT8 = np.dtype(ml_dtypes.float8_e4m3fn)

# Always fp32 in memory (spec section 3): the router, the sinks, NVFP4 tensor scales.
FP32_SUFFIXES = ("mlp.gate.weight", "self_attn.sinks", "weight_scale_2")
# Files copied along with the weights (the tokenizer and the generation defaults).
META_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "special_tokens_map.json")
DTYPES = ("auto", "bf16", "f32")
MIXED = ("refuse", "quantize", "dequantize")


class ConvertError(ValueError):
    """A conversion flint_jax refuses (the message names the file and tensor)."""


def _known_errors():
    return (ConvertError, hf_io.CheckpointError, GGUFError, ConfigError,
            checkpoint.CheckpointFormatError)


# ---- the plan: every parameter as a LazyTensor -------------------------------------------------

@dataclasses.dataclass
class Plan:
    """What a conversion writes: the config, the quant flag, one LazyTensor per parameter."""
    cfg: FlintConfig
    quant: bool
    tensors: list[LazyTensor]
    source: dict[str, Any]
    meta_dir: str | None  # where config.json / tokenizer files come from
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _stored_dtype(name: str, src: np.dtype, dtype: str) -> np.dtype:
    """The dtype a parameter is stored with: "auto" keeps floats as they are (f16 -> f32, so
    nothing rounds), "bf16"/"f32" cast weights; fp32-always leaves become f32 when cast."""
    src = np.dtype(src)
    if src not in (BF16, F32, F16):  # uint8 codes, float8 block scales
        return src
    if dtype == "auto":
        return F32 if src == F16 else src
    if name.endswith(FP32_SUFFIXES) or dtype == "f32":
        return F32
    return BF16


def _cast(arr: np.ndarray, dt: np.dtype) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype == dt:
        return arr
    if dt == BF16 and arr.dtype != F32:
        arr = arr.astype(F32)
    return arr.astype(dt)


def _check_dtype_option(dtype: str):
    if dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _stack_experts(ckpt, target: str, srcs, shape, dt) -> np.ndarray:
    """Per-expert HF tensors -> one `[E, 2I, D]` (gate rows first) or `[E, D, I]` stack, filled
    in place expert by expert (one copy of the stack in memory, each expert's memmap released
    right after its copy)."""
    out = np.empty(shape, dt)
    half = shape[1] // 2
    for name, (_, e, part) in srcs:
        rows = slice(None) if part == "down" else slice(0, half) if part == "gate" else slice(half, None)
        m = ckpt.get(name)
        out[e, rows] = m if m.dtype == dt else _cast(m, dt)
        del m
    return out


def plan_hf(src: str, *, dtype: str = "auto") -> Plan:
    """Validates a HF directory against its config.json and plans its parameters."""
    _check_dtype_option(dtype)
    cfg = FlintConfig.from_json(src)
    ckpt = hf_io.HFCheckpoint(src)
    sources = hf_io.plan(ckpt, cfg)
    expected = hf_io.expected_params(cfg)
    tensors = []
    for target, srcs in sources.items():
        src_dt = np.result_type(*[ckpt.dtype(n) for n, _ in srcs])
        dt = _stored_dtype(target, src_dt, dtype)

        def produce(target=target, srcs=srcs, dt=dt):
            if srcs[0][1] is not None:
                return _stack_experts(ckpt, target, srcs, expected[target], dt)
            (_, arr), = hf_io.iter_params(ckpt, cfg, {target: srcs})
            return _cast(arr, dt)

        tensors.append(LazyTensor(target, expected[target], dt, produce))
    return Plan(cfg, False, tensors, {"kind": "hf", "path": os.path.abspath(src)}, src)


# ---- GGUF (names, shapes and reads: `gguf_io`) ------------------------------------------------

def plan_gguf(path: str, hf_config: str | None, *, dtype: str = "auto",
              mixed: str = "refuse") -> Plan:
    """Validates a Flint GGUF file against the config in `hf_config` and plans its parameters."""
    _check_dtype_option(dtype)
    if mixed not in MIXED:
        raise ConvertError(f"mixed must be one of {MIXED}, got {mixed!r}")
    if hf_config is None:
        hf_config = gguf_io.find_gguf_config(path)   # config.json beside the file
    if hf_config is None:
        raise ConvertError(f"{path}: a GGUF file holds no usable config and no config.json lies "
                           "beside it; pass hf_config (--hf-config DIR) naming the BF16 repo "
                           "directory with config.json and the tokenizer")
    if not os.path.isdir(hf_config):
        raise ConvertError(f"{hf_config}: hf_config must be a directory holding config.json")
    cfg = FlintConfig.from_json(hf_config)
    ck = gguf_io.open_gguf(path)
    weights = gguf_io.check_config(ck, cfg, path)
    linear = [n for n in weights if gguf_io.may_be_nvfp4(n)]
    nv = [n for n in linear if weights[n].tensor_type == gguf_io.NVFP4]
    other = [n for n in linear if weights[n].tensor_type != gguf_io.NVFP4]
    notes = []
    if nv and other:
        if mixed == "refuse":
            shown = ", ".join(repr(n) for n in other[:3]) + (" ..." if len(other) > 3 else "")
            raise ConvertError(
                f"{path}: mixed linear formats: {len(nv)} NVFP4 and {len(other)} BF16/F32 "
                f"({shown}); flint_jax holds one format for every linear layer: pass mixed="
                "'quantize' (--mixed quantize: NVFP4-quantize the BF16 layers, lossy) or "
                "'dequantize' (--mixed dequantize: decode the NVFP4 layers exactly to fp32)")
        notes.append(f"mixed file ({len(nv)} NVFP4, {len(other)} BF16/F32 linear tensors): "
                     f"mixed={mixed!r}")
    quant = bool(nv) and (not other or mixed == "quantize")

    def read(name):
        return read_gguf_tensor(ck, name)

    def decode(name, n_exp):
        """NVFP4 -> (qweight, weight_scale, ts); BF16/F32 with mixed=quantize -> quantized."""
        t = weights[name]
        try:
            if t.tensor_type == gguf_io.NVFP4:
                q, s = nvfp4.gguf_to_kernel(read(name), name)
                return q, s, gguf_io.stacked_tensor_scale(ck, name, n_exp)
            w = read(name).astype(np.float32)
            return nvfp4.quantize_nvfp4(w)
        except GGUFError:
            raise
        except ValueError as e:
            raise ConvertError(f"{path}: {e}") from None

    def dense(name, n_exp, dt):
        """Any linear tensor as a dense float array of dtype `dt` (NVFP4: exact decode x ts)."""
        t = weights[name]
        try:
            if t.tensor_type == gguf_io.NVFP4:
                w = nvfp4.dequantize_gguf_np(read(name), name, ck.tensor_scale(name))
            else:
                w = read(name)
        except GGUFError:
            raise
        except ValueError as e:
            raise ConvertError(f"{path}: {e}") from None
        return _cast(w, dt)

    def dense_dtype(name):
        t = weights[name]
        src = F32 if t.tensor_type in (gguf_io.NVFP4, gguf_io.F32) else BF16
        return _stored_dtype("x.weight", src, dtype)

    tensors: list[LazyTensor] = []

    def add(name, shape, dt, produce):
        tensors.append(LazyTensor(name, shape, dt, produce))

    for g, shape in gguf_expected(cfg).items():
        hf = gguf_io.gguf_to_hf_name(g)
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate|up|down)_proj\.weight", hf)
        if m and m.group(2) == "up":
            continue  # with gate
        if m:
            stem, e = m.group(1), shape[0]
            if m.group(2) == "gate":
                up = g.replace("ffn_gate_exps", "ffn_up_exps")
                pre, gu_shape = stem + ".gate_up", (e, 2 * shape[1], shape[2])
                if quant:
                    def fn(g=g, up=up, e=e):
                        q0, s0, t0 = decode(g, e)
                        q1, s1, t1 = decode(up, e)
                        return {"q": np.concatenate([q0, q1], axis=1),
                                "s": np.concatenate([s0, s1], axis=1),
                                "t": np.stack([t0, t1], axis=-1).astype(np.float32)}
                    grp = TensorGroup(fn)
                    add(pre + "_qweight", (*gu_shape[:2], gu_shape[2] // 2), np.uint8,
                        lambda grp=grp: grp.take("q"))
                    add(pre + "_weight_scale", (*gu_shape[:2], gu_shape[2] // 16), FLOAT8,
                        lambda grp=grp: grp.take("s"))
                    add(pre + "_weight_scale_2", (e, 2), F32, lambda grp=grp: grp.take("t"))
                else:
                    dt = np.result_type(dense_dtype(g), dense_dtype(up))
                    add(stem + ".gate_up_proj", gu_shape, dt,
                        lambda g=g, up=up, e=e, dt=dt: np.concatenate(
                            [dense(g, e, dt), dense(up, e, dt)], axis=1))
            else:
                pre = stem + ".down"
                if quant:
                    grp = TensorGroup(lambda g=g, e=e: dict(zip("qst", decode(g, e))))
                    add(pre + "_qweight", (*shape[:2], shape[2] // 2), np.uint8,
                        lambda grp=grp: grp.take("q"))
                    add(pre + "_weight_scale", (*shape[:2], shape[2] // 16), FLOAT8,
                        lambda grp=grp: grp.take("s"))
                    add(pre + "_weight_scale_2", (e,), F32, lambda grp=grp: grp.take("t"))
                else:
                    dt = dense_dtype(g)
                    add(stem + ".down_proj", shape, dt, lambda g=g, e=e, dt=dt: dense(g, e, dt))
            continue
        param = gguf_io.param_name(hf)
        if gguf_io.may_be_nvfp4(g):
            base = param[: -len(".weight")]
            if quant:
                grp = TensorGroup(lambda g=g: dict(zip("qst", decode(g, None))))
                add(base + ".qweight", (shape[0], shape[1] // 2), np.uint8, lambda grp=grp: grp.take("q"))
                add(base + ".weight_scale", (shape[0], shape[1] // 16), FLOAT8,
                    lambda grp=grp: grp.take("s"))
                add(base + ".weight_scale_2", (), F32, lambda grp=grp: grp.take("t"))
            else:
                dt = dense_dtype(g)
                add(param, shape, dt, lambda g=g, dt=dt: dense(g, None, dt))
            continue
        src = F32 if weights[g].tensor_type == gguf_io.F32 else BF16
        dt = _stored_dtype(param, src, dtype)
        if param.endswith("mlp.gate.weight"):
            dt = F32  # the router stays fp32 (exact from BF16)
        add(param, shape, dt, lambda g=g, dt=dt: _cast(read(g), dt))
    source = {"kind": "gguf", "path": os.path.abspath(path), "hf_config": os.path.abspath(hf_config),
              "mixed": mixed if (nv and other) else None}
    return Plan(cfg, quant, tensors, source, hf_config, notes)


# ---- writing --------------------------------------------------------------------------------------

def make_plan(src: str, *, hf_config: str | None = None, dtype: str = "auto",
              mixed: str = "refuse") -> Plan:
    src = os.fspath(src)
    if os.path.isfile(src) and is_gguf(src):
        return plan_gguf(src, hf_config, dtype=dtype, mixed=mixed)
    if src.endswith(".gguf") and not os.path.exists(src):
        raise FileNotFoundError(f"{src}: no such GGUF file")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: no such HF directory or GGUF file")
    if checkpoint.is_converted(src):
        raise ConvertError(f"{src}: already a flint_jax checkpoint (load it with flint_jax.load)")
    if hf_config is not None and os.path.abspath(hf_config) != os.path.abspath(src):
        raise ConvertError(f"{src}: hf_config applies to GGUF sources; a HF directory brings its own "
                           "config.json")
    return plan_hf(src, dtype=dtype)


def _weight_dtype(plan: Plan) -> str:
    if plan.quant:
        return "nvfp4"
    dts = {str(t.dtype) for t in plan.tensors if not t.name.endswith(FP32_SUFFIXES)
           and not t.name.endswith("norm.weight")}
    return dts.pop() if len(dts) == 1 else "mixed"


def _copy_meta(plan: Plan, out: str):
    plan.cfg.to_json(os.path.join(out, "config.json"))
    if plan.meta_dir:
        for f in META_FILES:
            p = os.path.join(plan.meta_dir, f)
            if os.path.isfile(p):
                shutil.copyfile(p, os.path.join(out, f))


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, hf_config: str | None = None,
            overwrite: bool = False, progress: bool = True, dtype: str = "auto",
            mixed: str = "refuse", workers: int | None = None) -> str:
    """Converts a HF directory or an NVFP4 GGUF file into a flint_jax checkpoint at `dst`.

    Args:
      src: a HF directory, or a `.gguf` file (then `hf_config` names the BF16 repo directory).
      dst: the output directory; refused if it exists unless `overwrite`, and always when it is
        or contains the source or `hf_config`, or is or contains the working directory
        (`flint_jax.output_path.check`). An existing DST is replaced only once the new one is
        complete.
      dtype: "auto" (store weights as they are), "bf16" or "f32".
      mixed: for a GGUF with both NVFP4 and BF16 linear layers: "refuse", "quantize",
        "dequantize" (module docstring).
      workers: tensors produced ahead in threads (default min(4, cores)); peak memory is about
        `workers + 1` of the largest tensors (an expert stack).
    Returns the path of the checkpoint. Raises ValueError subclasses (ConvertError,
    hf_io.CheckpointError, gguf_io.GGUFError, ConfigError) naming file and tensor, with nothing
    written, or output_path.DestinationError / FileExistsError / OSError.
    """
    from flint_jax import output_path
    src = os.fspath(src)
    workers = workers or min(4, os.cpu_count() or 1)
    inputs = [("the source", src), ("--hf-config", hf_config)]
    dst = output_path.check(dst, inputs=inputs, overwrite=overwrite, kind="dir")
    plan = make_plan(src, hf_config=hf_config, dtype=dtype, mixed=mixed)
    bar = None
    state = {"last": None, "done": 0}
    try:
        with output_path.staging(dst, inputs=inputs, overwrite=overwrite, kind="dir") as tmp:
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024,
                           desc=f"convert {os.path.basename(dst)}", dynamic_ncols=True)

            def written(t: LazyTensor):
                state["done"] += 1
                state["last"] = t.name
                if bar is not None:
                    bar.set_postfix_str(f"{state['done']}/{len(plan.tensors)} tensors",
                                        refresh=False)
                    bar.update(t.nbytes)

            for t in plan.tensors:
                t.on_written = written
            t0 = time.time()
            try:
                checkpoint.write_params(os.path.join(tmp, checkpoint.PARAMS_DIR), plan.tensors,
                                        workers=workers)
            except _known_errors():
                raise
            except Exception as e:  # tensorstore / orbax / OS failures: one line naming DST
                order = sorted(t.name for t in plan.tensors)
                at = order[state["done"]] if state["done"] < len(order) else None
                where = f" at tensor {at!r}" if at else ""
                raise ConvertError(f"{dst}: writing the checkpoint failed{where}: "
                                   f"{type(e).__name__}: {e}") from e
            _copy_meta(plan, tmp)
            from flint_jax import __version__
            checkpoint.write_manifest(tmp, {
                "quant": plan.quant, "dtype": _weight_dtype(plan), "source": plan.source,
                "num_params": len(plan.tensors), "nbytes": plan.nbytes, "notes": plan.notes,
                "created_by": f"flint_jax {__version__}", "seconds": round(time.time() - t0, 1)})
    finally:
        if bar is not None:
            bar.close()
    return dst




def describe(path: str) -> dict[str, Any]:
    """The manifest of a converted checkpoint (for `inspect`)."""
    return checkpoint.read_manifest(path)


__all__ = ["ConvertError", "Plan", "convert", "make_plan", "plan_gguf", "plan_hf"]
