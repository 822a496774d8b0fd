"""Missed experts computed on the CPU, over the packed weights in host memory, all of a layer's in one call.

`CpuExecutor.run(layer, x, tokens, experts, weights)` takes the layer's missed (token, expert) assignments
with their routing weights and returns their weighted sum per token. Paths, for int4/fp4 stores:

- int8 activations (`cpu_kernels_int8.py`, one parallel call per layer, byte dot-product instructions):
  the default for real layer sizes (hidden and expert width >= INT8_MIN_WIDTH); bandwidth-bound, and off
  the exact result by the activations' rounding (~1 % relative on a whole expert, bound in that module);
- exact float (`cpu_kernels.py`, one call for gate/up and one for down): small layers (tiny test models,
  where a call is overhead-bound anyway and results must match the reference to float rounding), or
  `int8=False`;
- reference (dequantize each expert with the FTW codecs, `expert_forward`): without numba, odd shapes
  (a width not a multiple of the group), `fast=False`; what the others are tested against.

bf16/f32 stores run torch's own matmuls on zero-copy views.

Shapes: T tokens, A assignments, U distinct experts, D hidden, I expert width.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from runtime.experts import cpu_kernels as ck
from runtime.experts.host_store import HostExpertStore
from runtime.experts.interface import ExpertSpec, activate, expert_forward

def ck_scatter_add(out: np.ndarray, tokens: np.ndarray, y: np.ndarray, w: np.ndarray) -> None:
    """out[tokens[a]] += w[a] * y[a] (numpy; np.add.at handles repeated tokens)."""
    np.add.at(out, tokens, y * w[:, None])


_ACTIVATIONS = {"silu": 0, "gpt_oss": 1}
_NO_ANSWER = np.zeros(0, dtype=np.int64)          # the int8 kernel's answer word: none (the caller waits for it)
INT8_MIN_WIDTH = 512         # int8 activations from this hidden size and expert width up (real MoE layers)


def group_by_expert(experts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """assignments' experts [A] -> (order [A] sorting them by expert, distinct experts [U], starts [U + 1])."""
    order = np.argsort(experts, kind="stable")
    uniq, counts = np.unique(experts[order], return_counts=True)
    starts = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return order, uniq.astype(np.int64), starts


class CpuExecutor:
    """Runs missed experts on the CPU. `threads` bounds the kernel's threads (None: numba's default, all cores);
    `int8` picks the int8-activation kernels (None: by layer size, see the module docstring)."""

    def __init__(self, store: HostExpertStore, spec: ExpertSpec, *, threads: int | None = None,
                 fast: bool | None = None, int8: bool | None = None):
        self.store = store
        self.spec = spec
        self.fast = ck.HAVE_NUMBA if fast is None else fast
        if self.fast and not ck.HAVE_NUMBA and store.layout.quantized:
            raise RuntimeError("the fast CPU expert kernels need numba (pip install numba)")
        self.threads = min(threads, ck.numba.config.NUMBA_NUM_THREADS) if threads and ck.HAVE_NUMBA else 0
        if spec.activation not in _ACTIVATIONS:
            raise ValueError(f"unknown expert activation {spec.activation!r}")
        lay = store.layout
        if lay.quantized and (lay.hidden % lay.group or lay.intermediate % lay.group):
            self.fast = False          # the kernels view rows as whole groups; odd shapes take the reference path
        if int8 is None:
            int8 = min(lay.hidden, lay.intermediate) >= INT8_MIN_WIDTH
        self.int8 = bool(int8 and self.fast and lay.quantized)
        if self.int8:
            from runtime.experts import cpu_kernels_int8
            self._k8 = cpu_kernels_int8
            self.int8 = lay.group in cpu_kernels_int8.SUPPORTED[lay.codec]
            self.phases = np.zeros(cpu_kernels_int8.N_PHASES, dtype=np.int64)   # the kernel's time marks, summed
            self._scratch_by_thread = threading.local()     # a call's scratch, per calling thread
        if lay.codec == "int4":
            self._scale_table = ck.fp16_table()
        elif lay.codec == "fp4":
            self._scale_table = ck.e8m0_table() if lay.scale_format == "e8m0" else ck.e4m3_table()
        self._globals: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._empty = np.zeros((0, 0), dtype=np.float32)
        self._offsets: dict[str, np.ndarray] = {}
        self._flat: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ public
    def warm_up(self, layer: int) -> None:
        """Compile (or load from numba's cache) the kernels for this layout by running them once, on ONE thread:
        a parallel region run here would leave the calling thread its own pool of kernel threads for good
        (libgomp keeps a pool per thread that ran one), and beside the CPU-share worker's pool that is more
        threads than cores - libgomp then stops spinning between regions (throttled) and every request pays
        the threads' wake-up."""
        saved = self.threads
        before = ck.numba.get_num_threads() if ck.HAVE_NUMBA else 0
        self.threads = 1 if ck.HAVE_NUMBA else 0
        try:
            self.run(layer, torch.zeros(1, self.store.layout.hidden), np.zeros(1, np.int64), np.zeros(1, np.int64),
                     np.ones(1, np.float32))
        finally:
            self.threads = saved
            if before:
                ck.numba.set_num_threads(before)

    def run(self, layer: int, x: torch.Tensor, tokens: np.ndarray, experts: np.ndarray,
            weights: np.ndarray, *, threads: int | None = None) -> torch.Tensor:
        """x [T, D] float32 CPU; tokens, experts [A] int64; weights [A] float32 -> [T, D] float32:
        out[t] = sum over assignments a of token t of weights[a] * expert_{experts[a]}(x[t]).
        `threads`: this call's kernel threads (default: the executor's)."""
        x = x.to(torch.float32).contiguous()
        out = torch.zeros_like(x)
        if len(experts) == 0:
            return out
        threads = threads or self.threads
        if threads:                    # numba's thread count is per calling thread: set it where the work runs
            ck.numba.set_num_threads(threads)
        if self.int8:                  # the kernel groups the assignments itself (no numpy calls per layer)
            self._kernel_int8(layer, x.numpy(), np.ascontiguousarray(tokens, dtype=np.int64),
                              np.ascontiguousarray(experts, dtype=np.int64),
                              np.ascontiguousarray(weights, dtype=np.float32), out.numpy())
            return out
        order, uniq, starts = group_by_expert(np.asarray(experts, dtype=np.int64))
        tok = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64)[order])
        w = torch.from_numpy(np.ascontiguousarray(np.asarray(weights, dtype=np.float32)[order]))
        if not self.fast:
            y = self._reference(layer, x, tok, uniq, starts)
        elif not self.store.layout.quantized:
            y = self._dense(layer, x, tok, uniq, starts)
        else:
            y = self._kernel(layer, x.numpy(), tok, uniq, starts)
        # a serial scatter: torch's threaded index_add_ would fight numba's thread pool for the cores
        ck_scatter_add(out.numpy(), tok, y.numpy(), w.numpy())
        return out

    # ------------------------------------------------------------------ paths
    def _reference(self, layer, x, tok, uniq, starts) -> torch.Tensor:
        y = torch.empty(len(tok), x.shape[1], dtype=torch.float32)
        for u, e in enumerate(uniq):
            rows = torch.from_numpy(tok[starts[u]:starts[u + 1]])
            y[starts[u]:starts[u + 1]] = expert_forward(self.spec, self.store.dequantize(layer, int(e)), x[rows])
        return y

    def _dense(self, layer, x, tok, uniq, starts) -> torch.Tensor:
        """f32/bf16 stores: torch's matmuls in fp32 over the blocks (bf16 weights widened per expert), so the
        result is the reference's to rounding."""
        parts = self.store.layer_parts(layer)
        lay = self.store.layout
        if lay.codec == "bf16":
            view = lambda a: torch.from_numpy(a).view(torch.bfloat16).float()   # noqa: E731
        else:
            view = torch.from_numpy
        bias = lambda name, e: torch.from_numpy(parts[name][e]) if lay.has_bias else 0.0   # noqa: E731
        y = torch.empty(len(tok), x.shape[1], dtype=torch.float32)
        for u, e in enumerate(uniq):
            xs = x[torch.from_numpy(tok[starts[u]:starts[u + 1]])]
            g = torch.nn.functional.linear(xs, view(parts["gate"][e])) + bias("gate_bias", e)
            up = torch.nn.functional.linear(xs, view(parts["up"][e])) + bias("up_bias", e)
            y[starts[u]:starts[u + 1]] = torch.nn.functional.linear(activate(self.spec, g, up),
                                                                   view(parts["down"][e])) + bias("down_bias", e)
        return y

    def _kernel(self, layer, x: np.ndarray, tok, uniq, starts) -> torch.Tensor:
        lay = self.store.layout
        p = self.store.layer_parts(layer)
        buf = self.store.layer_buffer(layer)                             # [E, nbytes], zero-copy
        codec = 0 if lay.codec == "int4" else 1
        off = lambda name: lay.parts[name].offset if name in lay.parts else 0     # noqa: E731
        gu_offs = np.array([off(f"{m}{k}") for m in ("gate", "up") for k in ("", "_scales", "_mins")], dtype=np.int64)
        d_offs = np.array([off(f"down{k}") for k in ("", "_scales", "_mins")], dtype=np.int64)
        n_a = len(tok)
        h = np.empty((n_a, lay.intermediate), dtype=np.float32)
        y = np.empty((n_a, lay.hidden), dtype=np.float32)
        act = _ACTIVATIONS[self.spec.activation]
        alpha, limit = np.float32(self.spec.swiglu_alpha), np.float32(self.spec.swiglu_limit)
        # contiguous float32 everywhere: one compiled specialization serves every codec and layout
        bias = {n: np.ascontiguousarray(p[f"{n}_bias"], dtype=np.float32) if lay.has_bias else self._empty
                for n in ("gate", "up", "down")}
        g_scale, u_scale, d_scale = self._global_scales(layer, p)
        xe, xo, xsum = ck.split_even_odd(x, lay.group)
        ck.gate_up(codec, buf, gu_offs, lay.intermediate, self._scale_table, xe, xo, xsum,
                   tok, uniq, starts, g_scale, u_scale, bias["gate"], bias["up"], act, alpha, limit, h)
        he, ho, hsum = ck.split_even_odd(h, lay.group)
        ck.down(codec, buf, d_offs, lay.hidden, self._scale_table, he, ho, hsum,
                uniq, starts, d_scale, bias["down"], y)
        return torch.from_numpy(y)

    def int8_args(self) -> tuple:
        """Everything `cpu_kernels_int8.moe_layer_int8` takes besides one call's activations and assignments, for
        every layer at once, so compiled code can call it (cpu_share.py's worker loop): (codec, flat layer
        buffers as a numba typed List [L] of [E * nbytes] uint8, gate/up/down scales [L, E], nbytes, offsets,
        has_bias, expert width, group, scale table, activation, alpha, limit). Only for the int8 path."""
        from numba.typed import List

        if not self.int8:
            raise ValueError("int8_args: this executor does not run the int8 kernel")
        bufs, scales = List(), []
        for layer in self.store.layers:
            bufs.append(self._layer_flat(layer))
            scales.append(self._global_scales(layer, self.store.layer_parts(layer)))
        g, u, d = (np.ascontiguousarray(np.stack([sc[j] for sc in scales]), dtype=np.float32) for j in range(3))
        lay = self.store.layout
        return (self._int8_codec(), bufs, g, u, d, lay.nbytes, self._int8_offsets(), lay.has_bias, lay.intermediate,
                lay.group, self._scale_table, _ACTIVATIONS[self.spec.activation], np.float32(self.spec.swiglu_alpha),
                np.float32(self.spec.swiglu_limit))

    def _int8_offsets(self) -> np.ndarray:
        lay = self.store.layout
        offs = self._offsets.get(lay.codec)
        if offs is None:
            off = lambda name: lay.parts[name].offset if name in lay.parts else 0     # noqa: E731
            names = [f"{m}{k}" for m in ("gate", "up", "down") for k in ("", "_scales", "_mins")]
            offs = self._offsets[lay.codec] = np.array(
                [off(n) for n in names + ["gate_bias", "up_bias", "down_bias"]], dtype=np.uint64)
        return offs

    def _layer_flat(self, layer: int) -> np.ndarray:
        flat = self._flat.get(layer)
        if flat is None:
            flat = self._flat[layer] = _writable_alias(self.store.layer_buffer(layer).reshape(-1))  # [E * nbytes]
        return flat

    def _int8_codec(self) -> int:
        lay = self.store.layout
        return 0 if lay.codec == "int4" else (2 if lay.scale_format == "e8m0" else 1)

    def _kernel_int8(self, layer, x: np.ndarray, tokens, experts, weights, out: np.ndarray) -> None:
        lay = self.store.layout
        lanes = ck.numba.get_num_threads()
        offs = self._int8_offsets()
        flat = self._layer_flat(layer)
        g_scale, u_scale, d_scale = self._global_scales(layer, self.store.layer_parts(layer))
        codec = self._int8_codec()
        self._k8.moe_layer_int8(codec, flat, flat.view(np.uint16), flat.view(np.float32),
                                lay.nbytes, offs, lay.has_bias, lay.intermediate, lay.group, self._scale_table,
                                x, tokens, experts, weights, g_scale, u_scale, d_scale,
                                _ACTIVATIONS[self.spec.activation],
                                np.float32(self.spec.swiglu_alpha), np.float32(self.spec.swiglu_limit), out,
                                self.phases, lanes, *self._scratch().fit(x.shape[0], len(experts),
                                                                         self.store.num_experts, lay.hidden,
                                                                         lay.intermediate, lay.group, lanes),
                                _NO_ANSWER, 0)

    def _scratch(self):
        local = self._scratch_by_thread
        if not hasattr(local, "scratch"):
            local.scratch = self._k8.Scratch()
        return local.scratch

    def _global_scales(self, layer: int, parts: dict[str, np.ndarray]):
        """Per-matrix scales [E] of gate, up, down (NVFP4's global scale; ones otherwise), cached per layer."""
        cached = self._globals.get(layer)
        if cached is None:
            ones = np.ones(self.store.num_experts, dtype=np.float32)
            scales = []
            for proj in ("gate", "up", "down"):
                g = parts.get(f"{proj}_global")
                if g is None:
                    scales.append(ones)
                else:
                    g = np.ascontiguousarray(g[:, 0], dtype=np.float32)
                    scales.append(1.0 / g if self.store.layout.global_op == "div" else g)
            cached = self._globals[layer] = tuple(scales)
        return cached


def _writable_alias(a: np.ndarray) -> np.ndarray:
    """The same bytes (zero-copy) typed writable. numba compiles a separate specialization for read-only arrays
    (a mapped FTW file) -- another ~15 s compile of the whole kernel -- and the kernels only read the weights.
    The caller keeps `a`'s owner (the store) alive as long as the alias."""
    if a.flags.writeable:
        return a
    import ctypes
    return np.ctypeslib.as_array((ctypes.c_uint8 * a.size).from_address(a.ctypes.data))
