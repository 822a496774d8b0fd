"""`freetoken warm-kernels`: compile the CPU expert kernels now (the desktop app does it once in the background)."""
from __future__ import annotations

import os
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("warm-kernels", help="compile the CPU expert kernels now, so the first large model's load "
                                            "does not (the app does this once in the background)")
    p.add_argument("--marker", type=Path, default=None,
                   help="write this file when done (default: the cache folder's marker for this version)")
    p.add_argument("--layers", type=int, default=48,
                   help="layers of the tiny store compiled over (any count serves every model)")
    p.set_defaults(run=run)


def run(args) -> int:
    from app.cli import package_version
    from app.kernel_warmup import lower_priority, marker_path
    from app.paths import user_paths

    marker = args.marker or marker_path(user_paths().cache, package_version())
    lower_priority()
    try:
        import numba  # noqa: F401
    except ImportError:
        print("warm-kernels: numba is not installed, so there are no CPU kernels to compile")
        return 0
    from runtime.experts.warm import warm_cpu_kernels

    r = warm_cpu_kernels(args.layers)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(f"{r.isa}\n")
    os.replace(tmp, marker)             # a killed run leaves no marker that claims the work was done
    print(f"CPU expert kernels ready ({r.isa}): {r.layer_kernel_s + r.worker_loop_s:.1f} s "
          f"(compiled in {r.stage_variants} new variant(s); 0: already cached)")
    return 0
