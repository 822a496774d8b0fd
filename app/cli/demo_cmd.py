"""`freetoken demo`: make the built-in demo model (random weights, gibberish output) in the models folder."""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("demo", help="create the built-in demo model (random weights: it writes gibberish)",
                       description="Creates 'freetoken-demo-random', a small MoE with random weights, locally and "
                                   "once, so that run, serve and the app work without downloading anything.")
    p.add_argument("--force", action="store_true", help="rebuild it even if it is already there")
    p.add_argument("--json", action="store_true", help="print one JSON object with the package path")
    p.set_defaults(run=run)


def run(args) -> int:
    from app.demo import DemoError, ensure_demo_model
    from runtime.ftw.errors import FTWError

    say = None if args.json else (lambda message: print(message, file=sys.stderr, flush=True))
    try:
        demo = ensure_demo_model(force=args.force, progress=say)
    except (DemoError, FTWError, OSError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"name": demo.path.name, "path": str(demo.path), "created": demo.created}))
    elif demo.created:
        print(f"created {demo.path}\ntry: freetoken run {demo.path.name} --prompt hi --max-tokens 16")
    else:
        print(f"already there: {demo.path}")
    return 0
