"""Tests of flint_jax.gguf_io: Flint GGUF names, validated reading, writing."""

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from flint_jax import gguf_io, nvfp4
from flint_jax.gguf_io import BF16, F32, NVFP4, GGUFError

BF = ml_dtypes.bfloat16


# --- names ------------------------------------------------------------------------------------


def test_name_table_examples():
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.3.attn_q_norm.weight": "model.layers.3.self_attn.q_norm.weight",
        "blk.3.attn_k_norm.weight": "model.layers.3.self_attn.k_norm.weight",
        "blk.3.attn_sinks.weight": "model.layers.3.self_attn.softmax_offset",
        "blk.3.attn_q.weight": "model.layers.3.self_attn.q_proj.weight",
        "blk.3.attn_output.weight": "model.layers.3.self_attn.o_proj.weight",
        "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
        "blk.48.ffn_up_shexp.weight": "model.layers.48.mlp.shared_expert.up_proj.weight",
        "blk.48.ffn_gate_inp.weight": "model.layers.48.mlp.gate.weight",
        "blk.48.ffn_gate_exps.weight": "model.layers.48.mlp.experts.gate_proj.weight",
        # Tensor scales are named after the weight without ".weight" (llama.cpp, vLLM).
        "blk.48.ffn_down_exps.scale": "model.layers.48.mlp.experts.down_proj.weight_scale_2",
        "blk.2.attn_v.scale": "model.layers.2.self_attn.v_proj.weight_scale_2",
        "output.scale": "lm_head.weight_scale_2",
        "blk.2.attn_v.input_scale": "model.layers.2.self_attn.v_proj.input_scale",
        "blk.7.ffn_gate_exps.input_scale": "model.layers.7.mlp.experts.gate_proj.input_scale",
    }
    for g, h in pairs.items():
        assert gguf_io.gguf_to_hf_name(g) == h
        assert gguf_io.hf_to_gguf_name(h) == g
    # flint_jax 0.1's names are still read (never written).
    assert gguf_io.gguf_to_hf_name("blk.2.attn_v.weight.scale") == "model.layers.2.self_attn.v_proj.weight_scale_2"
    assert gguf_io.gguf_to_hf_name("output.weight.scale") == "lm_head.weight_scale_2"
    assert gguf_io.companion_of("output.scale") == ("output.weight", "scale")
    assert gguf_io.companion_of("output.weight.scale") == ("output.weight", "legacy_scale")
    assert gguf_io.companion_of("blk.1.attn_q.input_scale") == ("blk.1.attn_q.weight", "input_scale")
    assert gguf_io.companion_of("blk.1.attn_q.weight") is None
    # HF aliases in: the in-memory sink name and the fused expert down_proj.
    assert gguf_io.hf_to_gguf_name("model.layers.5.self_attn.sinks") == "blk.5.attn_sinks.weight"
    assert gguf_io.hf_to_gguf_name("model.layers.5.mlp.experts.down_proj") == "blk.5.ffn_down_exps.weight"


def test_all_flint_names_roundtrip():
    names = gguf_io.flint_gguf_names(49, [0, 1])
    assert len(names) == len(set(names)) == 1 + 2 * 12 + 47 * 16 + 2
    assert "blk.1.ffn_gate.weight" in names and "blk.1.ffn_gate_exps.weight" not in names
    assert "blk.2.ffn_gate_exps.weight" in names and "blk.2.ffn_gate.weight" not in names
    for g in names:
        assert gguf_io.hf_to_gguf_name(gguf_io.gguf_to_hf_name(g)) == g
        if gguf_io.may_be_nvfp4(g):
            for companion in (gguf_io.scale_name(g), gguf_io.input_scale_name(g)):
                assert gguf_io.hf_to_gguf_name(gguf_io.gguf_to_hf_name(companion)) == companion
    nv = {g.split(".", 2)[-1] for g in names if gguf_io.may_be_nvfp4(g)}
    assert "ffn_gate_inp.weight" not in nv and "attn_sinks.weight" not in nv
    assert "attn_norm.weight" not in nv and "attn_q.weight" in nv and "ffn_down_exps.weight" in nv


def test_bad_names():
    for bad in ("blk.1.ffn_foo.weight", "blk.x.attn_q.weight", "token_embd.weight.scale",
                "token_embd.scale", "blk.3.attn_norm.scale", "blk.3.ffn_gate_inp.scale",
                "blk.3.attn_norm.weight.scale", "blk.3.ffn_gate_inp.weight.scale",
                "blk.3.attn_sinks.input_scale", "blk.3.ffn_foo.scale"):
        with pytest.raises(ValueError, match="tensor"):
            gguf_io.gguf_to_hf_name(bad)
    with pytest.raises(ValueError, match="stacked"):
        gguf_io.hf_to_gguf_name("model.layers.3.mlp.experts.17.gate_proj.weight")
    with pytest.raises(ValueError, match="stacked"):
        gguf_io.hf_to_gguf_name("model.layers.3.mlp.experts.gate_up_proj")
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        gguf_io.hf_to_gguf_name("model.layers.3.mlp.gate.e_score_correction_bias")


# --- a tiny Flint-named file --------------------------------------------------------------------


def tiny_tensors(rng):
    """A small Flint tensor set: {gguf_name: (array, type, original float weight or None)}."""
    e, d, inter = 4, 128, 64
    out = {}
    out["token_embd.weight"] = (rng.standard_normal((10, d)).astype(BF), BF16, None)
    out["blk.0.attn_norm.weight"] = (rng.standard_normal(d).astype(BF), BF16, None)
    out["blk.0.attn_sinks.weight"] = (rng.standard_normal(8).astype(np.float32), F32, None)
    out["blk.0.ffn_gate_inp.weight"] = (rng.standard_normal((e, d)).astype(np.float32), F32, None)
    for name, shape in (("blk.0.attn_q.weight", (256, d)), ("blk.0.ffn_gate_exps.weight", (e, inter, d)),
                        ("blk.0.ffn_down_exps.weight", (e, d, inter))):
        w = rng.standard_normal(shape).astype(np.float32)
        raw, scale = nvfp4.quantize_to_gguf(w)
        out[name] = (raw, NVFP4, w)
        out[gguf_io.scale_name(name)] = (scale, F32, None)
    out["blk.0.attn_k.weight"] = (nvfp4.quantize_to_gguf(rng.standard_normal((32, d)))[0], NVFP4, None)  # no .scale
    out["output.weight"] = (rng.standard_normal((10, d)).astype(BF), BF16, None)
    return out


def test_write_read_roundtrip(tmp_path):
    rng = np.random.default_rng(20)
    tensors = tiny_tensors(rng)
    path = tmp_path / "tiny.gguf"
    meta = {"flint.block_count": 1, "flint.rope.freq_base": 10000.0, "general.name": "tiny",
            "flint.list": [1, 2, 3], "flint.flag": False}
    gen = ((n, a, t) for n, (a, t, _) in tensors.items())  # a generator, consumed once
    gguf_io.write_gguf(path, gen, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no spool left behind

    ck = gguf_io.open_gguf(path)
    assert ck.metadata["general.architecture"] == "flint"
    assert {k: ck.metadata[k] for k in meta} == meta
    assert list(ck.tensors) == list(tensors)  # file order = write order
    seen = [(hf, t.name) for hf, t in ck]
    assert seen == [(gguf_io.gguf_to_hf_name(n), n) for n in tensors]

    for name, (arr, qtype, w) in tensors.items():
        t = ck.tensors[name]
        assert t.tensor_type == qtype
        if qtype == NVFP4:
            k = arr.shape[-1] // 36 * 64
            assert tuple(int(x) for x in t.shape) == (k, *arr.shape[:-1][::-1])  # ggml order, elements
            assert t.data.shape == arr.shape and t.data.dtype == np.uint8
            np.testing.assert_array_equal(ck.array(name), arr)
        elif qtype == BF16:
            assert tuple(int(x) for x in t.shape) == arr.shape[::-1]
            assert t.data.shape == (*arr.shape[:-1], arr.shape[-1] * 2)  # bytes per row
            got = ck.array(name)
            assert got.dtype == BF and got.shape == arr.shape
            np.testing.assert_array_equal(got.view(np.uint16), arr.view(np.uint16))
        else:
            assert ck.array(name).dtype == np.float32
            np.testing.assert_array_equal(ck.array(name), arr)

    # NVFP4 decode of what was read: the kernel layout equals gguf's own dequantize.
    raw = ck.array("blk.0.ffn_gate_exps.weight")
    scale = ck.tensor_scale("blk.0.ffn_gate_exps.weight")
    assert scale.shape == (4,)
    w_hat = nvfp4.dequantize_gguf_np(raw, "blk.0.ffn_gate_exps.weight", scale)
    np.testing.assert_array_equal(w_hat, gguf_dequantize(np.asarray(raw), NVFP4) * scale[:, None, None])
    w = tensors["blk.0.ffn_gate_exps.weight"][2]
    assert np.sqrt(np.mean((w - w_hat) ** 2) / np.mean(w**2)) < 0.12
    np.testing.assert_array_equal(ck.tensor_scale("blk.0.attn_k.weight"), [1.0])  # no .scale -> 1


def test_nvfp4_tensors_helper(tmp_path):
    rng = np.random.default_rng(21)
    raw, scale = nvfp4.quantize_to_gguf(rng.standard_normal((16, 64)))
    entries = gguf_io.nvfp4_tensors("blk.0.attn_q.weight", raw, scale)
    assert [(n, t) for n, _, t in entries] == [("blk.0.attn_q.weight", NVFP4), ("blk.0.attn_q.scale", F32)]
    gguf_io.write_gguf(tmp_path / "a.gguf", entries)
    ck = gguf_io.open_gguf(tmp_path / "a.gguf")
    np.testing.assert_array_equal(ck.tensor_scale("blk.0.attn_q.weight"), scale)


# --- bad files ----------------------------------------------------------------------------------


def good_file(tmp_path, name="good.gguf"):
    rng = np.random.default_rng(22)
    raw, scale = nvfp4.quantize_to_gguf(rng.standard_normal((8, 128)))
    path = tmp_path / name
    gguf_io.write_gguf(path, [("blk.0.attn_norm.weight", np.ones(128, BF), BF16),
                              *gguf_io.nvfp4_tensors("blk.0.attn_q.weight", raw, scale)])
    return path


def raw_writer_file(path, tensors, kv=()):
    """Write with gguf's GGUFWriter directly (bypassing write_gguf's checks).

    tensors: (name, array, raw_dtype, shape or None): shape forces the recorded element shape.
    """
    w = gguf.GGUFWriter(path, arch="flint")
    for key, value, vtype in kv:
        w.add_key_value(key, value, vtype)
    for name, arr, qtype, shape in tensors:
        if shape is None:
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:  # a non-uint8 dtype keeps `shape` as the element shape
            w.add_tensor_info(name, shape, np.dtype(np.float32), arr.nbytes, raw_dtype=qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    if all(s is None for *_, s in tensors):
        w.write_tensors_to_file()
    else:
        w.write_ti_data_to_file()
        for _, arr, _, _ in tensors:
            w.write_tensor_data(arr)
    w.close()
    return path


def test_truncated_file(tmp_path):
    path = good_file(tmp_path)
    data = path.read_bytes()
    (tmp_path / "t1.gguf").write_bytes(data[:-100])  # inside attn_q's blocks
    with pytest.raises(GGUFError, match=r"t1\.gguf.*truncated: tensor 'blk\.0\.attn_q\.weight'"):
        gguf_io.open_gguf(tmp_path / "t1.gguf")
    (tmp_path / "t2.gguf").write_bytes(data[:60])  # inside the header
    with pytest.raises(GGUFError, match=r"t2\.gguf.*(corrupt or truncated header|truncated)"):
        gguf_io.open_gguf(tmp_path / "t2.gguf")
    (tmp_path / "t3.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"t3\.gguf"):
        gguf_io.open_gguf(tmp_path / "t3.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        gguf_io.open_gguf(tmp_path / "missing.gguf")


def test_corrupt_header(tmp_path):
    data = bytearray(good_file(tmp_path).read_bytes())
    bad_magic = bytes(b"GGUX" + data[4:])
    (tmp_path / "m.gguf").write_bytes(bad_magic)
    with pytest.raises(GGUFError, match=r"m\.gguf.*magic"):
        gguf_io.open_gguf(tmp_path / "m.gguf")
    bad_version = bytes(data[:4] + (99).to_bytes(4, "little") + data[8:])
    (tmp_path / "v.gguf").write_bytes(bad_version)
    with pytest.raises(GGUFError, match=r"v\.gguf.*version"):
        gguf_io.open_gguf(tmp_path / "v.gguf")
    huge_kv = bytes(data[:16] + (2**40).to_bytes(8, "little") + data[24:])
    (tmp_path / "k.gguf").write_bytes(huge_kv)
    with pytest.raises(GGUFError, match=r"k\.gguf.*corrupt"):
        gguf_io.open_gguf(tmp_path / "k.gguf")


def test_prec_a4_refused(tmp_path):
    raw, _ = nvfp4.quantize_to_gguf(np.random.default_rng(23).standard_normal((8, 64)))
    kv = [(gguf_io.PREC_A4_KEY, True, gguf.GGUFValueType.BOOL)]
    path = raw_writer_file(tmp_path / "a4.gguf", [("blk.0.attn_q.weight", raw, NVFP4, None)], kv)
    with pytest.raises(GGUFError, match=r"a4\.gguf.*general\.tensor_extra\.prec_a4.*W4A16"):
        gguf_io.open_gguf(path)
    # The same flag set to false is accepted.
    kv = [(gguf_io.PREC_A4_KEY, False, gguf.GGUFValueType.BOOL)]
    path = raw_writer_file(tmp_path / "a16.gguf", [("blk.0.attn_q.weight", raw, NVFP4, None)], kv)
    assert gguf_io.open_gguf(path).metadata[gguf_io.PREC_A4_KEY] is False


def test_row_not_multiple_of_64(tmp_path):
    blocks = np.zeros(2 * 96 * 36 // 64, np.uint8)  # a [2, 96] NVFP4 tensor: 1.5 blocks a row
    path = raw_writer_file(tmp_path / "r.gguf", [("blk.0.attn_v.weight", blocks, NVFP4, (2, 96))])
    with pytest.raises(GGUFError, match=r"r\.gguf.*'blk\.0\.attn_v\.weight'.*row length 96.*multiple of 64"):
        gguf_io.open_gguf(path)


def test_bad_tensors_in_file(tmp_path):
    rng = np.random.default_rng(24)
    raw, _ = nvfp4.quantize_to_gguf(rng.standard_normal((8, 64)))
    f16 = rng.standard_normal(64).astype(np.float16)
    cases = {
        "name.gguf": ([("blk.0.attn_qq.weight", raw, NVFP4, None)], r"'blk\.0\.attn_qq\.weight'.*not a Flint"),
        "f16.gguf": ([("blk.0.attn_norm.weight", f16, gguf.GGMLQuantizationType.F16, None)],
                     r"'blk\.0\.attn_norm\.weight'.*F16"),
        "orphan.gguf": ([("blk.0.attn_q.scale", np.ones(1, np.float32), F32, None)],
                        r"'blk\.0\.attn_q\.scale'.*no NVFP4 tensor"),
        "scale.gguf": ([("blk.0.attn_q.weight", raw, NVFP4, None),
                        ("blk.0.attn_q.scale", np.ones(3, np.float32), F32, None)],
                       r"'blk\.0\.attn_q\.scale'.*1 or 1 elements"),
        "input.gguf": ([("blk.0.attn_q.weight", raw, NVFP4, None),
                        ("blk.0.attn_q.input_scale", np.ones(2, np.float32), F32, None)],
                       r"activation scale 'blk\.0\.attn_q\.input_scale'.*1 or 1 elements"),
        "two.gguf": ([("blk.0.attn_q.weight", raw, NVFP4, None),
                      ("blk.0.attn_q.scale", np.ones(1, np.float32), F32, None),
                      ("blk.0.attn_q.weight.scale", np.ones(1, np.float32), F32, None)],
                     r"'blk\.0\.attn_q\.weight' has two tensor scales"),
    }
    for fname, (tensors, msg) in cases.items():
        path = raw_writer_file(tmp_path / fname, tensors)
        with pytest.raises(GGUFError, match=fname.replace(".", r"\.") + ".*" + msg):
            gguf_io.open_gguf(path)


def test_ff_scale_in_file(tmp_path):
    raw, _ = nvfp4.quantize_to_gguf(np.random.default_rng(25).standard_normal((8, 128)))
    raw[5, 36 + 3] = 0xFF
    path = raw_writer_file(tmp_path / "ff.gguf", [("blk.0.attn_q.weight", raw, NVFP4, None)])
    ck = gguf_io.open_gguf(path)  # found when decoded, not at open (that would read every byte)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*0xFF at row \(5,\), block 1"):
        nvfp4.gguf_to_kernel(ck.array("blk.0.attn_q.weight"), "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*0xFF"):
        gguf_io.write_gguf(tmp_path / "out.gguf", [("blk.0.attn_q.weight", raw, NVFP4)])
    assert not (tmp_path / "out.gguf").exists()


def test_write_refuses_bad_tensors(tmp_path):
    out = tmp_path / "w.gguf"
    bad = [
        (("blk.0.attn_qq.weight", np.ones(4, np.float32), F32), "not a Flint"),
        (("blk.0.attn_norm.weight", np.ones(4, np.float64), F32), "float32"),
        (("blk.0.attn_norm.weight", np.ones(4, np.float32), BF16), "bfloat16"),
        (("blk.0.attn_norm.weight", np.zeros((1, 36), np.uint8), NVFP4), "cannot be NVFP4"),
        (("blk.0.attn_q.weight", np.zeros((1, 40), np.uint8), NVFP4), "multiple of 36"),
        (("blk.0.attn_q.scale", np.ones((1, 1), np.float32), F32), "1-D F32"),
        (("blk.0.attn_q.weight", np.ones(4, np.float16), gguf.GGMLQuantizationType.F16), "not F32, BF16 or NVFP4"),
    ]
    for entry, msg in bad:
        with pytest.raises(ValueError, match=msg):
            gguf_io.write_gguf(out, [entry])
        assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # spool files removed too
