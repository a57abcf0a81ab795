"""The model handle (`Flint`: config, tokenizer, split state, jitted steps), prefill, decoding
and `generate`: the host loop around the jitted steps.

- `nnx.split` happens once at load; every step is a `jax.jit` of a pure function of the state
  (with the cache donated), cached on the handle (`Flint.jitted`), so a call costs about its
  compute instead of NNX's graph traversal.

- Prompts are right-padded into `[B, T]` with per-row lengths; each row's tokens sit at their true
  positions, padding is never written to the sliding rings nor attended.
- Prefill runs in chunks (one compiled function per chunk shape): on the Pallas prefill kernels
  (`flint_jax.prefill`) where `Flint.pallas_prefill`, else the XLA chunk step.
- The cache length is bucketed (a power of two >= prompt + new tokens, at least 64) so
  different prompt lengths reuse compiled steps; it is sized and checked before allocation.
- Each decode step is one jitted call (model, sampling and the seen-token mask fused; the cache
  donated). Tokens stream out as they are produced.
- The first call for a new batch size or cache length compiles the steps (4-30 s on a 2-core CPU
  for the demo model, depending on load): a one-line notice goes to the `flint_jax` logger at
  INFO level first (the CLI prints it on stderr). Each call's timings (time to first token,
  prompt and generation tokens/s, compile time) are in `GenerationStats`.
- `max_new_tokens` beyond the cache's room is clamped with a `MaxNewTokensClampedWarning`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flint_jax import prefill as pallas_prefill
from flint_jax import sampling
from flint_jax.cache import check_cache_fits
from flint_jax.config import FlintConfig
from flint_jax.tokenizer import Tokenizer


@dataclasses.dataclass(eq=False)
class Flint:
    """A loaded Flint model.

    Attributes: `config` (FlintConfig), `tokenizer` (Tokenizer or None), `graphdef`/`state` (the
    `nnx.split` of the module tree), `dtype`, `quant` (NVFP4 linear layers), `kernels` ("xla" or
    "pallas"), `mesh` (or None), `max_length` (the longest sequence a cache may hold),
    `generation_config` (dict from generation_config.json), `source` (path loaded),
    `decode_plan` (a function (quant, batch) -> `fast_decode.DecodePlan` for the Pallas step, or
    None for `fast_decode.decode_plan`, the measured choices), `prefill_kernels` ("auto": the
    Pallas prefill kernels (`flint_jax.prefill`: grouped-GEMM experts, flash attention with
    sinks, chunks of thousands of tokens) where `kernels` is "pallas" on a GPU, else the XLA
    chunk step; "pallas" forces them, in interpret mode off the GPU; "xla" never).
    """

    config: FlintConfig
    graphdef: Any
    state: Any
    dtype: Any = jnp.bfloat16
    quant: bool = False
    kernels: str = "xla"
    tokenizer: Tokenizer | None = None
    mesh: jax.sharding.Mesh | None = None
    max_length: int = 0
    generation_config: dict = dataclasses.field(default_factory=dict)
    source: str = ""
    cache_sharding: Any = None
    # (quant, batch) -> fast_decode.DecodePlan for the Pallas step (None: fast_decode.decode_plan);
    # may be changed at any time (the jitted steps are keyed by it).
    decode_plan: Any = None
    prefill_kernels: str = "auto"

    def __post_init__(self):
        if not self.max_length:
            self.max_length = self.config.max_position_embeddings
        self._jit_cache: dict = {}
        # (jit cache key, shapes) already run: a step called with a new entry compiles first
        # (a notice is logged then, `_new_shapes`).
        self._compiled_shapes: set = set()
        self._flat = None

    def jitted(self, key, build):
        """The jitted function cached on this handle under ``key`` (a hashable), made by
        ``build()`` (returning a ``jax.jit``) on first use: how ``forward``, ``research`` and
        the steps below keep one compiled function per shape family."""
        if key not in self._jit_cache:
            self._jit_cache[key] = build()
        return self._jit_cache[key]

    @property
    def steps(self):
        """{key: jitted function} of the steps built so far (read-only; key[0] names the kind:
        "chunk", "decode", "decode_logits", "sample", "forward", ...)."""
        return types.MappingProxyType(self._jit_cache)

    @property
    def leaves(self) -> list:
        """The state's arrays as a flat list: what the jitted steps take. Flattening the NNX
        State on every call costs ~2.7 ms for Flint's 732 leaves (Python pytree nodes); a list
        costs ~0.4 ms, and the tree is rebuilt inside jit, at trace time only."""
        if self._flat is None or self._flat[0] is not self.state:
            leaves, treedef = jax.tree.flatten(self.state)
            self._flat = (self.state, leaves, treedef)
        return self._flat[1]

    @property
    def treedef(self):
        self.leaves  # noqa: B018 (refreshes the cache)
        return self._flat[2]

    def _unflatten(self):
        treedef = self.treedef
        return lambda leaves: jax.tree.unflatten(treedef, leaves)

    @property
    def module(self):
        """The NNX module tree (a fresh merge: for research, not for the hot path)."""
        return nnx.merge(self.graphdef, self.state)

    def __repr__(self):
        c = self.config
        return (f"Flint({c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_experts} "
                f"experts, dtype={jnp.dtype(self.dtype).name}, nvfp4={self.quant}, "
                f"kernels={self.kernels!r}, source={self.source!r})")

    @property
    def pallas_prefill(self) -> bool:
        """Whether prompts go through the Pallas prefill kernels (see `prefill_kernels`)."""
        if self.prefill_kernels not in ("auto", "pallas", "xla"):
            raise ValueError(f"prefill_kernels must be 'auto', 'pallas' or 'xla', got "
                             f"{self.prefill_kernels!r}")
        if self.prefill_kernels == "auto":
            return self.kernels == "pallas" and jax.default_backend() == "gpu"
        return self.prefill_kernels == "pallas"

    # ---- jitted pure functions, built once per handle -------------------------------------
    def chunk_fn(self, logits: str, capture: tuple[str, ...] = ()):
        """jit(leaves, tokens [B,T], cache, n_tokens [B]) -> (logits, cache, captured); cache donated."""
        def build():
            graphdef, unflatten = self.graphdef, self._unflatten()

            def run(leaves, tokens, cache, n_tokens):
                return nnx.merge(graphdef, unflatten(leaves))(tokens, cache, n_tokens,
                                                              logits=logits, capture=capture)

            return jax.jit(run, donate_argnums=(2,))
        return self.jitted(("chunk", logits, capture), build)

    def decode_fn(self, params: sampling.SamplingParams, with_seen: bool, n_steps: int = 1):
        """jit(leaves, cache, tokens [B], key, seen) -> (tokens [B, n], logprobs [B, n], cache,
        seen, key).

        `n_steps` decode steps with sampling fused in, in one call (a `fori_loop` on the device:
        the host's per-call cost is paid once per `n_steps` tokens); the cache and the seen-token
        mask are donated. The returned key continues the chain.
        """
        def build():
            step = self.decode_logits_fn_raw()
            unflatten = self._unflatten()

            def one(state, cache, tokens, rng, seen):
                rng, step_rng = jax.random.split(rng)
                logits, cache = step(state, cache, tokens)
                nxt = sampling.sample(logits, step_rng, params, seen if with_seen else None)
                lp = sampling.token_logprobs(logits, nxt)
                if with_seen:
                    seen = seen.at[jnp.arange(nxt.shape[0]), nxt].set(True)
                return nxt, lp, cache, seen, rng

            def run(leaves, cache, tokens, rng, seen):
                state = unflatten(leaves)
                b = tokens.shape[0]
                out_t = jnp.zeros((b, n_steps), jnp.int32)
                out_lp = jnp.zeros((b, n_steps), jnp.float32)

                def body(i, carry):
                    cache, tokens, rng, seen, out_t, out_lp = carry
                    nxt, lp, cache, seen, rng = one(state, cache, tokens, rng, seen)
                    return (cache, nxt, rng, seen, out_t.at[:, i].set(nxt),
                            out_lp.at[:, i].set(lp))

                carry = (cache, tokens, rng, seen, out_t, out_lp)
                if n_steps == 1:
                    carry = body(0, carry)
                else:
                    carry = jax.lax.fori_loop(0, n_steps, body, carry)
                cache, _, rng, seen, out_t, out_lp = carry
                return out_t, out_lp, cache, seen, rng

            return jax.jit(run, donate_argnums=(1, 4))
        return self.jitted(("decode", params, with_seen, self.kernels, self.decode_plan, n_steps),
                           build)

    def decode_logits_fn_raw(self):
        """The un-jitted decode step `(state, cache, tokens [B]) -> (f32 logits [B, V], cache)`
        of the chosen kernel path."""
        graphdef, cfg = self.graphdef, self.config

        def xla_step(state, cache, tokens):
            n = jnp.ones(tokens.shape, jnp.int32)
            logits, cache, _ = nnx.merge(graphdef, state)(tokens[:, None], cache, n, logits="last")
            return logits, cache

        if self.kernels == "pallas":
            from flint_jax import fast_decode
            return fast_decode.make_decode_step(graphdef, cfg, fallback=xla_step,
                                                interpret=jax.default_backend() != "gpu",
                                                plan=self.decode_plan)
        return xla_step

    def decode_logits_fn(self):
        """jit(leaves, cache, tokens [B]) -> (f32 logits [B, V], cache), cache donated."""
        def build():
            step, unflatten = self.decode_logits_fn_raw(), self._unflatten()
            return jax.jit(lambda leaves, cache, tokens: step(unflatten(leaves), cache, tokens),
                           donate_argnums=(1,))
        return self.jitted(("decode_logits", self.kernels, self.decode_plan), build)

    def sample_fn(self, params: sampling.SamplingParams, with_seen: bool):
        def build():
            def run(logits, rng, seen):
                nxt = sampling.sample(logits, rng, params, seen if with_seen else None)
                lp = sampling.token_logprobs(logits, nxt)
                if with_seen:
                    seen = seen.at[jnp.arange(nxt.shape[0]), nxt].set(True)
                return nxt, lp, seen
            return jax.jit(run, donate_argnums=(2,))
        return self.jitted(("sample", params, with_seen), build)

logger = logging.getLogger("flint_jax")

# How messages name the cache's length setting: the Python API's argument by default; the CLI
# sets its flag (`--max-length`) so that its errors and warnings name what its user can pass.
MAX_LENGTH_HINT: contextvars.ContextVar[str] = contextvars.ContextVar(
    "flint_jax_max_length_hint", default="load(..., max_length=N)")


class PromptTooLongError(ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's maximum length."""


class MaxNewTokensClampedWarning(UserWarning):
    """`max_new_tokens` asked for more positions than the cache holds: it was lowered."""


@dataclasses.dataclass
class GenerationStats:
    """Timings of one `generate` / `stream_generate` call (all rows together).

    ttft_s: seconds from the call to the first generated token (compilation included, as a
      user waits for it). decode_s: wall time of the decoding after the first token.
      compile_s: the time spent tracing and compiling steps for new shapes (0 on a warm call).
      prompt_tokens_per_s: prompt tokens (every row) per second of prefill;
      generation_tokens_per_s: tokens decoded after the first (every row) per second of
      decoding; both exclude compile time (None when nothing was timed, e.g. a single new
      token).
    """
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    decode_s: float | None = None
    compile_s: float = 0.0
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    _prefill_compile_s: float = dataclasses.field(default=0.0, repr=False)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}

    def summary(self) -> str:
        """One line: `12 prompt tokens at 350 tok/s, 30 generated at 42.1 tok/s, first token
        after 0.41 s (of which compiling 0.3 s)`."""
        def rate(x):
            return "-" if x is None else f"{x:.1f} tok/s"
        parts = [f"{self.prompt_tokens} prompt tokens at {rate(self.prompt_tokens_per_s)}",
                 f"{self.generated_tokens} generated at {rate(self.generation_tokens_per_s)}"]
        if self.ttft_s is not None:
            parts.append(f"first token after {self.ttft_s:.2f} s")
        line = ", ".join(parts)
        if self.compile_s:
            line += f" (of which compiling {self.compile_s:.1f} s)"
        return line


@dataclasses.dataclass
class GenerationOutput:
    """One row's result: generated token ids, text (when a tokenizer is there), why it stopped
    ("stop": a stop token or string, "length": max_new_tokens), and per-token logprobs."""
    token_ids: np.ndarray
    text: str | None
    finish_reason: str
    logprobs: np.ndarray | None = None
    prompt_ids: np.ndarray | None = None
    stats: GenerationStats | None = None  # the call's timings (shared by its rows)


class GeneratedText(str):
    """The generated text, a `str`, carrying `.token_ids`, `.finish_reason`, `.logprobs` and
    `.stats` (the call's `GenerationStats`)."""
    token_ids: np.ndarray
    finish_reason: str
    logprobs: np.ndarray | None
    stats: GenerationStats | None
    output: GenerationOutput

    @classmethod
    def of(cls, out: GenerationOutput) -> "GeneratedText":
        s = cls(out.text or "")
        s.token_ids, s.finish_reason, s.logprobs, s.stats, s.output = (
            out.token_ids, out.finish_reason, out.logprobs, out.stats, out)
        return s


class GenerationStream:
    """The iterator `generate(..., stream=True)` returns: `StreamEvent`s, and `.stats` (a
    `GenerationStats`, complete once the iterator is exhausted)."""

    def __init__(self, events: Iterator[StreamEvent], stats: GenerationStats):
        self._events, self.stats = events, stats

    def __iter__(self):
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self):
        self._events.close()


@dataclasses.dataclass
class StreamEvent:
    """A streamed token: the row it belongs to, its id, the new text it adds (may be empty while
    a multi-byte character is incomplete), its logprob, and the finish reason once it ends."""
    row: int
    token_id: int
    text: str
    logprob: float | None = None
    finish_reason: str | None = None


def bucket_length(n: int, max_length: int, minimum: int = 64) -> int:
    """A power of two >= n (at least `minimum`), capped at `max_length` rounded up to a multiple
    of 256 (so the decode kernels' key blocks divide it)."""
    b = max(minimum, 1 << max(0, int(n - 1).bit_length()))
    return min(b, -(-max_length // 256) * 256)


def _as_rows(prompt, tokenizer) -> tuple[list[list[int]], bool, bool]:
    """Normalises a prompt to token id rows. Returns (rows, is_text, single)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; this checkpoint has no tokenizer.json "
                             "(pass token ids instead)")
        return [tokenizer.encode(prompt)], True, True
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this checkpoint has no tokenizer.json")
        return [tokenizer.encode(p) for p in prompt], True, False
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple, np.ndarray)):
        return [[int(t) for t in row] for row in prompt], False, False
    arr = np.asarray(prompt)
    if arr.ndim == 1 and arr.size and np.issubdtype(arr.dtype, np.integer):
        return [arr.tolist()], False, True
    if arr.ndim == 2 and np.issubdtype(arr.dtype, np.integer):
        return [row.tolist() for row in arr], False, False
    raise ValueError("prompt must be a string, a list of strings, or token ids [T] or [B, T] "
                     f"(got {type(prompt).__name__} {getattr(arr, 'shape', '')})")


def _check_rows(model: Flint, rows: list[list[int]], max_new_tokens: int) -> int:
    """Checks the prompts; returns `max_new_tokens`, lowered (with a warning) to what the cache
    has room for after the longest prompt."""
    vocab = model.config.vocab_size
    hint = MAX_LENGTH_HINT.get()
    for b, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt row {b} is empty: at least one token is needed")
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt row {b} holds token id {bad[0]} outside the vocabulary "
                             f"(0..{vocab - 1})")
        need = len(row) + min(max_new_tokens, 1)  # room for one new token at least
        if need > model.max_length:
            raise PromptTooLongError(
                f"prompt row {b} has {len(row)} tokens"
                + (" and needs a position for a new token" if need > len(row) else "")
                + f", but the cache holds at most {model.max_length} positions "
                f"(raise it with {hint}, up to the config's max_position_embeddings "
                f"{model.config.max_position_embeddings})")
    longest = max((len(r) for r in rows), default=0)
    room = model.max_length - longest
    if max_new_tokens > room:
        warnings.warn(
            f"max_new_tokens={max_new_tokens} does not fit: the cache holds {model.max_length} "
            f"positions and the longest prompt takes {longest}; generating at most {room} tokens "
            f"(raise the cache's length with {hint}, up to the config's max_position_embeddings "
            f"{model.config.max_position_embeddings})", MaxNewTokensClampedWarning, stacklevel=4)
        max_new_tokens = room
    return max_new_tokens


def _new_shapes(model: Flint, keys: Sequence[tuple]) -> list[tuple]:
    """The (jit cache key, shape) pairs not yet run on this handle; records them as run."""
    seen = model._compiled_shapes
    new = [k for k in keys if k not in seen]
    seen.update(new)
    return new


def _compile_notice(model: Flint, what: str, shape: str):
    logger.info(f"compiling the {what} for {shape} (the first call with these shapes: from "
                f"seconds to a minute or more) ...")


#: The XLA path's prefill chunk (tokens per row): its MoE is a dense `ragged_dot`.
XLA_CHUNK = 256


def prefill_chunk(t_max: int, cache_length: int, chunk_size: int | None = None,
                  model: Flint | None = None, batch: int = 1) -> int:
    """The prefill chunk length for prompts of at most `t_max` tokens: `chunk_size` if given,
    else on the Pallas prefill kernels `flint_jax.prefill.chunk_length` (a power of two, up to
    16K tokens per chunk over the batch: each expert's weights read once per thousands of
    tokens), on the XLA path `XLA_CHUNK`; never longer than the cache's bucket needs."""
    if chunk_size is None and model is not None and model.pallas_prefill:
        return pallas_prefill.chunk_length(batch, t_max)
    return min(chunk_size or XLA_CHUNK, bucket_length(t_max, cache_length, minimum=16))


def _prefill_step(model: Flint, logits: str):
    """The jitted chunk step of the prefill path `model` uses (`Flint.pallas_prefill`)."""
    if model.pallas_prefill:
        return pallas_prefill.chunk_fn(model, logits)
    return model.chunk_fn(logits)


def prefill(model: Flint, rows: list[list[int]], cache_length: int, chunk_size: int | None = None,
            stats: GenerationStats | None = None):
    """Allocates a cache and runs the prompts through it in chunks (`prefill_chunk`), on the
    Pallas prefill kernels or the XLA chunk step (`Flint.prefill_kernels`).

    Returns (last-token logits f32 [B, V], cache). Rows may have different lengths. With
    `stats`, the first chunk call's time is added to `stats.compile_s` (when the caller knows it
    compiles).
    """
    chunk = prefill_chunk(max(len(r) for r in rows), cache_length, chunk_size, model, len(rows))
    return pallas_prefill.run_prefill(model, rows, cache_length, chunk,
                                      _prefill_step(model, "last"), stats)


def _key_of(seed, key):
    if key is not None:
        return key
    return jax.random.key(0 if seed is None else int(seed))


class _TextTracker:
    """Incremental detokenisation of one row; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tok is None:
            return ""
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


def stream_generate(model: Flint, rows: list[list[int]], *, max_new_tokens: int = 256,
                    params: sampling.SamplingParams | None = None, seed: int | None = None,
                    key: jax.Array | None = None, stop_token_ids: Sequence[int] | None = None,
                    stop: Sequence[str] | None = None, chunk_size: int | None = None,
                    decode_block: int | None = None,
                    stats: GenerationStats | None = None) -> Iterator[StreamEvent]:
    """Yields a `StreamEvent` per generated token per live row, in step order.

    `decode_block` decode steps run per device call (default 8 on GPU, 1 elsewhere): the host's
    per-call cost is paid once per block, and tokens stream out block by block. Rows may run a
    few steps past their stop inside a block; those tokens are dropped. `max_new_tokens` beyond
    the cache's room after the longest prompt is lowered with a `MaxNewTokensClampedWarning`.
    `stats`, when given, is filled in as the generation runs (complete once it ends).
    """
    t_start = time.perf_counter()
    stats = stats if stats is not None else GenerationStats()
    params = (params or sampling.SamplingParams()).validate()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_new_tokens = _check_rows(model, rows, max_new_tokens)
    b = len(rows)
    stats.prompt_tokens = sum(len(r) for r in rows)
    stop_ids = set(int(t) for t in (stop_token_ids if stop_token_ids is not None else []))
    stop = [s for s in (stop or []) if s]
    if stop and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")
    t_max = max(len(r) for r in rows)
    cache_len = bucket_length(t_max + max_new_tokens, model.max_length)
    with_seen = params.repetition_penalty != 1.0
    if decode_block is None:
        decode_block = 8 if jax.default_backend() == "gpu" else 1
    # The steps this call runs, by jit key and shape: a new one compiles on its first call.
    chunk = prefill_chunk(t_max, cache_len, chunk_size, model, b)
    steps = {"prefill step": ("chunk", model.pallas_prefill, "last", b, chunk, cache_len),
             "sampler": ("sample", params, with_seen, b)}
    if max_new_tokens > 1:
        steps["decode step"] = ("decode", params, with_seen, model.kernels, model.decode_plan,
                                decode_block, b, cache_len)
    new = _new_shapes(model, list(steps.values()))
    if new:
        names = [n for n, k in steps.items() if k in new]
        _compile_notice(model, (", ".join(names[:-1]) + " and " if len(names) > 1 else "")
                        + names[-1], f"batch {b}, cache length {cache_len}")
    logits, cache = prefill(model, rows, cache_len, chunk_size,
                            stats if steps["prefill step"] in new else None)
    seen = None
    if with_seen:
        seen_np = np.zeros((b, model.config.vocab_size), bool)
        for i, r in enumerate(rows):
            seen_np[i, r] = True
        seen = jnp.asarray(seen_np)
    rng = _key_of(seed, key)
    rng, step_rng = jax.random.split(rng)
    t0 = time.perf_counter()
    nxt, lp, seen = model.sample_fn(params, with_seen)(logits, step_rng, seen)
    if steps["sampler"] in new:
        stats.compile_s += time.perf_counter() - t0
    step_fn = model.decode_fn(params, with_seen, decode_block)
    compile_decode = steps.get("decode step") in new
    trackers = [_TextTracker(model.tokenizer) for _ in range(b)]
    done = [False] * b
    block = (nxt[:, None], lp[:, None])  # the first token, from the prefill logits
    produced, dispatched, last = 0, 1, nxt
    t_first = None
    try:
        while block is not None:
            nxt_block = None
            if dispatched < max_new_tokens:  # dispatch the next block before reading this one
                t0 = time.perf_counter()
                toks_d, lps_d, cache, seen, rng = step_fn(model.leaves, cache, last, rng, seen)
                if compile_decode:
                    stats.compile_s += time.perf_counter() - t0
                    compile_decode = False
                last, nxt_block = toks_d[:, -1], (toks_d, lps_d)
                dispatched += decode_block
            toks, lps = np.asarray(block[0]), np.asarray(block[1])
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t_start
                stats._prefill_compile_s = stats.compile_s
                run = stats.ttft_s - stats.compile_s
                stats.prompt_tokens_per_s = stats.prompt_tokens / run if run > 0 else None
            for j in range(toks.shape[1]):
                if produced == max_new_tokens or all(done):
                    break
                produced += 1
                last_step = produced == max_new_tokens
                for i in range(b):
                    if done[i]:
                        continue
                    tid = int(toks[i, j])
                    reason = None
                    if tid in stop_ids:
                        reason, text = "stop", ""
                        trackers[i].ids.append(tid)
                    else:
                        text = trackers[i].add(tid)
                        for s in stop:
                            cut = trackers[i].text.find(s)
                            if cut >= 0:
                                keep = cut - (len(trackers[i].text) - len(text))
                                text = text[:max(0, keep)]
                                trackers[i].text = trackers[i].text[:cut]
                                reason = "stop"
                                break
                    if reason is None and last_step:
                        reason = "length"
                    done[i] = reason is not None
                    stats.generated_tokens += 1
                    yield StreamEvent(i, tid, text, float(lps[i, j]), reason)
            if produced == max_new_tokens or all(done):
                break
            block = nxt_block
    finally:
        if t_first is not None:
            stats.decode_s = time.perf_counter() - t_first
            decoded = stats.generated_tokens - b  # the first token of each row came from prefill
            run = stats.decode_s - (stats.compile_s - stats._prefill_compile_s)
            stats.generation_tokens_per_s = decoded / run if decoded > 0 and run > 0 else None


def generate(model: Flint, prompt, *, max_new_tokens: int = 256, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, seed: int | None = None,
             key: jax.Array | None = None, stop: str | Sequence[str] | None = None,
             stop_token_ids: Sequence[int] | None = None, stream: bool = False,
             logprobs: bool = False, return_details: bool = False, chunk_size: int | None = None,
             decode_block: int | None = None):
    """Generates continuations of one or several prompts.

    Args:
      model: a handle from `flint_jax.load`.
      prompt: a string, a list of strings, or token ids (`[T]` or `[B, T]`, or a list of rows of
        different lengths).
      max_new_tokens: tokens to generate per row at most (thinking counts); lowered, with a
        `MaxNewTokensClampedWarning`, to the room the cache (`load(..., max_length=)`) has left
        after the longest prompt.
      temperature / top_k / top_p / min_p / repetition_penalty: sampling (fp32, HF order);
        `temperature=0` is greedy. Unset values come from the checkpoint's generation_config.json,
        else temperature 1.0, top-p 0.95, top-k 20.
      seed / key: the PRNG seed or key (same seed, same output). Default seed 0.
      stop: stop string(s): the text is cut before the first occurrence.
      stop_token_ids: token ids that end a row (default: generation_config's eos list, else the
        tokenizer's end-of-text, `<|user|>` and `<|observation|>`); the stop token is kept in
        the ids, not in the text.
      stream: return an iterator of `StreamEvent` instead (a `GenerationStream`: its `.stats`
        are complete once it is exhausted).
      logprobs: keep per-token logprobs (log-softmax of the raw logits).
      return_details: return `GenerationOutput` objects (with `.stats`: time to first token,
        prompt and generation tokens/s, compile time; a `GenerationStats`).
      decode_block: decode steps per device call (default 8 on GPU, 1 elsewhere); the same
        tokens come out whatever its value.

    The first call for a new batch size or cache length compiles the steps (seconds to a minute;
    4-30 s on a 2-core CPU for the demo model); a one-line notice is logged first (logger
    `flint_jax`, level INFO: `logging.getLogger("flint_jax").setLevel(logging.INFO)` with a
    handler shows it; the CLI prints it).

    Returns: for a string prompt a `GeneratedText` (a str with `.token_ids`, `.finish_reason`,
    `.logprobs`, `.stats`); for a list of strings a list of them; for token ids `[T]` an int32
    array of the generated ids, for `[B, T]` a list of arrays (rows may differ in length).
    """
    rows, is_text, single = _as_rows(prompt, model.tokenizer)
    overrides = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     repetition_penalty=repetition_penalty)
    params = sampling.SamplingParams.from_generation_config(
        model.generation_config, **{k: v for k, v in overrides.items() if v is not None})
    if stop_token_ids is None:
        stop_token_ids = default_stop_ids(model)
    if isinstance(stop, str):
        stop = [stop]
    stats = GenerationStats()
    events = stream_generate(model, rows, max_new_tokens=max_new_tokens, params=params, seed=seed,
                             key=key, stop_token_ids=stop_token_ids, stop=stop,
                             chunk_size=chunk_size, decode_block=decode_block, stats=stats)
    if stream:
        return GenerationStream(events, stats)
    ids = [[] for _ in rows]
    lps = [[] for _ in rows]
    texts = [[] for _ in rows]
    reasons = ["length"] * len(rows)
    for ev in events:
        ids[ev.row].append(ev.token_id)
        lps[ev.row].append(ev.logprob)
        texts[ev.row].append(ev.text)
        if ev.finish_reason:
            reasons[ev.row] = ev.finish_reason
    outs = [GenerationOutput(token_ids=np.array(ids[i], np.int32),
                             text="".join(texts[i]) if model.tokenizer is not None else None,
                             finish_reason=reasons[i],
                             logprobs=np.array(lps[i], np.float32) if logprobs else None,
                             prompt_ids=np.array(rows[i], np.int32), stats=stats)
            for i in range(len(rows))]
    if return_details:
        return outs[0] if single else outs
    if is_text:
        res = [GeneratedText.of(o) for o in outs]
    else:
        res = [o.token_ids for o in outs]
    return res[0] if single else res


def default_stop_ids(model: Flint) -> list[int]:
    eos = model.generation_config.get("eos_token_id")
    if eos is not None:
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if model.config.eos_token_id:
        return list(model.config.eos_token_id)
    if model.tokenizer is not None:
        return model.tokenizer.stop_token_ids()
    return []


def forward(model: Flint, input_ids, *, lengths=None, capture: Sequence[str] = (),
            params: Any = None, chunk_size: int | None = None):
    """fp32 logits `[B, T, V]` of whole sequences, chunked through a cache: on the Pallas
    prefill kernels where the model uses them (`Flint.pallas_prefill`; not with `capture` or
    `params`, which need the module's own math), else the XLA path.

    Args:
      input_ids: int `[T]` or `[B, T]`.
      lengths: optional `[B]` valid tokens per row (right padding); logits past a row's length
        are meaningless.
      capture: any of "hidden_states", "router_scores", "router_ids", "router_weights",
        "sink_mass"; when given the result is `(logits, captured)` with arrays stacked over
        layers (hidden_states [L+1, B, T, D], router_* [L_moe, B, T, ...], sink_mass [L, B, T, H]).
      params: a state pytree to use instead of `model.state` (e.g. under `jax.grad`); forward is
        differentiable with respect to it.
    """
    from flint_jax.model import CAPTURABLE
    ids = jnp.asarray(input_ids, jnp.int32)
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    bad = [c for c in capture if c not in CAPTURABLE]
    if bad:
        raise ValueError(f"cannot capture {bad[0]!r}; choose from {CAPTURABLE}")
    b, t = ids.shape
    if t > model.max_length:
        raise PromptTooLongError(f"input has {t} tokens but the model holds at most "
                                 f"{model.max_length}")
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    pallas = model.pallas_prefill and not capture and params is None
    if pallas and chunk_size is None:
        chunk = pallas_prefill.chunk_length(b, t)
    else:
        chunk = min(chunk_size or 512, bucket_length(t, 1 << 30, minimum=16))
    n_chunks = -(-t // chunk)
    cache_len = bucket_length(n_chunks * chunk, 1 << 30)
    check_cache_fits(model.config, b, cache_len, model.dtype)
    fn = _forward_fn(model, chunk, n_chunks, cache_len, tuple(capture), pallas)
    if _new_shapes(model, [("forward", chunk, n_chunks, cache_len, tuple(capture), pallas, b)]):
        _compile_notice(model, "forward pass", f"batch {b}, {n_chunks * chunk} tokens")
    logits, captured = fn(model.state if params is None else params, ids, lengths)
    logits = logits[:, :t]
    captured = {k: v[:, :, :t] if v.ndim >= 3 else v for k, v in captured.items()}
    if squeeze:
        logits = logits[0]
        captured = {k: v[:, 0] for k, v in captured.items()}
    return (logits, captured) if capture else logits


def _forward_fn(model: Flint, chunk: int, n_chunks: int, cache_len: int, capture, pallas: bool):
    def build():
        from flint_jax.cache import cache_shapes
        graphdef, cfg, dtype = model.graphdef, model.config, model.dtype

        def run(state, ids, lengths):
            b, t = ids.shape
            ids = jnp.pad(ids, ((0, 0), (0, n_chunks * chunk - t)))
            cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 cache_shapes(cfg, b, cache_len, dtype))
            m = nnx.merge(graphdef, state)
            outs, caps = [], []
            for c in range(n_chunks):
                n = jnp.clip(lengths - c * chunk, 0, chunk)
                part = ids[:, c * chunk:(c + 1) * chunk]
                if pallas:
                    lo, cache, cap = pallas_prefill.chunk_forward(m, part, cache, n, logits="all")
                else:
                    lo, cache, cap = m(part, cache, n, logits="all", capture=capture)
                outs.append(lo)
                caps.append(cap)
            logits = jnp.concatenate(outs, axis=1)
            captured = {k: jnp.concatenate([cp[k] for cp in caps], axis=2) for k in caps[0]}
            return logits, captured

        return jax.jit(run)
    return model.jitted(("forward", chunk, n_chunks, cache_len, capture, pallas), build)
