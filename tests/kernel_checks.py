"""Kernel-vs-reference checks run in a child process with TRITON_INTERPRET=1 (Triton's CPU interpreter), so
that GPU-less machines test the Triton kernels' logic. Also importable with `--device cuda` (compiled kernels).

    python -m tests.kernel_checks norm_rope        # exits 0 when every check passed, prints the worst errors
"""
from __future__ import annotations

import sys

import torch


def _as_kernel_rounds(v: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """fp32 -> dtype as the kernel does it: round to nearest even compiled on a GPU, but Triton's CPU
    interpreter truncates to bf16 (checked), so there the expected value is the truncation."""
    if dtype != torch.bfloat16 or device == "cuda":
        return v.to(dtype)
    return (v.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)


def check_norm_rope(device: str = "cpu") -> list[str]:
    from runtime.kernels import norm_rope_triton as k
    from runtime.models.blocks import RMSNorm, Rotary

    failures = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for flavour in ("llama", "fp32", "offset"):
            for rows, d in ((1, 64), (5, 96), (3, 2048)):
                norm = RMSNorm(d, eps=1e-6, flavour=flavour)
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(d, generator=gen) * 0.1 + (0.0 if flavour == "offset" else 1.0))
                norm = norm.to(device, dtype if flavour == "llama" else torch.float32)
                x = (torch.randn(rows, d, generator=gen) * 3).to(device, dtype)
                got, want = k.rms_norm(x, norm.weight, eps=norm.eps, flavour=flavour), norm.reference(x)
                r = torch.randn(rows, d, generator=gen).to(device, dtype)
                total, normed = k.add_rms_norm(x, r, norm.weight, eps=norm.eps, flavour=flavour)
                if not torch.equal(total, _as_kernel_rounds(x.float() + r.float(), dtype, device)):
                    failures.append(f"add_rms_norm {dtype} {flavour} {rows}x{d}: the sum differs from x + r")
                got, want = torch.cat([got, normed]), torch.cat([want, norm.reference(x + r)])
                err = (got.float() - want.float()).abs().max().item()
                # bf16: the fp32 sum of squares adds up in another order, which may flip the rounding of the
                # normalised value by one unit in the last place, and the weight multiply rounds again: 2 ulps
                tol = 0.0 if dtype == torch.float32 else 2 ** -6 * want.float().abs().max().item()
                if got.dtype != want.dtype or err > max(tol, 1e-5):
                    failures.append(f"rms_norm {dtype} {flavour} {rows}x{d}: max error {err:.3g}")
        for hd, factor, with_norm in ((128, 1.0, True), (64, 1.0, False), (256, 0.25, True)):
            n, h = 3, 4
            rope = Rotary(head_dim=hd, theta=10000.0, partial_rotary_factor=factor)
            rope.init_buffers(device=device)
            pos = torch.tensor([0, 7, 1000], device=device)
            cos, sin = rope.cos_sin(pos, dtype)
            norm = RMSNorm(hd, eps=1e-6, flavour="llama") if with_norm else None
            if norm is not None:
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(hd, generator=gen) * 0.1 + 1.0)
                norm = norm.to(device, dtype)
            # q as a view of a fused q/k/v projection's output: rows strided past the heads
            x = torch.randn(n, h * hd + 3 * hd, generator=gen).to(device, dtype)[:, :h * hd].view(n, h, hd)
            want = rope.apply(norm.reference(x) if norm is not None else x, cos, sin)
            got = k.norm_rope(x, cos, sin, weight=None if norm is None else norm.weight, eps=1e-6,
                              rotary_dim=rope.rotary_dim)
            err = (got.float() - want.float()).abs().max().item()
            tol = 1e-5 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
            if err > tol:
                failures.append(f"norm_rope {dtype} hd {hd} rd {rope.rotary_dim} norm {with_norm}: max error {err:.3g}")
            failures += _check_norm_rope_store(k, x, cos, sin, norm, rope, dtype, device, gen)
    return failures


def _check_norm_rope_store(k, x, cos, sin, norm, rope, dtype, device, gen) -> list[str]:
    """norm_rope_store: k's normed, rotated rows land in the key cache at the rows given on the device (exactly
    what norm_rope computes), v's rows in the value cache at the same rows, and nothing else changes."""
    n, h, hd = x.shape
    label = f"norm_rope_store {dtype} hd {hd} rd {rope.rotary_dim} norm {norm is not None}"
    # a cache of capacity 12 viewed as the engine keeps it ([Hkv, S, hd]), filled with sentinels
    keys = torch.full((h, 12, hd), 7.0, dtype=dtype, device=device)
    values = torch.full((h, 12, hd), -7.0, dtype=dtype, device=device)
    rows = torch.tensor([5, 0, 11], device=device)
    v = torch.randn(n, h * hd + 2 * hd, generator=gen).to(device, dtype)[:, hd:hd + h * hd].view(n, h, hd)
    weight = None if norm is None else norm.weight
    k.norm_rope_store(x, v, cos, sin, keys, values, rows, weight=weight, eps=1e-6, rotary_dim=rope.rotary_dim)
    rotated = k.norm_rope(x, cos, sin, weight=weight, eps=1e-6, rotary_dim=rope.rotary_dim)     # [N, Hkv, hd]
    failures = []
    if not torch.equal(keys[:, rows].transpose(0, 1), rotated):
        failures.append(f"{label}: the stored keys differ from norm_rope's")
    if not torch.equal(values[:, rows].transpose(0, 1), v):
        failures.append(f"{label}: the stored values differ from v")
    others = torch.ones(12, dtype=torch.bool, device=device)
    others[rows] = False
    if not (torch.all(keys[:, others] == 7.0) and torch.all(values[:, others] == -7.0)):
        failures.append(f"{label}: rows other than the given ones changed")
    try:
        k.norm_rope_store(x, v[:, :1], cos, sin, keys, values, rows, weight=weight, rotary_dim=rope.rotary_dim)
        failures.append(f"{label}: a v of another shape was accepted")
    except ValueError:
        pass
    return failures


def check_dequant(device: str = "cpu") -> list[str]:
    """The Triton dequantizer against the torch reference (within one bf16 rounding step: the kernel may fuse
    q*s+m into one FMA where torch rounds twice), and the grouped-GEMM prefill path against the padded-bmm
    reference, with -1 slots and several dequantize-and-GEMM rounds per call."""
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec, ExpertWeights
    from runtime.kernels.dequant_triton import dequantize_experts
    from runtime.kernels import expert_pool
    from runtime.kernels.expert_pool import dequantize_blocks, pool_forward_grouped

    failures = []
    gen = torch.Generator().manual_seed(1)
    for codec, group, d, i in (("int4", 32, 64, 32), ("int4", 128, 128, 128), ("fp4", 32, 64, 32)):
        experts = 4
        weights = {(0, e): ExpertWeights(torch.randn(i, d, generator=gen) * 0.3, torch.randn(i, d, generator=gen) * 0.3,
                                         torch.randn(d, i, generator=gen) * 0.3) for e in range(experts)}
        store = HostExpertStore.from_weights(weights, codec=codec, group=group, fp4_format="mxfp4")
        pool = torch.from_numpy(store.layer_buffer(0).copy()).to(device)
        slots = torch.tensor([3, 0], device=device)
        gate_up, down = dequantize_experts(pool, store.layout, slots, dtype=torch.bfloat16)
        blocks = pool.index_select(0, slots)
        want_gu = torch.cat([dequantize_blocks(blocks, store.layout, "gate", torch.bfloat16),
                             dequantize_blocks(blocks, store.layout, "up", torch.bfloat16)], dim=1)
        want_down = dequantize_blocks(blocks, store.layout, "down", torch.bfloat16)
        err = max((gate_up.float() - want_gu.float()).abs().max().item(),
                  (down.float() - want_down.float()).abs().max().item())
        if err > 1.01 * 2 ** -7 * max(want_gu.float().abs().max().item(), want_down.float().abs().max().item()):
            failures.append(f"dequant {codec} g{group}: max error "
                            f"{(gate_up.float() - want_gu.float()).abs().max().item():.3g}")
        for t in (24,):
            x = torch.randn(t, d, generator=gen).to(device, torch.bfloat16)
            sl = torch.randint(-1, experts, (t, 3), generator=gen).to(device)
            w = torch.rand(t, 3, generator=gen).to(device)
            ref = pool_forward_grouped(pool, store.layout, ExpertSpec(), x.float(), sl, w, fast=False)
            # a workspace of 2 experts: several dequantize-and-GEMM rounds per call
            got = pool_forward_grouped(pool, store.layout, ExpertSpec(), x, sl, w, fast=True,
                                       workspace_bytes=2 * 3 * d * i * 2)
            rel = ((got.float() - ref).norm() / ref.norm().clamp(min=1e-6)).item()
            if got.dtype != torch.bfloat16 or rel > 2e-2:
                failures.append(f"grouped {codec} g{group} T{t}: relative error {rel:.3g}")
            # rounds cut by rows as well (a long prefill chunk); a slot here has ~18 rows: 5 rows a round leaves
            # one slot a round, over the cap; 40 two slots a round; the sum is the same
            for rows in (5, 40):
                saved, expert_pool.GROUPED_BATCH_ROWS = expert_pool.GROUPED_BATCH_ROWS, rows
                try:
                    cut = pool_forward_grouped(pool, store.layout, ExpertSpec(), x, sl, w, fast=True)
                finally:
                    expert_pool.GROUPED_BATCH_ROWS = saved
                rel = ((cut.float() - ref).norm() / ref.norm().clamp(min=1e-6)).item()
                if rel > 2e-2:
                    failures.append(f"grouped {codec} g{group} T{t}, {rows}-row rounds: relative error {rel:.3g}")
    return failures


def check_gdn_decode(device: str = "cpu") -> list[str]:
    """The fused Gated DeltaNet decode step (runtime/kernels/gdn_decode_triton.py) against the layer's torch form:
    output, both new states at the sequences' slots (the conv state exactly: it only moves values), the other
    slots untouched; fp32 and bf16; packed (Qwen3-Next) and separate (Qwen3.5) projections; head dims that are
    and are not powers of two; one sequence without slots and three with. Then the layer's first-use check
    accepts it and refuses a broken kernel."""
    from runtime.kernels import gdn_decode_triton
    from runtime.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig

    failures = []
    gen = torch.Generator().manual_seed(7)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))

    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for packed, (hk, hv, dk, dv) in ((False, (2, 4, 16, 32)), (True, (2, 4, 16, 32)), (False, (3, 3, 24, 20))):
            cfg = GatedDeltaNetConfig(hidden_size=64, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
            gdn = GatedDeltaNet(cfg, packed=packed, backend="torch")
            with torch.no_grad():
                for name, p in gdn.named_parameters():
                    if name == "A_log":
                        p.copy_(torch.rand(p.shape, generator=gen) * 2.5)
                    elif name == "dt_bias":
                        p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
                    elif name == "norm.weight":
                        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                    else:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            gdn = gdn.to(device, dtype)
            S = 5
            conv_pool = torch.randn(S, *cfg.conv_state_shape(), generator=gen).to(device, dtype)
            rec_pool = (torch.randn(S, *cfg.recurrent_state_shape(), generator=gen) * 0.2).to(device)
            for slots in (None, [4, 0, 2]):
                b = 1 if slots is None else len(slots)
                x = torch.randn(b, 64, generator=gen).to(device, dtype)
                rows = torch.tensor([2] if slots is None else slots, device=device)
                want, want_conv, want_rec = gdn(x[:, None], conv_pool[rows].clone(), rec_pool[rows].clone())
                conv, rec = conv_pool.clone(), rec_pool.clone()
                if slots is None:          # a single sequence's slot views, as the static path passes them
                    got = gdn.decode_in_place(x, conv[2:3], rec[2:3])
                else:
                    got = gdn.decode_in_place(x, conv, rec, torch.tensor(slots, device=device))
                case = f"{dtype} packed={packed} heads {hk}/{hv} dims {dk}/{dv} slots {slots}"
                if got.dtype != dtype or got.shape != (b, 64) or rel(got, want[:, 0]) > tol:
                    failures.append(f"{case}: output relative error {rel(got, want[:, 0]):.3g}")
                if not torch.equal(conv[rows], want_conv.to(dtype)):
                    failures.append(f"{case}: conv state differs")
                if rel(rec[rows], want_rec) > (1e-5 if dtype == torch.float32 else 1e-2):
                    failures.append(f"{case}: recurrent state relative error {rel(rec[rows], want_rec):.3g}")
                untouched = [i for i in range(S) if i not in rows.tolist()]
                if not (torch.equal(conv[untouched], conv_pool[untouched]) and
                        torch.equal(rec[untouched], rec_pool[untouched])):
                    failures.append(f"{case}: another slot's state changed")
            # the first-use check: accepts the kernel, leaves the caller's states alone, refuses a broken one
            before = (conv_pool.clone(), rec_pool.clone())
            x = torch.randn(3, 64, generator=gen).to(device, dtype)
            idx = torch.tensor([1, 3, 4], device=device)
            if not gdn.check_fused_decode(x, conv_pool, rec_pool, idx):
                failures.append(f"{dtype} packed={packed}: the first-use check refused a correct kernel")
            if not (torch.equal(conv_pool, before[0]) and torch.equal(rec_pool, before[1])):
                failures.append(f"{dtype} packed={packed}: the first-use check changed the caller's states")
            real = gdn_decode_triton.gdn_decode
            gdn_decode_triton.gdn_decode = lambda *a, **k: real(*a, **k) * 1.5
            try:
                if gdn.check_fused_decode(x, conv_pool, rec_pool, idx):
                    failures.append(f"{dtype} packed={packed}: the first-use check accepted a wrong output")
            finally:
                gdn_decode_triton.gdn_decode = real
    return failures


def _int8_linear_failures(k, device: str, gen: torch.Generator, cases) -> list[str]:
    """`k.int8_linear` against `k.int8_linear_reference` for cases (dtype, M, N, K, bias, x layout, plans): each plan
    within tolerance, and a split plan's output the same bits when run again (the partials add up in a fixed
    order). x layouts: "dense", "sliced" (rows of a wider tensor), "transposed" (a unit row stride: copied).
    Tolerance per element: the dtype's eps x |want| (one unit in the last place where the fp32 sums, added in
    another order, round the other way) + 1e-5 x max |want| (the fp32 sums' own order)."""
    failures = []
    for dtype, m, n, kd, with_bias, layout, plans in cases:
        w = torch.randn(n, kd, generator=gen)
        w[n // 2] = 0.0                                                       # a row of zeros: scale 1.0
        q, scale = (t.to(device) for t in k.quantize_int8(w))
        if layout == "sliced":
            x = torch.randn(m, kd + 24, generator=gen)[:, 8:8 + kd]
        elif layout == "transposed":
            x = torch.randn(kd, m, generator=gen).T
        else:
            x = torch.randn(m, kd, generator=gen)
        x = x.to(device, dtype)
        bias = (torch.randn(n, generator=gen) * 4).to(device, dtype) if with_bias else None
        want32 = k.int8_linear_reference(x.float(), q, scale, None if bias is None else bias.float())
        want = _as_kernel_rounds(want32, dtype, device)
        if not torch.equal(k.int8_linear_reference(x, q, scale, bias), want32.to(dtype)):
            failures.append(f"int8_linear_reference {dtype}: not the fp32 result rounded to x's dtype")
        peak = want.float().abs().max().item()
        tol = torch.finfo(dtype).eps * want.float().abs() + 1e-5 * peak
        for plan in plans:
            label = f"int8_linear {dtype} M{m} N{n} K{kd} bias {with_bias} x {layout} plan {plan}"
            got = k.int8_linear(x, q, scale, bias, plan=plan)
            if got.dtype != dtype or got.shape != (m, n):
                failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}")
                continue
            err = (got.float() - want.float()).abs()
            if not bool((err <= tol).all()):
                failures.append(f"{label}: max error {err.max().item():.3g} (output scale {peak:.3g})")
            if (plan or k.plan(m, n, kd)).split_k > 1 and not torch.equal(k.int8_linear(x, q, scale, bias, plan=plan),
                                                                          got):
                failures.append(f"{label}: a rerun gave other bits")
    return failures


def check_int8_linear(device: str = "cpu") -> list[str]:
    """The int8 weight-only linear kernel (runtime/kernels/int8_linear_triton.py) against its torch definition:
    M 1/3/16, fp32 and bf16 (fp16 once), N and K that are and are not multiples of the tiles, bias or not, rows
    of x strided, K split 1 and 2-4 ways (an empty split too) with reruns bit-identical, `out=`; quantize_int8's
    round trip; bad arguments refused; and a kernel whose scales are 1% off fails these checks."""
    from runtime.kernels import int8_linear_triton as k

    failures = []
    gen = torch.Generator().manual_seed(11)
    P = k.Int8Plan
    # N 40 / K 200: a short last column block and a masked last K step; split 3 over 2 steps leaves one empty
    small = (P(16, 128, 1), P(16, 128, 3))
    # N 256 / K 512: the default plan (32-row tiles split 2 ways), one split of 16 x 256, 64-row tiles split 4 ways
    real = (None, P(16, 256, 1), P(64, 128, 4))
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for m, with_bias, layout in ((1, True, "dense"), (3, False, "sliced"), (16, True, "sliced")):
            cases.append((dtype, m, 40, 200, with_bias, layout, small))
            cases.append((dtype, m, 256, 512, not with_bias, layout, real))
    cases.append((torch.float16, 5, 40, 200, True, "transposed", (P(32, 128, 2),)))
    failures += _int8_linear_failures(k, device, gen, cases)

    # out=: written in place (rows of a wider buffer) and returned
    q, scale = (t.to(device) for t in k.quantize_int8(torch.randn(48, 64, generator=gen)))
    x = torch.randn(2, 64, generator=gen).to(device, torch.bfloat16)
    buf = torch.full((2, 56), 3.0, dtype=torch.bfloat16, device=device)
    got = k.int8_linear(x, q, scale, out=buf[:, 4:52], plan=P(16, 128, 2))
    if got.data_ptr() != buf[:, 4:52].data_ptr() or not torch.equal(got, k.int8_linear(x, q, scale)) or \
            not (torch.all(buf[:, :4] == 3.0) and torch.all(buf[:, 52:] == 3.0)):
        failures.append("int8_linear out=: not written in place, or written outside its columns")

    # quantize_int8: |q * scale - w| <= scale / 2 per element (and fp32's rounding), zero rows at scale 1
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(37, 50, generator=gen) * torch.logspace(-3, 2, 37)[:, None]).to(device, dtype)
        w[5] = 0.0
        w[9, 7] = -1e3                                                        # one outlier: that row's scale
        q, scale = k.quantize_int8(w)
        deq = q.float() * scale[:, None]
        if q.dtype != torch.int8 or q.shape != w.shape or not q.is_contiguous() or scale.dtype != torch.float32 \
                or scale.shape != (37,):
            failures.append(f"quantize_int8 {dtype}: got {q.dtype} {tuple(q.shape)}, scale {scale.dtype} "
                            f"{tuple(scale.shape)}")
        elif not bool(((deq - w.float()).abs() <= scale[:, None] * (0.5 + 1e-5)).all()):
            failures.append(f"quantize_int8 {dtype}: an element further than scale / 2 from its weight")
        elif scale[5].item() != 1.0 or bool(q[5].any()) or \
                q.abs().amax(dim=1)[torch.arange(37, device=device) != 5].min().item() != 127:
            failures.append(f"quantize_int8 {dtype}: zero row not at scale 1, or a row not spanning +-127")

    # bad arguments: clear errors before any launch
    q, scale = (t.to(device) for t in k.quantize_int8(torch.randn(16, 32, generator=gen)))
    x = torch.randn(17, 32, generator=gen).to(device)
    for label, call, words in (
            ("M > MAX_M", lambda: k.int8_linear(x, q, scale), "int8_linear_reference"),
            ("K mismatch", lambda: k.int8_linear(x[:2, :16], q, scale), "int8"),
            ("float weights", lambda: k.int8_linear(x[:2], q.float(), scale), "int8"),
            ("fp16 scale", lambda: k.int8_linear(x[:2], q, scale.half()), "scale"),
            ("bias shape", lambda: k.int8_linear(x[:2], q, scale, scale[:8]), "bias"),
            ("out dtype", lambda: k.int8_linear(x[:2], q, scale, out=torch.empty(2, 16, device=device,
                                                                                  dtype=torch.bfloat16)), "out"),
            ("bad plan", lambda: k.int8_linear(x[:2], q, scale, plan=P(8, 128)), "power")):
        try:
            call()
            failures.append(f"int8_linear {label}: accepted")
        except ValueError as exc:
            if words not in str(exc):
                failures.append(f"int8_linear {label}: the error does not say {words!r}: {exc}")

    # a broken kernel (scales 1% off) must fail the same checks, split or not
    real_linear = k.int8_linear
    k.int8_linear = lambda x, q, scale, bias=None, **kw: real_linear(x, q, scale * 1.01, bias, **kw)
    try:
        caught = _int8_linear_failures(k, device, gen, [(torch.float32, 3, 40, 200, True, "dense", small),
                                                        (torch.bfloat16, 3, 40, 200, True, "dense", small)])
        if len(caught) != 4:
            failures.append(f"int8_linear: scales 1% off passed {4 - len(caught)} of 4 checks")
    finally:
        k.int8_linear = real_linear
    return failures


CHECKS = {"norm_rope": check_norm_rope, "dequant": check_dequant, "gdn_decode": check_gdn_decode,
          "int8_linear": check_int8_linear}

if __name__ == "__main__":
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    bad = CHECKS[sys.argv[1]](device)
    print("\n".join(bad) or "all passed")
    sys.exit(1 if bad else 0)
