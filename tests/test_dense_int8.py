"""Dense weights in int8 (runtime/models/quantized.py): the layer against its definition, the swap over a real
model (fused q/k/v included, routers and embeddings untouched), and the engine's option and plan.

The tiny test models' matrices are under the size the swap takes by default, so these tests pass
min_weights=0 (or lower MIN_WEIGHTS). The kernel path (a GPU) is checked in tests/kernel_checks.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.engine import Engine, SamplingParams
from runtime.kernels.int8_linear_triton import int8_linear_reference, quantize_int8
from runtime.models import quantized
from runtime.models.base import Batch
from runtime.models.quantized import Int8Linear, dense_nbytes, quantize_dense_
from tests.engine_fixtures import ftw_packages, random_prompt  # noqa: F401


def _linear(n: int, k: int, *, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.weight[3].zero_()                      # a row of zeros: scale 1, codes 0, output = bias
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_its_definition_and_close_to_the_float_layer(bias):
    lin = _linear(70, 48, bias=bias)
    q = Int8Linear.from_linear(lin)
    assert q.codes.dtype == torch.int8 and q.scale.dtype == torch.float32 and tuple(q.codes.shape) == (70, 48)
    # every weight within half a step of its row's scale
    err = (q.codes.float() * q.scale[:, None] - lin.weight).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7).all())
    x = torch.randn(2, 5, 48)                                           # leading dims kept
    y = q(x)
    assert y.shape == (2, 5, 70)
    want = int8_linear_reference(x.reshape(-1, 48), q.codes, q.scale, q.bias).reshape(2, 5, 70)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ref = lin(x)
    rel = (y - ref).norm() / ref.norm()
    assert rel < 0.01, rel                                              # per-row int8: well under 1 %
    assert (y[..., 3] == (lin.bias[3] if bias else 0)).all()


def test_the_torch_path_in_blocks_of_rows_gives_the_whole_matrix(monkeypatch):
    """Prefill dequantizes a block of rows at a time (bounded memory): the blocks' result is the one-shot one."""
    q = Int8Linear.from_linear(_linear(1000, 64, bias=True))
    x = torch.randn(7, 64)
    whole = q(x)
    monkeypatch.setattr(quantized, "DEQUANT_BLOCK_BYTES", 64 * 4 * 96)    # 96 rows a block: 11 blocks, a short one
    torch.testing.assert_close(q(x), whole, rtol=0, atol=0)


def _model(ftw_packages, family="qwen3_moe"):
    return Engine.load(ftw_packages(family, "f32"), device="cpu", dtype=torch.float32, cuda_graphs=False,
                       prefix_cache_bytes=0).model


def _logits(model, prompt):
    with torch.inference_mode():
        cache = model.new_cache(device="cpu", dtype=torch.float32)
        return model(Batch.build([(prompt, cache)], device="cpu"), all_logits=True)


@pytest.mark.parametrize("family, fuse", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3_next", False),
                                          ("gpt_oss", True), ("mixtral", False)])
def test_the_swap_keeps_routers_and_embeddings_and_the_logits_close(ftw_packages, family, fuse):
    plain, model = _model(ftw_packages, family), _model(ftw_packages, family)
    if fuse:
        model.fuse_projections()
    before = dense_nbytes(model)
    done = quantize_dense_(model, min_weights=0)
    assert done["matrices"] > 0 and done["bytes_after"] < done["bytes_before"] / 3     # fp32 -> int8 + scales
    assert dense_nbytes(model) == before - done["bytes_before"] + done["bytes_after"]   # the old tensors are gone
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["lm_head"] is Int8Linear
    routers = [t for n, t in kinds.items() if n.rsplit(".", 1)[-1] in ("gate", "router")]
    assert routers and all(t is nn.Linear for t in routers), "a router was rounded"
    assert all(t is not Int8Linear for n, t in kinds.items() if "embed" in n)
    if fuse:
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.qkv, Int8Linear) and attn.q_proj is None
    prompt = random_prompt(11, seed=5)
    want, got = _logits(plain, prompt), _logits(model, prompt)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)                  # per position
    # ~0.6 % a matrix at these 64-wide rows, compounded over the layers; the median, because a rounding may
    # move a token to another expert at one position (a routing flip: one tiny-model position showed 9 %)
    assert rel.median() < 0.03, rel
    # and the rounding is really there (a swap that kept the float weights would give the same bits)
    assert not torch.equal(got, want)


def test_engine_option_reports_int8_dense_and_generates(ftw_packages, monkeypatch):
    monkeypatch.setattr(quantized, "MIN_WEIGHTS", 0)
    path = ftw_packages("qwen3_moe", "f32")
    plain = Engine.load(path, device="cpu", dtype=torch.float32, prefix_cache_bytes=0)
    eng = Engine.load(path, device="cpu", dtype=torch.float32, prefix_cache_bytes=0, dense_int8=True)
    assert plain.plan["dense_codec"] == "float32" and eng.plan["dense_codec"] == "int8"
    assert eng.plan["dense_bytes"] < plain.plan["dense_bytes"] / 2
    out = eng.generate(random_prompt(6, seed=2), SamplingParams(max_tokens=5, temperature=0, stop_token_ids=()))
    assert len(out.tokens) == 5


def test_the_default_keeps_a_cpu_engine_exact(ftw_packages):
    """On a CPU the default never rounds: the engine's output is compared with transformers' elsewhere."""
    eng = Engine.load(ftw_packages("qwen3_moe", "f32"), device="cpu", dtype=torch.float32, prefix_cache_bytes=0)
    assert eng.plan["dense_codec"] == "float32"
    assert not any(isinstance(m, Int8Linear) for m in eng.model.modules())


def test_quantize_int8_rounds_to_the_nearest_code():
    w = torch.tensor([[0.0, 1.0, -0.6, 0.26], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = quantize_int8(w)
    assert scale.tolist() == pytest.approx([1 / 127, 1.0])
    assert codes.tolist() == [[0, 127, -76, 33], [0, 0, 0, 0]]


# ------------------------------------------------------------------------------------------ on the GPU machine


@pytest.mark.cuda
def test_int8_dense_on_a_gpu_decodes_through_graphs_as_it_does_eagerly(ftw_packages, device, monkeypatch):
    """Compiled (`pytest --device cuda`): the Triton kernel serves decode and short prompts, recorded in the decode
    graphs; greedy tokens through graphs equal the eager ones, and the default turns int8 on for quantized experts
    or a budget that can not hold every expert beside bf16 dense weights."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels run on the GPU machine: pytest --device cuda")
    from types import SimpleNamespace

    from runtime.engine import _wants_int8_dense

    monkeypatch.setattr(quantized, "MIN_WEIGHTS", 0)
    path = ftw_packages("qwen3_moe", "f32")
    kw = dict(device="cuda", dtype=torch.bfloat16, prefix_cache_bytes=0, dense_int8=True)
    graphs, eager = Engine.load(path, cuda_graphs=True, **kw), Engine.load(path, cuda_graphs=False, **kw)
    assert graphs.plan["decode_graphs"] and graphs.plan["dense_codec"] == "int8"
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=())
    for seed in (1, 2):
        prompt = random_prompt(9, seed=seed)
        assert graphs.generate(prompt, params).tokens == eager.generate(prompt, params).tokens
    dev = torch.device("cuda")
    for codec in ("bf16", "int4"):
        experts = SimpleNamespace(layers=list(range(48)), num_experts=128, block_nbytes=2_490_368, codec=codec)
        pkg = SimpleNamespace(experts=experts)                                                 # 15.3 GB of experts
        assert _wants_int8_dense(dev, pkg, 3 << 30, 8 << 30) is True          # 8 GiB: hybrid
        assert _wants_int8_dense(dev, pkg, 3 << 30, None) is (codec == "int4" or torch.cuda.mem_get_info()[0] < 21e9)
        assert _wants_int8_dense(torch.device("cpu"), pkg, 3 << 30, 8 << 30) is False


@pytest.mark.parametrize("setting, option", [("auto", None), ("int8", True), ("model", False)])
def test_the_setting_reaches_the_engine_as_a_load_option(setting, option, monkeypatch):
    """Settings -> the UI's load request -> the worker's LoadOptions -> Engine.load(dense_int8=...)."""
    from app.settings import Settings
    from runtime import service as service_mod
    from runtime.service import LoadOptions
    from ui.session import load_options

    settings = Settings()
    settings.set("dense_precision", setting)
    options = load_options(settings)
    assert options.get("dense_int8") is option and ("dense_int8" in options) == (option is not None)
    seen = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, **kw: seen.update(kw)))
    service_mod._default_engine_loader("/some/model", LoadOptions.from_dict(options), progress=None)
    assert seen["dense_int8"] is option


def test_quantize_int8_in_row_blocks_equals_the_whole_matrix(monkeypatch):
    """The fp32 temporaries go a block of rows at a time (the LM head's took 2.5 GB whole): same codes, scales."""
    from runtime.kernels import int8_linear_triton as int8_k

    w = torch.randn(1000, 64)
    whole = quantize_int8(w)
    monkeypatch.setattr(int8_k, "QUANTIZE_BLOCK_BYTES", 4 * 64 * 96)      # 96 rows a block, a short last one
    blocks = quantize_int8(w)
    assert torch.equal(blocks[0], whole[0]) and torch.equal(blocks[1], whole[1])


def test_a_weight_of_nan_names_its_matrix_and_the_engine_says_what_to_do(ftw_packages, monkeypatch):
    model = _model(ftw_packages)
    with torch.no_grad():
        model.lm_head.weight[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"lm_head: quantize_int8: w holds inf or NaN"):
        quantize_dense_(model, min_weights=0)

    from runtime.engine import EngineError

    def damaged(model, **_):
        raise ValueError("model.layers.0.self_attn.o_proj: quantize_int8: w holds inf or NaN")

    monkeypatch.setattr(quantized, "quantize_dense_", damaged)
    with pytest.raises(EngineError, match=r"o_proj.*damaged: convert it again.*--dense model"):
        Engine.load(ftw_packages("qwen3_moe", "f32"), device="cpu", dtype=torch.float32, dense_int8=True)
