"""`freetoken worker --ipc NAME`: the runtime worker the app starts (not meant to be run by hand).

It connects back to the app's QLocalServer NAME, loads models and generates on request, and serves the
HTTP API when the app turns it on. Logs go to worker.log in the log folder.
"""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("worker", help="the runtime worker process the app starts (internal)")
    p.add_argument("--ipc", required=True, metavar="NAME", help="the app's QLocalServer name to connect to")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests admitted at once before 'overloaded' (default 64)")
    p.set_defaults(run=run)


def run(args) -> int:
    from app.cli import package_version
    from runtime.worker import run_worker

    return run_worker(args.ipc, version=package_version(), max_queue=args.max_queue)
