"""The CPU expert kernels compiled once per version in the background, before a model needs them.

numba compiles them on a machine's first load that runs experts on the CPU, inside that load (~30-60 s, more on a
slow CPU: runtime/experts/warm.py). The desktop app starts `freetoken warm-kernels` at launch while that has not
been done for this version - usually long before the user's first large model has downloaded. The command writes
a marker under the cache folder when done; a machine without numba has nothing to compile.
`FREETOKEN_WARM_KERNELS=0` turns it off.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

ENV = "FREETOKEN_WARM_KERNELS"


def marker_path(cache_dir: Path, version: str) -> Path:
    """Where `freetoken warm-kernels` notes that this version's kernels are compiled (a version's own name:
    numba's cache is keyed by the source, so an update compiles again)."""
    return Path(cache_dir) / f"cpu-kernels-{re.sub(r'[^A-Za-z0-9._-]', '_', version)}.done"


def needs_warmup(cache_dir: Path, version: str) -> bool:
    """Whether the app should start the background compile: on unless turned off, numba installed, not done yet."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    if importlib.util.find_spec("numba") is None:
        return False
    return not marker_path(cache_dir, version).exists()


def lower_priority() -> None:
    """This process below the user's foreground work: the compile is one busy core for a minute."""
    try:
        import psutil

        p = psutil.Process()
        p.nice(psutil.BELOW_NORMAL_PRIORITY_CLASS if os.name == "nt" else 10)
    except (ImportError, OSError, AttributeError):
        pass            # (psutil.AccessDenied is an OSError) a normal priority still works


def start_in_background(cache_dir: Path, version: str, *, parent=None):
    """Start `freetoken warm-kernels` as a job of the app when `needs_warmup`; returns the job (or None). Quitting
    the app ends it: nothing is marked done, so the next launch starts it again."""
    if not needs_warmup(cache_dir, version):
        return None
    from app.jobs import ProcessJob

    job = ProcessJob.freetoken("warm-kernels", "--marker", str(marker_path(cache_dir, version)),
                               title="Compiling the CPU expert kernels (once per version)", parent=parent)
    job.start()
    return job
