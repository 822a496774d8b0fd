"""The CPU expert kernels with int8 activations: integer dot products over the packed int4/fp4 groups.

`moe_layer_int8` runs all of a layer's missed (token, expert) assignments in one call: it quantizes the
activations to int8 once per token and group (scale = amax / 127), multiplies them against the weight codes
with byte dot-product instructions (4 byte-products per 32-bit lane: AVX-512 VNNI `vpdpbusd`, AVX-VNNI, or
AVX2 `vpmaddubsw`), applies the group's weight scale (and the int4 min through the group's activation sum),
does the same for the down projection's input, and adds the weighted results into the output. The exact
float kernels (cpu_kernels.py) stay for small layers; cpu_executor.py says when each runs.

Accuracy: only the activations are rounded, so for one projection, per output row,
    |y - y_exact| <= sum_g (s_g / 2) * sum_{k in g} |W_k|      (s_g the group's activation scale, W dequantized)
plus float rounding; tests/test_cpu_kernels_int8.py checks that bound and the whole expert's relative error.

Why hand-written IR for the dot: numba widens every integer expression to int64, so a plain loop over nibbles
and int8 activations vectorizes into 8-lane int64 multiplies; and LLVM does not form the byte dot-product
instructions from a reduction by itself. The intrinsics below load a group's packed weights and its int8
activations as vectors and multiply-accumulate unsigned-byte x signed-byte pairs into int32 with the best
instruction the host has, chosen once at import:

- `vnni512` (AVX-512 VNNI: Xeon since Cascade Lake, Zen 4+): `vpdpbusd`, 64 byte-products per instruction;
- `avxvnni` (AVX-VNNI: Core 12th gen+): the same instruction at 256 bits;
- `avx2`: `vpmaddubsw` + `vpmaddwd` (llama.cpp's AVX2 path; pair sums stay under 2 x 15 x 127, no saturation);
- `generic` (ARM, old x86, NUMBA_CPU_NAME set): zext/sext multiply + reduce, which LLVM lowers per target.

Layout contract (`_quantize_row` writes it; byte j of a row holds element 2j low, 2j+1 high): on the whole-row
path every 64 activations are stored as their 32 even elements then their 32 odd ones, so `concat(low
nibbles, high nibbles)` of a 32-byte step lines up element for element with 64 activation bytes, whatever
the group size; on the group-by-group path (rows not a multiple of 64) the same holds per group.

- int4: u = nibble codes 0..15; dot = sum u * xq; W x = scale * dot * s_x + min * s_x * sum xq per group.
- fp4 (e2m1): u = |2 * e2m1(code)| in 0..12 (an integer: m + (m-4)+ + 2 (m-6)+ of the magnitude bits m), and
  the code's sign bit moves onto the activation (xq -> -xq), as llama.cpp does with `vpsignb`.

numba's cache watches only this file: after editing `cpu_kernels._act` (imported below), touch this one.

Shapes: A assignments, U distinct experts, T tokens, D hidden, I expert width, G groups per row.
"""
from __future__ import annotations

import os
import platform

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from runtime.experts.cpu_kernels import _act

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
GROUP_BYTES = (8, 16, 32, 64)       # packed bytes per group: fp4 blocks of 16, 32; int4 groups of 32, 64, 128
SUPPORTED = {"int4": (32, 64, 128), "fp4": (16, 32)}     # codec -> group sizes these kernels have code for


ISAS = ("vnni512", "avxvnni", "avx2", "generic")


def host_isas() -> list[str]:
    """Every flavour this CPU can run, best first (the tests run each one this CPU has)."""
    return [isa for isa in ISAS if isa == "generic" or _host_has(isa)]


def _host_has(isa: str) -> bool:
    try:
        feats = llvm.get_host_cpu_features()
    except RuntimeError:                           # not every platform reports features
        return False
    has = lambda name: name in feats and bool(feats[name])    # noqa: E731
    need = {"vnni512": ("avx512vnni", "avx512vl", "avx512bw"), "avxvnni": ("avxvnni",),
            "avx2": ("avx2",)}[isa]
    return all(has(f) for f in need)


def detect_isa() -> str:
    """The dot-product flavour for the CPU numba compiles for. It is baked into the cached machine code, which
    numba keys by CPU name and features, so a cache from another machine is never reused here.

    `FREETOKEN_CPU_ISA` picks another flavour this CPU runs, for measurements (e.g. 256-bit AVX-VNNI against
    AVX-512 on a Xeon). numba's cache does not key the kernels by it, so it needs a NUMBA_CACHE_DIR of its own."""
    want = os.environ.get("FREETOKEN_CPU_ISA", "").strip()
    if want:
        if want not in host_isas():
            raise ValueError(f"FREETOKEN_CPU_ISA={want}: this CPU runs {', '.join(host_isas())}")
        _needs_own_cache("FREETOKEN_CPU_ISA")
        return want
    if config.CPU_NAME not in (None, "host"):      # compiling for another CPU (portable cache): no host features
        return "generic"
    return host_isas()[0]


def _needs_own_cache(name: str) -> None:
    """A measurement setting that changes the compiled kernels: numba's cache does not key them by it, so the
    default cache would serve code built for another value."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        raise RuntimeError(f"{name} needs a NUMBA_CACHE_DIR of its own: numba's cache does not key the kernels by "
                           "it, so the default cache would serve another value")


ISA = detect_isa()


def _measurement_knob(name: str, default: int, allowed: range) -> int:
    """An integer baked into the compiled kernels that an environment variable may change for a measurement (an
    A/B of compiled variants in one call). numba's cache does not key the kernels by it, so a changed value needs a
    NUMBA_CACHE_DIR of its own, as FREETOKEN_CPU_ISA does."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value not in allowed:
        raise ValueError(f"{name}={raw}: expected {allowed.start}..{allowed.stop - 1} (a whole number)")
    if value != default:
        _needs_own_cache(name)
    return value


# ------------------------------------------------------------------ IR helpers
def _vec(elt, n):
    return ir.VectorType(elt, n)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _elem_ptr(builder, context, aryty, ary, index):
    """&ary.data[index] (index in elements), for typed or opaque LLVM pointers."""
    data = context.make_array(aryty)(context, builder, ary).data
    if getattr(data.type, "is_opaque", False):
        return builder.gep(data, [index], inbounds=True, source_etype=context.get_data_type(aryty.dtype))
    return builder.gep(data, [index], inbounds=True)


def _load_at(builder, ptr, vty):
    if getattr(ptr.type, "is_opaque", False):
        return builder.load(ptr, typ=vty, align=1)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _load(builder, context, aryty, ary, offset, vty):
    """vty loaded (unaligned) from &ary.data[offset] (offset counted in elements of a 1-byte array)."""
    return _load_at(builder, _elem_ptr(builder, context, aryty, ary, offset), vty)


def _slice(builder, v, start, n):
    return builder.shuffle_vector(v, v, ir.Constant(_vec(I32, n), list(range(start, start + n))))


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(_vec(I32, 2 * n), list(range(2 * n))))


def _dot_u8s8(builder, u, s, isa: str):
    """sum_j u[j] * s[j] as i32, for <m x i8> vectors u (unsigned, < 16) and s (signed); m in 16..128."""
    m = u.type.count
    if isa in ("vnni512", "avxvnni"):
        width = 64 if isa == "vnni512" and m >= 64 else min(m, 32)
        lanes = _vec(I32, width // 4)
        acc = ir.Constant(lanes, [0] * (width // 4))
        name = f"llvm.x86.avx512.vpdpbusd.{width * 8}"
        for c in range(0, m, width):
            uc = builder.bitcast(_slice(builder, u, c, width) if m > width else u, lanes)
            sc = builder.bitcast(_slice(builder, s, c, width) if m > width else s, lanes)
            acc = _call(builder, name, lanes, [acc, uc, sc])
        return _call(builder, f"llvm.vector.reduce.add.v{width // 4}i32", I32, [acc])
    if isa == "avx2":
        width = min(m, 32)
        pairs, quads = _vec(I16, width // 2), _vec(I32, width // 4)
        ones = ir.Constant(pairs, [1] * (width // 2))
        mub, mwd = (("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd") if width == 32 else
                    ("llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd"))
        acc = ir.Constant(quads, [0] * (width // 4))
        for c in range(0, m, width):
            uc = _slice(builder, u, c, width) if m > width else u
            sc = _slice(builder, s, c, width) if m > width else s
            acc = builder.add(acc, _call(builder, mwd, quads, [_call(builder, mub, pairs, [uc, sc]), ones]))
        return _call(builder, f"llvm.vector.reduce.add.v{width // 4}i32", I32, [acc])
    wide = _vec(I32, m)
    prod = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    return _call(builder, f"llvm.vector.reduce.add.v{m}i32", I32, [prod])


def _nibbles(builder, w):
    """<n x i8> packed bytes -> <2n x i8> codes: the n low nibbles, then the n high nibbles."""
    n = w.type.count
    lo = builder.and_(w, ir.Constant(w.type, [15] * n))
    hi = builder.lshr(w, ir.Constant(w.type, [4] * n))
    return _concat(builder, lo, hi)


_E2M1_TWICE = [0, 1, 2, 3, 4, 6, 8, 12] * 2          # |2 * e2m1(code)| by code (the sign bit is dropped)


def _e2m1_twice(builder, codes, isa: str = "generic"):
    """e2m1 codes <m x i8> -> (|2 * value| <m x i8> in 0..12, sign mask <m x i1>): a byte shuffle through a
    16-entry table on x86 (pshufb looks up within each 16-byte lane), integer arithmetic elsewhere."""
    m = codes.type.count
    c = lambda v: ir.Constant(codes.type, [v] * m)                 # noqa: E731
    neg = builder.icmp_unsigned("!=", builder.and_(codes, c(8)), c(0))
    if isa != "generic" and m in (32, 64):
        if isa == "vnni512" and m == 64:
            lut = ir.Constant(codes.type, _E2M1_TWICE * 4)
            return _call(builder, "llvm.x86.avx512.pshuf.b.512", codes.type, [lut, codes]), neg
        lut = ir.Constant(_vec(I8, 32), _E2M1_TWICE * 2)
        halves = [_call(builder, "llvm.x86.avx2.pshuf.b", lut.type, [lut, _slice(builder, codes, h, 32)])
                  for h in range(0, m, 32)]
        return (halves[0] if m == 32 else _concat(builder, halves[0], halves[1])), neg
    mag = builder.and_(codes, c(7))
    usub = f"llvm.usub.sat.v{m}i8"
    twice = builder.add(builder.add(mag, _call(builder, usub, codes.type, [mag, c(4)])),
                        builder.shl(_call(builder, usub, codes.type, [mag, c(6)]), c(1)))
    return twice, neg


def make_dot(n: int, codec: str, isa: str):
    """The intrinsic for groups of n packed bytes of `codec` ("int4" | "fp4") with the `isa` flavour."""
    @intrinsic
    def dot(typingctx, buf, boff, xq, xoff):
        """int32 dot of the n packed bytes at buf[boff:] with the 2n int8 activations at xq[xoff:]."""
        if not (isinstance(buf, types.Array) and buf.dtype == types.uint8 and isinstance(xq, types.Array)
                and xq.dtype == types.int8):
            return None
        sig = types.int32(buf, boff, xq, xoff)

        def codegen(context, builder, signature, args):
            w = _load(builder, context, signature.args[0], args[0], args[1], _vec(I8, n))
            s = _load(builder, context, signature.args[2], args[2], args[3], _vec(I8, 2 * n))
            codes = _nibbles(builder, w)
            if codec == "int4":
                return _dot_u8s8(builder, codes, s, isa)
            twice, neg = _e2m1_twice(builder, codes)
            s = builder.select(neg, builder.sub(ir.Constant(s.type, [0] * (2 * n)), s), s)
            return _dot_u8s8(builder, twice, s, isa)
        return sig, codegen
    return dot


def _lanes16(builder, u, s, isa: str):
    """<64 x i8> u (unsigned) and s (signed) -> <16 x i32>, lane q = sum of the products of bytes 4q..4q+3 (what
    vpdpbusd computes; the AVX2 and generic flavours produce the same lanes)."""
    v16 = _vec(I32, 16)
    if isa == "vnni512":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                     [ir.Constant(v16, [0] * 16), builder.bitcast(u, v16), builder.bitcast(s, v16)])
    halves = []
    for c in (0, 32):
        uc, sc = _slice(builder, u, c, 32), _slice(builder, s, c, 32)
        v8 = _vec(I32, 8)
        if isa == "avxvnni":
            halves.append(_call(builder, "llvm.x86.avx512.vpdpbusd.256", v8,
                                [ir.Constant(v8, [0] * 8), builder.bitcast(uc, v8), builder.bitcast(sc, v8)]))
        elif isa == "avx2":
            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [uc, sc])
            halves.append(_call(builder, "llvm.x86.avx2.pmadd.wd", v8, [pairs, ir.Constant(_vec(I16, 16), [1] * 16)]))
        else:
            prod = builder.mul(builder.zext(uc, _vec(I32, 32)), builder.sext(sc, _vec(I32, 32)))
            quad = None
            for k in range(4):
                part = builder.shuffle_vector(prod, prod, ir.Constant(v8, list(range(k, 32, 4))))
                quad = part if quad is None else builder.add(quad, part)
            halves.append(quad)
    return _concat(builder, halves[0], halves[1])


def _hsum(builder, v):
    """Horizontal sum of a float vector (a halving tree: one per row, so its cost does not matter)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.fadd(_slice(builder, v, 0, n), _slice(builder, v, n, n))
    return builder.extract_element(v, ir.Constant(I32, 0))


MAX_ROW_GROUPS = 1024      # the whole-row path's coefficient buffer (4 KiB of stack): groups per row at most
# Activations quantized in groups of ONE_LOAD_GROUP (int4 g128: 64 code bytes a group) lie as each group's 64 evens,
# then its 64 odds (chunk 0's evens, chunk 1's, chunk 0's odds, chunk 1's), the order of the low and high nibbles of
# the group's 64 code bytes: the row kernel loads a group's codes once and feeds each half to one vpdpbusd (session
# 22; before, two 32-byte steps each built a 64-byte vector of nibbles). Other groups keep the 64-element chunks'
# [evens, odds]. `_quantize_group` writes this order and `make_row` reads it: both test this constant.
ONE_LOAD_GROUP = 128


def make_row(n: int, codec: str, isa: str, *, e8m0: bool = False):
    """The intrinsic for a whole row: sum_g coef_g * dot_g (+ sum_g min_g * xm_g for int4), groups of n packed
    bytes, with the partial dots kept in 16 float lanes and reduced once per row (a horizontal reduction per
    group costs as much as the dot itself). Needs the row's packed bytes to be a multiple of 32 and at most
    MAX_ROW_GROUPS groups.

    The per-group coefficients (weight scale x activation scale) are computed first, 16 groups per vector
    (fp16 scales converted in one instruction on x86; e8m0 scales (`e8m0`) by placing the byte in a float's
    exponent), so the dot loop only loads them; int4's min term is summed in the same pass."""
    one_load = 2 * n == ONE_LOAD_GROUP          # a group's codes in one 64-byte load (else 32-byte steps)
    if n not in (8, 16, 32, 64) or (one_load and codec != "int4"):
        raise ValueError(f"make_row: no whole-row kernel for {codec} groups of {n} packed bytes")
    per_step = 1 if one_load else 32 // n      # groups covered by one iteration

    @intrinsic
    def row(typingctx, buf, q_off, s_off, m_off, n_groups, table, xq, x_off, xs, xm, xs_off):
        """row(buf, q_off, s_off, m_off, n_groups, table, xq, x_off, xs, xm, xs_off) -> float32.

        buf uint8 [bytes]: packed codes from byte q_off, scale codes from byte s_off (int4: fp16 bits; fp4: one
        byte), int4 mins from byte m_off; table float32: scale code -> value; xq int8 [..]: the activations from
        x_off (even/odd per group); xs, xm float32 [..]: the activation scales and scale * sums from xs_off."""
        sig = types.float32(buf, q_off, s_off, m_off, n_groups, table, xq, x_off, xs, xm, xs_off)

        def codegen(context, builder, signature, args):
            (buf_t, _, _, _, _, tab_t, xq_t, _, xs_t, xm_t, _) = signature.args
            buf_v, q0, s0, m0, ng, tab_v, xq_v, x0, xs_v, xm_v, xs0 = args
            f32, v16f = ir.FloatType(), _vec(ir.FloatType(), 16)
            facc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
            macc = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
            coefs = cgutils.alloca_once(builder, f32, size=MAX_ROW_GROUPS)     # entry block: once per function
            code_t = I16 if codec == "int4" else I8
            code_bytes = 2 if codec == "int4" else 1

            def scale_of(off_bytes, g):
                """table[code of group g] for the codes from byte off_bytes."""
                at = builder.add(off_bytes, builder.mul(g, ir.Constant(I64, code_bytes)))
                code = _load(builder, context, buf_t, buf_v, at, code_t)
                return builder.load(_elem_ptr(builder, context, tab_t, tab_v, builder.zext(code, I64)))

            def act_of(ary_t, ary_v, g):
                return builder.load(_elem_ptr(builder, context, ary_t, ary_v, builder.add(xs0, g)))

            def coef_ptr(g):
                return builder.gep(coefs, [g], inbounds=True)

            def vec_at(ary_t, ary_v, g, vty):
                return _load_at(builder, _elem_ptr(builder, context, ary_t, ary_v, builder.add(xs0, g)), vty)

            def scales(off_bytes, g0, width):
                """<width x float> weight scales of groups g0..g0+width-1."""
                vf, vi = _vec(f32, width), _vec(I32, width)
                if codec == "int4" and isa != "generic":       # x86 with F16C: vcvtph2ps
                    bits = _load(builder, context, buf_t, buf_v, builder.add(off_bytes, builder.mul(
                        g0, ir.Constant(I64, 2))), _vec(I16, width))
                    return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), width)), vf)
                if codec == "fp4" and e8m0:                      # 2^(b - 127): b in the exponent field
                    b = builder.zext(_load(builder, context, buf_t, buf_v, builder.add(off_bytes, g0),
                                           _vec(I8, width)), vi)
                    bits = builder.shl(b, ir.Constant(vi, [23] * width))
                    zero = builder.icmp_unsigned("==", b, ir.Constant(vi, [0] * width))
                    bits = builder.select(zero, ir.Constant(vi, [0x00400000] * width), bits)   # 2^-127
                    return builder.bitcast(bits, vf)
                v = ir.Constant(vf, [0.0] * width)
                for q in range(width):
                    g = builder.add(g0, ir.Constant(I64, q))
                    v = builder.insert_element(v, scale_of(off_bytes, g), ir.Constant(I32, q))
                return v

            # pass 1: coefficients 16 groups at a time, then 4 at a time, then one by one
            done = ir.Constant(I64, 0)
            for width in (16, 4):
                vf = _vec(f32, width)
                macc_w = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * width))
                n_blocks = builder.udiv(builder.sub(ng, done), ir.Constant(I64, width))
                with cgutils.for_range(builder, n_blocks) as loop:
                    g0 = builder.add(done, builder.mul(loop.index, ir.Constant(I64, width)))
                    c = builder.fmul(scales(s0, g0, width), vec_at(xs_t, xs_v, g0, vf))
                    builder.store(c, builder.bitcast(coef_ptr(g0), vf.as_pointer()), align=4)   # 4: a float array
                    if codec == "int4":
                        m = builder.fmul(scales(m0, g0, width), vec_at(xm_t, xm_v, g0, vf))
                        builder.store(builder.fadd(builder.load(macc_w), m), macc_w)
                if codec == "int4":
                    builder.store(builder.fadd(builder.load(macc), _hsum(builder, builder.load(macc_w))), macc)
                done = builder.add(done, builder.mul(n_blocks, ir.Constant(I64, width)))
            with cgutils.for_range(builder, builder.sub(ng, done)) as loop:
                g = builder.add(done, loop.index)
                builder.store(builder.fmul(scale_of(s0, g), act_of(xs_t, xs_v, g)), coef_ptr(g))
                if codec == "int4":
                    m = builder.fmul(scale_of(m0, g), act_of(xm_t, xm_v, g))
                    builder.store(builder.fadd(builder.load(macc), m), macc)

            def step_lanes(step):
                """<16 x i32> partial dots of 32-byte step `step`: the codes split into nibbles are already in
                the activations' chunk order (evens, then odds), so no shuffle is needed."""
                w = _load(builder, context, buf_t, buf_v, builder.add(q0, builder.mul(step, ir.Constant(I64, 32))),
                          _vec(I8, 32))
                sv = _load(builder, context, xq_t, xq_v, builder.add(x0, builder.mul(step, ir.Constant(I64, 64))),
                           _vec(I8, 64))
                codes = _concat(builder, builder.and_(w, ir.Constant(w.type, [15] * 32)),
                                builder.lshr(w, ir.Constant(w.type, [4] * 32)))
                if codec == "fp4":
                    twice, neg = _e2m1_twice(builder, codes, isa)
                    sv = builder.select(neg, builder.sub(ir.Constant(sv.type, [0] * 64), sv), sv)
                    codes = twice
                return _lanes16(builder, codes, sv, isa)

            def group64_lanes(j):
                """<16 x i32> partial dots of 64-byte group j (int4 g128) in one load of its codes: the low nibbles
                are the evens of its two 64-element chunks, the high ones their odds, and the activations of a
                group of 128 lie as [evens, odds] of both chunks (ONE_LOAD_GROUP) - so the two halves go straight
                into one accumulating vpdpbusd each, no concatenation of two 32-byte steps."""
                w = _load(builder, context, buf_t, buf_v, builder.add(q0, builder.mul(j, ir.Constant(I64, 64))),
                          _vec(I8, 64))
                at = builder.add(x0, builder.mul(j, ir.Constant(I64, 128)))
                xe = _load(builder, context, xq_t, xq_v, at, _vec(I8, 64))
                xo = _load(builder, context, xq_t, xq_v, builder.add(at, ir.Constant(I64, 64)), _vec(I8, 64))
                lo = builder.and_(w, ir.Constant(w.type, [15] * 64))
                hi = builder.lshr(w, ir.Constant(w.type, [4] * 64))
                if isa == "vnni512":
                    v16 = _vec(I32, 16)
                    first = _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                                  [ir.Constant(v16, [0] * 16), builder.bitcast(lo, v16), builder.bitcast(xe, v16)])
                    return _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                                 [first, builder.bitcast(hi, v16), builder.bitcast(xo, v16)])
                return builder.add(_lanes16(builder, lo, xe, isa), _lanes16(builder, hi, xo, isa))

            def accumulate(j, acc):
                """Iteration j (one 32-byte step, or for n = 64 one group of 64 bytes) into the lanes at acc."""
                ilanes = group64_lanes(j) if one_load else step_lanes(j)
                lanes = builder.sitofp(ilanes, v16f)
                k = per_step
                first = builder.mul(j, ir.Constant(I64, k))
                if k == 1:
                    coef = builder.insert_element(ir.Constant(_vec(f32, 1), [0.0]), builder.load(coef_ptr(first)),
                                                  ir.Constant(I32, 0))
                else:
                    coef = _load_at(builder, coef_ptr(first), _vec(f32, k))
                # lane q sums elements 8 (q mod 8) .. +7 of the step's 64 (evens for q < 8, odds after)
                spread = builder.shuffle_vector(coef, coef, ir.Constant(_vec(I32, 16),
                                                                        [(8 * (q % 8)) // (2 * n) for q in range(16)]))
                # fmuladd: one FMA where the CPU has it, a multiply and an add elsewhere (never a libm call)
                builder.store(_call(builder, "llvm.fmuladd.v16f32", v16f, [lanes, spread, builder.load(acc)]), acc)

            # pass 2: the dots, two accumulators so consecutive FMAs do not wait on each other's latency
            facc2 = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
            n_iters = builder.udiv(ng, ir.Constant(I64, per_step)) if per_step > 1 else ng
            pairs = builder.udiv(n_iters, ir.Constant(I64, 2))
            with cgutils.for_range(builder, pairs) as loop:
                two_p = builder.mul(loop.index, ir.Constant(I64, 2))
                accumulate(two_p, facc)
                accumulate(builder.add(two_p, ir.Constant(I64, 1)), facc2)
            with cgutils.for_range(builder, builder.sub(n_iters, builder.mul(pairs, ir.Constant(I64, 2)))) as loop:
                accumulate(builder.sub(n_iters, ir.Constant(I64, 1)), facc)       # the odd one out
            lanes = builder.fadd(builder.load(facc), builder.load(facc2))
            return builder.fadd(_hsum(builder, lanes), builder.load(macc))
        return sig, codegen
    return row


_row_int4_16, _row_int4_32, _row_int4_64 = (make_row(n, "int4", ISA) for n in (16, 32, 64))
_row_fp4_8, _row_fp4_16 = (make_row(n, "fp4", ISA) for n in (8, 16))              # e4m3 (or any) scales
_row_mxfp4_16 = make_row(16, "fp4", ISA, e8m0=True)                                 # MXFP4: e8m0 per 32

_dot_int4_8, _dot_int4_16, _dot_int4_32, _dot_int4_64 = (make_dot(n, "int4", ISA) for n in GROUP_BYTES)
_dot_fp4_8, _dot_fp4_16, _dot_fp4_32, _dot_fp4_64 = (make_dot(n, "fp4", ISA) for n in GROUP_BYTES)

ROWS_PER_TASK = 16       # rows of one gate/up matrix per task (2 x 16 rows of 1 KB at hidden 2048, int4)
DOWN_ROWS_PER_TASK = 32  # rows of out per down task, of every expert of the call (`_down_rows`): 32 x 384 B each
SYNC_STRIDE = 16         # int64s between the stages' shared counters: each on its own 128 bytes (a line and the
                         # adjacent-line prefetcher's pair), so lanes polling one are not invalidated by another

_HAVE_TSC = platform.machine().lower() in ("x86_64", "amd64")   # rdtsc: readable from user space


@intrinsic
def _cycles(typingctx):
    """The CPU's time-stamp counter (rdtsc) on x86, a clock compiled code can read; 0 elsewhere (on ARM the cycle
    counter register may trap in user space)."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        if not _HAVE_TSC:
            return context.get_constant(types.int64, 0)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, []), "llvm.readcyclecounter")
        return builder.call(fn, [])
    return sig, codegen


def _item_ptr(context, builder, sig, args):
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])


@intrinsic
def _fmax32(typingctx, a, b):
    """max of two float32 as llvm.maxnum: under fast-math LLVM vectorises a reduction over it, where numba's own
    max (a compare and select with its NaN rule) kept the quantizer's amax loop scalar - 1.3 of its 3.8 µs a token
    on the dev VM, the whole of it now ~0.1 (same bits: no NaN reaches it)."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32]), "llvm.maxnum.f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _load_acquire(typingctx, arr, index):
    """arr[index] (int64) as an atomic acquire load: never hoisted out of a polling loop."""
    sig = types.int64(arr, index)

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        return builder.load_atomic(ptr, "acquire", 8) if not getattr(ptr.type, "is_opaque", False) else \
            builder.load_atomic(ptr, "acquire", 8, typ=I64)
    return sig, codegen


@intrinsic
def _store_release(typingctx, arr, index, value):
    """arr[index] = value (int64) as an atomic release store: every earlier store is visible first."""
    sig = types.void(arr, index, value)

    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _item_ptr(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _fetch_add(typingctx, arr, index, value):
    """arr[index] += value (int64) atomically (acquire-release); the value before."""
    sig = types.int64(arr, index, value)

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _item_ptr(context, builder, sig, args), args[2], "acq_rel")
    return sig, codegen


@intrinsic
def _take(typingctx, arr, index, end):
    """One task from the counter arr[index] if it is below end: its number (the counter before, which moves up by
    one), or -1 once it reached end. A compare-and-swap, so the counter never passes end: counters can then run on
    from call to call (the worker's lanes never reset them while a late lane may still be reading them)."""
    sig = types.int64(arr, index, end)

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        end_v = args[2]
        result = cgutils.alloca_once_value(builder, ir.Constant(I64, -1))
        load = builder.load_atomic(ptr, "acquire", 8) if not getattr(ptr.type, "is_opaque", False) else \
            builder.load_atomic(ptr, "acquire", 8, typ=I64)
        cur = cgutils.alloca_once_value(builder, load)
        loop = builder.append_basic_block("take.loop")
        done = builder.append_basic_block("take.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        c = builder.load(cur)
        with builder.if_then(builder.icmp_signed("<", c, end_v)):
            pair = builder.cmpxchg(ptr, c, builder.add(c, ir.Constant(I64, 1)), "acq_rel", "acquire")
            ok = builder.extract_value(pair, 1)
            with builder.if_else(ok) as (then, otherwise):
                with then:
                    builder.store(c, result)
                    builder.branch(done)
                with otherwise:
                    builder.store(builder.extract_value(pair, 0), cur)
                    builder.branch(loop)
        builder.branch(done)
        builder.position_at_end(done)
        return builder.load(result)
    return sig, codegen


PREFETCH_LOCALITY = _measurement_knob("FREETOKEN_CPU_PREFETCH_LOCALITY", 3, range(4))  # llvm.prefetch's: 3 = T0


@intrinsic
def _prefetch(typingctx, arr, index):
    """Ask for the cache line of arr[index] (llvm.prefetch: read, PREFETCH_LOCALITY); never faults, so an index
    past the data is harmless."""
    sig = types.void(arr, index)

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        opaque = getattr(ptr.type, "is_opaque", False)
        if not opaque:
            ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, I32, I32, I32]),
                                            "llvm.prefetch.p0" if opaque else "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return sig, codegen


# How far ahead a row task asks for the rows it will read, in bytes of one matrix's codes: a gate/up row (1 KB
# at hidden 2048, int4) 2 rows ahead, a down row (384 B at width 768) 6. Run z4 measured 2 rows everywhere: a small
# request's down task read ~2 GB/s a lane cold, 768 B ahead of a ~150 ns miss being too little in flight.
PREFETCH_BYTES = _measurement_knob("FREETOKEN_CPU_PREFETCH_BYTES", 2048, range(64, 1 << 16))


@njit(cache=True, inline="always")
def _rows_ahead(row_bytes):
    """Rows a task asks for ahead of the one it computes: PREFETCH_BYTES of codes, at least one row."""
    return max(np.uint64(1), (np.uint64(PREFETCH_BYTES) + row_bytes - np.uint64(1)) // row_bytes)


@njit(cache=True, inline="always")
def _prefetch_row(buf, base, q_off, s_off, m_off, r, row_bytes, scale_bytes, mins):
    """Every line of row r's packed codes (from base + q_off), of its scales (from base + s_off) and, when mins
    (int4), of its mins (from base + m_off): every byte `_row` will read for it. A row's scales may straddle a line
    (12 bytes a down row at width 768, int4 g128), so its first and last bytes are asked for."""
    q = base + q_off + r * row_bytes
    six = np.uint64(6)
    one = np.uint64(1)
    for k in range(row_bytes >> six):
        _prefetch(buf, q + (np.uint64(k) << six))
    s = base + s_off + r * scale_bytes
    _prefetch(buf, s)
    _prefetch(buf, s + scale_bytes - one)
    if mins:
        m = base + m_off + r * scale_bytes
        _prefetch(buf, m)
        _prefetch(buf, m + scale_bytes - one)


@njit(cache=True, inline="always")
def _prefetch_down(buf, experts, nb, o, pu, pr, r0, r1, row_i, scale_i, mins):
    """Ask for down row pr of the call's expert pu; the cursor's next place (a down task's rows r0..r1 of each
    expert in turn, the order the task computes them)."""
    _prefetch_row(buf, np.uint64(experts[pu]) * nb, o[6], o[7], o[8], np.uint64(pr), row_i, scale_i, mins)
    if pr + 1 == r1:
        return pu + 1, r0
    return pu, pr + 1


_HAVE_SCHED_YIELD = platform.system() != "Windows"            # POSIX's sched_yield, resolved from libc at load


@intrinsic
def _yield_cpu(typingctx):
    """Give the core to another runnable thread, if any (sched_yield; nothing on Windows): a lane waiting for a
    stage must not keep the thread that holds its last task off a core when the machine is oversubscribed."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if _HAVE_SCHED_YIELD:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, []), "sched_yield")
            builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


YIELD_EVERY = 1024      # a waiting lane yields after this many polls (~50 µs): a syscall then costs it ~1 %


# `phases` [N_PHASES] int64 accumulates, per call, cycles from the call's start to each mark (where a request's
# time goes: the serial start, the region's threads coming in, each stage done as the first thread saw it, the
# join) and counts calls
PHASES = ("prologue", "first thread in", "last thread in", "x quantized", "gate/up done", "down inputs done",
          "down and sum done", "joined")
N_PHASES = len(PHASES) + 1                     # + the call count
SPLIT_MARK, SPLIT_COUNT = N_PHASES, N_PHASES + 1   # the worker's split rows answered (cycles from the request's
                                               # start, summed) and the requests that had them (before LANE_BASE)
_NEVER = (1 << 63) - 1
# After the call's marks, from word LANE_BASE, a block of LANE_WORDS words (128 bytes: no two lanes write one line)
# per lane, when `phases` is that long (`new_phases`): per stage, the cycles the lane spent in its tasks, the cycles
# it waited for the stage's other tasks, its task count and its first task's cycles - whether a slow stage's tasks
# are slow themselves or its lanes wait (session 12: the tasks)
LANE_BASE = 16
LANE_WORDS = 16
LANE_BUSY, LANE_WAIT, LANE_TASKS, LANE_FIRST = 0, 4, 8, 12   # a block's four runs of N_STAGES words
ALIGN_BYTES = 128                              # the scratch's regions each start on a line pair of their own


def aligned_zeros(n: int, dtype) -> np.ndarray:
    """n zeros of dtype starting on an ALIGN_BYTES boundary (numpy aligns to 16 or 64 bytes only)."""
    item = np.dtype(dtype).itemsize
    raw = np.zeros(n * item + ALIGN_BYTES, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN_BYTES
    return raw[skip:skip + n * item].view(dtype)


def new_phases(lanes: int) -> np.ndarray:
    """A `phases` array with room for every lane's counts (LANE_BASE)."""
    return aligned_zeros(LANE_BASE + max(1, lanes) * LANE_WORDS, np.int64)


def lane_counts(d: np.ndarray, lanes: int, cycles_per_s: float) -> dict[str, dict[str, float]] | None:
    """From a `new_phases` array's difference over some requests (its count at N_PHASES - 1): per stage, mean µs a
    request a lane spent in tasks and waiting (and the busiest lane's), and tasks a request per lane. None without
    requests or a cycle counter, or when the array has no lane blocks."""
    n = int(d[N_PHASES - 1])
    if not n or not cycles_per_s or d.shape[0] < LANE_BASE + lanes * LANE_WORDS:
        return None
    us = 1e6 / n / cycles_per_s
    blocks = d[LANE_BASE:LANE_BASE + lanes * LANE_WORDS].reshape(lanes, LANE_WORDS)
    result = {}
    for j, name in enumerate(STAGE_NAMES):
        busy, wait = blocks[:, LANE_BUSY + j] * us, blocks[:, LANE_WAIT + j] * us
        tasks = blocks[:, LANE_TASKS + j] / n
        first = blocks[:, LANE_FIRST + j] * us
        result[name] = {"busy_us": float(busy.mean()), "busy_max_us": float(busy.max()),
                        "first_task_us": float(first.mean()),
                        "wait_us": float(wait.mean()), "wait_max_us": float(wait.max()),
                        "tasks_per_lane": float(tasks.mean()),
                        "us_per_task": float(busy.sum() / max(tasks.sum(), 1e-9))}
    return result


# ------------------------------------------------------------------ kernels
# Indices are unsigned and no array view is made inside a parallel loop (cpu_kernels.py says why).

@njit(cache=True, fastmath=True, inline="always")
def _dot(codec, hg, buf, boff, xq, xoff):
    """The group's integer dot: int4 codes, or 2 * e2m1 values for fp4 (hg packed bytes per group)."""
    if codec == 0:
        if hg == 32:
            return _dot_int4_32(buf, boff, xq, xoff)
        if hg == 64:
            return _dot_int4_64(buf, boff, xq, xoff)
        if hg == 16:
            return _dot_int4_16(buf, boff, xq, xoff)
        return _dot_int4_8(buf, boff, xq, xoff)
    if hg == 16:
        return _dot_fp4_16(buf, boff, xq, xoff)
    if hg == 8:
        return _dot_fp4_8(buf, boff, xq, xoff)
    if hg == 32:
        return _dot_fp4_32(buf, boff, xq, xoff)
    return _dot_fp4_64(buf, boff, xq, xoff)


@njit(cache=True, fastmath=True, inline="always")
def _row(codec, buf, buf16, base, q_off, s_off, m_off, r, n_groups, hg, table, xq, xs, xm, t):
    """sum_k W[r, k] v_t[k] over one row of a packed matrix (its block part starts at base + q_off): the
    whole-row intrinsic when the row is a multiple of 32 bytes (every real shape), else group by group.
    codec: 0 int4, 1 fp4 with scales through the table (e4m3), 2 fp4 with e8m0 scales (MXFP4)."""
    one = np.uint64(1)
    row = base + q_off + r * n_groups * hg
    xrow = t * n_groups * hg * np.uint64(2)
    xg = t * n_groups
    if (n_groups * hg) % np.uint64(32) == 0 and n_groups <= MAX_ROW_GROUPS:
        if codec == 0:
            sb = base + s_off + r * n_groups * np.uint64(2)
            mb = base + m_off + r * n_groups * np.uint64(2)
            if hg == 32:
                return _row_int4_32(buf, row, sb, mb, n_groups, table, xq, xrow, xs, xm, xg)
            if hg == 64:
                return _row_int4_64(buf, row, sb, mb, n_groups, table, xq, xrow, xs, xm, xg)
            return _row_int4_16(buf, row, sb, mb, n_groups, table, xq, xrow, xs, xm, xg)
        sb = base + s_off + r * n_groups
        if hg == 16 and codec == 2:
            return _row_mxfp4_16(buf, row, sb, sb, n_groups, table, xq, xrow, xs, xm, xg) * np.float32(0.5)
        if hg == 16:
            return _row_fp4_16(buf, row, sb, sb, n_groups, table, xq, xrow, xs, xm, xg) * np.float32(0.5)
        return _row_fp4_8(buf, row, sb, sb, n_groups, table, xq, xrow, xs, xm, xg) * np.float32(0.5)
    total = np.float32(0.0)
    if codec == 0:
        si = ((base + s_off) >> one) + r * n_groups          # fp16 scales and mins, as uint16 indices
        mi = ((base + m_off) >> one) + r * n_groups
        for g in range(n_groups):
            gu = np.uint64(g)
            acc = _dot(codec, hg, buf, row + gu * hg, xq, xrow + gu * hg * np.uint64(2))
            total += table[buf16[si + gu]] * xs[xg + gu] * np.float32(acc) + table[buf16[mi + gu]] * xm[xg + gu]
        return total
    si = base + s_off + r * n_groups                         # one scale byte per block
    for g in range(n_groups):
        gu = np.uint64(g)
        acc = _dot(codec, hg, buf, row + gu * hg, xq, xrow + gu * hg * np.uint64(2))
        total += table[buf[si + gu]] * xs[xg + gu] * np.float32(acc)
    return total * np.float32(0.5)


@njit(cache=True, fastmath=True, inline="always")
def _round_half_up(y):
    """floor(y + 0.5) as int32, without math.floor: numba calls libm's floorf for it, once per element, which
    kept the loop scalar (session 12: ~1.2 µs a group of 128 on the GPU machine's host)."""
    y = y + np.float32(0.5)
    q = np.int32(y)
    return q - np.int32(np.float32(q) > y)


# Called, not inlined: vectorised, its loops inlined at the kernel's three sites made LLVM take ~26 s longer over
# the layer kernel and the worker's loop on the dev VM (a fresh install's first load); a call per group costs ns.
# _nrt=False as for _stages: no reference counts on the arrays it is passed.
@njit(cache=True, fastmath=True, nogil=True, _nrt=False)
def _quantize_group(v, n, g, group, vq, vs, vm):
    """Group g of row n of v [N, K] float32 -> int8 into vq [N * K], the group's scale into vs [N * G] and scale *
    sum of its int8 values into vm [N * G]. Layout: when K is a multiple of 64 (the whole-row path), every 64
    elements as their 32 even ones then their 32 odd ones (the order of a 32-byte step's low, then high nibbles),
    except groups of 128 (ONE_LOAD_GROUP): the evens of both 64-element chunks, then both chunks' odds (the low,
    then high nibbles of the group's 64 code bytes, loaded at once); otherwise every group as its even elements
    then its odd ones (the group-by-group path). Indices unsigned and stores contiguous, so the loops vectorise."""
    k = v.shape[1]
    one = np.uint64(1)
    nu = np.uint64(n)
    b = np.uint64(g * group)
    g128 = group == ONE_LOAD_GROUP and k % 64 == 0    # [evens, odds] of the group's two chunks
    amax = np.float32(0.0)
    for j in range(np.uint64(group)):
        amax = _fmax32(amax, abs(v[nu, b + np.uint64(j)]))
    scale = amax / np.float32(127.0)
    inv = np.float32(127.0) / amax if amax > np.float32(0.0) else np.float32(0.0)
    total = np.int32(0)
    row = n * k
    if k % 64 == 0:
        span = min(group, 64)                            # the group's part inside one chunk of 64
        odd = np.uint64(64 if g128 else 32)                # where the odds start after the evens
        for s in range(group // span):
            at = g * group + s * span
            if g128:                                     # chunk s's evens at 32 s, its odds 64 later
                lo = np.uint64(row + g * group + 32 * s)
            else:
                lo = np.uint64(row + (at & ~63) + ((at & 63) >> 1))   # its evens' first slot; odds 32 later
            au = np.uint64(at)
            for j in range(np.uint64(span // 2)):
                ju = np.uint64(j)
                qe = _round_half_up(v[nu, au + ju + ju] * inv)
                qo = _round_half_up(v[nu, au + ju + ju + one] * inv)
                vq[lo + ju] = qe
                vq[lo + odd + ju] = qo
                total += qe + qo
    else:
        hg = np.uint64(group // 2)
        lo = np.uint64(row) + b
        for j in range(hg):
            ju = np.uint64(j)
            qe = _round_half_up(v[nu, b + ju + ju] * inv)
            qo = _round_half_up(v[nu, b + ju + ju + one] * inv)
            vq[lo + ju] = qe
            vq[lo + hg + ju] = qo
            total += qe + qo
    vs[n * (k // group) + g] = scale
    vm[n * (k // group) + g] = scale * np.float32(total)


@njit(cache=True, fastmath=True, inline="always")
def _quantize_row(v, n, group, vq, vs, vm):
    """Row n of v [N, K] float32 -> int8, every group (`_quantize_group`)."""
    for g in range(v.shape[1] // group):
        _quantize_group(v, n, g, group, vq, vs, vm)


@njit(cache=True, inline="always")
def split_ok(expert, token, rows, inter, n_experts, n_tokens):
    """Whether a request's split expert (rows 0: none) is one the kernels may index."""
    return 0 <= rows <= inter and rows % ROWS_PER_TASK == 0 and (
        rows == 0 or (0 <= expert < n_experts and 0 <= token < n_tokens))


@njit(cache=True)
def group_by_expert(tokens, experts, weights, n_experts, n_tokens, counts, tok, w, uniq, starts):
    """Assignments sorted by expert (a counting sort, stable), into the caller's arrays: tok [A], w [A] (tokens
    and weights in that order), uniq [>= U] (the distinct experts), starts [>= U + 1] (their runs' starts);
    counts [E + 1] is scratch. Returns U. Ids out of range raise: the kernels index the mapped file without
    checks."""
    counts[:] = 0
    for a in range(experts.shape[0]):
        if experts[a] < 0 or experts[a] >= n_experts:
            raise ValueError("CPU expert kernel: an expert id is out of range for the layer's experts")
        if tokens[a] < 0 or tokens[a] >= n_tokens:
            raise ValueError("CPU expert kernel: a token index is out of range for x")
        counts[experts[a] + 1] += 1
    n_u = 0
    for e in range(n_experts):
        if counts[e + 1] > 0:
            uniq[n_u] = e
            n_u += 1
        counts[e + 1] += counts[e]                       # counts[e] is now expert e's first slot
    for u in range(n_u):
        starts[u] = counts[uniq[u]]
    starts[n_u] = experts.shape[0]
    for a in range(experts.shape[0]):
        slot = counts[experts[a]]
        counts[experts[a]] += 1
        tok[slot] = tokens[a]
        w[slot] = weights[a]
    return n_u


N_STAGES = 4
STAGE_NAMES = ("x to int8", "gate/up", "down inputs", "down and sum")
SPLIT_DONE = (2 * N_STAGES + 1) * SYNC_STRIDE   # the shared counter of a split expert's row tasks done (`_stages`)
SYNC_WORDS = SPLIT_DONE + SYNC_STRIDE           # per stage: tasks taken, tasks done; then SPLIT_DONE
FUSED_DOWN_INPUTS_MAX = 32   # up to this many assignments (decode, batch <= 4) a call has no down-input stage:
                             # the gate/up task that finishes a group of h rows quantizes that group itself (one
                             # stage and its barrier fewer: ~4 µs of a ~150 µs request on the GPU machine's host,
                             # session 14); a bigger call keeps the stage, whose tasks spread over every lane
HELD_PREFETCH_BYTES = 16 << 10   # a lane done with its gate/up tasks takes its first down task early and asks for
                                 # this much of its rows while the stage's last tasks finish (its L1 is 48 KB)
SERIAL_X_TOKENS = 1      # up to this many tokens the call's serial start quantizes x: for a decode request one
                         # stage and its barrier (~6 µs on the GPU machine's host) fewer. (Run z: with math.floor
                         # a token took ~15 µs there; `_round_half_up` vectorises, ~3x faster on the dev VM)


def scratch_sizes(n_tokens: int, n_assign: int, n_experts: int, hidden: int, inter: int, group: int,
                  lanes: int) -> tuple[int, int, int]:
    """Elements of the flat int64, float32 and int8 scratch arrays `moe_layer_int8` (or `serve_layers`, sized for
    the mailbox's most tokens and assignments) needs for a call of n_tokens tokens and n_assign assignments (the
    kernel allocates nothing: run q measured its ~20 small allocations at ~90 µs a request on the GPU machine's
    host, as long as the gate/up rows)."""
    a, t = n_assign, n_tokens
    i64 = ((n_experts + 1) + 3 * a + 1 + N_STAGES + SYNC_WORDS                        # counts, tok, uniq,
           + max(1, lanes) + a * (inter // group))            # starts, seen, sync, lanes, groups of h done
    f32 = a + 2 * t * (hidden // group) + a * inter + 2 * a * (inter // group)   # w, xs, xm, h, hs, hm
    i8 = t * hidden + a * inter                                                  # xq, hq
    pad = 8 * ALIGN_BYTES                      # each region rounded up to ALIGN_BYTES (`_carve`), 8 at most
    return i64 + pad // 8, f32 + pad // 4, i8 + pad


class Scratch:
    """The kernel's scratch arrays, kept between calls and grown when a call needs more - up to `keep_bytes`: a
    bigger call (a CPU prefill chunk of thousands of tokens needs ~0.7 GB) gets arrays of its own, freed after it,
    so one long prompt does not leave the process that much bigger."""

    KEEP_BYTES = 64 << 20

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self.i64 = aligned_zeros(0, np.int64)
        self.f32 = aligned_zeros(0, np.float32)
        self.i8 = aligned_zeros(0, np.int8)

    def fit(self, *sizes_args) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n64, n32, n8 = scratch_sizes(*sizes_args)
        if 8 * n64 + 4 * n32 + n8 > self.keep_bytes:
            return aligned_zeros(n64, np.int64), aligned_zeros(n32, np.float32), aligned_zeros(n8, np.int8)
        if self.i64.shape[0] < n64:
            self.i64 = aligned_zeros(n64, np.int64)
        if self.f32.shape[0] < n32:
            self.f32 = aligned_zeros(n32, np.float32)
        if self.i8.shape[0] < n8:
            self.i8 = aligned_zeros(n8, np.int8)
        return self.i64, self.f32, self.i8


@njit(cache=True, inline="always")
def _task_rows(task, blocks, experts, nb, n_rows, rows_per_task):
    """A row task's (distinct-expert index u, expert id, its block's byte offset, first row, row past the last):
    `blocks` tasks of rows_per_task rows an expert matrix of n_rows rows."""
    u = task // blocks
    e = np.uint64(experts[u])
    r0 = (task % blocks) * rows_per_task
    return u, e, e * nb, r0, min(r0 + rows_per_task, n_rows)


@njit(cache=True, inline="always")
def _aligned(at, elements):
    """at rounded up to a multiple of `elements` (an ALIGN_BYTES boundary in elements of the region's type)."""
    return (at + elements - 1) // elements * elements


@njit(cache=True, inline="always")
def _carve(s64, s32, s8, n_tok, n_a, n_exp, n_thr, d, i, group):
    """The scratch arrays as the kernel's views, for up to n_tok tokens and n_a assignments (views only: made
    outside the parallel loop, since a view is an atomic reference count on the shared buffer). Every region starts
    on an ALIGN_BYTES boundary of its array (Scratch aligns the arrays): a task writing the first rows of h does not
    invalidate the line that holds the activations' scales every lane reads, nor a neighbouring task's rows."""
    gdn, gin = d // group, i // group
    q64, q32, q8 = ALIGN_BYTES // 8, ALIGN_BYTES // 4, ALIGN_BYTES
    at = 0
    counts = s64[at:at + n_exp + 1]
    at = _aligned(at + n_exp + 1, q64)
    tokens = s64[at:at + n_a]
    at = _aligned(at + n_a, q64)
    experts = s64[at:at + n_a]
    at = _aligned(at + n_a, q64)
    starts = s64[at:at + n_a + 1]
    at = _aligned(at + n_a + 1, q64)
    sync = s64[at:at + SYNC_WORDS]                        # per stage: tasks taken, tasks done, a stride apart
    at = _aligned(at + SYNC_WORDS, q64)
    seen = s64[at:at + N_STAGES]                          # when a thread first saw each stage done
    at = _aligned(at + N_STAGES, q64)
    t_in = s64[at:at + n_thr]
    at = _aligned(at + n_thr, q64)
    qdone = s64[at:at + n_a * gin]                        # per (distinct expert, group of h): its gate/up tasks done
    at = 0
    weights = s32[at:at + n_a]
    at = _aligned(at + n_a, q32)
    xs = s32[at:at + n_tok * gdn]
    at = _aligned(at + n_tok * gdn, q32)
    xm = s32[at:at + n_tok * gdn]
    at = _aligned(at + n_tok * gdn, q32)
    h = s32[at:at + n_a * i].reshape((n_a, i))
    at = _aligned(at + n_a * i, q32)
    hs = s32[at:at + n_a * gin]
    at = _aligned(at + n_a * gin, q32)
    hm = s32[at:at + n_a * gin]
    xq = s8[:n_tok * d]
    at8 = _aligned(n_tok * d, q8)
    hq = s8[at8:at8 + n_a * i]
    return counts, tokens, experts, starts, sync, seen, t_in, weights, xs, xm, h, hs, hm, xq, hq, qdone


@njit(cache=True, inline="always")
def fused_down_inputs(n_a, group):
    """Whether a call of n_a assignments quantizes the down inputs in its gate/up tasks (FUSED_DOWN_INPUTS_MAX; a
    group must be whole tasks of rows)."""
    return n_a <= FUSED_DOWN_INPUTS_MAX and group % ROWS_PER_TASK == 0


@njit(cache=True, inline="always")
def _prepare(x, tokens_in, experts_in, weights_in, n_exp, n_tok, d, i, group, n_thr, v, quantize_x):
    """A call's serial start: its assignments sorted by expert, the marks cleared (plain loops: in a
    parallel=True function `seen[:] = 0` would be a parallel region of its own), x quantized here when it is a
    single token (SERIAL_X_TOKENS) and `quantize_x` (else the caller does it serially after publishing the plan:
    the worker's early plan); each stage's task count (none for the down inputs when the gate/up tasks quantize
    them, `fused_down_inputs`: its groups' counters cleared instead)."""
    counts, tokens, experts, starts, sync, seen, t_in, weights, xs, xm = v[:10]
    xq, qdone = v[13], v[15]
    n_u = group_by_expert(tokens_in, experts_in, weights_in, n_exp, n_tok, counts, tokens, weights, experts, starts)
    n_down_in = experts_in.shape[0] * (i // group)
    if fused_down_inputs(experts_in.shape[0], group):
        for j in range(n_u * (i // group)):
            qdone[j] = 0
        n_down_in = 0
    for j in range(N_STAGES):
        seen[j] = 0
    for j in range(n_thr):
        t_in[j] = _NEVER
    n_x = n_tok * (d // group)
    if n_tok <= SERIAL_X_TOKENS:
        if quantize_x:
            for n in range(n_tok):
                _quantize_row(x, n, group, xq, xs, xm)
        n_x = 0
    rows = _down_rows(n_u)
    return n_x, n_u * ((i + ROWS_PER_TASK - 1) // ROWS_PER_TASK), n_down_in, (d + rows - 1) // rows


@njit(cache=True, inline="always")
def _down_rows(n_u):
    """Rows of the output a down task covers, over all of a call's n_u experts: 32 (128 bytes of each token's
    row of out) for one or two experts; 16 (64 bytes: still no two tasks write one line) beyond, whose 32-row
    tasks are few and long - run z's 8-expert requests: 4.6 tasks a lane on 14 lanes, 17 µs of waiting for the
    last one."""
    return DOWN_ROWS_PER_TASK if n_u <= 2 else DOWN_ROWS_PER_TASK // 2


@njit(cache=True, inline="always")
def _prefetch_gate_up(buf, b0, o, r, row_d, scale_d, mins):
    """Row r of the gate and up matrices of the block at b0 (codes, scales, mins) asked for."""
    _prefetch_row(buf, b0, o[0], o[1], o[2], np.uint64(r), row_d, scale_d, mins)
    _prefetch_row(buf, b0, o[3], o[4], o[5], np.uint64(r), row_d, scale_d, mins)


@njit(cache=True, inline="always")
def _rows_asked_then_x(buf, b0, o, r0, r1, row_d, scale_d, mins, x_word, x_at, x_gen):
    """A lane's first gate/up task under the early plan: every row of it asked for (codes, scales, mins of both
    matrices), then a wait until x is quantized (x_word[x_at] >= x_gen) - the task's reads from DRAM overlap lane
    0's serial quantization of x instead of following it."""
    if _load_acquire(x_word, x_at) >= x_gen:         # (x was ready before the call: nothing to overlap)
        return
    for r in range(r0, r1):
        _prefetch_gate_up(buf, b0, o, r, row_d, scale_d, mins)
    _wait_at_least(x_word, x_at, x_gen)


@njit(cache=True, fastmath=True, inline="always")
def _gate_up_act(codec, buf, buf16, buf32, b0, o, ru, gd, hg, table, xq, xs, xm, t, g_scale, u_scale, has_bias,
                 activation, alpha, limit):
    """h[ru] of the expert whose block is at b0, for token t: the activation of its gate and up rows' dots with the
    token's int8 activations, each times its matrix's scale, plus its bias."""
    g = _row(codec, buf, buf16, b0, o[0], o[1], o[2], ru, gd, hg, table, xq, xs, xm, t) * g_scale
    w = _row(codec, buf, buf16, b0, o[3], o[4], o[5], ru, gd, hg, table, xq, xs, xm, t) * u_scale
    if has_bias:
        g += buf32[((b0 + o[9]) >> np.uint64(2)) + ru]
        w += buf32[((b0 + o[10]) >> np.uint64(2)) + ru]
    return _act(g, w, activation, alpha, limit)


# A function of its own, not inlined into its two callers (the per-call kernel and the worker's loop): numba
# compiles and optimises it once, where inlined each caller's parallel region re-ran it through LLVM (a fresh
# install compiled the kernels for ~150 s on the 2-core dev VM, ~120 s on the GPU machine; now ~70 and ~55).
# _nrt=False: without it every helper inlined here increfs and decrefs the shared arrays it is passed - atomics
# on the same words from every lane at every row, ~10x slower on 14 lanes (session 10's runs w and x; inside the
# region's own function numba had pruned them). It allocates nothing, so it needs no reference counts (a test
# checks its compiled code has none).
@njit(cache=True, fastmath=True, nogil=True, _nrt=False)
def _stages(codec, buf, buf16, buf32, nbytes, offs, has_bias, i, group, table, x, n_a, gate_scale, up_scale,
            down_scale, activation, alpha, limit, out, v, plan, answer, ticket, gen_word, gen, lane, phases,
            clear_out, split_e, split_t, split_r, split_base, part, part_answer, x_word, x_at, x_gen):
    """One lane's part of a call: each stage's tasks taken from its counter until none is left, then a wait until
    every task of the stage is done (counting tasks, not lanes: a lane the OS never runs takes none, and nothing
    waits for it). plan: (the stages' counter bases, then their task counts) - counters run on from call to call
    in the worker (`serve_layers`), so a call's tasks are base..base + count. The lane that finishes the call's
    last task stores `ticket` in answer[0] when answer is not empty (out is whole then). A stage's mark is kept
    only while gen_word[0] == gen (a lane late for its call does not mark the next one). When phases has this
    lane's block (LANE_BASE), the lane adds its cycles in tasks and waiting, its tasks and its first task's
    cycles, per stage.

    The down stage sums into out itself: a task is a slice of out's columns over every expert of the call (each
    assignment's row dot added to its token's row, in the assignments' order: the old weighted-sum stage's order),
    so no two tasks write one element and no stage of its own (and barrier) adds the experts up.

    A small call (`fused_down_inputs`: its plan has no down-input tasks) quantizes each group of h in the gate/up
    task that finishes it (a counter per expert and group), and a lane out of gate/up tasks takes its first down
    task at once and asks for its rows while the stage's last tasks run: the down stage starts on rows in cache.

    clear_out (the worker): each down task first sets its slice of out's columns to 0 for every row of out (out
    is the mailbox's, answered afresh each request), in parallel where lane 0 cleared all of it in the serial
    start before (128 lines, last written by other cores: part of the start's ~7 µs that every lane waited for).

    A split expert (split_r > 0: zero-copy decode's finer split, cpu_share.py): the first split_r / ROWS_PER_TASK
    tasks of the gate/up stage compute rows 0..split_r of expert split_e's activations for token split_t into
    `part` (fp32, not quantized: the GPU's down kernel takes them as its own h rows), before any whole expert's
    rows; the lane that finishes the last of them (a counter that runs on from call to call like the stages',
    from split_base) stores `ticket` in part_answer[0] (release). That expert has no down task here: the GPU
    computes its other rows and its down projection.

    x_word[x_at] >= x_gen is when x's int8 form is whole (the worker's early plan: lane 0 publishes the plan and
    then quantizes a single token's x while the other lanes take their first gate/up task and ask for all of its
    rows; each waits for x only before computing it). Where x is quantized before the call, x_word[x_at] is
    already past x_gen and the wait is one load."""
    tokens, experts, starts, sync, seen = v[1], v[2], v[3], v[4], v[5]
    weights, xs, xm, h, hs, hm, xq, hq, qdone = v[7:]
    d = x.shape[1]
    o = offs
    nb = np.uint64(nbytes)
    two = np.uint64(2)
    hg = np.uint64(group // 2)
    gd, gi = np.uint64(d // group), np.uint64(i // group)
    up_blocks = (i + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    n_split = split_r // ROWS_PER_TASK              # the split expert's row tasks: the gate/up stage's first
    n_u = (plan[N_STAGES + 1] - n_split) // up_blocks
    down_rows = _down_rows(n_u)
    row_d, row_i = gd * hg, gi * hg                   # packed bytes of a gate/up row, of a down row
    scale_b = np.uint64(2) if codec == 0 else np.uint64(1)
    scale_d, scale_i = gd * scale_b, gi * scale_b    # its scale bytes (int4: fp16; fp4: one byte)
    ahead_d, ahead_i = np.int64(_rows_ahead(row_d)), np.int64(_rows_ahead(row_i))   # rows asked for ahead
    mins = codec == 0                                # int4 rows have mins too
    fused = plan[N_STAGES + 2] == 0                  # the gate/up tasks quantize the down inputs
    per_group = group // ROWS_PER_TASK               # (then) gate/up tasks a group of h rows
    held = np.int64(-1)                              # a down task taken early
    held_rows = max(ahead_i, np.int64(HELD_PREFETCH_BYTES) // (np.int64(row_i) + np.int64(2) * np.int64(scale_i)))
    lb = LANE_BASE + lane * LANE_WORDS
    counting = phases.shape[0] >= lb + LANE_WORDS
    x_waited = False                                 # (this lane has seen x whole: its gate/up tasks may run)
    for stage in range(N_STAGES):
        base = plan[stage]
        end = base + plan[N_STAGES + stage]
        free = _cycles()                              # when this lane last finished something
        first = True                                  # (the lane's first task of the stage)
        while True:
            if stage == N_STAGES - 1 and held >= 0:
                task = held
                held = -1
            else:
                task = _take(sync, (2 * stage + 1) * SYNC_STRIDE, end)
            if task < 0:
                break
            task -= base
            began = _cycles()
            if stage == 0:                            # x: token, group
                _quantize_group(x, task // (d // group), task % (d // group), group, xq, xs, xm)
            elif stage == 1 and task < n_split:      # rows of the split expert, for the GPU's h
                e = np.uint64(split_e)
                b0, t = e * nb, np.uint64(split_t)
                r0 = task * ROWS_PER_TASK
                r1 = r0 + ROWS_PER_TASK
                if not x_waited:
                    _rows_asked_then_x(buf, b0, o, r0, r1, row_d, scale_d, mins, x_word, x_at, x_gen)
                    x_waited = True
                for r in range(r0, min(r0 + ahead_d, r1)):
                    _prefetch_gate_up(buf, b0, o, r, row_d, scale_d, mins)
                for r in range(r0, r1):
                    if r + ahead_d < r1:
                        _prefetch_gate_up(buf, b0, o, r + ahead_d, row_d, scale_d, mins)
                    part[r] = _gate_up_act(codec, buf, buf16, buf32, b0, o, np.uint64(r), gd, hg, table, xq, xs, xm, t,
                                           gate_scale[e], up_scale[e], has_bias, activation, alpha, limit)
                if _fetch_add(sync, SPLIT_DONE, 1) == split_base + n_split - 1:
                    _store_release(part_answer, 0, ticket)   # the GPU's take_split_rows may take the rows now
                    if counting:                  # (the worker's phases: gen_word is its ctl)
                        phases[SPLIT_MARK] += _cycles() - _load_acquire(gen_word, CTL_C0)
                        phases[SPLIT_COUNT] += 1
            elif stage == 1:                          # gate and up rows of one expert
                u, e, b0, r0, r1 = _task_rows(task - n_split, up_blocks, experts, nb, i, ROWS_PER_TASK)
                if not x_waited:
                    _rows_asked_then_x(buf, b0, o, r0, r1, row_d, scale_d, mins, x_word, x_at, x_gen)
                    x_waited = True
                for r in range(r0, min(r0 + ahead_d, r1)):           # the first rows asked for at once
                    _prefetch_gate_up(buf, b0, o, r, row_d, scale_d, mins)
                for r in range(r0, r1):
                    if r + ahead_d < r1:
                        _prefetch_gate_up(buf, b0, o, r + ahead_d, row_d, scale_d, mins)
                    for a in range(starts[u], starts[u + 1]):
                        h[a, r] = _gate_up_act(codec, buf, buf16, buf32, b0, o, np.uint64(r), gd, hg, table, xq, xs,
                                               xm, np.uint64(tokens[a]), gate_scale[e], up_scale[e], has_bias,
                                               activation, alpha, limit)
                if fused and _fetch_add(qdone, np.int64(u) * np.int64(gi) + r0 // group, 1) == per_group - 1:
                    for a in range(starts[u], starts[u + 1]):     # the group's last task: its rows are all in h
                        _quantize_group(h, a, r0 // group, group, hq, hs, hm)
            elif stage == 2:                          # down inputs: assignment, group
                _quantize_group(h, task // (i // group), task % (i // group), group, hq, hs, hm)
            else:                                     # down rows r0..r1 of every expert, summed into out
                r0 = task * down_rows
                r1 = min(r0 + down_rows, d)
                if clear_out:                         # (the worker's out: its rows of every token start at 0)
                    for tt in range(out.shape[0]):
                        for r in range(r0, r1):
                            out[tt, r] = 0.0
                # the rows ahead run on over the experts (a cursor pu, pr over the task's experts' rows in the
                # order they are computed): the next expert's first rows are in flight when this one's end
                pu, pr = 0, r0
                for _ in range(min(ahead_i, n_u * (r1 - r0))):
                    pu, pr = _prefetch_down(buf, experts, nb, o, pu, pr, r0, r1, row_i, scale_i, mins)
                for u in range(n_u):
                    e = np.uint64(experts[u])
                    b0 = e * nb
                    for r in range(r0, r1):
                        ru = np.uint64(r)
                        if pu < n_u:
                            pu, pr = _prefetch_down(buf, experts, nb, o, pu, pr, r0, r1, row_i, scale_i, mins)
                        for a in range(starts[u], starts[u + 1]):
                            w = _row(codec, buf, buf16, b0, o[6], o[7], o[8], ru, gi, hg, table, hq, hs, hm,
                                     np.uint64(a))
                            w *= down_scale[e]
                            if has_bias:
                                w += buf32[((b0 + o[11]) >> two) + ru]
                            out[tokens[a], r] += weights[a] * w
            if _fetch_add(sync, (2 * stage + 2) * SYNC_STRIDE, 1) == end - 1 and stage == N_STAGES - 1 \
                    and answer.shape[0] > 0:
                _store_release(answer, 0, ticket)     # the last task: out is whole
            if counting:
                free = _cycles()
                phases[lb + LANE_BUSY + stage] += free - began
                if first:
                    phases[lb + LANE_FIRST + stage] += free - began
                    first = False
                phases[lb + LANE_TASKS + stage] += 1
        if stage == 1 and fused:                      # out of gate/up tasks: a down task taken now, its rows asked for
            base3 = plan[N_STAGES - 1]
            held = _take(sync, (2 * N_STAGES - 1) * SYNC_STRIDE, base3 + plan[2 * N_STAGES - 1])
            if held >= 0:
                r0 = (held - base3) * down_rows
                r1 = min(r0 + down_rows, d)
                pu, pr = 0, r0
                for _ in range(min(held_rows, n_u * (r1 - r0))):
                    pu, pr = _prefetch_down(buf, experts, nb, o, pu, pr, r0, r1, row_i, scale_i, mins)
        _wait_at_least(sync, (2 * stage + 2) * SYNC_STRIDE, end)    # the stage done on every lane
        if counting:
            phases[lb + LANE_WAIT + stage] += _cycles() - free
        if seen[stage] == 0 and _load_acquire(gen_word, 0) == gen:   # (a benign race: any lane's time is fair)
            seen[stage] = _cycles()


@njit(cache=True, inline="always")
def _wait_at_least(word, index, value):
    """Poll word[index] until it is >= value, yielding every YIELD_EVERY polls."""
    polls = 0
    while _load_acquire(word, index) < value:
        polls += 1
        if polls % YIELD_EVERY == 0:
            _yield_cpu()


@njit(cache=True, inline="always")
def _mark_phases(phases, c0, t_in, n_thr, seen, joined):
    first, last = _NEVER, 0
    for j in range(n_thr):
        if t_in[j] != _NEVER:
            first = min(first, t_in[j])
            last = max(last, t_in[j])
    phases[1] += first - c0
    phases[2] += last - c0
    for stage in range(N_STAGES):
        phases[3 + stage] += seen[stage] - c0
    phases[3 + N_STAGES] += joined - c0
    phases[N_PHASES - 1] += 1


@njit(parallel=True, cache=True, fastmath=True)
def moe_layer_int8(codec, buf, buf16, buf32, nbytes, offs, has_bias, i, group, table, x, tokens_in, experts_in,
                   weights_in, gate_scale, up_scale, down_scale, activation, alpha, limit, out, phases, lanes,
                   s64, s32, s8, answer, ticket):
    """out[t] += sum over assignments a of t of weights[a] * expert_{experts}(x[t]), int8 activations.

    buf: the layer's blocks as one flat uint8 array [E * nbytes] (buf16, buf32: the same bytes as uint16 and
    float32); codec 0 int4, 1 fp4 (scales through the table), 2 fp4 with e8m0 scales; offs [12] uint64: byte offsets
    inside a block of gate, gate_scales, gate_mins, up, up_scales, up_mins, down, down_scales, down_mins (mins
    unused by fp4), gate_bias, up_bias, down_bias (read when has_bias); i the expert width; x [T, D] float32;
    the assignments in any order: tokens_in, experts_in [A] int64, weights_in [A] float32; *_scale [E]
    per-matrix scales; out [T, D] float32, added to; phases [N_PHASES] int64: the call's time marks, added to
    (PHASES); lanes: the region's iterations, one per kernel thread (numba.get_num_threads() of the caller,
    passed in: calling it here would make the function uncacheable, so every process would compile it again);
    s64, s32, s8: flat scratch arrays of at least `scratch_sizes(...)` elements (Scratch.fit); answer [>= 0]
    int64: when not empty, the lane that finishes the last task stores `ticket` in answer[0] (release) - out is
    complete then - so a waiting GPU goes on without the region's join (~20 µs on the GPU machine's host).

    One parallel region for the whole layer, in four stages: the tokens' activations to int8 (a task a group;
    for a single token done in the serial start instead, and the stage has no tasks), gate and up rows (a
    task = ROWS_PER_TASK rows of one expert), the down projection's inputs to int8 (a task a group of one
    assignment), and the down rows summed into out (a task a slice of out's columns over every expert).
    Threads take a stage's tasks from a shared counter and wait until every task of the stage is done before
    the next (`_stages`): a thread the OS delays holds up only the task it is on (with a static split, its whole
    share held the region up: run p, ~150 µs a region whatever its work), and no stage runs on one thread while
    the others wait.

    Only the prange is parallel: with parallel=True numba turns every whole-array expression (`a[:] = 0`) into a
    parallel region of its own, and on the GPU machine's host each region costs ~20 µs to start and join (three
    such fills were run r's 58 µs "prologue"), so every fill here is a plain loop (a test counts the regions).
    The worker's loop (`serve_layers`) keeps its lanes in one region across requests instead."""
    c0 = _cycles()
    n_tok, d = x.shape
    n_a = experts_in.shape[0]
    if n_a == 0:
        return
    n_exp = buf.shape[0] // nbytes
    n_thr = max(1, lanes)
    v = _carve(s64, s32, s8, n_tok, n_a, n_exp, n_thr, d, i, group)
    n0, n1, n2, n3 = _prepare(x, tokens_in, experts_in, weights_in, n_exp, n_tok, d, i, group, n_thr, v, True)
    sync, seen, t_in = v[4], v[5], v[6]
    for j in range(sync.shape[0]):
        sync[j] = 0
    zero = np.int64(0)                                    # (typed as serve_layers' plan: _stages compiles once)
    plan = (zero, zero, zero, zero, n0, n1, n2, n3)
    always = sync[:1]                                     # gen_word: sync[0] is padding, 0 throughout
    phases[0] += _cycles() - c0
    for lane in prange(n_thr):
        t_in[lane] = _cycles()
        # every argument typed as serve_layers passes it: numba compiles a variant for each distinct signature,
        # and literal flags and the prange's index (int64 in typing, uint64 in the parfor) had made four (a fresh
        # install's compile on the dev VM 117 s, 58 s with one)
        _stages(codec, buf, buf16, buf32, nbytes, offs, has_bias, i, group, table, x, n_a, gate_scale, up_scale,
                down_scale, activation, alpha, limit, out, v, plan, answer, ticket, always, zero, np.int64(lane),
                phases, zero != zero, zero, zero, zero, zero, s32, answer, always, zero, zero)
        # (no clearing of out, no split expert: the part arrays are never touched; x quantized already)
    _mark_phases(phases, c0, t_in, n_thr, seen, _cycles())


# The worker's lanes between requests (`serve_layers`): shared words of `ctl`, the first three each on its own
# 128 bytes; lane 0 writes the request's parameters (its plan: the stages' counter bases, then task counts)
CTL_GEN, CTL_BEGIN, CTL_QUIT, CTL_PLAN = (j * SYNC_STRIDE for j in range(4))   # request published, being written
CTL_LAYER, CTL_A, CTL_TICKET, CTL_C0, CTL_LAST = (CTL_PLAN + 2 * N_STAGES + j for j in range(5))
CTL_SPLIT_E, CTL_SPLIT_T, CTL_SPLIT_R, CTL_SPLIT_BASE = (CTL_PLAN + 2 * N_STAGES + 5 + j for j in range(4))
CTL_BAD = CTL_PLAN + 2 * N_STAGES + 9              # a request refused (its ticket): serve_int8 raises
# the generation whose x is quantized (the early plan: written after CTL_GEN), on its own 128 bytes - every lane
# polls it while lane 0 writes x's int8 form
CTL_XREADY = -(-(CTL_PLAN + 2 * N_STAGES + 10) // SYNC_STRIDE) * SYNC_STRIDE
CTL_SIZE = CTL_XREADY + SYNC_STRIDE


@njit(parallel=True, cache=True, fastmath=True, nogil=True)
def serve_layers(req, resp, meta, ids, weights, x, out, part, part_answer, last, spins, clock, stamps, phases, lanes,
                 early_x, sel64, sel32, s64, s32, s8, ctl, codec, bufs, g_scale, u_scale, d_scale, nbytes, offs,
                 has_bias, inter, group, table, activation, alpha, limit):
    """The CPU-share worker's requests (cpu_share.serve_int8 says what each argument is), served by `lanes` lanes
    that stay in one parallel region from request to request: lane 0 polls the mailbox, gathers a request's
    assignments and publishes it (ctl[CTL_GEN]); every lane, spinning on that word between requests, runs the
    kernel's stages (`_stages`); the lane that finishes the last task answers. No region is started or joined
    per request (run s: ~20-37 µs to start one on the GPU machine's 16 cores, its threads woken from libgomp's
    wait, and ~38 to join it), and nothing is allocated: the views are made once, for the mailbox's most tokens
    and assignments. Returns the last ticket served once `spins` polls saw nothing new.

    Nobody waits for a lane: the stages' counters run on from request to request (each request's tasks are a
    window of them, taken by compare-and-swap, so a counter never passes its window's end), and lane 0 sets up
    the next request as soon as every task of the last one is done. A lane the OS ran late (or, with more lanes
    than threads, after lane 0 left) finds its window's tasks all taken and moves on - it never touches a later
    request's data with an old plan, and lane 0 alone can serve everything. The plan is read under a
    sequence check (CTL_BEGIN is bumped before it is written, CTL_GEN after).

    A request may name a split expert (meta[2:5]: expert, token, rows; rows 0: none): its first rows' activations
    go to `part` and their ticket to part_answer (`_stages`), even when the request has no whole expert.

    early_x (the early plan, for a request of one token): lane 0 publishes the plan straight after the sort and
    quantizes x after it (CTL_XREADY), so the other lanes' first gate/up rows stream in from DRAM while it does -
    the serial start's quantization (~4 µs of 6-8 on the GPU machine's host, session 15) no longer holds every
    lane. Same tasks, same order of sums: the same bits either way."""
    # Every shared word the lanes read inside the prange is read with _load_acquire: numba hoists a plain
    # `meta[0]` or `ctl[i]` (a constant index into an array the loop does not look like it writes) out of the
    # loop, so every request after the first read the first one's layer and token count
    n_thr = max(1, lanes)
    t_max, d = x.shape
    a_max = ids.shape[0]
    k = a_max // t_max
    n_exp = bufs[0].shape[0] // nbytes
    v = _carve(s64, s32, s8, t_max, a_max, n_exp, n_thr, d, inter, group)
    sync, seen, t_in = v[4], v[5], v[6]
    xs, xm, xq = v[8], v[9], v[13]
    x_flat = x.reshape(t_max * d)                   # (x's lines asked for at a request's start, `_prefetch`)
    for j in range(sync.shape[0]):
        sync[j] = 0
    for j in range(ctl.shape[0]):
        ctl[j] = 0
    ctl[CTL_LAST] = last
    for lane in prange(n_thr):
        mine = 0                                    # the last request this lane ran
        b0 = b1 = b2 = b3 = bs = 0                  # (lane 0) the stages' counters so far, the split's
        while True:
            if lane == 0:
                seen_seq = _load_acquire(ctl, CTL_LAST)
                seq = _load_acquire(req, 0)
                n = 0
                while seq == seen_seq and n < spins:
                    seq = _load_acquire(req, 0)
                    n += 1
                if seq == seen_seq:                 # quiet for `spins` polls: every lane leaves the region
                    _store_release(ctl, CTL_QUIT, 1)
                    _store_release(ctl, CTL_BEGIN, mine + 1)
                    _store_release(ctl, CTL_GEN, mine + 1)
                    break
                c0 = _cycles()
                li, t = _load_acquire(meta, 0), _load_acquire(meta, 1)
                # x's lines (8 KB a token, last written by the GPU over PCIe: none in this core's caches) asked for
                # at once, so the sort below runs while they come and the quantization reads them from L1/L2
                for j in range(0, min(t, t_max) * d, 16):
                    _prefetch(x_flat, j)
                se, st, sr = _load_acquire(meta, 2), _load_acquire(meta, 3), _load_acquire(meta, 4)
                if not split_ok(se, st, sr, inter, n_exp, t):
                    # every lane leaves (as when quiet) and serve_int8 raises: no raise in here - one written in
                    # the prange makes numba compile it as a serial loop (lane 1 took 0 of 5,120 tasks on the
                    # dev VM; the GPU machine's host measured 8.1 GB/s, s16a, where sessions 14-15 saw 56-77),
                    # and the other lanes, waiting for the next request, would never have let it out
                    _store_release(ctl, CTL_BAD, seq)
                    _store_release(ctl, CTL_QUIT, 1)
                    _store_release(ctl, CTL_BEGIN, mine + 1)
                    _store_release(ctl, CTL_GEN, mine + 1)
                    break
                clock[1] += 1                       # counted before the answer: whoever sees it sees the count
                stamps[seq % stamps.shape[0], 0] = c0
                a = 0
                for j in range(t * k):
                    if ids[j] >= 0:
                        sel64[a], sel64[a_max + a], sel32[a] = j // k, ids[j], weights[j]
                        a += 1
                if a == 0 and sr == 0:              # nothing for the CPU: zero rows, answered at once
                    for r in range(t):
                        for c in range(d):
                            out[r, c] = 0.0
                    _store_release(resp, 0, seq)
                    stamps[seq % stamps.shape[0], 1] = _cycles()
                    clock[0] += stamps[seq % stamps.shape[0], 1] - c0
                    _store_release(ctl, CTL_LAST, seq)
                    continue
                late_x = early_x != 0 and t <= SERIAL_X_TOKENS     # x quantized after the plan is out
                n0, n1, n2, n3 = _prepare(x, sel64[:a], sel64[a_max:a_max + a], sel32[:a], n_exp, t, d, inter,
                                          group, n_thr, v, not late_x)
                n1 += sr // ROWS_PER_TASK           # the split expert's row tasks come first in the stage
                plan = (b0, b1, b2, b3, n0, n1, n2, n3)
                b0, b1, b2, b3 = b0 + n0, b1 + n1, b2 + n2, b3 + n3
                g = mine + 1
                _store_release(ctl, CTL_BEGIN, g)
                for j in range(2 * N_STAGES):
                    _store_release(ctl, CTL_PLAN + j, plan[j])
                _store_release(ctl, CTL_LAYER, li)
                _store_release(ctl, CTL_A, a)
                _store_release(ctl, CTL_TICKET, seq)
                _store_release(ctl, CTL_C0, c0)
                _store_release(ctl, CTL_SPLIT_E, se)
                _store_release(ctl, CTL_SPLIT_T, st)
                _store_release(ctl, CTL_SPLIT_R, sr)
                sb = bs                             # this request's split tasks: counted from here
                bs += sr // ROWS_PER_TASK
                _store_release(ctl, CTL_SPLIT_BASE, sb)
                _store_release(ctl, CTL_LAST, seq)
                if not late_x:
                    _store_release(ctl, CTL_XREADY, g)
                phases[0] += _cycles() - c0
                _store_release(ctl, CTL_GEN, g)
                if late_x:                          # the other lanes are asking for their first rows meanwhile
                    for n in range(t):
                        _quantize_row(x, n, group, xq, xs, xm)
                    _store_release(ctl, CTL_XREADY, g)
                    seen[0] = _cycles()             # (the "x quantized" mark: now lane 0's, after the stage's)
            else:
                _wait_at_least(ctl, CTL_GEN, mine + 1)
                g = _load_acquire(ctl, CTL_GEN)     # before QUIT: the quitting generation comes with QUIT set
                if _load_acquire(ctl, CTL_QUIT):
                    break
                plan = (_load_acquire(ctl, CTL_PLAN), _load_acquire(ctl, CTL_PLAN + 1),
                        _load_acquire(ctl, CTL_PLAN + 2), _load_acquire(ctl, CTL_PLAN + 3),
                        _load_acquire(ctl, CTL_PLAN + 4), _load_acquire(ctl, CTL_PLAN + 5),
                        _load_acquire(ctl, CTL_PLAN + 6), _load_acquire(ctl, CTL_PLAN + 7))
                li = _load_acquire(ctl, CTL_LAYER)
                a = _load_acquire(ctl, CTL_A)
                seq = _load_acquire(ctl, CTL_TICKET)
                se, st = _load_acquire(ctl, CTL_SPLIT_E), _load_acquire(ctl, CTL_SPLIT_T)
                sr, sb = _load_acquire(ctl, CTL_SPLIT_R), _load_acquire(ctl, CTL_SPLIT_BASE)
                if _load_acquire(ctl, CTL_BEGIN) != g:   # lane 0 is writing the next one: read that instead
                    continue
            mine = g
            if _load_acquire(ctl, CTL_GEN) == g:
                t_in[lane] = _cycles()
            buf = bufs[li]
            _stages(codec, buf, buf.view(np.uint16), buf.view(np.float32), nbytes, offs, has_bias, inter, group,
                    table, x, a, g_scale[li], u_scale[li], d_scale[li], activation, alpha, limit, out, v, plan,
                    resp, seq, ctl, g, np.int64(lane), phases, g == g, se, st, sr, sb, part, part_answer, ctl,
                    np.int64(CTL_XREADY), g)       # (typed as moe_layer_int8 passes them: one compiled variant)
            if lane == 0:
                joined = _cycles()
                c0 = _load_acquire(ctl, CTL_C0)
                _mark_phases(phases, c0, t_in, n_thr, seen, joined)
                clock[0] += joined - c0
                stamps[seq % stamps.shape[0], 1] = joined
    return ctl[CTL_LAST]
