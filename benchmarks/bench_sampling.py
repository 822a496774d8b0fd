"""Time one sampling step (runtime.sampling.sample_batch) at a real vocabulary size, one torch thread.

    python benchmarks/bench_sampling.py [--vocab 151936] [--steps 30]

Prints a Markdown table: batch, logits shape, parameters, milliseconds per step (median). Two logit
shapes: "peaked" (a language model's: few likely tokens, long tail; randn x 4) and "flat" (randn, the
worst case for top-p, whose nucleus is then thousands of tokens wide).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.sampling import RequestSampler, SamplingParams, sample_batch

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.7": SamplingParams(temperature=0.7, seed=1),
    "Qwen defaults (T 0.7, top-k 20, top-p 0.8)": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1),
    "top-p 0.95 alone": SamplingParams(temperature=0.7, top_p=0.95, seed=1),
    "Qwen defaults + presence 1.5, repetition 1.05": SamplingParams(
        temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5, repetition_penalty=1.05, seed=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("| batch | logits | parameters | ms / step |\n|---|---|---|---|")
    for batch in (1, 8):
        for shape, scale in (("peaked", 4.0), ("flat", 1.0)):
            logits = torch.randn(batch, args.vocab, generator=gen) * scale
            for name, params in CASES.items():
                if shape == "flat" and params.greedy:
                    continue
                samplers = [RequestSampler(params, prompt_ids=list(range(2000))) for _ in range(batch)]
                sample_batch(logits, samplers)
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    sample_batch(logits, samplers)
                    times.append(time.perf_counter() - t0)
                print(f"| {batch} | {shape} | {name} | {1000 * statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
