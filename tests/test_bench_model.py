"""`freetoken bench model`'s own arithmetic (the GPU rows run on the GPU machine)."""
from __future__ import annotations

import numpy as np

from runtime.experts.bench_model import distinct_per_layer


def test_distinct_experts_per_layer_call_count_each_call_once():
    """[S, L, T, K] routing -> the mean number of distinct experts a layer call touches: a batch whose tokens share
    experts touches fewer than T*K; one token always touches K."""
    one = np.array([[[[1, 2]], [[3, 4]]]])                          # S 1, L 2, T 1, K 2
    assert distinct_per_layer(one) == 2.0
    shared = np.array([[[[1, 2], [2, 3]], [[5, 5], [5, 5]]]])       # layer 0: {1,2,3}; layer 1: {5}
    assert distinct_per_layer(shared) == 2.0
    steps = np.stack([shared[0], one[0].repeat(2, axis=1)])         # a second step: {1,2}, {3,4}
    assert distinct_per_layer(steps) == (3 + 1 + 2 + 2) / 4


class _Steps:
    """A stand-in for DecodeGraphs: records the token of each step, answers logits whose argmax is 7 + step."""

    def __init__(self):
        self.fed = []

    def decode(self, token, cache):
        import torch
        self.fed.append(token)
        logits = torch.zeros(1, 50)
        logits[0, 7 + len(self.fed)] = 1.0
        return logits


def test_decode_rate_feeds_each_token_back_unless_chained():
    """The usual rows feed every sampled token into the next step (one host sync a token); `chain` never reads the
    token, so every step gets the first one and the GPU need not wait for the host between steps."""
    import torch

    from runtime.experts.bench_model import decode_rate

    for wait, expect in (("spin", [100, 8, 9, 10]), ("chain", [100] * 4)):
        steps = _Steps()
        rate = decode_rate(None, steps, None, steps=2, warmup=2, use_graphs=True, device=torch.device("cpu"),
                           host_wait=wait)
        assert steps.fed == expect and rate > 0


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_gather_traffic_counts_the_launches_done_between_its_marks(monkeypatch):
    """The joint bandwidth's GPU side (GatherTraffic, GPU only) counts finished launches by a binary search over
    their events (they finish in stream order) and gives GB/s between its first and last mark; a queue that ran dry
    before the last mark says nothing (0), since its rate then includes idle time."""
    from runtime.experts import bench_model

    t = object.__new__(bench_model.GatherTraffic)
    t.launch_bytes, t._marks = 10**9, []
    clock = iter([1.0, 1.5, 2.0])
    monkeypatch.setattr(bench_model.time, "perf_counter", lambda: next(clock))
    for done in (3, 40):
        t.events = [_Event(j < done) for j in range(100)]
        assert t._done() == done
        t.mark()
    assert t.rate() == (40 - 3) * 1.0 / 0.5
    t.events = [_Event(True)] * 100                    # every launch done by the last mark: ran dry
    t.mark()
    assert t.rate() == 0.0


def test_a_partial_stores_ceiling_gives_its_unpinned_layers_misses_to_the_cpu_alone():
    """`bench model --pinned-layers`: all layers pinned is the issue's ceiling (both links summed), none pinned the
    CPU kernel's alone, and in between the miss bytes split by the pinned fraction."""
    import pytest

    from runtime.experts.bench_model import ceiling_tok_s, partial_ceiling_tok_s

    args = dict(h2d_gbps=50.0, cpu_gbps=70.0, dense_s=0.003)
    both = ceiling_tok_s(20.0, 2_500_000, 120.0, 0.003)
    cpu_only = ceiling_tok_s(20.0, 2_500_000, 70.0, 0.003)
    assert partial_ceiling_tok_s(20.0, 2_500_000, pinned=1.0, **args) == pytest.approx(both)
    assert partial_ceiling_tok_s(20.0, 2_500_000, pinned=0.0, **args) == pytest.approx(cpu_only)
    half = partial_ceiling_tok_s(20.0, 2_500_000, pinned=0.5, **args)
    assert 1 / half == pytest.approx((1 / both + 1 / cpu_only) / 2)      # (the dense step counted once each side)
    assert cpu_only < partial_ceiling_tok_s(20.0, 2_500_000, pinned=0.75, **args) < both


def test_a_prefill_rows_streaming_ceiling_is_the_slower_of_its_link_and_its_compute():
    """Issue 10's streaming ceiling: moving the row's expert bytes over PCIe against the chunk's compute (the dense
    forward measured apart plus the experts' matmuls at the GEMM rate); whichever is slower bounds the row, and a
    side that is not known (no GPU: no link, no GEMM rate) drops out."""
    import pytest

    from runtime.experts.bench_model import expert_flops, prefill_ceiling_s

    flops = expert_flops(16384, top_k=8, hidden=2048, intermediate=768, layers=48)
    assert flops == pytest.approx(2 * 3 * 16384 * 8 * 2048 * 768 * 48)
    # qwen3-30b's 16K prompt in two 8K chunks at 8 GiB: 2 x 15.4 GB streamed at 55 GB/s (0.56 s) against a 0.25 s
    # dense forward and 0.1 s of matmuls: the link bounds it
    link = prefill_ceiling_s(moved_bytes=30.8e9, h2d_gbps=55.0, dense_s=0.25, expert_flops=flops, matmul_tflops=593.0)
    assert link == pytest.approx(30.8e9 / 55e9)
    # issue 10's laptop projection: the same row over a laptop's PCIe 4.0 x8 (same GPU): the link bounds it harder
    from runtime.experts.bench_model import LAPTOP_PCIE_GBPS
    assert prefill_ceiling_s(moved_bytes=30.8e9, h2d_gbps=LAPTOP_PCIE_GBPS, dense_s=0.25, expert_flops=flops,
                             matmul_tflops=593.0) == pytest.approx(30.8e9 / 12e9)
    # every expert resident (nothing moved): the compute bounds it
    compute = prefill_ceiling_s(moved_bytes=0, h2d_gbps=55.0, dense_s=0.25, expert_flops=flops, matmul_tflops=593.0)
    assert compute == pytest.approx(0.25 + flops / 593e12)
    assert prefill_ceiling_s(moved_bytes=30.8e9, h2d_gbps=0.0, dense_s=0.0, expert_flops=flops,
                             matmul_tflops=0.0) == 0.0


def test_bench_models_prefill_rows_run_in_the_engines_chunk_by_default():
    """`bench model`'s prefill rows measure what the engine does on a GPU: its default chunk is the planner's
    (16K since session 29), so a change to one cannot leave the bench timing the other."""
    import argparse

    from runtime.experts.bench import add_arguments
    from runtime.experts.planner import PREFILL_CHUNK_TOKENS

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["model"])
    assert args.chunk == PREFILL_CHUNK_TOKENS
    assert args.prefill_chunks is None and args.plan_chunks is None and args.plan_context == 0
