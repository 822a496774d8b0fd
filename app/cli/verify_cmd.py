"""`freetoken verify PATH`: recompute an FTW package's checksums."""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("verify", help="check that a converted model's files match their checksums")
    p.add_argument("path", metavar="PATH", help="the FTW package folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from runtime.ftw.errors import FTWError
    from runtime.ftw.verify import verify

    try:
        report = verify(args.path)
    except FTWError as e:
        if args.json:
            print(json.dumps({"ok": False, "path": args.path, "error": str(e), "bad": []}))
        print(f"verify: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": report.ok, "path": str(report.path), "checked": report.checked,
                          "bytes": report.nbytes, "bad": report.bad}))
    elif report.ok:
        print(f"{report.path}: OK ({report.checked} checksums, {report.nbytes / 2**20:.1f} MiB)")
    else:
        print(f"{report.path}: DAMAGED: {', '.join(report.bad)}; convert the model again", file=sys.stderr)
    return 0 if report.ok else 1
