"""The CLI driven in subprocesses: demo, generate --json, chat with piped input, --help."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, stdin=None, demo_dir=None, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if demo_dir:
        env["FLINT_JAX_DEMO_DIR"] = str(demo_dir)
    return subprocess.run([sys.executable, "-m", "flint_jax.cli", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo") / "ckpt"


def test_demo_runs():
    # The shipped trained model: a completion, a chat answer and a parsed tool call (greedy).
    res = run_cli("demo", "--max-new-tokens", "48")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "[complete]" in out and "[chat]" in out and "[tool call]" in out
    # The chat turn asks a task the model answers right under greedy decoding (cli.DEMO_CHAT).
    chat_part = out.split("[chat]", 1)[1].split("[tool call]", 1)[0]
    assert "Reverse the word 'flint'." in chat_part and "'tnilf'" in chat_part, chat_part
    tool_part = out.split("[tool call]", 1)[1]
    reply = json.loads(tool_part[tool_part.index("\n{"):tool_part.index("\n}") + 2])
    call = reply["tool_calls"][0]["function"]
    # The right tool, with the city asked about copied into its argument (docs/demo_model.md).
    assert call["name"] == "get_weather" and call["arguments"]["city"] == "Oslo", reply


def test_demo_random_is_a_model_name(demo_dir):
    res = run_cli("generate", "demo-random", "Hello", "--max-new-tokens", "4", "--temperature",
                  "0", demo_dir=demo_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RANDOM weights" in res.stderr
    assert os.path.exists(demo_dir / "model.safetensors")


def test_generate_json():
    res = run_cli("generate", "demo", "Hello", "--max-new-tokens", "6", "--temperature", "0",
                  "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prompt"] == "Hello" and len(out["token_ids"]) == len(out["logprobs"]) >= 1
    assert out["finish_reason"] in ("stop", "length")
    st = out["stats"]
    assert st["ttft_s"] > 0 and st["prompt_tokens_per_s"] > 0 and st["compile_s"] > 0
    assert st["generated_tokens"] == len(out["token_ids"])
    assert st["generation_tokens_per_s"] is None or st["generation_tokens_per_s"] > 0
    assert res.stderr.count("[flint-jax] compiling the") == 1


def test_chat_with_piped_input(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}]))
    res = run_cli("chat", "demo", "--tools", str(tools), "--max-new-tokens", "6",
                  stdin="hello\n/reset\nsecond question\n/exit\n")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[conversation cleared]" in res.stdout
    assert res.stdout.count("[thinking]") + res.stdout.count("[answer]") >= 2
    # A line of timings on stderr after each answer, none on stdout.
    assert res.stderr.count("prompt tokens at") == 2 and "tok/s" not in res.stdout


def test_generate_clamps_names_the_flag_and_reports_timings():
    # --max-length 16 leaves too little room for 40 new tokens: clamped with a warning naming
    # the CLI's flag; --debug after the command is accepted; the timings go to stderr.
    res = run_cli("generate", "demo", "Hello", "--max-new-tokens", "40", "--max-length", "16",
                  "--temperature", "0", "--debug")
    assert res.returncode == 0, res.stderr[-3000:]
    err = res.stderr
    assert "flint-jax generate: warning: max_new_tokens=40 does not fit" in err, err
    assert "--max-length N" in err and "load(" not in err
    assert err.count("[flint-jax] compiling the") == 1
    assert "generated at" in err and "first token after" in err
    assert "tok/s" not in res.stdout
    # The prompt alone too long: one error line naming --max-length; --quiet drops the notices.
    res = run_cli("generate", "demo", "Hello world, hello again", "--max-length", "2", "--quiet")
    assert res.returncode == 1
    assert "flint-jax generate: error: prompt row 0 has" in res.stderr
    assert "--max-length N" in res.stderr and "compiling" not in res.stderr


def test_errors_are_one_line(tmp_path):
    res = run_cli("generate", str(tmp_path / "missing"), "hi")
    assert res.returncode == 1
    assert "flint-jax generate: error:" in res.stderr and "Traceback" not in res.stderr


def test_help_explains():
    res = run_cli("--help")
    assert res.returncode == 0 and "demo" in res.stdout and "generate" in res.stdout
    res = run_cli("generate", "--help")
    assert "--temperature" in res.stdout and "--json" in res.stdout
