"""`freetoken info`: this machine (GPUs, CPU, RAM, disk) and where FreeToken keeps its files."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("info", help="show this machine and FreeToken's folders")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from app.hardware import probe
    from app.paths import user_paths
    from app.settings import Settings

    paths = user_paths(Settings().get("models_dir") or None)
    hardware = probe(paths.models)
    report = {"folders": {k: str(v) for k, v in vars(paths).items()}, "hardware": hardware.to_dict()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for line in hardware.summary_lines():
        print(line)
    print()
    for key, value in report["folders"].items():
        print(f"{key:>8}: {value}")
    return 0
