"""The resident expert tier against the plain-torch reference (interface.expert_forward), both compute paths."""
from __future__ import annotations

import pytest
import torch

from runtime.experts.interface import ExpertSpec, ExpertWeights, expert_forward
from runtime.experts.resident import ResidentExperts, stack_experts


def random_experts(num: int, d: int, i: int, *, bias: bool, gen: torch.Generator) -> list[ExpertWeights]:
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=gen)   # noqa: E731
    return [ExpertWeights(r(i, d), r(i, d), r(d, i), *((r(i), r(i), r(d)) if bias else ())) for _ in range(num)]


def reference(spec, weights, hidden, ids, topk):
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for slot in range(ids.shape[1]):
            out[t] += topk[t, slot] * expert_forward(spec, weights[ids[t, slot]], hidden[t:t + 1])[0]
    return out


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("spec", [ExpertSpec(), ExpertSpec(activation="gpt_oss", has_bias=True)])
@pytest.mark.parametrize("tokens,k,num", [(1, 2, 8), (5, 2, 8), (13, 4, 16), (64, 1, 4)])
def test_resident_experts_match_reference(grouped, spec, tokens, k, num):
    gen = torch.Generator().manual_seed(tokens * 31 + k * 7 + num)
    d, i = 24, 16
    weights = random_experts(num, d, i, bias=spec.has_bias, gen=gen)
    # scale up so gpt-oss's clamps at +-7 are actually reached
    hidden = torch.randn(tokens, d, generator=gen) * (8.0 if spec.activation == "gpt_oss" else 1.0)
    ids = torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(tokens)])       # [T, K]
    topk = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    experts = ResidentExperts({3: stack_experts(weights, device="cpu", dtype=torch.float32)}, spec, grouped=grouped)
    assert experts.grouped is grouped
    out = experts(3, hidden, ids, topk)
    assert torch.allclose(out, reference(spec, weights, hidden, ids, topk), atol=1e-4, rtol=1e-4)


def test_unknown_layer_is_reported():
    gen = torch.Generator().manual_seed(0)
    experts = ResidentExperts({0: stack_experts(random_experts(2, 4, 4, bias=False, gen=gen), device="cpu",
                                                dtype=torch.float32)}, ExpertSpec())
    with pytest.raises(KeyError, match="layer 5"):
        experts(5, torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    assert experts.grouped is False          # CPU fp32 defaults to the looped path


@pytest.mark.parametrize("spec", [ExpertSpec(), ExpertSpec(activation="gpt_oss", has_bias=True)])
def test_grouped_matches_looped_in_bf16_on_the_device(spec, device):
    """The path a GPU engine takes by default (bf16 grouped GEMM) against the looped one, on --device."""
    gen = torch.Generator().manual_seed(7)
    d, i, num, tokens, k = 64, 32, 16, 24, 4
    weights = random_experts(num, d, i, bias=spec.has_bias, gen=gen)
    stacked = stack_experts(weights, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(tokens, d, generator=gen).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(tokens)]).to(device)
    topk = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1).to(device, torch.bfloat16)
    grouped = ResidentExperts({0: stacked}, spec, grouped=True)
    out_grouped = grouped(0, hidden, ids, topk)
    assert grouped.grouped, "the grouped kernel refused bf16 on this device"
    out_looped = ResidentExperts({0: stacked}, spec, grouped=False)(0, hidden, ids, topk)
    scale = out_looped.float().abs().max().item()
    assert (out_grouped.float() - out_looped.float()).abs().max().item() <= 2e-2 * scale
    if torch.device(device).type == "cuda":
        assert ResidentExperts({0: stacked}, spec).grouped      # the default on a GPU
