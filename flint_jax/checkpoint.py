"""The flint_jax checkpoint format: an orbax PyTree `{dotted parameter name: array}` plus JSON.

A converted checkpoint is a directory::

    DST/
      flint_jax.json            manifest: format, format_version, quant, weight dtype, source, sizes
      config.json               FlintConfig.to_dict() (loadable by transformers and vLLM too)
      generation_config.json    copied from the source when present
      tokenizer.json, ...       tokenizer files copied from the source when present
      params/                   orbax PyTree checkpoint (OCDBT + zarr, uncompressed), a flat dict:
                                one leaf per NNX parameter, named like `nnx.state(model)` paths
                                joined with dots ("model.layers.3.mlp.experts.gate_up_qweight")

Leaves keep the dtype they were converted with (bf16 or fp32 weights, fp32 router / sinks /
NVFP4 tensor scales, uint8 `qweight`, float8_e4m3fn `weight_scale`); restoring casts to the
dtype asked for (tensorstore casts on read), so one checkpoint serves bf16 and fp32 loads.

Writing streams: each leaf is a `LazyTensor` (shape, dtype and a function producing the array).
orbax's own `PyTreeCheckpointHandler` writes the tree, with a type handler (`_LazyTensorHandler`)
that produces one leaf, writes it through tensorstore, drops it, and moves on (a few leaves are
produced ahead in threads, `workers`), so peak host memory is a few tensors whatever the model
size, and the result is a plain orbax checkpoint restorable by `ocp.PyTreeCheckpointer`,
`ocp.StandardCheckpointer` or `restore_params`.

Restoring (`restore_params`) passes one `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` per
leaf: orbax reads each device's shard from tensorstore and puts it on that device; the host holds
at most `restore_concurrent_gb` of staging at a time, never a full copy of the model. Arrays are
stored in chunks of at most `CHUNK_BYTES`, so a device reads little beyond its own shard.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

FORMAT = "flint_jax"
FORMAT_VERSION = 1
MANIFEST = "flint_jax.json"
PARAMS_DIR = "params"
# zarr chunk size: small enough that a shard reads little more than itself, large enough that a
# 40B model is a few thousand chunks.
CHUNK_BYTES = 64 << 20
# Bytes being written at once (beyond the leaves produced ahead): concurrent writes share one
# OCDBT commit; this bounds the host memory they hold.
INFLIGHT_BYTES = 128 << 20
MAX_INFLIGHT_TENSORS = 64
# Host staging allowed in flight while restoring (orbax's restore_concurrent_gb).
RESTORE_CONCURRENT_GB = 4


class CheckpointFormatError(ValueError):
    """A flint_jax checkpoint directory that cannot be read (the message names the path)."""


@dataclasses.dataclass(eq=False)
class LazyTensor:
    """One leaf to write: `produce()` returns a numpy array of `shape` and `dtype`.

    `produce` is called once, from a worker thread, just before the leaf is written.
    `on_written(tensor)` (optional) is called after the leaf is on disk (progress bars).
    """
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]
    on_written: Callable[["LazyTensor"], None] | None = None

    def __post_init__(self):
        self.shape = tuple(int(d) for d in self.shape)
        self.dtype = np.dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class TensorGroup:
    """Several leaves computed by one function (e.g. `qweight` and `weight_scale` of one GGUF
    tensor). The function runs once, at the first `take`; each output is handed out once and then
    dropped, so memory is held only until every sibling has been written."""

    def __init__(self, fn: Callable[[], Mapping[str, np.ndarray]]):
        self._fn, self._out, self._lock = fn, None, threading.Lock()

    def take(self, key: str) -> np.ndarray:
        with self._lock:
            if self._out is None:
                self._out = dict(self._fn())
                self._fn = None
            return self._out.pop(key)


# ---- the orbax type handler -----------------------------------------------------------------

def _handler_class():
    from orbax.checkpoint import future as ocp_future
    from orbax.checkpoint import type_handlers

    class _LazyTensorHandler(type_handlers.NumpyHandler):
        """Writes LazyTensor leaves one by one (produced `workers` ahead) as orbax numpy arrays."""

        def __init__(self, workers: int = 2, stop: "_WriterStop | None" = None):
            super().__init__()
            self.workers = max(1, int(workers))
            self.stop = stop or _WriterStop()

        def typestr(self) -> str:
            return "np.ndarray"  # restores as a plain numpy / jax array

        async def _write_one(self, value: np.ndarray, info, arg):
            if hasattr(self, "_background_serialize"):  # orbax 0.12.x: no defensive copy
                await self._background_serialize([value], [info], [arg])
                return
            futures = await super().serialize([value], [info], [arg])  # pragma: no cover
            for f in futures:
                await asyncio.to_thread(f.result)

        async def serialize(self, values, infos, args=None):
            from orbax.checkpoint import SaveArgs
            args = args or [SaveArgs()] * len(values)
            for v, info in zip(values, infos):
                if not isinstance(v, LazyTensor):
                    raise TypeError(f"{info.name}: expected a LazyTensor, got {type(v).__name__}")
            workers = self.workers

            def produce(t: LazyTensor) -> np.ndarray:
                arr = np.asarray(t.produce())
                if arr.shape != t.shape or arr.dtype != t.dtype:  # a bug in the plan, not bad input
                    raise ValueError(f"tensor {t.name!r}: produced {arr.dtype}{list(arr.shape)}, "
                                     f"expected {t.dtype}{list(t.shape)}")
                # (np.ascontiguousarray would turn a 0-d tensor scale into shape [1])
                return arr if arr.flags.c_contiguous else arr.copy(order="C")

            stop = self.stop

            async def produced(fut):
                # The next leaf, without waiting for a slow producer (an expert stack) once a
                # stop is asked for.
                w = asyncio.wrap_future(fut)
                while True:
                    done, _ = await asyncio.wait({w}, timeout=0.05)
                    if done:
                        return w.result()
                    if stop.requested:
                        raise concurrent.futures.CancelledError

            async def run():
                # Leaves are produced `workers` ahead in threads and written with up to
                # `INFLIGHT_BYTES` (at least one leaf) in flight: tensorstore batches concurrent
                # writes into one OCDBT commit, small leaves no longer pay one commit each.
                # A stop request (`_WriterStop`, an interrupt in the caller) ends it between
                # leaves, as a CancelledError, which orbax's thread does not log.
                if not stop.enter():
                    raise concurrent.futures.CancelledError
                pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="flint-ckpt")
                pending: list = [None] * len(values)
                writing: list[tuple[asyncio.Task, LazyTensor]] = []
                inflight = 0

                async def drain(limit):
                    nonlocal inflight
                    while writing and (inflight > limit or len(writing) > MAX_INFLIGHT_TENSORS):
                        task, t = writing.pop(0)
                        await task
                        inflight -= t.nbytes
                        if t.on_written is not None:
                            t.on_written(t)

                try:
                    nxt = 0
                    for i, (t, info, arg) in enumerate(zip(values, infos, args)):
                        if stop.requested:
                            raise concurrent.futures.CancelledError
                        while nxt < len(values) and nxt <= i + workers - 1:
                            pending[nxt] = pool.submit(produce, values[nxt])
                            nxt += 1
                        arr = await produced(pending[i])
                        pending[i] = None
                        await drain(max(0, INFLIGHT_BYTES - t.nbytes))
                        if stop.requested:
                            raise concurrent.futures.CancelledError
                        writing.append((asyncio.ensure_future(self._write_one(arr, info, arg)), t))
                        inflight += t.nbytes
                        del arr
                    await drain(-1)
                finally:
                    # On an error or a stop, let the writes already started finish (cancelling
                    # the await would not stop tensorstore, whose late writes would recreate
                    # directories the caller is removing), and stop producing (after a stop,
                    # without waiting for a producer still computing: it writes nothing).
                    try:
                        for f in pending:
                            if f is not None:
                                f.cancel()
                        if writing:
                            await asyncio.gather(*(w for w, _ in writing), return_exceptions=True)
                        pool.shutdown(wait=not stop.requested, cancel_futures=True)
                    finally:
                        stop.leave()

            return [ocp_future.CommitFutureAwaitingContractedSignals(run(), name="flint_lazy")]

    return _LazyTensorHandler


_HANDLER_CLASS = None


class _WriterStop:
    """Lets the caller of `write_params` stop its writer and wait until no write of it is in
    flight (so that removing the partial directory is final)."""

    WAIT_S = 2.0

    def __init__(self):
        self._cv = threading.Condition()
        self._requested = False
        self._running = 0

    @property
    def requested(self) -> bool:
        from flint_jax import output_path
        return self._requested or output_path.interrupt_requested()

    def enter(self) -> bool:
        with self._cv:
            if self.requested:
                return False
            self._running += 1
            return True

    def leave(self) -> None:
        with self._cv:
            self._running -= 1
            self._cv.notify_all()

    def stop_and_wait(self, timeout: float | None = None) -> bool:
        """Asks the writer to stop; True once none of its writes is in flight."""
        with self._cv:
            self._requested = True
            return self._cv.wait_for(lambda: self._running == 0,
                                     self.WAIT_S if timeout is None else timeout)


def _save_handler(workers: int, stop: _WriterStop | None = None):
    global _HANDLER_CLASS
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers
    if _HANDLER_CLASS is None:
        _HANDLER_CLASS = _handler_class()
    registry = type_handlers.create_type_handler_registry(
        (LazyTensor, _HANDLER_CLASS(workers, stop)))
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, use_compression=False,
                                       type_handler_registry=registry)


@contextlib.contextmanager
def _quiet_absl():
    """orbax logs through absl (INFO lines, and a traceback at ERROR when a producer raises, which
    is then re-raised to our caller anyway): silence it while we call orbax."""
    logger = logging.getLogger("absl")
    old = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(old)


def write_params(directory: str, tensors: Sequence[LazyTensor], *, workers: int = 2) -> None:
    """Writes `tensors` as an orbax PyTree checkpoint at `directory` (which must not exist).

    Leaves are produced and written in name order, `workers` produced ahead in threads; an
    exception from a producer (or from the writer) propagates and the caller removes the
    partial directory. On a KeyboardInterrupt (or any exception) in the calling thread, the
    writer is stopped and its writes in flight are awaited before the exception propagates, so
    that nothing writes into the directory afterwards.
    """
    import orbax.checkpoint as ocp
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor {dup!r} given twice")
    tree = {t.name: t for t in tensors}
    save_args = {t.name: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for t in tensors}
    stop = _WriterStop()
    with _quiet_absl():
        ckptr = ocp.Checkpointer(_save_handler(workers, stop))
        try:
            ckptr.save(os.path.abspath(directory), args=ocp.args.PyTreeSave(tree, save_args=save_args))
        except BaseException:
            from flint_jax import output_path
            output_path.handling()
            stop.stop_and_wait()
            raise
        ckptr.close()


def params_metadata(directory: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{leaf name: (shape, dtype)} of an orbax params directory, read from its metadata only."""
    import orbax.checkpoint as ocp
    if not os.path.isdir(directory):
        raise CheckpointFormatError(f"{directory}: no orbax parameter directory")
    try:
        with _quiet_absl():
            meta = ocp.PyTreeCheckpointer().metadata(os.path.abspath(directory))
    except Exception as e:  # orbax raises many kinds on a damaged directory
        raise CheckpointFormatError(f"{directory}: cannot read the orbax checkpoint metadata "
                                    f"({type(e).__name__}: {e})") from e
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    out = {}
    try:
        items = dict(tree).items()
    except Exception as e:
        raise CheckpointFormatError(f"{directory}: unexpected orbax metadata ({e})") from e
    for name, m in items:
        if not hasattr(m, "shape") or not hasattr(m, "dtype"):
            raise CheckpointFormatError(f"{directory}: leaf {name!r} is not an array ({m!r})")
        out[str(name)] = (tuple(int(d) for d in m.shape), np.dtype(m.dtype))
    return out


def restore_params(directory: str, targets: Mapping[str, jax.ShapeDtypeStruct], *,
                   restore_concurrent_gb: int = RESTORE_CONCURRENT_GB) -> dict[str, jax.Array]:
    """Restores every leaf straight into `targets[name]`: its shape, dtype (cast on read) and
    sharding (each device reads its own shard). `targets` must name exactly the stored leaves."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_utils
    targets = dict(targets)
    restore_args = checkpoint_utils.construct_restore_args(targets)
    with _quiet_absl():
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
            restore_concurrent_gb=restore_concurrent_gb))
        try:
            out = ckptr.restore(os.path.abspath(directory),
                                args=ocp.args.PyTreeRestore(item=targets, restore_args=restore_args))
        finally:
            ckptr.close()
    return dict(out)


# ---- the manifest -----------------------------------------------------------------------------

def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}, f, indent=2)
        f.write("\n")


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{directory}: not a flint_jax checkpoint (no {MANIFEST})") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointFormatError(f"{path}: not a flint_jax manifest (format {m.get('format')!r})"
                                    if isinstance(m, dict) else f"{path}: not a JSON object")
    if m.get("format_version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: format_version {m.get('format_version')!r}; this "
                                    f"flint_jax reads version {FORMAT_VERSION}")
    return m


def is_converted(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST))


def ordered_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int = 2):
    """Yields `fn(item)` in order, computing at most `workers` items ahead in threads (bounded
    memory: a streaming writer consumes one result while the next ones are produced)."""
    from flint_jax import output_path
    workers = max(1, int(workers))
    if workers == 1:
        for item in items:
            output_path.check_interrupt()
            yield fn(item)
        return
    items = list(items)
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="flint-map")
    pending: dict[int, concurrent.futures.Future] = {}
    finished = False
    try:
        for i in range(len(items)):
            for j in range(i, min(len(items), i + workers)):
                if j not in pending:
                    pending[j] = pool.submit(fn, items[j])
            yield pending.pop(i).result()
            output_path.check_interrupt()
        finished = True
    finally:
        # On an error or an interrupt, do not wait for the items still being computed (only
        # memory is at stake: `fn` produces, the consumer writes).
        for f in pending.values():
            f.cancel()
        pool.shutdown(wait=finished, cancel_futures=True)
