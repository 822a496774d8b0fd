"""The hybrid tier's host side per decode call (issue 10): one transfer, no hidden syncs, bookkeeping in
numpy that agrees with the key-by-key definitions, and a host mirror of the slot table that never drifts
from the device table."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.experts.host_store import HostExpertStore
from runtime.experts.hybrid import HybridExperts, HybridOptions
from runtime.experts.interface import ExpertSpec, expert_forward
from runtime.experts.policy import FrequencyPolicy, LRUPolicy, RoutingStats, SlotDirectory
from runtime.experts.slot_cache import SlotCache

CPU = torch.device("cpu")
# ops that read a tensor's values back to the host: on CUDA each is a device sync
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "_unique", "unique_", "unique_consecutive", "is_nonzero",
               "equal", "masked_select", "allclose")


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _reference(store, layer, x, ids, w):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            out[t] += w[t, k] * expert_forward(ExpertSpec(), store.dequantize(layer, int(ids[t, k])), x[t:t + 1])[0]
    return out


def test_decode_reads_the_ids_once_and_never_syncs_otherwise(monkeypatch):
    """Every decode call moves ids/weights/hidden to the host exactly once (`_start_to_host`, waited on once
    in `_finish_to_host`), a fully resident layer not at all, and no torch op that reads values back (item,
    nonzero, unique, ...) runs in either, through hits, CPU misses, fetches with evictions and promotions;
    results stay exact."""
    gen = torch.Generator().manual_seed(11)
    store = HostExpertStore.synthetic(layers=3, num_experts=8, hidden=64, intermediate=64, codec="int4",
                                      weight_std=0.2, seed=2)
    every_of_2 = tuple((2, e) for e in range(8))
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=14, top_k=2, hot_set=every_of_2, split="auto",
                                                 cpu_gbps=10.0, h2d_gbps=10.0))
    transfers, waits = [], []
    start, finish = hybrid._start_to_host, hybrid._finish_to_host
    monkeypatch.setattr(hybrid, "_start_to_host", lambda *a: transfers.append(1) or start(*a))
    monkeypatch.setattr(hybrid, "_finish_to_host", lambda *a: waits.append(1) or finish(*a))
    log = _OpLog()
    for step in range(24):
        layer = step % 3
        x = torch.randn(2, 64, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(2)])
        w = torch.softmax(torch.randn(2, 2, generator=gen), dim=-1)
        before = len(transfers)
        with log:
            got = hybrid(layer, x, ids, w)
        assert len(transfers) - before == (0 if layer == 2 else 1), (step, layer)
        assert len(waits) == len(transfers)
        torch.testing.assert_close(got, _reference(store, layer, x, ids, w), rtol=1e-4, atol=1e-5)
    assert "take.default" in log.ops                        # the log did see the device lookups
    bad = sorted({op for op in log.ops if any(op.startswith(s) for s in SYNCING_OPS)})
    assert not bad, bad
    c = hybrid.counters.total
    assert c.fetched_experts + c.promoted_experts > 0 and c.cpu_experts > 0 and c.hits > 0   # every path ran
    assert c.decode_calls == 24 and c.tokens == 48
    # the host phases the benchmark prints: each counted, none more than the calls' own time
    phases = (c.host_wait_seconds, c.host_book_seconds, c.host_fetch_seconds, c.host_upload_seconds, c.cpu_seconds,
              c.host_promote_seconds)
    assert all(p > 0 for p in phases) and sum(phases) <= c.decode_seconds


def test_distinct_experts_hits_and_cpu_assignments_match_the_key_by_key_definition():
    """The numpy bookkeeping (scratch-array unique, host-table hits, CPU assignment mask) against sets."""
    store = HostExpertStore.synthetic(layers=2, num_experts=16, hidden=64, intermediate=64, codec="int4")
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=6, top_k=4, split="cpu", promote_bytes_per_call=0,
                                                 hot_set=((1, 3), (1, 9), (1, 10), (0, 3))))
    seen = []
    hybrid.cpu.run = lambda layer, x, tok, ids, w: seen.append((tok.copy(), ids.copy(), w.copy())) or torch.zeros_like(x)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(3)])          # [T, K]
        w = rng.random((3, 4), dtype=np.float32)
        before = hybrid.cache.directory.counters.hits, hybrid.cache.directory.counters.misses
        hybrid(1, torch.randn(3, 64), torch.from_numpy(ids), torch.from_numpy(w))
        distinct = set(ids.ravel().tolist())
        hits = {e for e in distinct if e in (3, 9, 10)}
        d = hybrid.cache.directory.counters
        assert (d.hits - before[0], d.misses - before[1]) == (len(hits), len(distinct) - len(hits))
        tok, got_ids, got_w = seen.pop()
        want = [(t, int(e), w[t, k]) for t in range(3) for k, e in enumerate(ids[t]) if e not in hits]
        assert list(zip(tok.tolist(), got_ids.tolist(), got_w.tolist())) == want
    assert sum(hybrid.routing.counts.values()) == hybrid.cache.directory.counters.hits + \
        hybrid.cache.directory.counters.misses


@pytest.mark.parametrize("make", [LRUPolicy, lambda: FrequencyPolicy(half_life=5)])
def test_vectorised_access_equals_single_accesses(make):
    one, many = make(), make()
    rng = np.random.default_rng(1)
    for _ in range(300):                       # long enough for the frequency policy to renormalise
        layer = int(rng.integers(0, 3))
        experts = np.unique(rng.integers(0, 70, size=int(rng.integers(1, 9))))
        for e in experts.tolist():
            one.on_access((layer, e))
        many.on_access_many(layer, experts)
    for layer in range(3):
        ids = np.arange(80)
        want = np.array([one.score((layer, int(e))) for e in ids])
        np.testing.assert_allclose(many.scores(layer, ids), want, rtol=1e-12)
        np.testing.assert_allclose([many.score((layer, int(e))) for e in ids], want, rtol=1e-12)


@pytest.mark.parametrize("make", [LRUPolicy, lambda: FrequencyPolicy(half_life=7)])
def test_lazy_heap_victim_is_the_true_minimum(make):
    """Random inserts, accesses, evictions and protected sets: the heap's victim is always the cached,
    unprotected key of lowest score (ties by key), found by a full scan."""
    pol = make()
    rnd = random.Random(3)
    cached: set = set()
    for step in range(3000):
        r = rnd.random()
        key = (rnd.randrange(2), rnd.randrange(40))
        if r < 0.5:
            pol.on_access(key)
        elif r < 0.7 and key not in cached:
            pol.on_insert(key)
            cached.add(key)
        elif r < 0.8 and cached:
            gone = rnd.choice(sorted(cached))
            pol.on_evict(gone)
            cached.discard(gone)
        else:
            protected = set(rnd.sample(sorted(cached), min(len(cached), rnd.randrange(4))))
            got = pol.victim(cached, protected)
            free = [k for k in cached if k not in protected]
            if not free:
                assert got is None
                continue
            best = min(pol.score(k) for k in free)
            assert got in free and pol.score(got) == pytest.approx(best, rel=1e-12), step


def test_directory_never_offers_pinned_keys_and_protection_is_a_view():
    d = SlotDirectory(3, LRUPolicy(), pinned=[(0, 0)])
    for key in [(0, 0), (0, 1), (0, 2)]:
        d.allocate(key)
    d.record(0, np.array([1, 2]), hits=2)                   # (0, 0) is now the least recently used
    slot, evicted = d.allocate((0, 5))
    assert evicted == (0, 1) and (0, 0) in d                # the pinned key was never a candidate

    class OnlyTwo:
        def __contains__(self, key):
            return key == (0, 2)
    assert d.allocate((0, 6), protected=OnlyTwo())[1] == (0, 5)
    assert d.counters.hits == 2 and d.counters.misses == 0


def test_slot_cache_batched_writes_keep_host_mirror_device_table_and_counts_equal():
    d = SlotDirectory(12, LRUPolicy())
    cache = SlotCache(directory=d, layers=[3, 5, 9], num_experts=6, block_nbytes=4096, device=CPU)
    rng = random.Random(5)
    published: dict = {}
    for _ in range(200):
        keys = list({(rng.choice([3, 5, 9]), rng.randrange(6)) for _ in range(rng.randrange(1, 5))})
        if rng.random() < 0.6:
            slots = [rng.randrange(12) for _ in keys]
            cache.publish_many(keys, slots)
            published.update(zip(keys, slots))
        else:
            cache.withdraw_many(keys)
            for k in keys:
                published.pop(k, None)
        assert np.array_equal(cache.host_table, cache.table.numpy())
        assert cache.published == set(published)
        for li, layer in enumerate([3, 5, 9]):
            assert cache.resident[li] == sum(1 for k in published if k[0] == layer)
            assert cache.layer_resident(layer) == (cache.resident[li] == 6)
    for (layer, e), s in published.items():
        assert int(cache.device_slots(layer, torch.tensor([[e]]))[0, 0]) == s


def test_routing_stats_distinct_add_and_counts_view(tmp_path):
    a, b = RoutingStats(), RoutingStats({(7, 100): 2})
    for layer, experts in [(0, [1, 5, 9]), (7, [100, 3]), (0, [5])]:
        a.add(layer, experts)
        b.add_distinct(layer, np.array(sorted(experts)))
    a.add(7, [100, 100])
    assert a.counts == {(0, 1): 1, (0, 5): 2, (0, 9): 1, (7, 3): 1, (7, 100): 3}
    assert b.counts == a.counts and b.hot_set(2) == [(7, 100), (0, 5)]
    path = tmp_path / "r.json"
    b.save(path)
    assert RoutingStats.load(path).counts == a.counts
    # queued calls fold in batches (a fold every 3 here) over several layers, growing rows as ids grow
    c, d = RoutingStats(), RoutingStats()
    c.FOLD_EVERY = 3
    rng = np.random.default_rng(2)
    for step in range(50):
        layer, experts = int(rng.integers(0, 4)), np.unique(rng.integers(0, 40 + 10 * step, size=6))
        c.add_distinct(layer, experts)
        d.add(layer, experts.tolist())
        if step % 7 == 0:
            assert c.counts == d.counts
    assert c.counts == d.counts and c.hot_set(5) == d.hot_set(5)


def test_bench_hybrid_host_runs(capsys, tmp_path):
    """The host-time microbenchmark, tiny: every row runs and the hit rates it reports are the ones it set."""
    from benchmarks.bench_hybrid_host import main

    out = tmp_path / "rows.json"
    assert main(["--calls", "60", "--layers", "4", "--save", str(out)]) == 0
    import json
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10 and all(r["median_us"] > 0 for r in rows)
    for r in rows:
        assert r["hit_rate"] == pytest.approx(r["hit"], abs=0.06), r
    assert "_resident" in capsys.readouterr().out


def test_staged_decode_io_reuses_its_buffers_without_clobbering_results():
    """The CUDA path's staging (reusable host buffers for ids/weights/hidden, a reusable device buffer for
    the CPU's result), run on a CPU device: batch sizes that grow and shrink, int32 ids, and every call's
    output still right after later calls have reused the buffers."""
    gen = torch.Generator().manual_seed(12)
    store = HostExpertStore.synthetic(layers=2, num_experts=6, hidden=64, intermediate=64, codec="int4",
                                      weight_std=0.2, seed=6)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=3, top_k=2, split="cpu", hot_set=((0, 0), (1, 1))))
    hybrid._staged_io = True
    kept = []
    for t in (1, 4, 2, 9, 1, 3):
        layer = t % 2
        x = torch.randn(t, 64, generator=gen)
        ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(t)]).to(torch.int32)
        w = torch.softmax(torch.randn(t, 2, generator=gen), dim=-1)
        kept.append((hybrid(layer, x, ids, w), layer, x, ids.long(), w))
    for got, layer, x, ids, w in kept:
        torch.testing.assert_close(got, _reference(store, layer, x, ids, w), rtol=1e-4, atol=1e-5)
    assert hybrid._pinned["ids"].shape[0] >= 9 and hybrid._on_device["result"].shape[0] >= 9
    assert hybrid.counters.total.cpu_experts > 0 and hybrid.counters.total.hits > 0


def test_graph_safe_only_when_every_expert_stays_in_the_pool_on_cuda():
    """decode_graph.py records a layer's expert call inside the graph only when it can never need the host."""
    store = HostExpertStore.synthetic(layers=2, num_experts=4, hidden=64, intermediate=64, codec="int4")
    every = tuple((layer, e) for layer in range(2) for e in range(4))
    full = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                         options=HybridOptions(slots=8, top_k=2, hot_set=every))
    part = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                         options=HybridOptions(slots=8, top_k=2, hot_set=every[:4]))
    assert not full.graph_safe(0)                    # a CPU device never records graphs
    full.cuda = part.cuda = True
    assert full.graph_safe(0) and full.graph_safe(1)
    assert not part.graph_safe(0) and not part.graph_safe(1)


def test_gpu_work_is_enqueued_before_the_sync_and_before_the_cpu_starts(monkeypatch):
    """The overlap order of every decode call: the pass over resident experts is enqueued before the host
    waits for the ids, a pass over fetched experts (if any) before the CPU kernel starts."""
    gen = torch.Generator().manual_seed(13)
    store = HostExpertStore.synthetic(layers=1, num_experts=8, hidden=64, intermediate=64, codec="int4",
                                      weight_std=0.2, seed=3)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=6, top_k=3, split="fetch", hot_set=((0, 0), (0, 1)),
                                                 cpu_gbps=10.0, h2d_gbps=10.0))
    events: list[str] = []
    gpu, finish, cpu = hybrid._gpu_forward, hybrid._finish_to_host, hybrid.cpu.run
    monkeypatch.setattr(hybrid, "_gpu_forward", lambda *a: events.append("gpu") or gpu(*a))
    monkeypatch.setattr(hybrid, "_finish_to_host", lambda *a: events.append("sync") or finish(*a))
    monkeypatch.setattr(hybrid.cpu, "run", lambda *a: events.append("cpu") or cpu(*a))
    steps = [("fetch", [[0, 4, 5], [1, 6, 7]]),          # 2 pinned hits, 4 misses fetched
             ("cpu", [[0, 2, 3], [1, 4, 5]]),            # 2 misses on the CPU, 4 hits
             ("fetch", [[2, 3, 0], [1, 6, 7]]),
             ("cpu", [[0, 2, 3], [5, 4, 1]])]
    for mode, ids in steps:
        hybrid.options = HybridOptions(**{**hybrid.options.__dict__, "split": mode, "promote_bytes_per_call": 0})
        events.clear()
        ids = torch.tensor(ids)
        x, w = torch.randn(2, 64, generator=gen), torch.full((2, 3), 1 / 3)
        fetched = hybrid.counters.total.fetched_experts
        got = hybrid(0, x, ids, w)
        torch.testing.assert_close(got, _reference(store, 0, x, ids, w), rtol=1e-4, atol=1e-5)
        assert events[:2] == ["gpu", "sync"], events
        # a second pass exactly when this call fetched, after the sync that told it what to fetch
        assert events.count("gpu") == (2 if hybrid.counters.total.fetched_experts > fetched else 1), events
        if "cpu" in events:
            assert "gpu" not in events[events.index("cpu"):], events
    assert hybrid.counters.total.fetched_experts > 0 and hybrid.counters.total.cpu_experts > 0
