"""The int8-activation CPU expert kernels (runtime/experts/cpu_kernels_int8.py) against exact references.

Three levels: the integer core of every dot-product flavour this CPU can run is exact (integers in, integers
out); one projection stays inside the stated rounding bound; whole experts over a grid of codecs, token counts
and routings stay within a relative error, and the engine greedy-decodes the same tokens with them.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import pytest
import torch
from numba import njit

from runtime.experts import cpu_executor
from runtime.experts import cpu_kernels as ck
from runtime.experts import cpu_kernels_int8 as k8
from runtime.experts.cpu_executor import CpuExecutor
from runtime.experts.host_store import HostExpertStore
from runtime.experts.interface import ExpertSpec, ExpertWeights

# Whole-expert relative error (Frobenius norm over the output) of int8 activations against the exact dequantized
# expert: measured 0.9-1.6 % on these random experts (the down projection's input, a product of two
# projections, is the heavier-tailed one to round); 2.5 % leaves margin without hiding a wrong group or scale.
EXPERT_REL_ERROR = 0.025


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.norm(got - want) / torch.linalg.norm(want))


def _weights(gen, *, d, i, e, bias, layers=(0,)):
    rnd = lambda *s: torch.randn(*s, generator=gen) * 0.1       # noqa: E731
    return {(layer, x): ExpertWeights(rnd(i, d), rnd(i, d), rnd(d, i), rnd(i) if bias else None,
                                      rnd(i) if bias else None, rnd(d) if bias else None)
            for layer in layers for x in range(e)}


# ---------------------------------------------------------------- the integer core, every flavour

def _row_checker(isa: str):
    """A jitted loop over rows that calls this flavour's whole-row intrinsics (int4 groups of 64; fp4 blocks of
    32 with scales through the table, codec 1, or decoded as e8m0, codec 2)."""
    row_i4, row_f4 = k8.make_row(32, "int4", isa), k8.make_row(16, "fp4", isa)
    row_i4_128 = k8.make_row(64, "int4", isa)
    row_mx = k8.make_row(16, "fp4", isa, e8m0=True)

    @njit
    def rows(codec, buf, q_len, s_off, m_off, n_rows, n_groups, table, xq, xs, xm, out):
        for r in range(n_rows):
            q0 = np.uint64(r * q_len)
            if codec == 0:
                out[r] = row_i4(buf, q0, np.uint64(s_off + 2 * r * n_groups), np.uint64(m_off + 2 * r * n_groups),
                                np.uint64(n_groups), table, xq, np.uint64(0), xs, xm, np.uint64(0))
            elif codec == 3:        # int4 groups of 128: one 64-byte load of codes a group (ONE_LOAD_GROUP)
                out[r] = row_i4_128(buf, q0, np.uint64(s_off + 2 * r * n_groups),
                                    np.uint64(m_off + 2 * r * n_groups), np.uint64(n_groups), table, xq,
                                    np.uint64(0), xs, xm, np.uint64(0))
            elif codec == 1:
                out[r] = row_f4(buf, q0, np.uint64(s_off + r * n_groups), np.uint64(s_off),
                                np.uint64(n_groups), table, xq, np.uint64(0), xs, xm, np.uint64(0))
            else:
                out[r] = row_mx(buf, q0, np.uint64(s_off + r * n_groups), np.uint64(s_off),
                                np.uint64(n_groups), table, xq, np.uint64(0), xs, xm, np.uint64(0))
    return rows


@pytest.mark.parametrize("isa", k8.host_isas())
def test_every_dot_flavour_this_cpu_runs_is_exact_on_integers(isa):
    """Codes and int8 activations are integers and the scales powers of two, so each row's result is exact:
    VNNI, AVX2 and the generic lowering must all give numpy's integer dot products to the last bit. 1344
    inputs: 21 or 42 groups, so the coefficients go through the 16- and 4-group vector passes and the tail (int4
    groups of 128: 1408 inputs, 11 groups, each group's codes in one load and its activations in ONE_LOAD_GROUP)."""
    rng = np.random.default_rng(0)
    rows = 8
    e2m1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])       # 2 * e2m1(code)
    check = _row_checker(isa)
    for codec, group in ((0, 64), (3, 128), (1, 32), (2, 32)):
        k = 1408 if group == 128 else 1344
        g = k // group
        codes = rng.integers(0, 256, size=(rows, k // 2), dtype=np.uint8)
        xq_full = rng.integers(-127, 128, size=(g, group)).astype(np.int8)          # [G, group], natural order
        # the whole-row path's layout: every 64 elements, their even ones then their odd ones; a group of 128:
        # both chunks' evens, then both chunks' odds
        chunks = xq_full.reshape(-1, 64)
        if group == 128:
            pairs = xq_full.reshape(g, 2, 64)
            xq = np.concatenate([pairs[:, :, 0::2].reshape(g, 64), pairs[:, :, 1::2].reshape(g, 64)],
                                axis=1).reshape(-1)
        else:
            xq = np.concatenate([chunks[:, 0::2], chunks[:, 1::2]], axis=1).reshape(-1)
        xs = (2.0 ** rng.integers(-3, 3, size=g)).astype(np.float32)
        xm = (2.0 ** rng.integers(-3, 3, size=g)).astype(np.float32)
        if codec in (0, 3):
            scales = (2.0 ** rng.integers(-4, 2, size=(rows, g))).astype(np.float16)
            mins = (-(2.0 ** rng.integers(-4, 2, size=(rows, g)))).astype(np.float16)
            buf = np.concatenate([codes.reshape(-1), scales.view(np.uint8).reshape(-1),
                                  mins.view(np.uint8).reshape(-1)])
            s_off, m_off, table = codes.size, codes.size + scales.nbytes, ck.fp16_table()
            vals = np.stack([codes & 15, codes >> 4], axis=-1).reshape(rows, g, group).astype(np.int64)
            dots = (vals * xq_full.astype(np.int64)).sum(-1)                            # [rows, G], exact
            want = (scales.astype(np.float64) * xs * dots + mins.astype(np.float64) * xm).sum(-1)
        else:
            sc = rng.integers(120, 130, size=(rows, g)).astype(np.uint8)                 # e8m0 exponents
            sc[0, :3] = (0, 1, 255)                                                       # 2^-127, 2^-126, inf
            buf = np.concatenate([codes.reshape(-1), sc.reshape(-1)])
            s_off, m_off, table = codes.size, 0, ck.e8m0_table()
            vals = e2m1[np.stack([codes & 15, codes >> 4], axis=-1)].reshape(rows, g, group)
            dots = (vals * xq_full.astype(np.int64)).sum(-1)
            want = (np.ldexp(1.0, sc.astype(np.int64) - 127) * xs * dots).sum(-1)
        out = np.zeros(rows, dtype=np.float32)
        check(codec, buf, k // 2, s_off, m_off, rows, g, table, xq, xs, xm, out)
        if codec in (1, 2):             # row 0 holds e8m0 255 (the table's inf): not a finite number either way
            assert not np.isfinite(out[0])
            out, want = out[1:], want[1:]
        np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=f"{isa} codec {codec}")


_CROSS_COMPILE = """
import sys
import numba
import numpy as np
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from test_cpu_kernels_int8 import _row_checker
check = _row_checker(sys.argv[1])
args = (0, np.zeros(4096, np.uint8), 128, 0, 0, 1, 4, np.zeros(256, np.float32), np.zeros(1024, np.int8),
        np.zeros(64, np.float32), np.zeros(64, np.float32), np.zeros(1, np.float32))
check.compile(tuple(numba.typeof(a) for a in args))
print(check.inspect_asm(check.signatures[0]))
"""


@pytest.mark.parametrize("isa, cpu, want", [("vnni512", "cascadelake", "vpdpbusd"),
                                            ("avxvnni", "alderlake", r"\{vex\}\s+vpdpbusd"),
                                            ("avx2", "haswell", "vpmaddubsw")])
def test_each_x86_flavour_compiles_to_its_instruction_for_the_cpus_that_get_it(isa, cpu, want, tmp_path):
    """CI has one CPU; the flavours chosen on others are cross-compiled here (numba told to generate code for
    that CPU, in a child process that never runs it), so an intrinsic the backend cannot select for them fails
    here, not on a user's laptop. In-process, a host without AVX-512 would have to lower the AVX-512 flavour for
    itself, which LLVM answers with an abort of the whole test run."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _CROSS_COMPILE, isa, str(tests), str(tests.parent)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    asm = run.stdout
    assert re.search(want, asm)
    if isa == "avx2":
        assert "vpdpbusd" not in asm and "zmm" not in asm


# ---------------------------------------------------------------- one projection: the stated bound

@njit
def _one_projection(codec, buf, buf16, base, q_off, s_off, m_off, n_rows, n_groups, group, table, x, y):
    """y = W x through the kernel's own quantization and row code (one token)."""
    k = x.shape[1]
    xq = np.empty(k, dtype=np.int8)
    xs = np.empty(k // group, dtype=np.float32)
    xm = np.empty(k // group, dtype=np.float32)
    k8._quantize_row(x, 0, group, xq, xs, xm)
    hg = np.uint64(group // 2)
    for r in range(n_rows):
        y[r] = k8._row(codec, buf, buf16, np.uint64(base), np.uint64(q_off), np.uint64(s_off), np.uint64(m_off),
                       np.uint64(r), np.uint64(n_groups), hg, table, xq, xs, xm, np.uint64(0))


@pytest.mark.parametrize("codec, group, d", [("int4", 64, 512), ("int4", 32, 96), ("int4", 128, 256),
                                             ("fp4", 32, 256), ("fp4", 32, 96), ("fp4", 16, 128)])
def test_one_projection_stays_inside_the_rounding_bound(codec, group, d):
    """|y - W x| <= sum_g (s_g / 2) sum_{k in g} |W_k| per row (s_g = the group's activation scale), W the
    dequantized weights; d = 96 takes the group-by-group path (rows not a multiple of 32 bytes)."""
    gen = torch.Generator().manual_seed(4)
    i, e = 64, 3
    fmt = "nvfp4" if (codec, group) == ("fp4", 16) else "mxfp4"
    store = HostExpertStore.from_weights(_weights(gen, d=d, i=i, e=e, bias=False), codec=codec, group=group,
                                         fp4_format=fmt)
    lay = store.layout
    flat = store.layer_buffer(0).reshape(-1)
    table = ck.fp16_table() if codec == "int4" else (ck.e8m0_table() if lay.scale_format == "e8m0" else ck.e4m3_table())
    for expert in range(e):
        w = store.dequantize(0, expert).gate          # [I, D] fp32, exact (from_weights sets NVFP4's global to 1)
        x = torch.randn(1, d, generator=gen) * (1 + 3 * (torch.rand(1, d, generator=gen) > 0.95))   # a few outliers
        y = np.zeros(i, dtype=np.float32)
        p = lay.parts
        codec_id = 0 if codec == "int4" else (2 if lay.scale_format == "e8m0" else 1)
        _one_projection(codec_id, flat, flat.view(np.uint16), expert * lay.nbytes,
                        p["gate"].offset, p["gate_scales"].offset, p["gate_mins"].offset if codec == "int4" else 0,
                        i, d // group, group, table, x.numpy(), y)
        exact = (w.double() @ x[0].double()).numpy()
        s = x[0].reshape(-1, group).abs().amax(-1).double() / 127                 # activation scale per group
        bound = (w.double().abs().reshape(i, -1, group).sum(-1) * s / 2).sum(-1).numpy()
        slack = 1e-5 * (w.double().abs() @ x[0].double().abs()).numpy()         # float32 rounding of the sums
        err = np.abs(y - exact)
        worst = err.argmax()
        assert (err <= bound + slack).all(), f"expert {expert}: error {err[worst]:.3g} over bound {bound[worst]:.3g}"
        assert err.max() > 0                                                     # it did round (not the float path)


# ---------------------------------------------------------------- whole experts over a grid

GRID = [("int4", 64, "", "silu"), ("int4", 32, "", "gpt_oss"), ("int4", 128, "", "silu"),
        ("fp4", 32, "mxfp4", "gpt_oss"), ("fp4", 16, "nvfp4", "silu")]


@pytest.mark.parametrize("codec, group, fmt, activation", GRID)
def test_whole_experts_over_a_grid_of_tokens_and_routings(codec, group, fmt, activation):
    gen = torch.Generator().manual_seed(5)
    d, i, e = 512, 256, 6
    bias = activation == "gpt_oss"
    store = HostExpertStore.from_weights(_weights(gen, d=d, i=i, e=e, bias=bias), codec=codec, group=group,
                                         fp4_format=fmt or "mxfp4")
    spec = ExpertSpec(activation=activation, has_bias=bias)
    fast, ref = CpuExecutor(store, spec, int8=True), CpuExecutor(store, spec, fast=False)
    assert fast.int8 and not ref.fast
    rng = np.random.default_rng(6)
    for t in (1, 4, 17):
        x = torch.randn(t, d, generator=gen)
        k = 3
        experts = np.concatenate([rng.choice(e, k, replace=False) for _ in range(t)])
        tokens = np.repeat(np.arange(t), k)
        if t > 1:       # a token listed twice for one expert, and a token with no experts at all
            tokens, experts = np.append(tokens[k:], [1, 1]), np.append(experts[k:], [experts[k], experts[k]])
        w = rng.uniform(0.1, 1.0, size=len(tokens)).astype(np.float32)
        got, want = fast.run(0, x, tokens, experts, w), ref.run(0, x, tokens, experts, w)
        assert _rel(got, want) < EXPERT_REL_ERROR, (t, _rel(got, want))
        if t > 1:
            assert torch.equal(got[0], torch.zeros(d))                           # token 0 was left without experts
        # per token too: no token's result may hide behind the others
        for ti in set(tokens.tolist()):
            assert _rel(got[ti], want[ti]) < 2 * EXPERT_REL_ERROR
    assert torch.equal(fast.run(0, x, tokens[:0], experts[:0], w[:0]), torch.zeros_like(x))


def test_out_of_range_ids_are_refused_not_read():
    gen = torch.Generator().manual_seed(7)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=3, bias=False), codec="int4", group=64)
    ex = CpuExecutor(store, ExpertSpec())
    x = torch.randn(2, 512, generator=gen)
    with pytest.raises(ValueError, match="expert id is out of range"):
        ex.run(0, x, np.array([0, 1]), np.array([0, 3]), np.ones(2, dtype=np.float32))
    with pytest.raises(ValueError, match="token index is out of range"):
        ex.run(0, x, np.array([0, 2]), np.array([0, 1]), np.ones(2, dtype=np.float32))


def test_a_read_only_store_runs_through_the_same_compiled_kernel():
    """Read-only weights (a mapped file opened read-only) give the same output without a second numba
    specialization (each costs a full compile of the kernel)."""
    gen = torch.Generator().manual_seed(9)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=3, bias=False), codec="int4", group=64)
    x = torch.randn(2, 512, generator=gen)
    args = (0, x, np.array([0, 1, 1]), np.array([2, 0, 2]), np.array([0.5, 1.0, 0.25], dtype=np.float32))
    want = CpuExecutor(store, ExpertSpec()).run(*args)
    n_compiled = len(k8.moe_layer_int8.signatures)
    store.layer_buffer(0).flags.writeable = False
    got = CpuExecutor(store, ExpertSpec()).run(*args)
    assert torch.equal(got, want) and len(k8.moe_layer_int8.signatures) == n_compiled


def test_one_executors_kept_scratch_gives_each_call_what_a_fresh_executor_gives():
    """The kernel allocates nothing: its scratch is kept between calls and grown when a call needs more. Calls of
    growing, shrinking and growing sizes through one executor give exactly what a fresh executor gives for each
    (nothing stale from a bigger call leaks into a smaller one), at one thread and at two."""
    gen = torch.Generator().manual_seed(11)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=6, bias=False), codec="int4", group=64)
    kept = CpuExecutor(store, ExpertSpec())
    rng = np.random.default_rng(3)
    for threads in (1, 2):
        for t, k in ((1, 2), (4, 3), (1, 1), (4, 3), (2, 6)):
            x = torch.randn(t, 512, generator=gen)
            tokens = np.repeat(np.arange(t), k)
            experts = np.concatenate([rng.choice(6, k, replace=False) for _ in range(t)])
            w = rng.random(t * k).astype(np.float32)
            got = kept.run(0, x, tokens, experts, w, threads=threads)
            want = CpuExecutor(store, ExpertSpec()).run(0, x, tokens, experts, w, threads=threads)
            assert torch.equal(got, want), (threads, t, k)
    assert kept._scratch().f32.shape[0] >= k8.scratch_sizes(4, 12, 6, 512, 512, 64, 2)[1]


def test_a_call_too_big_to_keep_scratch_for_gets_its_own():
    """A prefill-sized call gets scratch of its own, freed after it: the kept arrays stay as they were."""
    scratch = k8.Scratch(keep_bytes=1 << 20)
    small = scratch.fit(1, 8, 128, 2048, 768, 128, 14)
    big = scratch.fit(512, 4096, 128, 2048, 768, 128, 14)
    assert big[1].nbytes > 1 << 20 and big[1] is not scratch.f32
    assert scratch.f32 is small[1] and scratch.f32.nbytes < 1 << 20


def test_more_lanes_than_threads_finish_with_the_same_result():
    """The kernel's stages wait for their tasks to be done, not for lanes to arrive: lanes that numba runs one
    after another on fewer threads (here 16 lanes on the executor's 1 or 2 threads) take no task, and nothing
    deadlocks or changes."""
    gen = torch.Generator().manual_seed(12)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=4, bias=False), codec="int4", group=64)
    ex = CpuExecutor(store, ExpertSpec())
    x = torch.randn(3, 512, generator=gen).numpy()
    tokens = np.array([0, 0, 1, 2, 2], dtype=np.int64)
    experts = np.array([1, 3, 0, 3, 2], dtype=np.int64)
    w = np.array([0.5, 0.25, 1.0, 0.75, 0.125], dtype=np.float32)
    lay = store.layout
    outs = []
    before = numba.get_num_threads()
    for threads, lanes in ((1, 1), (1, 16), (min(2, numba.config.NUMBA_NUM_THREADS), 16)):
        numba.set_num_threads(threads)
        out = np.zeros_like(x)
        answer = np.zeros(1, dtype=np.int64)
        flat = ex._layer_flat(0)
        g, u, d = ex._global_scales(0, store.layer_parts(0))
        k8.moe_layer_int8(ex._int8_codec(), flat, flat.view(np.uint16), flat.view(np.float32), lay.nbytes,
                          ex._int8_offsets(), lay.has_bias, lay.intermediate, lay.group, ex._scale_table, x, tokens,
                          experts, w, g, u, d, 0, np.float32(ex.spec.swiglu_alpha),
                          np.float32(ex.spec.swiglu_limit), out, np.zeros(k8.N_PHASES, dtype=np.int64), lanes,
                          *k8.Scratch().fit(3, 5, 4, 512, 512, 64, lanes), answer, 7 + lanes)
        assert answer[0] == 7 + lanes            # the lane that finished the last task answered
        outs.append(out)
    numba.set_num_threads(before)
    assert np.abs(outs[0]).sum() > 0
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])


def _layer_call(ex, x, tokens, experts, w, phases, lanes):
    """moe_layer_int8 on layer 0 of ex's store, as CpuExecutor calls it, with the caller's phases: its out."""
    lay = ex.store.layout
    out = np.zeros_like(x)
    flat = ex._layer_flat(0)
    g, u, d = ex._global_scales(0, ex.store.layer_parts(0))
    k8.moe_layer_int8(ex._int8_codec(), flat, flat.view(np.uint16), flat.view(np.float32), lay.nbytes,
                      ex._int8_offsets(), lay.has_bias, lay.intermediate, lay.group, ex._scale_table, x, tokens,
                      experts, w, g, u, d, 0, np.float32(ex.spec.swiglu_alpha), np.float32(ex.spec.swiglu_limit),
                      out, phases, lanes, *k8.Scratch().fit(x.shape[0], len(experts), ex.store.num_experts,
                                                            lay.hidden, lay.intermediate, lay.group, lanes),
                      np.zeros(0, dtype=np.int64), 0)
    return out


def test_a_token_gets_the_same_bits_whether_x_is_quantized_serially_or_by_tasks():
    """A single token is quantized in the call's serial start (SERIAL_X_TOKENS), more by the lanes; the down
    stage sums every expert into out itself, its row slices sized by the call's expert count. A token's answer
    must not depend on any of that: token 0 alone equals token 0 among three, bit for bit."""
    gen = torch.Generator().manual_seed(31)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=24, bias=True), codec="int4", group=64)
    ex = CpuExecutor(store, ExpertSpec())
    x = torch.randn(3, 512, generator=gen).numpy()
    experts = np.arange(24, dtype=np.int64)              # 24 distinct experts: the 16-row slices (_down_rows)
    tokens = np.repeat(np.arange(3, dtype=np.int64), 8)
    w = torch.rand(24, generator=gen).numpy()
    lanes = min(2, numba.config.NUMBA_NUM_THREADS)
    phases = k8.new_phases(lanes)
    three = _layer_call(ex, x, tokens, experts, w, phases, lanes)
    one = _layer_call(ex, x[:1].copy(), tokens[:8], experts[:8], w[:8], phases, lanes)
    assert np.abs(one).sum() > 0
    assert np.array_equal(one[0], three[0])
    want = ex.run(0, torch.from_numpy(x), tokens, experts, w)        # (the executor: the same kernel)
    assert np.array_equal(np.asarray(want), three)


def test_the_down_inputs_give_the_same_bits_quantized_by_gate_up_tasks_or_by_a_stage():
    """Up to FUSED_DOWN_INPUTS_MAX assignments the gate/up task that finishes a group of h quantizes it (and lanes
    take a down task early); a bigger call has a stage of its own for it. A token's answer is the same bits either
    way: token 0 alone (8 assignments) against token 0 among five (40), int4 and fp4, with groups of as many rows
    as a gate/up task and of two and four tasks."""
    gen = torch.Generator().manual_seed(33)
    for codec, group in (("int4", 64), ("int4", 32), ("fp4", 16), ("fp4", 32)):
        store = HostExpertStore.from_weights(_weights(gen, d=512, i=256, e=12, bias=False), codec=codec, group=group)
        ex = CpuExecutor(store, ExpertSpec(), int8=True)
        assert ex.int8
        n = k8.FUSED_DOWN_INPUTS_MAX // 8 + 1                         # tokens: one call past the fused size
        x = torch.randn(n, 512, generator=gen).numpy()
        experts = torch.randint(0, 12, (n * 8,), generator=gen).numpy().astype(np.int64)
        tokens = np.repeat(np.arange(n, dtype=np.int64), 8)
        w = torch.rand(n * 8, generator=gen).numpy()
        assert k8.fused_down_inputs(8, store.layout.group) and not k8.fused_down_inputs(n * 8, store.layout.group)
        lanes = min(2, numba.config.NUMBA_NUM_THREADS)
        phases = k8.new_phases(lanes)
        many = _layer_call(ex, x, tokens, experts, w, phases, lanes)
        one = _layer_call(ex, x[:1].copy(), tokens[:8], experts[:8], w[:8], phases, lanes)
        assert np.abs(one).sum() > 0
        assert np.array_equal(one[0], many[0]), (codec, group)


def test_each_lane_counts_its_tasks_and_cycles_per_stage():
    """With a `new_phases` array the lanes add up, per stage, their tasks and their cycles in tasks and waiting:
    the tasks over all lanes are exactly the call's plan."""
    gen = torch.Generator().manual_seed(32)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=6, bias=False), codec="int4", group=64)
    ex = CpuExecutor(store, ExpertSpec())
    lanes = min(2, numba.config.NUMBA_NUM_THREADS)
    for t, experts in ((1, [4, 1, 5]), (3, [0, 2, 2, 3, 5, 0]), (5, [0, 1, 2, 3, 4, 5, 1, 3] * 5)):
        phases = k8.new_phases(lanes)
        assert phases.ctypes.data % k8.ALIGN_BYTES == 0
        x = torch.randn(t, 512, generator=gen).numpy()
        tokens = np.arange(len(experts), dtype=np.int64) % t
        _layer_call(ex, x, tokens, np.array(experts, dtype=np.int64), np.full(len(experts), 0.5, np.float32),
                    phases, lanes)
        blocks = phases[k8.LANE_BASE:k8.LANE_BASE + lanes * k8.LANE_WORDS].reshape(lanes, k8.LANE_WORDS)
        tasks = blocks[:, k8.LANE_TASKS:k8.LANE_TASKS + k8.N_STAGES].sum(axis=0)
        n_u = len(set(experts))
        want = [0 if t <= k8.SERIAL_X_TOKENS else t * 512 // 64, n_u * 512 // k8.ROWS_PER_TASK,
                0 if k8.fused_down_inputs(len(experts), 64) else len(experts) * 512 // 64, 512 // k8._down_rows(n_u)]
        assert tasks.tolist() == want, t
        busy = blocks[:, k8.LANE_BUSY:k8.LANE_BUSY + k8.N_STAGES].sum(axis=0)
        if k8._HAVE_TSC:
            assert all((b > 0) == (n > 0) for b, n in zip(busy, want)), busy
            assert (blocks[:, k8.LANE_WAIT:k8.LANE_WAIT + k8.N_STAGES] >= 0).all()
        assert phases[k8.N_PHASES - 1] == 1                  # one call counted
        assert not phases[k8.N_PHASES:k8.LANE_BASE].any()    # the padding before the lanes' blocks untouched
        first = blocks[:, k8.LANE_FIRST:k8.LANE_FIRST + k8.N_STAGES]
        assert (first <= blocks[:, k8.LANE_BUSY:k8.LANE_BUSY + k8.N_STAGES]).all()   # one task's share of all


def test_the_scratch_regions_each_start_on_their_own_line_pair():
    """A region that shares a cache line with the one before it (the activations' scales with the first rows of h)
    is invalidated for every lane by the task writing there."""
    s64, s32, s8 = k8.Scratch().fit(3, 7, 9, 512, 384, 64, 4)
    views = k8._carve(s64, s32, s8, 3, 7, 9, 4, 512, 384, 64)
    assert all(v.ctypes.data % k8.ALIGN_BYTES == 0 for v in views), [v.ctypes.data % 128 for v in views]
    ends = sorted((v.ctypes.data, v.ctypes.data + v.nbytes) for v in views)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]) if a[0] // 8 != b[0] // 8)   # no two overlap
    assert s64.ctypes.data + s64.nbytes >= max(v.ctypes.data + v.nbytes for v in views[:7])


def test_which_path_runs_when():
    """int8 for real layer widths, the exact float kernels for small ones, the reference without numba's groups."""
    gen = torch.Generator().manual_seed(8)
    big = HostExpertStore.synthetic(layers=1, num_experts=2, hidden=512, intermediate=512, codec="fp4")
    small = HostExpertStore.synthetic(layers=1, num_experts=2, hidden=64, intermediate=64, codec="int4", group=32)
    assert CpuExecutor(big, ExpertSpec()).int8
    assert not CpuExecutor(big, ExpertSpec(), int8=False).int8
    assert not CpuExecutor(small, ExpertSpec()).int8 and CpuExecutor(small, ExpertSpec()).fast
    assert CpuExecutor(small, ExpertSpec(), int8=True).int8
    odd = HostExpertStore.from_weights(_weights(gen, d=64, i=32, e=2, bias=False), codec="int4", group=64)
    assert not CpuExecutor(odd, ExpertSpec(), int8=True).int8        # 32 is not a multiple of the group


# ---------------------------------------------------------------- the engine, greedy, with int8 misses

def test_engine_greedy_tokens_unchanged_with_int8_cpu_misses(tiny_checkpoints, tmp_path, monkeypatch):
    """The tiny qwen3_moe converted at int4 group 32 (hidden 64: whole-row path; expert width 32: group path),
    every miss through the int8 kernels: greedy decoding gives the all-resident engine's tokens."""
    from runtime.engine import Engine, SamplingParams
    from runtime.experts.hybrid import HybridExperts, hybrid_experts_factory
    from runtime.experts.planner import GiB, Hardware
    from runtime.ftw.converter import convert
    from tests.engine_fixtures import random_prompt

    path = convert(tiny_checkpoints("qwen3_moe"), tmp_path / "q-int4-g32", codec="int4", group_size=32)
    monkeypatch.setattr(cpu_executor, "INT8_MIN_WIDTH", 0)               # the tiny widths take the int8 path
    sampling = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    hw = Hardware(ram_total=16 * GiB, ram_available=16 * GiB, pinnable=8 * GiB, cpu_gbps=10.0)
    resident = Engine.load(path, device="cpu")
    hybrid = Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, hardware=hw,
                                                                               slots=4))
    experts = hybrid.model.experts
    assert isinstance(experts, HybridExperts) and experts.cpu.int8
    for seed in (5, 6):
        prompt = random_prompt(12, seed=seed)
        want = resident.generate(prompt, sampling).tokens
        got = hybrid.generate(prompt, sampling).tokens
        assert got == want and len(got) == 8
    assert experts.counters.total.cpu_experts > 0


_ONE_REGION = """
import sys
sys.path.insert(0, "tests")
import test_cpu_kernels_int8 as t
print("regions", t.count_layer_kernel_regions())
print("refcounts", t.count_stage_refcounts())
print("prefetches", t.count_stage_prefetches())
print("worker regions", t.count_worker_loop_regions())
"""


def count_layer_kernel_regions() -> int:
    """The kernel compiled afresh (the cached build keeps no diagnostics) and run once: its parallel regions."""
    fresh = njit(parallel=True, fastmath=True)(k8.moe_layer_int8.py_func)
    gen = torch.Generator().manual_seed(13)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=2, bias=False), codec="int4", group=64)
    ex = CpuExecutor(store, ExpertSpec())
    x = torch.randn(1, 512, generator=gen).numpy()
    lay, flat = store.layout, ex._layer_flat(0)
    g, u, d = ex._global_scales(0, store.layer_parts(0))
    out, answer = np.zeros_like(x), np.zeros(1, dtype=np.int64)
    fresh(ex._int8_codec(), flat, flat.view(np.uint16), flat.view(np.float32), lay.nbytes, ex._int8_offsets(),
          lay.has_bias, lay.intermediate, lay.group, ex._scale_table, x, np.array([0], dtype=np.int64),
          np.array([1], dtype=np.int64), np.array([1.0], dtype=np.float32), g, u, d, 0, np.float32(1.0),
          np.float32(7.0), out, np.zeros(k8.N_PHASES, dtype=np.int64), 2,
          *k8.Scratch().fit(1, 1, 2, 512, 512, 64, 2), answer, 5)
    assert answer[0] == 5 and np.abs(out).sum() > 0
    (compiled,) = fresh.overloads.values()
    return len(compiled.metadata["parfor_diagnostics"].initial_parfors)


def count_worker_loop_regions() -> int:
    """The worker's loop (serve_layers) compiled afresh for a worker's argument types: its parallel regions (0
    when numba could not make its prange parallel - a `raise` written inside it did that, session 16: lane 0 then
    served every request alone)."""
    import numba

    from runtime.experts.cpu_share import CpuShareWorker, Mailbox
    fresh = njit(parallel=True, fastmath=True, nogil=True)(k8.serve_layers.py_func)
    gen = torch.Generator().manual_seed(13)
    store = HostExpertStore.from_weights(_weights(gen, d=512, i=512, e=2, bias=False), codec="int4", group=64)
    ex = CpuExecutor(store, ExpertSpec())
    box = Mailbox(max_tokens=1, top_k=2, hidden=512, device=torch.device("cpu"), share=1.0, intermediate=512)
    like = CpuShareWorker.__new__(CpuShareWorker)
    like.box, like.int8_args = box, ex.int8_args()
    b = box._np
    args = (b["req"], b["resp"], b["meta"], b["ids"], b["weights"], b["x"], b["out"], b["part"], b["part_resp"], 0, 0,
            np.zeros(2, dtype=np.int64), box.cpu_times, k8.new_phases(2), 2, 1, *like._scratch_for(2),
            *like.int8_args)
    fresh.compile(tuple(numba.typeof(a) for a in args))
    (compiled,) = fresh.overloads.values()
    return len(compiled.metadata["parfor_diagnostics"].initial_parfors)


def count_stage_refcounts() -> int:
    """NRT reference-count calls in the stages' code as compiled (afresh: after count_layer_kernel_regions)."""
    import re
    return sum(len(re.findall(r"call void @NRT_(?:incref|decref)", k8._stages.inspect_llvm(sig)))
               for sig in k8._stages.signatures)


def count_stage_prefetches() -> int:
    """llvm.prefetch calls in the stages' code (the rows a task asks for ahead: gate, up, down; codes and scales)."""
    return sum(k8._stages.inspect_llvm(sig).count("call void @llvm.prefetch") for sig in k8._stages.signatures)


def test_the_layer_kernel_is_one_parallel_region(tmp_path):
    """numba makes a parallel region of every whole-array expression in a parallel=True function (`a[:] = 0`),
    and each costs ~20 µs to start and join on the GPU machine's 16 cores (three fills were run r's 58 µs
    "prologue" a request): the kernel has its prange alone; and the stages it runs count no references. In a
    subprocess with LLVM's optimiser off (NUMBA_OPT=0: both are counted before LLVM; ~25 s of compile instead of
    ~40) and a cache of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, NUMBA_OPT="0", NUMBA_CACHE_DIR=str(tmp_path))
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _ONE_REGION], capture_output=True, text=True, timeout=600,
                         cwd=root, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "regions 1" in run.stdout, run.stdout
    # the stages are a function of their own (compiled once for the kernel and the worker's loop), called by each
    # lane: with numba's reference counting on, every helper inlined into it counted the shared arrays it was
    # passed - atomics on the same words from every lane at every row, ~10x slower on 14 lanes (runs w, x)
    assert "refcounts 0" in run.stdout, run.stdout
    # and its row tasks ask for the rows ahead of the one they compute (run z2: a hot row's ~400 ns was a miss's
    # latency): a prefetch of codes, scales and mins at each of the three row sites, before and inside the loops
    assert int(run.stdout.split("prefetches")[1].split()[0]) >= 6, run.stdout
    # the worker's loop is one parallel region too: a `raise` written inside it made numba run its prange as a
    # serial loop (a performance warning, no error) - lane 0 alone served every request, ~8 GB/s on the GPU
    # machine where 14 lanes make 56-77 (session 16; validation now quits the region, serve_int8 raises)
    assert "worker regions 1" in run.stdout, run.stdout


def test_a_flavour_can_be_picked_for_measurements_with_its_own_cache(monkeypatch):
    """FREETOKEN_CPU_ISA picks a flavour this CPU runs (an A/B of 256- against 512-bit dot products); numba's cache
    does not key the kernels by it, so without a cache folder of its own it refuses, and an unknown one too."""
    flavour = k8.host_isas()[-1]                    # "generic": every CPU runs it
    monkeypatch.setenv("FREETOKEN_CPU_ISA", flavour)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    with pytest.raises(RuntimeError, match="NUMBA_CACHE_DIR"):
        k8.detect_isa()
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/tmp/freetoken-isa-cache")
    assert k8.detect_isa() == flavour
    monkeypatch.setenv("FREETOKEN_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="this CPU runs"):
        k8.detect_isa()
    monkeypatch.delenv("FREETOKEN_CPU_ISA")
    assert k8.detect_isa() == k8.ISA


def test_a_prefetch_variant_is_picked_like_a_flavour(monkeypatch):
    """FREETOKEN_CPU_PREFETCH_BYTES / _LOCALITY change constants compiled into the stages (session 13's A/B of
    2 KB, 4 KB and prefetcht1): like FREETOKEN_CPU_ISA, another value needs a cache folder of its own, and a value
    out of range is refused; the default needs nothing."""
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("FREETOKEN_CPU_PREFETCH_BYTES", "4096")
    with pytest.raises(RuntimeError, match="NUMBA_CACHE_DIR"):
        k8._measurement_knob("FREETOKEN_CPU_PREFETCH_BYTES", 2048, range(64, 1 << 16))
    monkeypatch.setenv("FREETOKEN_CPU_PREFETCH_BYTES", str(k8.PREFETCH_BYTES))
    assert k8._measurement_knob("FREETOKEN_CPU_PREFETCH_BYTES", k8.PREFETCH_BYTES, range(64, 1 << 16)) == 2048
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/tmp/freetoken-prefetch-cache")
    monkeypatch.setenv("FREETOKEN_CPU_PREFETCH_LOCALITY", "2")
    assert k8._measurement_knob("FREETOKEN_CPU_PREFETCH_LOCALITY", 3, range(4)) == 2
    monkeypatch.setenv("FREETOKEN_CPU_PREFETCH_LOCALITY", "7")
    with pytest.raises(ValueError, match="expected 0..3"):
        k8._measurement_knob("FREETOKEN_CPU_PREFETCH_LOCALITY", 3, range(4))


def test_a_row_s_rows_ahead_are_a_byte_distance():
    """PREFETCH_BYTES of codes ahead, in whole rows and at least one: a gate/up row of 1 KB (hidden 2048, int4)
    2 rows ahead, a down row of 384 B (width 768) 6, a 4 KB row 1."""
    assert [int(k8._rows_ahead(np.uint64(n))) for n in (1024, 384, 4096)] == [2, 6, 1]
