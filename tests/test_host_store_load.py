"""Loading the experts into host memory of our own (issue 10: peak RSS <= package + 2 GiB, fast cold load).

`pinned_copy(pin=False)` is the same code path as the GPU machine's page-locked copy, in ordinary memory: the
bytes must be identical to the FTW file, the process must never hold the file's pages beside the copy
(RSS sampled during the copy of a ~1 GiB package), and bad input must fail naming the file."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from runtime.experts.host_store import ExpertStoreError, HostExpertStore, write_synthetic_ftw_experts
from runtime.experts.stats import PeakRSS, host_rss

MiB = 1 << 20


@pytest.fixture(scope="module")
def package_1gib(tmp_path_factory):
    """6 layers x 64 experts of the qwen3-30b-a3b int4 block (2.53 MiB): 1.02 GB on disk."""
    folder = tmp_path_factory.mktemp("ftw_1gib")
    experts = write_synthetic_ftw_experts(folder, layers=6, num_experts=64, hidden=2048, intermediate=768)
    yield experts
    os.remove(folder / "experts.bin")


def _equals_file(copy: HostExpertStore, experts) -> bool:
    """Every layer of the copy against the file, read without mapping it (so RSS is not disturbed)."""
    path = experts._path
    for layer in copy.layers:
        want = np.fromfile(path, dtype=np.uint8, count=experts.num_experts * experts.block_nbytes,
                           offset=experts.layer_offset(layer))
        if not np.array_equal(copy.layer_buffer(layer).reshape(-1), want):
            return False
    return True


@pytest.mark.parametrize("method", ["read", "map"])
def test_copy_of_a_1gib_package_is_exact_and_counts_its_bytes_once(package_1gib, method):
    store = HostExpertStore.from_ftw(package_1gib)
    nbytes = store.nbytes
    assert nbytes > 0.9e9
    base = host_rss()
    if method == "map":           # the worst case for the mapped route: someone already faulted the file in
        for layer in store.layers[:2]:
            assert int(store.layer_buffer(layer)[:, ::4096].sum()) > 0
        assert host_rss() - base > 0.2 * nbytes
    with PeakRSS(every_s=0.001) as rss:
        copy = store.pinned_copy(pin=False, method=method, threads=2, chunk_bytes=32 * MiB)
    assert copy.load_seconds["method"] == method and copy.load_seconds["pinned"] is False
    # the copy itself is resident (so the measurement sees memory at all) ...
    assert rss.end - base > 0.85 * nbytes
    # ... and nothing else is: no file page beside it, at the end or at any moment in between
    margin = 96 * MiB
    assert rss.end - base < nbytes + margin, (rss.end - base) / MiB
    assert rss.peak - base < nbytes + margin, (rss.peak - base) / MiB
    assert copy._owner.nbytes == nbytes                      # exactly the store's size: no rounding up
    assert _equals_file(copy, package_1gib)


def test_chunks_threads_and_odd_sizes_give_the_same_bytes(tmp_path):
    """Chunk boundaries that cut blocks and pages, more threads than chunks, every method: identical."""
    experts = write_synthetic_ftw_experts(tmp_path, layers=3, num_experts=5, hidden=256, intermediate=128, seed=4)
    store = HostExpertStore.from_ftw(experts)
    want = [store.layer_buffer(layer).copy() for layer in store.layers]
    for method, threads, chunk in [("read", 1, 1 << 30), ("read", 3, 12345), ("map", 4, 7777), ("auto", 8, 4096)]:
        copy = store.pinned_copy(pin=False, method=method, threads=threads, chunk_bytes=chunk)
        assert copy.layers == store.layers and copy.layout == store.layout
        for layer, w in zip(store.layers, want):
            assert np.array_equal(copy.layer_buffer(layer), w), (method, threads, chunk, layer)
        assert copy.load_seconds["method"] == ("read" if method == "auto" else method)
    # an in-memory store has no file to read: "auto" copies it, "read" says why it cannot
    mem = HostExpertStore.synthetic(layers=2, num_experts=3, hidden=64, intermediate=64, codec="int4")
    again = mem.pinned_copy(pin=False, threads=2, chunk_bytes=5000)
    assert np.array_equal(again.layer_buffer(1), mem.layer_buffer(1)) and again.load_seconds["method"] == "map"
    with pytest.raises(ExpertStoreError, match="needs a store over an FTW file"):
        mem.pinned_copy(pin=False, method="read")
    with pytest.raises(ExpertStoreError, match="unknown copy method 'fast'"):
        mem.pinned_copy(pin=False, method="fast")


def test_a_truncated_expert_file_fails_naming_it(tmp_path):
    experts = write_synthetic_ftw_experts(tmp_path, layers=2, num_experts=4, hidden=256, intermediate=128)
    store = HostExpertStore.from_ftw(experts)
    os.truncate(experts._path, store.nbytes - 5000)          # e.g. an interrupted download
    with pytest.raises(ExpertStoreError, match=r"experts\.bin: the expert file ends at byte \d+"):
        store.pinned_copy(pin=False, method="read", threads=2, chunk_bytes=8192)


def test_pinning_without_cuda_keeps_the_copy_and_says_so(tmp_path, caplog):
    experts = write_synthetic_ftw_experts(tmp_path, layers=1, num_experts=3, hidden=256, intermediate=128)
    store = HostExpertStore.from_ftw(experts)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the pinned path runs for real (benchmarks/bench_load.py)")
    with caplog.at_level("WARNING"):
        copy = store.pinned_copy(pin=True)
    assert "cannot page-lock" in caplog.text and copy.load_seconds["pinned"] is False
    assert np.array_equal(copy.layer_buffer(0), store.layer_buffer(0))


def test_bench_load_runs_and_reports_rss(tmp_path, capsys):
    """The GPU machine's load benchmark, tiny: every method runs, GB/s and RSS rows come out sane."""
    from benchmarks.bench_load import main

    out = tmp_path / "rows.json"
    assert main(["--gib", "0.02", "--experts", "8", "--folder", str(tmp_path / "pkg"), "--no-pin", "--threads", "1", "2",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["threads"]) for r in rows] == [("before", 1), ("read", 1), ("read", 2), ("map", 1), ("map", 2)]
    for r in rows:
        assert r["gbps"] > 0 and r["after_minus_before"] < r["package"] + 64 * MiB
    assert "GB/s" in capsys.readouterr().out


def test_page_locking_registers_exactly_the_store_and_unregisters_when_the_last_view_goes(monkeypatch, caplog,
                                                                                        tmp_path):
    """HostBuffer.pin against a stand-in CUDA runtime (this machine has none): one registration of exactly
    the store's bytes at its address, transport treats it as pinned, and the registration ends only after
    the store and every view of it are gone; a refused registration warns and leaves the store pageable."""
    import gc

    import torch

    from runtime.experts.host_store import HostBuffer

    calls = []

    class Runtime:
        result = 0

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return self.result

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    rt = Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    experts = write_synthetic_ftw_experts(tmp_path, layers=2, num_experts=3, hidden=256, intermediate=128)
    copy = HostExpertStore.from_ftw(experts).pinned_copy(pin=True)
    ptr = copy._owner.array.ctypes.data
    # portable and mapped: the GPU reads missed experts in place (hybrid.py's zero-copy decode)
    assert calls == [("register", ptr, copy.nbytes, 3)] and copy.load_seconds["pinned"] is True
    assert copy.pinned_layers == frozenset(copy.layers)
    view = copy.block(1, 2)                   # a view outliving the store keeps the registration
    del copy
    gc.collect()
    assert calls[-1][0] == "register"
    del view
    gc.collect()
    assert calls[-1] == ("unregister", ptr)
    rt.result = 2                             # cudaErrorMemoryAllocation
    with caplog.at_level("WARNING"):
        buf = HostBuffer(1 << 20)
        assert buf.pin() is False and not buf.pinned
    assert "cudaHostRegister of 0.00 GiB failed (error 2)" in caplog.text
    # a driver that refuses the mapping but locks the pages: pinned (DMA copies), zero-copy not offered
    rt.cudaHostRegister = lambda ptr, size, flags: calls.append(("register", ptr, size, flags)) or (1 if flags else 0)
    calls.clear()
    buf = HostBuffer(1 << 20)
    assert buf.pin() is True and [c[3] for c in calls] == [3, 0]


def test_a_store_pinned_in_part_locks_only_those_layers_and_keeps_the_rest_mapped(monkeypatch, tmp_path):
    """The pinnable share holds only some layers (Windows: about half the RAM): `pinned_copy(layers=...)` copies and
    registers exactly those layers' bytes, once; the other layers stay views of the mapped file (no second copy in
    RAM), every block reads the same bytes as the file, and `pinned_layers` names what a GPU may read in place.
    A registration the driver refuses leaves no layer called pinned."""
    import torch

    calls = []

    class Runtime:
        result = 0

        def cudaHostRegister(self, ptr, size, flags):
            calls.append((ptr, size))
            return self.result

        def cudaHostUnregister(self, ptr):
            return 0

    rt = Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    experts = write_synthetic_ftw_experts(tmp_path, layers=4, num_experts=3, hidden=256, intermediate=128)
    mapped = HostExpertStore.from_ftw(experts)
    part = mapped.pinned_copy(pin=True, layers=[2, 0], threads=2)
    layer_bytes = mapped.layer_buffer(0).nbytes
    assert calls == [(part.layer_buffer(0).ctypes.data, 2 * layer_bytes)]       # one registration, two layers
    assert part.pinned_layers == frozenset({0, 2}) and part.layers == mapped.layers
    for layer in (1, 3):                       # the same memory as the mapped file's
        assert part.layer_buffer(layer).ctypes.data == mapped.layer_buffer(layer).ctypes.data
    for layer in (0, 2):                       # copies of their own
        assert part.layer_buffer(layer).ctypes.data != mapped.layer_buffer(layer).ctypes.data
    for layer in mapped.layers:
        np.testing.assert_array_equal(part.layer_buffer(layer), mapped.layer_buffer(layer))
    assert mapped.pinned_layers == frozenset()
    with pytest.raises(ExpertStoreError, match="no routed experts"):
        mapped.pinned_copy(pin=False, layers=[7])
    rt.result = 2                              # refused: nothing is called pinned
    assert mapped.pinned_copy(pin=True, layers=[1]).pinned_layers == frozenset()


def test_a_discarded_range_goes_back_to_the_os_and_the_rest_stays():
    """The benchmark's store pinned in part gives its synthetic copies of the pinned layers back (RSS as a real
    load's): the range reads as zeros after, the bytes past it are untouched, RSS falls; an unaligned start is
    refused."""
    from runtime.experts.host_store import HostBuffer

    buf = HostBuffer(64 << 20)
    buf.array[:] = 7
    before = host_rss()
    assert buf.discard(0, 32 << 20)
    assert host_rss() < before - (16 << 20)
    assert not buf.array[:32 << 20].any() and bool((buf.array[32 << 20:] == 7).all())
    assert not buf.discard(100, 4096)


def test_where_the_os_locks_less_than_planned_the_first_layers_that_fit_are_pinned(monkeypatch, tmp_path, caplog):
    """The planner's pinnable share is an estimate (other programs hold page-locked memory too): where the OS
    refuses the whole copy, as many of its first layers as it will take are page-locked (halving the count), the
    store says which, and the user reads why; where it takes none, none is called pinned."""
    import torch

    calls, limit = [], [0]

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(size)
            return 0 if size <= limit[0] else 2

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    experts = write_synthetic_ftw_experts(tmp_path, layers=5, num_experts=3, hidden=256, intermediate=128)
    mapped = HostExpertStore.from_ftw(experts)
    layer_bytes = mapped.layer_buffer(0).nbytes
    limit[0] = int(2.5 * layer_bytes)
    with caplog.at_level("WARNING"):
        copy = mapped.pinned_copy(pin=True, threads=2)
    assert copy.pinned_layers == frozenset(mapped.layers[:2]) and copy.load_seconds["pinned_layers"] == 2
    assert not copy.load_seconds["pinned"]
    assert calls[-1] == 2 * layer_bytes and 5 * layer_bytes in calls          # all first, then fewer
    assert "page-locked only 2 of 5 layers" in caplog.text
    for layer in mapped.layers:
        np.testing.assert_array_equal(copy.layer_buffer(layer), mapped.layer_buffer(layer))
    part = mapped.pinned_copy(pin=True, layers=[0, 1, 2, 3], threads=2)       # a plan pinned in part: the same rule
    assert part.pinned_layers == frozenset({0, 1})
    limit[0] = 0
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert mapped.pinned_copy(pin=True, threads=2).pinned_layers == frozenset()
    assert "refused to page-lock" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_forked_child_is_not_given_the_store():
    """A store is private memory, page-locked for the GPU's DMA: Linux copies such pages into a child at fork, so a
    fork() (a subprocess with a preexec_fn, a multiprocessing "fork" pool) would copy the whole store. The buffer is
    kept out of children (MADV_DONTFORK): the child's address space has nothing at the buffer's address."""
    from runtime.experts.host_store import HostBuffer

    buf = HostBuffer(64 << 20)
    buf.array[:] = 1
    start = buf.array.ctypes.data

    def mapped_at(maps: str, address: int) -> bool:
        for line in maps.splitlines():
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
        return False

    assert mapped_at(Path("/proc/self/maps").read_text(), start)          # (the parent has it)
    pid = os.fork()
    if pid == 0:                                                          # the child: 0 when the buffer is absent
        os._exit(1 if mapped_at(Path("/proc/self/maps").read_text(), start) else 0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "a forked child was given the store's buffer"


def test_huge_pages_are_counted_inside_the_buffer_only():
    """The benchmark reports how much of a store sits in transparent huge pages: smaps' AnonHugePages of the
    mappings inside the buffer's range, not its neighbours'."""
    from runtime.experts.host_store import HostBuffer, huge_bytes_in

    smaps = "\n".join([
        "7f0000000000-7f0000200000 rw-p 00000000 00:00 0 ",          # before the buffer
        "Size:               2048 kB", "AnonHugePages:      2048 kB",
        "7f0000200000-7f0000a00000 rw-p 00000000 00:00 0 ",          # the buffer, in two mappings
        "Size:               8192 kB", "AnonHugePages:      6144 kB", "VmFlags: rd wr mr mw me ac hg",
        "7f0000a00000-7f0000c00000 rw-p 00000000 00:00 0 ",
        "AnonHugePages:      2048 kB",
        "7f0000c00000-7f0000e00000 r--p 00000000 08:01 42 /usr/lib/libc.so.6",   # after it
        "AnonHugePages:         0 kB", "ShmemPmdMapped:     2048 kB"])
    assert huge_bytes_in(smaps, 0x7f0000200000, 0x7f0000c00000) == (6144 + 2048) << 10
    assert huge_bytes_in(smaps, 0x7f0000200000, 0x7f0000a00000) == 6144 << 10
    # a buffer whose end is not page-aligned still counts its mapping (which ends on the next page), capped at
    # the buffer's size (a neighbour merged into the same mapping is not the buffer's)
    assert huge_bytes_in(smaps, 0x7f0000200000, 0x7f00009ff800) == 6144 << 10
    assert huge_bytes_in(smaps, 0x7f0000200000, 0x7f0000201000) == 4096
    buf = HostBuffer(64 << 20)
    buf.array[:] = 1                                        # faulted in: huge pages only where the OS gives them
    got = buf.huge_page_bytes()
    assert got is None or 0 <= got <= buf.nbytes
    small = HostBuffer(64 << 20, huge_pages=False)           # the 4 KiB side of bench_store_pages.py
    small.array[:] = 1
    assert small.huge_page_bytes() in (None, 0)
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        thp = ""
    if got is not None and ("[always]" in thp or "[madvise]" in thp):
        # where the OS offers huge pages on request, the buffer gets them: Python's default MAP_SHARED anonymous
        # mapping is shmem, which ignores MADV_HUGEPAGE (every GPU-machine store until session 20: 0 bytes)
        assert got > 0, f"a 64 MiB HostBuffer got no transparent huge pages (THP: {thp.strip()})"
    store = HostExpertStore.synthetic(layers=1, num_experts=4, hidden=64, intermediate=64, codec="int4")
    got = store.huge_page_bytes()                           # the store asks its buffer
    assert got is None or 0 <= got <= store.nbytes
