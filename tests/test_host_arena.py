"""The prefix cache's host arena: exact-size tensors carved from slabs locked once, their memory back for the next
entry when the last tensor or view sharing it dies (runtime/host_arena.py). Plain-memory slabs here: the carving
and reuse are the same code a GPU engine runs over page-locked ones."""
import gc
import threading
import weakref

import psutil
import pytest
import torch

from runtime.cuda_capture import RECORDING
from runtime.experts.host_store import HostBuffer
from runtime.host_arena import ALIGN, HostArena, plain_slab, registered_slab
from runtime.kv_cache import KVCache, SequenceCache, StateCache

SLAB = 1 << 20


def arena(slabs: int = 4) -> HostArena:
    return HostArena(slabs * SLAB, slab_bytes=SLAB, allocate=plain_slab)


def test_carved_tensors_are_exact_writable_and_do_not_overlap():
    a = arena()
    x = a.empty((3, 100, 8), torch.bfloat16)
    y = a.empty((5,), torch.float32)
    assert x.shape == (3, 100, 8) and x.dtype == torch.bfloat16 and y.shape == (5,)
    x.fill_(1.5)
    y.fill_(-2.0)
    assert torch.all(x == 1.5) and torch.all(y == -2.0)            # neither write reached the other
    rounded = lambda n: -(-n // ALIGN) * ALIGN                       # noqa: E731 - each tensor's bytes, aligned
    assert a.used_bytes == rounded(4800) + rounded(20) and a.stats()["slabs"] == 1
    assert y.data_ptr() - x.data_ptr() >= x.numel() * x.element_size()


def test_memory_comes_back_only_when_the_last_view_is_gone_and_is_reused():
    a = arena()
    x = a.empty((256, 1024), torch.float16)                        # 512 KiB
    where, used = x.data_ptr(), a.used_bytes
    head = x[:10]                                                    # a view outliving its tensor (as load() makes)
    del x
    gc.collect()
    assert a.used_bytes == used                                      # still in use through the view
    del head
    assert a.used_bytes == 0
    again = a.empty((256, 1024), torch.float16)
    assert again.data_ptr() == where and a.stats()["slabs"] == 1    # the same bytes, no new slab


def test_neighbouring_free_ranges_merge_to_serve_a_larger_request():
    a = arena(slabs=1)
    parts = [a.empty((SLAB // 4,), torch.uint8) for _ in range(4)]   # the whole slab
    assert a.empty((16,), torch.uint8) is None and a.fallbacks == 1  # full: the caller's allocator serves it
    first = parts[0].data_ptr()
    del parts[1], parts[0]                                           # two adjacent quarters back
    half = a.empty((SLAB // 2,), torch.uint8)
    assert half is not None and half.data_ptr() == first


def test_it_refuses_what_it_cannot_hold_rather_than_grow_past_its_budget():
    a = arena(slabs=2)
    assert a.empty((SLAB + 1,), torch.uint8) is None                 # larger than a slab
    keep = [a.empty((SLAB,), torch.uint8) for _ in range(2)]
    assert all(k is not None for k in keep)
    assert a.empty((1,), torch.uint8) is None and a.nbytes == 2 * SLAB


def test_a_slab_that_cannot_be_locked_stops_its_growth_without_failing(caplog):
    calls = []

    def refuse_the_second(n):
        calls.append(n)
        if len(calls) > 1:
            raise RuntimeError("CUDA error: out of memory (page-locked)")
        return plain_slab(n)

    a = HostArena(4 * SLAB, slab_bytes=SLAB, allocate=refuse_the_second)
    keep = a.empty((SLAB,), torch.uint8)
    assert a.empty((SLAB,), torch.uint8) is None and "stops at 1 MiB" in caplog.text
    assert a.empty((SLAB,), torch.uint8) is None and len(calls) == 2   # not asked again
    assert keep is not None


def test_a_small_budget_gets_smaller_slabs_not_none():
    a = HostArena(300 << 10, allocate=plain_slab)                    # 300 KiB: 256 KiB slabs
    assert a.slab_bytes == 256 << 10 and a.empty((1000,), torch.float32) is not None


def test_caches_moved_into_an_arena_keep_their_values_and_free_it_when_dropped():
    a = arena()
    kv = KVCache(2, 16, device="cpu", dtype=torch.float32)
    kv.update_and_fetch(torch.randn(2, 37, 16), torch.randn(2, 37, 16))
    state = StateCache({"recurrent": torch.randn(4, 8, 8)}, offset=37)
    moved = SequenceCache([kv, state]).to("cpu", arena=a)
    assert torch.equal(moved.layers[0].keys, kv.keys[:, :37]) and torch.equal(moved.layers[1].states["recurrent"],
                                                                               state.states["recurrent"])
    assert a.used_bytes >= moved.nbytes > 0
    back = KVCache(2, 16, device="cpu", dtype=torch.float32)
    back.load(moved.layers[0], 20)                                   # a prefix-cache hit cut to 20 tokens
    assert torch.equal(back.keys[:, :20], kv.keys[:, :20])
    del moved
    assert a.used_bytes == 0


# torch's warning for each wait in sync debug mode; not its one-off notice that the mode is a prototype (it also
# says "synchronizing", and came with the first test to turn the mode on: s39b's second "wait")
_SYNC = "called a synchronizing CUDA operation"


def test_a_gpu_caches_copy_to_host_waits_for_the_gpu_once_and_holds_every_value(device):
    """SequenceCache.to("cpu") enqueues every tensor's copy into page-locked memory and then waits once (s37c: a
    wait per tensor, 84 in a 40-layer store); what it returns is complete when it returns - read at once, every
    value is the GPU's (a copy still in flight would leave the arena's memory as it was)."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    a = HostArena(256 << 20, slab_bytes=64 << 20, allocate=registered_slab)
    layers = []
    for _ in range(6):
        kv = KVCache(2, 256, device="cuda", dtype=torch.bfloat16)
        kv.update_and_fetch(torch.randn(2, 3000, 256, device="cuda", dtype=torch.bfloat16),
                            torch.randn(2, 3000, 256, device="cuda", dtype=torch.bfloat16))
        layers += [kv, StateCache({"conv": torch.randn(64, 4, device="cuda"),
                                   "recurrent": torch.randn(32, 128, 128, device="cuda")}, offset=3000)]
    cache = SequenceCache(layers)
    # a compact copy: the stored 3,000 rows of each KV buffer (its capacity is 3,072), each state whole
    want = [t.cpu() for layer in layers for t in ([layer.keys[:, :layer.stored], layer.values[:, :layer.stored]]
                                                  if isinstance(layer, KVCache) else list(layer.states.values()))]
    assert want[0].shape == (2, 3000, 256) and layers[0].capacity > 3000
    waits = []
    with pytest.warns(UserWarning) as seen:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            moved = cache.to("cpu", arena=a)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waits = [w for w in seen if _SYNC in str(w.message)]
    got = [t for layer in moved.layers for t in ([layer.keys, layer.values] if isinstance(layer, KVCache)
                                                 else list(layer.states.values()))]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in got)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == len(want) == 24
    assert len(waits) == 1, [f"{w.filename}:{w.lineno}: {w.message}" for w in waits]     # (where each wait was)


def test_a_stored_conversation_restores_with_one_wait_for_the_gpu_and_every_value(device):
    """SequenceCache.load from host memory (a prefix-cache hit) enqueues every copy - KV head by head, a recurrent
    state into its pool slot - and waits once, inside the call (the entry's host memory may be reused after it);
    on the CPU the same load, with no wait at all."""
    from runtime.models.gated_deltanet import GatedDeltaNetConfig
    from runtime.models.linear_state import LinearStateSpec, StatePool

    dev = torch.device(device)
    cfg = GatedDeltaNetConfig(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32)
    with torch.inference_mode():
        pool = StatePool(LinearStateSpec.for_layers(cfg, 1), 2, device=dev)
    src_slot, dst_slot = pool.alloc(), pool.alloc()
    live = pool.layer_caches(src_slot)[0]
    live.states["recurrent"] = torch.randn(tuple(live.states["recurrent"].shape), device=dev)
    live.states["conv"] = torch.randn(tuple(live.states["conv"].shape), device=dev)
    live.advance(500)
    kv = KVCache(4, 64, device=dev, dtype=torch.bfloat16)
    kv.update_and_fetch(torch.randn(4, 500, 64, device=dev, dtype=torch.bfloat16),
                        torch.randn(4, 500, 64, device=dev, dtype=torch.bfloat16))
    stored = SequenceCache([kv, live.copy()]).to("cpu", arena=arena() if dev.type == "cpu" else
                                                  HostArena(64 << 20, slab_bytes=16 << 20, allocate=registered_slab))
    fresh = SequenceCache([KVCache(4, 64, device=dev, dtype=torch.bfloat16), pool.layer_caches(dst_slot)[0]])
    waits = []
    if dev.type == "cuda":
        with pytest.warns(UserWarning) as seen:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fresh.load(stored)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits = [w for w in seen if _SYNC in str(w.message)]
        assert len(waits) == 1
    else:
        fresh.load(stored)
    assert torch.equal(fresh.layers[0].keys[:, :500], kv.keys[:, :500])
    assert torch.equal(fresh.layers[0].values[:, :500], kv.values[:, :500]) and fresh.layers[0].offset == 500
    for key in ("conv", "recurrent"):
        assert torch.equal(fresh.layers[1].states[key], live.states[key])
    assert fresh.layers[1].offset == 500


def test_a_layers_copy_left_in_flight_on_the_cpu_is_the_same_copy():
    """`wait=False` only changes a GPU source's copy: a CPU cache's layers copy as before."""
    kv = KVCache(2, 16, device="cpu", dtype=torch.float32)
    kv.update_and_fetch(torch.randn(2, 9, 16), torch.randn(2, 9, 16))
    state = StateCache({"recurrent": torch.randn(4, 8, 8)}, offset=9)
    for waited, left in ((kv.to("cpu"), kv.to("cpu", wait=False)), (state.to("cpu"), state.to("cpu", wait=False))):
        a, b = (waited.keys, left.keys) if isinstance(waited, KVCache) else (waited.states["recurrent"],
                                                                            left.states["recurrent"])
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("shape", [(0,), (4, 0, 8)])
def test_empty_shapes_take_no_memory(shape):
    a = arena()
    t = a.empty(shape, torch.float16)
    assert t.shape == shape and a.used_bytes == 0


def wait_for(condition, timeout_s: float = 10.0) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the background thread did not get there"
        time.sleep(0.005)


def test_prepare_locks_slabs_ahead_on_another_thread_and_the_tensors_then_take_them():
    import threading
    threads = []

    def record(n):
        threads.append(threading.current_thread().name)
        return plain_slab(n)

    a = HostArena(8 * SLAB, slab_bytes=SLAB, allocate=record)
    a.prepare(3 * SLAB - 100)                                         # rounds up to whole slabs
    wait_for(lambda: a.locked_ahead == 3)
    assert a.stats()["slabs"] == 3 and set(threads) == {"host-arena-lock-ahead"}
    keep = [a.empty((SLAB,), torch.uint8) for _ in range(3)]
    assert all(k is not None for k in keep) and len(threads) == 3 and a.fallbacks == 0   # no lock inside the store
    a.prepare(2 * SLAB)                                                # already held: nothing to lock
    a.prepare(4 * SLAB)
    wait_for(lambda: a.locked_ahead == 4)
    assert a.stats()["slabs"] == 4
    a.prepare(100 * SLAB)                                              # never past the budget
    wait_for(lambda: a.stats()["slabs"] == 8)
    assert len(threads) == 8 and a.nbytes == 8 * SLAB


def test_a_tensor_waits_for_a_slab_being_locked_ahead_rather_than_falling_back():
    """The budget's last slab is being locked by the background thread when the store comes: it waits for it
    (the lock is a fraction of a second) instead of spilling to torch's allocator."""
    import threading
    release = threading.Event()
    calls = []

    def slow(n):
        calls.append(n)
        release.wait(10)
        return plain_slab(n)

    a = HostArena(SLAB, slab_bytes=SLAB, allocate=slow)
    a.prepare(SLAB)
    wait_for(lambda: len(calls) == 1)                                  # the background thread is locking it
    got = {}
    store = threading.Thread(target=lambda: got.setdefault("t", a.empty((SLAB // 2,), torch.uint8)))
    store.start()
    store.join(0.2)
    assert store.is_alive()                                            # waiting for the slab, not falling back
    release.set()
    store.join(10)
    assert got["t"] is not None and a.fallbacks == 0 and len(calls) == 1


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: out of memory (page-locked)"),
                                   OSError(12, "Cannot allocate memory"), MemoryError()])
def test_a_refusal_while_locking_ahead_stops_growth_and_the_store_falls_back_cleanly(error, caplog):
    """Whatever stops a slab - the driver's refusal, no memory left to map - the arena stops growing and a store
    falls back at once (an error escaping the thread would leave a store waiting for a slab that never comes)."""
    def refuse(n):
        raise error

    a = HostArena(4 * SLAB, slab_bytes=SLAB, allocate=refuse)
    a.prepare(2 * SLAB)
    wait_for(lambda: a.max_slabs == 0)
    assert "stops at 0 MiB" in caplog.text
    assert a.empty((16,), torch.uint8) is None and a.fallbacks == 1


def test_a_gpu_engines_slabs_are_registered_in_place_and_copy_at_the_pinned_rate(device):
    """registered_slab (the GPU engine's arena): ordinary memory the driver page-locks in place. Carved tensors are
    pinned (cudaMemcpy takes them directly, and non_blocking copies are truly asynchronous) and round-trip a GPU
    tensor; the slab is unregistered when it dies."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    a = HostArena(64 << 20, slab_bytes=32 << 20, allocate=registered_slab)
    src = torch.randn(4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    host = a.empty(src.shape, src.dtype)
    assert host is not None and host.is_pinned()
    host.copy_(src)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src) and a.fallbacks == 0
    a.prepare(64 << 20)
    wait_for(lambda: a.stats()["slabs"] == 2)
    assert a.locked_ahead == 1


def test_without_cuda_the_registered_slab_is_refused_and_the_arena_declines_cleanly(device, caplog):
    """registered_slab page-locks through the driver; where there is none (or it refuses), the arena stops growing
    with its warning and the caller's allocator takes every copy - no exception reaches a request."""
    if device == "cuda" or torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    a = HostArena(4 * SLAB, slab_bytes=SLAB, allocate=registered_slab)
    assert a.empty((16,), torch.uint8) is None and a.fallbacks == 1
    assert "stops at 0 MiB" in caplog.text and a.nbytes == 0


def test_a_slab_is_never_registered_inside_a_graph_recording():
    """The driver refuses cudaHostRegister while a decode graph is being captured (runtime/cuda_capture.py): a slab
    locked on the arena's thread waits for a recording that holds RECORDING, then goes on (here, without CUDA, to
    its refusal)."""

    outcome = []

    def lock_a_slab():
        try:
            outcome.append(registered_slab(SLAB))
        except RuntimeError as exc:          # no CUDA here (or a driver that refuses): refused after the wait
            outcome.append(exc)

    with RECORDING:                          # a recording in progress on the engine's thread
        t = threading.Thread(target=lock_a_slab)
        t.start()
        t.join(0.3)
        assert t.is_alive() and outcome == []          # it waits for the recording
    t.join(10)
    assert not t.is_alive() and len(outcome) == 1


def test_touch_faults_in_every_page_on_one_thread():
    """A slab's pages are faulted in before the driver registers them (off its lock), by one byte a page written
    on the locking thread itself: they become resident, and they read as zeros."""

    nbytes = 64 << 20
    buf = HostBuffer(nbytes, huge_pages=False)
    before = psutil.Process().memory_info().rss
    buf.touch()
    grown = psutil.Process().memory_info().rss - before
    assert grown >= 0.9 * nbytes
    assert not buf.array.any()


def test_slabs_nbytes_packs_tensors_as_the_carving_will():
    """What prepare() is asked for: tensors that do not tile a slab take more slabs than their bytes fill (s34c: 96
    K/V tensors of 30.7 MB, 8 to a 256 MiB slab, took 12 slabs where their bytes fill 11)."""
    a = arena(slabs=8)
    third = SLAB * 3 // 10                                            # 3 fit a slab, with 10 % left over
    assert a.slabs_nbytes([third] * 9) == 3 * SLAB
    assert a.slabs_nbytes([third] * 10) == 4 * SLAB                  # bytes alone: 3 slabs
    assert a.slabs_nbytes([SLAB // 2 + 1] * 3) == 3 * SLAB           # one a slab
    assert a.slabs_nbytes([SLAB // 2 + 1, SLAB // 4, SLAB // 4]) == 2 * SLAB   # first fit fills the gaps
    assert a.slabs_nbytes([SLAB + 1]) == 0                           # larger than a slab: never carved
    keep = [a.empty((third,), torch.uint8) for _ in range(10)]       # the carving agrees
    assert a.stats()["slabs"] == 4 and all(k is not None for k in keep)


def test_a_dropped_arena_ends_its_lock_ahead_thread_and_gives_its_slabs_back():
    """An engine dropped on a model switch must take its arena's page-locked slabs with it: the lock-ahead thread
    holds the arena only weakly and exits when it is gone."""
    slabs = []

    def track(n):
        slab = plain_slab(n)
        slabs.append(weakref.ref(slab))
        return slab

    a = HostArena(4 * SLAB, slab_bytes=SLAB, allocate=track)
    a.prepare(2 * SLAB)
    wait_for(lambda: a.locked_ahead == 2)
    kept = a.empty((100,), torch.uint8)                               # an entry outliving... nothing: dropped below
    thread = a._grower
    del a, kept
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    assert all(ref() is None for ref in slabs)                       # the slabs' memory went back
