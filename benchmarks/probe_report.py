"""Print the full hardware probe as JSON (run it on the GPU machine to record real NVML output in docs/).

    python benchmarks/probe_report.py [--models-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=None, help="where free disk is read (default: the models folder)")
    args = parser.parse_args()
    from app.hardware import probe
    from app.paths import user_paths

    report = probe(args.models_dir or user_paths().models)
    data = report.to_dict()
    data["probed_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
