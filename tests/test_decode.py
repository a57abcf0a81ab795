"""Incremental decoding, batching, streaming, stops and errors of generate()."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import flint_jax
from flint_jax import decode
from flint_jax.cache import CacheTooLargeError


def test_incremental_decoding_equals_full_sequence(fp32_models):
    # tiny_a: window 7, ring of 64 slots; 10 prompt tokens then 190 decode steps wrap it ~3 times.
    m = fp32_models["tiny_a"]
    rng = np.random.default_rng(1)
    seq = rng.integers(0, m.config.vocab_size, size=200)
    full = np.asarray(flint_jax.forward(m, seq))  # [200, V]
    logits, cache = decode.prefill(m, [seq[:10].tolist()], cache_length=256, chunk_size=4)
    np.testing.assert_allclose(np.asarray(logits)[0], full[9], atol=1e-4 * np.abs(full).max())
    step = m.decode_logits_fn()
    worst = 0.0
    for t in range(10, 200):
        logits, cache = step(m.leaves, cache, jnp.asarray(seq[t:t + 1], jnp.int32))
        worst = max(worst, float(np.abs(np.asarray(logits)[0] - full[t]).max()))
    assert int(cache.lengths[0]) == 200
    assert worst <= 1e-4 * np.abs(full).max(), worst


def test_chunked_prefill_batch_of_different_lengths(fp32_models):
    m = fp32_models["tiny_b"]  # window 9, GQA 8
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (37, 5, 70)]
    logits, _ = decode.prefill(m, rows, cache_length=128, chunk_size=16)
    for i, row in enumerate(rows):
        ref = np.asarray(flint_jax.forward(m, np.array(row)))[-1]
        np.testing.assert_allclose(np.asarray(logits)[i], ref, atol=1e-4 * np.abs(ref).max())


def test_batch_generates_what_each_prompt_generates_alone(fp32_models):
    m = fp32_models["tiny_c"]
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (3, 17, 9)]
    together = flint_jax.generate(m, rows, max_new_tokens=12, temperature=0, stop_token_ids=[])
    for row, got in zip(rows, together):
        alone = flint_jax.generate(m, np.array(row), max_new_tokens=12, temperature=0,
                                   stop_token_ids=[])
        np.testing.assert_array_equal(got, alone)


def test_sampling_is_reproducible_and_seed_dependent(bf16_tiny_a):
    prompt = np.arange(5, 15)
    a = flint_jax.generate(bf16_tiny_a, prompt, max_new_tokens=16, seed=7, stop_token_ids=[])
    b = flint_jax.generate(bf16_tiny_a, prompt, max_new_tokens=16, seed=7, stop_token_ids=[])
    c = flint_jax.generate(bf16_tiny_a, prompt, max_new_tokens=16, seed=8, stop_token_ids=[])
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_text_prompt_streaming_matches_generate(bf16_tiny_a):
    kw = dict(max_new_tokens=12, temperature=0.7, seed=3, stop_token_ids=[])
    text = flint_jax.generate(bf16_tiny_a, "Hello world", **kw)
    events = list(flint_jax.generate(bf16_tiny_a, "Hello world", stream=True, **kw))
    assert [e.token_id for e in events] == text.token_ids.tolist()
    assert "".join(e.text for e in events) == str(text)
    assert events[-1].finish_reason == "length" and text.finish_reason == "length"
    assert str(text) == bf16_tiny_a.tokenizer.decode(text.token_ids)


def test_stop_token_and_logprobs(fp32_models):
    m = fp32_models["tiny_a"]
    prompt = np.arange(20, 30)
    free = flint_jax.generate(m, prompt, max_new_tokens=10, temperature=0, stop_token_ids=[])
    stop_at = int(free[4])
    first = int(np.flatnonzero(free == stop_at)[0])
    out = flint_jax.generate(m, prompt, max_new_tokens=10, temperature=0,
                             stop_token_ids=[stop_at], logprobs=True, return_details=True)
    assert out.finish_reason == "stop"
    np.testing.assert_array_equal(out.token_ids, free[:first + 1])
    # Greedy logprobs are the log-softmax maxima of the full-sequence logits.
    seq = np.concatenate([prompt, out.token_ids])
    full = np.asarray(flint_jax.forward(m, seq), np.float64)
    lse = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
    want = full[len(prompt) - 1:-1].max(-1) - lse[len(prompt) - 1:-1]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-4)


def test_stop_string_cuts_text(bf16_tiny_a):
    kw = dict(max_new_tokens=20, temperature=0, stop_token_ids=[])
    free = flint_jax.generate(bf16_tiny_a, "The sky", **kw)
    assert len(free) > 4
    needle = str(free)[2:4]
    cut = flint_jax.generate(bf16_tiny_a, "The sky", stop=needle, **kw)
    assert cut.finish_reason == "stop"
    assert str(cut) == str(free)[:str(free).find(needle)]


def test_prompt_longer_than_cache_is_refused(fp32_models):
    m = flint_jax.load(fp32_models["tiny_a"].source, dtype="float32", kernels="xla",
                       max_length=32)
    # No room for even one new token: refused (a longer max_new_tokens is clamped instead,
    # tests/test_ux.py), naming the Python argument that sets the cache's length.
    with pytest.raises(decode.PromptTooLongError,
                       match=r"32 tokens and needs a position for a new token, but the cache "
                             r"holds at most 32 positions \(raise it with load\(\.\.\., "
                             r"max_length=N\)"):
        flint_jax.generate(m, np.arange(32), max_new_tokens=8)
    with pytest.raises(decode.PromptTooLongError):
        flint_jax.forward(m, np.arange(40))


def test_cache_that_cannot_fit_is_refused(fp32_models, monkeypatch):
    monkeypatch.setenv("FLINT_JAX_MAX_CACHE_BYTES", str(1 << 20))
    with pytest.raises(CacheTooLargeError, match="KV cache for batch 1 x 4096 tokens needs"):
        flint_jax.generate(fp32_models["tiny_a"], np.arange(4000) % 300, max_new_tokens=8)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_invalid_sampling_values(bf16_tiny_a, kw, match):
    with pytest.raises(ValueError, match=match):
        flint_jax.generate(bf16_tiny_a, np.arange(5), **{"max_new_tokens": 4, **kw})


def test_bad_prompts(bf16_tiny_a):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        flint_jax.generate(bf16_tiny_a, np.array([1, 2, 10_000]), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        flint_jax.generate(bf16_tiny_a, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt must be"):
        flint_jax.generate(bf16_tiny_a, 3.5, max_new_tokens=2)


def test_decode_blocks_give_the_same_tokens(bf16_tiny_a):
    # Several decode steps per device call (a fori_loop) sample exactly what single steps do.
    kw = dict(max_new_tokens=11, temperature=0.9, seed=4, stop_token_ids=[], logprobs=True,
              return_details=True)
    one = flint_jax.generate(bf16_tiny_a, np.arange(3, 12), decode_block=1, **kw)
    four = flint_jax.generate(bf16_tiny_a, np.arange(3, 12), decode_block=4, **kw)
    np.testing.assert_array_equal(one.token_ids, four.token_ids)
    np.testing.assert_allclose(one.logprobs, four.logprobs, atol=1e-5)
    assert len(four.token_ids) == 11


def test_init_cache_reuses_its_compiled_allocator():
    # A fresh jax.jit per call re-traced the allocator before every prefill (~70-100 ms of host
    # time on the H200 at Flint size): the second call with the same shapes must not trace.
    from flint_jax import cache as cache_mod
    from flint_jax.config import preset
    cfg = preset("tiny")
    first = cache_mod.init_cache(cfg, 3, 48)
    traced = cache_mod._zeros_fn.cache_info().misses
    second = cache_mod.init_cache(cfg, 3, 48)
    assert cache_mod._zeros_fn.cache_info().misses == traced
    assert second.full_k is not first.full_k        # fresh buffers, not the first call's
    for a, s in zip(jax.tree.leaves(second), jax.tree.leaves(cache_mod.cache_shapes(cfg, 3, 48))):
        assert a.shape == s.shape and a.dtype == s.dtype and not np.asarray(a).any()
