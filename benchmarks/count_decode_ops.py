"""What one decode step of B sequences launches, B = 1 vs B = 4, on the tiny test checkpoints (CPU, no timing).

    python benchmarks/count_decode_ops.py [--families qwen3_moe qwen3_next] [--batches 1 4]

For each family and B: one decode step after prompts of unequal lengths, through the eager ragged forward (the
engine's path for mixed steps) and through the static path runtime/decode_graph.py records (run eagerly here).
Counts, from torch.profiler: top-level aten ops that are not views (about the kernels a GPU would launch), and
device uploads (`torch.tensor(..., device=)`; on a GPU each one waits for the stream: a host sync). What grows
with B in the eager step is what makes a batched step cost more than B = 1 (docs/engine.md, "Batched decode").
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VIEWS = {"slice", "transpose", "unsqueeze", "select", "view", "reshape", "alias", "as_strided", "expand", "split",
         "split_with_sizes", "chunk", "t", "permute", "squeeze", "detach", "detach_", "lift_fresh", "empty",
         "empty_like", "narrow", "_reshape_alias", "unbind", "contiguous", "result_type", "size", "stride"}


class UploadCounter:
    """Counts torch.tensor(..., device=...) calls while active (each is a host-to-device copy)."""

    def __init__(self):
        self.n, self._real = 0, torch.tensor

    def __enter__(self):
        def counting(*args, **kwargs):
            if kwargs.get("device") is not None:
                self.n += 1
            return self._real(*args, **kwargs)
        torch.tensor = counting
        return self

    def __exit__(self, *exc):
        torch.tensor = self._real


def count(step) -> tuple[collections.Counter, int]:
    from torch.profiler import ProfilerActivity, profile

    with UploadCounter() as uploads, profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    top = collections.Counter(e.name[6:] for e in prof.events() if e.name.startswith("aten::") and (
        e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return collections.Counter({k: v for k, v in top.items() if k not in VIEWS}), uploads.n


def main() -> None:
    from runtime.decode_graph import DecodeGraphs
    from runtime.engine import Engine
    from runtime.ftw.converter import convert
    from runtime.models.base import Batch
    from tests.fixtures.checkpoints import build_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["qwen3_moe", "qwen3_next"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for family in args.families:
            package = convert(build_checkpoint(family, Path(tmp) / family, seed=0), Path(tmp) / f"{family}-ftw",
                              codec="f32")
            eng = Engine.load(package, device="cpu", dtype=torch.float32, cuda_graphs=False,
                              max_batch=max(args.batches))
            model = eng.model
            graphs = DecodeGraphs(model, device="cpu", capture=False, max_batch=max(args.batches))
            print(f"{family}: {len(model.layer_kinds)} layers ({', '.join(sorted(set(model.layer_kinds)))})")
            for b in args.batches:
                caches = [model.new_cache(device="cpu", dtype=torch.float32) for _ in range(b)]
                for i, cache in enumerate(caches):
                    model(Batch.build([(list(range(5, 8 + i)), cache)], device="cpu"))
                eager = lambda: model(Batch.build([([7], c) for c in caches], device="cpu"))  # noqa: E731
                static = lambda: graphs.decode_batch([7] * b, caches)                          # noqa: E731
                for name, step in (("eager ragged", eager), ("static", static)):
                    step()                                                # warm: buffers grown, buckets made
                    ops, uploads = count(step)
                    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
                    print(f"  B={b} {name:<12} ops {sum(ops.values()):4d}  uploads {uploads}   ({top})", flush=True)
                for cache in caches:
                    cache.release()


if __name__ == "__main__":
    main()
