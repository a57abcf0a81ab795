"""`flint_jax.load`: a HF directory, a converted flint_jax checkpoint, or an NVFP4 GGUF file.

All loading lives here: the HF path (`hf_io`), converted checkpoints (`load_converted`: the
parameters checked against the NNX tree, restored onto their devices) and GGUF files
(`load_gguf`, on `convert.plan_gguf`'s reading and repacking). `convert` writes checkpoints and
imports nothing from here.

The module tree is built abstractly (`nnx.eval_shape`: nothing allocated), then each parameter
is read, cast and placed on its device(s) one at a time, so the host never holds a full copy.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flint_jax import checkpoint, gguf_io
from flint_jax.config import FlintConfig
from flint_jax.convert import BF16, F16, F32, ConvertError, plan_gguf
from flint_jax.decode import Flint
from flint_jax.gguf_io import is_gguf
from flint_jax.model import FlintForCausalLM
from flint_jax.sharding import ShardingRules, cache_shardings, param_sharding
from flint_jax.tokenizer import Tokenizer

KERNEL_CHOICES = ("auto", "pallas", "xla")


def resolve_kernels(kernels: str, cfg: FlintConfig | None = None, *, quant: bool = False,
                    dtype=jnp.bfloat16) -> str:
    """"auto" is the Pallas path on GPU and the XLA path elsewhere. With the model's ``cfg``
    (``quant``, ``dtype``), the Pallas path is checked against what its kernels support
    (``pallas.support.decode_support``): "pallas" refuses an unsupported model with a
    ValueError naming the field and the limit; "auto" takes the XLA path with a one-line
    warning. Without ``cfg`` only the choice is checked ("auto" stays "auto")."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if cfg is None:
        return kernels
    if kernels == "auto" and jax.default_backend() != "gpu":
        return "xla"
    if kernels == "xla":
        return kernels
    from flint_jax.pallas.support import decode_support
    sup = decode_support(cfg, quant, dtype)
    if not sup.ok:
        if kernels == "pallas":
            raise ValueError(f"kernels='pallas' does not support this model: {sup.message()}")
        warnings.warn(f"flint_jax: the XLA decode path for this model (the Pallas kernels do "
                      f"not support {sup.message()})", stacklevel=3)
        return "xla"
    for op in sorted(sup.xla_ops()):
        warnings.warn(f"flint_jax: the Pallas decode step runs {op} on XLA "
                      f"({sup.message(op)})", stacklevel=3)
    return "pallas"


_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
           "fp32": jnp.float32, "f32": jnp.float32}

# Always fp32 in memory (spec section 3): the router and the sinks; NVFP4 tensor scales too.
_FP32_SUFFIXES = ("mlp.gate.weight", "self_attn.sinks", "weight_scale_2")


def parse_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {d}")
    return d


def param_dtype(name: str, stored: np.dtype, dtype) -> np.dtype:
    """The in-memory dtype of a parameter: packed/scale leaves keep theirs, fp32 leaves stay fp32."""
    if name.endswith(("qweight", "weight_scale")):
        return stored
    if name.endswith(_FP32_SUFFIXES):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


def abstract_model(cfg: FlintConfig, dtype, quant: bool):
    """(graphdef, abstract state, {dotted name: flat path}) of a model, without allocating."""
    abs_model = nnx.eval_shape(lambda: FlintForCausalLM(cfg, dtype=dtype, quant=quant,
                                                        rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abs_model)
    names = {".".join(str(p) for p in path): (path, var)
             for path, var in nnx.to_flat_state(state)}
    return graphdef, state, names


def build_state(cfg: FlintConfig, dtype, quant: bool, tensors: Iterable[tuple[str, np.ndarray]],
                mesh=None, rules: ShardingRules | None = None, source: str = "checkpoint",
                progress: bool = False):
    """Places (name, array) pairs into a model state. Every parameter must come exactly once."""
    graphdef, _, names = abstract_model(cfg, dtype, quant)
    rules = rules or (ShardingRules.for_mesh(mesh) if mesh is not None else None)
    filled: dict[str, jax.Array] = {}
    it = tensors
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(tensors, total=len(names), desc="loading", unit="tensor")
    for name, arr in it:
        if name not in names:
            raise ValueError(f"{source}: unexpected parameter {name!r}")
        _, var = names[name]
        want = var.get_value()
        if tuple(arr.shape) != tuple(want.shape):
            raise ValueError(f"{source}: parameter {name!r} has shape {list(arr.shape)}, expected "
                             f"{list(want.shape)}")
        target = param_dtype(name, np.dtype(want.dtype), dtype)
        host = np.asarray(arr)
        if host.dtype != target:
            host = host.astype(np.float32).astype(target) if host.dtype.kind == "f" or \
                str(host.dtype) == "bfloat16" else host.astype(target)
        if mesh is not None:
            filled[name] = jax.device_put(host, param_sharding(name, host.shape, mesh, rules))
        else:
            filled[name] = jax.device_put(host)
    missing = [n for n in names if n not in filled]
    if missing:
        raise ValueError(f"{source}: missing parameter {missing[0]!r}")
    pairs = [(path, var.replace(value=filled[n])) for n, (path, var) in names.items()]
    return graphdef, nnx.from_flat_state(pairs)


def _read_json(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def load(path: str | os.PathLike, *, dtype="bfloat16", mesh: jax.sharding.Mesh | None = None,
         kernels: str = "auto", max_length: int | None = None, hf_config: str | None = None,
         rules: ShardingRules | None = None, progress: bool = False) -> Flint:
    """Loads Flint for generation and research.

    Args:
      path: a local HF directory (`config.json` + safetensors), a flint_jax checkpoint written by
        `flint-jax convert`, or an NVFP4 `.gguf` file. Hub IDs are not fetched: download the
        checkpoint first (e.g. `hf download RecursiveSI/flint --local-dir DIR`).
      hf_config: for a `.gguf` file, the directory with `config.json` and the tokenizer files;
        default the file's own directory when `config.json` is there (`gguf_io.find_gguf_config`).
      dtype: "bfloat16" (default) or "float32" (everything computed in fp32; parity tests).
      mesh: a `jax.sharding.Mesh`; parameters and caches are sharded over it (heads and
        intermediate dims over the tensor axis, experts over "expert" or the tensor axis).
      kernels: "auto" (Pallas on GPU, XLA elsewhere), "pallas" (interpret mode on CPU), "xla".
      max_length: the longest sequence (prompt + generation) a cache may hold; default the
        config's max_position_embeddings.
    Returns: a `Flint` handle with `.config`, `.tokenizer`, `.generation_config`.
    """
    path = os.fspath(path)
    dtype = parse_dtype(dtype)
    kernels = resolve_kernels(kernels)   # the choice; each path checks the model (its config)
    if max_length is not None and max_length < 1:   # before any weight is read
        raise ValueError(f"max_length must be positive, got {max_length}")
    mesh = auto_mesh(mesh)
    if path.endswith(".gguf") or (os.path.isfile(path) and is_gguf(path)):
        if hf_config is None:
            hf_config = gguf_io.find_gguf_config(path)
        return load_gguf(path, hf_config=hf_config, dtype=dtype, mesh=mesh, kernels=kernels,
                         max_length=max_length, rules=rules)
    if not os.path.isdir(path):
        hint = ""
        if not os.path.isabs(path) and path.count("/") == 1 and not os.path.exists(
                os.path.dirname(path)):
            hint = (" (flint_jax reads local files only; a hub ID is not fetched: download it "
                    f"first, e.g. `hf download {path} --local-dir DIR`, and pass DIR)")
        raise FileNotFoundError(f"{path}: no such checkpoint directory or .gguf file{hint}")
    if os.path.exists(os.path.join(path, "flint_jax.json")):
        return load_converted(path, dtype=dtype, mesh=mesh, kernels=kernels,
                              max_length=max_length, rules=rules)
    from flint_jax import hf_io
    cfg = FlintConfig.from_json(path)
    kernels = resolve_kernels(kernels, cfg, quant=False, dtype=dtype)   # before any weight is read
    ckpt = hf_io.HFCheckpoint(path)
    sources = hf_io.plan(ckpt, cfg)
    graphdef, state = build_state(cfg, dtype, False, hf_io.iter_params(ckpt, cfg, sources),
                                  mesh=mesh, rules=rules, source=path, progress=progress)
    return make_handle(cfg, graphdef, state, dtype=dtype, quant=False, kernels=kernels, mesh=mesh,
                       rules=rules, max_length=max_length, meta_dir=path, source=path,
                       checked=True)


def auto_mesh(mesh):
    """The same devices and axis names with Auto axis types: flint_jax places parameters and
    caches itself and lets XLA partition the computation (`jax.make_mesh` defaults to Explicit
    axes, under which every gather would need an explicit output sharding)."""
    if mesh is None:
        return None
    from jax.sharding import AxisType, Mesh
    if all(t == AxisType.Auto for t in getattr(mesh, "axis_types", ())):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def make_handle(cfg, graphdef, state, *, dtype, quant, kernels, mesh, rules, max_length,
                meta_dir, source, checked: bool = False) -> Flint:
    """A `Flint` handle around a placed state. ``checked``: ``kernels`` was already resolved
    against this model (``resolve_kernels`` with its config, as `load`'s paths do before reading
    a weight), so it is not checked again and its notice not repeated."""
    cache_sh = None
    if mesh is not None:
        rules = rules or ShardingRules.for_mesh(mesh)
        # The batch and length vary per call: shardings of a [.., B, KVH, S, Dh] cache only
        # depend on divisibility, so resolve them per shape at allocation (see cache_sharding_for).
        cache_sh = _CacheShardingFactory(cfg, mesh, rules, dtype)
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not checked:
        kernels = resolve_kernels(kernels, cfg, quant=quant, dtype=dtype)
    if quant and kernels == "pallas" and jax.default_backend() == "gpu":
        # The Pallas kernels' NVFP4 decode multiplies by bf16 scale * 2^119: holding the block
        # scales that way (exact, +11% of the NVFP4 bytes) spares every kernel their conversion;
        # batch 8 decodes 6% faster, batch 1 the same (H200 run 74).
        from flint_jax import nvfp4
        state = nvfp4.prescale_state(state)
    handle = Flint(config=cfg, graphdef=graphdef, state=state, dtype=dtype, quant=quant,
                   kernels=kernels, tokenizer=Tokenizer.from_dir(meta_dir) if meta_dir else None,
                   mesh=mesh, max_length=min(max_length or cfg.max_position_embeddings,
                                             cfg.max_position_embeddings),
                   generation_config=_read_json(os.path.join(meta_dir, "generation_config.json"))
                   if meta_dir else {}, source=source)
    handle.cache_sharding = cache_sh
    return handle


class _CacheShardingFactory:
    """Builds cache shardings for a (batch, length) on demand."""

    def __init__(self, cfg, mesh, rules, dtype):
        self.cfg, self.mesh, self.rules, self.dtype = cfg, mesh, rules, dtype

    def __call__(self, batch: int, length: int):
        from flint_jax.cache import cache_shapes
        return cache_shardings(cache_shapes(self.cfg, batch, length, self.dtype), self.mesh,
                               self.rules)


def from_module(module: FlintForCausalLM, *, tokenizer: Tokenizer | None = None,
                kernels: str = "auto", max_length: int | None = None,
                generation_config: dict | None = None) -> Flint:
    """A handle around an in-memory module (random weights, research variants)."""
    graphdef, state = nnx.split(module)
    cfg = module.cfg
    h = Flint(config=cfg, graphdef=graphdef, state=state, dtype=module.dtype, quant=module.quant,
              kernels=resolve_kernels(kernels, cfg, quant=module.quant, dtype=module.dtype),
              tokenizer=tokenizer,
              max_length=min(max_length or cfg.max_position_embeddings, cfg.max_position_embeddings),
              generation_config=generation_config or {}, source="<module>")
    return h


# ---- converted checkpoints and GGUF files ------------------------------------------------------

def expected_leaves(cfg: FlintConfig, quant: bool) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{parameter name: (shape, in-memory dtype of a bf16 model)} from the NNX tree."""
    _, _, names = abstract_model(cfg, jnp.bfloat16, quant)
    out = {}
    for n, (_, var) in names.items():
        v = var.get_value()
        out[n] = (tuple(v.shape), np.dtype(v.dtype))
    return out


def check_leaves(path: str, cfg: FlintConfig, quant: bool,
                 stored: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """A converted checkpoint's stored leaves against the NNX tree of `cfg` (first problem)."""
    want = expected_leaves(cfg, quant)
    for n in stored:
        if n not in want:
            hint = ""
            m = re.match(r"model\.layers\.(\d+)\.", n)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                hint = f" (config.json has {cfg.num_hidden_layers} layers)"
            elif n.endswith(("qweight", "weight_scale", "weight_scale_2")) != quant:
                hint = f" (the manifest says quant={quant})"
            raise ConvertError(f"{path}: unexpected tensor {n!r}{hint}")
    for n, (shape, dt) in want.items():
        if n not in stored:
            raise ConvertError(f"{path}: missing tensor {n!r}")
        s_shape, s_dt = stored[n]
        if tuple(s_shape) != tuple(shape):
            raise ConvertError(f"{path}: tensor {n!r} has shape {list(s_shape)}, expected "
                               f"{list(shape)} for its config.json")
        if n.endswith(("qweight", "weight_scale")) and s_dt != dt:
            raise ConvertError(f"{path}: tensor {n!r} has dtype {s_dt}, expected {dt}")
        if not n.endswith(("qweight", "weight_scale")) and s_dt not in (BF16, F32, F16):
            raise ConvertError(f"{path}: tensor {n!r} has dtype {s_dt}, expected a float")


def load_converted(path: str, *, dtype, mesh=None, kernels: str = "xla",
                   max_length: int | None = None, rules=None):
    """Restores a flint_jax checkpoint straight onto `mesh` (or the default device): one orbax
    restore with a `ShapeDtypeStruct(shape, dtype, sharding)` target per parameter."""
    manifest = checkpoint.read_manifest(path)
    cfg = FlintConfig.from_json(path)
    quant = bool(manifest.get("quant"))
    kernels = resolve_kernels(kernels, cfg, quant=quant, dtype=dtype)   # before any weight is read
    params_dir = os.path.join(path, checkpoint.PARAMS_DIR)
    stored = checkpoint.params_metadata(params_dir)
    check_leaves(path, cfg, quant, stored)
    graphdef, _, names = abstract_model(cfg, dtype, quant)
    if mesh is not None:
        rules = rules or ShardingRules.for_mesh(mesh)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {}
    for n, (_, var) in names.items():
        want = var.get_value()
        dt = param_dtype(n, np.dtype(want.dtype), dtype)
        sh = param_sharding(n, want.shape, mesh, rules) if mesh is not None else single
        targets[n] = jax.ShapeDtypeStruct(want.shape, dt, sharding=sh)
    try:
        arrays = checkpoint.restore_params(params_dir, targets)
    except (ValueError, OSError):
        raise
    except Exception as e:
        raise ConvertError(f"{path}: restoring the parameters failed: {type(e).__name__}: "
                           f"{e}") from e
    state = nnx.from_flat_state([(p, var.replace(value=arrays[n])) for n, (p, var) in names.items()])
    return make_handle(cfg, graphdef, state, dtype=dtype, quant=quant, kernels=kernels, mesh=mesh,
                       rules=rules, max_length=max_length, meta_dir=path, source=path,
                       checked=True)


def load_gguf(path: str, *, hf_config: str | None, dtype, mesh=None, kernels: str = "xla",
              max_length: int | None = None, rules=None, mixed: str = "refuse",
              progress: bool = False):
    """Loads an NVFP4 (or BF16) GGUF file directly: tensors are read and repacked one at a time
    and placed on their devices (`build_state`; the GGUF reading and repacking is
    `convert.plan_gguf`'s)."""
    plan = plan_gguf(path, hf_config, mixed=mixed)   # the header and config.json: no tensor read
    kernels = resolve_kernels(kernels, plan.cfg, quant=plan.quant, dtype=dtype)
    graphdef, state = build_state(plan.cfg, dtype, plan.quant,
                                  ((t.name, t.produce()) for t in plan.tensors),
                                  mesh=mesh, rules=rules, source=path, progress=progress)
    return make_handle(plan.cfg, graphdef, state, dtype=dtype, quant=plan.quant, kernels=kernels,
                       mesh=mesh, rules=rules, max_length=max_length, meta_dir=hf_config,
                       source=path, checked=True)
