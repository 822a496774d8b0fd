"""The curated catalog: every number is recomputed from its config and checked against transformers' models."""
from __future__ import annotations

import json

import pytest

from app.catalog import (CatalogError, checkpoint_bytes, computed_fields, count_parameters, find_entry,
                         load_catalog)

ENTRIES = load_catalog()
ORACLE_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}

# Figures the publishers state themselves (model cards, repo file listings): an independent check on
# the formulas. Tolerances are the rounding of the published figure.
PUBLISHED_TOTAL = {
    "gpt-oss-20b": (20.91e9, 0.001),             # gpt-oss model card: 20.91B total
    "gpt-oss-120b": (116.83e9, 0.001),           # 116.83B total
    "mixtral-8x7b-instruct-v0.1": (46.7e9, 0.002),
    "qwen3-30b-a3b-instruct-2507": (30.5e9, 0.005),
    "qwen3-235b-a22b-instruct-2507": (235e9, 0.005),
}
PUBLISHED_ACTIVE = {
    "gpt-oss-20b": (3.61e9, 0.002),              # 3.61B active
    "gpt-oss-120b": (5.13e9, 0.002),             # 5.13B active
    "qwen3-235b-a22b-instruct-2507": (22e9, 0.03),
}


def test_catalog_lists_the_curated_models():
    repos = {e.repo for e in ENTRIES}
    for repo in ("Qwen/Qwen3.6-35B-A3B", "nvidia/Qwen3.6-35B-A3B-NVFP4", "Qwen/Qwen3.5-35B-A3B",
                 "Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-30B-A3B-Thinking-2507",
                 "Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3-Next-80B-A3B-Instruct",
                 "Qwen/Qwen3-235B-A22B-Instruct-2507", "openai/gpt-oss-20b", "openai/gpt-oss-120b",
                 "mistralai/Mixtral-8x7B-Instruct-v0.1"):
        assert repo in repos
    for entry in ENTRIES:
        assert entry.licence and entry.description and entry.sources, entry.id
        assert entry.codec in ("int4", "fp4", "bf16")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.id)
def test_entry_numbers_are_the_ones_its_config_gives(entry):
    expected = computed_fields(entry.config())
    actual = {key: getattr(entry, key) for key in expected}
    assert actual == expected
    assert 0 < entry.active_params < entry.total_params
    # a quantized source must convert to the codec that holds it exactly
    assert (entry.format in ("mxfp4", "nvfp4")) == (entry.codec == "fp4")


def test_parameter_counts_equal_transformers_models_on_the_meta_device():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    seen = set()
    for entry in ENTRIES:
        config = entry.config()
        key = json.dumps({k: v for k, v in config.items() if k != "quantization_config"}, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        model_type = config["model_type"]
        kwargs = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
        hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
        with torch.device("meta"):
            model = getattr(transformers, ORACLE_CLASS[model_type])(hf_config)
        oracle = sum(p.numel() for p in model.parameters())
        counts = count_parameters(config)
        # transformers does not build the MTP head (it drops mtp.* weights at load); everything else must match
        assert counts.total - counts.mtp == oracle, entry.id
        del model


@pytest.mark.parametrize("entry_id", sorted(PUBLISHED_TOTAL))
def test_totals_agree_with_published_figures(entry_id):
    figure, tolerance = PUBLISHED_TOTAL[entry_id]
    entry = find_entry(entry_id)
    assert abs(entry.total_params - figure) / figure <= tolerance


@pytest.mark.parametrize("entry_id", sorted(PUBLISHED_ACTIVE))
def test_active_counts_agree_with_published_figures(entry_id):
    figure, tolerance = PUBLISHED_ACTIVE[entry_id]
    assert abs(find_entry(entry_id).active_params - figure) / figure <= tolerance


def test_download_sizes_agree_with_repo_listings():
    checked = 0
    for entry in ENTRIES:
        if entry.published_size_bytes:
            # 5%: the NVFP4 export quantizes a few modules beyond the routed experts that we count as bf16
            assert abs(entry.download_bytes - entry.published_size_bytes) / entry.published_size_bytes < 0.05, entry.id
            checked += 1
    assert checked >= 3


def test_quantized_formats_shrink_the_download():
    bf16 = find_entry("qwen3.6-35b-a3b")
    nvfp4 = find_entry("nvidia/Qwen3.6-35B-A3B-NVFP4")
    assert bf16.total_params == nvfp4.total_params
    assert nvfp4.download_bytes < 0.4 * bf16.download_bytes
    gpt = find_entry("gpt-oss-20b")
    assert gpt.download_bytes < gpt.total_params      # MXFP4 experts: well under a byte a weight


def test_bad_catalog_and_configs_are_reported_by_name(tmp_path):
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps({"models": [{"id": "broken", "name": "x"}]}))
    with pytest.raises(CatalogError, match="broken"):
        load_catalog(bad)
    bad.write_text("{not json")
    with pytest.raises(CatalogError, match="catalog.json"):
        load_catalog(bad)
    with pytest.raises(CatalogError, match="llama"):
        count_parameters({"model_type": "llama", "hidden_size": 8, "vocab_size": 8})
    with pytest.raises(CatalogError, match="awq"):
        checkpoint_bytes({**find_entry("gpt-oss-20b").config(), "quantization_config": {"quant_method": "awq"}})
