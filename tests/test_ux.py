"""User-facing behaviour (issue 39): the compile notice, timings, clamping max_new_tokens, a GGUF
file's config found beside it, help text on every CLI option, the bench smoke preset."""

import argparse
import logging
import pathlib
import warnings

import numpy as np
import pytest

import flint_jax
from flint_jax import cli, cli_checkpoints, decode, inspect_ckpt, synth

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def fresh_tiny_a():
    """A handle of its own (nothing compiled yet), the cache bounded to 32 positions."""
    return flint_jax.load(GOLDEN / "tiny_a", kernels="xla", max_length=32)


def _notices(caplog):
    return [r for r in caplog.records if r.name == "flint_jax" and "compiling" in r.getMessage()]


def test_compile_notice_once_and_stats(fresh_tiny_a, caplog):
    m = fresh_tiny_a
    kw = dict(max_new_tokens=6, temperature=0, stop_token_ids=[], return_details=True)
    with caplog.at_level(logging.INFO, logger="flint_jax"):
        first = flint_jax.generate(m, np.arange(20, 30), **kw)
    notes = _notices(caplog)
    assert len(notes) == 1, [r.getMessage() for r in notes]
    msg = notes[0].getMessage()
    assert "prefill step" in msg and "decode step" in msg and "batch 1, cache length 64" in msg
    assert first.stats.compile_s > 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flint_jax"):
        second = flint_jax.generate(m, np.arange(40, 50), **kw)   # same shapes: no compile
    assert _notices(caplog) == []
    for out in (first, second):
        st = out.stats
        assert st.prompt_tokens == 10 and st.generated_tokens == 6
        assert st.ttft_s > 0 and st.decode_s > 0
        assert st.prompt_tokens_per_s > 0 and st.generation_tokens_per_s > 0
    assert second.stats.compile_s == 0.0
    d = second.stats.as_dict()
    assert set(d) >= {"ttft_s", "prompt_tokens_per_s", "generation_tokens_per_s", "compile_s"}
    assert "tok/s" in second.stats.summary()
    # A stream's stats are complete once it is exhausted; a text result carries them too.
    stream = flint_jax.generate(m, np.arange(40, 50), stream=True, max_new_tokens=4,
                                temperature=0, stop_token_ids=[])
    assert len(list(stream)) == 4 and stream.stats.generation_tokens_per_s > 0


def test_max_new_tokens_is_clamped_with_a_warning(fresh_tiny_a):
    m = fresh_tiny_a
    with pytest.warns(decode.MaxNewTokensClampedWarning,
                      match=r"max_new_tokens=40 does not fit: the cache holds 32 positions and "
                            r"the longest prompt takes 10; generating at most 22 tokens "
                            r"\(raise the cache's length with load\(\.\.\., max_length=N\)"):
        ids = flint_jax.generate(m, np.arange(20, 30), max_new_tokens=40, temperature=0,
                                 stop_token_ids=[])
    assert len(ids) == 22
    # Within the room: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", decode.MaxNewTokensClampedWarning)
        assert len(flint_jax.generate(m, np.arange(20, 30), max_new_tokens=22, temperature=0,
                                      stop_token_ids=[])) == 22


@pytest.fixture(scope="module")
def synth_gguf(tmp_path_factory):
    """`flint-jax synth DIR --format gguf --config tiny`: DIR/model.gguf beside config.json and
    the tokenizer."""
    out = tmp_path_factory.mktemp("synth") / "tiny"
    info = synth.synth(str(out), fmt="gguf", config="tiny", progress=False)
    return out / "model.gguf", info


def test_gguf_finds_config_beside_it(synth_gguf, tmp_path, capsys):
    path, info = synth_gguf
    m = flint_jax.load(path, kernels="xla")
    assert m.quant and m.tokenizer is not None
    assert m.config.num_hidden_layers == info["config"].num_hidden_layers
    r = inspect_ckpt.inspect(path)
    assert r.ok and r.config_source == str(path.parent), (r.problems, r.notes)
    assert cli_checkpoints.main(["inspect", str(path)]) == 0
    assert "verdict: OK: matches the config in" in capsys.readouterr().out
    # convert takes config.json and the tokenizer from beside the file as well.
    dst = tmp_path / "conv"
    assert cli_checkpoints.main(["convert", str(path), str(dst), "-q"]) == 0
    assert (dst / "config.json").exists() and (dst / "tokenizer.json").exists()


def test_hub_id_gets_a_download_hint():
    with pytest.raises(FileNotFoundError, match=r"a hub ID is not fetched: download it first, "
                                                r"e\.g\. `hf download RecursiveSI/flint"):
        flint_jax.load("RecursiveSI/flint")


def _walk(parser, where="flint-jax"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{where} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield where, action


def test_every_option_has_help_and_debug_everywhere():
    parser = cli.build_parser()
    seen = set()
    for where, action in _walk(parser):
        seen.add(where)
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), \
            f"{where}: {name} has no help text"
    commands = {"demo", "generate", "chat", "bench", "convert", "quantize", "inspect", "synth"}
    assert {f"flint-jax {c}" for c in commands} <= seen
    # --debug before or after every command.
    argv = {"demo": [], "generate": ["m", "p"], "chat": ["m"], "bench": [],
            "convert": ["a", "b"], "quantize": ["a", "b"], "inspect": ["a"], "synth": ["a"]}
    for c, rest in argv.items():
        assert parser.parse_args([c, *rest, "--debug"]).debug is True, c
        assert parser.parse_args(["--debug", c, *rest]).debug is True, c
        assert parser.parse_args([c, *rest]).debug is False, c


def test_bench_smoke_preset():
    parser = cli.build_parser()
    a = cli.bench_options(parser.parse_args(["bench", "--config", "smoke"]))
    assert (a.config, a.layers, a.batch, a.context, a.steps) == ("tiny", 2, [1], [64], 2)
    a = cli.bench_options(parser.parse_args(["bench", "--config", "smoke", "--dtype", "bf16"]))
    assert a.dtype == ["bf16"] and a.context == [64]          # an explicit option still applies
    a = cli.bench_options(parser.parse_args(["bench"]))
    assert a.config == "flint" and a.batch == [1, 8] and a.steps == 50


def test_python_convert_finds_gguf_config_beside(tmp_path):
    """`flint_jax.convert.convert(model.gguf, dst)` from Python, like the CLI, takes config.json
    and the tokenizer from the file's own directory."""
    import flint_jax
    from flint_jax import synth
    synth.synth(tmp_path / "g", fmt="gguf", config="tiny", layers=2, experts=4)
    flint_jax.convert.convert(tmp_path / "g" / "model.gguf", tmp_path / "conv", progress=False)
    assert flint_jax.load(tmp_path / "conv", kernels="xla").quant
