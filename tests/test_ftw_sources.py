"""Round trip for every codec x source format: exact where the codec can hold the source, int4 within
its stated bound; quantized dense weights dequantized to bf16; excluded modules untouched."""
from __future__ import annotations

import pytest
import torch

from runtime.ftw.codecs import int4_dequantize
from runtime.ftw.converter import convert
from runtime.ftw.errors import FTWError
from runtime.ftw.reader import FTWPackage
from tests.fixtures import quantized as qz
from tests.test_ftw_codecs import assert_int4_bound

BUILDERS = {
    # name: (fixture family, builder)
    "bf16": ("qwen3_moe", lambda s, o: qz.build_cast(s, o, dtype=torch.bfloat16)),
    "fp16": ("mixtral", lambda s, o: qz.build_cast(s, o, dtype=torch.float16)),
    "fp8": ("qwen3_moe", lambda s, o: qz.build_fp8(s, o, block=(32, 32))),      # several scale blocks per tensor
    "fp8_128": ("qwen3_next", lambda s, o: qz.build_fp8(s, o)),
    "mxfp4": ("gpt_oss", qz.build_mxfp4_gpt_oss),
    "nvfp4_modelopt": ("qwen3_moe", qz.build_nvfp4),
    "nvfp4_ct": ("mixtral", lambda s, o: qz.build_nvfp4(s, o, spelling="compressed-tensors")),
    "qwen35_hub": ("qwen3_5_moe", qz.build_qwen35_hub),
}


@pytest.fixture(scope="module")
def variant(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    built = {}

    def get(name: str):
        if name not in built:
            family, build = BUILDERS[name]
            built[name] = (family, build(tiny_checkpoints(family), root / name))
        return built[name]

    return get


def check_experts(pkg: FTWPackage, reference: dict, *, exact_dtype: torch.dtype | None) -> None:
    """exact_dtype: the package must equal the reference rounded to it; None: int4 within its bound."""
    ex = pkg.experts
    assert sorted({k[0] for k in reference}) == ex.layers
    stacked = {layer: ex.layer_tensors(layer) for layer in ex.layers}
    for (layer, e), ref in reference.items():
        w = ex.dequantize(layer, e)
        parts = ex.tensors(layer, e)
        for name, t in parts.items():                 # [E, ...] strided views agree with the per-expert ones
            assert stacked[layer][name].dtype == t.dtype
            assert torch.equal(stacked[layer][name][e].view(torch.uint8), t.view(torch.uint8)), name
        for key, value in ref.items():
            if key.endswith("bias"):
                assert torch.equal(getattr(w, key), value.float()), (layer, e, key)
            elif exact_dtype is not None:
                assert torch.equal(getattr(w, key), value.to(exact_dtype).float()), (layer, e, key)
            else:
                q = {"q": parts[key], "scales": parts[f"{key}_scales"], "mins": parts[f"{key}_mins"]}
                assert torch.equal(int4_dequantize(q["q"], q["scales"], q["mins"], ex.group_size), getattr(w, key))
                assert_int4_bound(value.float(), q, ex.group_size)


@pytest.mark.parametrize("source", sorted(BUILDERS))
@pytest.mark.parametrize("codec", ["auto", "f32", "bf16", "int4", "fp4"])
def test_round_trip(variant, tiny_checkpoints, tmp_path, source, codec):
    family, src = variant(source)
    fp4_source = source.startswith(("mxfp4", "nvfp4"))
    if codec == "fp4" and not fp4_source:
        with pytest.raises(FTWError, match="fp4 codec .* needs such a source"):
            convert(src, tmp_path / "pkg", codec=codec)
        assert not (tmp_path / "pkg").exists()
        return
    pkg = FTWPackage.open(convert(src, tmp_path / "pkg", codec=codec, group_size=32))
    resolved = {"auto": "fp4" if fp4_source else "int4"}.get(codec, codec)
    assert pkg.experts.codec == resolved
    # The hub layout must hold exactly the experts of the per-expert original it was made from.
    reference = qz.reference_experts(tiny_checkpoints(family) if source == "qwen35_hub" else src, family)
    if resolved == "int4":
        check_experts(pkg, reference, exact_dtype=None)
    else:
        exact = {"f32": torch.float32, "bf16": torch.bfloat16, "fp4": torch.float32}[resolved]
        check_experts(pkg, reference, exact_dtype=exact)


def test_fp4_keeps_the_source_bytes(variant, tmp_path):
    """MXFP4 gate/up are a row selection of the fused, interleaved blocks; nothing is re-quantized."""
    _, src = variant("mxfp4")
    sd = qz.load_state_dict(src)
    pkg = FTWPackage.open(convert(src, tmp_path / "pkg"))
    ex = pkg.experts
    assert (ex.codec, ex.fp4_format, ex.block_size, ex.scale_format) == ("fp4", "mxfp4", 32, "e8m0")
    for layer in ex.layers:
        blocks = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"]
        scales = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"]
        for e in range(ex.num_experts):
            t = ex.tensors(layer, e)
            assert torch.equal(t["gate"], blocks[e, 0::2].reshape(ex.intermediate_size, -1))
            assert torch.equal(t["up"], blocks[e, 1::2].reshape(ex.intermediate_size, -1))
            assert torch.equal(t["gate_scales"], scales[e, 0::2])


@pytest.mark.parametrize("source", ["fp8", "nvfp4_modelopt", "nvfp4_ct"])
def test_quantized_dense_weights_become_bf16_and_excluded_ones_stay(variant, tmp_path, source):
    _, src = variant(source)
    raw = qz.load_state_dict(src)
    deq = qz.dequantized_state_dict(src)
    pkg = FTWPackage.open(convert(src, tmp_path / "pkg", codec="bf16"))
    names = set(pkg.dense_names())
    assert not any(n.endswith(("input_scale", "input_global_scale", "_scale_inv", "weight_scale", "_scale_2",
                               "weight_packed", "global_scale")) for n in names)
    quantized = 0
    for name in names:
        t = pkg.dense(name)
        if raw.get(name) is not None and raw[name].is_floating_point() and raw[name].itemsize >= 2:
            assert t.dtype == raw[name].dtype and torch.equal(t, raw[name]), name    # never quantized: as stored
        else:
            quantized += 1
            assert t.dtype == torch.bfloat16 and torch.equal(t, deq[name].to(torch.bfloat16)), name
    assert quantized >= 4
    if source.startswith("nvfp4"):
        # Excluded modules (router, lm_head, layer 0's attention) were stored in full precision.
        for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
            assert pkg.dense(name).dtype == (torch.float32 if "layers.1" not in name else torch.bfloat16)


def test_qwen35_hub_layout(variant, tiny_checkpoints, tmp_path):
    _, src = variant("qwen35_hub")
    pkg = FTWPackage.open(convert(src, tmp_path / "pkg", codec="f32"))
    original = tiny_checkpoints("qwen3_5_moe")
    assert pkg.model_type == "qwen3_5_moe_text" and pkg.config["model_type"] == "qwen3_5_moe_text"
    assert "text_config" not in pkg.config and pkg.config["hidden_size"] == 64
    sd = qz.load_state_dict(original)
    assert set(pkg.dense_names()) == {n for n in sd if ".experts." not in n}          # prefix rewritten, mtp/visual gone
    for name in pkg.dense_names():
        assert torch.equal(pkg.dense(name), sd[name])
    check_experts(pkg, qz.reference_experts(original, "qwen3_5_moe"), exact_dtype=torch.float32)


def test_mxfp4_matches_transformers_own_dequantization(variant, tmp_path):
    """The oracle the engine's parity tests trust: transformers' gpt-oss MXFP4 unpacking (to [E, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, src = variant("mxfp4")
    sd = qz.load_state_dict(src)
    ex = FTWPackage.open(convert(src, tmp_path / "pkg")).experts
    for layer in ex.layers:
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = convert_moe_packed_tensors(sd[p + "gate_up_proj_blocks"], sd[p + "gate_up_proj_scales"],
                                             dtype=torch.float32)
        down = convert_moe_packed_tensors(sd[p + "down_proj_blocks"], sd[p + "down_proj_scales"], dtype=torch.float32)
        for e in range(ex.num_experts):
            w = ex.dequantize(layer, e)
            assert torch.equal(w.gate, gate_up[e][:, 0::2].t()) and torch.equal(w.up, gate_up[e][:, 1::2].t())
            assert torch.equal(w.down, down[e].t())
