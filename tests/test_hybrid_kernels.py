"""Expert compute over a packed slot pool: the torch paths against per-expert `expert_forward` over a grid of
shapes and codecs (CPU, every run), and the Triton kernels against the torch path (GPU machine:
`pytest --device cuda tests/test_hybrid_kernels.py`). Fresh random inputs for every case."""
from __future__ import annotations

import pytest
import torch

from runtime.experts.host_store import HostExpertStore
from runtime.experts.interface import ExpertSpec, ExpertWeights, expert_forward
from runtime.kernels.expert_pool import pool_forward, pool_forward_grouped

GRID = [  # codec, group, fp4 format, hidden, width, activation, bias
    ("int4", 32, "", 64, 32, "silu", False),
    ("int4", 64, "", 128, 96, "silu", False),
    ("int4", 128, "", 128, 128, "gpt_oss", True),
    ("int4", 64, "", 96, 40, "silu", False),            # short last groups
    ("fp4", 32, "mxfp4", 128, 64, "silu", False),
    ("fp4", 32, "mxfp4", 64, 64, "gpt_oss", True),
    ("fp4", 16, "nvfp4", 64, 32, "silu", False),
    ("bf16", 0, "", 64, 48, "silu", False),
]


def make_store(codec, group, fmt, d, i, bias, *, experts=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen) * 0.3      # noqa: E731
    weights = {(0, e): ExpertWeights(rnd(i, d), rnd(i, d), rnd(d, i), rnd(i) if bias else None,
                                     rnd(i) if bias else None, rnd(d) if bias else None) for e in range(experts)}
    return HostExpertStore.from_weights(weights, codec=codec, group=group or 64, fp4_format=fmt or "mxfp4")


def reference(store, spec, x, slots, weights):
    experts = {s: store.dequantize(0, s, dtype=torch.float64) for s in set(slots.flatten().tolist()) if s >= 0}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(slots.shape[1]):
            s = int(slots[t, k])
            if s >= 0:
                out[t] += float(weights[t, k]) * expert_forward(spec, experts[s], x[t:t + 1].double())[0]
    return out


@pytest.mark.parametrize("codec, group, fmt, d, i, activation, bias", GRID)
def test_pool_paths_match_per_expert_reference(codec, group, fmt, d, i, activation, bias):
    store = make_store(codec, group, fmt, d, i, bias)
    spec = ExpertSpec(activation=activation, has_bias=bias)
    pool = torch.from_numpy(store.layer_buffer(0).copy())                  # slot s holds expert s
    gen = torch.Generator().manual_seed(hash((codec, group, d)) % 1000)
    for t in (1, 3, 17):
        x = torch.randn(t, d, generator=gen)
        slots = torch.randint(-1, 5, (t, 3), generator=gen)                # -1: computed elsewhere
        weights = torch.rand(t, 3, generator=gen)
        want = reference(store, spec, x, slots, weights).float()
        for fn in (pool_forward, pool_forward_grouped):
            got = fn(pool, store.layout, spec, x, slots, weights)
            assert got.shape == (t, d) and torch.isfinite(got).all()
            rel = (got - want).norm() / want.norm().clamp(min=1e-6)
            assert rel < 1e-5, (fn.__name__, t, float(rel))


def test_invalid_slots_contribute_nothing_even_over_garbage():
    """A -1 slot is clamped to slot 0 for the gather; whatever slot 0 holds (here NaN bytes) must not leak."""
    store = make_store("int4", 64, "", 128, 64, False)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    pool[0] = 0xFF                                                           # fp16 scales of 0xFFFF are NaN
    x = torch.randn(2, 128)
    slots = torch.tensor([[-1, 2], [3, -1]])
    w = torch.rand(2, 2)
    got = pool_forward(pool, store.layout, ExpertSpec(), x, slots, w)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(store, ExpertSpec(), x, slots, w).float(), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("codec, group, fmt, d, i, activation, bias",
                         [g for g in GRID if not g[6] and (g[0] == "int4" or g[2] == "mxfp4")] +
                         [("int4", 64, "", 2048, 768, "silu", False), ("fp4", 32, "mxfp4", 2048, 512, "silu", False)])
def test_triton_pool_kernels_match_torch(device, codec, group, fmt, d, i, activation, bias):
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("Triton kernels run on the GPU machine: pytest --device cuda")
    from runtime.kernels.int4_pool_triton import pool_forward_triton, supports

    store = make_store(codec, group, fmt, d, i, bias, experts=6)
    spec = ExpertSpec(activation=activation)
    assert supports(store.layout, spec)
    pool = torch.from_numpy(store.layer_buffer(0).copy()).cuda()
    gen = torch.Generator().manual_seed(d + i)
    for t in (1, 4, 9, 300 if d < 1000 else 64):    # a prefill chunk below the streaming threshold
        k = 10 if t == 4 else 8 if d > 1000 else 3  # K 10: the down tile pads the experts to 16
        x = torch.randn(t, d, generator=gen).cuda()
        slots = torch.randint(-1, 6, (t, k), generator=gen).cuda()
        weights = torch.rand(slots.shape, generator=gen).cuda()
        want = pool_forward(pool, store.layout, spec, x, slots, weights)
        got = pool_forward_triton(pool, store.layout, spec, x, slots, weights)
        rel = (got - want).norm() / want.norm().clamp(min=1e-6)
        assert torch.isfinite(got).all() and rel < 1e-4, (t, float(rel))
        # no atomics: the same inputs give the same bits
        assert torch.equal(pool_forward_triton(pool, store.layout, spec, x, slots, weights), got)
        # bf16 activations and weights as the engine runs them
        got16 = pool_forward_triton(pool, store.layout, spec, x.bfloat16(), slots, weights.bfloat16())
        rel16 = (got16.float() - want).norm() / want.norm().clamp(min=1e-6)
        assert got16.dtype == torch.bfloat16 and rel16 < 2e-2, (t, float(rel16))


@pytest.mark.cuda
def test_triton_pool_kernels_replay_in_a_cuda_graph(device):
    """Two launches, no host sync, allocations sized by shapes only: recorded once, the graph replays over
    new slots, weights and activations written into the captured buffers."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("Triton kernels run on the GPU machine: pytest --device cuda")
    from runtime.kernels.int4_pool_triton import pool_forward_triton

    store = make_store("int4", 64, "", 512, 256, False, experts=6)
    spec = ExpertSpec()
    pool = torch.from_numpy(store.layer_buffer(0).copy()).cuda()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 512, generator=gen).cuda().bfloat16()
    slots = torch.randint(-1, 6, (1, 8), generator=gen).cuda()
    weights = torch.rand(1, 8, generator=gen).cuda().bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool_forward_triton(pool, store.layout, spec, x, slots, weights)          # warm-up: compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pool_forward_triton(pool, store.layout, spec, x, slots, weights)
    for _ in range(3):
        x.copy_(torch.randn(1, 512, generator=gen).bfloat16())
        slots.copy_(torch.randint(-1, 6, (1, 8), generator=gen))
        weights.copy_(torch.rand(1, 8, generator=gen).bfloat16())
        graph.replay()
        want = pool_forward(pool, store.layout, spec, x.float(), slots, weights.float())
        rel = (out.float() - want).norm() / want.norm().clamp(min=1e-6)
        assert rel < 2e-2, float(rel)
