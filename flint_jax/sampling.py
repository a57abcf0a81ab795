"""Logits processors and samplers (fp32, batch-first, HF order, jittable).

Everything here is pure ``jax.numpy`` on ``[B, V]`` rows and works under
``jax.jit``; :class:`SamplingParams` is a frozen (hashable) dataclass and is a
*static* argument of the public functions, which are jitted with
``static_argnames=("params",)`` already (calling them inside another jit is
fine). Logits of any float dtype are upcast to float32 first.

Order and rules follow HF ``transformers`` (``generation/logits_process.py``):

1. repetition penalty (``RepetitionPenaltyLogitsProcessor``) on the tokens
   flagged in ``seen``: ``logit < 0 ? logit * p : logit / p``;
2. temperature (``TemperatureLogitsWarper``): ``logits / T``;
3. top-k (``TopKLogitsWarper``): keep every token whose logit is ``>=`` the
   k-th largest value, so tokens tied with the k-th value are *all* kept (more
   than k tokens may survive); ``k`` is clipped to ``V``;
4. top-p (``TopPLogitsWarper``): HF sorts the row ascending, takes
   ``cumsum(softmax)`` and removes the positions whose cumulative probability
   is ``<= 1 - top_p``, always keeping the most likely token. The surviving
   positions are a suffix of the ascending order; we take the logit at its
   first position as a *cutoff* and keep every token ``>= cutoff``. This is
   HF's rule exactly, except when a group of exactly tied logits straddles the
   cutoff: HF then keeps an arbitrary subset of the group (whatever
   ``torch.sort`` happened to put last), we keep the whole group -- the same
   tie rule as top-k, deterministic and order-free. (Example: four equal
   logits, ``top_p=0.5``: HF keeps 2 of them, we keep all 4.)
5. min-p (``MinPLogitsWarper``): ``p = softmax(row)``; remove tokens with
   ``p < min_p * max(p)``; the most likely token is always kept.

Filtered entries are set to ``-inf``; kept entries hold the penalised,
temperature-scaled logits. A knob at its "off" value (``repetition_penalty
1.0``, ``temperature 1.0``, ``top_k 0``, ``top_p 1.0``, ``min_p 0.0``) is
skipped at trace time, as in HF.

``temperature == 0`` means greedy: :func:`sample` returns the argmax of the
(repetition-penalised) logits without touching the key (``key`` may be
``None``), and :func:`process_logits` returns a point mass: the argmax entry
(first index on ties, as ``argmax``) keeps its logit, all others are ``-inf``.
top-k / top-p / min-p never remove the argmax, so they do not matter there.

Cost for V = 150144: top-k is one ``lax.top_k`` plus a threshold compare.
top-p needs the kept row in sorted order; when ``top_k > 0`` only the k values
returned by ``lax.top_k`` are needed (the tokens tied with the k-th value but
not returned by ``top_k`` all sit at the bottom of HF's ascending order and
enter as one constant prefix mass), so no length-V sort happens; with
``top_k == 0`` one full ``jnp.sort`` of the row is done (values only, no
argsort / scatter). The tests check that the cheap path equals the general
(full-sort) path.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "SamplingParams",
    "process_logits",
    "sample",
    "token_logprobs",
    "apply_repetition_penalty",
    "seen_from_tokens",
    "update_seen",
]

# Flint defaults when a generation_config.json leaves a field out.
_CONFIG_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs; hashable, so usable as a ``jax.jit`` static argument.

    ``temperature`` 0 => greedy; ``top_k`` 0 => off; ``top_p`` 1.0 => off;
    ``min_p`` 0 => off; ``repetition_penalty`` 1.0 => off. Values are
    validated on construction (and by :meth:`validate`) and normalised to
    ``float`` / ``int`` so equal settings hash equally.
    """

    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "top_k", int(self.top_k))

    def validate(self) -> "SamplingParams":
        """Raise ``ValueError`` naming the field and value if a knob is invalid;
        return ``self`` otherwise."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        mp = self.min_p
        if not _is_real(mp) or not (0.0 <= mp <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {mp!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or not rp > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_generation_config(cls, d: Mapping[str, Any], **overrides: Any) -> "SamplingParams":
        """Build from an HF ``generation_config.json`` dict.

        Reads ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty`` and ``do_sample``; other keys are ignored. A
        field that is absent or ``null`` takes the Flint default (temperature
        1.0, top_p 0.95, top_k 20, min_p 0, repetition_penalty 1). An explicit
        ``do_sample: false`` means greedy (temperature 0); an absent
        ``do_sample`` does *not* (unlike HF's ``GenerationConfig``, whose
        default is ``do_sample=False``). ``overrides`` (SamplingParams field
        names) are applied last and win over the dict, including over
        ``do_sample: false``.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"unknown SamplingParams override(s): {sorted(unknown)}")
        kw: dict[str, Any] = {}
        for name, default in _CONFIG_DEFAULTS.items():
            v = d.get(name)
            kw[name] = default if v is None else v
        if d.get("do_sample") is False:
            kw["temperature"] = 0.0
        kw.update(overrides)
        return cls(**kw)


# ----------------------------------------------------------------------------
# helpers for the repetition-penalty mask


@partial(jax.jit, static_argnames=("vocab_size",))
def seen_from_tokens(token_ids: jax.Array, vocab_size: int, valid: jax.Array | None = None) -> jax.Array:
    """``bool[B, V]`` mask of the ids in ``token_ids`` (``int[B, L]``).

    ``valid`` (``bool[B, L]``, optional) marks which positions count (e.g. to
    skip padding). Ids outside ``[0, vocab_size)`` are ignored, as HF does for
    ids beyond the lm_head size.
    """
    token_ids = jnp.asarray(token_ids)
    b = token_ids.shape[0]
    ok = (token_ids >= 0) & (token_ids < vocab_size)
    if valid is not None:
        ok = ok & jnp.asarray(valid, bool)
    ids = jnp.where(ok, token_ids, vocab_size)  # dump bad ids into a spare column
    seen = jnp.zeros((b, vocab_size + 1), bool)
    seen = seen.at[jnp.arange(b)[:, None], ids].set(True)
    return seen[:, :vocab_size]


@jax.jit
def update_seen(seen: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mark ``tokens`` (``int[B]``) in ``seen`` (``bool[B, V]``)."""
    return seen.at[jnp.arange(seen.shape[0]), tokens].set(True)


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: float) -> jax.Array:
    """HF ``RepetitionPenaltyLogitsProcessor`` on the tokens flagged in ``seen``."""
    x = jnp.asarray(logits, jnp.float32)
    penalised = jnp.where(x < 0, x * penalty, x / penalty)
    return jnp.where(jnp.asarray(seen, bool), penalised, x)


# ----------------------------------------------------------------------------
# filters (x: f32[B, V], filtered entries already -inf)


def _mask(x: jax.Array, keep: jax.Array) -> jax.Array:
    return jnp.where(keep, x, -jnp.inf)


def _top_p_cutoff(asc: jax.Array, m: jax.Array, z: jax.Array, base: jax.Array, top_p: float) -> jax.Array:
    """Smallest logit HF's top-p keeps.

    ``asc``: ``[B, n]`` the last n entries of HF's ascending sort of the row;
    ``base``: ``[B, 1]`` probability mass of the entries before them; ``m``,
    ``z``: the softmax max and normaliser of the row. Returns ``[B, 1]``.
    """
    p = jnp.exp(asc - m) / z
    cum = base + jnp.cumsum(p, axis=-1)
    keep = cum > (1.0 - top_p)  # HF removes cum <= 1 - top_p
    keep = keep.at[:, -1].set(True)  # min_tokens_to_keep = 1
    return jnp.min(jnp.where(keep, asc, jnp.inf), axis=-1, keepdims=True)


def _softmax_stats(x: jax.Array, m: jax.Array) -> jax.Array:
    return jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)


def _top_p_general(x: jax.Array, top_p: float) -> jax.Array:
    """top-p by one full sort of the row (used when top_k == 0)."""
    asc = jnp.sort(x, axis=-1)
    m = asc[:, -1:]
    z = _softmax_stats(x, m)
    cutoff = _top_p_cutoff(asc, m, z, jnp.zeros_like(m), top_p)
    return _mask(x, x >= cutoff)


def _top_k(x: jax.Array, k: int, top_p: float | jax.Array | None) -> jax.Array:
    """top-k, then (unless top_p is None) top-p using only the k sorted top values."""
    vals, _ = jax.lax.top_k(x, k)  # [B, k], descending
    thr = vals[:, -1:]
    keep = x >= thr  # HF: remove scores < k-th value -> ties with it are kept
    x = _mask(x, keep)
    if top_p is None:
        return x
    m = vals[:, :1]
    z = _softmax_stats(x, m)
    # kept tokens tied with the k-th value that lax.top_k did not return: they
    # share its value, so they sit first in HF's ascending order.
    n_extra = jnp.sum(keep, axis=-1, keepdims=True) - k
    base = n_extra.astype(jnp.float32) * (jnp.exp(thr - m) / z)
    cutoff = _top_p_cutoff(vals[:, ::-1], m, z, base, top_p)
    return _mask(x, x >= cutoff)


def _min_p(x: jax.Array, min_p: float) -> jax.Array:
    probs = jax.nn.softmax(x, axis=-1)
    top = jnp.max(probs, axis=-1, keepdims=True)
    keep = (probs >= min_p * top) | (x == jnp.max(x, axis=-1, keepdims=True))
    return _mask(x, keep)


def _check(logits: jax.Array, seen: jax.Array | None) -> jax.Array:
    x = jnp.asarray(logits)
    if x.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {x.shape}")
    if seen is not None and jnp.shape(seen) != x.shape:
        raise ValueError(f"seen must have the logits shape {x.shape}, got {jnp.shape(seen)}")
    return x.astype(jnp.float32)


def _penalise(x: jax.Array, params: SamplingParams, seen: jax.Array | None) -> jax.Array:
    if seen is not None and params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    return x


@partial(jax.jit, static_argnames=("params",))
def process_logits(logits: jax.Array, params: SamplingParams, seen: jax.Array | None = None) -> jax.Array:
    """HF-order logits processing; returns ``f32[B, V]`` with filtered entries
    at ``-inf`` (see the module docstring for the exact rules).

    ``seen``: optional ``bool[B, V]``, the tokens the repetition penalty
    applies to (HF penalises every id in ``input_ids``, prompt included).
    """
    x = _penalise(_check(logits, seen), params, seen)
    v = x.shape[-1]
    if params.temperature == 0.0:  # greedy: point mass at the argmax
        return _mask(x, jnp.arange(v)[None, :] == jnp.argmax(x, axis=-1)[:, None])
    if params.temperature != 1.0:
        x = x / params.temperature
    k = min(params.top_k, v)
    if k > 0:
        x = _top_k(x, k, params.top_p if params.top_p < 1.0 else None)
    elif params.top_p < 1.0:
        x = _top_p_general(x, params.top_p)
    if params.min_p > 0.0:
        x = _min_p(x, params.min_p)
    return x


@partial(jax.jit, static_argnames=("params",))
def sample(
    logits: jax.Array, key: jax.Array | None, params: SamplingParams, seen: jax.Array | None = None
) -> jax.Array:
    """One token per row, ``int32[B]``.

    Greedy (``temperature == 0``): argmax of the repetition-penalised logits,
    first index on ties; ``key`` is not used (may be ``None``). Otherwise a
    categorical draw (``jax.random.categorical``: independent per row) from
    :func:`process_logits`.
    """
    if params.temperature == 0.0:
        x = _penalise(_check(logits, seen), params, seen)
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("sample() needs a PRNG key when temperature > 0")
    x = process_logits(logits, params, seen)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


@jax.jit
def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log_softmax(logits)[b, tokens[b]]`` as ``f32[B]``.

    Deliberately on the *raw* (unprocessed) logits: this is the model's own
    log-probability of the token, independent of the sampling knobs, which is
    what perplexity / scoring / logprob reporting needs; under top-k/top-p a
    processed log-prob would be a renormalised value that changes with the
    knobs, and ``-inf`` for a token outside the kept set. For
    the log-prob under the sampling distribution call
    ``token_logprobs(process_logits(logits, params, seen), tokens)``.
    """
    x = _check(logits, None)
    lp = jax.nn.log_softmax(x, axis=-1)
    return jnp.take_along_axis(lp, jnp.asarray(tokens, jnp.int32)[:, None], axis=-1)[:, 0]
