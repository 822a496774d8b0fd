"""Fast checks of the installer sources (the bundle itself is built and smoke-tested by installer/smoke_test.sh).

The spec is parsed, not run (running it is a PyInstaller build); the NSIS script is compiled for real
against a stand-in payload when makensis is installed.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALLER = ROOT / "installer"


def load_build_module():
    spec = importlib.util.spec_from_file_location("freetoken_installer_build", INSTALLER / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_calls(name: str) -> list[ast.Call]:
    tree = ast.parse((INSTALLER / "freetoken.spec").read_text(), filename="freetoken.spec")
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def keywords(call: ast.Call) -> dict[str, ast.expr]:
    return {k.arg: k.value for k in call.keywords}


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_spec_builds_a_windowed_app_and_a_console_cli_from_one_entry():
    exes = spec_calls("EXE")
    assert len(exes) == 2
    by_console = {ast.literal_eval(keywords(e)["console"]): keywords(e)["name"] for e in exes}
    assert set(by_console) == {True, False}
    assert ast.literal_eval(by_console[False]) == "FreeToken"
    # The CLI's name differs from the app's even when case is ignored (Windows, macOS file systems).
    cli_name = by_console[True]
    assert isinstance(cli_name, ast.Name)
    source = (INSTALLER / "freetoken.spec").read_text()
    names = {m for m in ("freetoken", "freetoken-cli") if f'"{m}"' in source}
    assert names == {"freetoken", "freetoken-cli"}
    assert f'CLI_NAME = "freetoken" if sys.platform.startswith("linux") else "freetoken-cli"' in source
    # Both executables and every binary and data file land in one folder.
    (collect,) = spec_calls("COLLECT")
    assert ast.literal_eval(keywords(collect)["name"]) == "FreeToken"
    assert {a.id for a in collect.args[:2]} == {"app_exe", "cli_exe"}
    # One entry script, which exists and hands over to ui.entry.
    (analysis,) = spec_calls("Analysis")
    entry = ast.unparse(analysis.args[0])
    assert "entry.py" in entry
    assert "from ui.entry import main" in (INSTALLER / "entry.py").read_text()


def test_spec_ships_resources_metadata_numba_source_and_no_test_packages():
    source = (INSTALLER / "freetoken.spec").read_text()
    (analysis,) = spec_calls("Analysis")
    kw = keywords(analysis)
    tree = ast.parse(source)
    assigned = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}
    excludes = ast.literal_eval(assigned[kw["excludes"].id])
    for test_only in ("pytest", "pytest_qt", "schemathesis", "hypothesis", "PyInstaller"):
        assert test_only in excludes
    # Nothing the app imports may be excluded.
    for needed in ("torch", "numba", "PySide6", "uvicorn", "fastapi", "tokenizers", "jinja2"):
        assert needed not in excludes
    # every module with a cached numba function ships as source: inside the PYZ archive numba raises at its import
    cached = {".".join(path.relative_to(ROOT).with_suffix("").parts)
              for package in ("app", "runtime", "ui") for path in (ROOT / package).rglob("*.py")
              if re.search(r"@njit\([^)]*cache=True", path.read_text(encoding="utf-8"))}
    assert {"runtime.experts.cpu_kernels", "runtime.experts.cpu_kernels_int8", "runtime.experts.cpu_share"} <= cached
    assert ast.literal_eval(assigned[kw["module_collection_mode"].id]) == {name: "py" for name in cached}
    assert 'copy_metadata("freetoken")' in source
    assert '(str(ROOT / "resources"), "resources")' in source
    for package in ("app", "runtime", "ui"):             # commands and model families import by name
        assert f'collect_submodules("{package}")' in source
    assert 'collect_submodules("huggingface_hub"' in source  # its lazy `from huggingface_hub import HfApi`


def test_frozen_app_starts_the_worker_and_jobs_with_its_own_executable(monkeypatch):
    from app.jobs import ProcessJob
    from app.worker_client import worker_command

    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/FreeToken/FreeToken")
    assert worker_command("ipc-1") == ("/opt/FreeToken/FreeToken", ["worker", "--ipc", "ipc-1"])
    job = ProcessJob.freetoken("models", "list", "--json")
    assert (job.program, job.arguments) == ("/opt/FreeToken/FreeToken", ["models", "list", "--json"])
    monkeypatch.delattr(sys, "frozen")
    job = ProcessJob.freetoken("models", "list")           # from source: this interpreter runs the package
    assert job.program == "/opt/FreeToken/FreeToken" and job.arguments[:2] == ["-m", "ui.entry"]


def test_cli_modules_named_in_the_command_table_are_inside_the_collected_packages():
    from app.cli import COMMANDS

    for module_name in COMMANDS.values():
        assert module_name.split(".")[0] in ("app", "runtime", "ui")
        assert importlib.util.find_spec(module_name) is not None, module_name


def test_version_of_build_and_bundle_comes_from_pyproject():
    build = load_build_module()
    assert build.project_version() == pyproject_version()
    # The bundle's --version reads the installed metadata; the spec refuses to build when it is stale.
    assert installed_version("freetoken") == pyproject_version()
    source = (INSTALLER / "freetoken.spec").read_text()
    assert 'tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]' in source
    assert 'installed_version("freetoken") != VERSION' in source
    # The CI workflow names the installer with the same version.
    workflow = (ROOT / ".github" / "workflows" / "windows-installer.yml").read_text()
    assert "tomllib" in workflow and "pyproject.toml" in workflow


def test_smoke_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(INSTALLER / "smoke_test.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_icon_files_are_a_png_and_a_multi_size_ico():
    icons = ROOT / "resources" / "icons"
    png = (icons / "freetoken.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 256
    ico = (icons / "freetoken.ico").read_bytes()
    assert ico[:4] == b"\x00\x00\x01\x00"
    count = int.from_bytes(ico[4:6], "little")
    sizes = {ico[6 + 16 * i] or 256 for i in range(count)}
    assert {16, 32, 48, 256} <= sizes
    for i in range(count):                                 # every entry points at a PNG inside the file
        length = int.from_bytes(ico[6 + 16 * i + 8:6 + 16 * i + 12], "little")
        offset = int.from_bytes(ico[6 + 16 * i + 12:6 + 16 * i + 16], "little")
        assert offset + length <= len(ico)
        assert ico[offset:offset + 4] == b"\x89PNG"


def stand_in_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "FreeToken"
    (bundle / "_internal" / "resources").mkdir(parents=True)
    (bundle / "FreeToken.exe").write_bytes(b"MZ stand-in app")
    (bundle / "freetoken-cli.exe").write_bytes(b"MZ stand-in cli")
    (bundle / "_internal" / "resources" / "catalog.json").write_text("{}")
    return bundle


@pytest.mark.skipif(shutil.which("makensis") is None, reason="makensis (NSIS) is not installed")
def test_nsis_script_compiles_around_a_stand_in_payload(tmp_path):
    build = load_build_module()
    bundle = stand_in_bundle(tmp_path)
    setup = build.compile_installer(bundle, tmp_path / "out" / "FreeToken-setup.exe", version=pyproject_version())
    data = setup.read_bytes()
    assert data[:2] == b"MZ"                               # a Windows executable
    assert len(data) > 50_000                              # the NSIS stub plus the compressed payload
    assert not list((tmp_path / "out").glob("*.partial"))


@pytest.mark.skipif(shutil.which("makensis") is None, reason="makensis (NSIS) is not installed")
def test_nsis_failure_names_the_cause_and_leaves_no_installer(tmp_path):
    build = load_build_module()
    bundle = stand_in_bundle(tmp_path)
    out = tmp_path / "out" / "FreeToken-setup.exe"
    # An icon that does not exist makes makensis fail: its message must come through, and no .exe stay.
    original = build.ROOT
    build.ROOT = tmp_path
    try:
        with pytest.raises(RuntimeError, match="makensis failed"):
            build.compile_installer(bundle, out, version="1.0")
    finally:
        build.ROOT = original
    assert not out.exists()
    assert not list(out.parent.glob("*"))


def test_compile_installer_refuses_a_folder_that_is_not_a_bundle(tmp_path):
    build = load_build_module()
    with pytest.raises(FileNotFoundError, match="not a built bundle|makensis not found"):
        build.compile_installer(tmp_path, tmp_path / "x.exe", version="1.0", makensis=sys.executable)


def test_nsis_script_keeps_user_data_unless_asked_and_installs_per_user():
    nsi = (INSTALLER / "windows" / "freetoken.nsi").read_text()
    assert "RequestExecutionLevel user" in nsi
    assert 'InstallDir "$LOCALAPPDATA\\Programs\\${APPNAME}"' in nsi
    # The data-removal section is optional and off by default (/o); the program section never touches it.
    data_section = nsi[nsi.index('Section /o "un.Also delete my models'):]
    assert 'RMDir /r "${USERDATA}"' in data_section
    main_uninstall = nsi[nsi.index('Section "un.FreeToken'):nsi.index('Section /o "un.Also delete')]
    assert "USERDATA" not in main_uninstall
    assert "freetoken-cli.exe" in main_uninstall
