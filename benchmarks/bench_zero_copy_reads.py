"""How fast a decode call's missed experts come over PCIe, by three ways, on the GPU machine.

    python benchmarks/bench_zero_copy_reads.py [--out zc.json] [--models qwen3-30b-a3b qwen3.6-35b-a3b]

A layer call of T tokens x K experts where `m` of the K are misses living in page-locked, mapped host memory
(the hybrid tier's zero-copy store; runtime/experts/host_store.py). Each way is recorded in a CUDA graph of
CALLS calls over different experts (several layers of the store: no call finds its blocks in the GPU's L2):

  in place   the pool kernels read the misses straight from host memory (hybrid.py's zero-copy decode today)
  gather     runtime/kernels/gather_triton.py copies the missed blocks into VRAM scratch (one launch), then the
             pool kernels read them there
  gather alone  the same copy without the compute, at several chunk sizes: the rate the copy kernel reaches
  dma        one cudaMemcpyAsync per missed block (copy engines; needs the host to know the misses, so not a
             decode-step option: the link's practical limit), then the pool kernels over the scratch

Prints us per call and GB/s of distinct missed expert bytes (an expert several tokens share counts once), per way
and per number of misses (a CPU share leaves the GPU fewer). Chunk sizes of the gather kernel are swept too.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CALLS = 12
REPLAYS = 15
LAYERS = 6              # store layers the calls rotate over (6 x ~340 MB for the int4 shape)


def _graph_us(fn) -> float:
    from benchmarks.profile_decode_step import best_replay_us

    return best_replay_us(fn, calls=CALLS, replays=REPLAYS)


def run(models: list[str], tokens: list[int]) -> list[dict]:
    from runtime.experts.bench import SHAPES
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec
    from runtime.kernels import gather_triton as gk
    from runtime.kernels import int4_pool_triton as pk

    dev = torch.device("cuda")
    spec = ExpertSpec()
    rows = []
    for name in models:
        _, e, k, d, i, codec, group = SHAPES[name]
        t0 = time.perf_counter()
        store = HostExpertStore.synthetic(layers=LAYERS, num_experts=e, hidden=d, intermediate=i, codec=codec,
                                          group=group).pinned_copy()
        layout, nb = store.layout, store.block_nbytes
        hosts = [torch.from_numpy(store.layer_buffer(layer)) for layer in store.layers]
        print(f"\n== {name} ({codec}): block {nb / 1e6:.2f} MB, store {store.nbytes / 1e9:.2f} GB pinned "
              f"({time.perf_counter() - t0:.1f} s)")
        print(f"  {'way':<22} {'T':>2} {'misses':>6} {'us/call':>9} {'GB/s':>7}")
        gen = torch.Generator().manual_seed(0)
        for t in tokens:
            scratch = torch.empty((t * k, nb), dtype=torch.uint8, device=dev)
            x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
            w = torch.rand(t, k, device=dev, dtype=torch.bfloat16)
            for m in sorted({t * k, t * k * 3 // 4, t * k // 2, t * k // 4}, reverse=True):
                calls = []                                  # (host layer, rows [T, K] with m misses, as a list, scratch slots)
                for c in range(CALLS):
                    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
                    miss = torch.zeros(t * k, dtype=torch.bool)
                    miss[torch.randperm(t * k, generator=gen)[:m]] = True
                    r = torch.where(miss.view(t, k), ids, -1)
                    a = torch.arange(t * k).view(t, k)
                    calls.append((hosts[c % len(hosts)], r.to(dev), r.flatten().tolist(),
                                  torch.where(r >= 0, a, -1).to(dev)))
                # bytes of distinct missed blocks per call: the gather copies an expert shared by tokens once
                nbytes = sum(len({row for row in flat if row >= 0}) for _, _, flat, _ in calls) / CALLS * nb

                def in_place():
                    for host, r, _, _ in calls:
                        pk.pool_forward_triton(host, layout, spec, x, r, w)

                def gather(chunk=gk.CHUNK_BYTES, compute=True):
                    def fn():
                        for host, r, _, _ in calls:
                            s = gk.gather_blocks(host, r, scratch, chunk_bytes=chunk)
                            if compute:
                                pk.pool_forward_triton(scratch, layout, spec, x, s, w)
                    return fn

                def dma():
                    for host, _, flat, s in calls:
                        for a, row in enumerate(flat):
                            if row >= 0:
                                scratch[a].copy_(host[row], non_blocking=True)
                        pk.pool_forward_triton(scratch, layout, spec, x, s, w)

                ways = [("in place", in_place), ("gather", gather()), ("dma", dma)]
                ways += [(f"gather alone {c >> 10}K", gather(c, False)) for c in (8 << 10, 16 << 10, 32 << 10, 64 << 10)]
                for label, fn in ways:
                    try:
                        us = _graph_us(fn)
                    except Exception as exc:        # noqa: BLE001  (say so, go on)
                        print(f"  {label:<22} {t:>2} {m:>6} failed: {type(exc).__name__}: {exc}")
                        continue
                    gbs = nbytes / us / 1e3
                    print(f"  {label:<22} {t:>2} {m:>6} {us:>9.1f} {gbs:>7.1f}")
                    rows.append(dict(model=name, way=label, tokens=t, misses=m, us=us, gb_s=gbs))
            del scratch
        del hosts, store
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "qwen3.6-35b-a3b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    rows = run(args.models, args.tokens)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
