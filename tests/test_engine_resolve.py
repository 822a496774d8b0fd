"""MODEL -> FTW package: package folders, Hugging Face folders converted once into the cache, library names."""
from __future__ import annotations

import json
import shutil

import pytest

from app.paths import user_paths
from app.resolve import ResolveError, resolve_model
from runtime.ftw.reader import FTWPackage
from tests.engine_fixtures import ftw_packages  # noqa: F401


def test_package_folder_is_used_as_is(ftw_packages):
    pkg = ftw_packages("mixtral", "f32")
    assert resolve_model(str(pkg)) == pkg


def test_hf_folder_is_converted_once_into_the_cache(tiny_checkpoints, tmp_path):
    src = tmp_path / "my-mixtral"
    shutil.copytree(tiny_checkpoints("mixtral"), src)
    first = resolve_model(str(src), codec="f32")
    assert first.is_relative_to(user_paths().cache)
    assert FTWPackage.open(first).model_type == "mixtral"
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert resolve_model(str(src), codec="f32") == first                       # reused, not converted again
    assert (first / "manifest.json").stat().st_mtime_ns == stamp
    # a changed checkpoint is a different model: converted anew
    config = json.loads((src / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(src), codec="f32") != first


def test_library_names_and_repo_ids(ftw_packages, tiny_checkpoints):
    models = user_paths().ensure().models
    shutil.copytree(ftw_packages("gpt_oss", "f32"), models / "gpt-oss-tiny")
    assert resolve_model("gpt-oss-tiny") == models / "gpt-oss-tiny"
    # a downloaded checkpoint under its repo id, converted on first use
    shutil.copytree(tiny_checkpoints("mixtral"), models / "mistralai--Mixtral-tiny")
    path = resolve_model("mistralai/Mixtral-tiny", codec="f32")
    assert FTWPackage.open(path).model_type == "mixtral"
    # a package whose manifest names the repo wins over the raw checkpoint
    pkg = models / "Mixtral-tiny-f32"
    shutil.copytree(path, pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["source"]["repo_id"] = "mistralai/Mixtral-tiny"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    assert resolve_model("mistralai/Mixtral-tiny") == pkg


def test_errors_name_the_cause(tmp_path):
    user_paths().ensure()
    (user_paths().models / "something").mkdir()
    with pytest.raises(ResolveError, match=r"no model named 'nope'.*something"):
        resolve_model("nope")
    with pytest.raises(ResolveError, match="neither an FTW package"):
        resolve_model(str(tmp_path))
    partial = tmp_path / "pkg.partial"
    partial.mkdir()
    with pytest.raises(ResolveError, match="did not finish"):
        resolve_model(str(partial))
    with pytest.raises(ResolveError, match="no such folder"):
        resolve_model("./does/not/exist")
    with pytest.raises(ResolveError, match="no model given"):
        resolve_model("  ")


def test_the_models_dir_setting_is_honoured(ftw_packages, tmp_path):
    from app.settings import Settings

    elsewhere = tmp_path / "big-disk"
    shutil.copytree(ftw_packages("mixtral", "f32"), elsewhere / "mixtral-tiny")
    settings = Settings()
    settings.set("models_dir", str(elsewhere))
    settings.save()
    assert resolve_model("mixtral-tiny") == elsewhere / "mixtral-tiny"


def test_naming_the_demo_on_an_empty_library_makes_it_once(tmp_path):
    """The README's `freetoken run freetoken-demo-random` works on a fresh machine: the name is the demo's first use.
    The model it makes is the real demo package, made once; another unknown name is still an error."""
    from app.demo import DEMO_MODEL_NAME

    models = tmp_path / "models"
    path = resolve_model(DEMO_MODEL_NAME, models_dir=models, cache_dir=tmp_path / "cache")
    assert path == models / DEMO_MODEL_NAME
    assert "random" in FTWPackage.open(path).config["freetoken_demo"]
    stamp = (path / "manifest.json").stat().st_mtime_ns
    assert resolve_model(DEMO_MODEL_NAME, models_dir=models, cache_dir=tmp_path / "cache") == path
    assert (path / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(ResolveError, match=rf"no model named 'freetoken-demo'.*{DEMO_MODEL_NAME}"):
        resolve_model("freetoken-demo", models_dir=models)
