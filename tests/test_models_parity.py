"""Our Qwen3-MoE, Mixtral and gpt-oss against transformers on the same tiny random weights (fp32).

Logits through the engine's model over an FTW package must match transformers' forward within 1e-4
(lossless f32 codec), prefilled in chunks through the KV cache; greedy generations must be identical
to transformers' generate. Lossy codecs have stated bounds, and the model itself stays exact against
transformers running on the very weights the codec produced.
"""
from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine, SamplingParams
from runtime.loading import build_empty_model, load_dense_weights
from runtime.experts.resident import ResidentExperts
from runtime.models.base import Batch
from tests.engine_fixtures import (OWN_FAMILIES, SafetensorsSource, ftw_packages, random_prompt,  # noqa: F401
                                   reference_greedy, references)

# |logit error| against transformers on the original fp32 weights, per expert codec: (max, mean). Logits
# are O(1). int4 (group 64) can flip a near-tied routing choice, which moves single logits by a few
# tenths (measured up to 0.45 on gpt-oss) while the mean stays ~0.01; bf16 measured <= 1.6e-3 max.
CODEC_BOUNDS = {"f32": (1e-4, 1e-5), "bf16": (5e-3, 1e-3), "int4": (1.0, 0.03)}


def engine_logits(eng: Engine, prompt: list[int], chunks: tuple[int, ...]) -> torch.Tensor:
    """Every position's logits, prefilled in the given chunk sizes through one sequence's cache: [T, V]."""
    cache = eng.model.new_cache(device=eng.device, dtype=eng.dtype)
    out, start = [], 0
    with torch.inference_mode():
        for n in chunks:
            batch = Batch.build([(prompt[start:start + n], cache)], device=eng.device)
            out.append(eng.model(batch, all_logits=True).cpu())
            start += n
    assert cache.offset == len(prompt) == start
    return torch.cat(out)


def reference_logits(ref, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_logits_match_transformers_through_ftw(family, ftw_packages, references, device):
    eng = Engine.load(ftw_packages(family, "f32"), device=device, dtype=torch.float32)
    prompt = random_prompt(24, seed=1)
    # 11 + 1 + 12: a multi-token chunk, a single-token step and another chunk; gpt-oss's window is 8
    ours = engine_logits(eng, prompt, (11, 1, 12))
    ref = reference_logits(references(family), prompt)
    assert (ours - ref).abs().max().item() <= CODEC_BOUNDS["f32"][0]


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_logits_match_transformers_from_safetensors(family, tiny_checkpoints, references):
    """The same model loaded straight from the HF shards (no converter): isolates model bugs from FTW bugs."""
    src = SafetensorsSource(tiny_checkpoints(family))
    model = build_empty_model(src.config, experts=None, device="cpu", dtype=torch.float32)
    report = load_dense_weights(model, src)
    assert set(report.loaded.values()) == set(src.dense_names()) - set(report.ignored)
    model.set_experts(ResidentExperts.from_store(src.experts, model.expert_spec(), device="cpu", dtype=torch.float32))
    prompt = random_prompt(16, seed=2)
    with torch.inference_mode():
        ours = model(Batch.build([(prompt, model.new_cache(device="cpu", dtype=torch.float32))], device="cpu"),
                     all_logits=True)
    assert (ours - reference_logits(references(family), prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_greedy_generation_identical_to_transformers(family, ftw_packages, references, device):
    eng = Engine.load(ftw_packages(family, "f32"), device=device, dtype=torch.float32)
    prompt = random_prompt(19, seed=4)   # longer than gpt-oss's window of 8
    expected = reference_greedy(references(family), prompt, 32)
    result = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=()))
    assert result.tokens == expected
    assert result.finish_reason == "length"


def _substitute_experts(ref, family: str, store) -> None:
    """Put the package's dequantized experts into the transformers model (its fused in-memory layout)."""
    with torch.no_grad():
        for layer in store.layers:
            mlp = ref.model.layers[layer].mlp
            experts = mlp.experts
            for e in range(store.num_experts):
                w = store.dequantize(layer, e, dtype=torch.float32)
                if family == "gpt_oss":   # gate_up [E, D, 2I] interleaved columns; down [E, I, D]
                    experts.gate_up_proj[e, :, 0::2] = w.gate.T
                    experts.gate_up_proj[e, :, 1::2] = w.up.T
                    experts.gate_up_proj_bias[e, 0::2] = w.gate_bias
                    experts.gate_up_proj_bias[e, 1::2] = w.up_bias
                    experts.down_proj[e] = w.down.T
                    experts.down_proj_bias[e] = w.down_bias
                else:                     # gate_up [E, 2I, D] (gate rows first); down [E, D, I]
                    inter = w.gate.shape[0]
                    experts.gate_up_proj[e, :inter] = w.gate
                    experts.gate_up_proj[e, inter:] = w.up
                    experts.down_proj[e] = w.down


@pytest.mark.parametrize("family", OWN_FAMILIES)
@pytest.mark.parametrize("codec", ["bf16", "int4"])
def test_lossy_codecs_within_stated_bounds(family, codec, ftw_packages, tiny_checkpoints, device):
    from tests.fixtures.checkpoints import load_reference

    path = ftw_packages(family, codec)
    eng = Engine.load(path, device=device, dtype=torch.float32)
    prompt = random_prompt(20, seed=5)
    ours = engine_logits(eng, prompt, (13, 7))
    ref = load_reference(tiny_checkpoints(family))
    err = (ours - reference_logits(ref, prompt)).abs()
    max_bound, mean_bound = CODEC_BOUNDS[codec]
    assert err.max().item() <= max_bound and err.mean().item() <= mean_bound
    assert err.max().item() > 1e-6, "a lossy codec that changes nothing means the codec was not applied"
    # the model itself stays exact on the weights the codec produced
    _substitute_experts(ref, family, eng.package.experts)
    if codec == "bf16":   # the bf16 package also rounds dense weights; give transformers the same ones
        with torch.no_grad():
            params = dict(ref.named_parameters())
            for name in eng.package.dense_names():
                if name in params:
                    params[name].copy_(eng.package.dense(name).float())
    assert (ours - reference_logits(ref, prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family,source", [("gpt_oss", "mxfp4"), ("qwen3_moe", "nvfp4")])
def test_fp4_checkpoints_run_exactly_on_the_weights_they_hold(family, source, tiny_checkpoints, tmp_path, device):
    """gpt-oss as OpenAI ships it (MXFP4 experts) and an NVFP4 (ModelOpt) Qwen3-MoE, converted with the
    fp4 codec that keeps them exactly, run by the engine: equal to transformers on those very weights."""
    from runtime.ftw.converter import convert
    from tests.fixtures.checkpoints import load_reference
    from tests.fixtures.quantized import build_mxfp4_gpt_oss, build_nvfp4

    src = tiny_checkpoints(family)
    variant = (build_mxfp4_gpt_oss if source == "mxfp4" else build_nvfp4)(src, tmp_path / source)
    eng = Engine.load(convert(variant, tmp_path / "pkg"), device=device, dtype=torch.float32)
    store = eng.package.experts
    assert store.codec == "fp4"
    # the experts the engine computes with are the published formula's, bit for bit
    from tests.fixtures.quantized import reference_experts

    expected = reference_experts(variant, family)
    for layer, e in ((store.layers[0], 0), (store.layers[-1], store.num_experts - 1)):
        got = store.dequantize(layer, e)
        for role, tensor in expected[(layer, e)].items():
            assert torch.equal(getattr(got, role), tensor.float()), (layer, e, role)
    prompt = random_prompt(20, seed=6)
    ours = engine_logits(eng, prompt, (12, 8))
    ref = load_reference(src)
    _substitute_experts(ref, family, eng.package.experts)
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name in eng.package.dense_names():     # NVFP4 also quantized the dense projections
            params[name].copy_(eng.package.dense(name).float())
    assert (ours - reference_logits(ref, prompt)).abs().max().item() <= 1e-4
