"""Build the one-folder bundle for the platform this runs on; print where it is and how big.

    python installer/build.py [--clean]

Output: dist/FreeToken/ with `FreeToken` (windowed app) and `freetoken` (CLI). On Windows, then
compile installer/windows/freetoken.nsi with makensis (see docs/install.md).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="rebuild from scratch")
    parser.add_argument("--dist", default=str(ROOT / "dist"), help="output folder")
    args = parser.parse_args()
    env = dict(os.environ, FREETOKEN_VERSION=project_version())
    icon = ROOT / "resources" / "icons" / ("freetoken.ico" if sys.platform == "win32" else "freetoken.png")
    if icon.exists():
        env["FREETOKEN_ICON"] = str(icon)
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--distpath", args.dist,
           "--workpath", str(ROOT / "build" / "pyinstaller"), str(ROOT / "installer" / "freetoken.spec")]
    if args.clean:
        cmd.insert(3, "--clean")
    started = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    out = Path(args.dist) / "FreeToken"
    size = folder_size(out)
    print(f"\nFreeToken {project_version()} bundle: {out}")
    print(f"size: {size / 2**30:.2f} GiB ({size:,} bytes); built in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
