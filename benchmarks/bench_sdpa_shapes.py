"""What torch's attention costs the first time it meets a shape, by backend (session 36).

Why: s34j's profile of qwen3.6's lone last-token step (eager, KV of 30,200 tokens) spent 34 ms of host time in
three `aten::_cudnn_attention_forward` calls, ~11 ms each, and s35b's first 16K prompt beside a decode spent 0.49 s
in 96 `attend` calls. cuDNN's attention builds an execution graph for each new shape (mlx's cuDNN attention PR
names the same cost), and an engine meets a new shape at every prompt: its length, and its KV length for a lone
token. This times, for each backend SDPA may pick, the first call at each of several new shapes and a repeat
call at the same shape (after one call at a shape of its own, so that loading the backend is not counted), for a
model's attention (heads, kv heads, head dim). Each backend meets lengths no other backend met: torch's default
picks cuDNN on an H100, and cuDNN's plans are cached by shape, so a cuDNN row after the default's at the same
lengths timed cached calls (s36a printed cuDNN "first calls" of 0.06 ms beside the default's 33-42 ms):

- "prompt": a chunk that starts a sequence, causal, T queries over T keys (the engine's first prefill chunk);
- "lone token": one query over S cached keys, no mask (a prompt's last token or a step beside a prefill, eager).

    python benchmarks/bench_sdpa_shapes.py                     # on the GPU machine: both shapes of issue 10
    python benchmarks/bench_sdpa_shapes.py --device cpu --heads 4 1 16 --prompt 64 --keys 256   # the dev VM

Prints a table (ms) and writes JSON with --out. A backend that cannot take the case shows "-" and why.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "qwen3.6-35b-a3b": (16, 2, 256)}   # heads, kv heads, head dim
NEW_SHAPES = 5            # distinct lengths a case is timed at (each a first call), then one repeat of the last
LENGTH_STEP = 7           # between a case's new lengths
BACKEND_STRIDE = 37       # between two backends' first lengths: more than (NEW_SHAPES - 1) * LENGTH_STEP, so none meet


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def lengths(length: int, backend_index: int) -> list[int]:
    """The NEW_SHAPES lengths a backend is timed at: its own, never one another backend of the run meets."""
    first = length + BACKEND_STRIDE * backend_index
    return [first + LENGTH_STEP * i for i in range(NEW_SHAPES)]


def measure(case: str, backend: str, heads: tuple[int, int, int], length: int, *, device: torch.device,
            dtype: torch.dtype, backend_index: int = 0) -> dict:
    """First-call ms at the backend's NEW_SHAPES lengths (`lengths`), then the repeat ms at the last of them. A
    case the backend refuses: {"error": why}."""
    h, hkv, hd = heads
    firsts, repeat = [], None
    own = lengths(length, backend_index)
    try:
        # i = -1: a shape of its own first, so that loading the backend's library is not counted as a first call
        for i in range(-1, NEW_SHAPES + 1):
            n = length // 2 if i < 0 else own[min(i, NEW_SHAPES - 1)]
            t = n if case == "prompt" else 1
            q = torch.randn(1, h, t, hd, device=device, dtype=dtype)
            k = torch.randn(1, hkv, n, hd, device=device, dtype=dtype)
            v = torch.randn_like(k)
            choice = BACKENDS[backend]
            with sdpa_kernel([choice]) if choice is not None else contextlib.nullcontext():
                ms = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case == "prompt",
                                                                  enable_gqa=h != hkv), device)
            if 0 <= i < NEW_SHAPES:
                firsts.append(ms)
            elif i == NEW_SHAPES:
                repeat = ms
    except RuntimeError as exc:        # "No available kernel" and the like: this backend does not take the case
        return {"error": str(exc).splitlines()[0][:80]}
    return {"first_ms": statistics.median(firsts), "first_ms_each": firsts, "repeat_ms": repeat, "lengths": own}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heads", type=int, nargs=3, metavar=("H", "HKV", "HD"), action="append",
                    help="an attention shape (default: qwen3-30b-a3b's and qwen3.6-35b-a3b's)")
    ap.add_argument("--prompt", type=int, default=1000, help="first prompt length timed (tokens)")
    ap.add_argument("--keys", type=int, default=16000, help="first KV length for the lone token")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--out", help="JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {f"{h}/{hkv}x{hd}": (h, hkv, hd) for h, hkv, hd in args.heads} if args.heads else dict(SHAPES)
    rows = []
    print(f"SDPA first call at a new shape vs a repeat, ms (median of {NEW_SHAPES} new shapes); torch "
          f"{torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, {dtype}")
    print("| attention | case | length | backend | first call ms | repeat ms |")
    print("|---|---|---|---|---|---|")
    for name, heads in shapes.items():
        for case, length in (("prompt", args.prompt), ("lone token", args.keys)):
            for index, backend in enumerate(args.backends):
                r = measure(case, backend, heads, length, device=device, dtype=dtype, backend_index=index)
                rows.append({"attention": name, "case": case, "length": length, "backend": backend, **r})
                cells = (f"- ({r['error']})", "-") if "error" in r else \
                    (f"{r['first_ms']:.3f}", f"{r['repeat_ms']:.3f}")
                print(f"| {name} | {case} | {length} | {backend} | {cells[0]} | {cells[1]} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
