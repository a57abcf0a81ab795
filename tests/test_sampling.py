"""Tests for flint_jax.sampling (fast, CPU)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import sampling as S
from flint_jax.sampling import SamplingParams

GOLDEN = pathlib.Path(__file__).parent / "golden" / "sampling_cases.npz"
OFF = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


def P(**kw) -> SamplingParams:
    return SamplingParams(**{**OFF, **kw})


def kept(x) -> np.ndarray:
    return np.isfinite(np.asarray(x))


# ----------------------------------------------------------------------------
# independent numpy implementation of HF's processors (positional, as in
# transformers/generation/logits_process.py), fp32 like torch


def np_softmax(x):
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True)


def np_reference(logits, params: SamplingParams, seen=None, tie_inclusive_top_p=True):
    x = np.array(logits, np.float32)
    if seen is not None and params.repetition_penalty != 1.0:
        pen = np.where(x < 0, x * np.float32(params.repetition_penalty), x / np.float32(params.repetition_penalty))
        x = np.where(seen, pen, x).astype(np.float32)
    if params.temperature != 1.0:
        x = (x / np.float32(params.temperature)).astype(np.float32)
    v = x.shape[-1]
    if params.top_k:
        k = min(params.top_k, v)
        kth = -np.sort(-x, axis=-1)[:, k - 1 : k]
        x = np.where(x < kth, -np.inf, x).astype(np.float32)
    if params.top_p < 1.0:
        out = x.copy()
        for b in range(x.shape[0]):
            order = np.argsort(x[b], kind="stable")  # ascending
            srt = x[b][order]
            cum = np.cumsum(np_softmax(srt[None])[0], dtype=np.float32)
            remove = cum <= np.float32(1 - params.top_p)
            remove[-1] = False
            if tie_inclusive_top_p:  # flint rule: keep every token tied with the cutoff
                cutoff = srt[~remove].min()
                out[b] = np.where(x[b] >= cutoff, x[b], -np.inf)
            else:
                out[b, order[remove]] = -np.inf
        x = out
    if params.min_p > 0.0:
        p = np_softmax(x)
        remove = p < params.min_p * p.max(-1, keepdims=True)
        remove[np.arange(x.shape[0]), np.argmax(p, -1)] = False
        x = np.where(remove, -np.inf, x)
    return x


# ----------------------------------------------------------------------------
# HF goldens (tools/make_sampling_goldens.py)


def _golden_cases():
    g = np.load(GOLDEN)
    meta = json.loads(str(g["meta"]))
    return [(i, c) for i, c in enumerate(meta["cases"])]


@pytest.mark.parametrize("i,case", _golden_cases(), ids=lambda c: c["name"] if isinstance(c, dict) else str(c))
def test_matches_hf_goldens(i, case):
    g = np.load(GOLDEN)
    knobs = {k: v for k, v in case.items() if k != "name"}
    params = SamplingParams(**knobs)
    x, ids, want = g[f"{i}_logits"], g[f"{i}_input_ids"], g[f"{i}_expected"]
    seen = np.zeros(x.shape, bool)
    np.put_along_axis(seen, ids, True, axis=-1)
    got = np.asarray(S.process_logits(x, params, seen))
    np.testing.assert_array_equal(kept(got), kept(want))
    m = kept(want)
    np.testing.assert_allclose(got[m], want[m], rtol=1e-6, atol=1e-6)
    # the processed distribution is what we sample from
    assert got.dtype == np.float32


@pytest.mark.parametrize(
    "params",
    [
        P(top_p=0.9),
        P(top_k=20, top_p=0.95),
        P(top_k=3, top_p=0.5, min_p=0.2),
        P(top_k=64, top_p=0.7, temperature=1.7, repetition_penalty=1.3),
        SamplingParams(),
    ],
    ids=str,
)
def test_matches_numpy_reference_fresh_inputs(params):
    rng = np.random.default_rng(hash(params) % 2**32)
    for scale in (0.3, 2.0, 6.0):
        x = (rng.standard_normal((16, 777)) * scale).astype(np.float32)
        seen = rng.random((16, 777)) < 0.05
        got = kept(S.process_logits(x, params, jnp.asarray(seen)))
        want = kept(np_reference(x, params, seen, tie_inclusive_top_p=False))  # continuous: no ties
        np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------
# individual knobs on known distributions


def test_top_k_keeps_exactly_the_k_largest():
    rng = np.random.default_rng(0)
    x = rng.permutation(1000).reshape(4, 250).astype(np.float32) * 0.01  # distinct values
    for k in (1, 7, 300):
        got = kept(S.process_logits(x, P(top_k=k)))
        kk = min(k, 250)
        want = np.zeros_like(got)
        np.put_along_axis(want, np.argsort(-x, axis=-1)[:, :kk], True, axis=-1)
        np.testing.assert_array_equal(got, want)
        assert (got.sum(-1) == kk).all()
    # values of kept entries are untouched
    out = np.asarray(S.process_logits(x, P(top_k=7)))
    np.testing.assert_array_equal(out[kept(out)], x[kept(out)])


def test_top_k_ties_keep_every_token_equal_to_kth_value():
    # HF: remove scores < k-th largest value -> all ties with the k-th survive
    x = np.array([[5.0, 3.0, 3.0, 1.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 1.0, 1.0]], np.float32)
    got = kept(S.process_logits(x, P(top_k=2)))
    np.testing.assert_array_equal(got[0], [1, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(got[1], [1, 1, 1, 1, 0, 0])
    got1 = kept(S.process_logits(x, P(top_k=1)))
    np.testing.assert_array_equal(got1[1], [1, 1, 1, 1, 0, 0])


def test_top_p_known_skewed_distribution():
    probs = np.array([0.05, 0.5, 0.15, 0.3], np.float64)
    x = np.log(probs).astype(np.float32)[None]
    # HF: token kept iff the mass strictly above it is < top_p (its ascending
    # cumulative prob > 1 - top_p); the top token is always kept
    cases = {1e-6: [0, 1, 0, 0], 0.7: [0, 1, 0, 1], 0.85: [0, 1, 1, 1]}
    for top_p, want in cases.items():
        np.testing.assert_array_equal(kept(S.process_logits(x, P(top_p=top_p)))[0], want, err_msg=str(top_p))
        # cheap path (top_k > 0) agrees
        if top_p == 0.7:
            np.testing.assert_array_equal(kept(S.process_logits(x, P(top_k=3, top_p=top_p)))[0],
                                          np.array(want) & np.array([0, 1, 1, 1]), err_msg=str(top_p))


def test_top_p_ties_straddling_cutoff_are_all_kept():
    # documented deviation: HF keeps an arbitrary 2 of the 4 tied tokens in row 0
    x = np.array([[0.0, 0.0, 0.0, 0.0, -30.0], [2.0, 1.0, 1.0, 1.0, -5.0]], np.float32)
    got = kept(S.process_logits(x, P(top_p=0.5)))
    np.testing.assert_array_equal(got, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    assert kept(np_reference(x, P(top_p=0.5), tie_inclusive_top_p=False)).sum(-1).tolist() == [2, 2]


def test_min_p_known_distribution():
    probs = np.array([[0.06, 0.6, 0.1, 0.2, 0.04]])
    x = np.log(probs).astype(np.float32)
    np.testing.assert_array_equal(kept(S.process_logits(x, P(min_p=0.2)))[0], [0, 1, 0, 1, 0])  # >= 0.12
    np.testing.assert_array_equal(kept(S.process_logits(x, P(min_p=0.15)))[0], [0, 1, 1, 1, 0])  # >= 0.09
    tie = np.array([[1.0, 3.0, 3.0, 0.0, -9.0]], np.float32)  # ties with the max all survive
    np.testing.assert_array_equal(kept(S.process_logits(np.concatenate([x, tie]), P(min_p=1.0))),
                                  [[0, 1, 0, 0, 0], [0, 1, 1, 0, 0]])


def test_repetition_penalty_sign_rule():
    x = np.array([[2.0, -2.0, 3.0, -1.0, 0.0]], np.float32)
    seen = jnp.array([[True, True, False, False, True]])
    out = np.asarray(S.process_logits(x, P(repetition_penalty=2.0), seen))
    np.testing.assert_allclose(out, [[1.0, -4.0, 3.0, -1.0, 0.0]])
    out = np.asarray(S.process_logits(x, P(repetition_penalty=0.5), seen))
    np.testing.assert_allclose(out, [[4.0, -1.0, 3.0, -1.0, 0.0]])
    # no `seen` -> no penalty
    np.testing.assert_allclose(np.asarray(S.process_logits(x, P(repetition_penalty=2.0))), x)
    # penalty applies before temperature (HF order)
    out = np.asarray(S.process_logits(x, P(repetition_penalty=2.0, temperature=0.5), seen))
    np.testing.assert_allclose(out, [[2.0, -8.0, 6.0, -2.0, 0.0]])
    # greedy applies it too (HF applies processors before argmax): 3.0 / 4 = 0.75 < 1.0
    x2 = np.array([[1.0, 0.5, 3.0]], np.float32)
    seen2 = jnp.array([[False, False, True]])
    assert int(S.sample(x2, None, P(temperature=0.0, repetition_penalty=4.0), seen2)[0]) == 0


def test_temperature_scaling():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 50)).astype(np.float32) * 3
    outs = {}
    for t in (0.5, 2.0):
        outs[t] = np.asarray(S.process_logits(x, P(temperature=t)))
        np.testing.assert_allclose(outs[t], x / np.float32(t), rtol=1e-6)
    # lower temperature sharpens the distribution
    ent = lambda z: -(np_softmax(z) * np.log(np_softmax(z))).sum(-1)  # noqa: E731
    e_lo, e_hi = ent(outs[0.5]), ent(outs[2.0])
    assert (e_lo < ent(x)).all() and (ent(x) < e_hi).all()


# ----------------------------------------------------------------------------
# cheap top-k -> top-p path vs the general full-sort path


def _ties_logits(rng, b, v, kind):
    if kind == "int":
        return rng.integers(-6, 3, size=(b, v)).astype(np.float32)
    x = rng.standard_normal((b, v)).astype(np.float32) * 2.5
    if kind == "bf16":
        return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    return x


@partial(jax.jit, static_argnums=(1,))
def _cheap_and_general(x, k, top_p):  # top_p traced here: one compile per k
    return S._top_k(x, k, top_p), S._top_p_general(S._top_k(x, k, None), top_p)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int"])
def test_cheap_top_p_equals_general(kind):
    rng = np.random.default_rng({"fp32": 11, "bf16": 12, "int": 13}[kind])
    x = jnp.asarray(_ties_logits(rng, 32, 1001, kind))
    for k, top_p in itertools.product((1, 20, 200), (0.13, 0.5, 0.83, 0.95)):
        cheap, general = _cheap_and_general(x, k, np.float32(top_p))
        np.testing.assert_array_equal(np.asarray(cheap), np.asarray(general), err_msg=f"{k=} {top_p=}")
        # and the (tie-inclusive) numpy reference of HF's rule
        ref = np_reference(np.asarray(x), P(top_k=k, top_p=top_p))
        np.testing.assert_array_equal(kept(cheap), kept(ref), err_msg=f"{k=} {top_p=}")


def test_cheap_path_full_vocab_and_no_length_v_sort():
    v = 150144
    rng = np.random.default_rng(5)
    x = jnp.asarray(_ties_logits(rng, 2, v, "bf16"))
    params = SamplingParams(top_k=20, top_p=0.95, temperature=0.7)
    got = S.process_logits(x, params)
    np.testing.assert_array_equal(kept(got), kept(np_reference(np.asarray(x), params)))
    # the jaxpr of the top_k > 0 path has no sort; the top_k == 0 path has one
    assert " sort" not in str(jax.make_jaxpr(lambda z: S.process_logits(z, params))(x))
    full = str(jax.make_jaxpr(lambda z: S.process_logits(z, P(top_p=0.9)))(x))
    assert full.count(" sort[") == 1


# ----------------------------------------------------------------------------
# sampling


def test_greedy_is_argmax_and_ignores_key():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 1000)).astype(np.float32)
    g = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    want = np.argmax(x, -1)
    a = np.asarray(S.sample(x, None, g))
    b = np.asarray(S.sample(x, jax.random.key(1), g))
    c = np.asarray(S.sample(x, jax.random.key(2), g))
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(b, want)
    np.testing.assert_array_equal(c, want)
    assert a.dtype == np.int32 and a.shape == (16,)
    # process_logits at temperature 0 is a point mass at the argmax
    out = np.asarray(S.process_logits(x, g))
    assert (kept(out).sum(-1) == 1).all()
    np.testing.assert_array_equal(np.argmax(out, -1), want)
    # first index on ties, like argmax
    assert int(S.sample(np.array([[1.0, 3.0, 3.0]], np.float32), None, g)[0]) == 1


def test_same_key_same_tokens_different_keys_differ():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((64, 500)) * 0.1).astype(np.float32)  # flat-ish
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    k1, k2 = jax.random.key(100), jax.random.key(101)
    a = np.asarray(S.sample(x, k1, params))
    b = np.asarray(S.sample(x, k1, params))
    c = np.asarray(S.sample(x, k2, params))
    np.testing.assert_array_equal(a, b)
    assert (a != c).sum() > 48  # near-uniform over 500 tokens: almost every row differs
    assert len(set(a.tolist())) > 40  # rows are independent draws, not one shared draw
    with pytest.raises(ValueError, match="key"):
        S.sample(x, None, params)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0),
        SamplingParams(temperature=1.3, top_k=6, top_p=1.0, min_p=0.1, repetition_penalty=1.5),
    ],
    ids=str,
)
def test_empirical_frequencies_match_renormalised_probs(params):
    logits = np.log(np.array([0.30, 0.22, 0.15, 0.11, 0.08, 0.06, 0.05, 0.03])).astype(np.float32)
    seen = np.array([True, False, False, True, False, False, False, False])
    n = 50_000
    x = np.broadcast_to(logits, (n, 8))
    seen_b = jnp.asarray(np.broadcast_to(seen, (n, 8)))
    tokens = np.asarray(S.sample(x, jax.random.key(1234), params, seen_b))
    counts = np.bincount(tokens, minlength=8)
    ref = np_reference(logits[None], params, seen[None])[0]
    p = np_softmax(ref[None].astype(np.float64))[0]
    assert (counts[p == 0] == 0).all(), (counts, p)  # filtered tokens never drawn
    assert 1 < (p > 0).sum() < 8  # the filters did something
    exp = n * p[p > 0]
    chi2 = float((((counts[p > 0] - exp) ** 2) / exp).sum())
    df = int((p > 0).sum()) - 1
    # ~1e-4 upper tail of chi-square for df <= 6 is < 28; seed is fixed
    assert chi2 < 28, (chi2, df, counts, exp)


def test_jit_static_params_and_hashing():
    x = jnp.asarray(np.random.default_rng(9).standard_normal((4, 64)), jnp.float32)
    assert hash(SamplingParams(temperature=1, top_k=20)) == hash(SamplingParams())
    assert SamplingParams(temperature=1, top_p=1) == SamplingParams(top_p=1.0)
    assert isinstance(SamplingParams(temperature=1).temperature, float)

    @jax.jit
    def step(x, key):
        return S.sample(x, key, SamplingParams(top_k=8, top_p=1.0, temperature=0.8))

    toks = step(x, jax.random.key(0))
    assert toks.shape == (4,) and toks.dtype == jnp.int32
    # bf16 input -> fp32 output
    assert S.process_logits(x.astype(jnp.bfloat16), P(top_k=3)).dtype == jnp.float32


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        S.process_logits(jnp.zeros((8,)), SamplingParams())
    with pytest.raises(ValueError, match="seen"):
        S.process_logits(jnp.zeros((2, 8)), SamplingParams(), jnp.zeros((2, 7), bool))


# ----------------------------------------------------------------------------
# logprobs and seen helpers


def test_token_logprobs_raw_logits():
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((6, 300)) * 4).astype(np.float32)
    toks = rng.integers(0, 300, 6).astype(np.int32)
    lp = np.asarray(S.token_logprobs(x, toks))
    xd = x.astype(np.float64)
    want = xd[np.arange(6), toks] - np.log(np.exp(xd - xd.max(-1, keepdims=True)).sum(-1)) - xd.max(-1)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
    assert lp.dtype == np.float32 and (lp < 0).all()
    np.testing.assert_allclose(np.asarray(S.token_logprobs(jnp.asarray(x, jnp.bfloat16), toks)),
                               np.asarray(S.token_logprobs(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), toks)))


def test_seen_helpers():
    ids = jnp.array([[1, 3, 3, -1, 9], [0, 0, 2, 4, 4]])
    valid = jnp.array([[True] * 5, [True, True, True, False, False]])
    seen = np.asarray(S.seen_from_tokens(ids, 5, valid))
    np.testing.assert_array_equal(seen, [[0, 1, 0, 1, 0], [1, 0, 1, 0, 0]])
    seen2 = np.asarray(S.update_seen(jnp.asarray(seen), jnp.array([4, 2])))
    np.testing.assert_array_equal(seen2, [[0, 1, 0, 1, 1], [1, 0, 1, 0, 0]])


# ----------------------------------------------------------------------------
# params: validation and generation_config


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
    ],
)
def test_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value!r}".replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**{field: value})
    # validate() on an (unsafely) modified instance also raises
    p = SamplingParams()
    object.__setattr__(p, field, value)
    with pytest.raises(ValueError, match=field):
        p.validate()


def test_validate_returns_self_and_edges_ok():
    p = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, repetition_penalty=0.01)
    assert p.validate() is p and p.greedy
    assert not SamplingParams().greedy


def test_from_generation_config():
    assert SamplingParams.from_generation_config({}) == SamplingParams(temperature=1.0, top_p=0.95, top_k=20)
    d = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.02,
         "repetition_penalty": 1.05, "eos_token_id": [1, 2], "max_new_tokens": 100}
    assert SamplingParams.from_generation_config(d) == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.05)
    greedy = SamplingParams.from_generation_config({**d, "do_sample": False})
    assert greedy.temperature == 0.0 and greedy.top_k == 40
    assert SamplingParams.from_generation_config({"top_k": None, "temperature": None}) == SamplingParams()
    o = SamplingParams.from_generation_config({**d, "do_sample": False}, temperature=0.3, top_k=0)
    assert o.temperature == 0.3 and o.top_k == 0 and o.top_p == 0.9
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.from_generation_config(d, bogus=1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0})
    assert dataclasses.is_dataclass(o) and math.isfinite(o.temperature)
