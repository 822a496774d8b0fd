"""Launch plans of the decode expert kernels (runtime/kernels/int4_pool_triton.py) on the GPU machine.

    python benchmarks/sweep_pool_kernels.py [--out sweep.json] [--budget-s 65] [--tokens 1 4]

Times `pool_forward_triton` at T = 1 and 4 on a resident pool of the real shapes (qwen3-30b-a3b: int4 group
128, 128 experts, FFN 768; qwen3.6-35b-a3b: MXFP4, 256 experts, FFN 512), recorded in a CUDA graph as the
decode step runs it. One graph holds CALLS calls, each over other experts (together every expert of the
pool, ~300-400 MB, far past the 50 MB L2), so no call finds its weights cached by the one before.

Each gate_up plan is timed with the default down plan, and each down plan with the default gate_up plan
(the sum of both lists instead of their product); the plans are compiled first by child
processes, in parallel, into Triton's disk cache; the table prints the pair's time, the
change against the default row, and GB/s of expert bytes read (each distinct expert's gate, up and down
once per call). Then the best gate_up and best down together. Stops sweeping at --budget-s (the lead's
limit is 90 s on the H200) and says what it skipped. Last, the fused decode glue (router GEMV + ranking,
k/v straight into the cache) against the launches it replaces. JSON rows go to --out.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CALLS = 16              # calls per recorded graph, each over its own experts
REPLAYS = 20
COMPILE_WORKERS = 8     # the H200 machine has 16 cores; each compile is single-threaded
COMPILE_PARTS = 3       # each model's plans of one kernel split over this many jobs


def candidates(t: int, k: int, layout, *, sms: int) -> dict:
    """{"gate_up": [plans], "down": [plans]} for T tokens: the default first, the pre-sweep loop (the kernels'
    old behaviour), then tiles x unrolling x prefetch x warps around it. Also run by the compile workers."""
    from runtime.kernels import int4_pool_triton as pk

    group, d, i = layout.group, layout.hidden, layout.intermediate
    out = {}
    for kind, default, half in zip(("gate_up", "down"), pk.default_plans(t, k, layout, sms=sms), (d // 2, i // 2)):
        tiles = ((4, 128), (8, 128), (16, 128), (4, 256), (8, 256), (16, 64)) if kind == "gate_up" \
            else ((1, 128), (2, 128), (4, 128), (2, 256), (8, 64))
        plans = [default, pk.KernelPlan(default.block_n, default.block_k, 4, 0, False)]
        plans += [pk.KernelPlan(bn, bk, 4, -1, True) for bn, bk in tiles]
        plans += [pk.KernelPlan(default.block_n, default.block_k, w, st, pf)
                  for w, st, pf in ((8, -1, True), (4, 0, True), (4, -1, False))]
        filled = []
        for p in plans:
            bk = max(p.block_k, group // 2)
            p = pk.KernelPlan(p.block_n, bk, p.warps, pk.unrolled_steps(half, bk) if p.steps < 0 else p.steps,
                              p.prefetch)
            if p not in filled:
                filled.append(p)
        out[kind] = filled
    return out


def _compile_worker(job: tuple[str, list[int], str, int, int]) -> int:
    """Compile a share (every `parts`-th plan from `part`) of one model's candidates for one kernel into
    Triton's on-disk cache: compiles are single-threaded, so several children compile in parallel and the
    timing process only loads them."""
    name, tokens, which, part, parts = job
    from runtime.experts.bench import SHAPES
    from runtime.experts.host_store import BlockLayout
    from runtime.experts.interface import ExpertSpec
    from runtime.kernels import int4_pool_triton as pk

    _, e, k, d, i, codec, group = SHAPES[name]
    layout = BlockLayout.build(codec, d, i, group=group)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    pool = torch.zeros((k, layout.nbytes), dtype=torch.uint8, device=dev)    # the bytes do not matter here
    n = 0
    for t in tokens:
        slots = torch.arange(k, device=dev).repeat(t, 1)
        x = torch.zeros(t, d, device=dev, dtype=torch.bfloat16)
        w = torch.zeros(t, k, device=dev, dtype=torch.bfloat16)
        cands = candidates(t, k, layout, sms=sms)
        gu0, dn0 = cands["gate_up"][0], cands["down"][0]
        for kind in ("gate_up", "down"):
            for plan in cands[kind][part::parts] if kind == which else ():
                plans = (plan, dn0) if kind == "gate_up" else (gu0, plan)
                try:
                    pk.pool_forward_triton(pool, layout, ExpertSpec(), x, slots, w, plans=plans)
                    n += 1
                except Exception:               # noqa: BLE001  (the timing process reports it)
                    pass
    torch.cuda.synchronize()
    return n


def _graph_us(fn, *, replays: int = REPLAYS) -> float:
    """µs per call of fn (which makes CALLS calls) recorded as one CUDA graph; the best of `replays` replays."""
    from benchmarks.profile_decode_step import best_replay_us

    return best_replay_us(fn, calls=CALLS, replays=replays)


def sweep(*, tokens: list[int], budget_s: float) -> list[dict]:
    from runtime.experts.bench import SHAPES
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec
    from runtime.kernels import int4_pool_triton as pk

    t_start = time.perf_counter()
    rows, skipped = [], 0
    ctx = multiprocessing.get_context("spawn")
    jobs = [(name, tokens, kind, part, COMPILE_PARTS) for name in ("qwen3-30b-a3b", "qwen3.6-35b-a3b")
            for kind in ("gate_up", "down") for part in range(COMPILE_PARTS)]
    with concurrent.futures.ProcessPoolExecutor(max_workers=COMPILE_WORKERS, mp_context=ctx) as workers:
        compiled = sum(workers.map(_compile_worker, jobs))
    print(f"compiled {compiled} launches in {time.perf_counter() - t_start:.1f} s ({COMPILE_WORKERS} processes)")
    spec = ExpertSpec()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for name in ("qwen3-30b-a3b", "qwen3.6-35b-a3b"):
        _, e, k, d, i, codec, group = SHAPES[name]
        store = HostExpertStore.synthetic(layers=1, num_experts=e, hidden=d, intermediate=i, codec=codec, group=group)
        layout = store.layout
        pool = torch.from_numpy(store.layer_buffer(0).copy()).to(dev)
        proj_bytes = sum(p.nbytes for n, p in layout.parts.items() if n.split("_")[0] in ("gate", "up", "down"))
        gen = torch.Generator().manual_seed(0)
        for t in tokens:
            # CALLS calls over a permutation of the pool: one token's K experts distinct, several tokens' random
            perm = torch.randperm(e, generator=gen)
            slot_sets = []
            for c in range(CALLS):
                if t == 1:
                    ids = perm[(c * k) % e:(c * k) % e + k].view(1, k)
                else:
                    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
                slot_sets.append(ids.to(dev))
            distinct = sum(len(set(s.flatten().tolist())) for s in slot_sets) / CALLS
            nbytes = distinct * proj_bytes
            x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
            w = torch.rand(t, k, device=dev, dtype=torch.bfloat16)
            cands = candidates(t, k, layout, sms=sms)
            gu0, dn0 = cands["gate_up"][0], cands["down"][0]

            def timed(plans) -> float:
                def calls():
                    for slots in slot_sets:
                        pk.pool_forward_triton(pool, layout, spec, x, slots, w, plans=plans)
                return _graph_us(calls)

            base_us = timed((gu0, dn0))
            results = {"gate_up": [], "down": []}
            for kind, default in (("gate_up", gu0), ("down", dn0)):
                for plan in cands[kind]:
                    if time.perf_counter() - t_start > budget_s:
                        skipped += 1
                        continue
                    plans = (plan, dn0) if kind == "gate_up" else (gu0, plan)
                    try:
                        us = timed(plans)
                    except Exception as exc:         # noqa: BLE001  (a plan that does not compile: say so, go on)
                        print(f"  {name} T={t} {kind} {plan}: failed: {type(exc).__name__}: {exc}")
                        continue
                    results[kind].append((us, plan))
                    rows.append(dict(model=name, codec=codec, tokens=t, kernel=kind, plan=dataclasses.asdict(plan),
                                     us=us, delta_us=us - base_us, gb_s=nbytes / us / 1e3,
                                     default=plan == default))
            best = tuple(min(results[kind], key=lambda r: r[0])[1] if results[kind] else d0
                         for kind, d0 in (("gate_up", gu0), ("down", dn0)))
            us = timed(best)
            rows.append(dict(model=name, codec=codec, tokens=t, kernel="both best", plan=[dataclasses.asdict(p) for p in best],
                             us=us, delta_us=us - base_us, gb_s=nbytes / us / 1e3, default=best == (gu0, dn0)))
            _print_table(name, codec, t, nbytes, base_us, [r for r in rows if r["model"] == name and r["tokens"] == t])
        del pool
        torch.cuda.empty_cache()
    if skipped:
        print(f"\nbudget of {budget_s:.0f} s reached: {skipped} plans not timed")
    print(f"sweep took {time.perf_counter() - t_start:.1f} s")
    return rows


def glue() -> list[dict]:
    """The fused decode glue against what it replaces, per layer at qwen3-30b-a3b's shape, in CUDA graphs of
    CALLS calls: the router (GEMM + route vs route_linear) and k/v into the cache (norm_rope + 2 index_copy_
    vs norm_rope_store) and decode attention (SDPA with the additive mask vs decode_attention)."""
    import torch.nn.functional as F

    from runtime.kernels import decode_attention_triton as da, norm_rope_triton as nr, router_triton as rk

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    x = torch.randn(1, 2048, device=dev, dtype=dt)
    gate = torch.randn(128, 2048, device=dev, dtype=dt) * 0.02
    rk.route_linear(x, gate, None, 8, renormalize=True)                      # its counter, before any capture
    pairs = {"router": (lambda: rk.route(F.linear(x, gate), 8, renormalize=True),
                        lambda: rk.route_linear(x, gate, None, 8, renormalize=True))}
    hkv, hd, cap = 4, 128, 1024
    qkv = torch.randn(1, 40 * hd, device=dev, dtype=dt)
    k, v = qkv[:, 32 * hd:36 * hd].view(1, hkv, hd), qkv[:, 36 * hd:].view(1, hkv, hd)
    keys, values = (torch.zeros(hkv, cap, hd, device=dev, dtype=dt) for _ in range(2))
    w = torch.ones(hd, device=dev, dtype=dt)
    cos, sin = (torch.rand(1, 1, hd // 2, device=dev, dtype=dt) for _ in range(2))
    at = torch.tensor([700], device=dev)

    def separate():
        rotated = nr.norm_rope(k, cos, sin, weight=w)
        keys.index_copy_(1, at, rotated.transpose(0, 1))
        values.index_copy_(1, at, v.transpose(0, 1))

    pairs["k/v into the cache"] = (separate, lambda: nr.norm_rope_store(k, v, cos, sin, keys, values, at, weight=w))
    q = torch.randn(1, 32, hd, device=dev, dtype=dt)
    mask = torch.zeros(1, 32, 1, cap, device=dev, dtype=dt)
    mask[..., 701:] = float("-inf")
    da.decode_attention(q, keys, values, at, scale=hd ** -0.5, bucket=cap)   # its counter, before any capture
    pairs["attention (1K, pos 700)"] = (
        lambda: F.scaled_dot_product_attention(q.view(1, 32, 1, hd), keys[None], values[None], attn_mask=mask,
                                               scale=hd ** -0.5, enable_gqa=True),
        lambda: da.decode_attention(q, keys, values, at, scale=hd ** -0.5, bucket=cap))
    print("\n== decode glue at qwen3-30b-a3b's shape, per layer call (recorded in a graph)")
    for name, (before, after) in pairs.items():
        us = [_graph_us(lambda fn=fn: [fn() for _ in range(CALLS)]) for fn in (before, after)]
        print(f"  {name:20s} separate {us[0]:7.2f} us   fused {us[1]:7.2f} us")
        rows.append(dict(kernel=name, separate_us=us[0], fused_us=us[1]))
    return rows


def _fmt(plan) -> str:
    if isinstance(plan, list):
        return " + ".join(_fmt(p) for p in plan)
    steps = f"unroll {plan['steps']}" if plan["steps"] else "loop"
    return (f"n{plan['block_n']} k{plan['block_k']} w{plan['warps']} {steps}"
            f"{' pf' if plan['prefetch'] else ''}")


def _print_table(name, codec, t, nbytes, base_us, rows) -> None:
    print(f"\n== {name} ({codec}) T={t}: {nbytes / 1e6:.1f} MB of experts per call; default pair {base_us:.1f} us "
          f"({nbytes / base_us / 1e3:.0f} GB/s)")
    print(f"  {'kernel':9s} {'plan':36s} {'us (pair)':>10s} {'vs default':>10s} {'GB/s':>7s}")
    for r in rows:
        mark = "  <- default" if r["default"] else ""
        print(f"  {r['kernel']:9s} {_fmt(r['plan']):36s} {r['us']:10.2f} {r['delta_us']:+10.2f} {r['gb_s']:7.0f}{mark}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--budget-s", type=float, default=65.0,
                   help="stop timing new pool plans after this many seconds (the glue tables take ~10 s more)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("sweep_pool_kernels: needs a CUDA GPU (the GPU machine)")
        return 2
    rows = sweep(tokens=a.tokens, budget_s=a.budget_s)
    try:
        glue_rows = glue()
    except Exception as exc:                 # noqa: BLE001  (a diagnostic: the pool rows still count)
        print(f"  glue timing failed: {type(exc).__name__}: {exc}")
        glue_rows = []
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "glue": glue_rows},
                                    indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
