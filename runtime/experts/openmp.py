"""numba's OpenMP threads kept apart from torch's (issue 10: the CPU share's fixed cost per request).

torch's Linux wheels ship their own libgomp and load it into the process's global symbol scope
(`libtorch_global_deps` is opened RTLD_GLOBAL). numba's OpenMP layer (`omppool`) links the system's libgomp,
but a library's undefined symbols bind to the first definition in the global scope first: torch's. So one
libgomp runs both runtimes' thread pools and counts them together. Once torch's intra-op pool (every core,
created by the first multi-threaded CPU op of a thread: the planner's bandwidth probe is one) and the CPU-share
worker's pool outnumber the cores, libgomp "throttles": it stops spinning between parallel regions, so each
region of the worker's kernel must wake sleeping threads (on the H200 host: 61 µs a region instead of 11, two
regions a request; `benchmarks/omp_pools.py`).

`load_private_openmp()` opens `omppool` with RTLD_DEEPBIND before numba launches its threads: its calls then
bind to its own libgomp (the one it links), a second instance with its own pools and count, and torch's
threads, idle between torch ops, no longer throttle ours. torch must be loaded first (it is, here). Where it does not apply (not glibc, numba's threads
already launched, no OpenMP layer) it changes nothing and says why.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

OMPPOOL = "numba.np.ufunc.omppool"
_state: dict[str, str] = {}


def load_private_openmp() -> str:
    """Load numba's OpenMP layer bound to its own libgomp, once per process. Returns what happened: "private"
    (loaded with RTLD_DEEPBIND), "already loaded" (someone loaded it first: binding unchanged),
    "unsupported" (no RTLD_DEEPBIND on this platform: Windows binds per DLL anyway, macOS has no libgomp
    wheel), or "unavailable" (numba or its OpenMP layer cannot load; numba picks another layer)."""
    if "result" in _state:
        return _state["result"]
    if not hasattr(os, "RTLD_DEEPBIND"):
        result = "unsupported"
    elif OMPPOOL in sys.modules:
        result = "already loaded"
    else:
        # torch first: its libgomp has the same soname as the system's, so were numba's loaded first, torch's
        # would never load and both runtimes would share one instance again
        import torch  # noqa: F401
        flags = sys.getdlopenflags()
        sys.setdlopenflags(flags | os.RTLD_DEEPBIND)
        try:
            import numba.np.ufunc.omppool  # noqa: F401  (numba's threading layer imports this same module later)
            result = "private"
        except ImportError as exc:        # no libgomp on this machine: numba falls back to tbb or workqueue
            log.info("numba's OpenMP layer did not load (%s)", exc)
            result = "unavailable"
        finally:
            sys.setdlopenflags(flags)
    if result == "already loaded":
        log.warning("numba's OpenMP layer was loaded before the expert kernels: it may share torch's libgomp, "
                    "which throttles the CPU-share worker's threads")
    _state["result"] = result
    return result
