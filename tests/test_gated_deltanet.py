"""The Gated DeltaNet layer alone: chunked == recurrent == transformers' layer, state carried across
chunks, both checkpoint spellings, the conv state, the fla glue, and the state-slot pool."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext

from runtime.models import gated_deltanet as gdn_mod
from runtime.models.gated_deltanet import (GatedDeltaNet, GatedDeltaNetConfig, GatedDeltaNetError, causal_conv1d,
                                           chunked_gated_delta_rule, fla_gated_delta_rule,
                                           recurrent_gated_delta_rule)
from runtime.models.linear_state import LinearStateSpec, StatePool, StatePoolFull
from tests.fixtures.checkpoints import FAMILIES, oracle_torch_only

oracle_torch_only()   # transformers stays the torch reference even where fla-core is installed

TOL = 1e-4
SPELLINGS = {  # our fixture family -> (transformers config class, transformers GDN layer, packed projection)
    "qwen3_next": (transformers.Qwen3NextConfig, hfnext.Qwen3NextGatedDeltaNet, True),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, hf35.Qwen3_5MoeGatedDeltaNet, False),
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def perturbed_pair(family: str, seed: int = 0):
    """transformers' GDN layer with non-trivial weights, and ours loaded strictly from its state dict."""
    cfg_cls, layer_cls, packed = SPELLINGS[family]
    hf_cfg = cfg_cls(**FAMILIES[family].config)
    torch.manual_seed(seed)
    ref = layer_cls(hf_cfg, 0).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(p + 0.1 * noise if p.ndim == 1 else 0.1 * noise)
    ours = GatedDeltaNet(GatedDeltaNetConfig.from_config(hf_cfg.to_dict()), packed=packed, backend="torch")
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", sorted(SPELLINGS))
def test_chunked_recurrent_and_transformers_agree(family, device):
    ref, ours = perturbed_pair(family)
    ours.to(device)
    x = torch.randn(2, 150, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(3))  # 2 full chunks + 22
    with torch.no_grad():
        expected = ref(x).to(device)                                          # transformers on the CPU, no cache
        x = x.to(device)
        conv0, rec0 = ours.new_states(2)
        y_chunk, conv_c, rec_c = ours(x, conv0, rec0)
        conv, rec, steps = conv0, rec0, []
        for t in range(x.shape[1]):                                           # decode path: one token at a time
            y, conv, rec = ours(x[:, t:t + 1], conv, rec)
            steps.append(y)
        y_rec = torch.cat(steps, dim=1)
    assert expected.abs().max() > 0.1                                         # the comparison is not trivial
    assert max_err(y_chunk, expected) <= TOL
    assert max_err(y_rec, expected) <= TOL
    assert max_err(rec_c, rec) <= TOL and max_err(conv_c, conv) <= TOL
    assert rec.dtype == torch.float32 and rec.shape == (2, 4, 16, 16) and conv.shape == (2, 128, 3)


@pytest.mark.parametrize("family", sorted(SPELLINGS))
@pytest.mark.parametrize("split", [1, 2, 64, 70])
def test_prefill_in_two_chunks_carries_the_state(family, split, device):
    """What chunked prefill and the prefix cache rely on: stopping anywhere and resuming is exact."""
    ref, ours = perturbed_pair(family, seed=1)
    ours.to(device)
    x = torch.randn(1, 130, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(x).to(device)
        x = x.to(device)
        conv, rec = ours.new_states(1)
        y_full, conv_full, rec_full = ours(x, conv, rec)
        y_a, conv, rec = ours(x[:, :split], conv, rec)
        y_b, conv, rec = ours(x[:, split:], conv, rec)
    assert max_err(torch.cat([y_a, y_b], dim=1), expected) <= TOL
    assert max_err(rec, rec_full) <= TOL and max_err(conv, conv_full) == 0.0


@pytest.mark.parametrize("family", sorted(SPELLINGS))
def test_a_long_prefill_runs_in_pieces_with_the_same_result(family, device, monkeypatch):
    """A chunk past PREFILL_PIECE_TOKENS runs through the layer a piece at a time (what bounds its transients in
    VRAM), with the output and states of one whole pass - and of transformers' layer."""
    ref, ours = perturbed_pair(family, seed=5)
    ours.to(device)
    x = torch.randn(2, 150, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    pieces = []
    whole_forward = ours._forward
    monkeypatch.setattr(ours, "_forward", lambda x, c, r: pieces.append(x.shape[1]) or whole_forward(x, c, r))
    with torch.no_grad():
        expected = ref(x).to(device)
        x = x.to(device)
        monkeypatch.setattr(gdn_mod, "PREFILL_PIECE_TOKENS", 0)            # 0: the chunk in one pass
        y_whole, conv_whole, rec_whole = ours(x, *ours.new_states(2))
        monkeypatch.setattr(gdn_mod, "PREFILL_PIECE_TOKENS", 64)
        y, conv, rec = ours(x, *ours.new_states(2))
    assert pieces == [150, 64, 64, 22]
    assert max_err(y, expected) <= TOL and max_err(y, y_whole) <= TOL
    assert max_err(rec, rec_whole) <= TOL and max_err(conv, conv_whole) == 0.0


def test_packed_projection_is_regrouped_per_key_head():
    """Qwen3-Next's in_proj_qkvz/in_proj_ba rows are grouped per key head; rebuilding them from the
    separate Qwen3.5 tensors in that grouping must give the same layer (checked without transformers)."""
    _, split_layer = perturbed_pair("qwen3_5_moe", seed=2)
    cfg = split_layer.cfg
    D, Hk, dk, dv, r = cfg.hidden_size, cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.heads_per_key
    sd = split_layer.state_dict()
    q, k, v = torch.split(sd["in_proj_qkv.weight"], [cfg.key_dim, cfg.key_dim, cfg.value_dim])
    z = sd["in_proj_z.weight"]
    per_head = [torch.cat([q.view(Hk, dk, D)[h], k.view(Hk, dk, D)[h], v.view(Hk, r * dv, D)[h],
                           z.view(Hk, r * dv, D)[h]]) for h in range(Hk)]
    ba = [torch.cat([sd["in_proj_b.weight"].view(Hk, r, D)[h], sd["in_proj_a.weight"].view(Hk, r, D)[h]])
          for h in range(Hk)]
    packed_sd = {n: t for n, t in sd.items() if not n.startswith("in_proj_")}
    packed_sd["in_proj_qkvz.weight"] = torch.cat(per_head)
    packed_sd["in_proj_ba.weight"] = torch.cat(ba)
    packed = GatedDeltaNet(cfg, packed=True, backend="torch")
    packed.load_state_dict(packed_sd, strict=True)
    x = torch.randn(1, 20, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = split_layer(x, *split_layer.new_states(1))[0]
        b = packed(x, *packed.new_states(1))[0]
    assert max_err(a, b) <= 1e-6
    assert a.abs().max() > 0.01


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_rule_forms_agree_from_a_nonzero_state(chunk_size, device):
    """The two forms on raw inputs: grouped value heads (Hv = 3 Hk), a non-zero incoming state, strong decay."""
    gen = torch.Generator().manual_seed(6)
    B, T, Hk, Hv, dk, dv = 2, 45, 2, 6, 8, 12
    q, k = torch.randn(B, T, Hk, dk, generator=gen), torch.randn(B, T, Hk, dk, generator=gen)
    v = torch.randn(B, T, Hv, dv, generator=gen)
    g = -torch.rand(B, T, Hv, generator=gen) * 3                                # log decay in [-3, 0]
    beta = torch.rand(B, T, Hv, generator=gen)
    s0 = torch.randn(B, Hv, dk, dv, generator=gen)
    # transformers' reference gets the key heads expanded to value heads, as its layer does before calling it
    # (transformers 5.25 also expands them inside; older versions' reference assumes equal counts)
    qe, ke = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    o_hf, s_hf = hfnext.torch_recurrent_gated_delta_rule(qe, ke, v, g=g, beta=beta, initial_state=s0,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta, s0, o_hf, s_hf = (t.to(device) for t in (q, k, v, g, beta, s0, o_hf, s_hf))
    s0_before = s0.clone()
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    assert torch.equal(s0, s0_before)          # the incoming state may be a prefix-cache snapshot: never written
    assert max_err(o_r, o_hf) <= 1e-5 and max_err(s_r, s_hf) <= 1e-5
    assert max_err(o_c, o_r) <= 1e-5 and max_err(s_c, s_r) <= 1e-5
    assert s0.abs().max() > 0 and max_err(o_r, recurrent_gated_delta_rule(q, k, v, g, beta)[0]) > 1e-3


@pytest.mark.parametrize("family", sorted(SPELLINGS))
def test_16_bit_activations_stay_within_their_bound(family, device):
    """The layer in bf16 on this device with the automatic backend (the torch path on the CPU; fla-core's
    kernels on CUDA when installed) against the same weights in fp32, prefill and step by step."""
    _, ours = perturbed_pair(family, seed=3)
    ours.backend = "auto"
    half = ours.to(device=device, dtype=torch.bfloat16)
    full = copy.deepcopy(half).float()                                          # bf16-rounded weights, upcast
    x = torch.randn(2, 150, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(9)).to(device)
    with torch.no_grad():
        y_ref, _, s_ref = full(x, *full.new_states(2))
        y, _, s = half(x.bfloat16(), *half.new_states(2))
        conv, rec = half.new_states(2)
        steps = []
        for t in range(20):
            out, conv, rec = half(x[:, t:t + 1].bfloat16(), conv, rec)
            steps.append(out)
    rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()   # noqa: E731
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32              # the state stays fp32
    assert rel(y, y_ref) <= 5e-2 and rel(s, s_ref) <= 1e-2                     # measured ~2e-2 and ~5e-3 on CPU
    assert rel(torch.cat(steps, dim=1), y_ref[:, :20]) <= 5e-2


def test_causal_conv_continues_from_its_state():
    gen = torch.Generator().manual_seed(7)
    C, W = 10, 4
    weight = torch.randn(C, W, generator=gen)
    x = torch.randn(1, 12, C, generator=gen)
    full = torch.nn.functional.silu(torch.nn.functional.conv1d(x.transpose(1, 2), weight[:, None], padding=W - 1,
                                                               groups=C)[..., :12]).transpose(1, 2)
    state = torch.zeros(1, C, W - 1)
    pieces = []
    for lo, hi in [(0, 2), (2, 3), (3, 12)]:                  # shorter than the window, then one token, then more
        y, state = causal_conv1d(x[:, lo:hi], state, weight)
        pieces.append(y)
    assert max_err(torch.cat(pieces, dim=1), full) <= 1e-6
    assert torch.equal(state, x[0, -(W - 1):].T[None])         # the state is the last W-1 inputs


def test_bad_config_and_backend_are_named():
    with pytest.raises(GatedDeltaNetError, match="linear_num_value_heads"):
        GatedDeltaNetConfig.from_config(dict(hidden_size=8, linear_num_key_heads=3, linear_num_value_heads=4,
                                             linear_key_head_dim=4, linear_value_head_dim=4))
    _, layer = perturbed_pair("qwen3_next")
    with pytest.raises(ValueError, match="backend"):
        GatedDeltaNet(layer.cfg, packed=True, backend="triton")
    layer.backend = "fla"                                      # asked for explicitly where it cannot run
    with pytest.raises(GatedDeltaNetError, match="fla"):
        layer(torch.zeros(1, 2, layer.cfg.hidden_size), *layer.new_states(1))


def test_fla_glue_passes_what_fla_expects(monkeypatch):
    """fla itself needs CUDA (benchmarks/gdn_cuda_check.py checks it there); here a stand-in with fla's
    keyword API records what our glue passes and computes with the torch reference."""
    seen = {}

    def fake_kernel(*, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        seen.update(heads=(q.shape[2], k.shape[2], v.shape[2]), scale=scale, l2=use_qk_l2norm_in_kernel,
                    final=output_final_state, state_dtype=initial_state.dtype)
        assert scale == q.shape[-1] ** -0.5        # fla's default; our rule applies the same factor itself
        if not use_qk_l2norm_in_kernel:            # then fla takes q and k as given: they must come normalised
            for t in (q, k):
                torch.testing.assert_close(t.norm(dim=-1), torch.ones(t.shape[:-1]), rtol=0, atol=1e-5)
        # (the reference normalises q and k itself; normalising a unit vector again moves it by ~eps/2)
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state)

    monkeypatch.setattr(gdn_mod, "fla_kernels", lambda: (fake_kernel, fake_kernel))
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 5, 2, 8, generator=gen), torch.randn(1, 5, 2, 8, generator=gen)
    v, g = torch.randn(1, 5, 4, 8, generator=gen), -torch.rand(1, 5, 4, generator=gen)
    beta, s0 = torch.rand(1, 5, 4, generator=gen), torch.randn(1, 4, 8, 8, generator=gen)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    # the chunked kernel gets q and k normalised by us (fla's own l2norm compiles a variant per size bucket); the
    # one-token kernel normalises them itself
    for recurrent in (False, True):
        o, s = fla_gated_delta_rule(q, k, v, g, beta, initial_state=s0, recurrent=recurrent)
        assert seen == dict(heads=(4, 4, 4), scale=8 ** -0.5, l2=recurrent, final=True, state_dtype=torch.float32)
        assert max_err(o, o_ref) <= 1e-6 and max_err(s, s_ref) <= 1e-6


def test_state_pool_slots_snapshot_and_restore():
    cfg = GatedDeltaNetConfig(hidden_size=16, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    spec = LinearStateSpec.for_layers(cfg, 3)
    assert spec.bytes_per_sequence == 3 * (cfg.conv_dim * 3 * 4 + 2 * 4 * 4 * 4)
    with torch.inference_mode():                              # the engine steps in inference mode...
        pool = StatePool(spec, 2)
    assert pool.nbytes == 2 * spec.bytes_per_sequence
    a, b = pool.alloc(), pool.alloc()                         # ...and slots are reset outside it
    assert (a, b) == (0, 1) and pool.in_use == 2
    with pytest.raises(StatePoolFull, match="2 linear-attention state slots"):
        pool.alloc()
    caches = pool.layer_caches(a)
    caches[1].states["recurrent"] = torch.full((2, 4, 4), 3.0)
    caches[1].advance(5)
    snap = pool.snapshot(a)
    caches[1].states["recurrent"] = torch.zeros(2, 4, 4)      # the slot moves on; the snapshot must not
    assert snap.recurrent[1].eq(3.0).all() and snap.offset == 5
    pool.restore(b, snap)
    assert torch.equal(pool.recurrent[b], snap.recurrent) and torch.equal(pool.conv[b], snap.conv)
    stored = pool.layer_caches(b)[1].copy()                   # what a prefix cache keeps: slot-free
    pool.free(b)
    c = pool.alloc()                                          # a reused slot starts from zeros
    assert c == b and pool.recurrent[c].abs().sum() == 0
    fresh = pool.layer_caches(c)[1]
    fresh.load(stored)
    assert fresh.states["recurrent"].eq(3.0).all() and fresh.offset == 5 and fresh.trim(3) == 0
    with pytest.raises(ValueError, match="already free"):
        pool.free(c) or pool.free(c)
    with pytest.raises(ValueError, match="shape"):
        fresh.states["conv"] = torch.zeros(3, 3)


def test_the_loads_warm_up_runs_each_distinct_layer_on_fla_once_per_length(monkeypatch, caplog):
    """A GPU load warms fla-core's prefill kernels (runtime/engine.py `_warm_up_gpu_kernels`): one run of each
    warm-up length through the chunked kernel per distinct layer, none where fla would not run, weights untouched;
    a warm-up that fails is a warning and a finished stage, never a failed load. fla needs CUDA: a stand-in with its
    keyword API records the calls and computes with the torch reference."""
    import logging

    from runtime.engine import _warm_up_gpu_kernels

    _, ours = perturbed_pair("qwen3_next")
    auto = GatedDeltaNet(ours.cfg, packed=ours.packed, backend="auto")
    auto.load_state_dict(ours.state_dict())
    model = torch.nn.ModuleList([auto, copy.deepcopy(auto), ours])   # two alike, and one kept on the torch path
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def fake_kernel(*, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        calls.append(q.shape[1])
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state)

    monkeypatch.setattr(gdn_mod, "fla_kernels", lambda: (fake_kernel, fake_kernel))
    assert gdn_mod.warm_up_prefill_kernels(model) == 0 and calls == []       # on a CPU fla never runs
    monkeypatch.setattr(gdn_mod, "fla_usable", lambda x: True)
    stages = []
    _warm_up_gpu_kernels(model, lambda done, total: stages.append((done, total)))
    assert calls == list(gdn_mod.WARM_UP_TOKENS) and stages == [(0, 1), (1, 1)]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    def broken(**_):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(gdn_mod, "fla_kernels", lambda: (broken, broken))
    stages.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        _warm_up_gpu_kernels(model, lambda done, total: stages.append((done, total)))
    assert stages == [(0, 1), (1, 1)] and "the first prompt compiles them" in caplog.text

