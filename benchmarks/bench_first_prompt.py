"""A machine's first prompt to a linear-attention model, with and without the load's kernel warm-up (issue 10).

A fresh GPU host's first 16K prefill of qwen3.6 took 58 s against 0.3 s once Triton had compiled (and fla-core
autotuned) its kernels (s28b; docs/benchmarks.md, twenty-eighth pass); since session 27 `Engine.load` warms them on
a GPU (`_warm_up_gpu_kernels`). This times what a user sees, in three fresh processes (two with `--skip-cold`), each
building the qwen3.6 shape cut to `--layers` layers (3 Gated DeltaNet + 1 attention per 4; experts that cost
nothing: the experts' path compiles little, s27c) with random weights:

1. "cold": an empty Triton cache, no warm-up - the first prompts as before;
2. "cold + warm-up": another empty cache - the warm-up timed, then the same prompts;
3. "warm cache + warm-up": the second cache again - what the warm-up costs every later load.

Each row: the warm-up's seconds, then the seconds of prompts of `--prompts` tokens in turn (a whole number of 64-token
chunks and an odd length both, since Triton compiles a variant for each). Prints a table, writes JSON to `--out`.

    python benchmarks/bench_first_prompt.py --out /tmp/out        # GPU machine (fla-core on PYTHONPATH), ~3 min
    python benchmarks/bench_first_prompt.py --layers 4 --prompts 70 65 --device cpu   # dev VM: the script's path
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args) -> dict:
    import torch

    from runtime.experts.bench import CONFIGS
    from runtime.experts.bench_model import prefill, random_model
    from runtime.models.gated_deltanet import warm_up_prefill_kernels

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = dict(CONFIGS["qwen3.6-35b-a3b"], num_hidden_layers=args.layers, max_position_embeddings=65536)
    with torch.inference_mode():
        model = random_model(cfg, device=device, dtype=dtype)
        model.attach_state_pool(2, device=device, dtype=dtype)
        warm_s, warmed = 0.0, 0
        if args.warm:
            t0 = time.perf_counter()
            warmed = warm_up_prefill_kernels(model, fla_only=device.type == "cuda")
            if device.type == "cuda":
                torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
        prompts = []
        for n in args.prompts:
            cache = model.new_cache(device=device, dtype=dtype)
            prompts.append(prefill(model, cache, n, chunk=args.chunk, device=device))
            cache.release()
    return {"warm_s": warm_s, "layers_warmed": warmed, "prompt_s": prompts}


def main() -> None:
    from runtime.experts.planner import PREFILL_CHUNK_TOKENS   # torch-free

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of the qwen3.6 shape (a multiple of 4)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[16384, 1000, 777], help="prompt lengths, in turn")
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK_TOKENS, help="prefill chunk (the engine's on a GPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-cold", action="store_true", help="only the rows with the warm-up (what a load does)")
    ap.add_argument("--out", help="folder for first_prompt.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    caches = [tempfile.mkdtemp(prefix="triton-cold-"), tempfile.mkdtemp(prefix="triton-warm-")]
    for label, cache_dir, warm in [("cold", caches[0], False), ("cold + warm-up", caches[1], True),
                                   ("warm cache + warm-up", caches[1], True)][int(args.skip_cold):]:
        cmd = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--chunk", str(args.chunk),
               "--device", args.device, "--prompts", *map(str, args.prompts)] + (["--warm"] if warm else [])
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}     # (fla-core's autotune results are kept there too)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"{label}: the child failed\n{done.stderr[-3000:]}")
        row = {"run": label, "process_s": time.perf_counter() - t0, **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(row)
    head = " | ".join(f"prompt {n:,} (s)" for n in args.prompts)
    print(f"| run | warm-up (s) | {head} | warm-up + first prompt (s) |")
    print("|---|---|" + "---|" * len(args.prompts) + "---|")
    for r in rows:
        cells = " | ".join(f"{s:.3f}" for s in r["prompt_s"])
        print(f"| {r['run']} | {r['warm_s']:.3f} ({r['layers_warmed']} layer kinds) | {cells} | "
              f"{r['warm_s'] + r['prompt_s'][0]:.3f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "first_prompt.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
