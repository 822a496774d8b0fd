"""Zero-copy hybrid decode (issue 10): the GPU computes every expert of a decode call itself, hits from the VRAM
pool and misses in place from page-locked host memory, so a decode step needs no host decision per layer and is
recorded as one CUDA graph; the host keeps its books between steps from a device log of the step's routing.

On CI's CPU the same code runs with the torch pool kernels and a CPU "pool" (the zero-copy pass reads the host
store's layer blocks directly); `--device cuda` runs the Triton kernels over really page-locked memory, inside
recorded graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.experts.host_store import HostExpertStore
from runtime.experts.hybrid import HybridExperts, HybridOptions
from runtime.experts.interface import ExpertSpec, expert_forward
from runtime.experts.slot_cache import SlotCache
from runtime.experts.policy import LRUPolicy, SlotDirectory
from tests.engine_fixtures import ftw_packages, random_prompt, teacher_forced_sampling  # noqa: F401  (fixture)


def _reference(store, layer, x, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            weights = store.dequantize(layer, int(ids[t, k]))
            out[t] += float(w[t, k]) * expert_forward(ExpertSpec(), weights, x[t:t + 1].float().cpu())[0]
    return out


def _tier(device, *, slots, layers=3, experts=8, top_k=2, hot=(), pin=False, **options):
    store = HostExpertStore.synthetic(layers=layers, num_experts=experts, hidden=64, intermediate=64, codec="int4",
                                      weight_std=0.2, seed=4, pin=pin)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return store, HybridExperts(store, ExpertSpec(), device=device, dtype=dtype, options=HybridOptions(
        slots=slots, top_k=top_k, hot_set=tuple(hot), zero_copy=True if device.type == "cpu" else None,
        **options))


def _recorded_call(tier, x, ids, w):
    """A layer-0 zero-copy call recorded as a CUDA graph (run once eagerly on a side stream first, as
    decode_graph does): (its output buffer, the graph)."""
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(tier._zero_copy_decode(0, x, ids, w))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(tier._zero_copy_decode(0, x, ids, w))
    return out, g


def test_miss_table_is_the_complement_of_the_slot_table():
    """Every table write keeps miss_table[l, e] == (e if not published else -1), on the host mirror's terms."""
    cache = SlotCache(directory=SlotDirectory(4, LRUPolicy()), layers=[3, 5], num_experts=6, block_nbytes=8,
                      device=torch.device("cpu"), miss_table=True)
    rng = np.random.default_rng(0)
    for _ in range(40):
        keys = [(int(rng.choice([3, 5])), int(rng.integers(6))) for _ in range(int(rng.integers(1, 4)))]
        keys = list(dict.fromkeys(keys))
        if rng.random() < 0.5:
            cache.publish_many(keys, [int(rng.integers(4)) for _ in keys])
        else:
            cache.withdraw_many(keys)
        want = np.where(cache.host_table >= 0, -1, np.arange(6)[None, :])
        assert np.array_equal(cache.miss_table.numpy(), want)
        assert np.array_equal(cache.table.numpy(), cache.host_table)


@pytest.mark.parametrize("share,gather", [(0.0, True), (0.5, True), (0.0, False)])
def test_zero_copy_decode_is_exact_and_keeps_its_books_between_steps(share, gather):
    """Results equal the dequantized reference through misses, hits and promotions, with the CPU worker taking
    its share of misses through the mailbox or not; the step log gives the same hit/miss counts as the host
    path's definition (distinct experts per layer call against the table the step ran with) and the same CPU
    count as the handoff's rule (the first round(n_miss * share) misses); promoted experts become hits in later
    steps; the tier says it may be recorded in graphs only on CUDA."""
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=6, hot=[(0, 0), (0, 1)], promote_bytes_per_step=1 << 20, cpu_share=share,
                        zero_copy_gather=gather)
    assert (tier._worker is not None) == (share > 0) and tier.cpu_share == share
    assert (tier._scratch is not None) == gather
    want_cpu = 0
    assert tier.zero_copy and not tier.graph_safe(0)
    tier.cuda = True
    assert tier.graph_safe(0) and tier.graph_safe(2)
    tier.cuda = False
    gen = torch.Generator().manual_seed(3)
    want_hits = want_misses = promoted_hits = 0
    pinned = {(0, 0), (0, 1)}
    for step in range(12):
        for layer in range(3):
            x = torch.randn(1, 64, generator=gen)
            ids = torch.randperm(8, generator=gen)[:2][None] if step % 3 else torch.tensor([[0, 1]])
            w = torch.softmax(torch.randn(1, 2, generator=gen), dim=-1)
            got = tier(layer, x, ids, w)          # called eagerly: layer 0's call is the step boundary
            torch.testing.assert_close(got, _reference(store, layer, x, ids, w), rtol=1e-4, atol=1e-5)
            if layer == 0:
                table = tier._snapshot.copy()     # the table this step runs against (noted at its boundary)
            hit = table[layer, ids[0].numpy()] >= 0
            promoted_hits += sum(1 for e, h in zip(ids[0].tolist(), hit) if h and (layer, e) not in pinned)
            want_hits += int(hit.sum())
            want_misses += int((~hit).sum())
            want_cpu += int(int((~hit).sum()) * share + 0.5)
    tier.begin_step()                             # the last step's log goes to the host...
    tier.flush_step_log()                         # ...and is accounted
    c = tier.counters.total
    assert (c.hits, c.misses) == (want_hits, want_misses)
    assert (c.cpu_experts, c.fetched_experts) == (want_cpu, want_misses - want_cpu)
    if share:
        assert tier._worker.served > 0 and tier._worker.error is None
        tier.close()
        assert tier.cpu_share == 0.0 and not tier._worker
    assert c.promoted_experts > 0                                   # misses were copied into free slots
    assert promoted_hits > 0                                        # ...published, then hits in later steps


class _SlowCopy:
    """A log copy's event that has not landed until `landed` is set (a GPU still busy with the step before)."""

    landed = False

    def query(self) -> bool:
        return _SlowCopy.landed

    def synchronize(self) -> None:
        _SlowCopy.landed = True


def test_every_steps_routing_is_accounted_once_though_its_log_copy_lands_late(monkeypatch):
    """A step's routing log goes to the host at the next step's start, and is accounted once that copy lands. When
    copies land late, later steps must not write over a log not yet copied: a batch of two, then ones, counts every
    step's rows exactly once (before: the next step wrote over the first's row 0 and its row 1 was counted in a
    later step), in step order, and a host LOG_COPIES steps ahead waits for the oldest copy."""
    from runtime.experts.hybrid import LOG_COPIES

    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=0, cpu_share=0.0)
    monkeypatch.setattr(_SlowCopy, "landed", False)
    tier._log_event = _SlowCopy
    gen = torch.Generator().manual_seed(5)
    batches = [2, 1, 1]                                     # under LOG_COPIES steps: nothing waits
    distinct = 0
    for t in batches:
        for layer in range(3):
            ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(t)])
            w = torch.softmax(torch.randn(t, 2, generator=gen), dim=-1)
            tier(layer, torch.randn(t, 64, generator=gen), ids, w)
            distinct += len(torch.unique(ids))
    assert tier.counters.total.tokens == 0                  # no copy has landed: nothing accounted yet
    tier.begin_step()                                       # the last step's log leaves too
    assert len(tier._log_copies) == len(batches) + 1 <= LOG_COPIES
    tier.flush_step_log()
    c = tier.counters.total
    assert c.tokens == 3 * sum(batches)                     # every step's rows, each once (before: 3 x 2)
    assert c.hits + c.misses == distinct and c.decode_calls == 3 * len(batches)
    # a host further ahead than the ring: the oldest copy is waited for, so no step's log is lost either
    before = c.tokens
    monkeypatch.setattr(_SlowCopy, "landed", False)
    for _ in range(LOG_COPIES + 2):
        ids = torch.randperm(8, generator=gen)[:2][None]
        tier(0, torch.randn(1, 64, generator=gen), ids, torch.full((1, 2), 0.5))
        assert len(tier._log_copies) <= LOG_COPIES
    tier.begin_step()
    tier.flush_step_log()
    assert tier.counters.total.tokens == before + LOG_COPIES + 2


def test_zero_copy_with_no_slots_reads_every_expert_from_host_memory():
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=0, cpu_share=0.0)
    x = torch.randn(2, 64)
    ids = torch.tensor([[1, 4], [4, 7]])
    w = torch.full((2, 2), 0.5)
    torch.testing.assert_close(tier(1, x, ids, w), _reference(store, 1, x, ids, w), rtol=1e-4, atol=1e-5)
    tier.begin_step()
    tier.flush_step_log()
    assert tier.counters.total.misses == 3 and tier.counters.total.hits == 0


def test_zero_copy_is_off_when_asked_or_for_many_tokens():
    cpu = torch.device("cpu")
    store = HostExpertStore.synthetic(layers=1, num_experts=8, hidden=64, intermediate=64, codec="int4")
    off = HybridExperts(store, ExpertSpec(), device=cpu, dtype=torch.float32,
                        options=HybridOptions(slots=4, top_k=2, split="cpu"))
    assert not off.zero_copy and off.cache.miss_table is None
    _, on = _tier(cpu, slots=4, layers=1)
    x, w = torch.randn(9, 64), torch.full((9, 2), 0.5)
    ids = torch.randint(0, 8, (9, 2))
    ids[:, 1] = (ids[:, 0] + 1) % 8
    on(0, x, ids, w)                                                 # 9 tokens: the host-driven path
    assert on.counters.total.decode_calls == 1


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_a_store_pinned_in_part_decodes_zero_copy_on_cuda(device, share):
    """On the GPU machine: a store whose middle layer the OS would not page-lock decodes through zero-copy calls
    (recordable), that layer's misses all on the CPU worker, the others' shared as usual; results match the
    reference over steps with promotions from both kinds of layer (the unpinned one's through the staging ring)."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    pageable = HostExpertStore.synthetic(layers=3, num_experts=8, hidden=64, intermediate=64, codec="int4",
                                         weight_std=0.2, seed=4)
    store = pageable.pinned_copy(pin=True, layers=[0, 2])
    assert store.pinned_layers == frozenset({0, 2})
    tier = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16, options=HybridOptions(
        slots=6, top_k=2, hot_set=((0, 0), (1, 1)), cpu_share=share, promote_bytes_per_step=1 << 20))
    assert tier.zero_copy and tier.graph_safe(1) and tier._host_only == [1] and tier.transport.ring is not None
    assert tier._worker is not None
    gen = torch.Generator().manual_seed(8)
    for step in range(6):
        for layer in range(3):
            x = torch.randn(1, 64, generator=gen).to(dev, torch.bfloat16)
            ids = torch.randperm(8, generator=gen)[:2][None].to(dev)
            w = torch.full((1, 2), 0.5, device=dev)
            got = tier(layer, x, ids, w)
            want = _reference(store, layer, x.float().cpu(), ids.cpu(), w.cpu())
            torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=3e-2)
    torch.cuda.synchronize()
    tier.begin_step()
    tier.flush_step_log()
    c = tier.counters.total
    assert c.promoted_experts > 0 and c.cpu_experts > 0 and tier._worker.error is None
    for (layer, e), slot in tier.cache.directory.slot_of.items():       # promoted bytes, ring or direct, exact
        if tier.cache.is_ready((layer, e)):
            assert np.array_equal(tier.cache.pool[slot].cpu().numpy(), store.block(layer, e))
    tier.close()


@pytest.mark.parametrize("share,gather", [(0.0, True), (0.5, True), (0.0, False), (0.5, False)])
def test_zero_copy_graph_step_on_cuda_matches_eager(device, share, gather):
    """On the GPU machine: the Triton kernels read misses from page-locked host memory inside a recorded graph
    (with the CPU worker answering its share through the mailbox, or not); replays with changed routing and a
    promotion published between steps give the reference's results."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    store, tier = _tier(dev, slots=6, hot=[(0, 0), (1, 1)], pin=True, cpu_share=share, zero_copy_gather=gather)
    assert (tier._worker is not None) == (share > 0)
    assert tier.zero_copy and tier.graph_safe(0)
    x = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3]], device=dev)
    w = torch.full((1, 2), 0.5, device=dev)
    out, g = _recorded_call(tier, x, ids, w)
    for step in range(6):
        ids.copy_(torch.tensor([[step % 8, (step + 3) % 8]]))
        tier.begin_step()
        g.replay()
        tier.end_step()
        torch.cuda.synchronize()
        want = _reference(store, 0, x.float().cpu(), ids.cpu(), w.cpu())
        torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)
    tier.flush_step_log()
    assert tier.counters.total.misses > 0 and tier.counters.total.hits > 0


@pytest.mark.parametrize("share,slots,collect_warps", [(0.0, 6, 4), (0.5, 6, 4), (0.5, 0, 4), (0.5, 6, 0)])
def test_hits_beside_and_the_gather_in_two_give_the_same_bits_as_one_stream(device, share, slots, collect_warps):
    """On the GPU machine: the hits' pool kernels on a side stream (beside the misses' gather), and the misses'
    blocks gathered in two parts with their gate/up kernel on the side stream beside the second part's copy, are
    branches of the recorded graph that give the very bits of everything on one stream, replay after replay; the
    side stream exists only for them, and the two-part gather splits at the block's down part. Every answer of the
    CPU came (no error flag), with collect polling from one thread a token or from every warp."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    from runtime.kernels.int4_pool_triton import down_offset
    dev = torch.device("cuda")
    runs = []
    for beside, split in ((True, True), (True, False), (False, True), (False, False)):
        _, tier = _tier(dev, slots=slots, hot=[(0, 0), (0, 3), (1, 1)][:slots], pin=True, cpu_share=share,
                        hits_beside=beside, split_gather=split, collect_warps=collect_warps)
        assert (tier._side_stream is not None) == (beside or split)
        assert tier._split_at == (down_offset(tier.layout) if split else 0) and (tier._split_at > 0) == split
        x = torch.randn(1, 64, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(3))
        ids = torch.tensor([[0, 5]], device=dev)
        w = torch.full((1, 2), 0.5, device=dev)
        out, g = _recorded_call(tier, x, ids, w)
        outs = []
        for step in range(6):
            ids.copy_(torch.tensor([[(3 * step) % 8, (step + 5) % 8]]))      # hits (0, 3), misses, or both
            g.replay()
            torch.cuda.synchronize()
            outs.append(out.clone())
        outs.append(tier._zero_copy_decode(0, x, ids, w))                   # eagerly too
        torch.cuda.synchronize()
        assert share == 0 or int(tier._box.error[0]) == 0, (beside, split, "an answer of the CPU never came")
        runs.append(torch.stack(outs))
        del g, tier
    for j, other in enumerate(runs[1:]):
        assert torch.equal(runs[0], other), (j + 1, float((runs[0].float() - other.float()).abs().max()),
                                             (runs[0] != other).nonzero()[:6].tolist())


def test_the_cuda_handoff_gives_the_cpu_nothing_once_the_error_flag_is_up(device):
    """On the GPU machine: the Triton handoff reads the error flag (a worker that missed an answer): no request, so
    `collect` does not wait, and the GPU's own path computes every miss exactly."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    dev = torch.device("cuda")
    store, tier = _tier(dev, slots=0, pin=True, cpu_share=1.0)
    tickets = int(tier._box.ticket[0])                 # requests sent so far (the load's probe sent one)
    assert bool((tier._log == -1).all())              # the probe's ids are no step's routing
    tier._box.error.fill_(1)
    x = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
    ids, w = torch.tensor([[2, 5]], device=dev), torch.full((1, 2), 0.5, device=dev)
    got = tier._zero_copy_forward(0, x, ids, w)
    torch.cuda.synchronize()
    assert tier._log[0, 0].tolist() == [2, 5] and bool((tier._log[0, 1:] == -1).all())   # the handoff logged it
    assert int(tier._box.ncpu[0]) == 0 and int(tier._box.ticket[0]) == tickets    # no request this time
    want = _reference(store, 0, x.float().cpu(), ids.cpu(), w.cpu())
    torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=3e-2)


def test_free_slots_are_filled_at_load_hot_first_then_evenly_over_layers():
    """A pool starts full: the pinned hot set, then the experts earlier runs' routing ranks next, then expert j of
    every layer before expert j + 1; every filled slot holds its expert's bytes and is a hit."""
    from runtime.experts.policy import RoutingStats

    store = HostExpertStore.synthetic(layers=3, num_experts=8, hidden=64, intermediate=64, codec="int4", seed=5)
    stats = RoutingStats({(2, 7): 50, (1, 6): 40, (0, 0): 30})
    tier = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32, routing_stats=stats,
                         options=HybridOptions(slots=7, top_k=2, hot_set=((0, 0),), fill_pool=True))
    published = tier.cache.published
    assert published == {(0, 0), (2, 7), (1, 6), (1, 0), (2, 0), (0, 1), (1, 1)}
    for (layer, e), slot in tier.cache.directory.slot_of.items():
        assert np.array_equal(tier.cache.pool[slot].numpy(), store.block(layer, e))
    assert tier.cache.directory.pinned == {(0, 0)}


def test_a_failing_cpu_worker_answers_with_zeros_and_hands_its_share_back():
    """The GPU is waiting for every answer: a worker exception still answers (zeros, so that step is wrong), is
    reported, and from the next step the GPU reads every miss itself; a worker that never answers trips the
    bounded wait, and the next step boundary raises a clear error instead of hanging."""
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=0, cpu_share=1.0)
    tier._worker.compute = lambda *a: (_ for _ in ()).throw(MemoryError("no RAM for the CPU experts"))
    x, ids, w = torch.randn(1, 64), torch.tensor([[2, 5]]), torch.full((1, 2), 0.5)
    got = tier(0, x, ids, w)
    assert torch.count_nonzero(got) == 0                           # the answer was zeros
    assert isinstance(tier._worker.error, MemoryError)
    tier(0, x, ids, w)                                              # the boundary notices and turns the share off
    assert tier.cpu_share == 0.0 and tier._worker is None
    torch.testing.assert_close(tier(0, x, ids, w), _reference(store, 0, x, ids, w), rtol=1e-4, atol=1e-5)

    store, tier = _tier(cpu, slots=0, cpu_share=1.0)
    tier._worker.close()                                            # nobody answers
    from runtime.experts import cpu_share
    original = cpu_share.collect_reference
    try:
        import runtime.experts.hybrid as hybrid_mod
        hybrid_mod.collect_reference = lambda out, box, **kw: original(out, box, timeout_s=0.2, **kw)
        tier(0, x, ids, w)
    finally:
        hybrid_mod.collect_reference = original
    assert int(tier._box.error[0]) == 1
    with pytest.raises(RuntimeError, match="did not answer"):
        tier(0, x, ids, w)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_host_only_layers_give_every_miss_to_the_cpu_worker_whatever_the_share(share):
    """A store pinned in part (the pinnable share held only some layers): the GPU may not read the other layers'
    host memory, so the handoff gives all their misses to the CPU worker - a worker exists even at share 0, a learned
    share never reaches those layers - while the pinned layers keep the share. Results stay exact and the books
    count every miss of a host-only layer as the CPU's."""
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=4, hot=[(0, 0), (1, 1)], cpu_share=share, host_only_layers=(1,),
                        promote_bytes_per_step=1 << 20)
    assert tier.zero_copy and tier._worker is not None
    assert tier._box.share_host.tolist() == [share, 2.0, share]
    tier._box.set_share(0.25)                          # what a learned share does: the host-only layer keeps 2
    assert tier._box.share_host.tolist() == [0.25, 2.0, 0.25] and float(tier._box.share[1]) == 2.0
    tier._box.set_share(share)
    gen = torch.Generator().manual_seed(5)
    want_cpu = want_misses = want_host_only = 0
    for step in range(8):
        t = 3 if step % 2 else 1                       # (several tokens a call too: a few sequences decoding)
        for layer in range(3):
            x = torch.randn(t, 64, generator=gen)
            ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(t)])
            w = torch.softmax(torch.randn(t, 2, generator=gen), dim=-1)
            got = tier(layer, x, ids, w)
            torch.testing.assert_close(got, _reference(store, layer, x, ids, w), rtol=1e-4, atol=1e-5)
            if layer == 0:
                table = tier._snapshot.copy()
            uniq = np.unique(ids.numpy())             # (the books count distinct experts; the rule, assignments)
            want_misses += int((table[layer, uniq] < 0).sum())
            want_host_only += int((table[layer, uniq] < 0).sum()) if layer == 1 else 0
            missed = int((table[layer, ids.numpy().reshape(-1)] < 0).sum())
            want_cpu += len(uniq[table[layer, uniq] < 0]) if layer == 1 else \
                min(int((table[layer, uniq] < 0).sum()), int(missed * share + 0.5))
    tier.begin_step()
    tier.flush_step_log()
    c = tier.counters.total
    assert c.misses == want_misses and (c.cpu_experts, c.fetched_experts) == (want_cpu, want_misses - want_cpu)
    assert 0 < c.host_only_misses == want_host_only < c.misses     # (the bench's partial ceiling reads it)
    assert tier._worker.served > 0 and tier._worker.error is None
    assert tier.stats_dict()["zero_copy"]["host_only_layers"] == 1 and tier.plan()["layers"] == 3


def test_host_driven_calls_run_a_host_only_layers_misses_on_the_cpu():
    """Calls of more tokens than zero-copy takes go host-driven; there a store pinned in part fetches misses only
    from its pinned layers (a fetch from an unpinned one would wait for the ring's host copy, and the split learned
    on direct DMA would fetch too many): the host-only layer's misses all run on the CPU, results stay exact."""
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=6, cpu_share=0.0, host_only_layers=(1,), split="fetch", fill_pool=False)
    gen = torch.Generator().manual_seed(12)
    fetched = {0: 0, 1: 0, 2: 0}
    cpu_run = {0: 0, 1: 0, 2: 0}
    for step in range(4):
        for layer in range(3):
            x = torch.randn(6, 64, generator=gen)                 # 6 tokens: past ZERO_COPY_MAX_TOKENS
            ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)])
            w = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
            before = (tier.counters.total.fetched_experts, tier.counters.total.cpu_experts)
            torch.testing.assert_close(tier(layer, x, ids, w), _reference(store, layer, x, ids, w), rtol=1e-4,
                                       atol=1e-5)
            fetched[layer] += tier.counters.total.fetched_experts - before[0]
            cpu_run[layer] += tier.counters.total.cpu_experts - before[1]
    assert fetched[1] == 0 and cpu_run[1] > 0
    assert fetched[0] > 0 and fetched[2] > 0
    tier.close()


def test_without_its_worker_a_tier_with_host_only_layers_stops_with_a_clear_error():
    """The worker is the only reader of a host-only layer: once it fails, the GPU cannot take its misses back (as it
    does for a pinned store), so the next step boundary says so - reload the model - and every later call too,
    rather than answering with those layers' experts missing."""
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=0, cpu_share=0.0, host_only_layers=(0,))
    tier._worker.compute = lambda *a: (_ for _ in ()).throw(MemoryError("no RAM for the CPU experts"))
    x, ids, w = torch.randn(1, 64), torch.tensor([[2, 5]]), torch.full((1, 2), 0.5)
    tier(0, x, ids, w)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="GPU cannot read.*reload the model"):
            tier(0, x, ids, w)
    assert int(tier._box.error[0]) == 1            # (no request goes to the stopped worker)


def test_after_one_unanswered_call_the_rest_of_the_step_does_not_wait_for_the_worker():
    """A worker that stops answering mid-step costs one bounded wait, not one per layer (48 of them held a step for
    minutes): once the error flag is up the handoff gives the CPU nothing, so later layers of the same step skip the
    wait and are exact, the GPU reading every miss itself."""
    import time

    import runtime.experts.hybrid as hybrid_mod
    from runtime.experts import cpu_share
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=0, cpu_share=1.0)
    tier._worker.close()                                            # nobody answers
    x, ids, w = torch.randn(1, 64), torch.tensor([[2, 5]]), torch.full((1, 2), 0.5)
    original = cpu_share.collect_reference
    waits = []

    def timed(out, box, **kw):
        t0 = time.monotonic()
        try:
            return original(out, box, timeout_s=0.3, **kw)
        finally:
            waits.append(time.monotonic() - t0)
    try:
        hybrid_mod.collect_reference = timed
        tier(0, x, ids, w)                                          # layer 0: times out, raises the flag
        later = [tier(layer, x, ids, w) for layer in (1, 2)]        # same step: no wait, GPU path
    finally:
        hybrid_mod.collect_reference = original
    assert waits[0] >= 0.3 and max(waits[1:]) < 0.05
    assert int(tier._box.ncpu[0]) == 0
    for layer, got in zip((1, 2), later):
        torch.testing.assert_close(got, _reference(store, layer, x, ids, w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("best", [0.0, 0.8])
def test_share_controller_finds_the_fastest_share_from_step_times(best):
    """Hill-climbing over step times: where any CPU share slows the step (the H200's fast link) it stays at 0
    and pays little for its trials; where the link is slow beside RAM it climbs to the share that balances both
    sides; a pause between requests (a 50x step) is not taken for a sample."""
    from runtime.experts.policy import ShareController

    rng = np.random.default_rng(1)
    if best == 0.0:
        cost = lambda s: 0.02 * (1 + 0.5 * s)                          # noqa: E731
    else:
        cost = lambda s: 0.06 * max((1 - s) / 12, s / 35) * 35          # noqa: E731  laptop: 12 vs 35 GB/s
    ctl = ShareController()
    spent = []
    for step in range(1500):
        s = ctl.share
        spent.append(cost(s))
        ctl.observe(cost(s) * (1 + 0.02 * rng.random()) * (50 if step % 97 == 0 else 1))
    assert ctl.share == best
    assert np.mean(spent[-500:]) < 1.04 * cost(best)          # trials: one window in 17, at a neighbour


def test_a_learned_share_reaches_the_gpu_side_and_the_books():
    """The tier applies the controller's share at the step boundary (mailbox share, counted per step); a fresh
    controller starts at the bandwidth balance (the grid's nearest share to `_default_cpu_share`)."""
    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=2, cpu_share=None)
    balance = tier._default_cpu_share()
    assert 0.35 < balance < 0.45                       # 0.62 x 20 GB/s against 0.83 x 20 (the options' defaults)
    assert tier._share_control is not None and tier._worker is not None and tier.cpu_share == 0.4
    tier._share_control.observe = lambda dt: 1.0
    x, w = torch.randn(1, 64), torch.full((1, 2), 0.5)
    ids = torch.tensor([[3, 6]])
    for _ in range(3):
        torch.testing.assert_close(tier(0, x, ids, w), _reference(store, 0, x, ids, w), rtol=1e-4, atol=1e-5)
    assert tier.cpu_share == 1.0 and float(tier._box.share[0]) == 1.0 and tier._worker.served >= 1
    tier.begin_step()
    tier.flush_step_log()
    assert tier.counters.total.cpu_experts >= 2
    tier.close()


def test_the_share_controller_never_times_a_step_across_a_prefill():
    """The learned share feeds on the time from one zero-copy step to the next. Another user's prompt prefilling
    between two of a conversation's tokens (a host-driven or streamed call) would make that interval look like a
    slow step, during a trial too (where no outlier is dropped): such an interval is not observed."""
    cpu = torch.device("cpu")
    _, tier = _tier(cpu, slots=2, layers=1, cpu_share=None)
    seen = []
    tier._share_control.observe = lambda dt: seen.append(dt) or tier.cpu_share
    one = (torch.randn(1, 64), torch.tensor([[3, 6]]), torch.full((1, 2), 0.5))
    many = torch.randn(9, 64), torch.randint(0, 8, (9, 2)), torch.full((9, 2), 0.5)
    many[1][:, 1] = (many[1][:, 0] + 1) % 8
    tier(0, *one)                      # the first step: nothing before it to time
    tier(0, *one)                      # timed
    assert len(seen) == 1
    tier(0, *many)                     # 9 tokens: a prompt's chunk on the host-driven path
    tier(0, *one)                      # not timed: the interval holds the prefill
    tier(0, *one)                      # timed again
    assert len(seen) == 2
    tier.close()


def test_an_unloaded_tier_stops_its_worker_and_is_freed():
    """The service unloads a model by dropping the engine: the CPU worker must not keep the tier (its pinned
    experts, its VRAM pool) alive, and its thread ends."""
    import gc
    import weakref

    cpu = torch.device("cpu")
    _, tier = _tier(cpu, slots=2, cpu_share=0.5)
    thread, gone = tier._worker._thread, weakref.ref(tier)
    assert thread.is_alive()
    del tier
    gc.collect()
    assert gone() is None
    thread.join(timeout=3.0)
    assert not thread.is_alive()


@pytest.mark.parametrize("graphs", [False, True])
def test_the_engine_generates_the_same_tokens_through_zero_copy_decode(ftw_packages, graphs):
    """End to end on CI's CPU: prefill through the host-driven path, decode through zero-copy with the CPU worker
    taking half the misses (eagerly, or through decode_graph's static step run eagerly), greedy tokens equal to
    every expert resident; the books were kept (hits, CPU and in-place experts counted)."""
    import functools

    from runtime.engine import Engine, SamplingParams
    from runtime.experts.hybrid import hybrid_experts_factory
    from runtime.experts.planner import Hardware

    path = ftw_packages("qwen3_moe", "int4")
    prompt = random_prompt(12, seed=7)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    want = Engine.load(path, device="cpu").generate(prompt, sampling).tokens
    hw = Hardware(ram_total=16 << 30, ram_available=16 << 30, pinnable=8 << 30, cpu_gbps=10.0)
    factory = functools.partial(hybrid_experts_factory, hardware=hw, slots=6, zero_copy=True, cpu_share=0.5)
    eng = Engine.load(path, device="cpu", experts_factory=factory, cuda_graphs=graphs)
    got = eng.generate(prompt, sampling).tokens
    experts = eng.model.experts
    assert got == want and len(got) == 8
    assert experts.zero_copy and experts._worker is not None and experts._worker.served > 0
    experts.begin_step()
    experts.flush_step_log()
    c = experts.counters.total
    assert c.hits > 0 and c.cpu_experts > 0 and c.fetched_experts > 0
    experts.close()


def test_a_conversation_decodes_zero_copy_while_anothers_prompt_prefills(device, ftw_packages):
    """Two users: one conversation decoding zero-copy (graphs on) while another's prompt arrives, prefills in the
    same steps and ends in a step where both feed one token - the decode-graph path with one sequence still
    finishing its prompt. Session 33's GPU run of this case (bench_cold_load --beside) went silent for 165 s. Both
    requests finish without an error, in the steps the schedule says, the two then decode through batch-2 graphs,
    and on the CPU each gets the tokens it gets alone from resident experts. The CUDA run (--device cuda) records
    and replays, the prefix cache's arena locking ahead meanwhile; its CPU worker rounds to int8, so tokens are not
    compared there."""
    import functools
    import time

    from runtime.engine import Engine, SamplingParams
    from runtime.experts.hybrid import hybrid_experts_factory
    from runtime.experts.planner import Hardware

    path = ftw_packages("qwen3_moe", "int4")
    first, second = random_prompt(12, seed=7), random_prompt(16, seed=8)
    long_answer = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])
    short_answer = SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[])
    cuda = device == "cuda"
    hw = Hardware(ram_total=16 << 30, ram_available=16 << 30, pinnable=8 << 30, cpu_gbps=10.0,
                  **(dict(vram_free=8 << 30, vram_total=8 << 30, h2d_gbps=20.0, has_cuda=True) if cuda else {}))
    factory = functools.partial(hybrid_experts_factory, hardware=hw, slots=6, zero_copy=True, cpu_share=0.5)
    load = functools.partial(Engine.load, path, device=device, experts_factory=factory, cuda_graphs=True,
                             prefill_chunk=16, **(dict(cpu_experts_per_layer=1) if cuda else {}))
    eng = load()
    a = eng.add_request(first, long_answer)
    got: dict[str, list[int]] = {a: []}

    def step():
        for e in eng.step():
            assert e.request_id in got, e
            if e.token_id is not None:
                got[e.request_id].append(e.token_id)

    while len(got[a]) < 4:                               # a is decoding (its graph recorded)
        step()
    b = eng.add_request(second, short_answer)
    got[b] = []
    t0 = time.monotonic()
    step()                                               # a's token + 15 of b's 16 (the step's 16-token budget)
    assert got[b] == [] and len(got[a]) == 5
    graph_steps = eng.graphs.counters["steps"]
    step()                                               # a's token + b's last: one token each, batch 2
    assert len(got[b]) == 1 and len(got[a]) == 6
    assert eng.graphs.counters["steps"] == graph_steps   # eagerly: a prompt's tail records no graph (engine.py)
    while eng.scheduler.has_work():                      # then both decode: batch-2 graphs, recorded and replayed
        step()
        assert time.monotonic() - t0 < 120, "two conversations at once did not finish"
    assert eng.graphs.batch_steps.get(2, 0) >= 1
    results = {rid: eng.result(rid) for rid in (a, b)}
    assert all(r is not None and r.error is None for r in results.values()), results
    assert len(got[a]) == 12 and len(got[b]) == 3
    experts = eng.model.experts
    assert experts.zero_copy and experts._worker is not None and experts._worker.error is None
    if not cuda:                                         # exact on the CPU: each as it is alone, all resident
        ref = Engine.load(path, device="cpu")
        assert got[a] == ref.generate(first, long_answer).tokens
        assert got[b] == ref.generate(second, short_answer).tokens
    experts.close()


def test_a_plan_pinned_in_part_loads_and_decodes_zero_copy_on_cuda(device, ftw_packages, monkeypatch):
    """On the GPU machine, the load a Windows user gets whose model outgrows the pinnable half: a plan that pins
    the first MoE layer only (the tiny model has 2, fewer than the planner could split: its ring alone takes 2, so
    the plan is edited), the factory copies and page-locks just that layer and keeps the others mapped from the
    file, and the engine decodes zero-copy with the other layers' misses all on the CPU worker: greedy tokens equal
    to a fully pinned load's."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    import dataclasses
    import functools

    from runtime.engine import Engine, SamplingParams
    from runtime.experts import planner
    from runtime.experts.hybrid import hybrid_experts_factory

    path = ftw_packages("qwen3_moe", "int4")
    prompt = random_prompt(12, seed=7)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    hw = planner.Hardware(vram_free=8 << 30, vram_total=8 << 30, ram_total=16 << 30, ram_available=16 << 30,
                          pinnable=8 << 30, h2d_gbps=20.0, cpu_gbps=10.0, has_cuda=True)
    factory = functools.partial(hybrid_experts_factory, hardware=hw, slots=6, cpu_share=0.5)
    # (an expert a layer left to the CPU: a hybrid plan, not the all-in-VRAM one this tiny model would get)
    load = functools.partial(Engine.load, path, device="cuda", experts_factory=factory, cpu_experts_per_layer=1)
    # each step's logits recorded; the second load is fed the first one's tokens (teacher-forced). The loads place
    # experts differently (here more of the unpinned layer's in VRAM, the rest on the CPU alone), and the CPU
    # kernel rounds activations to int8 where the GPU keeps bf16: a near-tie between two random-weight logits may
    # then flip a greedy token, so logits are compared, within a bound
    steps, forced = teacher_forced_sampling(monkeypatch)
    whole = load()
    want = whole.generate(prompt, sampling).tokens
    reference, steps[:] = list(steps), []
    assert whole.model.experts.store.pinned_layers == frozenset(whole.model.experts.store.layers)
    whole.model.experts.close()
    real = planner.plan_memory
    monkeypatch.setattr(planner, "plan_memory", lambda *a, **k: dataclasses.replace(
        real(*a, **k), experts_pinned=False, experts_pinned_layers=1))
    eng = load()
    experts = eng.model.experts
    first, *rest = experts.store.layers                 # (MoE layers 0 and 2: indices 0 and 1)
    assert experts.store.pinned_layers == frozenset({first}) and experts._host_only == list(range(1, 1 + len(rest)))
    assert experts.plan()["pinned_layers"] == 1 and experts.plan()["layers"] == 1 + len(rest)
    assert experts.zero_copy and experts._worker is not None and experts.transport.ring is not None
    # most of the pool is pinned to the unpinned layers' experts (hybrid.costly_hot_set), loaded through the ring
    pinned = experts.cache.directory.pinned
    assert pinned and {layer for layer, _ in pinned} <= set(rest)
    forced.extend(chosen for _, chosen in reference)
    assert len(eng.generate(prompt, sampling).tokens) == len(want) == len(steps) == len(reference)
    scale = max(ref.abs().max().item() for ref, _ in reference)
    for (got, _), (ref, _) in zip(steps, reference):
        assert (got - ref).abs().max().item() <= 0.05 * scale        # a wrong expert or layer moves them by ~scale
    experts.begin_step()
    experts.flush_step_log()
    assert experts.counters.total.cpu_experts > 0 and experts._worker.error is None
    experts.close()


def test_the_compiled_worker_loop_answers_with_the_int8_kernels_result():
    """Real layer widths take the int8 kernel: the worker then serves requests in compiled code (no Python
    between a request and its answer) and answers exactly what the executor computes for the same misses."""
    cpu = torch.device("cpu")
    store = HostExpertStore.synthetic(layers=2, num_experts=6, hidden=512, intermediate=512, codec="int4",
                                      group=64, weight_std=0.05, seed=9)
    tier = HybridExperts(store, ExpertSpec(), device=cpu, dtype=torch.float32,
                         options=HybridOptions(slots=0, top_k=2, zero_copy=True, cpu_share=1.0))
    assert tier.cpu.int8 and tier._worker.int8_args is not None
    gen = torch.Generator().manual_seed(4)
    import time
    t0 = time.perf_counter()
    for step in range(4):
        layer = step % 2
        x = torch.randn(2, 512, generator=gen)
        ids = torch.tensor([[1, 4], [4, 5]]) if step % 2 else torch.tensor([[0, 3], [2, 0]])
        w = torch.softmax(torch.randn(2, 2, generator=gen), dim=-1)
        got = tier(layer, x, ids, w)
        tok, kk = np.nonzero(np.ones((2, 2), dtype=bool))
        want = tier.cpu.run(layer, x, tok, ids.numpy()[tok, kk], w.numpy()[tok, kk])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert tier._worker.kernel_requests == step + 1       # counted at the answer, not when the spin ends
    wall = time.perf_counter() - t0
    deadline = time.monotonic() + 5                 # the loop counts its requests when its spin ends
    while tier._worker.served < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier._worker.served == 4 and tier._worker.error is None
    # the cycle counter times the requests themselves (seen -> answered), not the waits between them
    if tier._worker.kernel_seconds is not None:
        assert 0 < tier._worker.kernel_seconds < wall
        # the kernel's marks come in its order (a thread may come in after others finished a stage), and its
        # whole call fits inside the request's time
        # (up to the cores' clock skew: with more than one lane each reads its own core's counter, ~0.3 µs apart on
        # the GPU machine's VM; and with the lanes kept in one region, "joined" is the request's whole time)
        m, skew = tier._worker.kernel_phases(), 2.0
        order = ("prologue", "first thread in", "x quantized", "gate/up done", "down inputs done",
                 "down and sum done", "joined")
        assert all(m[a] <= m[b] + skew for a, b in zip(order, order[1:])), m
        assert m["first thread in"] <= m["last thread in"] + skew and m["joined"] > 0
        assert m["joined"] <= 1e6 * tier._worker.kernel_seconds / 4 + skew
    tier.close()


def test_the_finer_split_hands_the_cpu_rows_of_one_more_expert():
    """With the compiled worker a one-token call splits one miss by rows (cpu_share.cpu_split): the CPU computes
    the whole misses and that expert's first gate/up rows, the GPU side the rest of it (its gather skips the
    CPU's rows; on this CPU device the torch stand-in), and the sum matches the fp32 reference within the int8
    activations' rounding at every share; the books count the split expert as the GPU's. Off, the old rounding."""
    from runtime.experts.cpu_share import cpu_split

    cpu = torch.device("cpu")
    store = HostExpertStore.synthetic(layers=2, num_experts=12, hidden=512, intermediate=512, codec="int4",
                                      group=64, weight_std=0.05, seed=9)
    gen = torch.Generator().manual_seed(12)
    for split_on in (True, False):
        tier = HybridExperts(store, ExpertSpec(), device=cpu, dtype=torch.float32, options=HybridOptions(
            slots=2, top_k=4, zero_copy=True, cpu_share=0.5, hot_set=((0, 0), (1, 0)), expert_split=split_on,
            promote_bytes_per_step=0))
        assert tier._worker.compiled and (tier._split_unit > 0) == split_on
        splits = 0
        for step, share in enumerate((0.5,) * 6 + (0.3, 0.7, 0.45, 0.2, 0.6, 0.35)):
            tier._box.set_share(share)
            layer = step % 2
            x = torch.randn(1, 512, generator=gen)
            ids = torch.cat([torch.tensor([0]), 1 + torch.randperm(11, generator=gen)[:3]])[None]   # 0: a hit
            w = torch.softmax(torch.randn(1, 4, generator=gen), dim=-1)
            got = tier(layer, x, ids, w)
            want = _reference(store, layer, x, ids, w)
            assert (got - want).norm() / want.norm() < 0.03, (split_on, step)
            whole, rows = cpu_split(3, share, unit=tier._split_unit, inter=512)
            assert int(tier._box.split[1]) == rows and int(tier._box.ncpu[0]) == whole + (rows > 0)
            splits += rows > 0
        tier.begin_step()
        tier.flush_step_log()
        c = tier.counters.total            # (the books replay the tier's own share, 0.5, at every step)
        whole = cpu_split(3, 0.5, unit=tier._split_unit, inter=512)[0]
        assert (c.misses, c.cpu_experts, c.fetched_experts) == (36, 12 * whole, 12 * (3 - whole))
        assert whole == (1 if split_on else 2)             # 1.5 experts: one and half of one, or round(1.5)
        assert (splits >= 6) == split_on and tier._worker.error is None and int(tier._box.error[0]) == 0
        tier.close()


def test_an_expert_named_twice_is_never_split():
    """The gather copies an expert a call names twice once, for both assignments: were it the split one, the
    rows it leaves behind for the CPU would be missing from the other assignment too (the CUDA graph test's ids
    found it on the GPU: error 0.52). The handoff does not split it; the answer matches the reference."""
    cpu = torch.device("cpu")
    store = HostExpertStore.synthetic(layers=1, num_experts=12, hidden=512, intermediate=512, codec="int4",
                                      group=64, weight_std=0.05, seed=9)
    tier = HybridExperts(store, ExpertSpec(), device=cpu, dtype=torch.float32, options=HybridOptions(
        slots=0, top_k=4, zero_copy=True, cpu_share=0.45, expert_split=True))
    gen = torch.Generator().manual_seed(3)
    for row in ([8, 7, 11, 7], [8, 7, 11, 4]):          # share 0.45 of 4 misses: one whole, rows of the second
        x, w = torch.randn(1, 512, generator=gen), torch.softmax(torch.randn(1, 4, generator=gen), dim=-1)
        ids = torch.tensor([row])
        got = tier(0, x, ids, w)
        want = _reference(store, 0, x, ids, w)
        assert (got - want).norm() / want.norm() < 0.03, row
        assert tier._box.split.tolist() == ([-1, 0] if row.count(7) == 2 else [1, tier._box.split.tolist()[1]])
        assert (int(tier._box.split[1]) > 0) == (row.count(7) == 1)
    assert int(tier._box.error[0]) == 0
    tier.close()


@pytest.mark.parametrize("split", [True, False])
def test_a_learned_share_with_the_finer_split_climbs_a_finer_grid(split):
    """The learned share's controller gets SPLIT_SHARE_GRID (steps of 0.05) when the tier splits experts: the step
    time then moves between whole experts; else the grid of whole-expert shares."""
    from runtime.experts.policy import SHARE_GRID, SPLIT_SHARE_GRID

    store = HostExpertStore.synthetic(layers=1, num_experts=8, hidden=512, intermediate=512, codec="int4",
                                      group=64, weight_std=0.05, seed=9)
    tier = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32, options=HybridOptions(
        slots=2, top_k=4, zero_copy=True, cpu_share=None, expert_split=split))
    assert tier.share_controller.grid == (SPLIT_SHARE_GRID if split else SHARE_GRID)
    assert (tier._split_unit > 0) == split
    tier.close()


@pytest.mark.parametrize("split", [True, False])
def test_the_compiled_worker_answers_inside_a_cuda_graph(device, split):
    """On the GPU machine, at a real layer width (the int8 kernel, the compiled worker loop): a recorded step
    whose misses are split between the GPU (gathered over PCIe) and the CPU worker matches the fp32 reference
    within the int8 activations' rounding, replay after replay - with the finer split (one expert's first gate/up
    rows from the CPU, taken by the gate/up kernel inside the graph) where the rule splits, and without it."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    from runtime.experts.cpu_share import cpu_split
    from runtime.experts.mailbox_clock import ClockMap, GpuClockSync

    dev = torch.device("cuda")
    store = HostExpertStore.synthetic(layers=1, num_experts=16, hidden=512, intermediate=512, codec="int4",
                                      group=64, weight_std=0.05, seed=9, pin=True)
    tier = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16,    # no slots: 4 misses a call
                         options=HybridOptions(slots=0, top_k=4, cpu_share=0.5, expert_split=split))
    assert tier.zero_copy and tier._worker.int8_args is not None and (tier._split_unit > 0) == split
    x = torch.randn(1, 512, device=dev, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5, 9, 12]], device=dev)
    w = torch.full((1, 4), 0.25, device=dev)
    out, g = _recorded_call(tier, x, ids, w)
    splits = 0
    sync = GpuClockSync(dev)
    before = sync.sample()
    for step in range(10):
        ids.copy_(torch.tensor([[step, 5 + step % 6, 11 - step % 2, 15 - step]]))
        share = (0.5, 0.3, 0.7, 0.45, 0.2)[step % 5]
        tier._box.set_share(share)
        tier.begin_step()
        g.replay()
        tier.end_step()
        torch.cuda.synchronize()
        want = _reference(store, 0, x.float().cpu(), ids.cpu(), w.cpu())
        err = (out.float().cpu() - want).norm() / want.norm()
        assert err < 0.03, (step, share, float(err), tier._box.split.tolist())
        whole, rows = cpu_split(4, share, unit=tier._split_unit, inter=512)
        if rows and ids.view(-1).tolist().count(int(ids.view(-1)[whole])) > 1:
            rows = 0                    # (step 8 names expert 7 twice: gathered once for both, never split)
        assert int(tier._box.split[1]) == rows and (rows == 0 or split), (step, share, tier._box.split.tolist())
        splits += rows > 0
    assert (splits >= 6) == split, splits
    assert tier._worker.kernel_requests >= 5 and int(tier._box.error[0]) == 0   # (served lags inside a spin)
    # the GPU's clock in the mailbox's timeline: every request of the replays, in order, each answer seen after
    # the worker's own time on it (the worker saw the request after it was published, the GPU its answer later);
    # with the worker's stamps set on the GPU's clock, the request reached the worker after its handoff
    spans = tier._box.timeline(0, clock=ClockMap.fit(before, sync.sample()))
    assert spans is not None and spans["requests"] == int(tier._box.ticket[0]) >= 5, spans
    worker_us = 1e6 * tier._worker.kernel_seconds / tier._worker.kernel_requests
    assert spans["request to answer seen, mean"] > worker_us > 0, (spans, worker_us)
    assert spans["answer seen to rows added"] >= 0 and spans["request to collect"] > 0, spans
    assert spans["worker stamps"] == spans["requests"] and spans["request to worker"] > -spans["clock error"], spans
    assert 0 < spans["worker"] < spans["request to answer seen"], spans
    tier.close()


def test_the_worker_clock_is_set_against_the_gpus_within_a_ping(device):
    """On the GPU machine: two samples of the cycle counter against %globaltimer (mailbox_clock.GpuClockSync), 50
    ms apart, give a map whose rate is the counter's own (within 1 %), each within half a ping (< 10 µs)."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    import time

    from runtime.experts.cpu_share import _cycle_rate
    from runtime.experts.mailbox_clock import ClockMap, GpuClockSync
    sync = GpuClockSync(torch.device("cuda"))
    a = sync.sample()
    time.sleep(0.05)
    b = sync.sample()
    clock = ClockMap.fit(a, b)
    assert clock is not None and a.error_ns < 10_000 and b.error_ns < 10_000, (a, b)
    assert clock.ns_per_cycle * _cycle_rate() == pytest.approx(1e9, rel=0.01), clock
    assert 45e6 < b.ns - a.ns < 500e6, (a, b)


def test_the_share_worker_leaves_two_cores_to_the_decoding_and_polling_threads():
    """The worker's kernel threads when none were asked for: a 16-core host runs 14 beside the decoding thread's
    spinning sync and the polling loop; small machines keep at least one."""
    from runtime.experts.cpu_share import default_worker_threads

    assert [default_worker_threads(c) for c in (16, 8, 3, 2, 1)] == [14, 6, 1, 1, 1]
    cpu = torch.device("cpu")
    _, tier = _tier(cpu, slots=2, cpu_share=0.5)
    assert tier._worker.threads == (tier.cpu.threads or default_worker_threads())
    tier.close()


def test_a_decoding_worker_spins_through_the_pauses_between_steps_and_naps_only_when_quiet():
    """Run k's trace: a worker that napped 0.5 ms whenever ~0.1 ms of polls saw nothing answered each step's first
    requests up to 1.3 ms late. Its spin is sized in time from a calibration (SPIN_S, longer than the host's pause
    between steps), and it sleeps only after QUIET_AFTER_S without a request."""
    pytest.importorskip("numba")
    from runtime.experts import cpu_share
    polls = cpu_share.polls_per_second(200_000)
    assert polls > 1e6                                   # a compiled poll: well under a microsecond each
    assert cpu_share.nap_after_an_empty_spin(quiet=False) == 0.0
    assert cpu_share.nap_after_an_empty_spin(quiet=True) == cpu_share.QUIET_SLEEP_S
    _, tier = _tier(torch.device("cpu"), slots=0, cpu_share=1.0)
    spin_s = tier._worker.spin_polls / polls
    assert 0.2 * cpu_share.SPIN_S < spin_s < 5 * cpu_share.SPIN_S   # sized in time (two calibrations: some noise)
    assert cpu_share.SPIN_S > 0.003                      # longer than the 1-3 ms between two decode steps
    tier.close()


def test_a_request_sent_while_the_worker_thread_starts_is_answered(monkeypatch):
    """The tier sends its first request right after building the worker (its probe call on a GPU): a thread that
    read the last answered ticket only once running took that request for an old one and never answered it."""
    import time

    from runtime.experts.cpu_share import CpuShareWorker

    run = CpuShareWorker._run

    def slow_start(self, *args):
        time.sleep(0.3)                         # the request below lands before the loop starts
        return run(self, *args)

    monkeypatch.setattr(CpuShareWorker, "_run", slow_start)
    store, tier = _tier(torch.device("cpu"), slots=0, cpu_share=1.0)
    x, ids, w = torch.randn(1, 64), torch.tensor([[2, 5]]), torch.full((1, 2), 0.5)
    t0 = time.monotonic()
    got = tier(0, x, ids, w)
    assert time.monotonic() - t0 < 5 and int(tier._box.error[0]) == 0
    torch.testing.assert_close(got, _reference(store, 0, x, ids, w), rtol=1e-4, atol=1e-5)
    deadline = time.monotonic() + 5                 # the worker counts a request just after answering it
    while tier._worker.served < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier._worker.served == 1
    tier.close()


def test_the_kernel_warm_up_runs_on_one_thread_and_leaves_the_thread_count_alone():
    """Loading compiles the CPU kernels by running them once on one thread (no pool of kernel threads is left
    to the loading thread beside the share worker's); the thread's count and the executor's are as before."""
    numba = pytest.importorskip("numba")
    store = HostExpertStore.synthetic(layers=1, num_experts=4, hidden=256, intermediate=256, codec="int4", group=64)
    from runtime.experts.cpu_executor import CpuExecutor
    cpu = CpuExecutor(store, ExpertSpec(), threads=2)
    seen = []
    real = numba.set_num_threads

    def spy(n):
        seen.append((n, numba.get_num_threads()))
        real(n)

    numba.set_num_threads(2)
    try:
        numba.set_num_threads = spy
        cpu.warm_up(store.layers[0])
    finally:
        numba.set_num_threads = real
    assert seen and seen[0][0] == 1                      # the kernel ran with one thread...
    assert numba.get_num_threads() == 2 and cpu.threads == 2   # ...and the counts are back


def test_with_a_worker_the_decoding_thread_leaves_the_cores_to_its_pool(monkeypatch):
    """While a CPU-share worker runs, the host-driven path (calls of more than 4 tokens) computes its CPU misses on
    the decoding thread with only the cores the worker leaves (a second full pool would make libgomp stop spinning
    for both); results stay exact; without a worker the executor's own count applies."""
    numba = pytest.importorskip("numba")
    import os

    cpu = torch.device("cpu")
    store, tier = _tier(cpu, slots=2, cpu_share=0.5)
    worker = tier._worker.threads
    assert tier._host_threads == max(1, (os.cpu_count() or 1) - worker - 1)
    seen = []
    real = numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: seen.append(n) or real(1))
    x, w = torch.randn(6, 64), torch.full((6, 2), 0.5)
    ids = torch.tensor([[1, 4], [4, 7], [2, 3], [5, 6], [0, 7], [3, 6]])
    torch.testing.assert_close(tier(1, x, ids, w), _reference(store, 1, x, ids, w), rtol=1e-4, atol=1e-5)
    assert seen and set(seen) == {tier._host_threads}
    tier.close()
    assert tier._worker is None


_WORKER_ALONE = """
import numpy as np, torch
from runtime.experts.openmp import load_private_openmp
load_private_openmp()                     # first, as the tier does
from runtime.experts.cpu_executor import CpuExecutor
from runtime.experts.cpu_share import CpuShareWorker, Mailbox, collect_reference, handoff_reference
from runtime.experts.host_store import HostExpertStore
from runtime.experts.interface import ExpertSpec
store = HostExpertStore.synthetic(layers=1, num_experts=8, hidden=512, intermediate=512, codec="int4", group=64, seed=3)
cpu = CpuExecutor(store, ExpertSpec())
box = Mailbox(max_tokens=1, top_k=2, hidden=512, device=torch.device("cpu"), share=1.0)
worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=2)
x, ids, w = torch.randn(1, 512), torch.tensor([[1, 2]]), torch.full((1, 2), 0.5)
handoff_reference(0, ids, w, x, torch.full((8,), -1), box)
got = collect_reference(torch.zeros(1, 512), box)
want = cpu.run(0, x, np.zeros(2, np.int64), ids[0].numpy(), w[0].numpy())
assert worker.error is None and torch.equal(got, want), (worker.error, (got - want).abs().max())
worker.close()
print("answered")
"""


def test_a_compiled_worker_built_alone_answers_its_first_request():
    """A CPU-share worker built with no kernel run before it (no warm-up on the main thread): its first request
    starts numba's threads, which crashed the process when that happened inside the worker's compiled loop. In
    a subprocess: a crash must fail this test, not the run."""
    pytest.importorskip("numba")
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", _WORKER_ALONE], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0 and "answered" in run.stdout, (run.returncode, run.stderr[-2000:])
