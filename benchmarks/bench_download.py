"""Download manager throughput on localhost: how fast our streaming + hashing path goes when the network is not
the limit (a real link is slower; this says whether the manager itself could ever be the bottleneck).

    python benchmarks/bench_download.py [--mib 512] [--files 2] [--concurrency 2]

Serves `--files` random LFS files of `--mib` MiB each from tests/hub_server.py (the hub-compatible test
server) and downloads them with app.downloads.DownloadManager through the real huggingface_hub client:
GET with Range support, sha256 as bytes arrive, fsync, rename. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of each file")
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = False
    from app.downloads import DONE, DownloadManager
    from tests.hub_server import HubServer, RepoFile

    files = {"config.json": RepoFile("config.json", b'{"model_type": "qwen3_moe"}', lfs=False)}
    for i in range(args.files):
        name = f"model-{i:05d}.safetensors"
        n = args.mib * 1024 ** 2
        header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
        files[name] = RepoFile(name, len(header).to_bytes(8, "little") + header + os.urandom(n), lfs=True)
    total = sum(len(f.data) for f in files.values())
    with HubServer() as hub, tempfile.TemporaryDirectory() as tmp:
        hub.add_repo("bench/model", files)
        models = Path(tmp) / "models"
        mgr = DownloadManager(models, Path(tmp) / "downloads.json", endpoint=hub.url, concurrency=args.concurrency)
        t0 = time.perf_counter()
        job = mgr.add("bench/model")
        mgr.start()
        done = mgr.wait(job.id)
        elapsed = time.perf_counter() - t0
        mgr.shutdown()
        assert done.state == DONE, done.error
    print(json.dumps({"bytes": total, "files": args.files, "concurrency": args.concurrency,
                      "seconds": round(elapsed, 2), "MiB_per_s": round(total / elapsed / 1024 ** 2, 1),
                      "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
