"""Gated DeltaNet on CUDA: fla-core's kernels against our plain-torch reference, error and time.

    pip install fla-core                      # on the GPU machine, next to the CUDA build of torch
    python benchmarks/gdn_cuda_check.py       # [--shape qwen3-next-80b] [--json out.json]

At a real model's layer sizes it checks, on random inputs:
  rule/prefill   fla `chunk_gated_delta_rule` (bf16) vs `chunked_gated_delta_rule` (fp32) for several
                 lengths, from a zero and from a random incoming state;
  rule/decode    fla `fused_recurrent_gated_delta_rule` vs `recurrent_gated_delta_rule`, batch 1 and 8;
  layer          the whole `GatedDeltaNet` with backend="fla" (bf16) vs backend="torch" (fp32, same
                 weights): a 512-token prefill then 16 decode steps carrying the state;
  torch on cuda  our chunked vs recurrent forms in fp32 on the GPU (the path CUDA runs without fla).
Errors are max |fla - reference| and that over max |reference|; times are CUDA-event medians.
Exit status: 0 all within bounds, 1 an error above its bound, 2 no CUDA or fla-core not importable
(the torch timings still print).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.models.gated_deltanet import (GatedDeltaNet, GatedDeltaNetConfig, chunked_gated_delta_rule,  # noqa: E402
                                           fla_gated_delta_rule, fla_kernels, recurrent_gated_delta_rule)

SHAPES = {   # config.json's linear_* values of the real checkpoints
    "qwen3.5-35b-a3b": dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "qwen3-next-80b": dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                           linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "tiny": dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,      # smoke runs
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
}
BF16_REL_BOUND = 2e-2       # bf16 inputs and kernels against an fp32 reference, relative to the output scale
FP32_REL_BOUND = 1e-4       # our two torch forms against each other on the GPU


DEVICE = "cuda"             # --device cpu: a smoke run of the script itself (no fla, wall-clock times)


def cuda_time(fn, *, repeats: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of fn() measured with CUDA events (wall clock on the CPU smoke run)."""
    if DEVICE == "cpu":                      # the smoke run: enough to see the order of magnitude
        repeats, warmup = min(repeats, 3), 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if DEVICE == "cpu":
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (got.float() - ref.float()).abs().max().item()
    return diff, diff / max(ref.float().abs().max().item(), 1e-12)


def rule_inputs(cfg: GatedDeltaNetConfig, B: int, T: int, *, gen: torch.Generator, dtype: torch.dtype):
    """q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv] as the layer produces them."""
    dev = DEVICE
    q = torch.randn(B, T, cfg.num_k_heads, cfg.head_k_dim, generator=gen, device=dev).to(dtype)
    k = torch.randn(B, T, cfg.num_k_heads, cfg.head_k_dim, generator=gen, device=dev).to(dtype)
    v = torch.randn(B, T, cfg.num_v_heads, cfg.head_v_dim, generator=gen, device=dev).to(dtype)
    a = torch.randn(B, T, cfg.num_v_heads, generator=gen, device=dev)
    g = -torch.nn.functional.softplus(a) * torch.rand(cfg.num_v_heads, generator=gen, device=dev) * 4   # log decay <= 0
    beta = torch.rand(B, T, cfg.num_v_heads, generator=gen, device=dev).to(dtype)
    return q, k, v, g.float(), beta


def check_rule(cfg: GatedDeltaNetConfig, have_fla: bool, rows: list[dict]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cases = [(64, False), (512, False), (512, True)] + ([(4096, False)] if DEVICE == "cuda" else [])
    for T, with_state in cases:
        q, k, v, g, beta = rule_inputs(cfg, 1, T, gen=gen, dtype=torch.bfloat16)
        s0 = (torch.randn(1, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, generator=gen, device=DEVICE) * 0.1
              if with_state else None)
        ref = lambda: chunked_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(),  # noqa: E731
                                               initial_state=s0)
        o_ref, s_ref = ref()
        row = dict(check="rule/prefill", T=T, initial_state=with_state, torch_fp32_ms=round(cuda_time(ref), 3))
        if have_fla:
            fla = lambda: fla_gated_delta_rule(q, k, v, g, beta, initial_state=s0, recurrent=False)  # noqa: E731
            o, s = fla()
            row.update(fla_ms=round(cuda_time(fla), 3), out_err=errors(o, o_ref), state_err=errors(s, s_ref),
                       bound=BF16_REL_BOUND)
        rows.append(row)
    for B in (1, 8):
        q, k, v, g, beta = rule_inputs(cfg, B, 1, gen=gen, dtype=torch.bfloat16)
        s0 = torch.randn(B, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, generator=gen, device=DEVICE) * 0.1
        ref = lambda: recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(),  # noqa: E731
                                                 initial_state=s0)
        o_ref, s_ref = ref()
        row = dict(check="rule/decode", B=B, torch_fp32_ms=round(cuda_time(ref, repeats=50), 4))
        if have_fla:
            fla = lambda: fla_gated_delta_rule(q, k, v, g, beta, initial_state=s0, recurrent=True)  # noqa: E731
            o, s = fla()
            row.update(fla_ms=round(cuda_time(fla, repeats=50), 4), out_err=errors(o, o_ref),
                       state_err=errors(s, s_ref), bound=BF16_REL_BOUND)
        rows.append(row)


def random_layer(cfg: GatedDeltaNetConfig, *, backend: str, dtype: torch.dtype, seed: int = 1) -> GatedDeltaNet:
    layer = GatedDeltaNet(cfg, packed=False, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":      # transformers' initialisation
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return layer.to(device=DEVICE, dtype=dtype)


def check_layer(cfg: GatedDeltaNetConfig, have_fla: bool, rows: list[dict]) -> None:
    """fp32 torch (the reference), bf16 torch and bf16 fla layers over the same bf16-rounded weights.

    bf16 against fp32 is reported for information: where a head's output is small the gated RMSNorm
    rescales it to unit size, so bf16 rounding shows up large there whoever computes it. The kernel
    check is fla against the torch path at the same precision.
    """
    torch_bf16 = random_layer(cfg, backend="torch", dtype=torch.bfloat16)
    ref_layer = copy.deepcopy(torch_bf16).float()
    x = torch.randn(1, 512 + 16, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    xb = x.bfloat16()

    def run(layer, x):
        conv, rec = layer.new_states(1)
        y, conv, rec = layer(x[:, :512], conv, rec)
        ys = [y]
        for t in range(512, x.shape[1]):
            y, conv, rec = layer(x[:, t:t + 1], conv, rec)
            ys.append(y)
        return torch.cat(ys, dim=1), rec

    def timings(layer, x) -> tuple[float, float]:
        prefill = cuda_time(lambda: layer(x[:, :512], *layer.new_states(1)), repeats=5)
        step = cuda_time(lambda: layer(x[:, :1], *layer.new_states(1)), repeats=30)
        return round(prefill, 3), round(step, 4)

    with torch.no_grad():
        y_ref, s_ref = run(ref_layer, x)
        y16, s16 = run(torch_bf16, xb)
        (p32, d32), (p16, d16) = timings(ref_layer, x), timings(torch_bf16, xb)
        rows.append({"check": "layer: torch bf16 vs torch fp32 (information)", "prefill_tokens": 512,
                     "decode_steps": 16, "torch_fp32_prefill_ms": p32, "torch_fp32_decode_ms": d32,
                     "torch_bf16_prefill_ms": p16, "torch_bf16_decode_ms": d16,
                     "out_err_info": errors(y16, y_ref), "state_err_info": errors(s16, s_ref)})
        if have_fla:
            fla_layer = copy.deepcopy(torch_bf16)
            fla_layer.backend = "fla"
            y, s = run(fla_layer, xb)
            pf, df = timings(fla_layer, xb)
            rows.append({"check": "layer: fla bf16 vs torch bf16", "fla_bf16_prefill_ms": pf, "fla_bf16_decode_ms": df,
                         "out_err": errors(y, y16), "state_err": errors(s, s16), "bound": BF16_REL_BOUND,
                         "out_err_vs_fp32_info": errors(y, y_ref)})


def check_torch_forms(cfg: GatedDeltaNetConfig, rows: list[dict]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v, g, beta = rule_inputs(cfg, 1, 200, gen=gen, dtype=torch.float32)
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta)
    rows.append(dict(check="torch on cuda: chunked vs recurrent (fp32)", T=200, out_err=errors(o_c, o_r),
                     state_err=errors(s_c, s_r), bound=FP32_REL_BOUND))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-35b-a3b")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke run of this script (torch paths only, one thread, no 4096-token case)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check runs on the GPU machine (or --device cpu for a smoke run)")
        return 2
    if DEVICE == "cpu":
        torch.set_num_threads(1)     # one thread: comparable numbers on a shared machine
    cfg = GatedDeltaNetConfig.from_config(SHAPES[args.shape])
    have_fla = DEVICE == "cuda" and fla_kernels() is not None
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{args.shape}: Hk={cfg.num_k_heads} Hv={cfg.num_v_heads} dk={cfg.head_k_dim} dv={cfg.head_v_dim}; "
          f"{device_name}; torch {torch.__version__}; fla-core "
          f"{'present' if have_fla else 'NOT importable (pip install fla-core)'}")
    rows: list[dict] = []
    torch.backends.cuda.matmul.allow_tf32 = False      # the fp32 reference must really be fp32
    check_torch_forms(cfg, rows)
    check_rule(cfg, have_fla, rows)
    check_layer(cfg, have_fla, rows)
    failed = False
    for row in rows:
        rel = max((row[key][1] for key in ("out_err", "state_err") if key in row), default=None)
        verdict = "" if rel is None else ("ok" if rel <= row["bound"] else "ABOVE BOUND")
        failed |= verdict == "ABOVE BOUND"
        print(json.dumps(row), verdict)
    if args.json:
        args.json.write_text(json.dumps(dict(shape=args.shape, device=device_name,
                                             torch=torch.__version__, fla=have_fla, rows=rows), indent=1))
    if failed:
        return 1
    return 0 if have_fla else 2


if __name__ == "__main__":
    sys.exit(main())
