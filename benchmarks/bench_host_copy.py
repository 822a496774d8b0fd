"""How fast a GPU cache reaches host memory, by the kind of host memory it lands in.

The prefix cache copies a finished (or, for linear-attention models, a snapshotted) sequence's cache to host RAM
inside an engine step; session 31 measured those copies at 0.76 s for a 16K-token qwen3-30b prompt (1.5 GB,
~2 GB/s) - the rate of page-locking fresh memory, not of the link. This prints, for the same tensors, the time to
land them in: fresh pinned memory (torch's default host allocator), fresh pinned memory through
cudaHostRegister with several threads (PYTORCH's pinned_use_cuda_host_register), pinned memory freed before and
reused, and ordinary (pageable) memory - and the time to bring each back.

    python3 benchmarks/bench_host_copy.py --mib 1536 --tensors 96
"""
import argparse
import json
import time

import torch


def empty_host_cache() -> None:
    """Give the host allocator's cached pinned blocks back, so that a "fresh" row allocates anew."""
    torch.cuda.synchronize()
    torch._C._host_emptyCache()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1536)
    ap.add_argument("--tensors", type=int, default=96)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out")
    a = ap.parse_args()
    per = a.mib * 2**20 // a.tensors // 2
    src = [torch.randn(per, device="cuda", dtype=torch.bfloat16) for _ in range(a.tensors)]
    gb = sum(t.numel() * 2 for t in src) / 1e9
    rows = []

    def land(pin: bool):
        out = []
        for t in src:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            h.copy_(t)
            out.append(h)
        return out

    def back(hosts):
        for h, t in zip(hosts, src):
            t.copy_(h, non_blocking=True)

    def row(name, fn):
        holder = {}
        s = timed(lambda: holder.setdefault("h", fn()))
        b = timed(lambda: back(holder["h"]))
        rows.append({"kind": name, "GB": round(gb, 3), "to_host_s": round(s, 4), "to_host_GBps": round(gb / s, 2),
                     "back_s": round(b, 4), "back_GBps": round(gb / b, 2)})
        return holder["h"]

    land(True)  # the CUDA context and host allocator's first use, not counted
    empty_host_cache()
    row("pageable, fresh", lambda: land(False))
    kept = row("pinned, fresh (cudaHostAlloc)", lambda: land(True))
    del kept
    row("pinned, reused after free", lambda: land(True))
    empty_host_cache()
    torch.cuda.memory._set_allocator_settings(
        f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{a.threads}")
    keep = [row(f"pinned, fresh (host register, {a.threads} threads)", lambda: land(True)) for _ in range(2)]
    print("| host memory | GB | to host s | GB/s | back s | GB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['GB']} | {r['to_host_s']} | {r['to_host_GBps']} | {r['back_s']} | {r['back_GBps']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    del keep


if __name__ == "__main__":
    main()
