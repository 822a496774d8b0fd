"""Writing a package: the expert block layout, positioned writes, the resume journal, the atomic finish.

Everything is written into `<out>.partial/` at offsets fixed before the first byte is written,
so a resumed conversion rewrites exactly the bytes an uninterrupted one would. After each unit
(the global tensors, then one decoder layer at a time) the data files are fsynced and one line is
appended to `journal.jsonl`; a resume skips the units the journal lists. `manifest.json` is
written last, atomically, and the folder is renamed to `<out>`: a folder with a manifest and
without `.partial` in its name is a complete package, and nothing else is.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.ftw.codecs import FP4_FORMATS, int4_num_groups
from runtime.ftw.errors import FTWError

FORMAT_VERSION = 1
BLOCK_ALIGN = 4096          # every (layer, expert) block starts and ends on a 4 KiB boundary
PART_ALIGN = 64             # parts inside a block, and dense tensors, start on a cache line
DENSE_FILE = "dense.bin"
EXPERTS_FILE = "experts.bin"
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
PARTIAL_SUFFIX = ".partial"
CHECKSUM = "sha256"         # ~1.7 GiB/s with SHA-NI here, twice blake2b (docs/ftw-format.md)
EXIT_AFTER_UNITS_ENV = "FREETOKEN_FTW_EXIT_AFTER_UNITS"   # test hook: die hard after N committed units

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Part:
    """One packed tensor inside an expert block."""
    name: str                  # "gate", "gate_scales", "gate_mins", "gate_global", "gate_bias", ...
    dtype: str                 # key of TORCH_DTYPES
    shape: tuple[int, ...]
    offset: int                # from the start of the block
    nbytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes}


def expert_block_parts(*, codec: str, hidden: int, intermediate: int, group_size: int = 64,
                       fp4_format: str = "", has_bias: bool = False) -> tuple[list[Part], int]:
    """The parts of one (layer, expert) block in order, and the block size (a multiple of 4096).

    Order: gate, up, down, each followed by its scales (and mins / global scale), then biases.
    """
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    for proj, (o, n) in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                         ("down", (hidden, intermediate))):
        if codec == "f32":
            specs.append((proj, "float32", (o, n)))
        elif codec == "bf16":
            specs.append((proj, "bfloat16", (o, n)))
        elif codec == "int4":
            g = int4_num_groups(n, group_size)
            specs += [(proj, "uint8", (o, n // 2)), (f"{proj}_scales", "float16", (o, g)),
                      (f"{proj}_mins", "float16", (o, g))]
        elif codec == "fp4":
            block, scale_format, has_global = FP4_FORMATS[fp4_format]
            specs += [(proj, "uint8", (o, n // 2)),
                      (f"{proj}_scales", "uint8" if scale_format == "e8m0" else "float8_e4m3fn", (o, n // block))]
            if has_global:
                specs.append((f"{proj}_global", "float32", (1,)))
        else:
            raise FTWError(f"unknown codec {codec!r}")
    if has_bias:
        specs += [("gate_bias", "float32", (intermediate,)), ("up_bias", "float32", (intermediate,)),
                  ("down_bias", "float32", (hidden,))]
    parts, offset = [], 0
    for name, dtype, shape in specs:
        nbytes = TORCH_DTYPES[dtype].itemsize
        for s in shape:
            nbytes *= s
        parts.append(Part(name, dtype, shape, offset, nbytes))
        offset = align(offset + nbytes, PART_ALIGN)
    return parts, align(offset, BLOCK_ALIGN)


def _os_error(e: OSError, file: Path, tensor: str) -> FTWError:
    if e.errno in (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", -1)):
        why = "the disk is full (or the file size limit was reached); free space and run the same command again to resume"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "the destination is read-only; pick another --out folder"
    else:
        why = e.strerror or str(e)
    return FTWError(f"{file}: cannot write tensor {tensor}: {why}")


class PackageWriter:
    """Positioned writes into `<out>.partial/`, a per-unit journal, and the atomic finish."""

    def __init__(self, out: Path, *, fingerprint: str, file_sizes: dict[str, int]):
        self.out = out
        self.partial = out.with_name(out.name + PARTIAL_SUFFIX)
        self.fingerprint = fingerprint
        self.file_sizes = file_sizes
        self.done: dict[str, dict] = {}
        self.resumed = False
        self.complete = False             # a previous run wrote everything; only the final rename is missing
        self._units_committed = 0
        self._exit_after = int(os.environ.get(EXIT_AFTER_UNITS_ENV, "0") or 0)
        try:
            self.partial.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(e, self.partial, "(package folder)") from e
        self._load_journal()
        self._files = {}
        for name in file_sizes:
            path = self.partial / name
            try:
                self._files[name] = open(path, "r+b" if path.exists() else "w+b", buffering=0)
            except OSError as e:
                raise _os_error(e, path, "(opening)") from e

    def _load_journal(self) -> None:
        manifest = self.partial / MANIFEST
        if manifest.exists():
            # Killed after the manifest was written but before the rename: only the rename is left.
            try:
                self.complete = json.loads(manifest.read_text(encoding="utf-8")).get(
                    "conversion_fingerprint") == self.fingerprint
            except ValueError:
                self.complete = False
            if self.complete:
                return
        journal = self.partial / JOURNAL
        lines = journal.read_text(encoding="utf-8").splitlines() if journal.exists() else []
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                break            # a torn last line: that unit was not committed
        if records and records[0].get("fingerprint") == self.fingerprint:
            self.done = {r["unit"]: r for r in records[1:] if "unit" in r}
            self.resumed = bool(self.done)
            return
        # Nothing usable (first run, or a partial from other options/sources): start clean.
        for child in self.partial.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        self._append_journal({"fingerprint": self.fingerprint})

    def _append_journal(self, record: dict) -> None:
        path = self.partial / JOURNAL
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as e:
            raise _os_error(e, path, "(journal)") from e

    def write(self, file: str, offset: int, data, *, tensor: str) -> None:
        fh = self._files[file]
        view = memoryview(data).cast("B")
        try:
            fh.seek(offset)
            done = 0
            while done < len(view):
                n = fh.write(view[done:])
                if not n:
                    raise OSError(errno.ENOSPC, "no space left on device")
                done += n
        except OSError as e:
            raise _os_error(e, self.partial / file, tensor) from e

    def commit_unit(self, unit: str, record: dict) -> None:
        """Make the unit's bytes durable, then record it as done."""
        for name, fh in self._files.items():
            try:
                os.fsync(fh.fileno())
            except OSError as e:
                raise _os_error(e, self.partial / name, f"(unit {unit})") from e
        self._append_journal({"unit": unit, **record})
        self.done[unit] = record
        self._units_committed += 1
        if self._exit_after and self._units_committed >= self._exit_after:
            os._exit(75)      # test hook: simulate a kill right after a committed unit

    def finish(self, manifest: dict | None, *, overwrite: bool) -> Path:
        """Write the manifest (None: already there, see `complete`) and move the package into place."""
        if manifest is not None:
            self._write_manifest(manifest)
        for fh in self._files.values():
            fh.close()
        old = None
        if self.out.exists():
            if not overwrite:
                raise FTWError(f"{self.out} already exists; remove it or pass --force to replace it")
            old = self.out.with_name(self.out.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(self.out, old)
        os.replace(self.partial, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def _write_manifest(self, manifest: dict) -> None:
        manifest = {**manifest, "conversion_fingerprint": self.fingerprint}
        for name, fh in self._files.items():
            try:
                fh.truncate(self.file_sizes[name])
                os.fsync(fh.fileno())
            except OSError as e:
                raise _os_error(e, self.partial / name, "(final size)") from e
        tmp = self.partial / (MANIFEST + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(manifest, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.partial / MANIFEST)
            (self.partial / JOURNAL).unlink(missing_ok=True)
        except OSError as e:
            raise _os_error(e, self.partial / MANIFEST, "(manifest)") from e

    def close(self) -> None:
        for fh in self._files.values():
            if not fh.closed:
                fh.close()


class Slot:
    """A reusable output buffer (growable, never freed: fresh memory costs a page fault per 4 KiB)."""

    def __init__(self):
        self.buf = np.zeros(0, dtype=np.uint8)

    def ensure(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.zeros(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]


def block_digest(data) -> bytes:
    return hashlib.new(CHECKSUM, data).digest()


def combine_digests(digests) -> str:
    """A layer's checksum: the hash of its blocks' hashes, in expert order (so blocks hash in parallel)."""
    return hashlib.new(CHECKSUM, b"".join(digests)).hexdigest()


class BlockDigests:
    """Collects one layer's per-block digests as the hash workers finish them."""

    def __init__(self, n: int):
        self.parts: list[bytes | None] = [None] * n

    def hexdigest(self) -> str:
        if any(p is None for p in self.parts):
            raise RuntimeError("a block was never hashed")
        return combine_digests(self.parts)


class WritePipeline:
    """Writes and hashes on background threads while the caller fills the next buffer.

    File writes and hashlib release the GIL, so reading and repacking (caller), writing (one thread,
    in submission order) and hashing (a pool: expert blocks hash independently, see BlockDigests)
    run at once. A running digest (dense tensors) is updated by the writer thread, in file order.
    """

    _BARRIER = object()

    def __init__(self, writer: PackageWriter, *, hash_threads: int = 0, extra_slots: int = 0):
        self.writer = writer
        hash_threads = hash_threads or max(1, min(4, os.cpu_count() or 1))
        self._free: queue.Queue = queue.Queue()
        for _ in range(hash_threads + 2 + extra_slots):     # extra: one per producer thread beyond the first
            self._free.put(Slot())
        self._pending: dict[int, int] = {}           # id(slot) -> stages still to finish
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="ftw-write", daemon=True)
        self._thread.start()
        self._pool = ThreadPoolExecutor(max_workers=hash_threads, thread_name_prefix="ftw-hash")
        self._futures: list[Future] = []

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] is self._BARRIER:
                job[1].set()
                continue
            slot, file, offset, nbytes, digest, tensor = job
            try:
                if self._error is None:
                    data = slot.buf[:nbytes]
                    self.writer.write(file, offset, data, tensor=tensor)
                    if digest is not None and not isinstance(digest, tuple):
                        digest.update(data)
            except BaseException as e:          # handed to the caller at its next call
                self._error = e
            finally:
                self._release(slot)

    def _hash_block(self, slot: Slot, nbytes: int, target: BlockDigests, index: int) -> None:
        try:
            target.parts[index] = block_digest(slot.buf[:nbytes])
        finally:
            self._release(slot)

    def _release(self, slot: Slot) -> None:
        with self._lock:
            self._pending[id(slot)] -= 1
            if self._pending[id(slot)]:
                return
            del self._pending[id(slot)]
        self._free.put(slot)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
        with self._lock:
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        for f in done:
            f.result()                          # raises a hash worker's error

    def acquire(self) -> Slot:
        slot = self._free.get()
        self._raise()
        return slot

    def submit(self, slot: Slot, file: str, offset: int, nbytes: int, digest, *, tensor: str,
               block: tuple[BlockDigests, int] | None = None) -> None:
        """Queue a write of slot's first nbytes; hash them into `digest` (a running hashlib object,
        updated in order) or, with `block=(collector, index)`, as one block on the hash pool."""
        with self._lock:
            self._pending[id(slot)] = 2 if block else 1
            self._jobs.put((slot, file, offset, nbytes, digest, tensor))
            if block:
                self._futures.append(self._pool.submit(self._hash_block, slot, nbytes, *block))

    def drain(self) -> None:
        """Wait until every submitted job is written and hashed; raise the first error."""
        done = threading.Event()
        self._jobs.put((self._BARRIER, done))
        done.wait()
        with self._lock:
            futures, self._futures = self._futures, []
        for f in futures:
            f.result()
        self._raise()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self._pool.shutdown(wait=True)
