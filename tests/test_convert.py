"""flint-jax convert / quantize / inspect / synth: exactness of every path (CPU).

- HF (tiny_a, tiny_a_fused, tiny_b, tiny_c) -> convert -> load: logits bit-identical to loading the
  HF directory directly, and within 1e-4 (relative to max |logit|) of the transformers goldens.
- NVFP4 GGUF (from our quantizer, and from blocks packed by hand with gguf's own writer) ->
  convert: decoded weights equal `gguf.quants.dequantize(...) * scale` bit for bit; the NVFP4
  model's logits match an fp32 HF checkpoint of the dequantized weights within 1e-4 relative.
- quantize -> convert -> repack (kernel_to_gguf) gives the quantized file's blocks byte for byte.
- Restore onto 8 fake CPU devices: tests/test_sharding.py.
"""

import json
import os
import pathlib
import shutil

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

import flint_jax
from flint_jax import checkpoint, cli_checkpoints, convert, gguf_io, hf_io, inspect_ckpt, nvfp4
from flint_jax import quantize, synth
from flint_jax.config import FlintConfig

GOLDEN = pathlib.Path(__file__).parent / "golden"
REPO = pathlib.Path(__file__).parent.parent
BF = ml_dtypes.bfloat16


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def flat_state(model) -> dict[str, np.ndarray]:
    from flax import nnx
    return {".".join(str(p) for p in path): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(model.state)}


def assert_states_equal(a, b):
    sa, sb = flat_state(a), flat_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert sa[k].shape == sb[k].shape, k
        np.testing.assert_array_equal(np.atleast_1d(sa[k]).view(np.uint8),
                                      np.atleast_1d(sb[k]).view(np.uint8), err_msg=k)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


# ---- HF -> flint_jax ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny_a", "tiny_a_fused", "tiny_b", "tiny_c"])
def test_hf_convert_logits(name, work):
    dst = work / f"{name}-conv"
    convert.convert(GOLDEN / name, dst, progress=False)
    manifest = json.loads((dst / "flint_jax.json").read_text())
    assert manifest["format"] == "flint_jax" and manifest["quant"] is False
    assert manifest["dtype"] == "bfloat16" and manifest["source"]["kind"] == "hf"
    for f in ("config.json", "generation_config.json"):
        assert (dst / f).exists()
    assert FlintConfig.from_json(dst) == FlintConfig.from_json(GOLDEN / name)
    gold = np.load(GOLDEN / ("tiny_a" if name == "tiny_a_fused" else name) / "golden.npz")
    direct = flint_jax.load(GOLDEN / name, dtype="float32", kernels="xla")
    conv = flint_jax.load(dst, dtype="float32", kernels="xla")
    assert_states_equal(conv, direct)
    # One compiled forward: the converted state runs through the direct handle's jitted function
    # (as uncommitted arrays like the direct load's, so jit reuses its executable).
    import jax
    ref = np.asarray(flint_jax.forward(direct, gold["input_ids"]))
    params = jax.tree.map(lambda a: jax.device_put(np.asarray(a)), conv.state)
    got = np.asarray(flint_jax.forward(direct, gold["input_ids"], params=params))
    np.testing.assert_array_equal(got, ref)
    assert rel_err(got, gold["logits"]) <= 1e-4
    if name == "tiny_a":
        assert conv.tokenizer is not None and conv.generation_config


def test_dtype_options_and_bf16_rounding(work):
    """--dtype f32 stores fp32; loading it as bf16 rounds like the HF loader (ml_dtypes RNE);
    --dtype bf16 from an fp32 source equals the HF loader's bf16 cast."""
    src = work / "fp32-src"
    ck = hf_io.HFCheckpoint(str(GOLDEN / "tiny_b"))
    rng = np.random.default_rng(0)
    tensors = {}
    for n in ck.names():  # fp32 values that bf16 cannot hold exactly
        a = np.asarray(ck.get(n)).astype(np.float32)
        tensors[n] = a * (1 + rng.uniform(-1e-3, 1e-3, a.shape)).astype(np.float32)
    src.mkdir()
    hf_io.write_safetensors(str(src / "model.safetensors"), tensors)
    shutil.copy(GOLDEN / "tiny_b" / "config.json", src)
    direct = flint_jax.load(src, kernels="xla")  # bf16
    for opt, stored in (("auto", "float32"), ("f32", "float32"), ("bf16", "bfloat16")):
        dst = work / f"fp32-{opt}"
        convert.convert(src, dst, dtype=opt, progress=False)
        meta = checkpoint.params_metadata(str(dst / "params"))
        assert str(meta["model.layers.0.self_attn.q_proj.weight"][1]) == stored
        assert str(meta["model.layers.2.mlp.gate_proj.weight"][1]) == stored
        router = meta["model.layers.1.mlp.gate.weight"][1]
        assert router == (np.float32 if opt != "auto" else np.float32)  # fp32 in the source too
        assert_states_equal(flint_jax.load(dst, kernels="xla"), direct)


# ---- GGUF -> flint_jax ----------------------------------------------------------------------------

def dequantized_reference(gguf_path, cfg_dir, out_dir):
    """A fused-layout fp32 HF checkpoint holding `gguf.quants.dequantize(blocks) * scale` (the
    tensor scale folded in fp32) for every NVFP4 tensor, other tensors as they are."""
    ck = gguf_io.open_gguf(gguf_path)
    tensors, experts = {}, {}
    for name, t in ck.weights.items():
        if t.tensor_type == gguf_io.NVFP4:
            w = gguf_dequantize(np.asarray(t.data), t.tensor_type)
            s = ck.tensor_scale(name)
            w = w * (s.reshape(-1, 1, 1) if w.ndim == 3 and s.size > 1 else s.reshape(()))
        elif t.tensor_type == gguf_io.BF16:
            w = np.asarray(ck.array(name)).astype(np.float32)
        else:
            w = np.array(t.data, np.float32)
        hf = gguf_io.gguf_to_hf_name(name)
        if ".mlp.experts." in hf:
            stem, part = hf.rsplit(".", 2)[0], hf.rsplit(".", 2)[1]
            experts.setdefault(stem, {})[part] = w.astype(np.float32)
        else:
            tensors[hf] = w.astype(np.float32)
    for stem, parts in experts.items():
        tensors[stem + ".gate_up_proj"] = np.concatenate([parts["gate_proj"], parts["up_proj"]], 1)
        tensors[stem + ".down_proj"] = parts["down_proj"]
    os.makedirs(out_dir)
    hf_io.write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    shutil.copy(os.path.join(cfg_dir, "config.json"), out_dir)
    return tensors


def raw_tensor_scale(reader: gguf.GGUFReader, weight_name: str, legacy=False) -> np.ndarray:
    """A weight's tensor scale read with gguf's own reader by the name the file uses: `X.scale`
    for `X.weight` (llama.cpp, vLLM), or `X.weight.scale` in a flint_jax 0.1 file; 1.0 when absent."""
    name = weight_name + ".scale" if legacy else weight_name[: -len(".weight")] + ".scale"
    t = {t.name: t for t in reader.tensors}.get(name)
    return np.ones(1, np.float32) if t is None else np.array(t.data, np.float32).reshape(-1)


def check_decoded_equals_gguf(gguf_path, conv_dir, legacy=False):
    """Every NVFP4 tensor: flint_jax leaves decode to gguf's dequantize * scale, bit for bit
    (+0/-0 aside), and repack to the file's blocks. The reference reads the file and its scales
    with gguf's own GGUFReader, not with flint_jax."""
    ck = gguf.GGUFReader(str(gguf_path))
    cfg = FlintConfig.from_json(conv_dir)
    stored = checkpoint.params_metadata(os.path.join(conv_dir, "params"))
    import jax
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    leaves = checkpoint.restore_params(os.path.join(conv_dir, "params"), {
        n: jax.ShapeDtypeStruct(s, dt, sharding=dev) for n, (s, dt) in stored.items()})
    leaves = {n: np.asarray(a) for n, a in leaves.items()}
    mi = cfg.moe_intermediate_size
    n_checked = 0
    for t in ck.tensors:
        name = t.name
        if t.tensor_type != gguf_io.NVFP4:
            continue
        hf = gguf_io.gguf_to_hf_name(name)
        raw = np.asarray(t.data)
        ref = gguf_dequantize(raw, t.tensor_type)
        s = raw_tensor_scale(ck, name, legacy)
        ref = ref * (s.reshape(-1, 1, 1) if ref.ndim == 3 and s.size > 1 else s.reshape(()))
        if ".mlp.experts." in hf:
            stem, part = hf.rsplit(".", 2)[0], hf.rsplit(".", 2)[1]
            key = stem + (".down" if part == "down_proj" else ".gate_up")
            q, sc, ts = (leaves[key + x] for x in ("_qweight", "_weight_scale", "_weight_scale_2"))
            if part != "down_proj":
                sl = slice(0, mi) if part == "gate_proj" else slice(mi, 2 * mi)
                q, sc, ts = q[:, sl], sc[:, sl], ts[:, 0 if part == "gate_proj" else 1]
            ts = ts.reshape(-1, 1, 1)
        else:
            base = hf[: -len(".weight")]
            q, sc, ts = (leaves[base + x] for x in (".qweight", ".weight_scale", ".weight_scale_2"))
        got = nvfp4.dequantize_kernel_np(q, sc) * ts
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        np.testing.assert_array_equal(got, ref, err_msg=name)  # -0 == +0
        n_checked += 1
    return leaves, n_checked


@pytest.fixture(scope="module")
def quantized(work):
    """tiny_a quantized by flint-jax quantize, converted."""
    path = work / "tiny_a.gguf"
    rows = quantize.quantize(GOLDEN / "tiny_a", path)
    conv = work / "tiny_a-nvfp4"
    convert.convert(path, conv, hf_config=GOLDEN / "tiny_a", progress=False)
    return path, conv, rows


def test_quantize_file_and_stats(quantized):
    path, conv, rows = quantized
    ck = gguf_io.open_gguf(path)
    assert ck.metadata["general.architecture"] == "flint"
    assert ck.metadata["flint.block_count"] == 6 and ck.metadata["flint.expert_count"] == 8
    types = {n: t.tensor_type for n, t in ck.tensors.items()}
    assert types["token_embd.weight"] == gguf_io.BF16
    assert types["blk.2.ffn_gate_inp.weight"] == gguf_io.F32  # router
    assert types["blk.0.attn_sinks.weight"] == gguf_io.F32
    assert types["blk.0.attn_norm.weight"] == gguf_io.BF16
    assert types["output.weight"] == gguf_io.NVFP4 and types["blk.2.ffn_down_exps.weight"] == gguf_io.NVFP4
    assert ck.tensors["blk.2.ffn_down_exps.scale"].n_elements == 8  # per expert
    assert ck.tensors["blk.0.attn_q.scale"].n_elements == 1 and ck.tensors["output.scale"].n_elements == 1
    assert not [n for n in ck.tensors if n.endswith(".weight.scale")]  # the names llama.cpp reads
    nv = [r for r in rows if r["type"] == "NVFP4"]
    assert len(nv) == sum(t == gguf_io.NVFP4 for t in types.values())
    assert all(0 < r["rel_rms_err"] < 0.15 and r["max_abs_err"] > 0 for r in nv)
    table = quantize.format_table(rows)
    assert "blk.2.ffn_down_exps.weight" in table and "NVFP4" in table


def test_quantized_gguf_convert_exact(quantized, work):
    path, conv, _ = quantized
    manifest = checkpoint.read_manifest(str(conv))
    assert manifest["quant"] is True and manifest["dtype"] == "nvfp4"
    leaves, n = check_decoded_equals_gguf(path, str(conv))
    assert n == 6 * 4 + 2 * 3 + 4 * 6 + 1  # attention, dense MLPs, MoE (3 shexp + 3 exps), head
    # Repack: the stored leaves give back the quantized file's blocks byte for byte.
    ck = gguf_io.open_gguf(path)
    cfg = FlintConfig.from_json(conv)
    mi = cfg.moe_intermediate_size
    for name, t in ck.tensors.items():
        if t.tensor_type != gguf_io.NVFP4:
            continue
        hf = gguf_io.gguf_to_hf_name(name)
        if ".mlp.experts." in hf:
            stem, part = hf.rsplit(".", 2)[0], hf.rsplit(".", 2)[1]
            key = stem + (".down" if part == "down_proj" else ".gate_up")
            q, s = leaves[key + "_qweight"], leaves[key + "_weight_scale"]
            ts = leaves[key + "_weight_scale_2"]
            if part != "down_proj":
                j = 0 if part == "gate_proj" else 1
                q, s, ts = q[:, j * mi:(j + 1) * mi], s[:, j * mi:(j + 1) * mi], ts[:, j]
        else:
            base = hf[: -len(".weight")]
            q, s, ts = (leaves[base + x] for x in (".qweight", ".weight_scale", ".weight_scale_2"))
        np.testing.assert_array_equal(nvfp4.kernel_to_gguf(q, s), np.asarray(t.data), err_msg=name)
        np.testing.assert_array_equal(np.asarray(ts, np.float32).reshape(-1), ck.tensor_scale(name))
    # Loading the GGUF directly gives the same state as the converted checkpoint.
    direct = flint_jax.load(path, hf_config=GOLDEN / "tiny_a", dtype="float32", kernels="xla")
    assert direct.quant
    assert_states_equal(direct, flint_jax.load(conv, dtype="float32", kernels="xla"))


def test_nvfp4_logits_match_dequantized_reference(quantized, work):
    path, conv, _ = quantized
    ref_dir = work / "tiny_a-dequant-fp32"
    dequantized_reference(path, GOLDEN / "tiny_a", ref_dir)
    gold = np.load(GOLDEN / "tiny_a" / "golden.npz")
    ref = np.asarray(flint_jax.forward(flint_jax.load(ref_dir, dtype="float32", kernels="xla"),
                                       gold["input_ids"]))
    model = flint_jax.load(conv, dtype="float32", kernels="xla")
    got = np.asarray(flint_jax.forward(model, gold["input_ids"]))
    assert rel_err(got, ref) <= 1e-4


# Weights whose tensor scale hand_packed_gguf always writes: dense, shared expert, routed experts
# (one scale per expert) and the LM head; a third of the others have none (= 1.0).
ALWAYS_SCALED = {"blk.0.ffn_down.weight": 1, "blk.2.ffn_up_shexp.weight": 1,
                 "blk.2.ffn_down_exps.weight": 8, "blk.3.ffn_gate_exps.weight": 8,
                 "output.weight": 1}


def hand_packed_gguf(path, cfg: FlintConfig, seed=0, scale_names="standard"):
    """A Flint NVFP4 GGUF written with gguf's own GGUFWriter from random blocks: scale bytes
    0x00..0x7E plus 0x7F (decodes as 0) and bit-7 bytes; some tensor scales missing (1.0),
    expert scales [E] or [1]. `scale_names`: "standard" names them as llama.cpp and vLLM do
    (`blk.N.attn_q.scale` for `blk.N.attn_q.weight`, `output.scale`) and adds some
    `X.input_scale` sidecars; "legacy" as flint_jax 0.1 did (`X.weight.scale`); "both" writes
    both names for one weight."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="flint")
    scale_choices = np.array([0x00, 0x7F, 0xB0] + list(range(0x30, 0x48)), np.uint8)
    for i, (name, shape) in enumerate(gguf_io.gguf_expected(cfg).items()):
        if gguf_io.may_be_nvfp4(name):
            *lead, k = shape
            blocks = rng.integers(0, 256, size=(*lead, k // 64, 36), dtype=np.uint8)
            blocks[..., :4] = rng.choice(scale_choices, size=(*lead, k // 64, 4))
            w.add_tensor(name, blocks.reshape(*lead, k // 64 * 36), raw_dtype=gguf_io.NVFP4)
            if i % 3 or name in ALWAYS_SCALED:
                n = ALWAYS_SCALED.get(name, shape[0] if len(shape) == 3 and i % 2 else 1)
                scale = rng.uniform(0.005, 0.02, n).astype(np.float32)
                base = name[: -len(".weight")]
                if scale_names in ("standard", "both"):
                    w.add_tensor(base + ".scale", scale)
                if scale_names in ("legacy", "both"):
                    w.add_tensor(name + ".scale", scale)
                if scale_names == "standard" and i % 2:
                    w.add_tensor(base + ".input_scale", rng.uniform(1, 2, n).astype(np.float32))
        elif name == "token_embd.weight":
            w.add_tensor(name, rng.standard_normal(shape).astype(BF), raw_dtype=gguf_io.BF16)
        elif name.endswith("norm.weight"):
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:  # router, sinks
            w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_hand_packed_gguf_convert_exact(work):
    path = work / "hand.gguf"
    cfg = FlintConfig.from_json(GOLDEN / "tiny_a")
    hand_packed_gguf(path, cfg)
    conv = work / "hand-conv"
    convert.convert(path, conv, hf_config=GOLDEN / "tiny_a", progress=False)
    _, n = check_decoded_equals_gguf(path, str(conv))
    assert n == 55
    # W4A16 end to end on CPU: bf16 activations, NVFP4 weights, greedy generation.
    model = flint_jax.load(conv, kernels="xla")
    assert model.quant
    out = flint_jax.generate(model, [[1, 2, 3]], max_new_tokens=3, temperature=0.0)
    assert len(out[0]) == 3 and all(0 <= int(t) < cfg.vocab_size for t in out[0])


def test_standard_scale_names_convert(work):
    """The names llama.cpp writes and vLLM reads (`X.scale`, `X.input_scale`): a file with a
    dense layer's, a shared expert's, routed experts' (one per expert) and the LM head's scale
    converts, and every decoded weight equals gguf's dequantize times the scale gguf reads."""
    path = work / "standard.gguf"
    cfg = FlintConfig.from_json(GOLDEN / "tiny_a")
    hand_packed_gguf(path, cfg, seed=3)
    names = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for weight, n in ALWAYS_SCALED.items():
        base = weight[: -len(".weight")]
        assert names[base + ".scale"].n_elements == n and weight + ".scale" not in names
    assert any(n.endswith(".input_scale") for n in names)
    ck = gguf_io.open_gguf(path)
    np.testing.assert_array_equal(ck.tensor_scale("output.weight"), np.asarray(names["output.scale"].data))
    inputs = [n for n in names if n.endswith(".input_scale")]
    np.testing.assert_array_equal(ck.input_scale(inputs[0][: -len(".input_scale")] + ".weight"),
                                  np.asarray(names[inputs[0]].data))
    conv = work / "standard-conv"
    convert.convert(path, conv, hf_config=GOLDEN / "tiny_a", progress=False)
    _, n = check_decoded_equals_gguf(path, str(conv))
    assert n == 55
    rows = inspect_ckpt.inspect(str(path), config=str(GOLDEN / "tiny_a")).tensors
    assert {"output.scale", "blk.2.ffn_down_exps.scale"} <= {r.name for r in rows}


def test_legacy_scale_names(work):
    """Files of flint_jax 0.1 (`X.weight.scale`) still convert, with a one-line warning; a file
    with both names for one weight is refused."""
    cfg = FlintConfig.from_json(GOLDEN / "tiny_a")
    path = work / "legacy.gguf"
    hand_packed_gguf(path, cfg, seed=4, scale_names="legacy")
    conv = work / "legacy-conv"
    with pytest.warns(gguf_io.LegacyScaleNameWarning, match=r"legacy\.gguf.*'.*\.weight\.scale'.*look for X\.scale"):
        convert.convert(path, conv, hf_config=GOLDEN / "tiny_a", progress=False)
    _, n = check_decoded_equals_gguf(path, str(conv), legacy=True)
    assert n == 55
    both = work / "both.gguf"
    hand_packed_gguf(both, cfg, seed=4, scale_names="both")
    with pytest.raises(gguf_io.GGUFError, match=r"both\.gguf.*has two tensor scales.*X\.scale"):
        convert.convert(both, work / "both-conv", hf_config=GOLDEN / "tiny_a", progress=False)
    assert not (work / "both-conv").exists()


def test_mixed_gguf(work):
    """A BF16 output.weight among NVFP4 layers: refused by default, or quantize / dequantize."""
    cfg = FlintConfig.from_json(GOLDEN / "tiny_a")
    src = gguf_io.open_gguf(work / "tiny_a.gguf") if (work / "tiny_a.gguf").exists() else None
    if src is None:
        quantize.quantize(GOLDEN / "tiny_a", work / "tiny_a.gguf")
        src = gguf_io.open_gguf(work / "tiny_a.gguf")
    head = np.asarray(hf_io.HFCheckpoint(str(GOLDEN / "tiny_a")).get("lm_head.weight"))
    entries = []
    for name, t in src.tensors.items():
        if name in ("output.weight", "output.scale"):
            continue
        entries.append((name, np.array(src.array(name)), t.tensor_type))
    entries.append(("output.weight", head, gguf_io.BF16))
    mixed = work / "mixed.gguf"
    gguf_io.write_gguf(mixed, entries)
    with pytest.raises(convert.ConvertError, match=r"mixed.*output\.weight.*--mixed"):
        convert.convert(mixed, work / "mixed-refused", hf_config=GOLDEN / "tiny_a", progress=False)
    assert not (work / "mixed-refused").exists()
    q = convert.make_plan(mixed, hf_config=GOLDEN / "tiny_a", mixed="quantize")
    assert q.quant and "lm_head.qweight" in {t.name for t in q.tensors}
    d = convert.make_plan(mixed, hf_config=GOLDEN / "tiny_a", mixed="dequantize")
    assert not d.quant
    by = {t.name: t for t in d.tensors}
    assert by["lm_head.weight"].dtype == BF and by["model.layers.0.self_attn.q_proj.weight"].dtype == np.float32
    np.testing.assert_array_equal(by["lm_head.weight"].produce(), head)
    ref = nvfp4.dequantize_gguf_np(np.asarray(src.tensors["blk.0.attn_q.weight"].data), "q",
                                   src.tensor_scale("blk.0.attn_q.weight"))
    np.testing.assert_array_equal(by["model.layers.0.self_attn.q_proj.weight"].produce(), ref)


# ---- synth, inspect, CLI -------------------------------------------------------------------------

def test_synth_formats_convert_and_load(work):
    hf = synth.synth(work / "synth-hf", fmt="hf", config="tiny", layers=3, seed=3)
    gg = synth.synth(work / "synth-gguf", fmt="gguf", config="tiny", layers=3, seed=3)
    fused = synth.synth(work / "synth-fused", fmt="hf", config="tiny", layers=3, seed=3, fused=True)
    cfg = hf["config"]
    assert cfg.num_hidden_layers == 3 and (work / "synth-hf" / "tokenizer.json").exists()
    ck = hf_io.HFCheckpoint(str(work / "synth-hf"))
    hf_io.plan(ck, cfg)
    assert len(ck.files) == 5  # embeddings, 3 layers, head
    for n in ck.names():  # realistic, never zero
        a = np.asarray(ck.get(n)).astype(np.float32)
        assert np.isfinite(a).all() and (a != 0).all(), n
    q = np.asarray(ck.get("model.layers.2.mlp.experts.3.up_proj.weight")).astype(np.float32)
    assert 0.015 < q.std() < 0.025
    # The same seed gives the same values in both HF layouts.
    fk = hf_io.HFCheckpoint(str(work / "synth-fused"))
    assert fk.shape("model.layers.2.mlp.experts.gate_up_proj") == (8, 128, 128)
    g = gguf_io.open_gguf(gg["path"])
    assert sum(t.tensor_type == gguf_io.NVFP4 for t in g.tensors.values()) == 3 * 4 + 2 * 3 + 6 + 1
    w = nvfp4.dequantize_gguf_np(np.asarray(g.tensors["blk.2.ffn_down_exps.weight"].data), "d",
                                 g.tensor_scale("blk.2.ffn_down_exps.weight"))
    assert 0.01 < w.std() < 0.04 and np.count_nonzero(w) > 0.8 * w.size
    for r in (inspect_ckpt.inspect(work / "synth-hf"), inspect_ckpt.inspect(work / "synth-fused"),
              inspect_ckpt.inspect(gg["path"], config=str(work / "synth-gguf"))):
        assert r.ok, r.problems
    convert.convert(gg["path"], work / "synth-gguf-conv", hf_config=work / "synth-gguf",
                    progress=False)
    m = flint_jax.load(work / "synth-gguf-conv", kernels="xla")
    assert m.quant and m.tokenizer is not None
    text = flint_jax.generate(m, "Hello", max_new_tokens=3, temperature=0.0)
    assert len(text.token_ids) == 3


def test_inspect_reports(quantized, work):
    path, conv, _ = quantized
    r = inspect_ckpt.inspect(GOLDEN / "tiny_a")
    assert r.ok and r.kind == "hf" and r.n_tensors == len(hf_io.HFCheckpoint(str(GOLDEN / "tiny_a")).names())
    assert any(t.count == 8 for t in r.tensors)  # per-expert tensors grouped
    assert "verdict: OK" in inspect_ckpt.format_report(r)
    r = inspect_ckpt.inspect(GOLDEN / "tiny_a_fused")
    assert r.ok, r.problems
    r = inspect_ckpt.inspect(path)  # no config: listed, not checked
    assert not r.ok and r.config_source is None and r.n_tensors == len(gguf_io.open_gguf(path).tensors)
    r = inspect_ckpt.inspect(path, config=str(GOLDEN / "tiny_a"), check_blocks=True)
    assert r.ok, r.problems
    assert r.metadata["flint.expert_count"] == 8
    r = inspect_ckpt.inspect(conv)
    assert r.ok and r.kind == "flint_jax" and r.metadata["quant"] is True
    # Against a config that disagrees: every problem listed.
    bad = work / "cfg-5-layers"
    bad.mkdir(exist_ok=True)
    FlintConfig.from_json(GOLDEN / "tiny_a").replace(num_hidden_layers=5).to_json(bad / "config.json")
    r = inspect_ckpt.inspect(GOLDEN / "tiny_a", config=str(bad))
    assert not r.ok and any("the config has 5 layers" in p for p in r.problems)
    assert all("model.layers.5." in p for p in r.problems)
    bad6 = work / "cfg-4-experts"
    bad6.mkdir(exist_ok=True)
    FlintConfig.from_json(GOLDEN / "tiny_a").replace(num_experts=4).to_json(bad6 / "config.json")
    r = inspect_ckpt.inspect(GOLDEN / "tiny_a_fused", config=str(bad6))
    assert any("gate_up_proj' has shape [8, 128, 128], expected [4, 128, 128]" in p
               for p in r.problems), r.problems
    r = inspect_ckpt.inspect(path, config=str(bad))
    assert not r.ok and any("blk.5." in p for p in r.problems)


def test_cli_in_process(quantized, work, capsys):
    path, conv, _ = quantized
    main = cli_checkpoints.main
    assert main(["inspect", str(conv)]) == 0
    out = capsys.readouterr().out
    assert "flint_jax checkpoint" in out and "verdict: OK" in out
    assert main(["inspect", str(path), "--config", str(GOLDEN / "tiny_a"), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["ok"] and j["kind"] == "gguf"
    assert main(["quantize", str(GOLDEN / "tiny_a_fused"), str(work / "cli.gguf")]) == 0
    out = capsys.readouterr().out
    assert "blk.2.ffn_gate_exps.weight" in out and "relative RMS error" in out
    # tiny_a and tiny_a_fused hold the same weights: the same quantized bytes.
    assert (work / "cli.gguf").read_bytes()[-4096:] == path.read_bytes()[-4096:]
    assert main(["convert", str(work / "cli.gguf"), str(work / "cli-conv"), "--hf-config",
                 str(GOLDEN / "tiny_a"), "-q"]) == 0
    assert "quant=True" in capsys.readouterr().out
    assert main(["synth", str(work / "cli-synth"), "--format", "gguf", "--layers", "2",
                 "--experts", "4", "-q"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint.startswith(f"convert with: flint-jax convert {work / 'cli-synth' / 'model.gguf'} DST")
    assert main(["convert", str(work / "cli-synth" / "model.gguf"), str(work / "cli-synth-conv"),
                 "-q"]) == 0   # the hint's command works: config.json beside the file is found
    assert main(["inspect", str(work / "cli-synth" / "model.gguf"), "--config",
                 str(work / "cli-synth")]) == 0


def test_public_api_spelling(work):
    """`flint_jax.convert` is the module; `flint_jax.convert.convert(src, dst)` converts (the
    module is no longer made callable)."""
    import types
    assert isinstance(flint_jax.convert, types.ModuleType)
    dst = flint_jax.convert.convert(GOLDEN / "tiny_c", work / "api-tiny_c", progress=False)
    assert checkpoint.is_converted(dst)
    assert flint_jax.load(dst, kernels="xla").config == FlintConfig.from_json(GOLDEN / "tiny_c")
