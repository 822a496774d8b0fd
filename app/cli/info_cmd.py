"""`freetoken info`: where FreeToken keeps its files (the library issue adds the hardware probe)."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("info", help="show this machine and FreeToken's folders")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from app.paths import user_paths

    paths = user_paths()
    report = {"folders": {k: str(v) for k, v in vars(paths).items()}}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report["folders"].items():
            print(f"{key:>8}: {value}")
    return 0
