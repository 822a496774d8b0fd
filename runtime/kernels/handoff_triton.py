"""Triton kernels that hand a decode call's CPU share to the CPU worker and take its answer back, from inside a
CUDA graph (runtime/experts/cpu_share.py has the worker, the mailbox and the torch/numpy references).

Why: a recorded decode step cannot stop for the host to decide which experts the CPU computes. So the GPU decides
(a rule the host can replay) and talks to a CPU thread through page-locked, device-mapped host memory:

- `handoff` (one program): expert ids [A = T*K] -> slots in the pool (hits), the misses the GPU reads over PCIe
  itself, and the misses the CPU computes: the first round(n_miss * share) misses in assignment order (the
  mailbox's share, or its layer's: a share past 1 marks a layer whose host memory the GPU cannot read). Writes
  the pool and zero-copy slot vectors to device memory, the CPU's ids, weights and the tokens' activations
  (fp32) to the mailbox, then - after a system-scope fence - the request's ticket, which starts the worker. No
  request when the CPU's share of this call is empty (`ncpu` = 0 tells `collect` not to wait), nor once the
  error flag is up: a worker that missed one answer gets no more in that step, the GPU reads every miss
  itself (one timeout a step, not one a layer: 48 of them had held a step for minutes). With the mailbox's
  `split_unit` set and one token, the rule is the finer split (`cpu_share.cpu_split`, op for op in fp32): the
  split miss stays in the GPU's ids, and `box.split` (device) says which assignment it is and how many of its
  first gate/up rows the CPU computes (`take_split_rows`/`fill_split_rows` take those from the mailbox).
- `take_split_rows` and `fill_split_rows` (one program each): the finer split's rows. The first waits for the CPU's
  `part_resp` ticket (bounded like collect) and copies the rows into device memory, between the two gathers, when
  nothing else crosses the link: a poll waits behind every read in flight (session 16 polled inside the gate/up
  kernel, then in one warp after it, beside the down parts' gather: the rows, ready early, were seen late, and
  the split's rows ran at half speed, then 3 % behind whole experts - s16a, s16c, s17a). The second writes them
  into the split expert's first rows of h after the gate/up kernel (which computed the others from the rows the
  gather left it).
- `collect` (a program a token): one thread spins on the mailbox's answer word until it holds the ticket
  (volatile loads over PCIe; gives up after `max_spins` and raises the error flag instead of hanging the GPU),
  then the program adds the CPU's fp32 row into the output.
- The mailbox's timeline (`Mailbox.times`, the GPU's %globaltimer): the handoff stamps a request before its ticket,
  collect when it starts, sees the answer and has added its rows (four stores a request; not in the interpreter).
  `clock_pings` times pings of a compiled CPU echo: they set the worker's cycle counter against that clock
  (runtime/experts/mailbox_clock.py), so `bench model` can split a round trip at the worker (session 18).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


if HAVE_TRITON:
    @triton.jit(do_not_specialize=["n", "first", "max_spins"])
    def _clock_ping_kernel(req_ptr, resp_ptr, g_ptr, n, first, max_spins):
        """n pings of a CPU echo: each stores first+i in req (out at once: a system fence after it) and polls resp
        until it comes back; g [n, 2] gets the GPU's clock before the store and after the echo (-1: no echo, and
        no more pings)."""
        alive = n > 0
        for i in range(n):
            if alive:
                g0 = globaltimer(i)
                v = first + i + _fence_system(i * 0).to(tl.int64)   # (after the clock read: asm stays in order)
                tl.store(req_ptr, v)
                v = v + _fence_system(i * 0).to(tl.int64)
                spins = 0
                while (tl.load(resp_ptr, volatile=True) != v) & (spins < max_spins):
                    spins += 1
                alive = spins < max_spins
                tl.store(g_ptr + 2 * i, g0)
                tl.store(g_ptr + 2 * i + 1, tl.where(alive, globaltimer(i), -1))

    @triton.jit
    def _fence_system(x):
        """A system-scope memory fence (the CPU must see the mailbox before the ticket) that no memory access
        moves across (a memory clobber); returns x."""
        return tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, $1;", "=r,r,~{memory}", [x], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def globaltimer(x):
        """The GPU's nanosecond clock (%globaltimer; x: any int32 scalar the result may not be hoisted above)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _handoff_kernel(ids_ptr, w_ptr, x_ptr, x_st, table_ptr, share_ptr, ticket_ptr, ncpu_ptr,
                        hit_ptr, zc_ptr, box_ids_ptr, box_w_ptr, box_x_ptr, box_meta_ptr, box_req_ptr, err_ptr,
                        log_ptr, split_ptr, unit_ptr, times_ptr, layer, T, A, D, I, RING: tl.constexpr,
                        TIMES: tl.constexpr, FENCE: tl.constexpr, LOG: tl.constexpr, SHARE_PER_LAYER: tl.constexpr,
                        ABLOCK: tl.constexpr, DBLOCK: tl.constexpr):
        a = tl.arange(0, ABLOCK)
        m = a < A
        ids = tl.load(ids_ptr + a, mask=m, other=0)
        if LOG:
            tl.store(log_ptr + a, ids, mask=m)                  # the step log's row: no copy kernel before this one
        slot = tl.load(table_ptr + ids, mask=m, other=0)
        miss = m & (slot < 0)
        miss_i = miss.to(tl.int32)
        rank = tl.cumsum(miss_i, 0) - miss_i                    # misses before this assignment
        n_miss = tl.sum(miss_i, 0)
        share = tl.load(share_ptr + layer * SHARE_PER_LAYER)
        work = n_miss.to(tl.float32) * share
        # the finer split (cpu_share.cpu_split: the same fp32 ops): whole misses, then rows of the next one
        unit = tl.load(unit_ptr)
        whole = tl.floor(work)
        rows = (work - whole) * unit
        past = rows >= (I * 1.0 + unit) * 0.5                 # nearer the whole expert than all its gate/up rows
        r = (tl.floor(rows * 0.0625 + 0.5) * 16.0).to(tl.int32)     # SPLIT_ROWS = 16
        n_split = tl.where(past, whole + 1.0, whole).to(tl.int32)
        r = tl.where(past | (n_split >= n_miss), 0, tl.minimum(r, I))
        split = (unit > 0) & (T == 1)
        n_cpu = tl.minimum(tl.where(split, n_split, (work + 0.5).to(tl.int32)), n_miss)   # (a host-only share: 2)
        r = tl.where(split, r, 0)
        failed = tl.load(err_ptr) != 0                        # the worker failed to answer: no more requests
        n_cpu = tl.where(failed, 0, n_cpu)
        r = tl.where(failed, 0, r)
        split_a = tl.min(tl.where(miss & (rank == n_cpu), a, ABLOCK), 0)
        # an expert the call names twice is gathered once for both (gather_triton's owner): the rows it would
        # leave behind for the CPU would be missing from the other assignment too - no split then (a real top-k
        # names an expert once a token; found by the CUDA graph test's ids on the GPU, s17t)
        split_id = tl.sum(tl.where(a == split_a, ids, 0), 0)
        twice = tl.sum((m & (ids == split_id)).to(tl.int32), 0) > 1
        r = tl.where(twice, 0, r)
        split_a = tl.where(r > 0, split_a, -1)
        cpu = miss & (rank < n_cpu)
        tl.store(hit_ptr + a, tl.where(m & (slot >= 0), slot, -1), mask=m)
        # a host-only layer (share past 1: host memory the GPU cannot read) never sends a miss over PCIe, not even
        # once the worker failed (its misses are then dropped and the tier reports the failure)
        n_read = tl.where(share <= 1.0, n_miss, 0)
        tl.store(zc_ptr + a, tl.where(miss & (rank >= n_cpu) & (rank < n_read), ids, -1), mask=m)
        tl.store(ncpu_ptr, n_cpu + (r > 0).to(tl.int32))
        tl.store(split_ptr, split_a)
        tl.store(split_ptr + 1, r)
        if (n_cpu > 0) | (r > 0):
            ticket = tl.load(ticket_ptr) + 1
            tl.store(ticket_ptr, ticket)
            tl.store(box_ids_ptr + a, tl.where(cpu, ids, -1), mask=m)
            tl.store(box_w_ptr + a, tl.load(w_ptr + a, mask=m, other=0.0).to(tl.float32), mask=m)
            for t in range(T):
                for d0 in range(0, D, DBLOCK):
                    cols = d0 + tl.arange(0, DBLOCK)
                    v = tl.load(x_ptr + t * x_st + cols, mask=cols < D, other=0.0).to(tl.float32)
                    tl.store(box_x_ptr + t * D + cols, v, mask=cols < D)
            tl.store(box_meta_ptr, layer)
            tl.store(box_meta_ptr + 1, T)
            tl.store(box_meta_ptr + 2, tl.where(r > 0, split_id, -1))
            tl.store(box_meta_ptr + 3, 0)                       # (a split's token: only one-token calls split)
            tl.store(box_meta_ptr + 4, r)
            tl.debug_barrier()                                  # every thread's mailbox stores issued...
            if FENCE:
                # ...and visible system-wide before the ticket: the ticket's value depends on the fence's output
                # (a zero the compiler cannot see through), so its store cannot move above the fence
                ticket += _fence_system(n_cpu * 0).to(tl.int64)
            if TIMES:                                           # the mailbox's timeline (box.times)
                tl.store(times_ptr + (ticket % RING) * 4, globaltimer(n_cpu))
            tl.store(box_req_ptr, ticket)

    @triton.jit
    def _read_once(word_ptr, LANES: tl.constexpr):
        """The int64 at word_ptr, read over PCIe by one thread of the program (volatile), for all of it. LANES (the
        program's threads, 32 * num_warps) gives every thread an element of its own, so only thread 0 loads: a
        scalar load is issued by every warp, and polls of one word queue one behind the other (s19a: collect's
        poll of a ticket already there took 8.6 µs from 16 warps, 1.5 from one thread)."""
        lane = tl.arange(0, LANES)
        return tl.sum(tl.load(word_ptr + lane * 0, mask=lane == 0, other=0, volatile=True), 0)

    @triton.jit
    def _await_ticket(word_ptr, ticket_ptr, err_ptr, max_spins, POLL_LANES: tl.constexpr):
        """Poll word_ptr (volatile: over PCIe each time) until it holds the call's ticket, at most max_spins
        times; past that the error flag goes up and the caller goes on (a lost answer must not hang the GPU).
        POLL_LANES: 0, every warp polls (kept for the A/B of s19a); else the program's thread count, and one
        thread polls (`_read_once`)."""
        ticket = tl.load(ticket_ptr)
        spins = 0
        if POLL_LANES == 0:
            while (tl.load(word_ptr, volatile=True) != ticket) & (spins < max_spins):
                spins += 1
        else:
            while (_read_once(word_ptr, POLL_LANES) != ticket) & (spins < max_spins):
                spins += 1
        if spins >= max_spins:
            tl.store(err_ptr, 1)

    @triton.jit
    def _collect_kernel(out_ptr, out_st, extra_ptr, extra_st, ticket_ptr, ncpu_ptr, box_resp_ptr, box_out_ptr,
                        err_ptr, times_ptr, D, max_spins, RING: tl.constexpr, TIMES: tl.constexpr,
                        EXTRA: tl.constexpr, BLOCK: tl.constexpr, POLL_LANES: tl.constexpr):
        t = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        n_cpu = tl.load(ncpu_ptr)
        v = tl.zeros([BLOCK], dtype=tl.float32)
        # the program that writes the mailbox's timeline (box.times): started, the answer's ticket seen, done
        first = (tl.program_id(0) == 0) & (t == 0) & TIMES
        times = times_ptr + (tl.load(ticket_ptr) % RING) * 4
        if n_cpu > 0:
            if first:
                tl.store(times + 1, globaltimer(n_cpu))
            _await_ticket(box_resp_ptr, ticket_ptr, err_ptr, max_spins, POLL_LANES)
            if first:
                tl.store(times + 2, globaltimer(n_cpu))         # (after the loop that read the ticket)
            v = tl.load(box_out_ptr + t * D + cols, mask=mask, other=0.0, volatile=True)
        if EXTRA:                                   # the hits' rows too: no add kernel of their own
            e = tl.load(extra_ptr + t * extra_st + cols, mask=mask, other=0.0).to(tl.float32)
            o = tl.load(out_ptr + t * out_st + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * out_st + cols, (o + e + v).to(out_ptr.dtype.element_ty), mask=mask)
        elif n_cpu > 0:
            o = tl.load(out_ptr + t * out_st + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * out_st + cols, (o + v).to(out_ptr.dtype.element_ty), mask=mask)
        if first & (n_cpu > 0):                     # (read once the rows came: the timer takes them as input)
            tl.store(times + 3, globaltimer(tl.sum(v, 0).to(tl.int32, bitcast=True)))

    @triton.jit
    def _take_split_kernel(split_ptr, part_ptr, part_dev_ptr, part_resp_ptr, ticket_ptr, err_ptr, max_spins,
                           BLOCK: tl.constexpr, POLL_LANES: tl.constexpr):
        rows = tl.load(split_ptr + 1)
        if (tl.load(split_ptr) >= 0) & (rows > 0):
            _await_ticket(part_resp_ptr, ticket_ptr, err_ptr, max_spins, POLL_LANES)
            r = tl.arange(0, BLOCK)                             # (BLOCK >= I: every row in one round trip)
            v = tl.load(part_ptr + r, mask=r < rows, other=0.0, volatile=True)
            tl.store(part_dev_ptr + r, v, mask=r < rows)

    @triton.jit
    def _fill_split_kernel(h_ptr, I, split_ptr, part_dev_ptr, BLOCK: tl.constexpr):
        a = tl.load(split_ptr)
        rows = tl.load(split_ptr + 1)
        if (a >= 0) & (rows > 0):
            for r0 in range(0, rows, BLOCK):
                r = r0 + tl.arange(0, BLOCK)
                v = tl.load(part_dev_ptr + r, mask=r < rows, other=0.0)
                tl.store(h_ptr + a.to(tl.int64) * I + r, v.to(h_ptr.dtype.element_ty), mask=r < rows)


def handoff(layer_index: int, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, table_row: torch.Tensor,
            box, *, fence: bool = True, log: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] int64 (contiguous), weights [T, K], x [T, D] -> (hit slots [T, K], zero-copy ids [T, K]) on the
    device; the CPU's share goes to `box` (a cpu_share.Mailbox). `log` (contiguous int64, >= T*K elements): gets
    the ids too (the tier's step log; a copy kernel of its own would sit between the router and the CPU's start).
    One launch. (A second system fence after the ticket, in case the GPU's caches held it back, measured no effect
    in s18b-c and was removed in session 19: the ~25 µs it was after lay in collect's polls.)"""
    t, k = ids.shape
    d = x.shape[1]
    if log is not None and (not log.is_contiguous() or log.numel() < t * k or log.dtype != ids.dtype):
        raise ValueError(f"handoff: a log of {log.dtype} {tuple(log.shape)} cannot take {t * k} ids of {ids.dtype}")
    hit, zc = box.hit_slots[:t * k].view(t, k), box.zc_ids[:t * k].view(t, k)
    per_layer = box.share.numel() > 1            # a share a layer (host-only layers), else one for all
    if per_layer and not 0 <= layer_index < box.share.numel():
        raise ValueError(f"handoff: layer index {layer_index} has no share in a mailbox of {box.share.numel()}")
    _handoff_kernel[(1,)](ids, weights.contiguous(), x, x.stride(0), table_row, box.share, box.ticket, box.ncpu,
                          hit, zc, box.ids, box.weights, box.x, box.meta, box.req, box.error,
                          ids if log is None else log, box.split, box.split_unit, box.times, layer_index, t, t * k,
                          d, box.intermediate, RING=box.times.shape[0], TIMES=TIMES, FENCE=fence,
                          LOG=log is not None, SHARE_PER_LAYER=int(per_layer),
                          ABLOCK=max(16, triton.next_power_of_2(t * k)), DBLOCK=1024, num_warps=4)
    return hit, zc


# the GPU's clock into the mailbox's timeline (box.times); not in Triton's interpreter (no inline PTX there: the
# references write the host's clock instead)
TIMES = os.environ.get("TRITON_INTERPRET") != "1"
# polls of the answer word (PCIe round trips) before collect gives up and sets the error flag the host reports:
# ~6-8 s at one poller's ~1.2-1.5 µs a poll (s19a). A real answer takes < 1 ms, one from experts the OS must read
# back from disk tens of ms. It was 100 M (~2 minutes): a stuck worker would have frozen the app that long before
# the user saw why
MAX_SPINS = 5_000_000
# collect's program sizes: warps of a token's program with one poller; 0 for every warp of 256-column programs
COLLECT_WARPS = (0, 1, 2, 4, 8, 16)


def take_split_rows(box, *, max_spins: int = MAX_SPINS) -> None:
    """The finer split's rows from the mailbox's `part` into device memory (`box.part_dev`), once `part_resp`
    holds the call's ticket (bounded like collect); nothing when the call has no split. One launch of one program,
    meant for a moment the link is quiet: a poll over PCIe waits behind every read in flight before it (s17a:
    polled beside the gather of the down parts, the rows that were there ~100 µs early were seen ~17 µs after
    that gather ended)."""
    # every row in one block: each pass of the copy loop is a round trip over PCIe (~3 µs? s17b's take kernel
    # took a median 11-14 µs for rows the CPU had answered long before; 256 rows a pass made 3-4 trips)
    _take_split_kernel[(1,)](box.split, box.part, box.part_dev, box.part_resp, box.ticket, box.error, max_spins,
                             BLOCK=triton.next_power_of_2(max(16, box.part.numel())), POLL_LANES=32 * 4,
                             num_warps=4)     # (one thread polls, as collect's: MAX_SPINS is counted for that)


def fill_split_rows(h: torch.Tensor, box) -> torch.Tensor:
    """h [T*K, I] (the gate/up kernel's activations): rows 0..r of the split assignment (`box.split`) from
    `box.part_dev` (`take_split_rows` put them there); nothing when the call has no split (in place; returns h).
    One launch of one warp, device memory only."""
    if h.stride(1) != 1 or h.stride(0) != h.shape[1]:
        raise ValueError(f"fill_split_rows: h {tuple(h.shape)} (strides {h.stride()}) is not contiguous rows")
    _fill_split_kernel[(1,)](h, h.shape[1], box.split, box.part_dev, BLOCK=256, num_warps=1)
    return h


def clock_pings(req: torch.Tensor, resp: torch.Tensor, g: torch.Tensor, first: int, *,
                max_spins: int = MAX_SPINS) -> None:
    """g.shape[0] pings of a CPU thread echoing req into resp (page-locked int64 words; runtime/experts/
    mailbox_clock.py): g [n, 2] int64 (device) gets the GPU's clock around each. One launch of one warp."""
    _clock_ping_kernel[(1,)](req, resp, g, g.shape[0], first, max_spins, num_warps=1)


def collect(out: torch.Tensor, box, *, extra: torch.Tensor | None = None, max_spins: int = MAX_SPINS,
            warps: int = 4) -> torch.Tensor:
    """out [T, D] += the CPU's answer, once it is there, and `extra` [T, D] (the hits' rows, computed beside the
    misses) when given: summed in fp32, rounded once (in place; returns out). One launch.

    warps (COLLECT_WARPS: a power of two, 1-16): a program a token of that many warps, its whole row, one thread
    polling the answer word (s19a at 4: the answer seen 0.2-0.8 µs after the worker's end, where every warp's polls
    saw it 8-12 µs late; but the row then takes 2.8 µs to add - each thread's four 16-byte loads at hidden 2048
    partly one after another - against 1.4 in programs of 256 columns; 16 warps read it in one load a thread: 1.6
    µs in s19c, and no tok/s gained). 0: sessions 9-18's programs of 256 columns (2 warps), every warp polling."""
    t, d = out.shape
    if extra is not None and (extra.shape != out.shape or extra.stride(1) != 1):
        raise ValueError(f"collect: extra rows {tuple(extra.shape)} (strides {extra.stride()}) do not match "
                         f"out {tuple(out.shape)}")
    if warps not in COLLECT_WARPS:
        raise ValueError(f"collect: {warps} warps (a power of two, 1-16; 0: every warp polls)")
    one_poller = warps > 0
    block, warps = (triton.next_power_of_2(d), warps) if one_poller else (256, 2)
    _collect_kernel[(triton.cdiv(d, block), t)](out, out.stride(0), out if extra is None else extra,
                                                0 if extra is None else extra.stride(0), box.ticket, box.ncpu,
                                                box.resp, box.out, box.error, box.times, d, max_spins,
                                                RING=box.times.shape[0], TIMES=TIMES, EXTRA=extra is not None,
                                                BLOCK=block, POLL_LANES=32 * warps if one_poller else 0,
                                                num_warps=warps)
    return out
