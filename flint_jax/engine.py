"""The model handle users get from `flint_jax.load`: config, tokenizer, split state, jitted steps.

`nnx.split` happens once at load; every step is a `jax.jit` of a pure function of the state (with
the cache donated), so a call costs about its compute instead of NNX's graph traversal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flint_jax import sampling
from flint_jax.cache import KVCache
from flint_jax.config import FlintConfig
from flint_jax.tokenizer import Tokenizer

KERNEL_CHOICES = ("auto", "pallas", "xla")


def resolve_kernels(kernels: str) -> str:
    """"auto" is the Pallas path on GPU and the XLA path elsewhere."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return kernels


@dataclasses.dataclass(eq=False)
class Flint:
    """A loaded Flint model.

    Attributes: `config` (FlintConfig), `tokenizer` (Tokenizer or None), `graphdef`/`state` (the
    `nnx.split` of the module tree), `dtype`, `quant` (NVFP4 linear layers), `kernels` ("xla" or
    "pallas"), `mesh` (or None), `max_length` (the longest sequence a cache may hold),
    `generation_config` (dict from generation_config.json), `source` (path loaded),
    `decode_plan` (a function (quant, batch) -> `fast_decode.DecodePlan` for the Pallas step, or
    None for `fast_decode.decode_plan`, the measured choices).
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

    def __post_init__(self):
        if not self.max_length:
            self.max_length = self.config.max_position_embeddings
        self._jit_cache: dict = {}
        self._flat = None

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

    # ---- jitted pure functions, built once per handle -------------------------------------
    def chunk_fn(self, logits: str, capture: tuple[str, ...] = ()):
        """jit(leaves, tokens [B,T], cache, n_tokens [B]) -> (logits, cache, captured); cache donated."""
        key = ("chunk", logits, capture)
        if key not in self._jit_cache:
            graphdef, unflatten = self.graphdef, self._unflatten()

            def run(leaves, tokens, cache, n_tokens):
                return nnx.merge(graphdef, unflatten(leaves))(tokens, cache, n_tokens,
                                                              logits=logits, capture=capture)

            self._jit_cache[key] = jax.jit(run, donate_argnums=(2,))
        return self._jit_cache[key]

    def decode_fn(self, params: sampling.SamplingParams, with_seen: bool, n_steps: int = 1):
        """jit(leaves, cache, tokens [B], key, seen) -> (tokens [B, n], logprobs [B, n], cache,
        seen, key).

        `n_steps` decode steps with sampling fused in, in one call (a `fori_loop` on the device:
        the host's per-call cost is paid once per `n_steps` tokens); the cache and the seen-token
        mask are donated. The returned key continues the chain.
        """
        key = ("decode", params, with_seen, self.kernels, self.decode_plan, n_steps)
        if key not in self._jit_cache:
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

            self._jit_cache[key] = jax.jit(run, donate_argnums=(1, 4))
        return self._jit_cache[key]

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
        key = ("decode_logits", self.kernels, self.decode_plan)
        if key not in self._jit_cache:
            step, unflatten = self.decode_logits_fn_raw(), self._unflatten()
            self._jit_cache[key] = jax.jit(
                lambda leaves, cache, tokens: step(unflatten(leaves), cache, tokens),
                donate_argnums=(1,))
        return self._jit_cache[key]

    def sample_fn(self, params: sampling.SamplingParams, with_seen: bool):
        key = ("sample", params, with_seen)
        if key not in self._jit_cache:
            def run(logits, rng, seen):
                nxt = sampling.sample(logits, rng, params, seen if with_seen else None)
                lp = sampling.token_logprobs(logits, nxt)
                if with_seen:
                    seen = seen.at[jnp.arange(nxt.shape[0]), nxt].set(True)
                return nxt, lp, seen
            self._jit_cache[key] = jax.jit(run, donate_argnums=(2,))
        return self._jit_cache[key]
