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
threads, idle between torch ops, no longer throttle ours. torch must be loaded first (this function sees to it:
the two libraries share a soname, and whichever loads first would serve both).

Who calls it: the hybrid tier when it decodes zero-copy (the only path with a CPU-share worker; it calls it
before its kernels' load-time warm-up launches numba's threads) and the worker itself. Not a CPU engine: there
torch's dense layers and numba's experts take turns every layer on every core, and two instances that each
spin after their regions keep both pools' threads busy at once: a torch op and a numba region in turn took
8.0 ms a pair with the private binding against 0.44-0.62 ms with one libgomp (dev VM, 2 threads each,
`benchmarks/omp_pools.py alternate 2 [private]`). For the same reason nothing may run multi-threaded torch CPU ops
beside a running worker.
Where it does not apply (not glibc, numba's threads already launched, no OpenMP layer) it changes nothing and
says why. A CPU engine loaded later in such a process (a model swap) warns: `warn_if_private_beside_torch`.
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
        spin = _private_spin_count()
        if spin is not None:              # read once, by the private instance's constructor at its load
            os.environ["GOMP_SPINCOUNT"] = spin
        try:
            import numba.np.ufunc.omppool  # noqa: F401  (numba's threading layer imports this same module later)
            result = "private"
        except ImportError as exc:        # no libgomp on this machine: numba falls back to tbb or workqueue
            log.info("numba's OpenMP layer did not load (%s)", exc)
            result = "unavailable"
        finally:
            sys.setdlopenflags(flags)
            if spin is not None:          # torch's instance read the environment long ago; later ones see the user's
                os.environ.pop("GOMP_SPINCOUNT", None)
    if result == "already loaded":
        log.warning("numba's OpenMP layer was loaded before the hybrid tier could set it apart from torch's: "
                    "the CPU's share of the experts may run slower in this process (docs/hybrid.md, fifth session)")
    _state["result"] = result
    return result


def _private_spin_count() -> str | None:
    """GOMP_SPINCOUNT for the private instance only: how long its idle threads spin (pause instructions) before
    they sleep. `FREETOKEN_OMP_SPINCOUNT` sets it; a user's own GOMP_SPINCOUNT (for every instance) wins."""
    if "GOMP_SPINCOUNT" in os.environ:
        return None
    return os.environ.get("FREETOKEN_OMP_SPINCOUNT") or None


def warn_if_private_beside_torch() -> bool:
    """A tier whose CPU misses take turns with torch's dense layers (a CPU engine) in a process where numba's
    OpenMP layer is already private (an earlier zero-copy GPU model loaded it so): the two pools contend, and
    the way back is a new process. Logs it; True when it applies."""
    if _state.get("result") != "private":
        return False
    log.warning("an earlier GPU model in this process set the CPU expert threads apart from torch's; for this "
                "CPU model the two thread pools compete and decoding is slower: restart FreeToken and load the "
                "model again for full speed")
    return True
