"""MODEL (what a user types after `freetoken run`/`serve`) -> the FTW package folder to load.

MODEL may be
- an FTW package folder (it has manifest.json): used as is;
- a Hugging Face checkpoint folder (config.json + *.safetensors): converted once, through the real
  FTW converter, into `<cache>/converted/<folder>-<fingerprint>`, and reused while the checkpoint is
  unchanged (the fingerprint covers config.json and each shard's name, size and mtime); an
  interrupted conversion resumes;
- a name in the models folder: a folder name, or a hub repo id ("Qwen/Qwen3-30B-A3B") that names
  a downloaded checkpoint (`Qwen--Qwen3-30B-A3B`) or a package converted from it. A package wins
  over a checkpoint that still needs converting. The built-in demo's name (`freetoken-demo-random`) makes the
  demo model when the library lacks it: naming it is its first use, as the README's `run` example does.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

from app.demo import DEMO_MODEL_NAME, DemoError, ensure_demo_model
from app.paths import user_paths

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"


class ResolveError(ValueError):
    """MODEL names nothing we can load; the message says what was looked for and where."""


def is_package(folder: Path) -> bool:
    return (folder / MANIFEST).is_file() and not folder.name.endswith(PARTIAL_SUFFIX)


def is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def checkpoint_fingerprint(folder: Path) -> str:
    """Changes whenever config.json or any shard changes (name, size or modification time)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for shard in sorted(folder.glob("*.safetensors")):
        st = shard.stat()
        h.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def converted_path(checkpoint: Path, cache_dir: Path, codec: str) -> Path:
    return cache_dir / "converted" / f"{checkpoint.name}-{codec}-{checkpoint_fingerprint(checkpoint)}"


def convert_cached(checkpoint: Path, *, cache_dir: Path, codec: str = "auto",
                   progress: Callable | None = None) -> Path:
    """The cached FTW package of a checkpoint folder, converting it first when needed."""
    from runtime.ftw.converter import convert

    out = converted_path(checkpoint, cache_dir, codec)
    if is_package(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s", checkpoint, out)
    return convert(checkpoint, out, codec=codec, progress=progress)


def _packages_from(models: Path, repo: str) -> list[Path]:
    """Packages in the models folder whose manifest names `repo` as their source."""
    found = []
    for manifest in sorted(models.glob(f"*/{MANIFEST}")):
        folder = manifest.parent
        if not is_package(folder):
            continue
        try:
            source = json.loads(manifest.read_text(encoding="utf-8")).get("source") or {}
        except (OSError, ValueError):
            continue
        if source.get("repo_id") == repo:
            found.append(folder)
    return found


def resolve_model(model: str, *, models_dir: Path | None = None, cache_dir: Path | None = None,
                  codec: str = "auto", progress: Callable | None = None) -> Path:
    """The FTW package folder for MODEL (see the module docstring); ResolveError when there is none."""
    if not model or not str(model).strip():
        raise ResolveError("no model given: name an FTW package folder, a Hugging Face model folder, "
                           "or a model from the library")
    if models_dir is None:
        from app.settings import Settings

        paths = user_paths(Settings().get("models_dir") or None)   # the setting, unless the environment wins
    else:
        paths = user_paths()
    models = Path(models_dir) if models_dir is not None else paths.models
    cache = Path(cache_dir) if cache_dir is not None else paths.cache

    def from_folder(folder: Path) -> Path:
        if is_package(folder):
            return folder
        if folder.name.endswith(PARTIAL_SUFFIX) or folder.with_name(folder.name + PARTIAL_SUFFIX).exists():
            raise ResolveError(f"{folder}: its conversion did not finish; run `freetoken convert` again to resume it")
        if is_checkpoint(folder):
            return convert_cached(folder, cache_dir=cache, codec=codec, progress=progress)
        raise ResolveError(f"{folder} is neither an FTW package (no {MANIFEST}) nor a Hugging Face model folder "
                           "(config.json and .safetensors files)")

    candidate = Path(model).expanduser()
    if candidate.is_dir():
        return from_folder(candidate)
    looks_like_path = any(sep in str(model) for sep in ("\\",)) or str(model).startswith((".", "/", "~"))
    if looks_like_path:
        raise ResolveError(f"{model}: no such folder")

    named = models / model
    if named.is_dir():
        return from_folder(named)
    if model == DEMO_MODEL_NAME and not named.exists():
        log.info("%s is not in %s: making it (random weights)", model, models)
        try:
            return ensure_demo_model(models).path
        except (OSError, DemoError) as exc:
            raise ResolveError(f"could not make the demo model in {models}: {exc}") from exc
    if "/" in model:                                    # a hub repo id
        packages = _packages_from(models, model)
        if packages:
            return packages[0]
        download = models / model.replace("/", "--")
        if download.is_dir():
            return from_folder(download)
    available = sorted(p.name for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if models.is_dir() else []
    hint = f"; the library has: {', '.join(available)}" if available else "; the library is empty"
    raise ResolveError(f"no model named {model!r} in {models}{hint}")
