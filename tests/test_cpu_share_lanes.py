"""The CPU-share worker's lanes kept in one parallel region across requests (cpu_kernels_int8.serve_layers).

Session 9 found that starting and joining a parallel region per request cost ~20 µs each way on the GPU
machine's 16 cores; the worker now keeps its lanes spinning in one region while requests come. These tests
check that the lanes answer exactly what the executor computes, request after request (layers, token counts
and experts changing), and that lanes the OS runs late (here: more lanes than threads) cost nothing but speed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")

from runtime.experts import cpu_kernels_int8 as k8                                      # noqa: E402
from runtime.experts.cpu_executor import CpuExecutor                                    # noqa: E402
from runtime.experts.cpu_share import (CpuShareWorker, Mailbox, collect_reference,     # noqa: E402
                                       handoff_reference, serve_int8)
from runtime.experts.host_store import HostExpertStore                                  # noqa: E402
from runtime.experts.interface import ExpertSpec                                        # noqa: E402

E, D, I, K, T_MAX = 8, 512, 512, 2, 3


@pytest.fixture(scope="module")
def cpu():
    store = HostExpertStore.synthetic(layers=2, num_experts=E, hidden=D, intermediate=I, codec="int4", group=64,
                                      weight_std=0.05, seed=21)
    return CpuExecutor(store, ExpertSpec())


def _box(share=1.0):
    return Mailbox(max_tokens=T_MAX, top_k=K, hidden=D, device=torch.device("cpu"), share=share)


def _want(cpu, layer, x, ids, w, table):
    """The executor's answer for the CPU's assignments of one call (every miss at share 1)."""
    t, k = ids.shape
    miss = (table[ids] < 0).reshape(-1)
    tok = np.repeat(np.arange(t), k)[miss]
    return cpu.run(layer, x, tok, ids.reshape(-1)[miss].numpy(), w.reshape(-1)[miss].numpy())


@pytest.mark.parametrize("early_x", [True, False], ids=["early plan", "x before the plan"])
@pytest.mark.parametrize("threads", [2, 14])
def test_the_lanes_answer_request_after_request_as_the_executor_does(cpu, threads, early_x):
    """(14 lanes: the GPU machine's worker, where a race between lanes - a group of h quantized before its last
    rows landed, a down task taken early, a gate/up row computed before lane 0 finished x under the early plan -
    would show)"""
    if numba.config.NUMBA_NUM_THREADS < threads:
        pytest.skip(f"needs {threads} numba threads (the GPU machine's worker runs 14 lanes)")
    box = _box()
    worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=threads, early_x=early_x)
    compiled = set(k8.serve_layers.signatures)   # the worker compiled its loop while it was built...
    gen = torch.Generator().manual_seed(5)
    try:
        for step in range(12 if threads == 2 else 200):
            layer, t = step % 2, 1 + step % T_MAX
            x = torch.randn(t, D, generator=gen)
            ids = torch.randint(0, E, (t, K), generator=gen)
            w = torch.softmax(torch.randn(t, K, generator=gen), dim=-1)
            table = torch.full((E,), -1)
            table[step % E] = 0                      # one expert "in VRAM": not the CPU's
            handoff_reference(layer, ids, w, x, table, box)
            got = collect_reference(torch.zeros(t, D), box)
            if int(box.ncpu[0]):
                assert torch.equal(got, _want(cpu, layer, x, ids, w, table)), step
            assert worker.error is None and int(box.error[0]) == 0
        assert worker.kernel_requests == int(box.ticket[0]) > 8
        assert set(k8.serve_layers.signatures) == compiled    # ...for the types it serves with: not again at a request
        worker.close()                               # (its last spin ends: the region quits)
        ctl = worker._scratch[-1]
        assert ctl[k8.CTL_QUIT] == 1 and ctl[k8.CTL_GEN] >= 2   # served by the lanes' region (requests + its quit)
        m = worker.kernel_phases()
        if m is not None:      # marks in order, as from the per-request kernel - up to the cores' clock skew
            skew = 2.0         # µs: lanes read their own core's time-stamp counter (a VM's vCPUs differ by ~0.3)
            order = ("prologue", "first thread in", "x quantized", "gate/up done", "down inputs done",
                     "down and sum done", "joined")   # (a lane the OS runs late may come in after a stage is done)
            assert all(m[a] <= m[b] + skew for a, b in zip(order, order[1:])), m
            assert m["first thread in"] <= m["last thread in"] <= m["joined"] + skew, m
            assert m["joined"] > m["gate/up done"] > 0
            lanes = worker.lane_counts()           # per stage: the tasks over all lanes, a request's on average
            total = {name: threads * c["tasks_per_lane"] for name, c in lanes.items()}
            assert D // 32 <= total["down and sum"] <= D // 16 == D // k8._down_rows(3)   # 32 or 16 rows a task
            assert 0 < total["x to int8"] < T_MAX * D // 64    # only the 3-token requests' x by tasks
            assert lanes["gate/up"]["busy_us"] > 0 and lanes["gate/up"]["us_per_task"] > 0
    finally:
        worker.close()


def _post(box, cpu, layer, gen, t=2):
    x = torch.randn(t, D, generator=gen)
    ids = torch.randint(0, E, (t, K), generator=gen)
    w = torch.softmax(torch.randn(t, K, generator=gen), dim=-1)
    table = torch.full((E,), -1)
    handoff_reference(layer, ids, w, x, table, box)
    return _want(cpu, layer, x, ids, w, table)


@pytest.fixture
def two_threads():
    """The calling thread's numba threads set to two for the test, restored after."""
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    yield
    numba.set_num_threads(before)


def _direct(box, cpu, lanes):
    """What serve_int8 needs besides the mailbox, as the worker makes it: its scratch, clock and marks."""
    worker_like = CpuShareWorker.__new__(CpuShareWorker)
    worker_like.box, worker_like.int8_args = box, cpu.int8_args()
    return worker_like._scratch_for(lanes), np.zeros(2, dtype=np.int64), np.zeros(k8.N_PHASES, dtype=np.int64)


def _serve(box, cpu, scratch, lanes, last, clock, phases):
    b = box._np
    return serve_int8(b["req"], b["resp"], b["meta"], b["ids"], b["weights"], b["x"], b["out"], b["part"],
                      b["part_resp"], last, 1000, clock, box.cpu_times, phases, lanes, 1, *scratch,
                      *cpu.int8_args())     # (1: the early plan, the worker's default)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_more_lanes_than_threads_still_answer_every_request(cpu, two_threads):
    """Three lanes on two threads: one thread runs two lanes one after the other, so one lane only comes in once
    lane 0 has left. Nobody waits for a lane (each request's tasks go to whoever takes them), so lane 0 and the
    other thread serve everything, and the late lane finds nothing left to do."""
    box = _box()
    gen = torch.Generator().manual_seed(6)
    scratch, clock, phases = _direct(box, cpu, 3)
    last = 0
    for step in range(3):
        want = _post(box, cpu, step % 2, gen)
        last = _serve(box, cpu, scratch, 3, last, clock, phases)
        assert last == int(box.ticket[0]) == step + 1
        assert torch.equal(collect_reference(torch.zeros(2, D), box), want), step
    assert clock[1] == 3 and phases[-1] == 3


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_two_lanes_on_two_threads_serve_in_one_region(cpu, two_threads):
    box = _box()
    gen = torch.Generator().manual_seed(7)
    scratch, clock, phases = _direct(box, cpu, 2)
    want = _post(box, cpu, 1, gen, t=3)
    assert _serve(box, cpu, scratch, 2, 0, clock, phases) == 1
    assert torch.equal(collect_reference(torch.zeros(3, D), box), want)
    assert scratch[-1][k8.CTL_GEN] == 2 and clock[1] == 1      # the request, then the quit
    assert phases[-1] == 1                      # the lanes marked their one request


def test_a_row_shorter_than_the_mailbox_is_refused(cpu):
    """The worker reads T rows of the mailbox's K ids: a row of fewer would leave the rest's stale ids in the
    request (sessions 8-12's small-request bench sent one id into a row of eight, and the worker computed expert 0
    for the seven stale zeros besides)."""
    box = Mailbox(max_tokens=1, top_k=4, hidden=D, device=torch.device("cpu"), share=1.0)
    with pytest.raises(ValueError, match="1 experts a token, the mailbox 4"):
        handoff_reference(0, torch.tensor([[3]]), torch.ones(1, 1), torch.randn(1, D), torch.full((E,), -1), box)
    assert int(box.ticket[0]) == 0 and int(box._np["req"][0]) == 0     # nothing was published


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_the_small_request_bench_sends_exactly_its_experts(cpu):
    """bench_cpu_requests' rows: a request of n experts is n experts' tasks for the worker, whatever the mailbox's
    K (the token's other experts resident)."""
    from runtime.experts.bench_model import time_requests
    for experts in (1, 3):
        box = Mailbox(max_tokens=1, top_k=4, hidden=D, device=torch.device("cpu"), share=1.0)
        worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=2)
        try:
            trips, busy = time_requests(worker, box, cpu.store, experts=experts, calls=4, gap_s=0.0, hot=False)
            assert len(trips) == 4 and busy > 0 and worker.error is None
            ids = box._np["ids"][:4]
            assert (ids >= 0).sum() == experts and ids[experts:].tolist() == [-1] * (4 - experts)
        finally:
            worker.close()          # the lanes count a request's tasks after its answer: all counted once closed
        lanes = worker.lane_counts()
        up_blocks = -(-I // k8.ROWS_PER_TASK)
        assert 2 * lanes["gate/up"]["tasks_per_lane"] == pytest.approx(experts * up_blocks)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_the_bench_counts_every_request_while_the_worker_still_spins(cpu):
    """`bench model`'s worker line reads `requests` (the compiled loop's own count), not `served`, which is added
    to only when a spin runs out: a decode run's requests come closer together than the spin, and session 13's
    rows read 44 requests for ~4,500 (and 12,360 µs each)."""
    from types import SimpleNamespace

    from runtime.experts.bench_model import worker_counts
    from runtime.experts.cpu_share import polls_per_second
    box = _box()
    worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=2)
    worker.spin_polls = int(polls_per_second() * 0.5)  # the loop stays in its spin between these requests
    tier = SimpleNamespace(_worker=worker)
    gen = torch.Generator().manual_seed(8)
    try:
        before = worker_counts(tier)
        for _ in range(6):
            _post(box, cpu, 0, gen, t=1)
            collect_reference(torch.zeros(1, D), box)
        after = worker_counts(tier)
        assert after[0] - before[0] == 6 and after[2] > before[2]       # current: requests and their cycles
        assert worker.served == after[4] < after[0]                     # served waits for the spin to end
    finally:
        worker.close()


def test_the_mailbox_timeline_spans_each_request_from_its_handoff_to_its_rows():
    """`Mailbox.timeline` (bench model's "mailbox" line: where a request's round trip goes beside the worker's own
    time): a request answered 40 ms after its handoff shows ~40 ms to the answer, collect's wait in it, and the
    rows added after; requests before `after` are not counted, nor one whose collect never ran."""
    import threading
    import time

    from runtime.experts.cpu_share import publish
    box = _box(share=1.0)
    gen = torch.Generator().manual_seed(3)
    table = torch.full((E,), -1, dtype=torch.int64)

    def one(delay_s: float, collect: bool = True) -> None:
        x = torch.randn(1, D, generator=gen)
        handoff_reference(0, torch.tensor([[1, 4]]), torch.rand(1, K, generator=gen), x, table, box)
        want = int(box.ticket[0])
        answer = threading.Timer(delay_s, lambda: publish(box._np["resp"], want))
        answer.start()
        if collect:
            time.sleep(delay_s / 4)                      # collect starts after the handoff, waits for the rest
            collect_reference(torch.zeros(1, D), box)
        answer.join()

    one(0.0)
    after = int(box.ticket[0])
    for _ in range(3):
        one(0.04)
    one(0.0, collect=False)                              # published, never collected: no span of its own
    spans = box.timeline(after)
    assert spans["requests"] == 3, spans
    assert 38_000 < spans["request to answer seen"] < 80_000, spans                  # µs
    assert spans["request to answer seen, mean"] >= 38_000 and 20_000 < spans["collect waited"] < 40_000, spans
    assert 8_000 < spans["request to collect"] < spans["request to answer seen"], spans
    assert 0 <= spans["answer seen to rows added"] < 20_000, spans
    assert box.timeline(int(box.ticket[0])) is None                                   # nothing after the last


def test_the_clock_echo_answers_each_ping_and_stamps_it():
    """The compiled echo that the GPU's clock pings talk to (mailbox_clock.echo_pings), driven from a thread here:
    each ping's value comes back, its cycle stamp lies between the sender's counter reads around it, and an echo
    that waits in vain returns the pings it answered."""
    import threading

    from runtime.experts.cpu_share import publish, read_cycles, spin_until_changed
    from runtime.experts.mailbox_clock import echo_pings
    req, resp = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    cycles, answered, sent = np.zeros(4, dtype=np.int64), [0], []
    echo_pings(req, resp, cycles, 0, 1, 0)              # (compiled before the thread waits on it)
    t = threading.Thread(target=lambda: answered.__setitem__(0, echo_pings(req, resp, cycles, 4, 2_000_000_000, 0)))
    t.start()
    for v in (1, 2, 3):
        c0 = int(read_cycles())
        publish(req, v)
        assert int(spin_until_changed(resp, v - 1, 2_000_000_000)) == v
        sent.append((c0, int(read_cycles())))
    t.join(timeout=0.1)
    assert t.is_alive()                                 # (still waiting for the fourth)
    publish(req, 4)
    t.join(timeout=30)
    assert answered[0] == 4 and int(resp[0]) == 4
    assert all(c0 <= c <= c1 for (c0, c1), c in zip(sent, cycles[:3])), (sent, cycles)
    assert echo_pings(req, resp, cycles, 2, 1000, 4) == 0             # nothing new: none answered


def _wait_for_end_stamp(box, ticket: int, timeout_s: float = 10.0) -> None:
    """Until the worker has stamped request `ticket`'s end (after it booked the request's cycles), then a moment
    more: the compiled loop's two plain stores carry no order a reader could rely on."""
    import time

    from runtime.experts.cpu_share import TIMELINE_RING

    deadline = time.monotonic() + timeout_s
    while box.cpu_times[ticket % TIMELINE_RING, 1] == 0:
        assert time.monotonic() < deadline, f"the worker never stamped request {ticket}'s end"
        time.sleep(0.001)
    time.sleep(0.01)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_the_worker_stamps_put_its_time_between_the_two_crossings(cpu):
    """The compiled worker stamps each request's seeing and end with the cycle counter (Mailbox.cpu_times); a
    ClockMap onto the references' clock (monotonic_ns, as the GPU's for the kernels) splits the round trip at the
    worker: the request reaches it after its handoff, it answers before collect sees the answer, and its time is
    the cycle counter's own mean. A map off by 1 ms moves both crossings by 1 ms (the map is applied); two samples
    of one moment make no map."""
    import time

    from runtime.experts.mailbox_clock import ClockMap, ClockSample, host_sample
    box = _box()
    worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=2)
    gen = torch.Generator().manual_seed(12)
    try:
        _post(box, cpu, 0, gen, t=1)                     # (a first request: compiled paths warm)
        collect_reference(torch.zeros(1, D), box)
        after = int(box.ticket[0])
        # the worker counts a request's cycles after its answer is out (its last task answers; lane 0 then books
        # the time and stamps its end): read the clock once that is done, or a loaded machine (CI's two test
        # workers) reads it before the first request's cycles land and counts them with the five below
        _wait_for_end_stamp(box, after)
        cycles_before = int(worker._clock[0])
        first = host_sample()
        for layer in (0, 1, 0, 1, 1):
            _post(box, cpu, layer, gen, t=1)
            time.sleep(0.002)                            # (collect starts late: the answer is there before it)
            collect_reference(torch.zeros(1, D), box)
        clock = ClockMap.fit(first, host_sample())
        _wait_for_end_stamp(box, after + 5)
        spans = box.timeline(after, clock=clock)
        cycles = int(worker._clock[0]) - cycles_before
    finally:
        worker.close()
    assert spans["requests"] == spans["worker stamps"] == 5, spans
    stamped = box.cpu_times[np.arange(after + 1, after + 6)]
    assert int((stamped[:, 1] - stamped[:, 0]).sum()) == cycles      # the stamps are the clock's own requests
    assert spans["worker"] == pytest.approx(np.median(stamped[:, 1] - stamped[:, 0]) * clock.ns_per_cycle / 1e3,
                                            abs=0.01)
    assert 0 < spans["request to worker"] < 20_000, spans          # µs: the worker spins on the request word
    assert 0 < spans["worker done to answer seen"] < 50_000, spans # collect began ~2 ms after the handoff
    assert spans["request to worker"] + spans["worker"] < spans["request to answer seen"], spans
    late = ClockMap(ClockSample(clock.a.cycles, clock.a.ns + 1_000_000, 0.0),
                    ClockSample(clock.b.cycles, clock.b.ns + 1_000_000, 0.0))
    moved = box.timeline(after, clock=late)
    assert moved["request to worker"] == pytest.approx(spans["request to worker"] + 1_000, abs=1), moved
    assert moved["worker done to answer seen"] == pytest.approx(spans["worker done to answer seen"] - 1_000, abs=1)
    assert ClockMap.fit(first, first) is None and box.timeline(after, clock=None).get("worker") is None


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_the_ceilings_cpu_kernel_bandwidth_is_the_workers_on_whole_cold_layers(cpu):
    """`bench model`'s ceiling takes the CPU kernel's bandwidth (issue 10: "the measured PCIe and CPU-kernel
    bandwidths"): the worker's own time on requests of a layer's K experts, all missed. A store the int8 kernel
    does not take has no such figure (0.0: the row falls back to the read probe)."""
    from runtime.experts.bench_model import cpu_kernel_gbps
    gbps = cpu_kernel_gbps(cpu.store, top_k=K, threads=2, calls=4, gap_s=0.0)
    assert 0.0 < gbps < 1e4
    plain = HostExpertStore.synthetic(layers=1, num_experts=E, hidden=D, intermediate=I, codec="bf16", seed=2)
    assert cpu_kernel_gbps(plain, top_k=K, threads=2, calls=2, gap_s=0.0) == 0.0


def test_a_row_is_held_to_the_probe_taken_right_after_it_too(cpu):
    """`bench model` probes the CPU kernel again after each zero-copy row and holds the row to that ceiling beside
    the process's start probe: the same formula (miss bytes over PCIe + kernel, plus the dense time), another
    bandwidth - a row faster than both ceilings' sum of links would be a wrong formula, not a fast row."""
    from runtime.experts.bench_model import probe_after_row
    row = {"tok_s": 50.0, "misses_per_token": 40.0, "of_ceiling": 0.5}
    probe_after_row(row, cpu.store, top_k=K, threads=2, h2d_gbps=1.0, dense_s=1e-3)
    after = row["kernel_gbps_after"]
    assert 0.0 < after < 1e4
    want = 1.0 / (40.0 * cpu.store.block_nbytes / ((1.0 + after) * 1e9) + 1e-3)
    assert row["ceiling_after_tok_s"] == pytest.approx(want)
    assert row["of_ceiling_after"] == pytest.approx(50.0 / want)
    assert row["ceiling_after_tok_s"] < 1e3        # (never above the dense step alone: 1 ms a token)


def test_the_split_rule_takes_the_fraction_of_an_expert_in_rows():
    """cpu_share.cpu_split: whole misses, then the fraction's worth of rows of the next one (unit rows weigh an
    expert), in steps of the int8 kernel's row task; past the midpoint to the whole expert it takes that; calls of
    several tokens and a unit of 0 keep the old rounding."""
    from runtime.experts.cpu_share import SPLIT_ROWS, cpu_split

    assert SPLIT_ROWS == k8.ROWS_PER_TASK
    unit, inter = 1152, 768                             # qwen3-30b-a3b's int4 block: gate/up are 2/3 of it
    assert cpu_split(5, 0.6, unit=unit, inter=inter) == (3, 0)          # 3.0 experts: whole
    assert cpu_split(5, 0.5, unit=unit, inter=inter) == (2, 576)        # 2.5: half an expert's bytes in rows
    assert cpu_split(5, 0.55, unit=unit, inter=inter) == (2, 768)       # 2.75: all its gate/up rows (864 > 768)
    assert cpu_split(5, 0.58, unit=unit, inter=inter) == (3, 0)         # 2.9: nearer the whole expert
    assert cpu_split(4, 0.3, unit=unit, inter=inter) == (1, 224)        # 1.2: 230.4 rows -> 14 tasks of 16
    assert cpu_split(3, 0.0, unit=unit, inter=inter) == (0, 0)
    assert cpu_split(3, 1.0, unit=unit, inter=inter) == (3, 0)
    assert cpu_split(5, 0.5, unit=unit, inter=inter, tokens=2) == (3, 0)   # round(2.5): the old rule
    assert cpu_split(5, 0.5) == (3, 0)
    for n in range(9):                   # never more rows than the expert has, never a miss that is not there
        for s in np.linspace(0, 1, 41):
            whole, rows = cpu_split(n, float(s), unit=unit, inter=inter)
            assert 0 <= whole <= n and 0 <= rows <= inter and rows % SPLIT_ROWS == 0
            assert rows == 0 or whole < n


def _h_rows(store, layer, expert, x):
    """The fp32 reference of an expert's activations h for one token."""
    wt = store.dequantize(layer, expert)
    from runtime.experts.interface import activate
    return activate(ExpertSpec(), x.float() @ wt.gate.float().T, x.float() @ wt.up.float().T)[0]


@pytest.mark.parametrize("threads", [2, 14])
def test_the_lanes_compute_a_split_experts_first_rows_for_the_gpu(cpu, threads):
    """With the finer split on, a one-token request names one more expert and a row count: the lanes write that
    expert's first rows of h (fp32, within the int8 activations' rounding of the reference) to the mailbox's part
    and its ticket to part_resp, leave the rows past it alone, and still answer exactly the executor's sum for the
    whole experts - also when the CPU's share is that expert's rows alone (14 lanes: the GPU machine's worker)."""
    from runtime.experts.cpu_share import cpu_split, split_unit_rows

    if numba.config.NUMBA_NUM_THREADS < threads:
        pytest.skip(f"needs {threads} numba threads (the GPU machine's worker runs 14 lanes)")

    box = Mailbox(max_tokens=T_MAX, top_k=4, hidden=D, device=torch.device("cpu"), share=0.5, intermediate=I)
    unit = split_unit_rows(cpu.store.layout)
    assert 1.4 * I < unit < 1.6 * I                     # gate/up are ~2/3 of a block
    box.enable_split(unit)
    worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=threads)
    gen = torch.Generator().manual_seed(8)
    splits = alone = 0
    try:
        for step, share in enumerate((0.5, 0.3, 0.1, 0.8, 0.2, 0.45, 0.6, 0.05) * (1 if threads == 2 else 25)):
            box.set_share(share)
            layer = step % 2
            x = torch.randn(1, D, generator=gen)
            ids = torch.randperm(E, generator=gen)[:4][None]
            w = torch.softmax(torch.randn(1, 4, generator=gen), dim=-1)
            table = torch.full((E,), -1)
            table[int(ids[0, 3])] = 0                    # one hit: three misses
            box._np["part"][:] = np.nan
            handoff_reference(layer, ids, w, x, table, box)
            got = collect_reference(torch.zeros(1, D), box)
            whole, rows = cpu_split(3, share, unit=unit, inter=I)
            a, r = box.split.tolist()
            assert r == rows and int(box.ncpu[0]) == whole + (rows > 0)
            cpu_ids = box._np["ids"][:4]
            assert (cpu_ids >= 0).sum() == whole
            tok = np.zeros(whole, dtype=np.int64)
            want = cpu.run(layer, x, tok, cpu_ids[cpu_ids >= 0], box._np["weights"][:4][cpu_ids >= 0])
            assert torch.equal(got, want), step
            if rows:
                splits += 1
                alone += whole == 0
                assert a >= 0 and cpu_ids[a] == -1 and table[int(ids[0, a])] < 0   # a miss, not the CPU's whole
                assert int(box._np["part_resp"][0]) == int(box.ticket[0])
                ref = _h_rows(cpu.store, layer, int(ids[0, a]), x)[:r]
                part = torch.from_numpy(box._np["part"][:r].copy())
                assert (part - ref).norm() / ref.norm() < 0.02, step
                assert np.isnan(box._np["part"][r:]).all()            # rows past the split: the GPU's
            else:
                assert a == -1
            assert worker.error is None and int(box.error[0]) == 0
        assert splits >= 4 and alone >= 1
        assert worker.kernel_requests == int(box.ticket[0])
        marks = worker.kernel_phases()                   # the split rows' answer, timed where the cycle counter runs
        if marks is not None:
            assert 0 < marks["split rows answered"] < 10 * marks["joined"]    # (split requests are the longer)
            assert worker.phase_marks()[k8.SPLIT_COUNT] == splits
    finally:
        worker.close()


def test_a_request_with_a_bad_split_is_refused_and_answered():
    """A split whose rows are not whole row tasks (or whose expert is out of range) is a worker error, answered
    with zeros and both tickets, so nothing on the GPU waits for it."""
    store = HostExpertStore.synthetic(layers=1, num_experts=E, hidden=D, intermediate=I, codec="int4", group=64,
                                      weight_std=0.05, seed=21)
    cpu = CpuExecutor(store, ExpertSpec())
    box = Mailbox(max_tokens=1, top_k=K, hidden=D, device=torch.device("cpu"), share=0.5, intermediate=I)
    worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=2)
    try:
        b = box._np
        b["ids"][:] = -1
        b["out"][:] = 1.0
        b["meta"][:] = (0, 1, 3, 0, 20)                  # 20 rows: not a multiple of 16
        b["req"][0] = 1
        deadline = __import__("time").monotonic() + 20
        while int(b["resp"][0]) != 1 and __import__("time").monotonic() < deadline:
            pass
        assert int(b["resp"][0]) == 1 and int(b["part_resp"][0]) == 1
        assert (b["out"] == 0).all() and "split" in str(worker.error)
    finally:
        worker.close()
