"""The HTTP server's overhead over the engine, and the concurrency it holds.

    python benchmarks/bench_server.py [--model PATH] [--tokens 128] [--streams 1,4,16,32] [--threads 1]

For each concurrency C it runs C greedy generations of --tokens tokens from the same chat prompt
  - directly: Engine.add_request x C, then step() until done (the engine alone), and
  - through HTTP: C concurrent streaming /v1/completions requests with the same prompt tokens to
    `freetoken serve` in its own process (the real server: HTTP, SSE, JSON, the service thread).
    Completions, not chat: a chat answer goes through the family's output parser, which holds text
    back while it might be a tool call (the random demo model writes `<tool_call>` tokens), and that
    is the model's content, not the server's overhead;
and reports tokens/s summed over the streams (all generated tokens over the wall time from the first
request to the last token), the inter-token latency p50/p99 (time between consecutive text arrivals
within a stream, as a client sees them), and errors. Without --model it uses the
built-in demo model (created in a temporary FreeToken home). Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [{"role": "user", "content": "Tell me a long story about a fox who runs large models on a small PC."}]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def prompt_ids(model: Path) -> list[int]:
    """The chat prompt rendered with the model's template: the same tokens on both paths."""
    from runtime.ftw.reader import FTWPackage
    from runtime.text.chat_template import ChatTemplate
    from runtime.text.tokenizer import Tokenizer

    folder = FTWPackage.open(model).tokenizer_dir
    return Tokenizer.from_dir(folder).encode(ChatTemplate.from_dir(folder).render(PROMPT, add_generation_prompt=True))


def direct(model: Path, streams: int, tokens: int, device: str, ids: list[int], max_batch: int) -> dict:
    from runtime.engine import Engine, SamplingParams

    engine = Engine.load(model, device=device, max_batch=max_batch, context_length=2048)   # as the server has
    engine.generate(ids, SamplingParams(temperature=0, max_tokens=8))            # warm-up
    stamps: dict[str, list[float]] = {}
    for i in range(streams):
        rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=tokens, seed=i))
        stamps[rid] = []
    t0 = time.perf_counter()
    generated = 0
    while engine.has_work():
        for ev in engine.step():
            generated += ev.token_id is not None
            if ev.text:          # what a client would see: events that carry text
                stamps[ev.request_id].append(time.perf_counter())
    wall = time.perf_counter() - t0
    return summarize(list(stamps.values()), generated, wall, errors=0)


def summarize(stamps: list[list[float]], generated: int, wall: float, errors: int) -> dict:
    """tokens/s: every generated token over the wall time from the first request to the last token
    (prefill included, the same for both paths); ITL: gaps between text arrivals within a stream."""
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    return {"tokens": generated, "wall_s": wall, "tps": generated / wall if wall > 0 else float("nan"),
            "itl_p50_ms": 1000 * percentile(gaps, 0.5), "itl_p99_ms": 1000 * percentile(gaps, 0.99),
            "errors": errors}


async def http_run(url: str, streams: int, tokens: int, prompt_ids: list[int]) -> dict:
    import httpx

    async def one(client, i):
        body = {"model": "bench", "prompt": prompt_ids, "max_tokens": tokens, "temperature": 0, "seed": i,
                "stream": True, "stream_options": {"include_usage": True}}
        times, usage = [], None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return times, f"HTTP {response.status_code}: {response.text[:200]}", 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
        if not usage or usage["completion_tokens"] != tokens:
            return times, f"usage {usage} (expected {tokens} tokens)", 0
        return times, None, usage["completion_tokens"]

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, -1)                                                     # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, i) for i in range(streams)))
        wall = time.perf_counter() - t0
    errors = [e for _, e, _ in results if e]
    for e in errors[:3]:
        print("  error:", e, file=sys.stderr)
    return summarize([t for t, _, _ in results], sum(n for _, _, n in results), wall, errors=len(errors))


def start_server(model: Path, port: int, env: dict, device: str, max_batch: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())", "serve", str(model),
           "--port", str(port), "--device", device, "--context", "2048", "--max-batch", str(max_batch),
           "--max-queue", "256"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("Press Ctrl+C"):
            return proc
    raise RuntimeError("the server did not start: " + proc.stderr.read()[-2000:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="FTW package folder (default: the demo model)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,4,16,32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (engine and server alike)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    home = Path(tempfile.mkdtemp(prefix="freetoken-bench-"))
    env = {**os.environ, "FREETOKEN_HOME": str(home), "OMP_NUM_THREADS": str(args.threads)}
    os.environ["FREETOKEN_HOME"] = str(home)
    model = args.model
    if model is None:
        from app.demo import ensure_demo_model

        model = ensure_demo_model(home / "models").path
    from tests.api_fixtures import free_port

    port = free_port()
    server = start_server(model, port, env, args.device, args.max_batch)
    rows = []
    try:
        for streams in [int(s) for s in args.streams.split(",")]:
            ids = prompt_ids(model)
            d = direct(model, streams, args.tokens, args.device, ids, args.max_batch)
            h = asyncio.run(http_run(f"http://127.0.0.1:{port}", streams, args.tokens, ids))
            rows.append((streams, d, h))
            print(f"C={streams}: direct {d['tps']:.0f} tok/s, http {h['tps']:.0f} tok/s, "
                  f"errors {h['errors']}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(home, ignore_errors=True)      # the temporary home (and its demo model)
    print(f"model: {model.name}; {args.tokens} tokens per stream, greedy; torch threads {args.threads}; "
          f"device {args.device}\n")
    print("| streams | direct tok/s | HTTP tok/s | HTTP/direct | direct ITL p50 / p99 ms | "
          "HTTP ITL p50 / p99 ms | HTTP errors |")
    print("|---|---|---|---|---|---|---|")
    for streams, d, h in rows:
        print(f"| {streams} | {d['tps']:.0f} | {h['tps']:.0f} | {h['tps'] / d['tps']:.2f} | "
              f"{d['itl_p50_ms']:.2f} / {d['itl_p99_ms']:.2f} | {h['itl_p50_ms']:.2f} / {h['itl_p99_ms']:.2f} | "
              f"{h['errors']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
