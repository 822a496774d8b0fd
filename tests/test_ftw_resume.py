"""Kill and resume, progress, verify and the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main as cli_main
from runtime.ftw.converter import ProgressEvent, convert
from runtime.ftw.errors import FTWError
from runtime.ftw.reader import FTWPackage
from runtime.ftw.verify import verify
from runtime.ftw.writer import EXIT_AFTER_UNITS_ENV

REPO = Path(__file__).resolve().parents[1]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def convert_in_child(src: Path, out: Path, codec: str, *, exit_after: int) -> int:
    code = f"from runtime.ftw.converter import convert; convert({str(src)!r}, {str(out)!r}, codec={codec!r})"
    env = dict(os.environ, PYTHONPATH=str(REPO), **{EXIT_AFTER_UNITS_ENV: str(exit_after)})
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, timeout=120).returncode


def test_killed_conversion_resumes_to_identical_bytes(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints("qwen3_next")                    # 4 layers: globals + 4 units
    reference = convert(src, tmp_path / "reference", codec="int4")

    out = tmp_path / "pkg"
    assert convert_in_child(src, out, "int4", exit_after=2) == 75     # died hard after 2 committed units
    partial = tmp_path / "pkg.partial"
    assert not out.exists() and partial.is_dir() and not (partial / "manifest.json").exists()
    journal = (partial / "journal.jsonl").read_text().splitlines()
    assert len(journal) == 3                                 # fingerprint + 2 units

    events: list[ProgressEvent] = []
    convert(src, out, codec="int4", progress=events.append)
    resumed = [e for e in events if e.stage == "resuming"]
    assert resumed and "2 of 5 units" in resumed[0].tensor and resumed[0].bytes_done > 0
    converted = {e.tensor for e in events if e.stage in ("dense", "experts")}
    assert "model.embed_tokens.weight" not in converted and "layer 0 expert 0" not in converted   # skipped
    assert files_of(out) == files_of(reference)
    assert not partial.exists() and verify(out).ok


def test_partial_from_other_options_is_discarded(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints("mixtral")
    out = tmp_path / "pkg"
    assert convert_in_child(src, out, "int4", exit_after=1) == 75
    convert(src, out, codec="bf16")                          # different codec: start clean, not mix
    assert files_of(out) == files_of(convert(src, tmp_path / "reference", codec="bf16"))


def test_progress_events(tiny_checkpoints, tmp_path):
    events: list[ProgressEvent] = []
    convert(tiny_checkpoints("gpt_oss"), tmp_path / "pkg", codec="int4", progress=events.append)
    stages = [e.stage for e in events]
    assert stages[0] == "planning" and stages[-1] == "done" and {"dense", "experts", "finishing"} <= set(stages)
    total = events[-1].bytes_total
    assert total > 0 and events[-1].bytes_done == total
    done = [e.bytes_done for e in events[1:]]
    assert done == sorted(done)                              # never goes backwards
    assert all(e.bytes_total == total for e in events[1:])
    assert events[-1].rate > 0 and events[-1].eta == 0


def test_verify_finds_damage(tiny_checkpoints, tmp_path):
    out = convert(tiny_checkpoints("mixtral"), tmp_path / "pkg", codec="int4")
    assert verify(out).ok
    pkg = FTWPackage.open(out)
    meta = pkg.manifest["dense"]["tensors"]["model.norm.weight"]
    with open(out / "experts.bin", "r+b") as fh:             # flip one byte in layer 1's experts
        fh.seek(pkg.experts.block_offset(1, 3) + 10)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with open(out / "dense.bin", "r+b") as fh:
        fh.seek(meta["offset"])
        fh.write(b"\x00\x00\x80\x7f")
    assert verify(out).bad == ["dense model.norm.weight", "experts layer 1"]


def test_cli_convert_progress_json_and_verify(tiny_checkpoints, tmp_path, capsys, freetoken_home):
    src = tiny_checkpoints("mixtral")
    assert cli_main(["convert", str(src), "--progress-json", "--codec", "bf16"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["event"] == "done"
    path = Path(lines[-1]["path"])
    assert path == freetoken_home / "models" / f"{src.name}-bf16"         # default: the models folder
    progress = [x for x in lines if x["event"] == "progress"]
    assert progress and {"stage", "tensor", "bytes_done", "bytes_total", "rate", "eta"} <= set(progress[-1])
    assert cli_main(["verify", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True

    (path / "manifest.json").unlink()
    assert cli_main(["verify", str(path)]) == 1
    assert "not an FTW package" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 1
    assert "no config.json" in capsys.readouterr().err


def test_source_repo_and_revision_are_recorded(tiny_checkpoints, tmp_path):
    import shutil

    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--acme--Tiny-MoE" / "snapshots" / rev
    shutil.copytree(tiny_checkpoints("mixtral"), snap)
    source = FTWPackage.open(convert(snap, tmp_path / "a", codec="bf16")).manifest["source"]
    assert (source["repo_id"], source["revision"]) == ("acme/Tiny-MoE", rev)
    (snap / "source.json").write_text(json.dumps({"repo_id": "acme/Other", "revision": "v1"}))
    source = FTWPackage.open(convert(snap, tmp_path / "b", codec="bf16")).manifest["source"]
    assert (source["repo_id"], source["revision"], source["quantization"]) == ("acme/Other", "v1", "none")
    with pytest.raises(FTWError, match="already exists"):
        convert(snap, tmp_path / "b", codec="bf16")


def test_killed_between_manifest_and_rename_only_renames(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints("mixtral")
    out = convert(src, tmp_path / "pkg", codec="int4")
    before = files_of(out)
    out.rename(tmp_path / "pkg.partial")                    # as if killed just before the final rename
    with pytest.raises(FTWError, match="did not finish"):
        FTWPackage.open(out)
    events: list[ProgressEvent] = []
    convert(src, out, codec="int4", progress=events.append)
    assert not any(e.stage in ("dense", "experts") for e in events)    # nothing converted again
    assert files_of(out) == before and verify(out).ok


def test_parallel_expert_workers_write_the_same_bytes(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints("qwen3_moe")
    one = convert(src, tmp_path / "one", codec="int4", workers=1)
    three = convert(src, tmp_path / "three", codec="int4", workers=3)
    assert files_of(one) == files_of(three) and verify(three).ok


def test_cli_convert_honours_the_models_dir_setting_and_reports_bad_settings(tiny_checkpoints, tmp_path, capsys,
                                                                              freetoken_home):
    from app.settings import Settings

    settings = Settings()
    settings.set("models_dir", str(tmp_path / "elsewhere"))
    settings.save()
    src = tiny_checkpoints("gpt_oss")
    assert cli_main(["convert", str(src), "--codec", "bf16", "--group-size", "32"]) == 0
    assert FTWPackage.open(tmp_path / "elsewhere" / f"{src.name}-bf16").experts.codec == "bf16"
    settings.path.write_text("{not json")
    assert cli_main(["convert", str(src)]) == 1
    assert "settings.json" in capsys.readouterr().err
