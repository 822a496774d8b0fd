"""Decode steps of several sequences through the static path (what runtime/decode_graph.py records as one CUDA
graph per batch size) against the ordinary ragged forward, and the engine choosing it.

On this machine the static path runs eagerly (`capture=False`, or `cuda_graphs=True` on a CPU engine); with
`--device cuda` on the GPU machine the same tests record and replay, and the CUDA-only ones at the end check a
recorded batch-4 step (whole, and cut around experts that need the host) against the eager forward."""
from __future__ import annotations

import pytest
import torch

from runtime.decode_graph import DecodeGraphs, bucket_of, graph_takes, graph_tokens
from runtime.engine import Engine, SamplingParams
from runtime.models.base import Batch
from tests.engine_fixtures import ftw_packages, random_prompt  # noqa: F401  (session fixture)

BUCKET = 8                       # small buckets: every sequence crosses one within a few steps
PROMPT_LENGTHS = (3, 6, 9, 13)   # unequal: the sequences sit at different positions and in different buckets


def _engine(path, device, **kw):
    return Engine.load(path, device=device, dtype=torch.float32, **kw)


def _prefilled(model, eng, lengths, *, seed):
    """Two caches per sequence, the ordinary one and the static one, both after the same prompt."""
    pairs, last = [], []
    for i, n in enumerate(lengths):
        prompt = random_prompt(n, seed=seed + i)
        pair = (model.new_cache(device=eng.device, dtype=eng.dtype), model.new_cache(device=eng.device, dtype=eng.dtype))
        for cache in pair:
            model(Batch.build([(prompt, cache)], device=eng.device))
        pairs.append(pair)
        last.append(prompt[-1])
    return pairs, last


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe"])
def test_static_batched_steps_match_the_ragged_forward(family, ftw_packages, device):
    """B = 2, 3, 4 sequences of unequal lengths decode 9 steps together: the static batched step's logits equal the
    ordinary ragged forward's row for row, while each sequence crosses a bucket boundary at its own step, and
    every cache advances as the ordinary one does."""
    eng = _engine(ftw_packages(family), device, cuda_graphs=False, max_batch=8)
    model = eng.model
    graphs = DecodeGraphs(model, device=eng.device, bucket=BUCKET, max_batch=4, doubling=False)   # (crossings by BUCKETs)
    with torch.inference_mode():
        for b in (2, 3, 4):
            lengths = PROMPT_LENGTHS[-b:] if b % 2 else PROMPT_LENGTHS[:b]
            pairs, tokens = _prefilled(model, eng, lengths, seed=10 * b)
            crossed = set()
            for _ in range(9):
                ordinary = [o for o, _ in pairs]
                static = [s for _, s in pairs]
                crossed |= {i for i, c in enumerate(static) if bucket_of(c.offset, BUCKET) != bucket_of(c.offset - 1, BUCKET)}
                want = model(Batch.build([([t], c) for t, c in zip(tokens, ordinary)], device=eng.device))  # [B, V]
                got = graphs.decode_batch(tokens, static)
                assert got.shape == want.shape == (b, model.config.vocab_size)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                assert [c.offset for c in static] == [c.offset for c in ordinary]
                tokens = want.argmax(-1).tolist()
            assert crossed == set(range(b))          # every sequence moved to a new bucket during the steps
            for pair in pairs:
                for cache in pair:
                    cache.release()
    assert graphs.batch_steps == {2: 9, 3: 9, 4: 9}
    if graphs.capture:           # a graph per (B, buckets, buffers): more than one per batch size
        assert graphs.counters["captures"] > 3


def test_a_batch_of_one_sequence_twice_is_refused(ftw_packages, device):
    eng = _engine(ftw_packages("qwen3_moe"), device, cuda_graphs=False)
    graphs = DecodeGraphs(eng.model, device=eng.device, max_batch=2)
    cache = eng.model.new_cache(device=eng.device, dtype=eng.dtype)
    with pytest.raises(ValueError, match="twice"):
        graphs.decode_batch([1, 2], [cache, cache])
    with pytest.raises(ValueError, match="1..2 sequences"):
        graphs.decode_batch([1, 2, 3], [eng.model.new_cache(device=eng.device, dtype=eng.dtype) for _ in range(3)])
    assert not graphs.covers(3) and graphs.covers(2)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_concurrent_requests_decode_as_each_alone_and_drop_to_smaller_batches(family, ftw_packages, device):
    """Three greedy requests run together through the static batched step give exactly the tokens each gives
    alone through the ordinary forward; as the shorter ones finish the step drops to B = 2, then 1."""
    path = ftw_packages(family)
    prompts = [random_prompt(n, seed=20 + n) for n in (5, 11, 8)]
    budgets = (4, 7, 10)                     # finish at different steps: 3 decode together, then 2, then 1
    alone = _engine(path, device, cuda_graphs=False, prefix_cache_bytes=0)
    want = [alone.generate(p, SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[])).tokens
            for p, m in zip(prompts, budgets)]
    eng = _engine(path, device, cuda_graphs=True, prefix_cache_bytes=0, max_batch=4)
    assert eng.graphs is not None and eng.graphs.max_batch == 4
    ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[]))
           for p, m in zip(prompts, budgets)]
    while eng.has_work():
        eng.step()
    got = [eng.result(rid).tokens for rid in ids]
    assert got == want
    steps = eng.stats()["decode_graphs"]["batch_steps"]
    # all three prefilled in the first step; then 3 decode steps of 3, 3 of 2, 3 of 1
    assert steps == {3: 3, 2: 3, 1: 3}, steps


def test_a_request_joining_mid_way_mixes_one_eager_step_then_decodes_batched(ftw_packages, device):
    """Two requests decode together; a third joins after three steps (its prompt step carries the others' decode
    tokens: eager), then all three decode through the batched step; each gives the tokens it gives alone."""
    path = ftw_packages("qwen3_next")
    prompts = [random_prompt(n, seed=60 + n) for n in (7, 4, 10)]
    sampling = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    alone = _engine(path, device, cuda_graphs=False, prefix_cache_bytes=0)
    want = [alone.generate(p, sampling).tokens for p in prompts]
    eng = _engine(path, device, cuda_graphs=True, prefix_cache_bytes=0, max_batch=4)
    ids = [eng.add_request(p, sampling) for p in prompts[:2]]
    for _ in range(3):
        eng.step()
    ids.append(eng.add_request(prompts[2], sampling))
    while eng.has_work():
        eng.step()
    assert [eng.result(rid).tokens for rid in ids] == want
    # steps 2-3: the first two together; step 4 (the join) eager; steps 5-8: three; then the third alone
    assert eng.stats()["decode_graphs"]["batch_steps"] == {2: 2, 3: 4, 1: 3}


def test_a_failed_batched_recording_keeps_batch1_graphs_and_the_tokens(ftw_packages, device, monkeypatch):
    """A recording of a step of several sequences that fails (as a capture error does on the GPU: the step itself
    ran eagerly first) keeps that step's result; later steps of several sequences go eagerly, batch-1 steps still
    through the graphs, and every request gives the tokens it gives alone."""
    from runtime.decode_graph import GraphCaptureError

    path = ftw_packages("qwen3_moe")
    prompts = [random_prompt(n, seed=40 + n) for n in (6, 9)]
    budgets = (5, 9)
    alone = _engine(path, device, cuda_graphs=False, prefix_cache_bytes=0)
    want = [alone.generate(p, SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[])).tokens
            for p, m in zip(prompts, budgets)]
    eng = _engine(path, device, cuda_graphs=True, prefix_cache_bytes=0, max_batch=4)
    graphs = eng.graphs
    real = graphs.decode_batch

    def failing_when_batched(tokens, caches, **kw):
        logits = real(tokens, caches, **kw)
        if len(caches) > 1:
            err = GraphCaptureError("recording the decode step of 2 sequence(s) as a CUDA graph failed: test")
            err.logits = logits
            raise err
        return logits

    monkeypatch.setattr(graphs, "decode_batch", failing_when_batched)
    ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[]))
           for p, m in zip(prompts, budgets)]
    while eng.has_work():
        eng.step()
    assert [eng.result(rid).tokens for rid in ids] == want
    stats = eng.stats()["decode_graphs"]
    assert eng.graphs is graphs and stats["max_batch"] == 1 and "test" in stats["batch_disabled"]
    assert stats["disabled"] is None
    # one batched step (the failing one), then 3 more of the two went eagerly; the longer one's last 4 alone
    assert stats["batch_steps"] == {2: 1, 1: 4}, stats["batch_steps"]


def test_graph_tokens_says_how_many_tokens_a_tier_takes_inside_a_graph():
    """A tier that only says graph_safe promises one token (batch-1 decode); `graph_tokens` (method or attribute)
    widens or narrows that; a tier that says nothing is never recorded."""
    class Plain:
        def __call__(self, *a):
            raise AssertionError

    class SafeOnly(Plain):
        def graph_safe(self, layer):
            return True

    class ZeroCopyLike(SafeOnly):
        def graph_tokens(self, layer):
            return 4 if layer else 0

    class Attribute(SafeOnly):
        graph_tokens = None              # an attribute, not a method: None means any number of tokens

    assert graph_tokens(Plain(), 0) == 0 and not graph_takes(Plain(), 0, 1)
    assert graph_tokens(SafeOnly(), 0) == 1 and graph_takes(SafeOnly(), 0, 1) and not graph_takes(SafeOnly(), 0, 2)
    assert graph_takes(ZeroCopyLike(), 1, 4) and not graph_takes(ZeroCopyLike(), 1, 5)
    assert not graph_takes(ZeroCopyLike(), 0, 1)
    tier = Attribute()
    assert graph_tokens(tier, 3) is None and graph_takes(tier, 3, 64)
    tier.graph_tokens = 16
    assert graph_takes(tier, 3, 16) and not graph_takes(tier, 3, 17)


# ------------------------------------------------------------------------------------- CUDA only


class _GatheredExperts:
    """A graph-safe tier for any number of tokens in fp32: every token's K experts computed from the resident
    tier's stacked weights by a device-side gather (no host work), so a whole batch-4 step records as one graph."""

    def __init__(self, resident):
        self.resident = resident

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        s = self.resident.layers[layer]
        i = s.intermediate
        gate_up = torch.einsum("td,tkod->tko", hidden, s.gate_up[topk_ids])            # [T, K, 2I]
        h = torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]             # [T, K, I]
        out = torch.einsum("tki,tkdi->tkd", h, s.down[topk_ids])                      # [T, K, D]
        return (out * topk_weights[..., None].to(out.dtype)).sum(1)

    def graph_safe(self, layer):
        return True

    def graph_tokens(self, layer):
        return None


@pytest.mark.parametrize("family,whole", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3_next", True)])
def test_recorded_batch4_step_on_cuda_matches_eager(family, whole, ftw_packages, device):
    """On the GPU machine: a step of 4 sequences (unequal lengths) is recorded (whole with graph-safe experts, or
    cut around the resident tier's looped fp32 calls) and replayed for 10 steps across a bucket boundary; logits
    equal the ordinary forward's, and each graph is recorded once per (batch, buckets) and then replayed."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    from runtime.engine import resident_experts_factory

    eng = _engine(ftw_packages(family), device, cuda_graphs=False, max_batch=8,
                  experts_factory=resident_experts_factory)
    model = eng.model
    assert not model.experts.grouped         # fp32: the looped path, which reads counts on the host
    if whole:
        model.set_experts(_GatheredExperts(model.experts))
    graphs = DecodeGraphs(model, device=eng.device, bucket=BUCKET, max_batch=4, doubling=False)   # (crossings by BUCKETs)
    assert graphs.capture
    with torch.inference_mode():
        pairs, tokens = _prefilled(model, eng, PROMPT_LENGTHS, seed=7)
        for _ in range(10):
            want = model(Batch.build([([t], o) for t, (o, _) in zip(tokens, pairs)], device=eng.device))
            got = graphs.decode_batch(tokens, [s for _, s in pairs])
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            tokens = want.argmax(-1).tolist()
    assert graphs.batch_steps == {4: 10}
    assert 1 < graphs.counters["captures"] < 10 and graphs.counters["failures"] == 0
    pieces_per_capture = graphs.counters["pieces"] / graphs.counters["captures"]
    assert pieces_per_capture == 1 if whole else pieces_per_capture > 1
