"""The decode kernels (Triton) on a machine without a GPU: run by Triton's interpreter against the plain-torch
references over a grid of shapes, and compiled for the H200 (sm_90) with Triton's bundled ptxas.

- `runtime/kernels/int4_pool_triton.py::pool_forward_triton` (2 launches) against
  `runtime/kernels/expert_pool.py::pool_forward`: int4 groups 32/64/128 (a short last group too), MXFP4,
  both activations, T = 1/3/8 with K = 8/2/8, slots of -1, bf16 activations and weights, int32 and strided
  slot tables, garbage bytes where no valid slot points.
- `runtime/kernels/router_triton.py::route` (1 launch) against `runtime/models/blocks.py`'s routings:
  E = 8/128/256/512, K = 2/8/10, fp32 and bf16 logits, renormalise on/off, both routings, ties (to the
  lowest index), -inf.

How the interpreter is switched on: in Triton 3.x `TRITON_INTERPRET` is read by `triton.jit` when it
decorates a kernel (`triton.knobs.runtime.interpret`), and triton.language's own helpers (tl.sum, tl.cdiv,
...) are decorated when triton is imported; so the variable must be set before triton is imported at all.
In a pytest session other modules have imported triton (runtime.experts.hybrid imports the pool kernels),
so the cases run in ONE worker subprocess started with the variable set: each test below sends its case
(a `case_*` function of this module, run there) and fails with the worker's traceback if it raised.
The interpreter runs each program in Python, so the shapes are small and tiles are widened where the tile
choice is not itself under test.
"""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from runtime.experts.interface import ExpertSpec
from runtime.kernels.expert_pool import pool_forward
from runtime.models.blocks import route_softmax_topk, route_topk_softmax
from tests.test_hybrid_kernels import make_store

if sys.platform != "linux":
    pytest.skip("triton is a test dependency on Linux only (pyproject [test])", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_S = 120
_REPLY = "@@case-reply "
_WORKER = f"""
import json, os, sys, traceback
os.environ["TRITON_INTERPRET"] = "1"          # before anything imports triton
sys.path.insert(0, {str(ROOT)!r})
import torch
torch.set_num_threads(1)
import tests.test_kernels_interpreted as cases
for line in sys.stdin:
    req = json.loads(line)
    try:
        getattr(cases, "case_" + req["case"])(**req["kwargs"])
        reply = {{"ok": True}}
    except BaseException:
        reply = {{"ok": False, "error": traceback.format_exc()}}
    print({_REPLY!r} + json.dumps(reply), flush=True)
"""


class _Worker:
    """A Python process whose triton runs every kernel in the interpreter; runs `case_*` functions."""

    def __init__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def run(self, case: str, **kwargs) -> None:
        self.proc.stdin.write(json.dumps({"case": case, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                self.log.seek(0)
                pytest.fail(f"interpreter worker gave no reply to case {case!r} (exit {self.proc.poll()}); "
                            f"its stderr:\n{self.log.read()[-4000:]}")
            if line.startswith(_REPLY):
                reply = json.loads(line[len(_REPLY):])
                if not reply["ok"]:
                    pytest.fail(f"case {case}({kwargs}) in the interpreter:\n{reply['error']}", pytrace=False)
                return

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def interpreter():
    import triton
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        # triton 3.6's interpreter cannot use a runtime scalar as a loop bound (seen on the GPU machine, which
        # then runs the compiled kernels instead: tests/test_hybrid_kernels.py and the cuda cases below)
        pytest.skip(f"Triton's interpreter before 3.7 cannot run these kernels (this is {triton.__version__})")
    worker = _Worker()
    yield worker
    worker.close()


def _kernels():
    """The kernel modules as this process imported them (in the worker: interpreted)."""
    from runtime.kernels import int4_pool_triton, router_triton
    return int4_pool_triton, router_triton


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-6))


# ------------------------------------------------------------------------------------------ pool kernels

POOL_GRID = [  # codec, group, fp4 format, hidden, width, activation, K at batch 1, its tiles (None: the
    # plan's), a 16-bit activation dtype
    ("int4", 32, "", 64, 32, "silu", 8, None, "bfloat16"),
    ("int4", 64, "", 128, 96, "gpt_oss", 8, 16, "float16"),
    ("int4", 128, "", 256, 64, "silu", 10, 32, "bfloat16"),     # K 10: the down tile pads the experts to 16
    ("int4", 64, "", 96, 40, "silu", 8, 64, "float16"),         # short last groups in both directions
    ("fp4", 32, "mxfp4", 128, 64, "silu", 10, None, "bfloat16"),
]


def case_pool_matches_torch(codec, group, fmt, d, i, activation, k1, bn1, half):
    pool_k, _ = _kernels()
    store = make_store(codec, group, fmt, d, i, False, experts=6)
    spec = ExpertSpec(activation=activation)
    assert pool_k.supports(store.layout, spec)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    gen = torch.Generator().manual_seed(d * 1000 + i)
    # (T, K, block_n): batch 1 (with the tiles the GPU would pick where bn1 is None: the narrowest), then more
    # tokens with wide tiles (the interpreter's time grows with the number of programs)
    for t, k, block_n in ((1, k1, bn1), (3, 2, 128), (8, 8, 128)):
        x = torch.randn(t, d, generator=gen)
        slots = torch.randint(-1, 6, (t, k), generator=gen)                   # -1: computed elsewhere
        slots[0, 0] = -1
        weights = torch.rand(t, k, generator=gen)
        want = pool_forward(pool, store.layout, spec, x, slots, weights)
        got = pool_k.pool_forward_triton(pool, store.layout, spec, x, slots, weights, block_n=block_n)
        assert got.shape == (t, d) and got.dtype == x.dtype
        assert _rel(got, want) < 1e-5, (t, k, _rel(got, want))
    # 16-bit activations (read as 32-bit words of pairs) and weights and an int32 slot table, as the engine
    # may hand them over; the reference takes the same rounded inputs in fp32
    dt = getattr(torch, half)
    got16 = pool_k.pool_forward_triton(pool, store.layout, spec, x.to(dt), slots.int(), weights.to(dt), block_n=32)
    want16 = pool_forward(pool, store.layout, spec, x.to(dt).float(), slots, weights.to(dt).float())
    # h and y round to the 16-bit dtype (h as the torch path rounds its activations; this reference keeps h in
    # fp32), and the interpreter rounds bf16 by truncation: two biased roundings of up to 2^-8 each
    tol = 1e-2 if dt == torch.bfloat16 else 2e-3
    assert got16.dtype == dt and _rel(got16, want16) < tol, (dt, _rel(got16, want16))


def case_gate_up_reads_nothing_of_the_down_part():
    pool_k, _ = _kernels()
    for codec, group, fmt in (("int4", 64, ""), ("fp4", 32, "mxfp4")):
        store = make_store(codec, group, fmt, 128, 64, False, experts=4)
        layout = store.layout
        cut = pool_k.down_offset(layout)
        assert cut == layout.parts["down"].offset > 0
        pool = torch.from_numpy(store.layer_buffer(0).copy())
        clean = pool.clone()
        pool[:, cut:] = 0xFF                                                  # the down parts not yet copied: NaNs
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(2, 128, generator=gen)
        slots = torch.tensor([[0, 3], [2, -1]])
        h, looked = pool_k.pool_gate_up_triton(pool, layout, ExpertSpec(), x, slots)
        h_clean, _ = pool_k.pool_gate_up_triton(clean, layout, ExpertSpec(), x, slots)
        assert torch.equal(h[:3], h_clean[:3]) and torch.isfinite(h[:3]).all() and looked is slots
        pool[:, cut:] = clean[:, cut:]                                        # the down parts land
        weights = torch.rand(2, 2, generator=gen)
        y = pool_k.pool_down_triton(pool, layout, h, looked, weights, out_dtype=x.dtype)
        assert torch.equal(y, pool_k.pool_forward_triton(clean, layout, ExpertSpec(), x, slots, weights))
    # a layout whose gate/up parts do not all lie below its down part cannot be gathered in two parts
    from dataclasses import replace
    parts = dict(layout.parts)
    parts["up"] = replace(parts["up"], offset=layout.nbytes - parts["up"].nbytes)
    assert pool_k.down_offset(replace(layout, parts=parts)) == 0


def test_gate_up_reads_nothing_of_the_down_part(interpreter):
    """Zero-copy decode may run the gate/up kernel while the down parts of the missed blocks are still being
    copied (hybrid.py `split_gather`): it must read nothing at or above `down_offset` (NaN bytes there leave h
    the same), and its h with the down launch after gives pool_forward_triton's very bits, for int4 and MXFP4."""
    interpreter.run("gate_up_reads_nothing_of_the_down_part")


@pytest.mark.parametrize("codec, group, fmt, d, i, activation, k1, bn1, half", POOL_GRID)
def test_pool_kernels_match_torch(interpreter, codec, group, fmt, d, i, activation, k1, bn1, half):
    interpreter.run("pool_matches_torch", codec=codec, group=group, fmt=fmt, d=d, i=i, activation=activation,
                    k1=k1, bn1=bn1, half=half)


def case_pool_skips_minus_one_over_garbage_and_reads_strides():
    pool_k, _ = _kernels()
    store = make_store("int4", 64, "", 128, 64, False, experts=6)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    clean = pool.clone()
    pool[0] = 0xFF                                                            # fp16 0xFFFF is NaN
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 128, generator=gen)
    table = torch.tensor([[3, -1, 5], [-1, -1, 2], [1, -1, -1]])              # [K, T]: read transposed
    slots = table.t()                                                         # [T, K], strides (1, 3)
    assert slots.tolist() == [[3, -1, 1], [-1, -1, -1], [5, 2, -1]]
    weights = torch.rand(3, 3, generator=gen).t()
    got = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights, block_n=32)
    want = pool_forward(clean, store.layout, ExpertSpec(), x, slots.contiguous(), weights.contiguous())
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros(128))                              # no expert computed here
    assert _rel(got, want) < 1e-5


def test_pool_kernels_skip_slots_of_minus_one_over_garbage_and_read_strides(interpreter):
    """-1 slots touch nothing: slot 0 full of NaN bytes, pointed at only by -1s, must not leak; a token
    whose K slots are all -1 gives exact zeros. Slot and weight tables may be strided views."""
    interpreter.run("pool_skips_minus_one_over_garbage_and_reads_strides")


def case_pool_reads_strided_16bit_rows():
    pool_k, _ = _kernels()
    store = make_store("int4", 32, "", 64, 32, False, experts=6)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 80, generator=gen).bfloat16()
    slots, weights = torch.tensor([[1, -1], [4, 2], [-1, 0]]), torch.rand(3, 2, generator=gen)
    # row stride 80 and a 2-element offset: read in place as words; 1-element offset: copied first (a word
    # would straddle two pairs)
    for x in (wide[:, 2:66], wide[:, 1:65], wide[:, 3:67]):
        got = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights, block_n=32)
        dense = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x.contiguous(), slots, weights,
                                           block_n=32)
        want = pool_forward(pool, store.layout, ExpertSpec(), x.float(), slots, weights)
        assert torch.equal(got, dense)                                       # the same words, wherever they lie
        assert _rel(got, want) < 1e-2, _rel(got, want)                       # h and y rounded to bf16


def test_pool_kernels_read_strided_16bit_rows(interpreter):
    """16-bit activations are read as 32-bit words of element pairs: rows at even and odd offsets give the
    same results (the copy of odd ones, which a GPU needs for aligned words, is checked in the launch test:
    the interpreter does not fault on a misaligned word)."""
    interpreter.run("pool_reads_strided_16bit_rows")


def case_pool_tile_overrides_agree():
    pool_k, _ = _kernels()
    store = make_store("fp4", 32, "mxfp4", 128, 64, False, experts=6)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, generator=gen)
    slots = torch.tensor([[0, 4], [5, -1]])
    weights = torch.rand(2, 2, generator=gen)
    base = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights, block_n=32)
    other = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights, block_n=8, block_k=4)
    assert _rel(other, base) < 1e-6                                           # reassociated, same sums
    assert _rel(base, pool_forward(pool, store.layout, ExpertSpec(), x, slots, weights)) < 1e-5


def test_pool_kernels_tile_overrides_agree(interpreter):
    """Different tiles (an override narrower than a group is widened to one group) give the same sums up to
    fp32 reassociation: the tile only changes how rows and bytes are spread over programs."""
    interpreter.run("pool_tile_overrides_agree")


def case_pool_plans_agree_bit_for_bit():
    pool_k, _ = _kernels()
    store = make_store("int4", 32, "", 128, 96, False, experts=6)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 128, generator=gen).bfloat16()
    slots = torch.tensor([[0, 4, -1], [5, 1, 2]])
    weights = torch.rand(2, 3, generator=gen)
    plan = pool_k.KernelPlan
    # rows of 64 / 48 bytes in steps of 16: unrolled (4 and 3 steps) or a loop, with or without the prefetch
    runs = [pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights,
                                       plans=(plan(8, 16, 4, st1, pf), plan(4, 16, 4, st2, pf)))
            for st1, st2 in ((4, 3), (0, 0)) for pf in (False, True)]
    for other in runs[1:]:
        assert torch.equal(other, runs[0])                 # the same sums in the same order: the same bits
    want = pool_forward(pool, store.layout, ExpertSpec(), x.float(), slots, weights)
    assert _rel(runs[0], want) < 1e-2


def test_pool_kernel_plans_agree_bit_for_bit(interpreter):
    """Unrolling a row's steps and prefetching the next step's codes reorder loads, not sums: every plan of the
    same tile gives the same bits."""
    interpreter.run("pool_plans_agree_bit_for_bit")


def case_pool_looks_up_slots_in_the_table():
    pool_k, _ = _kernels()
    store = make_store("int4", 64, "", 128, 64, False, experts=6)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(3, 128, generator=gen)
    weights = torch.rand(3, 4, generator=gen)
    # a layer's table: 10 experts, 6 of them resident at scrambled slots
    for dtype in (torch.int32, torch.int64):
        table = torch.tensor([[9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
                              [3, -1, 0, 5, -1, 1, -1, 2, 4, -1]], dtype=dtype)
        ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 2]])
        slots = table[1][ids].long()
        got = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, ids, weights, slot_table=table[1],
                                         block_n=32)
        want = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights, block_n=32)
        assert torch.equal(got, want)
        assert _rel(got, pool_forward(pool, store.layout, ExpertSpec(), x, slots, weights)) < 1e-5
    # ids outside the table (never from a router, but never a read out of bounds either) count as not resident
    odd = torch.tensor([[-1, 10, 0, 2], [4, 5, 6, 7], [8, 9, 0, 2]])
    got = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, odd, weights, slot_table=table[1],
                                     block_n=32)
    slots = torch.where((odd >= 0) & (odd < 10), table[1][odd.clamp(0, 9)], -1).long()
    assert torch.equal(got, pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights,
                                                       block_n=32))


def test_pool_kernels_look_up_slots_in_the_table(interpreter):
    """With `slot_table` (a layer's expert->slot row) the kernels take expert ids and look the slots up
    themselves, giving exactly what the looked-up slots give; ids outside the row are skipped like -1."""
    interpreter.run("pool_looks_up_slots_in_the_table")


def case_gather_copies_the_missed_blocks():
    from runtime.kernels import gather_triton as gk
    gen = torch.Generator().manual_seed(5)
    for nbytes in (96, 50):                       # 16-byte rows (4-byte words) and odd rows (single bytes)
        src = torch.randint(0, 256, (10, nbytes), generator=gen, dtype=torch.uint8)
        ids = torch.tensor([[3, -1, 7], [0, 9, -1]])
        got, want = torch.full((8, nbytes), 7, dtype=torch.uint8), torch.full((8, nbytes), 7, dtype=torch.uint8)
        slots = gk.gather_blocks(src, ids, got, chunk_bytes=32)           # several chunks per block
        assert torch.equal(slots, torch.tensor([[0, -1, 2], [3, 4, -1]]))
        assert torch.equal(slots, gk.gather_blocks_reference(src, ids, want))
        assert torch.equal(got, want)
        assert torch.equal(got[0], src[3]) and torch.equal(got[4], src[9])
        assert bool((got[1] == 7).all()) and bool((got[5:] == 7).all())   # nothing written where nothing copied
        # expert ids looked up in a layer's miss row (expert -> host row, -1 resident); ids outside it skipped
        table = torch.tensor([9, -1, 8, 7, -1, 6, 5, 4, 3, 2])
        e = torch.tensor([[0, 1, 2], [11, -1, 5]])
        got, want = torch.zeros(6, nbytes, dtype=torch.uint8), torch.zeros(6, nbytes, dtype=torch.uint8)
        slots = gk.gather_blocks(src, e, got, table=table)
        assert torch.equal(slots, torch.tensor([[0, -1, 2], [-1, -1, 5]]))
        assert torch.equal(slots, gk.gather_blocks_reference(src, e, want, table=table))
        assert torch.equal(got, want) and torch.equal(got[5], src[6])
        # tokens of a call that share an expert: copied once, the later assignments point at the first one's row
        ids = torch.tensor([[3, 7, -1], [7, 3, 5]])
        got, want = torch.full((6, nbytes), 7, dtype=torch.uint8), torch.full((6, nbytes), 7, dtype=torch.uint8)
        slots = gk.gather_blocks(src, ids, got)
        assert torch.equal(slots, torch.tensor([[0, 1, -1], [1, 0, 5]]))
        assert torch.equal(slots, gk.gather_blocks_reference(src, ids, want)) and torch.equal(got, want)
        assert bool((got[2:5] == 7).all()) and torch.equal(got[5], src[5])          # rows 3 and 4: not copied
        e = torch.tensor([[0, 2, 5], [5, 2, 1]])                                     # 1: resident (-1)
        got, want = torch.zeros(6, nbytes, dtype=torch.uint8), torch.zeros(6, nbytes, dtype=torch.uint8)
        slots = gk.gather_blocks(src, e, got, table=table)
        assert torch.equal(slots, torch.tensor([[0, 1, 2], [2, 1, -1]]))
        assert torch.equal(slots, gk.gather_blocks_reference(src, e, want, table=table)) and torch.equal(got, want)
        # byte ranges: two launches, the first bytes then the rest, copy what one does; a range alone writes only
        # its bytes (16-byte bounds take 4-byte words, others single bytes)
        ids = torch.tensor([[3, 7, -1], [7, 3, 5]])
        whole = torch.full((6, nbytes), 7, dtype=torch.uint8)
        gk.gather_blocks(src, ids, whole)
        for cut in (48, 37):
            got, want = torch.full((6, nbytes), 7, dtype=torch.uint8), torch.full((6, nbytes), 7, dtype=torch.uint8)
            first = gk.gather_blocks(src, ids, got, byte_range=(0, cut), chunk_bytes=16)
            assert torch.equal(got[:, cut:], want[:, cut:])                         # the rest: not yet written
            second = gk.gather_blocks(src, ids, got, byte_range=(cut, nbytes), chunk_bytes=16)
            assert torch.equal(got, whole) and torch.equal(first, second)
            gk.gather_blocks_reference(src, ids, want, byte_range=(0, cut))
            gk.gather_blocks_reference(src, ids, want, byte_range=(cut, nbytes))
            assert torch.equal(want, whole)
        got = torch.zeros(6, nbytes, dtype=torch.uint8)
        gk.gather_blocks(src, ids, got, byte_range=(5, 21))
        assert torch.equal(got[0, 5:21], src[3, 5:21]) and int(got[:, :5].sum()) == int(got[:, 21:].sum()) == 0
    for bad in ((0, 0), (30, 20), (0, 51)):
        try:
            gk.gather_blocks(src, ids, torch.zeros(6, 50, dtype=torch.uint8), byte_range=bad)
        except ValueError as exc:
            assert "byte range" in str(exc)
        else:
            raise AssertionError(f"the byte range {bad} was accepted")
    try:
        gk.gather_blocks(src, ids, torch.zeros(5, 50, dtype=torch.uint8))
    except ValueError as exc:
        assert "cannot hold 6 blocks" in str(exc)
    else:
        raise AssertionError("a scratch too small for the call was accepted")


def test_gather_copies_the_missed_blocks(interpreter):
    """The zero-copy decode's gather kernel copies block ids[t, k] (or table[ids]) to scratch row t*K + k, in
    chunks, for 16-byte and odd block sizes; rows of -1 (hits, the CPU's share, ids outside the table) are
    neither read nor written; an expert several tokens share is copied once and its later assignments get the
    first one's row; the slots it returns are what the pool kernels take; a byte range copies only those bytes of
    each block (two ranges make the whole), and a range outside a block is refused; the torch reference agrees."""
    interpreter.run("gather_copies_the_missed_blocks")


def case_handoff_matches_the_reference():
    from runtime.experts.cpu_share import Mailbox, collect_reference, handoff_reference
    from runtime.kernels import handoff_triton as hk
    gen = torch.Generator().manual_seed(6)
    table = torch.tensor([-1, 3, -1, -1, 0, -1, 2, -1, -1, 1, -1, -1])          # expert -> pool slot, -1 missed
    cpu = torch.device("cpu")
    # (host: a share a layer, layer 2 host-only - a store pinned in part: the GPU may not read its misses)
    for share, error, host in ((0.0, 0, None), (0.5, 0, None), (1.0, 0, None), (0.5, 1, None), (0.25, 0, [2]),
                               (0.25, 1, [2]), (0.25, 0, [0, 3])):
        ids = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(3)])    # [T=3, K=4]
        w, x = torch.rand(3, 4, generator=gen), torch.randn(3, 40, generator=gen)
        boxes = [Mailbox(max_tokens=4, top_k=4, hidden=40, device=cpu, share=share, layers=4 if host else 1)
                 for _ in range(2)]
        logs = [torch.full((4, 4), -1, dtype=torch.int64) for _ in range(2)]
        for box in boxes:
            box.error.fill_(error)
            box.set_host_only(host or [])
        got = hk.handoff(2, ids, w, x, table, boxes[0], fence=False, log=logs[0])
        want = handoff_reference(2, ids, w, x, table, boxes[1], log=logs[1])
        assert all(torch.equal(g, h) for g, h in zip(got, want)), (share, got, want)
        assert torch.equal(logs[0], logs[1]) and torch.equal(logs[0][:3], ids) and bool((logs[0][3] == -1).all())
        a, b = boxes
        assert int(a.ncpu[0]) == int(b.ncpu[0]) and int(a.ticket[0]) == int(b.ticket[0])
        assert (int(a.ncpu[0]) > 0) == (share > 0 and not error)
        missed = int((table[ids] < 0).sum())
        if host and 2 in host:      # every miss the CPU's, none read over PCIe - after a failure, none at all
            assert bool((got[1] == -1).all()) and int(a.ncpu[0]) == (0 if error else missed)
        elif host:                  # another layer of the same mailbox keeps the share
            assert int((got[1] >= 0).sum()) == missed - int(missed * share + 0.5)
        if int(a.ncpu[0]):
            for name in ("req", "meta", "ids", "weights"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert torch.equal(a.x[:3], b.x[:3])
        # collect: the CPU's rows (answered already) and the hits' rows added to the misses' out, in fp32
        for box in boxes:
            box.resp.copy_(box.ticket)
            box.out.copy_(torch.arange(160, dtype=torch.float32).view(4, 40) / 7)
        misses = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
        hits = torch.randn(3, 80, generator=gen).to(torch.bfloat16)[:, ::2]           # strided rows refused...
        for extra in (None, hits.contiguous()):
            want = misses.float() + (0 if extra is None else extra.float())
            if int(a.ncpu[0]):
                want = want + a.out[:3]
            for warps in (4, 16, 0):                      # a program a token, one thread polling; or 256 columns
                got = hk.collect(misses.clone(), a, extra=extra, warps=warps)
                # (within one bf16 step: the interpreter truncates where the GPU rounds to nearest)
                torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)
                assert int(a.error[0]) == error
            ref = collect_reference(misses.float(), b, extra=None if extra is None else extra.float())
            torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)
        if int(a.ncpu[0]):                                # an answer that never comes: bounded, the flag up
            for warps in (4, 0):
                a.resp.fill_(-5)
                a.error.zero_()
                got = hk.collect(misses.clone(), a, max_spins=3, warps=warps)
                assert int(a.error[0]) == 1, warps
                a.resp.copy_(a.ticket)
        try:
            hk.collect(misses.clone(), a, extra=hits)
        except ValueError as exc:
            assert "do not match" in str(exc)
        else:
            raise AssertionError("strided extra rows were taken")
        try:
            hk.collect(misses.clone(), a, warps=3)
        except ValueError as exc:
            assert "power of two" in str(exc)
        else:
            raise AssertionError("a program of 3 warps was launched")
    try:
        hk.handoff(0, ids, w, x, table, boxes[0], fence=False, log=torch.zeros(5, dtype=torch.int64))
    except ValueError as exc:
        assert "cannot take 12 ids" in str(exc)
    else:
        raise AssertionError("a log too short for the ids was taken")


def test_handoff_matches_the_reference_and_writes_the_step_log(interpreter):
    """The handoff kernel (the CPU's share of a zero-copy call, into the mailbox) gives the torch reference's hit
    slots, zero-copy ids, request, mailbox rows and counters at shares 0, 0.5 and 1 and with the error flag up,
    and writes the call's ids into the tier's step log (T < the log's rows: the rest untouched); a log too short
    is refused. collect adds the CPU's answer (when the call had a CPU share) and the hits' rows (when given) to
    the misses' rows, summed in fp32, as the reference does; strided hits' rows are refused."""
    interpreter.run("handoff_matches_the_reference")


def case_the_finer_split():
    from runtime.experts.cpu_share import Mailbox, cpu_split, handoff_reference, split_row_parts, split_unit_rows
    from runtime.kernels import gather_triton as gk
    from runtime.kernels import handoff_triton as hk
    pool_k, _ = _kernels()
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(16)
    # the handoff: one token splits one miss by rows as cpu_split says (fp32, op for op); two tokens do not
    table = torch.tensor([-1, 3, -1, -1, 0, -1, 2, -1, -1, 1, -1, -1])
    splits = 0
    for t, share, error in [(1, s / 20, 0) for s in range(21)] + [(1, 0.45, 1), (2, 0.45, 0)]:
        ids = torch.stack([torch.randperm(12, generator=gen)[:6] for _ in range(t)])
        w, x = torch.rand(t, 6, generator=gen), torch.randn(t, 40, generator=gen)
        boxes = [Mailbox(max_tokens=2, top_k=6, hidden=40, device=cpu, share=share, intermediate=48)
                 for _ in range(2)]
        for box in boxes:
            box.enable_split(72)
            box.error.fill_(error)
        got = hk.handoff(1, ids, w, x, table, boxes[0], fence=False)
        want = handoff_reference(1, ids, w, x, table, boxes[1])
        assert all(torch.equal(g, h) for g, h in zip(got, want)), (share, got, want)
        a, b = boxes
        assert torch.equal(a.split, b.split) and torch.equal(a.ncpu, b.ncpu), (share, a.split, b.split)
        n_miss = int((table[ids] < 0).sum())
        whole, rows = cpu_split(n_miss, share, unit=72, inter=48, tokens=t)
        if error:
            whole = rows = 0
        assert a.split.tolist()[1] == rows and int(a.ncpu[0]) == whole + (rows > 0)
        if rows:
            splits += 1
            sa = int(a.split[0])
            assert int(got[1].view(-1)[sa]) == int(ids.view(-1)[sa]) >= 0      # the GPU's miss, split
            assert a.meta.tolist() == [1, 1, int(ids.view(-1)[sa]), 0, rows] == b.meta.tolist()
        if int(a.ncpu[0]):
            for name in ("req", "meta", "ids", "weights"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert splits >= 8
    # an expert the call names twice is gathered once for both: it is never the split one (the CUDA graph test's
    # ids found it on the GPU), whether the split would land on its first naming or its second
    for row, share in (([5, 2, 7, 2, 8, 0], 0.25), ([2, 5, 2, 7, 8, 0], 0.4), ([5, 2, 7, 1, 8, 0], 0.25)):
        ids, w, x = torch.tensor([row]), torch.rand(1, 6, generator=gen), torch.randn(1, 40, generator=gen)
        boxes = [Mailbox(max_tokens=2, top_k=6, hidden=40, device=cpu, share=share, intermediate=48)
                 for _ in range(2)]
        for box in boxes:
            box.enable_split(72)
        got = hk.handoff(1, ids, w, x, table, boxes[0], fence=False)
        want = handoff_reference(1, ids, w, x, table, boxes[1])
        assert all(torch.equal(g, h) for g, h in zip(got, want)) and torch.equal(boxes[0].meta, boxes[1].meta)
        whole, rows = cpu_split(int((table[ids] < 0).sum()), share, unit=72, inter=48)
        assert rows > 0 and whole in (1, 2)                 # the rule alone would split here
        twice = row.count(2) == 2
        assert boxes[0].split.tolist() == ([-1, 0] if twice else [1, rows]), (row, boxes[0].split)
        assert int(boxes[0].ncpu[0]) == whole + (not twice) == int(boxes[1].ncpu[0])
    # the gather leaves behind the chunks wholly inside the CPU's rows of the split assignment's gate/up parts (the
    # reference: exactly those rows), and copies every other byte
    src = torch.randint(0, 256, (10, 96), generator=gen, dtype=torch.uint8)
    ids = torch.tensor([[3, 7, 5, -1]])
    for parts, left in (([(0, 16), (48, 16)], 64), ([(0, 8), (50, 3)], 16)):   # 16-byte words; single bytes
        skip = gk.RowSkip.of(torch.tensor([1, 2], dtype=torch.int32), parts)   # assignment 1, two rows
        assert skip.whole_words == (parts[1][1] == 16)
        got, want = torch.full((4, 96), 7, dtype=torch.uint8), torch.full((4, 96), 7, dtype=torch.uint8)
        slots = gk.gather_blocks(src, ids, got, skip=skip, chunk_bytes=16)
        assert torch.equal(slots, gk.gather_blocks_reference(src, ids, want, skip=skip))
        cpu_rows = torch.zeros(96, dtype=torch.bool)
        for lo, per in parts:
            cpu_rows[lo:lo + 2 * per] = True
        assert torch.equal(want[1, ~cpu_rows], src[7, ~cpu_rows]) and bool((want[1, cpu_rows] == 7).all())
        assert torch.equal(got[1, ~cpu_rows], src[7, ~cpu_rows])                  # every byte the GPU needs
        behind = got[1] != src[7]
        assert int(behind.sum()) == left and bool((got[1, behind] == 7).all()) and not bool(behind[~cpu_rows].any())
        assert torch.equal(got[[0, 2]], want[[0, 2]]) and torch.equal(got[0], src[3]) and torch.equal(got[2], src[5])
    # the gate/up kernel takes the split assignment's first rows from the mailbox, once its ticket is there
    for codec, group, fmt in (("int4", 32, ""), ("fp4", 32, "mxfp4")):
        store = make_store(codec, group, fmt, 64, 64, False, experts=4)
        layout = store.layout
        assert split_row_parts(layout)[0][0] == layout.parts["gate"].offset
        assert 1.4 * 64 < split_unit_rows(layout) < 1.6 * 64
        pool = torch.from_numpy(store.layer_buffer(0).copy())
        x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
        slots = torch.tensor([[0, 3, 2]])
        box = Mailbox(max_tokens=1, top_k=3, hidden=64, device=cpu, share=0.5, intermediate=64)
        box.split.copy_(torch.tensor([1, 32], dtype=torch.int32))
        box.part.copy_(torch.randn(64, generator=gen))
        box.ticket.fill_(5)
        box.part_resp.fill_(5)
        plain, _ = pool_k.pool_gate_up_triton(pool, layout, ExpertSpec(), x, slots, block_n=16)
        hk.take_split_rows(box)                                               # the rows into device memory...
        assert torch.equal(box.part_dev[:32], box.part[:32]) and not bool(box.part_dev[32:].any())
        h = hk.fill_split_rows(plain.clone(), box)                            # ...then into h
        # (within one bf16 step: the interpreter truncates where the GPU rounds to nearest)
        torch.testing.assert_close(h[1, :32].float(), box.part[:32], rtol=8e-3, atol=1e-6)
        assert torch.equal(h[1, 32:], plain[1, 32:]) and not torch.equal(h[1, :32], plain[1, :32])
        assert torch.equal(h[0], plain[0]) and torch.equal(h[2], plain[2]) and int(box.error[0]) == 0
        box.split.copy_(torch.tensor([-1, 0], dtype=torch.int32))              # no split: nothing taken or filled
        box.part_dev.zero_()
        hk.take_split_rows(box)
        assert not bool(box.part_dev.any()) and torch.equal(hk.fill_split_rows(plain.clone(), box), plain)
        box.split.copy_(torch.tensor([2, 48], dtype=torch.int32))
        box.part_resp.fill_(4)                                                # the CPU never answers: bounded
        hk.take_split_rows(box, max_spins=3)
        assert int(box.error[0]) == 1


def test_the_finer_split_kernels_match_the_reference(interpreter):
    """The finer split (a one-token call's CPU share in rows of one more expert, cpu_share.py) in the kernels:
    the handoff picks the assignment and rows the reference does at every share (fp32, op for op), none with the
    error flag up or for two tokens; the gather leaves behind the chunks wholly inside the CPU's rows of that
    assignment's gate/up parts and copies everything else (4-byte words and single bytes); `take_split_rows`
    copies the CPU's rows into device memory once their ticket is there (giving up after max_spins with the error
    flag up), and after the gate/up kernel `fill_split_rows` writes them into that assignment's first rows
    (rounded to h's dtype) and nothing else; neither does anything without a split."""
    interpreter.run("the_finer_split")


def test_pool_tile_plan_fills_the_gpu_at_batch_one_and_stays_in_budget():
    """qwen3-30b-a3b's shape (D 2048, I 768, K 8) and qwen3.5's (I 512, K 10) on 132 SMs: batch 1 gets
    narrow tiles and at least PROGRAMS_PER_SM programs per SM where the outputs allow; every plan keeps
    whole groups per step and a tile (rows x bytes) within TILE_ELEMENTS unless one group is wider."""
    m, _ = _kernels()
    for t in (1, 2, 8, 64, 511):
        for jobs, n_out, fan, n_in in ((t * 8, 768, 2, 2048), (t, 2048, 8, 768), (t * 10, 512, 2, 2048),
                                       (t, 2048, 16, 512)):
            for group in (32, 64, 128):
                bn, bk = m.tile_sizes(jobs, n_out, fan, n_in, group, sms=132)
                assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0
                assert m.MIN_BLOCK_N <= bn <= m.MAX_BLOCK_N and bk >= group // 2
                assert bn * fan * bk <= max(m.TILE_ELEMENTS, m.MIN_BLOCK_N * fan * group // 2)
                if bn > m.MIN_BLOCK_N and bn < m.MAX_BLOCK_N:
                    assert jobs * -(-n_out // bn) >= m.PROGRAMS_PER_SM * 132
    assert m.tile_sizes(8, 768, 2, 2048, 64, sms=132)[0] <= 8                # batch 1: narrow
    assert m.tile_sizes(4088, 768, 2, 2048, 64, sms=132)[0] == 32            # prefill-sized: widest
    assert m.tile_sizes(8, 768, 2, 2048, 64, sms=132, block_n=64) == (64, 32)  # an override, BLOCK_K fitted


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` is recorded, nothing runs."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, tuple(grid), args, kwargs))


def _torch_ops(fn):
    """Run fn; return its result and the torch ops it dispatched, views left out (they launch nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        out = fn()
    return out, ops


def test_pool_forward_is_two_launches_and_nothing_else(monkeypatch):
    """The host side of a decode call: two allocations sized by shapes (h, y) and the two kernel launches;
    no torch kernel around them (no token-id arange, no where/cast/sum), so 2 launches in a CUDA graph."""
    pool_k, _ = _kernels()
    launches = []
    monkeypatch.setattr(pool_k, "_gate_up_kernel", _LaunchRecorder("gate_up", launches))
    monkeypatch.setattr(pool_k, "_down_kernel", _LaunchRecorder("down", launches))
    store = make_store("int4", 64, "", 128, 96, False, experts=6)
    pool = torch.from_numpy(store.layer_buffer(0).copy())
    x = torch.randn(3, 128).bfloat16()
    slots, weights = torch.randint(-1, 6, (3, 8)), torch.rand(3, 8).bfloat16()
    y, ops = _torch_ops(lambda: pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, weights))
    assert [name for name, *_ in launches] == ["gate_up", "down"]
    assert sorted(ops) == ["empty.memory_format"] * 2, ops
    (_, grid1, args1, _), (_, grid2, args2, const2) = launches
    assert grid1[0] == 3 * 8 and grid2[0] == 3 and grid2[1] == -(-128 // const2["BLOCK_N"])
    assert args2[9] is y and y.dtype == torch.bfloat16 and y.shape == (3, 128)   # written in place, x's dtype
    assert args1[2] is slots and args2[5] is weights                              # read as given, no copies
    assert args1[8] is x
    # with a slot table: the ids go in, one more shape-sized allocation for the looked-up slots, still 2 launches
    launches.clear()
    table = torch.tensor([2, -1, 0, 1, 3, 4], dtype=torch.int32)
    ids = torch.randint(0, 6, (3, 8))
    _, ops = _torch_ops(lambda: pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, ids, weights,
                                                           slot_table=table))
    assert [name for name, *_ in launches] == ["gate_up", "down"]
    assert sorted(ops) == ["empty.memory_format"] * 3, ops
    (_, _, gu_args, gu_const), (_, _, dn_args, _) = launches
    assert gu_args[2] is ids and gu_args[5] is table and gu_const["LOOKUP"]
    assert dn_args[2] is gu_args[7] and dn_args[2].dtype == torch.int32 and dn_args[2].shape == (3, 8)
    with pytest.raises(ValueError, match="slot_table"):
        pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, ids, weights, slot_table=table.view(2, 3))
    # 16-bit rows read as 32-bit words: a view at an odd element offset is copied (aligned) first
    wide = torch.randn(3, 160).bfloat16()
    for view, in_place in ((wide[:, 2:130], True), (wide[:, 1:129], False)):
        launches.clear()
        pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), view, slots, weights)
        x_arg = launches[0][2][8]
        assert (x_arg is view) == in_place and x_arg.data_ptr() % 4 == 0 and torch.equal(x_arg, view)


def test_route_is_one_launch_and_nothing_else(monkeypatch):
    _, router_k = _kernels()
    launches = []
    monkeypatch.setattr(router_k, "_route_kernel", _LaunchRecorder("route", launches))
    logits = torch.randn(2, 128).bfloat16()
    (ids, weights), ops = _torch_ops(lambda: router_k.route(logits, 8, mode="topk_softmax",
                                                            out_dtype=torch.bfloat16))
    assert [name for name, *_ in launches] == ["route"] and launches[0][1] == (2,)
    assert sorted(ops) == ["empty.memory_format"] * 2, ops
    assert ids.dtype == torch.int64 and weights.dtype == torch.bfloat16 and ids.shape == weights.shape == (2, 8)


# ------------------------------------------------------------------------------------------ router


def _stable_topk_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk's ids with ties broken towards the lower index (torch leaves the tie order unspecified)."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[..., :k]


def case_router_matches_torch(e, k, dtype):
    _, router_k = _kernels()
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(e + k)
    logits = (torch.randn(3, e, generator=gen) * 2).to(dtype)
    ids_ref = _stable_topk_ids(logits, k)
    for renormalize in (False, True):
        ids, w = router_k.route(logits, k, mode="softmax_topk", renormalize=renormalize)
        _, w_ref = route_softmax_topk(logits, k, renormalize=renormalize)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (3, k)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)
    ids, w = router_k.route(logits, k, mode="topk_softmax", out_dtype=dtype)
    _, w_ref = route_topk_softmax(logits, k)
    assert torch.equal(ids, ids_ref) and w.dtype == dtype
    torch.testing.assert_close(w.float(), w_ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6)
    # the picked logits are torch.topk's values (its ids may order ties differently on the CPU)
    assert torch.equal(logits.gather(1, ids), torch.topk(logits, k, dim=-1).values)


@pytest.mark.parametrize("e, k", [(8, 2), (60, 4), (128, 8), (256, 8), (512, 10)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_router_matches_torch_routings(interpreter, e, k, dtype):
    interpreter.run("router_matches_torch", e=e, k=k, dtype=dtype)


def case_router_ties_infinities_and_shapes():
    _, router_k = _kernels()
    route = router_k.route
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 1.0, 1.0, 1.0]]).bfloat16()
    ids, w = route(tied, 5, mode="softmax_topk", renormalize=True)
    assert ids.tolist() == [[1, 2, 4, 0, 5]]
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    inf = float("-inf")
    masked = torch.tensor([[inf, 0.5, inf, inf, 2.0, inf]])
    ids, w = route(masked, 4, mode="topk_softmax")
    assert ids.tolist() == [[4, 1, 0, 2]]
    assert w[0, 2:].tolist() == [0.0, 0.0] and abs(float(w.sum()) - 1.0) < 1e-6
    nan_row = torch.tensor([[0.5, float("nan"), 2.0, -1.0]])
    for mode in ("softmax_topk", "topk_softmax"):
        ids, w = route(nan_row, 2, mode=mode)
        assert ids.tolist() == [[1, 2]] and torch.isnan(w).all()             # NaN ranks first, as in torch
    wide = torch.randn(2, 3, 40)
    view = wide[..., 4:36]                                                    # [2, 3, 32], row stride 40
    ids, w = route(view, 3, mode="softmax_topk", renormalize=False)
    assert ids.shape == (2, 3, 3)
    assert torch.equal(ids, _stable_topk_ids(view, 3))
    torch.testing.assert_close(w, route_softmax_topk(view.reshape(6, 32), 3, renormalize=False)[1].view(2, 3, 3))


def test_router_ties_infinities_and_shapes(interpreter):
    """Ties go to the lowest index; -inf logits are still picked (distinct ids) when k exceeds the finite
    ones; a NaN ranks first and makes the weights NaN; leading dimensions and a strided row are taken as
    they come."""
    interpreter.run("router_ties_infinities_and_shapes")


def case_route_linear_matches_linear_then_route(e, k, dtype):
    _, router_k = _kernels()
    import torch.nn.functional as F
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(e * 7 + k)
    d = 96
    x = torch.randn(3, d, generator=gen).to(dtype)
    weight = (torch.randn(e, d, generator=gen) * 0.2).to(dtype)
    bias = torch.randn(e, generator=gen).to(dtype)
    for b, modes in ((None, (("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False))),
                     (bias, (("topk_softmax", False),))):
        logits = F.linear(x, weight, b)                                       # [N, E] in x's dtype, as the model
        for mode, renorm in modes:
            ids, w = router_k.route_linear(x, weight, b, k, mode=mode, renormalize=renorm)
            assert ids.shape == w.shape == (3, k) and ids.dtype == torch.int64
            if dtype == torch.float32:                                        # no ties: torch's very ids
                ref_ids, ref_w = router_k.route(logits, k, mode=mode, renormalize=renorm)
                assert torch.equal(ids, ref_ids), (mode, renorm)
                torch.testing.assert_close(w, ref_w, rtol=1e-4, atol=1e-6)
            else:
                # 16-bit logits tie often and the fp32 sums may round one unit apart: the picks are torch's top-k
                # up to a unit in the last place, and the weights follow the logits
                picked = logits.float().gather(1, ids)
                kth = torch.topk(logits.float(), k, dim=-1).values[:, -1:]
                assert torch.all(picked >= kth - 2 * kth.abs() * 2 ** -7), (mode, renorm)
                assert torch.all(ids.sort(dim=1).values[:, 1:] != ids.sort(dim=1).values[:, :-1])   # distinct
                if mode == "topk_softmax" or renorm:
                    torch.testing.assert_close(w.sum(1), torch.ones(3), rtol=1e-5, atol=1e-5)
    # the count is back at zero after every call: a second call (or a graph replay) ranks again
    again, _ = router_k.route_linear(x, weight, None, k)
    assert torch.equal(again, router_k.route_linear(x, weight, None, k)[0])
    assert int(router_k._counters[x.device].abs().sum()) == 0


@pytest.mark.parametrize("e, k, dtype", [(8, 2, "float32"), (128, 8, "float32"), (128, 8, "bfloat16"),
                                         (60, 4, "bfloat16")])
def test_route_linear_matches_linear_then_route(interpreter, e, k, dtype):
    """The router GEMV fused with the ranking (the last program of a token ranks its row): torch's Linear then
    the routings, with and without a bias, for every mode."""
    interpreter.run("route_linear_matches_linear_then_route", e=e, k=k, dtype=dtype)


def test_route_linear_is_one_launch_and_refuses_bad_shapes(monkeypatch):
    _, router_k = _kernels()
    launches = []
    monkeypatch.setattr(router_k, "_route_linear_kernel", _LaunchRecorder("route_linear", launches))
    monkeypatch.setitem(router_k._counters, torch.device("cpu"), torch.zeros(router_k.LINEAR_MAX_ROWS,
                                                                             dtype=torch.int32))
    x, weight = torch.randn(1, 2048).bfloat16(), torch.randn(128, 2048).bfloat16()
    (ids, w), ops = _torch_ops(lambda: router_k.route_linear(x, weight, None, 8, out_dtype=torch.bfloat16))
    assert [name for name, *_ in launches] == ["route_linear"]
    assert launches[0][1] == (1, 128 // launches[0][3]["ROWS"]) and launches[0][1][1] >= 64
    assert sorted(ops) == ["empty.memory_format"] * 3, ops                   # ids, weights, the logits' scratch
    assert ids.shape == w.shape == (1, 8) and w.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="do not agree"):
        router_k.route_linear(x, weight[:, :100], None, 8)
    with pytest.raises(ValueError, match="tokens"):
        router_k.route_linear(torch.randn(router_k.LINEAR_MAX_ROWS + 1, 2048), weight.float(), None, 8)


def case_decode_attention_matches_sdpa(h, hkv, hd, bucket, dtype):
    from runtime.kernels import decode_attention_triton as da
    import torch.nn.functional as F
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(h * hd + bucket)
    cap = bucket + 8                                                          # the cache's rows: more than the bucket
    keys = torch.randn(hkv, cap, hd, generator=gen).to(dtype)
    values = torch.randn(hkv, cap, hd, generator=gen).to(dtype)
    for pos in sorted({0, 5, bucket // 2 + 3, bucket - 1}):
        q = torch.randn(1, h, hd, generator=gen).to(dtype)
        got = da.decode_attention(q, keys, values, torch.tensor([pos]), scale=hd ** -0.5, bucket=bucket)
        mask = (torch.arange(bucket) <= pos)[None, :]
        want = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys[None, :, :bucket].float(),
                                              values[None, :, :bucket].float(), attn_mask=mask, scale=hd ** -0.5,
                                              enable_gqa=True)[0].transpose(0, 1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2                        # p rounded to bf16 before p.v
        assert got.shape == q.shape and got.dtype == dtype
        assert _rel(got, want) < tol, (pos, _rel(got, want))
        assert int(da._counters[q.device].abs().sum()) == 0                  # counts back at zero
    # keys past the query's row are never read: NaN there changes nothing
    keys[:, bucket // 2 + 4:] = float("nan")
    values[:, bucket // 2 + 4:] = float("nan")
    q = torch.randn(1, h, hd, generator=gen).to(dtype)
    got = da.decode_attention(q, keys, values, torch.tensor([bucket // 2 + 3]), scale=hd ** -0.5, bucket=bucket)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("h, hkv, hd, bucket, dtype", [(8, 2, 64, 32, "float32"), (8, 2, 64, 256, "bfloat16"),
                                                       (32, 4, 128, 128, "float32")])
def test_decode_attention_matches_sdpa(interpreter, h, hkv, hd, bucket, dtype):
    """The split-KV decode kernel against SDPA over the bucket with the key mask: one split and several,
    GQA 4:1 and 8:1, fp32 and bf16; only keys up to the query's row are read (NaN past it stays out)."""
    interpreter.run("decode_attention_matches_sdpa", h=h, hkv=hkv, hd=hd, bucket=bucket, dtype=dtype)


def test_router_rejects_bad_arguments():
    _, router_k = _kernels()
    route = router_k.route
    with pytest.raises(ValueError, match="mode"):
        route(torch.randn(2, 8), 2, mode="sigmoid")
    with pytest.raises(ValueError, match="top-k of 9 out of 8"):
        route(torch.randn(2, 8), 9)
    with pytest.raises(ValueError, match="floating"):
        route(torch.ones(2, 8, dtype=torch.int64), 2)
    ids, w = route(torch.randn(0, 8), 2)                                      # nothing to launch
    assert ids.shape == w.shape == (0, 2)


# ------------------------------------------------------------------------------------------ compiled for sm_90


def _compile_sm90(fn, args: dict, constexprs: dict, warps: int, tmp_path: Path, *,
                  stages: int | None = None) -> tuple[int, int, str]:
    """Compile a kernel for sm_90 as a launch with `args` would: pointers (strings: their type) and ints
    that are multiples of 16 marked divisible by 16, as Triton specialises them; `stages` the launch's
    num_stages (None: Triton's default). -> (registers a thread, local-memory bytes, SASS)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for idx, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        value = args[name]
        sig[name] = value if isinstance(value, str) else "fp32" if isinstance(value, float) else "i32"
        if isinstance(value, str) or (isinstance(value, int) and value % 16 == 0):
            attrs[(idx,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    cubin = tmp_path / f"{fn.__name__}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage, re.S)
    assert found, usage
    return int(found.group(1)), int(found.group(2)), sass


def test_kernels_compile_for_h200_without_spilling(tmp_path, monkeypatch):
    """The interpreter does not check GPU code generation (layouts of reshape/split, register use): compile
    the variants the engine launches at qwen3-30b-a3b's shape (int4/64, K 8) and an MXFP4 K-10 one for
    sm_90 with the ptxas Triton ships, with bf16, fp16 and fp32 activations, the zero-copy gather (and its finer
    split: the gather leaving the CPU's rows, the fill kernel waiting for them), and the CPU share's handoff (with and without
    the step log: its system-scope fence is there) and collect (with and without the hits' rows). No register spills, and the
    packed codes are read 16 bytes per load (a select over offsets, once, hid their alignment and made it
    16 byte loads)."""
    from runtime.experts.host_store import BlockLayout
    from runtime.kernels import int4_pool_triton as pool_k, router_triton as router_k

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))                  # a real compile, not a cache hit
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    cases = []
    # codec, group, D, I, K, then (T, activation dtype) pairs: batch 1 and prefill-sized tiles
    for codec, group, d, i, k, runs in (("int4", 128, 2048, 768, 8, ((1, "bf16"), (64, "fp16"))),
                                        ("int4", 64, 2048, 768, 8, ((1, "bf16"),)),
                                        ("fp4", 32, 2048, 512, 10, ((1, "fp32"),))):
        layout = BlockLayout.build(codec, d, i, group=group)
        off = {name: part.offset for name, part in layout.parts.items()}
        common = dict(pool_ptr="*u8", nbytes=layout.nbytes, slots_ptr="*i64", slot_st=k, slot_sk=1, K=k, I=i)
        gate_up = dict(common, table_ptr="*i32", E=128, slots_out="*i32", x_st=d, D2=d // 2, DG=-(-d // group),
                       gq=off["gate"], gs=off["gate_scales"], gm=off.get("gate_mins", 0), uq=off["up"],
                       us=off["up_scales"], um=off.get("up_mins", 0), alpha=1.702, limit=7.0)
        down = dict(common, w_st=k, w_sk=1, D=d, I2=i // 2, IG=-(-i // group),
                    dq=off["down"], ds=off["down_scales"], dm=off.get("down_mins", 0))
        c = 0 if codec == "int4" else 1
        kb = 16 if k > 8 else 8
        for t, dtype in runs:
            h = "*" + dtype if dtype != "fp32" else "*fp32"                  # h in x's dtype when 16-bit
            gu, dn = pool_k.default_plans(t, k, layout, sms=132)
            for lookup in (False, True) if t == 1 else (False,):
                cases.append((pool_k._gate_up_kernel, dict(gate_up, x_ptr="*" + dtype, h_ptr=h),
                              dict(CODEC=c, GROUP=group, ACT=0, LOOKUP=lookup, BLOCK_N=gu.block_n,
                                   BLOCK_K=gu.block_k, STEPS=gu.steps, PREFETCH=gu.prefetch,
                                   EVEN=(d // 2) % gu.block_k == 0, ROWS_ALL=i % gu.block_n == 0), gu.warps))
            cases.append((pool_k._down_kernel, dict(down, w_ptr="*" + dtype, y_ptr="*" + dtype, h_ptr=h),
                          dict(CODEC=c, GROUP=group, KB=kb, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
                               STEPS=dn.steps, PREFETCH=dn.prefetch,
                               EVEN=(i // 2) % dn.block_k == 0), dn.warps))
    router = dict(logits_ptr="*bf16", row_stride=512, ids_ptr="*i64", w_ptr="*fp32", E=512)
    cases.append((router_k._route_kernel, router, dict(K=10, MODE=0, RENORM=True, BLOCK_E=512, BLOCK_K=16), 1))
    cases.append((router_k._route_kernel, dict(router, E=128, row_stride=128),                 # gpt-oss
                  dict(K=4, MODE=1, RENORM=False, BLOCK_E=128, BLOCK_K=4), 1))
    cases.append((router_k._route_linear_kernel,                                              # fused router
                  dict(x_ptr="*bf16", x_stride=2048, gate_ptr="*bf16", gate_stride=2048, bias_ptr="*bf16",
                       logits_ptr="*fp32", count_ptr="*i32", ids_ptr="*i64", w_ptr="*bf16", D=2048, E=128),
                  dict(K=8, MODE=0, RENORM=True, HAS_BIAS=False, ROWS=2, BLOCK_D=2048, BLOCK_E=128, BLOCK_K=8), 4))
    from runtime.kernels import decode_attention_triton as attn_k
    for hd in (128, 256):                                           # decode attention: qwen3-30b's, qwen3.6's heads
        cases.append((attn_k._decode_attention_kernel,
                      dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", rows_ptr="*i64", out_ptr="*bf16",
                           part_o="*fp32", part_ml="*fp32", count_ptr="*i32", k_head_stride=2048 * hd,
                           k_row_stride=hd, scale_log2=0.1, G=8, HD=hd, chunk=64),
                      dict(SPLITS=16, BLOCK_S=64, BLOCK_G=16, BLOCK_D=hd, DOT_FP32=False), 4))
    from runtime.kernels import gather_triton as gather_k
    words = 2506752 // 4                                           # qwen3-30b-a3b's int4/128 block
    for lookup, first, count, skip in ((False, 0, words, False), (True, 0, words, False),       # zero-copy gather
                                       (True, 0, 1671168 // 4, True),                        # (gate/up, a split)
                                       (True, 1671168 // 4, words - 1671168 // 4, False)):   # (its down part)
        cases.append((gather_k._gather_kernel,
                      dict(src_ptr="*i32", ids_ptr="*i64", table_ptr="*i64", E=128, dst_ptr="*i32", slots_ptr="*i64",
                           words=words, first=first, count=count, split_ptr="*i32", parts_ptr="*i64"),
                      dict(LOOKUP=lookup, CHUNK=gather_k.CHUNK_BYTES // 4, ABLOCK=32, SKIP=skip,
                           NPARTS=6 if skip else 0, WORD=4), gather_k.NUM_WARPS))
    from runtime.kernels import handoff_triton as handoff_k
    small = []                  # the CPU share's handoff and collect: a few words and rows, no wide loads to check
    for log, per_layer in ((False, False), (True, True)):      # (a share a layer: a store pinned in part)
        small.append((handoff_k._handoff_kernel,
                      dict(ids_ptr="*i64", w_ptr="*bf16", x_ptr="*bf16", x_st=2048, table_ptr="*i64", share_ptr="*fp32",
                           ticket_ptr="*i64", ncpu_ptr="*i32", hit_ptr="*i64", zc_ptr="*i64", box_ids_ptr="*i64",
                           box_w_ptr="*fp32", box_x_ptr="*fp32", box_meta_ptr="*i64", box_req_ptr="*i64",
                           err_ptr="*i32", log_ptr="*i64", split_ptr="*i32", unit_ptr="*fp32", times_ptr="*i64",
                           layer=3, T=1, A=8, D=2048, I=768),
                      dict(RING=8192, TIMES=True, FENCE=True, LOG=log, SHARE_PER_LAYER=int(per_layer), ABLOCK=16,
                           DBLOCK=1024), 4))
    small.append((handoff_k._clock_ping_kernel,
                  dict(req_ptr="*i64", resp_ptr="*i64", g_ptr="*i64", n="i32", first="i64", max_spins="i32"), {}, 1))
    small.append((handoff_k._take_split_kernel,
                  dict(split_ptr="*i32", part_ptr="*fp32", part_dev_ptr="*fp32", part_resp_ptr="*i64",
                       ticket_ptr="*i64", err_ptr="*i32", max_spins=100_000_000), dict(BLOCK=1024, POLL_LANES=128), 4))
    small.append((handoff_k._fill_split_kernel,
                  dict(h_ptr="*bf16", I=768, split_ptr="*i32", part_dev_ptr="*fp32"), dict(BLOCK=256), 1))
    for extra in (False, True):             # (collect's one thread a token polling, and every warp)
        for block, lanes, warps in ((2048, 128, 4), (2048, 512, 16), (256, 0, 2)):
            small.append((handoff_k._collect_kernel,
                          dict(out_ptr="*bf16", out_st=2048, extra_ptr="*bf16", extra_st=2048, ticket_ptr="*i64",
                               ncpu_ptr="*i32", box_resp_ptr="*i64", box_out_ptr="*fp32", err_ptr="*i32",
                               times_ptr="*i64", D=2048, max_spins=100_000_000),
                          dict(RING=8192, TIMES=True, EXTRA=extra, BLOCK=block, POLL_LANES=lanes), warps))
    for fn, args, constexprs, warps in cases + small:
        regs, local, sass = _compile_sm90(fn, args, constexprs, warps, tmp_path)
        assert local == 0, (fn.__name__, constexprs, regs, local)               # no spills
        if fn is not router_k._route_kernel and (fn, args, constexprs, warps) not in small:
            assert "LDG.E.128" in sass, (fn.__name__, constexprs)
        if fn is handoff_k._collect_kernel and constexprs["POLL_LANES"]:
            # one poller: the row's fp32 read 16 bytes a load, each thread's share in 2048 / 4 / (32 * warps) loads
            # (4 at 4 warps: s19a's 2.8 µs an add; 1 at 16, as the 256-column programs' 1.4 µs)
            assert sass.count("LDG.E.128.STRONG.SYS") == 2048 // 4 // (32 * warps), (warps, sass[:2000])
        if fn is handoff_k._handoff_kernel:
            # the system-scope fence before the ticket
            fences = sass.count("MEMBAR.ALL.SYS") + sass.count("MEMBAR.SC.SYS")
            assert fences == 1, (constexprs, fences, sass[:2000])


def test_gdn_decode_kernels_compile_for_h200_without_spilling(tmp_path, monkeypatch):
    """The fused Gated DeltaNet decode step at qwen3.6-35b-a3b's shape (C 8,192 channels, W 4; 16 key and 32 value
    heads of 128; bf16), with and without slot indices, compiles for sm_90 without register spills (a [128, 128]
    fp32 state tile a program)."""
    from runtime.kernels import gdn_decode_triton as gdn_k

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    for slots in (False, True):
        conv = dict(mixed_ptr="*bf16", mixed_st=8192, conv_ptr="*bf16", conv_ss=8192 * 3 * 30, conv_sc=3,
                    slots_ptr="*i64", w_ptr="*bf16", y_ptr="*bf16", C=8192)
        regs, local, _ = _compile_sm90(gdn_k._conv_kernel, conv, dict(W=4, WB=4, HAS_SLOTS=slots,
                                                                      BLOCK=gdn_k.CONV_BLOCK), 4, tmp_path)
        assert local == 0, ("conv", slots, regs, local)
        rec = dict(y_ptr="*bf16", C=8192, key_dim=2048, z_ptr="*bf16", z_st=4096, b_ptr="*bf16", b_st=32,
                   a_ptr="*bf16", a_st=32, rec_ptr="*fp32", rec_ss=32 * 128 * 128 * 30, slots_ptr="*i64",
                   alog_ptr="*bf16", dtb_ptr="*bf16", nw_ptr="*bf16", out_ptr="*bf16", out_st=4096, Hv=32,
                   scale=128 ** -0.5, eps=1e-6, qk_eps=1e-6)
        regs, local, _ = _compile_sm90(gdn_k._recurrent_kernel, rec, dict(R=2, DK=128, DV=128, BK=128, BV=128,
                                                                          HAS_SLOTS=slots), 8, tmp_path)
        assert local == 0, ("recurrent", slots, regs, local)


def test_int8_linear_kernels_compile_for_h200_without_spilling(tmp_path, monkeypatch):
    """The int8 weight-only linear kernel with its default plans at decode shapes (bf16): an attention projection
    (M 1, N 5,120, K 2,048) and a narrow one (M 4, N 2,048, K 4,096), both split over K, with the reduce
    launch, and lm_head (M 1, N 151,936, K 2,048), compiles for sm_90 without register spills, the weights read 16 bytes
    per load (at the default 3 stages, as cp.async copies into shared memory)."""
    import triton

    from runtime.kernels import int8_linear_triton as int8_k

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    splits = set()
    for m, n, k in ((1, 5120, 2048), (4, 2048, 4096), (1, 151936, 2048)):
        plan = int8_k.plan(m, n, k)
        splits.add(plan.split_k)
        args = dict(x_ptr="*bf16", x_stride=k, q_ptr="*i8", scale_ptr="*fp32", bias_ptr="*fp32", out_ptr="*bf16",
                    out_stride=n, part_ptr="*fp32", M=m, N=n, K=k,
                    k_chunk=triton.cdiv(triton.cdiv(k, plan.block_k), plan.split_k) * plan.block_k)
        constexprs = dict(HAS_BIAS=False, SPLIT_K=plan.split_k, BLOCK_M=int8_k.BLOCK_M, BLOCK_N=plan.block_n,
                          BLOCK_K=plan.block_k, EVEN_K=k % plan.block_k == 0, DOT_FP32=False)
        regs, local, sass = _compile_sm90(int8_k._int8_linear_kernel, args, constexprs, plan.warps, tmp_path,
                                          stages=plan.stages)
        assert local == 0, ((m, n, k), plan, regs, local)                     # no spills
        # 16-byte loads: plain, or the pipeliner's asynchronous copies to shared memory (stages > 1)
        assert re.search(r"LDG(STS)?\.E(\.BYPASS)?\.128", sass), ((m, n, k), plan)
        if plan.split_k > 1:
            reduce_args = dict(part_ptr="*fp32", scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
                               out_stride=n, M=m, N=n)
            regs, local, _ = _compile_sm90(int8_k._int8_reduce_kernel, reduce_args,
                                           dict(HAS_BIAS=True, SPLIT_K=plan.split_k, BLOCK_N=int8_k.REDUCE_BLOCK_N),
                                           int8_k.NUM_WARPS, tmp_path)
            assert local == 0, ("reduce", plan, regs, local)
    assert splits == {4, 8, 1}                                                # lm_head alone is not split


# ------------------------------------------------------------------------------------------ on the GPU machine


@pytest.mark.cuda
@pytest.mark.parametrize("e, k", [(128, 8), (512, 10), (32, 4)])
def test_router_on_cuda_matches_torch(device, e, k):
    """Compiled, on the GPU (`pytest --device cuda`): ids in stable-sort order (ties to the lowest index;
    bf16 logits of few distinct values tie often) picking exactly torch.topk's values, and equal to its ids
    where a row has no ties; weights within fp32 rounding; and it replays in a graph."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels run on the GPU machine: pytest --device cuda")
    from runtime.kernels.router_triton import route

    gen = torch.Generator().manual_seed(e)
    tied = (torch.randint(-6, 6, (64, e), generator=gen).float() / 4).bfloat16()          # many ties
    distinct = torch.stack([torch.randperm(e, generator=gen) for _ in range(64)]).float() / e
    for logits in (tied.cuda(), distinct.cuda()):
        for renormalize in (False, True):
            ids, w = route(logits, k, mode="softmax_topk", renormalize=renormalize)
            ids_ref, w_ref = route_softmax_topk(logits, k, renormalize=renormalize)
            assert torch.equal(ids, _stable_topk_ids(logits, k))
            assert torch.equal(logits.gather(1, ids), logits.gather(1, ids_ref))
            torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)
        ids, w = route(logits, k, mode="topk_softmax", out_dtype=torch.bfloat16)
        ids_ref, w_ref = route_topk_softmax(logits, k)
        assert torch.equal(logits.gather(1, ids), logits.gather(1, ids_ref))
        torch.testing.assert_close(w.float(), w_ref.float(), rtol=1e-2, atol=1e-6)
    assert torch.equal(ids, ids_ref)                                          # no ties: torch's very ids
    row = logits[:1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_ids, g_w = route(row, k, mode="topk_softmax", out_dtype=torch.bfloat16)
    row.copy_(logits[5:6])
    graph.replay()
    assert torch.equal(g_ids, ids_ref[5:6]) and torch.equal(g_w, w[5:6])


@pytest.mark.cuda
def test_pool_plans_and_lookup_on_cuda(device):
    """Compiled, on the GPU (`pytest --device cuda`), at qwen3-30b-a3b's shape (int4 g128, D 2048, I 768, K 8):
    every plan the sweep (benchmarks/sweep_pool_kernels.py) may pick gives the default's bits, the slot-table
    lookup gives the looked-up slots' bits, and the lookup records and replays in a CUDA graph."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels run on the GPU machine: pytest --device cuda")
    from runtime.kernels import int4_pool_triton as pool_k

    store = make_store("int4", 128, "", 2048, 768, False, experts=12)
    pool = torch.from_numpy(store.layer_buffer(0).copy()).cuda()
    gen = torch.Generator().manual_seed(23)
    table = torch.randperm(16, generator=gen)[:16].int()
    table[table >= 12] = -1                                                 # 4 of 16 experts not resident
    table = table.cuda()
    for t in (1, 4):
        ids = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(t)]).cuda()
        slots = table.long()[ids]
        x = torch.randn(t, 2048, generator=gen).cuda().bfloat16()
        w = torch.rand(t, 8, generator=gen).cuda().bfloat16()
        base = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, w)
        want = pool_forward(pool, store.layout, ExpertSpec(), x, slots, w)
        assert _rel(base, want) < 2e-2
        gu, dn = pool_k.default_plans(t, 8, store.layout, sms=132)
        plan = pool_k.KernelPlan
        # unrolled or not, prefetched or not: the same sums in the same order
        for other in ((plan(gu.block_n, gu.block_k, gu.warps, gu.steps, not gu.prefetch), dn),
                      (plan(gu.block_n, gu.block_k, gu.warps, 0, False), plan(dn.block_n, dn.block_k, dn.warps, 0,
                                                                               not dn.prefetch))):
            assert torch.equal(pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, w,
                                                          plans=other), base)
        # other warps or tiles reduce in another order (fp32 reassociation, then h's bf16 rounding)
        for other in ((plan(gu.block_n, gu.block_k, 8, gu.steps, gu.prefetch), plan(4, 128, 8, 3, True)),
                      (plan(16, 64, 4, 0, True), plan(1, 128, 4, 3, False))):
            got = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, w, plans=other)
            assert _rel(got, base) < 1e-2
        assert torch.equal(pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x, ids, w,
                                                      slot_table=table), base)
    ids1, x1, w1 = ids[:1].clone(), x[:1].clone(), w[:1].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x1, ids1, w1, slot_table=table)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x1, ids1, w1, slot_table=table)
    for row in range(1, 4):
        ids1.copy_(ids[row:row + 1])
        x1.copy_(x[row:row + 1])
        w1.copy_(w[row:row + 1])
        graph.replay()
        want = pool_k.pool_forward_triton(pool, store.layout, ExpertSpec(), x1, table.long()[ids1], w1)
        assert torch.equal(out, want)


@pytest.mark.cuda
def test_route_linear_on_cuda(device):
    """Compiled (`pytest --device cuda`) at qwen3-30b-a3b's router (D 2048 -> E 128, top 8, bf16): the fused
    GEMV + ranking picks torch's top-k of F.linear's logits (up to a unit in the last place where they tie) with
    matching weights, and replays in a CUDA graph over new activations (the count resets each time)."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels run on the GPU machine: pytest --device cuda")
    import torch.nn.functional as F
    from runtime.kernels import router_triton as router_k

    gen = torch.Generator().manual_seed(29)
    weight = (torch.randn(128, 2048, generator=gen) * 0.02).cuda().bfloat16()
    xs = torch.randn(6, 2048, generator=gen).cuda().bfloat16()
    for n in (1, 4):
        x = xs[:n]
        logits = F.linear(x, weight)
        ids, w = router_k.route_linear(x, weight, None, 8, renormalize=True)
        ref_ids, ref_w = route_softmax_topk(logits, 8, renormalize=True)
        kth = torch.topk(logits.float(), 8, dim=-1).values[:, -1:]
        assert torch.all(logits.float().gather(1, ids) >= kth - 2 * kth.abs() * 2 ** -7)
        same = (ids.sort(1).values == ref_ids.sort(1).values).all(1)        # rows without a near-tie at the k-th
        torch.testing.assert_close(w[same].sort(1).values, ref_w[same].sort(1).values, rtol=2e-2, atol=1e-3)
    x1 = xs[:1].clone()
    router_k.route_linear(x1, weight, None, 8)                              # the counter exists before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_ids, g_w = router_k.route_linear(x1, weight, None, 8)
    for row in range(1, 6):
        x1.copy_(xs[row:row + 1])
        graph.replay()
        want_ids, want_w = router_k.route_linear(x1, weight, None, 8)
        assert torch.equal(g_ids, want_ids) and torch.equal(g_w, want_w)


def test_sparse_moe_fuses_the_routings_route_linear_covers():
    """SparseMoE hands decode-sized CUDA calls to route_linear for the routings it covers, with their options."""
    from functools import partial

    from runtime.models.blocks import _fused_routing

    assert _fused_routing(partial(route_softmax_topk, renormalize=True)) == ("softmax_topk", True)
    assert _fused_routing(partial(route_softmax_topk, renormalize=False)) == ("softmax_topk", False)
    assert _fused_routing(route_topk_softmax) == ("topk_softmax", False)
    assert _fused_routing(lambda logits, k, **kw: route_topk_softmax(logits, k)) is None       # unknown: unfused
    assert _fused_routing(partial(route_softmax_topk, renormalize=True, out_dtype=torch.float32)) is None


@pytest.mark.cuda
def test_sparse_moe_fused_router_on_cuda(device):
    """On the GPU machine: a qwen3-30b-a3b-sized SparseMoE routes decode tokens through route_linear and gives
    the unfused Linear + routing's experts and weights (rows without a near-tie at the k-th), prefill-sized
    calls keep the unfused path."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels run on the GPU machine: pytest --device cuda")
    from functools import partial

    from runtime.models.blocks import SparseMoE

    torch.manual_seed(3)
    moe = SparseMoE(hidden_size=2048, num_experts=128, top_k=8,
                    routing=partial(route_softmax_topk, renormalize=True)).cuda().bfloat16()
    seen = []
    experts = lambda layer, x, ids, w: seen.append((ids, w)) or x                    # noqa: E731
    for n in (1, 4, 100):
        x = torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16)
        moe(x, 0, experts)
        ids, w = seen[-1]
        ref_ids, ref_w = route_softmax_topk(moe.gate(x), 8, renormalize=True, out_dtype=x.dtype)
        same = (ids.sort(1).values == ref_ids.sort(1).values).all(1)
        assert same.float().mean() >= 0.75, (n, same)
        torch.testing.assert_close(w[same].float().sort(1).values, ref_w[same].float().sort(1).values,
                                   rtol=2e-2, atol=2e-3)
        if n == 100:
            assert torch.equal(ids, ref_ids)                                         # unfused: the same code


@pytest.mark.cuda
@pytest.mark.parametrize("h, hkv, hd, bucket, positions", [
    (32, 4, 128, 1024, (0, 63, 64, 700, 1023)),        # qwen3-30b-a3b: a 1K bucket
    (16, 2, 256, 1024, (0, 63, 64, 700, 1023)),        # qwen3.6-35b-a3b's full-attention layers
    (16, 2, 256, 4096, (2048, 3001, 4095)),            # a doubled bucket (decode_graph.bucket_of): its upper half
])
def test_decode_attention_on_cuda(device, h, hkv, hd, bucket, positions):
    """Compiled (`pytest --device cuda`) at each shape's attention (bf16, the bucket in a cache twice its size):
    against SDPA with the key mask at several positions, and recorded once in a CUDA graph that replays at other
    positions (the row is read on the device, the counts reset)."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels run on the GPU machine: pytest --device cuda")
    import torch.nn.functional as F
    from runtime.kernels import decode_attention_triton as da

    gen = torch.Generator().manual_seed(31)
    keys = torch.randn(hkv, 2 * bucket, hd, generator=gen).cuda().bfloat16()
    values = torch.randn(hkv, 2 * bucket, hd, generator=gen).cuda().bfloat16()
    q = torch.randn(1, h, hd, generator=gen).cuda().bfloat16()
    row = torch.tensor([0], device="cuda")

    def want(pos):
        mask = (torch.arange(bucket, device="cuda") <= pos)[None, :]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, :bucket],
                                              values[None, :, :bucket], attn_mask=mask, scale=hd ** -0.5,
                                              enable_gqa=True)[0].transpose(0, 1)

    for pos in positions:
        row.fill_(pos)
        got = da.decode_attention(q, keys, values, row, scale=hd ** -0.5, bucket=bucket)
        assert _rel(got, want(pos)) < 2e-2, (pos, _rel(got, want(pos)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, keys, values, row, scale=hd ** -0.5, bucket=bucket)
    for pos in (positions[0] + 5, positions[-1] - 24, (positions[0] + positions[-1]) // 2):
        row.fill_(pos)
        graph.replay()
        assert _rel(out, want(pos)) < 2e-2, pos
