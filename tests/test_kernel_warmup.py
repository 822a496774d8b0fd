"""The CPU expert kernels compiled ahead of the first load that needs them (app/kernel_warmup.py,
`freetoken warm-kernels`, runtime/experts/warm.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.jobs import ProcessJob
from app.kernel_warmup import ENV, marker_path, needs_warmup, start_in_background

ROOT = Path(__file__).resolve().parent.parent


def test_warm_kernels_compiles_each_kernel_once_and_marks_it_done(tmp_path):
    """The command the app starts, in a process of its own over an empty numba cache: it compiles the lanes' shared
    stages in exactly one variant (1be4ae6: two callers' literal arguments and prange index types had made four,
    doubling a fresh install's compile) and writes its marker only at the end."""
    pytest.importorskip("numba")
    marker = tmp_path / "cache" / "cpu-kernels-test.done"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "FREETOKEN_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ui.entry", "warm-kernels", "--marker", str(marker),
                           "--layers", "2"], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"compiled in 1 new variant\(s\)", proc.stdout), proc.stdout
    isa = re.search(r"ready \((\w+)\)", proc.stdout).group(1)
    assert marker.read_text().strip() == isa                   # the flavour it compiled, named in the marker
    assert not marker.with_name(marker.name + ".tmp").exists()


def test_the_app_warms_once_per_version_unless_turned_off(tmp_path, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv(ENV, raising=False)
    assert needs_warmup(tmp_path, "1.2.3")
    marker_path(tmp_path, "1.2.3").write_text("vnni512\n")
    assert not needs_warmup(tmp_path, "1.2.3")
    assert needs_warmup(tmp_path, "1.2.4")                       # an update compiles again
    monkeypatch.setenv(ENV, "0")
    assert not needs_warmup(tmp_path, "1.2.4")


def test_a_version_string_cannot_name_a_marker_outside_the_cache_folder(tmp_path):
    path = marker_path(tmp_path, "../../etc/x")
    assert path.parent == tmp_path and "/" not in path.name


def test_the_app_starts_the_command_as_a_job(qapp, tmp_path, monkeypatch):
    """At launch the app starts `freetoken warm-kernels --marker ...` (the command itself is run for real above)."""
    pytest.importorskip("numba")
    monkeypatch.delenv(ENV, raising=False)
    started = []
    monkeypatch.setattr(ProcessJob, "start", lambda self: started.append(self))
    job = start_in_background(tmp_path, "9.9", parent=None)
    assert started == [job]
    assert job.arguments[-3:] == ["warm-kernels", "--marker", str(marker_path(tmp_path, "9.9"))]
    marker_path(tmp_path, "9.9").write_text("x")
    assert start_in_background(tmp_path, "9.9") is None and started == [job]
