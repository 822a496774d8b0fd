"""The hybrid expert tier against the resident reference, on CPU (the "GPU pool" is a CPU tensor pool here,
so every path -- slot table lookup, fetch, CPU misses, promotion, streaming -- runs in CI)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from runtime.experts.cpu_executor import CpuExecutor
from runtime.experts.host_store import HostExpertStore
from runtime.experts.hybrid import HybridExperts, HybridOptions, hybrid_experts_factory
from runtime.experts.interface import ExpertSpec, ExpertWeights, expert_forward
from runtime.experts.planner import GiB, Hardware
from runtime.experts.policy import RoutingStats
from runtime.experts.resident import ResidentExperts
from tests.engine_fixtures import ftw_packages, random_prompt  # noqa: F401  (session fixture)

CPU = torch.device("cpu")


def random_routing(gen: torch.Generator, t: int, e: int, k: int, *, hot: int = 0):
    """[T, K] distinct expert ids per token (from the first `hot` experts when hot > 0) and softmax weights."""
    pool = hot or e
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return ids, w


def reference(store: HostExpertStore, spec: ExpertSpec, layer: int, x, ids, w) -> torch.Tensor:
    out = torch.zeros_like(x)
    for ti in range(x.shape[0]):
        for ki in range(ids.shape[1]):
            weights = store.dequantize(layer, int(ids[ti, ki]))
            out[ti] += w[ti, ki] * expert_forward(spec, weights, x[ti:ti + 1])[0]
    return out


def test_hybrid_matches_resident_on_a_converted_tiny_model(ftw_packages):
    """A real FTW package (int4): every split strategy gives the resident tier's output; the counters add up."""
    from runtime.ftw.reader import FTWPackage

    pkg = FTWPackage.open(ftw_packages("qwen3_moe", "int4"))
    spec = ExpertSpec()
    resident = ResidentExperts.from_store(pkg.experts, spec, device=CPU, dtype=torch.float32)
    store = HostExpertStore.from_ftw(pkg.experts)
    assert store.layers == pkg.experts.layers and store.codec == "int4"
    gen = torch.Generator().manual_seed(0)
    d, e, k = store.hidden_size, store.num_experts, 2
    for split in ("auto", "cpu", "fetch"):
        hybrid = HybridExperts(store, spec, device=CPU, dtype=torch.float32,
                               options=HybridOptions(slots=5, top_k=k, split=split))
        for step in range(12):
            layer = store.layers[step % len(store.layers)]
            x = torch.randn(3, d, generator=gen)
            ids, w = random_routing(gen, 3, e, k, hot=5 if step % 2 else 0)
            got = hybrid(layer, x, ids, w)
            want = resident(layer, x, ids, w)
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
        c = hybrid.counters.total
        assert c.decode_calls == 12 and c.hits + c.misses > 0
        assert c.cpu_experts + c.fetched_experts + c.hits == c.hits + c.misses
        if split == "cpu":
            assert c.fetched_experts == 0 and c.cpu_experts == c.misses
        if split == "fetch":
            assert c.cpu_experts <= c.misses and c.fetched_experts > 0
        assert c.hits > 0                       # promotions and fetches made later calls hit
        assert len(hybrid.cache.directory) <= 5


@pytest.mark.parametrize("codec, fmt, activation", [("int4", "", "silu"), ("fp4", "mxfp4", "gpt_oss"),
                                                    ("fp4", "nvfp4", "silu"), ("bf16", "", "gpt_oss")])
def test_hybrid_every_codec_against_the_reference(codec, fmt, activation):
    gen = torch.Generator().manual_seed(1)
    d, i, e, k = 64, 32, 6, 2
    bias = activation == "gpt_oss"
    rnd = lambda *s: torch.randn(*s, generator=gen) * 0.2        # noqa: E731
    weights = {(layer, x): ExpertWeights(rnd(i, d), rnd(i, d), rnd(d, i), rnd(i) if bias else None,
                                         rnd(i) if bias else None, rnd(d) if bias else None)
               for layer in (1, 3) for x in range(e)}
    store = HostExpertStore.from_weights(weights, codec=codec, group=32, fp4_format=fmt or "mxfp4")
    spec = ExpertSpec(activation=activation, has_bias=bias)
    hybrid = HybridExperts(store, spec, device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=3, top_k=k, stream_threshold=16, stream_on_cpu=True))
    for t in (1, 4, 20):                                    # 20 tokens: the streaming (prefill) path
        x = torch.randn(t, d, generator=gen)
        ids, w = random_routing(gen, t, e, k)
        got = hybrid(3, x, ids, w)
        tol = dict(rtol=3e-2, atol=3e-3) if codec == "bf16" else dict(rtol=1e-4, atol=1e-5)   # bf16 activations
        torch.testing.assert_close(got, reference(store, spec, 3, x, ids, w), **tol)
    assert hybrid.counters.total.stream_calls == 1 and hybrid.counters.total.decode_calls == 2


def test_cpu_executor_fast_path_matches_reference_path():
    """The numba kernels (one call for all misses) against dequantize + expert_forward, odd groupings included."""
    gen = torch.Generator().manual_seed(2)
    d, i, e = 128, 64, 5
    weights = {(0, x): ExpertWeights(torch.randn(i, d, generator=gen) * .1, torch.randn(i, d, generator=gen) * .1,
                                     torch.randn(d, i, generator=gen) * .1) for x in range(e)}
    for codec in ("int4", "fp4"):
        store = HostExpertStore.from_weights(weights, codec=codec, group=32)
        fast, ref = CpuExecutor(store, ExpertSpec()), CpuExecutor(store, ExpertSpec(), fast=False)
        assert fast.fast and not ref.fast
        x = torch.randn(4, d, generator=gen)
        tokens = np.array([0, 0, 1, 2, 2, 3, 3, 3])
        experts = np.array([4, 1, 1, 0, 4, 2, 1, 4])        # repeated experts and tokens
        w = np.linspace(0.1, 0.8, 8, dtype=np.float32)
        torch.testing.assert_close(fast.run(0, x, tokens, experts, w), ref.run(0, x, tokens, experts, w),
                                   rtol=1e-4, atol=1e-6)
        assert torch.equal(fast.run(0, x, tokens[:0], experts[:0], w[:0]), torch.zeros_like(x))


def test_warm_start_from_routing_stats_and_stats_dict(tmp_path):
    gen = torch.Generator().manual_seed(3)
    store = HostExpertStore.synthetic(layers=2, num_experts=8, hidden=64, intermediate=32, codec="int4", group=32)
    stats = RoutingStats()
    stats.add(1, [5, 5, 6])
    stats.add(1, [5])
    path = tmp_path / "routing.json"
    stats.save(path)
    loaded = RoutingStats.load(path)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32, routing_stats=loaded,
                           options=HybridOptions(slots=2, top_k=1, hot_set=tuple(loaded.hot_set(2)), split="cpu"))
    x = torch.randn(1, 64, generator=gen)
    hybrid(1, x, torch.tensor([[5]]), torch.ones(1, 1))
    hybrid(1, x, torch.tensor([[6]]), torch.ones(1, 1))
    c = hybrid.counters.total
    assert (c.hits, c.misses) == (2, 0)                     # the hot set was in the pool from the start
    hybrid(0, x, torch.tensor([[2]]), torch.ones(1, 1))     # a miss; the pool is all pinned: stays on the CPU
    d = hybrid.stats()
    assert d["total"]["hits"] == 2 and d["total"]["misses"] == 1 and d["total"]["cpu_experts"] == 1
    assert d["total"]["hit_rate"] == pytest.approx(2 / 3, abs=1e-3) and d["vram_bytes"]["expert_pool"] == 2 * store.block_nbytes
    assert d["host_rss_bytes"] > 0
    hybrid.save_routing(path)
    again = RoutingStats.load(path)                          # earlier runs' counts plus this one's
    assert again.counts[(1, 5)] == 4 and again.counts[(1, 6)] == 2 and again.counts[(0, 2)] == 1
    with pytest.raises(KeyError, match="layer 7"):
        hybrid(7, x, torch.tensor([[2]]), torch.ones(1, 1))


def test_engine_generates_the_same_tokens_through_the_hybrid_tier(ftw_packages):
    """End to end: the engine with the hybrid tier (a 6-slot CPU pool) greedy-decodes exactly what it does
    with every expert resident."""
    from runtime.engine import Engine, SamplingParams

    path = ftw_packages("qwen3_moe", "int4")
    prompt = random_prompt(12, seed=5)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    want = Engine.load(path, device="cpu").generate(prompt, sampling).tokens
    hw = Hardware(ram_total=16 * GiB, ram_available=16 * GiB, pinnable=8 * GiB, cpu_gbps=10.0)
    factory = functools.partial(hybrid_experts_factory, hardware=hw, slots=6)
    eng = Engine.load(path, device="cpu", experts_factory=factory)
    got = eng.generate(prompt, sampling).tokens
    assert got == want and len(got) == 8
    experts = eng.model.experts
    assert isinstance(experts, HybridExperts) and experts.counters.total.cpu_experts > 0
    assert experts.planned["backend"] == "cpu"


def test_out_of_memory_at_load_shrinks_the_pool_and_says_so(monkeypatch, caplog):
    import runtime.experts.hybrid as hybrid_mod

    store = HostExpertStore.synthetic(layers=1, num_experts=8, hidden=64, intermediate=32, codec="int4", group=32)
    real_init = hybrid_mod.HybridExperts.__init__

    def small_gpu(self, *args, options, **kwargs):
        if options.slots > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real_init(self, *args, options=options, **kwargs)

    monkeypatch.setattr(hybrid_mod.HybridExperts, "__init__", small_gpu)
    with caplog.at_level("WARNING"):
        experts = hybrid_mod._build_hybrid(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                                           options=HybridOptions(slots=8, top_k=2), routing=RoutingStats())
    assert experts.options.slots == 3 and experts.cache.directory.capacity == 3       # 8 -> 6 -> 4 -> 3
    assert "out of memory with 8 expert slots" in caplog.text
    assert experts.plan()["slots"] == 3


def test_fully_resident_layer_skips_the_host():
    """When every expert of a layer is in the pool, calls go straight to the device lookup (no id transfer,
    no host bookkeeping) and still match the reference; a layer that loses one expert takes the full path."""
    gen = torch.Generator().manual_seed(4)
    store = HostExpertStore.synthetic(layers=2, num_experts=4, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2)
    every = tuple((layer, e) for layer in range(2) for e in range(4))
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=8, top_k=2, hot_set=every))
    x = torch.randn(3, 64, generator=gen)
    ids, w = random_routing(gen, 3, 4, 2)
    torch.testing.assert_close(hybrid(1, x, ids, w), reference(store, ExpertSpec(), 1, x, ids, w), rtol=1e-4, atol=1e-5)
    assert hybrid.routing.counts == {}                         # the host never looked at the ids
    assert hybrid.counters.total.hits == 6 and hybrid.counters.total.misses == 0
    hybrid.cache.withdraw((1, 3))                               # no longer fully resident
    hybrid.cache.directory.release((1, 3))
    torch.testing.assert_close(hybrid(1, x, ids, w), reference(store, ExpertSpec(), 1, x, ids, w), rtol=1e-4, atol=1e-5)
    assert sum(hybrid.routing.counts.values()) == len(torch.unique(ids))


def test_pinned_copy_never_holds_the_mapped_file_and_the_copy_at_once(tmp_path):
    """The host side counts a page once: copying a mapped store hands each layer's mapped pages back."""
    import types

    from runtime.experts.host_store import BlockLayout
    from runtime.experts.stats import host_rss

    layout = BlockLayout.build("int4", 512, 256, group=64)
    layers, experts = 4, 48                                    # 4 x 48 x 200 KiB blocks = ~38 MB
    path = tmp_path / "experts.bin"
    data = np.random.default_rng(0).integers(0, 256, size=layers * experts * layout.nbytes, dtype=np.uint8)
    data.tofile(path)
    nbytes = data.nbytes
    del data
    fake = types.SimpleNamespace(
        codec="int4", hidden_size=512, intermediate_size=256, group_size=64, block_size=None, fp4_format=None,
        scale_format=None, global_scale_op=None, block_nbytes=layout.nbytes, layers=list(range(layers)),
        num_experts=experts, parts={n: types.SimpleNamespace(offset=p.offset, shape=p.shape, dtype=p.dtype,
                                                             nbytes=p.nbytes) for n, p in layout.parts.items()},
        mm=np.memmap(path, dtype=np.uint8, mode="c", shape=(nbytes,)),
        layer_offset=lambda layer: layer * experts * layout.nbytes)
    store = HostExpertStore.from_ftw(fake)
    before = host_rss()
    checksum = sum(int(store.layer_buffer(layer).sum(dtype=np.uint64)) for layer in store.layers)   # map it all
    mapped = host_rss() - before
    assert mapped > 0.8 * nbytes
    copy = store.pinned_copy(pin=False)
    grown = host_rss() - before
    assert grown < mapped + 0.3 * nbytes                       # the copy replaced the mapping, not added to it
    assert sum(int(copy.layer_buffer(layer).sum(dtype=np.uint64)) for layer in copy.layers) == checksum
    assert np.array_equal(copy.block(3, 47), store.block(3, 47))   # the released mapping reads back from the file


def test_prefill_streaming_double_buffers_across_layers():
    """Streaming through three layers in turn (and back): each call computes with its own layer's experts
    although the next layer's copy went into the other buffer before it ran."""
    gen = torch.Generator().manual_seed(8)
    store = HostExpertStore.synthetic(layers=3, num_experts=4, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2, seed=3)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=2, top_k=2, stream_threshold=8, stream_on_cpu=True))
    for layer in (0, 1, 2, 0, 2, 1, 1, 0):                   # in order, wrapping, skipping and repeating
        x = torch.randn(10, 64, generator=gen)
        ids, w = random_routing(gen, 10, 4, 2)
        torch.testing.assert_close(hybrid(layer, x, ids, w), reference(store, ExpertSpec(), layer, x, ids, w),
                                   rtol=1e-4, atol=1e-5)
    c = hybrid.counters.total
    assert c.stream_calls == 8 and c.bytes_streamed >= 8 * 4 * store.block_nbytes


@pytest.mark.parametrize("staged_io", [False, True])
def test_a_split_stream_matches_the_reference_whatever_prefix_each_layer_got(staged_io):
    """A mid-size chunk streams experts [0, k) and the CPU computes the rest's assignments: the output is the
    reference's for every k - none, some, all - including a layer staged ahead with another chunk's k, and the
    counters say what each side did (k blocks copied per call, the CPU's distinct experts). `staged_io`: the ids,
    weights and hidden reach the host, and the CPU's answer the device, through the staging buffers a GPU uses."""
    import itertools

    gen = torch.Generator().manual_seed(10)
    e = 16
    store = HostExpertStore.synthetic(layers=3, num_experts=e, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2, seed=4)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=2, top_k=2, stream_threshold=8, stream_on_cpu=True,
                                                 stream_split=True))
    hybrid._staged_io = staged_io
    prefixes = itertools.cycle([5, 16, 1, 9, 0, 12])
    asked = []
    hybrid._stream_prefix = lambda t: asked.append(next(prefixes)) or asked[-1]     # noqa: E731
    for layer in (0, 1, 2, 0, 2, 1, 1, 0):
        t = int(torch.randint(8, 24, (1,), generator=gen))
        x = torch.randn(t, 64, generator=gen)
        ids, w = random_routing(gen, t, e, 2)
        torch.testing.assert_close(hybrid(layer, x, ids, w), reference(store, ExpertSpec(), layer, x, ids, w),
                                   rtol=1e-4, atol=1e-5)
    c = hybrid.counters.total
    assert c.stream_calls == 8
    # every prefix asked for was copied, and only those blocks (staged ones too, some overwritten before use)
    assert hybrid.transport.bytes_copied == sum(asked) * store.block_nbytes
    assert c.bytes_streamed < c.stream_calls * e * store.block_nbytes
    assert 0 < c.cpu_experts and c.cpu_seconds > 0 and c.bytes_cpu_read == c.cpu_experts * store.block_nbytes
    assert hybrid._cpu_assignment_s is not None and hybrid._cpu_assignment_s > 0     # learned from those calls
    shown = hybrid.stats_dict()["stream_split"]                                        # (the stats event's)
    assert shown["on"] is True and shown["cpu_assignment_us"] == round(hybrid._cpu_assignment_s * 1e6, 3)


def test_the_stream_prefix_balances_the_copy_against_the_cpu(monkeypatch):
    """Off (the default, until a GPU A/B): the whole layer. On: at the stream threshold - where the CPU's part of
    every expert would take as long as the copy - half the experts; more as chunks grow, all of them once the CPU's
    part would be under 1/32 of the experts; a CPU measured slower than modelled gets fewer."""
    from runtime.experts.hybrid import STREAM_SPLIT_MIN_PART, stream_threshold_tokens

    e, d, i, k = 128, 256, 128, 8
    store = HostExpertStore.synthetic(layers=1, num_experts=e, hidden=d, intermediate=i, codec="int4", group=32,
                                      seed=5)
    monkeypatch.delenv("FREETOKEN_STREAM_SPLIT", raising=False)

    def tier(**options):
        return HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                             options=HybridOptions(slots=0, top_k=k, h2d_gbps=10.0, stream_on_cpu=True, **options))

    assert tier().stream_split is False and tier()._stream_prefix(64) == e
    monkeypatch.setenv("FREETOKEN_STREAM_SPLIT", "1")
    on = tier()
    on._split_cpu_threads = lambda: 16                   # (the modelled figure's threads: this VM has 2)
    assert on.stream_split is True and tier(stream_split=False).stream_split is False
    threshold = stream_threshold_tokens(num_experts=e, top_k=k, block_nbytes=store.block_nbytes, hidden=d,
                                        intermediate=i, h2d_gbps=10.0)
    assert 32 <= threshold < 32 * e // k                 # (below the rule: the balance sets it)
    assert abs(on._stream_prefix(threshold) - e / 2) <= 2
    ks = [on._stream_prefix(t) for t in (threshold, 2 * threshold, 8 * threshold)]
    assert ks == sorted(ks) and len(set(ks)) == 3 and ks[-1] < e
    big = on._stream_prefix(1 << 20)
    assert big == e                                       # the CPU's part would be a fraction of an expert
    assert e - on._stream_prefix(16 * threshold) >= e // STREAM_SPLIT_MIN_PART or on._stream_prefix(16 * threshold) == e
    modelled = on._stream_prefix(threshold)
    on._split_cpu_threads = lambda: 4                    # fewer kernel threads (beside the worker): more streams
    assert e > on._stream_prefix(threshold) > modelled
    on._split_cpu_threads = lambda: 1                    # one (a 16-core host's worker keeps 14): ~1/17 left
    assert e > on._stream_prefix(threshold) >= e * 15 / 16
    on._split_cpu_threads = lambda: 16
    on._cpu_assignment_s = 4 * 6 * d * i / 0.3e12        # the CPU measured 4x slower than the model: more streams
    assert on._stream_prefix(threshold) > modelled


def test_the_split_thread_count_from_the_environment_is_checked(monkeypatch, caplog):
    """FREETOKEN_STREAM_SPLIT_THREADS: a count is taken (capped at the cores: numba refuses more); anything else is
    ignored with a warning that names the variable, rather than failing a prompt deep in the kernel."""
    import logging
    import os

    from runtime.experts.hybrid import _env_threads

    name = "FREETOKEN_STREAM_SPLIT_THREADS"
    monkeypatch.delenv(name, raising=False)
    assert _env_threads(name) is None
    monkeypatch.setenv(name, "1")
    assert _env_threads(name) == 1
    with caplog.at_level(logging.WARNING, logger="runtime.experts.hybrid"):
        for bad in ("many", "0", "-3", "2.5"):
            monkeypatch.setenv(name, bad)
            assert _env_threads(name) is None
        monkeypatch.setenv(name, str((os.cpu_count() or 1) + 7))
        assert _env_threads(name) == (os.cpu_count() or 1)
    assert sum(name in r.getMessage() for r in caplog.records) == 5
    assert "not a positive whole number of threads" in caplog.text and "cores" in caplog.text


def test_the_last_chunk_of_a_prompt_stages_no_layer_ahead():
    """The last layer stages the first one ahead only while the engine says another prefill chunk follows: after a
    prompt's last chunk that copy would serve nobody (and hold up the copy stream's decode promotions)."""
    gen = torch.Generator().manual_seed(9)
    store = HostExpertStore.synthetic(layers=3, num_experts=4, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2, seed=3)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=2, top_k=2, stream_threshold=8, stream_on_cpu=True))
    layer_bytes = store.num_experts * store.block_nbytes
    for chunk, last in ((0, False), (1, True)):
        hybrid.prefill_continues = not last
        for layer in (0, 1, 2):
            x = torch.randn(10, 64, generator=gen)
            ids, w = random_routing(gen, 10, 4, 2)
            torch.testing.assert_close(hybrid(layer, x, ids, w), reference(store, ExpertSpec(), layer, x, ids, w),
                                       rtol=1e-4, atol=1e-5)
    # six streamed layers, each copied once: the first chunk's wrap-around staged layer 0 for the second chunk,
    # the second's last layer staged nothing
    assert hybrid.counters.total.stream_calls == 6
    assert hybrid.transport.bytes_copied == 6 * layer_bytes and not hybrid._staged


def _recording_tier(**attributes):
    """An experts factory whose tier (resident, with `attributes` set on it) records each forward's token count at
    layer 0 and what the engine set `prefill_continues` to; returns (the records, the factory)."""
    seen = []

    class Recording(ResidentExperts):
        prefill_continues = True

        def __call__(self, layer, hidden, topk_ids, topk_weights):
            if layer == 0:
                seen.append((hidden.shape[0], self.prefill_continues))
            return super().__call__(layer, hidden, topk_ids, topk_weights)

    def factory(package, spec, *, device, dtype, **_unused):
        tier = Recording.from_store(package.experts, spec, device=device, dtype=dtype)
        for name, value in attributes.items():
            setattr(tier, name, value)
        return tier

    return seen, factory


def test_the_engine_tells_a_streaming_tier_whether_a_prefill_chunk_follows(ftw_packages):
    """Engine.step sets `prefill_continues` before each forward: True for every chunk of a prompt but its last."""
    from runtime.engine import Engine, SamplingParams

    seen, factory = _recording_tier()
    sampling = SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=[])
    eng = Engine.load(ftw_packages("qwen3_moe", "int4"), device="cpu", experts_factory=factory, prefill_chunk=8)
    eng.generate(random_prompt(20, seed=4), sampling)
    prefill = [entry for entry in seen if entry[0] > 1]
    assert [n for n, _ in prefill] == [8, 8, 4]
    assert [more for _, more in prefill] == [True, True, False]
    # one sequence at a time: the first prompt's last chunk is followed by the waiting request's prefill
    seen.clear()
    eng = Engine.load(ftw_packages("qwen3_moe", "int4"), device="cpu", experts_factory=factory, prefill_chunk=8,
                      max_batch=1)
    for seed in (5, 6):
        eng.add_request(random_prompt(12, seed=seed), sampling)
    while eng.has_work():
        eng.step()
    prefill = [entry for entry in seen if entry[0] > 1]
    assert prefill == [(8, True), (4, True), (8, True), (4, False)]


def test_a_chunk_leaving_fewer_tokens_than_stream_threshold_stages_nothing(ftw_packages):
    """With a threshold, a later step counts only when it prefills enough tokens to stream: a prompt left a few
    tokens short (a recurrent model's lone last token) gets no staged layer, which would only compete for PCIe."""
    from runtime.engine import Engine, SamplingParams

    seen, factory = _recording_tier(stream_threshold=5)
    sampling = SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=[])
    eng = Engine.load(ftw_packages("qwen3_moe", "int4"), device="cpu", experts_factory=factory, prefill_chunk=8)
    eng.generate(random_prompt(20, seed=4), sampling)
    # 12 tokens left after the first chunk (>= 5), 4 after the second (< 5): the same chunks as without a threshold
    assert [entry for entry in seen if entry[0] > 1] == [(8, True), (8, False), (4, False)]
    # a waiting prompt of 12 tokens counts, one of 3 does not
    for length, expected in ((12, True), (3, False)):
        seen.clear()
        eng = Engine.load(ftw_packages("qwen3_moe", "int4"), device="cpu", experts_factory=factory, prefill_chunk=8,
                          max_batch=1)
        eng.add_request(random_prompt(8, seed=5), sampling)
        eng.add_request(random_prompt(length, seed=6), sampling)
        eng.step()
        assert seen[0] == (8, expected)


def test_bookkeeping_stays_consistent_under_churn():
    """Many calls over a small pool with fetches, promotions and prefetch competing for slots: every output
    matches the reference, the device table equals the host's map, and nothing stays 'in flight' forever."""
    from runtime.experts.prefetch import NextLayerPrefetcher

    gen = torch.Generator().manual_seed(9)
    store = HostExpertStore.synthetic(layers=3, num_experts=6, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2, seed=5)
    pf = NextLayerPrefetcher({layer: torch.randn(6, 64, generator=gen) for layer in range(3)}, top_k=2)
    for policy in ("lru", "frequency"):
        hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32, prefetcher=pf,
                               options=HybridOptions(slots=5, top_k=2, policy=policy, hot_set=((0, 0),),
                                                     prefetch_bytes_per_call=2 * store.block_nbytes))
        for step in range(15):
            layer = step % 3
            x = torch.randn(2, 64, generator=gen)
            ids, w = random_routing(gen, 2, 6, 2, hot=3 if step % 4 else 0)
            torch.testing.assert_close(hybrid(layer, x, ids, w), reference(store, ExpertSpec(), layer, x, ids, w),
                                       rtol=1e-4, atol=1e-5)
            d, cache = hybrid.cache.directory, hybrid.cache
            assert len(d) <= 5 and (0, 0) in d                          # capacity kept, pinned key never evicted
            assert cache.pending <= set(d.slot_of)
            for li, lay in enumerate(store.layers):
                for e in range(6):
                    key = (lay, e)
                    want = d.slot_of[key] if key in cache.published else -1
                    assert int(cache.table[li, e]) == want, (step, key)
            assert cache.published <= set(d.slot_of)
        hybrid._finish_promotions()
        assert not hybrid.cache.pending                                  # CPU copies land at once
        c = hybrid.counters.total
        assert c.hits > 0 and c.cpu_experts + c.fetched_experts > 0 and c.promoted_experts > 0


def test_mid_size_batches_stream_when_the_cpu_would_take_longer():
    """The stream threshold: decode-sized batches never stream; on a fast link the CPU's arithmetic makes
    tens of tokens stream (the H200's qwen3-30b shape: from 32), a slow link moves the crossover up, and the
    issue's 32 x E/K rule stays the ceiling (and the rule without a GPU link)."""
    from runtime.experts.hybrid import MIN_STREAM_TOKENS, stream_threshold_tokens

    shape = dict(num_experts=128, top_k=8, block_nbytes=2_654_208, hidden=2048, intermediate=768)
    h200 = stream_threshold_tokens(**shape, h2d_gbps=55.0)
    laptop = stream_threshold_tokens(**shape, h2d_gbps=12.0)
    assert h200 == MIN_STREAM_TOKENS and MIN_STREAM_TOKENS < laptop < 512
    assert stream_threshold_tokens(**shape, h2d_gbps=0.5) == 512 == stream_threshold_tokens(**shape, h2d_gbps=0.0)
    assert stream_threshold_tokens(**shape, h2d_gbps=10_000.0) == MIN_STREAM_TOKENS   # decode never streams
