"""Recompute a package's checksums: `freetoken verify PATH`.

A package counts as good only when its manifest says it is complete (FTWPackage.open) and every
dense tensor and every expert layer hashes to the checksum the converter recorded.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from runtime.ftw.reader import FTWPackage
from runtime.ftw.writer import block_digest, combine_digests

READ_CHUNK = 16 << 20
BATCH_BLOCKS = 8


@dataclass
class VerifyReport:
    path: Path
    checked: int = 0                                  # tensors / layers hashed
    nbytes: int = 0
    bad: list[str] = field(default_factory=list)      # "dense <name>" / "experts layer <L>"

    @property
    def ok(self) -> bool:
        return not self.bad


def _hash_range(path: Path, offset: int, nbytes: int, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        left = nbytes
        while left:
            chunk = fh.read(min(READ_CHUNK, left))
            if not chunk:
                break                                 # truncated: the digest will not match
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def verify(path: str | Path, *, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Hash every tensor and expert layer of the package at `path` (raises FTWError if it is not one)."""
    pkg = FTWPackage.open(path)
    m, algo = pkg.manifest, pkg.checksum_algorithm
    report = VerifyReport(pkg.path)
    dense_file = pkg.path / m["dense"]["file"]
    experts_file = pkg.path / m["experts"]["file"]
    total = int(m["dense"]["nbytes"]) + int(m["experts"]["nbytes"])
    for name, meta in m["dense"]["tensors"].items():
        digest = _hash_range(dense_file, int(meta["offset"]), int(meta["nbytes"]), algo)
        report.checked += 1
        report.nbytes += int(meta["nbytes"])
        if digest != meta.get("checksum"):
            report.bad.append(f"dense {name}")
        if progress:
            progress(report.nbytes, total)
    ex = m["experts"]
    block = int(ex["block_nbytes"])
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool, \
            open(experts_file, "rb", buffering=0) as fh:
        for layer, offset in ex["layer_offsets"].items():
            # A layer's checksum is the hash of its blocks' hashes (writer.combine_digests).
            n, parts = int(ex["num_experts"]), []
            for first in range(0, n, BATCH_BLOCKS):       # bounded memory: a few blocks at a time
                batch = [_read_at(fh, int(offset) + e * block, block) for e in range(first, min(first + BATCH_BLOCKS, n))]
                parts += pool.map(block_digest, batch)
            digest = combine_digests(parts)
            report.checked += 1
            report.nbytes += block * n
            if digest != ex.get("layer_checksums", {}).get(layer):
                report.bad.append(f"experts layer {layer}")
            if progress:
                progress(report.nbytes, total)
    return report


def _read_at(fh, offset: int, nbytes: int) -> bytes:
    fh.seek(offset)
    return fh.read(nbytes)        # short if truncated: the digest will not match
