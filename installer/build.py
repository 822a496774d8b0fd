"""Build the one-folder bundle for the platform this runs on; print where it is and how big.

    python installer/build.py [--clean] [--installer]

Output: dist/FreeToken/ with `FreeToken` (windowed app) and the console CLI (`freetoken` on Linux,
`freetoken-cli` on Windows and macOS, whose file names ignore case). `--installer` then compiles
installer/windows/freetoken.nsi with makensis into dist/FreeToken-VERSION-setup.exe (on Linux the
Linux bundle stands in for the Windows one: it proves the script compiles). docs/install.md has the rest.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "installer" / "freetoken.spec"
NSIS_SCRIPT = ROOT / "installer" / "windows" / "freetoken.nsi"
# Where Chocolatey and the NSIS installer put makensis when it is not on PATH.
WINDOWS_MAKENSIS = (r"C:\Program Files (x86)\NSIS\makensis.exe", r"C:\Program Files\NSIS\makensis.exe")


def project_version() -> str:
    """The version in pyproject.toml: the one source for the bundle, the installer and the CI artifact."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def find_makensis() -> str | None:
    found = shutil.which("makensis")
    if found:
        return found
    return next((p for p in WINDOWS_MAKENSIS if Path(p).is_file()), None) if sys.platform == "win32" else None


def compile_installer(bundle: Path, outfile: Path, *, version: str, makensis: str | None = None) -> Path:
    """Wrap `bundle` in the NSIS installer `outfile`. Raises with makensis's own output when it fails."""
    makensis = makensis or find_makensis()
    if makensis is None:
        raise FileNotFoundError("makensis not found: install NSIS 3 (Debian: apt install nsis; "
                                "Windows: choco install nsis) or put makensis on PATH")
    if not (bundle / "_internal").is_dir():
        raise FileNotFoundError(f"{bundle} is not a built bundle (no _internal folder): run installer/build.py")
    outfile.parent.mkdir(parents=True, exist_ok=True)
    partial = outfile.with_name(outfile.name + ".partial")   # a failed compile never leaves a good-looking .exe
    # `-D` works on every platform (`/D` only on Windows); NSIS paths may use `/` on Windows too.
    cmd = [makensis, "-V2", f"-DVERSION={version}", f"-DBUNDLE={bundle.resolve()}",
           f"-DOUTFILE={partial.resolve()}", f"-DICON={(ROOT / 'resources' / 'icons' / 'freetoken.ico').resolve()}",
           str(NSIS_SCRIPT)]
    done = subprocess.run(cmd, cwd=NSIS_SCRIPT.parent, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"makensis failed on {NSIS_SCRIPT} (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    partial.replace(outfile)
    return outfile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="rebuild from scratch")
    parser.add_argument("--installer", action="store_true", help="then compile the NSIS installer with makensis")
    parser.add_argument("--dist", default=str(ROOT / "dist"), help="output folder")
    args = parser.parse_args()
    version = project_version()
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--distpath", args.dist,
           "--workpath", str(ROOT / "build" / "pyinstaller"), str(SPEC)]
    if args.clean:
        cmd.insert(3, "--clean")
    started = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    built_s = time.monotonic() - started
    out = Path(args.dist) / "FreeToken"
    size = folder_size(out)
    print(f"\nFreeToken {version} bundle: {out}")
    print(f"size: {size / 2**30:.2f} GiB ({size:,} bytes); built in {built_s:.0f} s")
    if args.installer:
        setup = compile_installer(out, Path(args.dist) / f"FreeToken-{version}-setup.exe", version=version)
        print(f"installer: {setup} ({setup.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
