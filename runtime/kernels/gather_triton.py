"""Triton kernel: copy a decode call's missed expert blocks from page-locked host memory into VRAM scratch.

Why: zero-copy decode (runtime/experts/hybrid.py) lets the pool kernels read missed experts in place over
PCIe. Those kernels are shaped for VRAM (few programs per expert row, a dequantize between loads), so over
PCIe they keep too few reads in flight: measured 41 of the link's 55 GB/s on the H200. A pure copy kernel
can keep megabytes in flight (every program loads its whole chunk before storing any of it), and the pool
kernels then read the blocks from VRAM at ~1 TB/s. It is also shaped by bytes, not by experts: when the CPU
takes a share of the misses, the GPU's part still spreads over every SM.

    grid (A, cdiv(count, CHUNK)):  a = assignment (token t = a // K, k = a % K), c = chunk of the block's words
                                    [first, first + count) (the whole block, or a byte range of it: see below)
        row = rows[a]          (or table[ids[a]] with a table: the layer's miss row, expert id -> host row;
                                an id outside the table counts as -1)
        owner = the first a' <= a with ids[a'] == ids[a] (tokens of a call that share an expert copy it once)
        row < 0: nothing (a hit, or the CPU's); owner == a: dst[a, chunk c] = src[row, chunk c]
        programs of chunk 0 also write slots[a] = owner if row >= 0 else -1: the scratch rows the pool kernels read

Nothing on the host depends on the data: the launch records in a CUDA graph. Words are 4 bytes when a block
(and the byte range, if any) is a multiple of 16 bytes (16-byte vector loads), else single bytes.

`byte_range`: the launch copies only bytes [lo, hi) of each block, to the same place in its scratch row. Zero-copy
decode gathers the gate/up parts of the missed blocks first and their down parts second, so the gate/up kernel can
run on another stream while the down parts still cross PCIe (session 14; hybrid.py `split_gather`).

`skip` (a RowSkip): the finer split's expert (cpu_share.py) - `split` [2] int32 on the device is (assignment,
rows r) as the handoff wrote it, `parts` [P, 2] int64 each gate/up part's (byte offset, bytes a row). The CPU
computes that assignment's first r gate/up rows, so the launch leaves behind every chunk that lies wholly inside
bytes [offset, offset + r * row) of a part (those never cross PCIe); the chunks at a range's ends are copied whole,
so a few of the CPU's rows may be copied too (at most a chunk at each end: ~64 KB of a part's ~r KB), never a
byte the GPU needs left out. The torch reference leaves out exactly the CPU's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

CHUNK_BYTES = 32 << 10      # bytes one program copies: loaded all at once, so ~32 KB per program in flight
NUM_WARPS = 4


@dataclass(frozen=True)
class RowSkip:
    """The rows of one assignment's gate/up parts a gather leaves behind (the module docstring's `skip`). Made once
    (`of`): the launch then needs nothing from the device's memory on the host, so it records in a CUDA graph."""
    split: torch.Tensor       # [2] int32 on the device: (assignment, rows), -1 / 0 for none
    parts: torch.Tensor       # [P, 2] int64 on the device: (byte offset, bytes a row) of each gate/up part
    whole_words: bool         # every offset and row size a multiple of 16 bytes (the launch may read 4-byte words)

    @classmethod
    def of(cls, split: torch.Tensor, parts: list[tuple[int, int]]) -> RowSkip:
        return cls(split, torch.tensor(parts, dtype=torch.int64, device=split.device),
                   all(off % 16 == 0 and per % 16 == 0 for off, per in parts))


if HAVE_TRITON:
    @triton.jit
    def _gather_kernel(src_ptr, ids_ptr, table_ptr, E, dst_ptr, slots_ptr, words, first, count, split_ptr, parts_ptr,
                       LOOKUP: tl.constexpr, CHUNK: tl.constexpr, ABLOCK: tl.constexpr,
                       SKIP: tl.constexpr, NPARTS: tl.constexpr, WORD: tl.constexpr):
        a = tl.program_id(0)
        c = tl.program_id(1)
        key = tl.load(ids_ptr + a)                         # an expert id (LOOKUP) or a host row
        if LOOKUP:
            known = (key >= 0) & (key < E)                 # an id outside the table: skipped, never read past it
            row = tl.load(table_ptr + tl.where(known, key, 0))
            row = tl.where(known, row, -1)
        else:
            row = key
        # the call's first assignment of this expert owns the copy; later ones (other tokens) share its row
        j = tl.arange(0, ABLOCK)
        earlier = tl.load(ids_ptr + j, mask=j < a, other=-1)
        owner = tl.min(tl.where((earlier == key) & (j < a), j, a))
        if c == 0:
            tl.store(slots_ptr + a, tl.where(row >= 0, owner, -1).to(slots_ptr.dtype.element_ty))
        start = first + c * CHUNK
        copy = (row >= 0) & (owner == a)
        if SKIP:
            # the split expert: a chunk that lies wholly inside the CPU's rows of a part stays behind (a scalar
            # test a program: a mask per word made the device's Triton give up the 16-byte loads, session 16)
            if copy & (a == tl.load(split_ptr)):
                rows = tl.load(split_ptr + 1).to(tl.int64)
                for part in tl.static_range(NPARTS):
                    lo = tl.load(parts_ptr + 2 * part) // WORD
                    hi = lo + rows * tl.load(parts_ptr + 2 * part + 1) // WORD
                    copy = copy & ((start < lo) | (start + CHUNK > hi))
        if copy:
            idx = start + tl.arange(0, CHUNK)
            inside = idx < first + count
            # one load of the whole chunk before any store: all its reads are in flight together
            v = tl.load(src_ptr + row.to(tl.int64) * words + idx, mask=inside)
            tl.store(dst_ptr + a.to(tl.int64) * words + idx, v, mask=inside)


def _word_bytes(*tensors: torch.Tensor, bounds: tuple[int, int]) -> int:
    """4 when every [N, nbytes] uint8 tensor's rows and both bounds allow 16-byte loads of 4-byte words, else 1."""
    whole = all(t.shape[1] % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)
    return 4 if whole and bounds[0] % 16 == 0 and bounds[1] % 16 == 0 else 1


def gather_blocks(src: torch.Tensor, ids: torch.Tensor, scratch: torch.Tensor, *,
                  table: torch.Tensor | None = None, chunk_bytes: int = CHUNK_BYTES,
                  byte_range: tuple[int, int] | None = None,
                  skip: RowSkip | None = None) -> torch.Tensor:
    """src [E, nbytes] uint8 (host memory the GPU may read: page-locked and mapped), ids [T, K] int64 host rows
    (-1: skip), or expert ids looked up in `table` [E] (expert -> host row, -1: skip); scratch [>= T*K, nbytes]
    uint8 on the device. Copies block ids[t, k] to scratch row t*K + k, once per distinct id (a later assignment
    of the same expert shares the first one's row), and returns slots [T, K] int64: the row holding the block, or
    -1 where there is none (what `pool_forward_triton(scratch, ..., slots)` takes). `byte_range` (lo, hi): only
    those bytes of each block are copied (the slots are the same). `skip`: see the module docstring. One launch."""
    t, k = ids.shape
    nbytes = src.shape[1]
    if scratch.shape[0] < t * k or scratch.shape[1] != nbytes or scratch.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"gather_blocks: scratch {scratch.dtype} {tuple(scratch.shape)} cannot hold {t * k} blocks "
                         f"of {nbytes} bytes from src {src.dtype} {tuple(src.shape)}")
    lo, hi = byte_range if byte_range is not None else (0, nbytes)
    if not 0 <= lo < hi <= nbytes:
        raise ValueError(f"gather_blocks: byte range [{lo}, {hi}) is not inside a block of {nbytes} bytes")
    if not ids.is_contiguous():
        ids = ids.contiguous()
    slots = torch.empty((t, k), dtype=torch.int64, device=scratch.device)
    if t * k == 0:
        return slots
    word = _word_bytes(src, scratch, bounds=(lo, hi))
    if skip is not None and not skip.whole_words:
        word = 1       # (never for real layouts: parts and rows are multiples of 16 bytes) ranges in whole bytes
    s, d = (src.view(torch.int32), scratch.view(torch.int32)) if word == 4 else (src, scratch)
    chunk = triton.next_power_of_2(max(1, chunk_bytes // word))
    count = (hi - lo) // word
    _gather_kernel[(t * k, triton.cdiv(count, chunk))](
        s, ids, table if table is not None else ids, 0 if table is None else table.shape[0], d, slots, s.shape[1],
        lo // word, count, ids if skip is None else skip.split, ids if skip is None else skip.parts,
        LOOKUP=table is not None, CHUNK=chunk, ABLOCK=max(16, triton.next_power_of_2(t * k)),
        SKIP=skip is not None, NPARTS=0 if skip is None else skip.parts.shape[0], WORD=word, num_warps=NUM_WARPS)
    return slots


def gather_blocks_reference(src: torch.Tensor, ids: torch.Tensor, scratch: torch.Tensor, *,
                            table: torch.Tensor | None = None,
                            byte_range: tuple[int, int] | None = None,
                            skip: RowSkip | None = None) -> torch.Tensor:
    """The same in torch (CPU tests and devices without Triton)."""
    t, k = ids.shape
    lo, hi = byte_range if byte_range is not None else (0, src.shape[1])
    keys = ids.reshape(-1).tolist()
    if table is not None:
        inside = (ids >= 0) & (ids < table.shape[0])
        ids = torch.where(inside, table[ids.clamp(0, table.shape[0] - 1)], -1)
    rows = ids.reshape(-1).tolist()
    slots, first = [], {}
    for a, (key, row) in enumerate(zip(keys, rows)):
        owner = first.setdefault(key, a)
        slots.append(owner if row >= 0 else -1)
        if row >= 0 and owner == a and (skip is None or a != int(skip.split[0])):
            scratch[a, lo:hi] = src[row, lo:hi].to(scratch.device)
        elif row >= 0 and owner == a:                        # the split expert: all but the CPU's rows
            keep = torch.zeros(src.shape[1], dtype=torch.bool)
            keep[lo:hi] = True
            for off, per in skip.parts.tolist():
                keep[off:off + int(skip.split[1]) * per] = False
            idx = torch.nonzero(keep)[:, 0]
            scratch[a, idx.to(scratch.device)] = src[row, idx].to(scratch.device)
    return torch.tensor(slots, dtype=torch.int64, device=scratch.device).view(t, k)
