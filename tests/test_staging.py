"""The page-locked staging ring a mapped (pageable) store's experts pass through (runtime/experts/staging.py).

On the CPU the ring's code runs with plain buffers and a synchronous "DMA" (CI); `--device cuda` runs it with
page-locked slots, a copy stream and a compute stream that is slow to release its buffers."""
from __future__ import annotations

import concurrent.futures
import re
import threading

import numpy as np
import pytest
import torch

from runtime.experts import staging
from runtime.experts.host_store import HostExpertStore
from runtime.experts.hybrid import HybridExperts, HybridOptions
from runtime.experts.interface import ExpertSpec
from runtime.experts.planner import STAGING_RING_LAYERS
from runtime.experts.staging import StagingRing
from runtime.experts.transport import Transport, ready_event
from tests.test_hybrid_experts import random_routing, reference

CPU = torch.device("cpu")


def _layers(n: int, entries: int, nbytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(entries, nbytes), dtype=np.uint8) for _ in range(n)]


def test_layers_staged_through_two_slots_arrive_intact_in_parallel_chunks(monkeypatch):
    """Seven layers through a two-slot ring, each copied by three threads in chunks that do not divide it: every
    destination holds its own layer's bytes, though the slots were refilled while earlier layers were queued."""
    monkeypatch.setattr(staging, "COPY_CHUNK_BYTES", 1000)          # 5.2 chunks a layer, the last one short
    ring = StagingRing(slots=2, entries_per_slot=4, entry_nbytes=1300, device=CPU, copy_threads=3)
    layers = _layers(7, 4, 1300)
    dsts = [torch.zeros(4, 1300, dtype=torch.uint8) for _ in layers]
    handles = [ring.stage_layer(src, dst) for src, dst in zip(layers, dsts)]      # all queued before any waits
    for src, dst, handle in zip(layers, dsts, handles):
        assert handle.event() is None                   # a CPU device: the copy has finished when event() returns
        assert np.array_equal(dst.numpy(), src)
    ring.close()


def test_a_short_layer_and_blocks_share_the_ring_in_call_order():
    """Decode's blocks (fetches, promotions) after a layer staged ahead, on the ring's one thread: each lands, the
    layer before them; a batch larger than the ring goes a ring's worth at a time; `query` says when they landed."""
    ring = StagingRing(slots=2, entries_per_slot=3, entry_nbytes=64, device=CPU, copy_threads=2)
    short = _layers(1, 2, 64, seed=1)[0]                # fewer experts than a slot holds
    dst = torch.zeros(2, 64, dtype=torch.uint8)
    ring.stage_layer(short, dst)
    blocks = _layers(1, 9, 64, seed=2)[0]
    outs = [torch.zeros(64, dtype=torch.uint8) for _ in blocks]
    first = ring.stage_blocks([(blocks[0], outs[0])])
    rest = ring.stage_blocks(list(zip(blocks[1:], outs[1:])))     # 8 blocks through 6 entries
    assert rest.event() is None and rest.query() and first.query()
    assert np.array_equal(dst.numpy(), short)
    for block, out in zip(blocks, outs):
        assert np.array_equal(out.numpy(), block)
    # the ring's own account (the bench's prefill line): one layer of 2 entries and 9 blocks, every byte counted
    t = ring.timing
    assert (t["layers"], t["blocks"], t["bytes"]) == (1, 9, short.nbytes + blocks.nbytes)
    assert all(t[k] >= 0 for k in ("wait_s", "copy_s", "ship_s")) and t["copy_s"] > 0
    assert ring._next_entry == 9 % 6                    # every block took the next entry, the ring wrapped
    ring.close()


def test_a_failed_staging_raises_in_the_waiting_thread_and_the_ring_goes_on():
    ring = StagingRing(slots=2, entries_per_slot=2, entry_nbytes=16, device=CPU, copy_threads=1)
    bad = np.full((2, 16), 0.5)                         # floats: numpy refuses to cast them into the byte slot
    handle = ring.stage_layer(bad, torch.zeros(2, 16, dtype=torch.uint8))
    with pytest.raises(TypeError):
        handle.event()
    good, dst = _layers(1, 2, 16)[0], torch.zeros(2, 16, dtype=torch.uint8)
    ring.stage_layer(good, dst).event()
    assert np.array_equal(dst.numpy(), good)
    with pytest.raises(ValueError, match="does not fit a slot of 2 entries of 16 bytes"):
        ring.stage_layer(_layers(1, 3, 16)[0], torch.zeros(3, 16, dtype=torch.uint8))
    ring.close()


def test_a_staging_buffer_that_cannot_be_page_locked_falls_back_and_says_so(monkeypatch, caplog):
    """The OS's page-locked limit reached (Windows pins about half the RAM): the ring takes pageable slots, says
    which buffer, how big and what frees page-locked memory, and the layer still arrives; a buffer that cannot be
    allocated at all is a StagingError with that message, raised where the layer was asked for, and the ring is
    still usable once memory is free."""
    real_empty = torch.empty

    def no_pinning(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)
    ring = StagingRing(slots=2, entries_per_slot=2, entry_nbytes=1 << 20, device=CPU, copy_threads=1)
    ring.pin = True                                      # as on a GPU
    monkeypatch.setattr(staging.torch, "empty", no_pinning)
    src, dst = _layers(1, 2, 1 << 20)[0], torch.zeros(2, 1 << 20, dtype=torch.uint8)
    with caplog.at_level("WARNING", logger="runtime.experts.staging"):
        ring.stage_layer(src, dst).event()
    assert np.array_equal(dst.numpy(), src) and not ring.pin and not ring.buf.is_pinned()
    assert re.search(r"could not page-lock 4 MiB .*staging buffer .*out of memory.*pageable", caplog.text)
    ring.close()

    ring = StagingRing(slots=2, entries_per_slot=2, entry_nbytes=1 << 20, device=CPU, copy_threads=1)

    def refuse(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(staging.torch, "empty", refuse)
    with pytest.raises(staging.StagingError, match=r"could not allocate 4 MiB .*staging buffer .*out of memory"):
        ring.stage_layer(_layers(1, 2, 1 << 20)[0], torch.zeros(2, 1 << 20, dtype=torch.uint8))
    monkeypatch.setattr(staging.torch, "empty", real_empty)
    src, dst = _layers(1, 2, 1 << 20)[0], torch.zeros(2, 1 << 20, dtype=torch.uint8)
    ring.stage_layer(src, dst).event()
    assert np.array_equal(dst.numpy(), src)
    ring.close()


def test_transport_stages_a_pageable_store_in_the_ring_the_planner_counts():
    store = HostExpertStore.synthetic(layers=2, num_experts=4, hidden=64, intermediate=32, codec="int4", group=32)
    transport = Transport(store, CPU, staged=True, copy_threads=2)
    assert transport.ring.nbytes == STAGING_RING_LAYERS * store.num_experts * store.block_nbytes
    assert transport.ring._buf is None                  # nothing page-locked until a copy needs the ring
    layer = torch.zeros(store.num_experts, store.block_nbytes, dtype=torch.uint8)
    assert ready_event(transport.submit_range(store.layer_buffer(1), layer)) is None
    assert np.array_equal(layer.numpy(), store.layer_buffer(1))
    blocks = [torch.zeros(store.block_nbytes, dtype=torch.uint8) for _ in range(3)]
    handle = transport.submit([(store.block(0, e), b) for e, b in zip((3, 0, 2), blocks)])
    assert ready_event(handle) is None                  # (staged on the ring's thread: waited for here)
    for e, b in zip((3, 0, 2), blocks):
        assert np.array_equal(b.numpy(), store.block(0, e))
    assert transport.bytes_copied == 7 * store.block_nbytes
    assert transport.ring.buf.numel() == transport.ring.nbytes
    assert Transport(store, CPU).ring is None           # a CPU device reads the store itself: nothing to stage
    transport.close()


def test_a_store_pinned_in_part_stages_only_its_unpinned_layers():
    """A store pinned in part: blocks and layers inside the pinned span are copied directly (no ring, no Staged),
    the others through the ring - also within one submit that mixes both (filling the pool at load does) - and every
    byte arrives. (On the CPU nothing is page-locked: the span a GPU would compute is set as it would be.)"""
    from runtime.experts.staging import Staged
    from runtime.experts.transport import layers_span

    store = HostExpertStore.synthetic(layers=3, num_experts=4, hidden=64, intermediate=32, codec="int4",
                                      group=32).pinned_copy(pin=False, layers=[0, 1])
    transport = Transport(store, CPU, staged=True, copy_threads=2)
    transport._direct_span = layers_span(store, [0, 1])
    layer = torch.zeros(store.num_experts, store.block_nbytes, dtype=torch.uint8)
    assert not isinstance(transport.submit_range(store.layer_buffer(1), layer), Staged)
    assert np.array_equal(layer.numpy(), store.layer_buffer(1)) and transport.ring._buf is None   # (ring unused)
    assert isinstance(transport.submit_range(store.layer_buffer(2), layer), Staged)
    transport.ring.drain()
    assert np.array_equal(layer.numpy(), store.layer_buffer(2))
    keys = [(0, 3), (2, 1), (1, 0), (2, 2)]
    blocks = [torch.zeros(store.block_nbytes, dtype=torch.uint8) for _ in keys]
    handle = transport.submit([(store.block(*key), b) for key, b in zip(keys, blocks)])
    assert isinstance(handle, Staged) and ready_event(handle) is None
    for key, b in zip(keys, blocks):
        assert np.array_equal(b.numpy(), store.block(*key))
    direct = transport.submit([(store.block(0, 1), blocks[0])])
    assert not isinstance(direct, Staged) and np.array_equal(blocks[0].numpy(), store.block(0, 1))
    transport.close()


def _staged_tier(*, experts: int, slots: int, seed: int) -> tuple[HostExpertStore, HybridExperts]:
    """A CPU tier (streaming from 8 tokens) whose transport runs the staging ring's code path."""
    store = HostExpertStore.synthetic(layers=3, num_experts=experts, hidden=64, intermediate=32, codec="int4",
                                      group=32, weight_std=0.2, seed=seed)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=slots, top_k=2, stream_threshold=8, stream_on_cpu=True))
    hybrid.transport = Transport(store, CPU, staged=True, copy_threads=2)
    return store, hybrid


def _run_against_reference(store, hybrid, calls, gen) -> None:
    for layer, tokens in calls:
        x = torch.randn(tokens, 64, generator=gen)
        ids, w = random_routing(gen, tokens, store.num_experts, 2)
        torch.testing.assert_close(hybrid(layer, x, ids, w), reference(store, ExpertSpec(), layer, x, ids, w),
                                   rtol=1e-4, atol=1e-5)


def test_beside_the_rings_thread_the_host_driven_kernel_leaves_it_a_core(monkeypatch):
    """A pageable store's host-driven call runs its misses while the ring's thread copies promotions: the kernel
    takes every core but one (on every core, the copy stalled its parallel region: bench_kernel_beside_copy.py);
    without a ring it keeps its default, and a user's thread count is kept as given."""
    import os

    store, hybrid = _staged_tier(experts=6, slots=0, seed=3)         # (no slots: every call runs on the CPU)
    seen = []
    real = hybrid.cpu.run
    monkeypatch.setattr(hybrid.cpu, "run", lambda *a, **kw: seen.append(kw.get("threads")) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    _run_against_reference(store, hybrid, [(layer, 1) for layer in (0, 1, 2, 0)], gen)
    assert seen and set(seen) == {max(1, (os.cpu_count() or 1) - 1)}
    hybrid.transport.close()
    hybrid.transport = Transport(store, CPU)                    # no ring: the executor's own default
    seen.clear()
    _run_against_reference(store, hybrid, [(layer, 1) for layer in (1, 2)], gen)
    assert seen and set(seen) == {None}
    hybrid.transport = Transport(store, CPU, staged=True, copy_threads=2)
    hybrid.cpu.threads = 1                                      # the user's count
    seen.clear()
    _run_against_reference(store, hybrid, [(layer, 1) for layer in (0, 2)], gen)
    assert seen and set(seen) == {None}
    hybrid.transport.close()


def test_prefill_streaming_through_the_ring_matches_the_reference():
    """The hybrid tier's streamed layers (both buffers, wrapping, repeating) through the staging ring's threads."""
    store, hybrid = _staged_tier(experts=4, slots=2, seed=4)
    calls = [(layer, 9) for layer in (0, 1, 2, 0, 0, 2, 1)]
    _run_against_reference(store, hybrid, calls, torch.Generator().manual_seed(5))
    assert hybrid.counters.total.stream_calls == 7
    staged = hybrid.stats_dict()["staging"]     # every streamed layer went through the ring, counted there
    assert staged["layers"] >= 7 and staged["bytes"] == staged["layers"] * store.layer_buffer(0).nbytes
    assert staged["caller_wait_s"] >= 0
    hybrid.transport.close()


def test_prefill_streaming_under_the_engines_inference_mode():
    """The engine runs its forward under torch.inference_mode, so the stream buffers are inference tensors; the
    ring's own thread (where inference mode is off) must still write into them (s25c: the mapped store's first GPU
    row stopped at 'Inplace update to inference tensor outside InferenceMode')."""
    store, hybrid = _staged_tier(experts=4, slots=2, seed=9)
    with torch.inference_mode():
        _run_against_reference(store, hybrid, [(layer, 9) for layer in (0, 1, 2, 0)],
                               torch.Generator().manual_seed(10))
    assert hybrid.counters.total.stream_calls == 4
    hybrid.transport.close()


def test_decode_promotions_after_a_streamed_prefill_share_the_ring():
    """A prompt streamed (the last layer stages the first one ahead), then decode calls whose promotions copy blocks
    through the same ring's entries: every output matches the reference and the promoted blocks are the store's."""
    store, hybrid = _staged_tier(experts=6, slots=5, seed=6)
    calls = [(layer, 12) for layer in (0, 1, 2)] + [(step % 3, 2) for step in range(12)]
    _run_against_reference(store, hybrid, calls, torch.Generator().manual_seed(8))
    hybrid._finish_promotions()
    c = hybrid.counters.total
    assert c.stream_calls == 3 and c.promoted_experts > 0
    layer_bytes = store.num_experts * store.block_nbytes       # four layers staged: 0, 1, 2 and 0 again ahead
    moved = c.promoted_experts + c.fetched_experts                # promotions and fetched misses: block by block
    assert hybrid.transport.bytes_copied == 4 * layer_bytes + moved * store.block_nbytes
    for (layer, e), slot in hybrid.cache.directory.slot_of.items():
        if (layer, e) in hybrid.cache.published:
            assert np.array_equal(hybrid.cache.pool[slot].numpy(), store.block(layer, e)), (layer, e)
    hybrid.transport.close()


def test_decode_promotions_from_a_pageable_store_leave_the_decoding_thread_at_once():
    """A promotion's host copy runs on the ring's thread, not the decoding thread (s25d: decode from a mapped store
    at 6.8 tok/s with them copied inline): with the ring's thread held, decode calls that promote still return
    their (exact) outputs; the promoted experts become hits only once the ring has moved them."""
    store = HostExpertStore.synthetic(layers=2, num_experts=8, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2, seed=12)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=4, top_k=2, split="cpu", fill_pool=False))
    hybrid.transport = Transport(store, CPU, staged=True, copy_threads=2)
    hold = threading.Event()
    hybrid.transport.ring._stager.submit(hold.wait)          # the ring's thread busy until released
    try:
        gen = torch.Generator().manual_seed(13)
        _run_against_reference(store, hybrid, [(0, 1), (1, 1), (0, 1)], gen)
        promoted = hybrid.counters.total.promoted_experts
        assert promoted > 0 and hybrid.cache.pending and not hybrid.cache.published
    finally:
        hold.set()                                           # (a failed assert must not leave the thread held)
    hybrid.transport.ring.drain()
    hybrid._finish_promotions()
    assert len(hybrid.cache.published) == promoted and not hybrid.cache.pending
    for (layer, e), slot in hybrid.cache.directory.slot_of.items():
        assert np.array_equal(hybrid.cache.pool[slot].numpy(), store.block(layer, e)), (layer, e)
    hybrid.transport.close()


def test_a_promotion_that_fails_on_the_rings_thread_is_dropped_once_and_decode_goes_on(caplog):
    """A promotion staged on the ring's thread that fails there is dropped with a warning: its slot is free again,
    the expert stays a miss (computed from host memory, exactly), and later calls do not raise its error again."""
    store = HostExpertStore.synthetic(layers=2, num_experts=8, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2, seed=16)
    hybrid = HybridExperts(store, ExpertSpec(), device=CPU, dtype=torch.float32,
                           options=HybridOptions(slots=4, top_k=2, split="cpu", fill_pool=False))
    hybrid.transport = Transport(store, CPU, staged=True, copy_threads=1)
    ring = hybrid.transport.ring
    real = ring._stage_blocks

    def failing(*args):
        raise RuntimeError("DMA failed")
    ring._stage_blocks = failing
    gen = torch.Generator().manual_seed(17)
    with caplog.at_level("WARNING", logger="runtime.experts.hybrid"):
        # each call promotes; the next one finds the last one's promotions failed - and still answers exactly
        _run_against_reference(store, hybrid, [(0, 1), (1, 1), (0, 1)], gen)
        for future in list(ring._pending):
            concurrent.futures.wait([future])
        hybrid._finish_promotions()
    started = hybrid.counters.total.promoted_experts
    assert started > 0 and caplog.text.count("into VRAM failed (DMA failed)") == started    # once each
    assert not hybrid.cache.pending and not hybrid.cache.published and not hybrid.cache.directory.slot_of
    ring.drain = lambda: None                                # (the failed futures must not raise at close)
    ring._stage_blocks = real                                 # the ring works again: promotions land
    _run_against_reference(store, hybrid, [(1, 1), (0, 1), (1, 1)], gen)
    ring.__class__.drain(ring)
    hybrid._finish_promotions()
    assert hybrid.cache.published
    for (layer, e), slot in hybrid.cache.directory.slot_of.items():
        if (layer, e) in hybrid.cache.published:
            assert np.array_equal(hybrid.cache.pool[slot].numpy(), store.block(layer, e)), (layer, e)
    hybrid.transport.close()


def test_staged_layers_on_cuda_wait_for_the_compute_that_reads_their_buffer(device):
    """On the GPU machine: a pageable store is staged (auto); layers go into two device buffers whose reader (a
    slow kernel on the compute stream) still holds them, and the ring's slots are refilled meanwhile; each
    buffer, read after its layer's event, holds that layer."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    store = HostExpertStore.synthetic(layers=6, num_experts=8, hidden=256, intermediate=128, codec="int4",
                                      group=32, pin=False)
    transport = Transport(store, dev, copy_threads=4)
    assert not transport.pinned and transport.ring is not None and transport.ring.buf.is_pinned()
    bufs = torch.empty((2, store.num_experts, store.block_nbytes), dtype=torch.uint8, device=dev)
    free = [None, None]
    compute = torch.cuda.current_stream(dev)
    for round_ in range(3):
        for layer in store.layers:
            b = layer % 2
            staged = transport.submit_range(store.layer_buffer(layer), bufs[b], after=free[b])
            compute.wait_event(ready_event(staged))
            torch.cuda._sleep(2_000_000)                # the layer's "compute": holds the buffer ~1 ms
            got = bufs[b].cpu()                         # on the compute stream, after the event
            assert torch.equal(got, torch.from_numpy(store.layer_buffer(layer))), (round_, layer)
            free[b] = compute.record_event()
    transport.close()


def test_prefill_from_a_pageable_store_on_cuda_matches_the_pinned_store(device):
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    outs = {}
    for pin in (True, False):
        store = HostExpertStore.synthetic(layers=3, num_experts=8, hidden=256, intermediate=128, codec="int4",
                                          group=32, weight_std=0.2, seed=7, pin=pin)
        hybrid = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16,
                               options=HybridOptions(slots=4, top_k=2, stream_threshold=16, zero_copy=False))
        assert (hybrid.transport.ring is None) == pin
        g = torch.Generator().manual_seed(6)
        outs[pin] = []
        for layer in (0, 1, 2, 1, 0):
            x = torch.randn(64, 256, generator=g).to(dev, torch.bfloat16)
            ids, w = random_routing(g, 64, 8, 2)
            with torch.inference_mode():                 # as the engine runs it
                outs[pin].append(hybrid(layer, x, ids.to(dev), w.to(dev)).float().cpu())
        assert hybrid.counters.total.stream_calls == 5
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_split_stream_on_cuda_matches_the_reference(device, pin, zero_copy):
    """On the GPU machine: mid-size chunks whose layers stream a prefix of their experts while the CPU computes the
    rest (FREETOKEN_STREAM_SPLIT's path; every prefix from none to all, staged ones included), from a pinned and a
    pageable store, beside the zero-copy worker or not, give the reference's outputs in bf16 as closely as the
    unsplit stream does, and the CPU took part."""
    import itertools

    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    store = HostExpertStore.synthetic(layers=3, num_experts=16, hidden=256, intermediate=128, codec="int4",
                                      group=32, weight_std=0.2, seed=7, pin=pin)
    errors = {}
    for split in (False, True):
        hybrid = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16,
                               options=HybridOptions(slots=4, top_k=2, stream_threshold=16, zero_copy=zero_copy,
                                                     stream_split=split))
        prefixes = itertools.cycle([5, 16, 1, 9, 0, 12])
        if split:
            hybrid._stream_prefix = lambda t: next(prefixes)        # noqa: E731
        g = torch.Generator().manual_seed(6)
        errors[split] = []
        for layer in (0, 1, 2, 1, 0, 2):
            x = torch.randn(40, 256, generator=g)
            ids, w = random_routing(g, 40, 16, 2)
            with torch.inference_mode():                 # as the engine runs it
                got = hybrid(layer, x.to(dev, torch.bfloat16), ids.to(dev), w.to(dev)).float().cpu()
            want = reference(store, ExpertSpec(), layer, x.to(torch.bfloat16).float(), ids, w)
            errors[split].append(float((got - want).norm() / want.norm()))
        c = hybrid.counters.total
        assert c.stream_calls == 6 and (c.cpu_experts > 0) == split
        hybrid.close()
        hybrid.transport.close()
    assert max(errors[True]) < 2e-2 and max(errors[True]) < 2 * max(errors[False]) + 1e-3, errors


@pytest.mark.parametrize("split", ["cpu", "fetch"])
def test_decode_from_a_pageable_store_on_cuda_matches_the_reference(device, split):
    """On the GPU machine: host-driven decode over a pageable store - promotions (split "cpu") or fetches (split
    "fetch") staged on the ring's thread under the engine's inference mode - gives the reference's outputs, and
    every block that became a hit holds the store's bytes."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    store = HostExpertStore.synthetic(layers=3, num_experts=8, hidden=256, intermediate=128, codec="int4",
                                      group=32, weight_std=0.2, seed=14, pin=False)
    hybrid = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.float32,
                           options=HybridOptions(slots=5, top_k=2, zero_copy=False, split=split))
    assert hybrid.transport.ring is not None
    g = torch.Generator().manual_seed(15)
    with torch.inference_mode():
        for step in range(24):
            layer = step % 3
            x = torch.randn(1, 256, generator=g)
            ids, w = random_routing(g, 1, 8, 2)
            got = hybrid(layer, x.to(dev), ids.to(dev), w.to(dev)).cpu()
            torch.testing.assert_close(got, reference(store, ExpertSpec(), layer, x, ids, w), rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    hybrid.transport.ring.drain()
    hybrid._finish_promotions()
    c = hybrid.counters.total
    assert (c.promoted_experts if split == "cpu" else c.fetched_experts) > 0
    for (layer, e), slot in hybrid.cache.directory.slot_of.items():
        if (layer, e) in hybrid.cache.published:
            assert np.array_equal(hybrid.cache.pool[slot].cpu().numpy(), store.block(layer, e)), (layer, e)
    hybrid.transport.close()
