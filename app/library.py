"""Local models: what is in the models folder, what state each is in, and deleting them.

Layout of the models folder (docs/library.md):

    <models>/<org>--<name>/                downloaded checkpoint; complete when source.json is there
    <models>/<org>--<name>/.download/      partial files of a running or paused download
    <models>/<package>/manifest.json       a converted FTW package (`freetoken convert` names it
                                           <name>-<codec>); its manifest names the source repo
    <models>/<package>.partial/            a conversion in progress or interrupted (it resumes)

Status of a model, in the order a user meets them: not downloaded -> downloading -> needs conversion
-> converting -> ready. A model is "ready" as soon as a complete package exists, whether or not its
source checkpoint was kept.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app.catalog import CatalogEntry, load_catalog
from app.downloads import ACTIVE_STATES, PARTIAL_DIR, PAUSED, SOURCE_FILE, DownloadJob, DownloadManager, repo_folder

log = logging.getLogger(__name__)

NOT_DOWNLOADED = "not downloaded"
DOWNLOADING = "downloading"
NEEDS_CONVERSION = "needs conversion"
CONVERTING = "converting"
READY = "ready"
PARTIAL_SUFFIX = ".partial"          # runtime/ftw/writer.py: a package being written
PACKAGE_CODECS = ("int4", "fp4", "bf16", "f32")   # the codec suffixes of `freetoken convert`'s default names


class LibraryError(RuntimeError):
    pass


@dataclass
class LocalModel:
    key: str                          # the hub repo id when known, else the folder name
    status: str
    detail: str = ""
    repo: str | None = None
    source_dir: Path | None = None    # the downloaded checkpoint
    package_dirs: tuple[Path, ...] = ()   # complete FTW packages made from it
    partial_dirs: tuple[Path, ...] = ()   # conversions in progress or interrupted
    catalog: CatalogEntry | None = None
    download: DownloadJob | None = None
    bytes_on_disk: int = 0

    @property
    def package_dir(self) -> Path | None:
        return self.package_dirs[0] if self.package_dirs else None


def folder_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class Library:
    """The models folder as the user sees it. Plain object; reads the disk on every call (no cache to go stale)."""

    def __init__(self, models_dir: Path, *, downloads: DownloadManager | None = None,
                 catalog: list[CatalogEntry] | None = None):
        self.models_dir = Path(models_dir)
        self.downloads = downloads
        self.catalog = catalog if catalog is not None else load_catalog()

    def _packages(self) -> tuple[dict[str, list[Path]], list[Path]]:
        """(source repo or folder -> complete packages, partial package folders)."""
        complete: dict[str, list[Path]] = {}
        partial: list[Path] = []
        if not self.models_dir.is_dir():
            return complete, partial
        for child in sorted(self.models_dir.iterdir()):
            if not child.is_dir():
                continue
            if child.name.endswith(PARTIAL_SUFFIX):
                partial.append(child)
                continue
            manifest = _read_json(child / "manifest.json")
            if manifest and manifest.get("format") == "ftw":
                source = manifest.get("source") or {}
                key = source.get("repo_id") or source.get("folder") or child.name
                complete.setdefault(key, []).append(child)
        return complete, partial

    def models(self, *, include_catalog: bool = True) -> list[LocalModel]:
        """Every model the user has or may get: catalog entries first (in catalog order), then the rest."""
        jobs: dict[str, DownloadJob] = {}
        if self.downloads is not None:
            for job in self.downloads.jobs():
                jobs[str(Path(job.dest).resolve())] = job
        jobs_by_repo = {job.repo: job for job in jobs.values()}     # jobs downloading to a folder of their own
        packages, partials = self._packages()
        keys: list[str] = []
        sources: dict[str, Path] = {}
        # Downloaded checkpoints: folders with a config.json, or a download in progress.
        if self.models_dir.is_dir():
            for child in sorted(self.models_dir.iterdir()):
                if not child.is_dir() or child.name.endswith(PARTIAL_SUFFIX) or (child / "manifest.json").exists():
                    continue
                if (child / "config.json").exists() or (child / SOURCE_FILE).exists() or (child / PARTIAL_DIR).exists() \
                        or str(child.resolve()) in jobs:
                    meta = _read_json(child / SOURCE_FILE) or {}
                    key = meta.get("repo_id") or child.name.replace("--", "/", 1)
                    sources[key] = child
        if include_catalog:
            keys.extend(e.repo for e in self.catalog)
        queued = [j.repo for j in jobs.values()]         # a queued repo may have no folder yet
        keys.extend(dict.fromkeys(k for k in list(sources) + list(packages) + queued if k not in keys))
        by_repo = {e.repo: e for e in self.catalog}
        out = []
        for key in keys:
            entry = by_repo.get(key)
            src = sources.get(key) or (repo_folder(self.models_dir, key) if "/" in key else None)
            job = (jobs.get(str(src.resolve())) if src is not None else None) or jobs_by_repo.get(key)
            pkgs = tuple(dict.fromkeys(packages.get(key, []) + ([] if src is None else packages.get(src.name, []))))
            base = key.split("/")[-1]
            # `freetoken convert` writes <name>-<codec>.partial; match the name exactly, not as a prefix
            # (Qwen3-30B-A3B must not claim Qwen3-30B-A3B-Instruct-2507's conversion)
            parts = tuple(p for p in partials if p.name[:-len(PARTIAL_SUFFIX)] in
                          {f"{base}-{codec}" for codec in PACKAGE_CODECS})
            out.append(self._status(key, entry, src if src is not None and src.exists() else None, job, pkgs, parts))
        return out

    def _status(self, key: str, entry: CatalogEntry | None, src: Path | None, job: DownloadJob | None,
                pkgs: tuple[Path, ...], parts: tuple[Path, ...]) -> LocalModel:
        model = LocalModel(key=key, status=NOT_DOWNLOADED, repo=key if "/" in key else None, source_dir=src,
                           package_dirs=pkgs, partial_dirs=parts, catalog=entry, download=job)
        model.bytes_on_disk = sum(folder_size(p) for p in (src, *pkgs, *parts) if p is not None)
        complete_source = src is not None and (src / SOURCE_FILE).exists()
        if pkgs:
            model.status, model.detail = READY, ", ".join(p.name for p in pkgs)
        elif parts:
            model.status, model.detail = CONVERTING, f"{parts[0].name} (an interrupted conversion resumes where it stopped)"
        elif job is not None and job.state in ACTIVE_STATES + (PAUSED, "failed"):
            model.status = DOWNLOADING
            model.detail = job.summary()
        elif complete_source:
            model.status, model.detail = NEEDS_CONVERSION, f"freetoken convert {src}"
        elif src is not None and (src / PARTIAL_DIR).exists():
            model.status, model.detail = DOWNLOADING, "interrupted: resumes when the download queue starts"
        elif src is not None and (src / "config.json").exists():
            # a folder the user copied in by hand (no source.json): convertible if it is complete
            model.status, model.detail = NEEDS_CONVERSION, f"freetoken convert {src} (not downloaded by FreeToken)"
        return model

    def get(self, key: str) -> LocalModel:
        for model in self.models():
            if model.key.lower() == key.lower() or (model.catalog and model.catalog.id == key.lower()):
                return model
        raise LibraryError(f"no model {key!r} in the catalog or in {self.models_dir}")

    def delete(self, key: str, *, source: bool = True, packages: bool = True) -> int:
        """Delete a model's files (its checkpoint, its packages, or both); returns the bytes freed.

        A model that is downloading must be cancelled first: deleting under a running download would
        leave it writing into a folder that no longer exists."""
        model = self.get(key)
        if model.status == DOWNLOADING and model.download is not None and model.download.state in ACTIVE_STATES:
            raise LibraryError(f"{model.key} is downloading; cancel the download first")
        targets = []
        if source and model.source_dir is not None:
            targets.append(model.source_dir)
        if packages:
            targets.extend(model.package_dirs)
            targets.extend(model.partial_dirs)
        root = self.models_dir.resolve()
        freed = 0
        for path in targets:
            resolved = path.resolve()
            if root not in resolved.parents:
                raise LibraryError(f"refusing to delete {path}: it is not inside the models folder {root}")
            freed += folder_size(resolved)
            shutil.rmtree(resolved)
            log.info("deleted %s", resolved)
        if source and model.download is not None and self.downloads is not None:
            self.downloads.cancel(model.download.id, delete_files=False)   # forget the finished/paused job
        return freed


def conversion_hook(*, auto_convert: bool, convert: Callable[[Path], None],
                    offer: Callable[[Path], None]) -> Callable[[DownloadJob], None]:
    """What happens when a download completes (DownloadManager.on_complete): start the conversion
    (the `auto_convert` setting) or offer it. `convert` and `offer` are the app's (a QProcess job running
    `freetoken convert`, a notification); the CLI passes its own."""

    def hook(job: DownloadJob) -> None:
        (convert if auto_convert else offer)(Path(job.dest))

    return hook
