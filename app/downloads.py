"""The download manager: a persistent queue of hub repos fetched file by file, verified, resumable.

Built on huggingface_hub: `HfApi.model_info(files_metadata=True)` gives the commit, every file's size,
git blob id and LFS sha256; `hf_hub_url` and `build_hf_headers` give the URL (custom endpoint / mirror)
and the headers (the token huggingface_hub keeps, for gated repos); its shared HTTP session streams the
bytes. We stream ourselves rather than call `hf_hub_download` because a download manager must pause,
cap bandwidth, notice stalls and resume across restarts, none of which that call exposes.

A file is written to `<dest>/.download/<path>.part`, resumed with a Range request after a pause, an
error or a restart, hashed as it arrives, checked against the hub's checksum (LFS sha256, else the
git blob sha1) and only then renamed into place. A finished repo gets `source.json` (repo, revision,
checksums), which is what marks a download complete for the library and the FTW converter.

Threads: `concurrency` workers take files from the queue in order; listeners are called from those
threads (the desktop app forwards them to its own thread). The queue is saved in the data folder
(`downloads.json`) on every state change, so after a restart `DownloadManager(...).start()` resumes
every job that was running.
"""
from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

PARTIAL_DIR = ".download"
SOURCE_FILE = "source.json"
CHUNK_BYTES = 64 * 1024                 # small enough that pause, cancel and the cap act within a moment
DISK_MARGIN_BYTES = 256 * 1024 ** 2     # room left on the disk beyond the download itself
PROGRESS_EVERY_S = 0.25                 # listeners hear about progress at most this often per job
RATE_WINDOW_S = 5.0                     # rate and ETA over the last few seconds

QUEUED, DOWNLOADING, PAUSED, DONE, FAILED, CANCELLED = "queued", "downloading", "paused", "done", "failed", "cancelled"
ACTIVE_STATES = (QUEUED, DOWNLOADING)


class DownloadError(RuntimeError):
    """A download that cannot go on; the message names the repo, the file and the cause."""


class DiskSpaceError(DownloadError):
    pass


class _Retryable(Exception):
    """A transient failure: network error, stall, 5xx/429, truncated body, bad checksum."""


class _Interrupted(Exception):
    """The worker was asked to stop this file (pause, cancel, shutdown)."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5              # tries per file without progress before the job fails
    base_delay_s: float = 1.0      # backoff: base * 2^(attempt-1), jittered, capped
    max_delay_s: float = 30.0
    stall_timeout_s: float = 30.0  # no byte for this long on an open stream counts as a network error
    connect_timeout_s: float = 15.0
    checksum_retries: int = 1      # a file whose bytes do not hash right is fetched afresh this many times


@dataclass
class FileTask:
    path: str                      # path in the repo
    size: int
    sha256: str | None = None      # LFS files
    blob_id: str | None = None     # git blob sha1 (non-LFS files)
    state: str = QUEUED
    done: int = 0                  # bytes on disk (final or .part)
    error: str = ""
    rate: float = 0.0              # live, not persisted: bytes/s of this file over the last few seconds
    eta_s: float | None = None

    @property
    def expected(self) -> str:
        return f"sha256 {self.sha256}" if self.sha256 else f"git-sha1 {self.blob_id}"


@dataclass
class DownloadJob:
    id: str
    repo: str
    revision: str                  # the commit sha the files were listed at: every file comes from it
    dest: str
    files: list[FileTask]
    state: str = QUEUED
    error: str = ""
    requested_revision: str = "main"
    allow_patterns: list[str] | None = None
    created: float = field(default_factory=time.time)
    # live numbers, not persisted
    rate: float = 0.0              # bytes/s over the last few seconds
    eta_s: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def done_bytes(self) -> int:
        return sum(f.done for f in self.files)

    @property
    def dest_path(self) -> Path:
        return Path(self.dest)

    def snapshot(self) -> "DownloadJob":
        return DownloadJob(**{**self.__dict__, "files": [FileTask(**f.__dict__) for f in self.files]})

    def to_json(self) -> dict:
        data = asdict(self)
        for item in (data, *data["files"]):
            item.pop("rate"), item.pop("eta_s")
        return data

    def summary(self) -> str:
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        text = f"{self.repo}: {self.state} {pct:5.1f}% ({_human(self.done_bytes)} of {_human(self.total_bytes)})"
        if self.state == DOWNLOADING and self.rate:
            text += f" at {_human(self.rate)}/s"
            if self.eta_s is not None:
                text += f", {_duration(self.eta_s)} left"
        if self.error:
            text += f" — {self.error}"
        return text


@dataclass(frozen=True)
class DownloadEvent:
    kind: str                      # "added" | "progress" | "state" | "file_done" | "completed"
    job: DownloadJob               # a snapshot; safe to keep
    file: str | None = None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def repo_folder(models_dir: Path, repo: str) -> Path:
    """Where a repo's files go: `<models>/<org>--<name>` (the library uses the same rule)."""
    return Path(models_dir) / repo.replace("/", "--")


def select_files(paths: Iterable[str], allow_patterns: list[str] | None, ignore_patterns: list[str] | None = None) -> list[str]:
    """The repo files an allow/ignore pattern pair keeps (fnmatch, as huggingface_hub filters)."""
    kept = []
    for p in paths:
        if allow_patterns and not any(fnmatch.fnmatch(p, pat) for pat in allow_patterns):
            continue
        if ignore_patterns and any(fnmatch.fnmatch(p, pat) for pat in ignore_patterns):
            continue
        kept.append(p)
    return kept


class _RateLimiter:
    """A token bucket shared by every worker: the optional bandwidth cap."""

    def __init__(self, bytes_per_s: float):
        self.rate = float(bytes_per_s)
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def set_rate(self, bytes_per_s: float) -> None:
        with self.lock:
            self.rate = float(bytes_per_s)

    def wait(self, nbytes: int, stop: threading.Event) -> None:
        with self.lock:
            if self.rate <= 0:
                return
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + nbytes / self.rate
            delay = start - now
        if delay > 0:
            stop.wait(delay)


class _RateMeter:
    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, done: int) -> float:
        now = time.monotonic()
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        t0, d0 = self.samples[0]
        return (done - d0) / (now - t0) if now > t0 else 0.0


class DownloadManager:
    """A queue of repo downloads. Plain object: the CLI, the app and tests use it the same way."""

    def __init__(self, models_dir: Path, state_file: Path, *, endpoint: str | None = None,
                 token: str | bool | None = None, concurrency: int = 2, bandwidth_bytes_s: float = 0.0,
                 retry: RetryPolicy = RetryPolicy(), disk_usage: Callable[[Path], Any] = shutil.disk_usage,
                 open_part: Callable[[Path, str], Any] = open):
        """`disk_usage` and `open_part` are the free-space check and the write path; tests stand in a full disk."""
        self.models_dir = Path(models_dir)
        self.state_file = Path(state_file)
        self.endpoint = (endpoint or "").rstrip("/") or None
        self.token = token                     # None: the token huggingface_hub keeps (`hf auth login`)
        self.concurrency = max(1, int(concurrency))
        self.retry = retry
        self.disk_usage = disk_usage
        self.open_part = open_part
        self._limiter = _RateLimiter(bandwidth_bytes_s)
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._shutdown = threading.Event()
        self._jobs: dict[str, DownloadJob] = {}
        self._active: dict[tuple[str, str], threading.Event] = {}   # (job, file) -> stop flag of its worker
        self._finishing: set[str] = set()                            # jobs whose completion a worker claimed
        self._listeners: list[Callable[[DownloadEvent], None]] = []
        self._completion_hooks: list[Callable[[DownloadJob], None]] = []
        self._meters: dict[str, _RateMeter] = {}
        self._last_progress: dict[str, float] = {}
        self._workers: list[threading.Thread] = []
        self._load()

    # ----------------------------------------------------------------------------- public API

    def add_listener(self, callback: Callable[[DownloadEvent], None]) -> None:
        self._listeners.append(callback)

    def on_complete(self, hook: Callable[[DownloadJob], None]) -> None:
        """Called once per finished repo (after source.json is written): where conversion is offered or started."""
        self._completion_hooks.append(hook)

    def set_bandwidth(self, bytes_per_s: float) -> None:
        self._limiter.set_rate(bytes_per_s)

    def start(self) -> "DownloadManager":
        with self._lock:
            if self._workers:
                return self
            self._shutdown.clear()
            for i in range(self.concurrency):
                t = threading.Thread(target=self._worker, name=f"download-{i}", daemon=True)
                t.start()
                self._workers.append(t)
        return self

    def shutdown(self, *, wait: bool = True, timeout: float = 10.0) -> None:
        """Stop the workers; running files keep their .part and resume at the next start."""
        with self._lock:
            self._shutdown.set()
            for stop in self._active.values():
                stop.set()
            self._wake.notify_all()
            workers, self._workers = self._workers, []
        if wait:
            for t in workers:
                t.join(timeout)
        self._save()

    def add(self, repo: str, *, revision: str = "main", allow_patterns: list[str] | None = None,
            ignore_patterns: list[str] | None = None, dest: Path | None = None) -> DownloadJob:
        """Queue a repo. Lists its files at `revision` (pinning the commit), checks free disk first."""
        import httpx2
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        try:
            info = HfApi(endpoint=self.endpoint).model_info(repo, revision=revision, files_metadata=True,
                                                            token=self.token)
        except HfHubHTTPError as exc:
            raise DownloadError(f"{repo}: {_http_reason(exc)}") from exc
        except (OSError, httpx2.TransportError) as exc:
            raise DownloadError(f"{repo}: cannot reach the hub at {self.endpoint or 'huggingface.co'} ({exc})") from exc
        repo = info.id or repo                  # the hub's spelling, so folders and the library agree
        siblings = {s.rfilename: s for s in info.siblings or []}
        chosen = select_files(sorted(siblings), allow_patterns, ignore_patterns)
        if not chosen:
            raise DownloadError(f"{repo}: no file matches {allow_patterns or '*'}")
        files = []
        commit = info.sha or revision
        for path in chosen:
            parts = Path(path).parts
            if Path(path).is_absolute() or ".." in parts or path.startswith(("/", "\\")):
                raise DownloadError(f"{repo}: refusing the file name {path!r}: it points outside the model folder")
            s = siblings[path]
            if s.size is not None and (s.lfs or s.blob_id):
                files.append(FileTask(path=path, size=int(s.size), sha256=s.lfs.sha256 if s.lfs else None,
                                      blob_id=s.blob_id))
            else:
                files.append(self._file_from_headers(repo, commit, path))
        dest = Path(dest) if dest else repo_folder(self.models_dir, repo)
        job = DownloadJob(id=uuid.uuid4().hex[:12], repo=repo, revision=commit, dest=str(dest),
                          files=files, requested_revision=revision, allow_patterns=allow_patterns)
        self._scan_disk(job)
        self._check_disk(job)
        with self._lock:
            for other in list(self._jobs.values()):
                if other.dest != job.dest:
                    continue
                if other.state in ACTIVE_STATES + (PAUSED,):
                    raise DownloadError(f"{repo} is already in the download queue ({other.state}); resume it")
                del self._jobs[other.id]           # a finished or failed job for the same folder: replaced
            self._jobs[job.id] = job
            self._wake.notify_all()
        self._save()
        self._emit("added", job)
        return job

    def _file_from_headers(self, repo: str, revision: str, path: str) -> FileTask:
        """Size and checksum from the file's own headers, for mirrors whose file listing lacks them:
        `X-Linked-Size`/`X-Linked-Etag` (the LFS sha256) or `Content-Length`/`ETag` (the git blob sha1)."""
        import httpx2
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError

        url = hf_hub_url(repo, path, revision=revision, endpoint=self.endpoint)
        try:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint, retry_on_errors=True)
        except HfHubHTTPError as exc:
            raise DownloadError(f"{repo}: {path}: {_http_reason(exc)}") from exc
        except (OSError, httpx2.TransportError) as exc:
            raise DownloadError(f"{repo}: {path}: cannot read its metadata ({exc})") from exc
        if meta.size is None:
            raise DownloadError(f"{repo}: the hub gives no size for {path}")
        etag = (meta.etag or "").lower()
        sha256 = etag if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag) else None
        blob_id = etag if len(etag) == 40 and all(c in "0123456789abcdef" for c in etag) else None
        if not (sha256 or blob_id):
            log.warning("%s: %s: the server gives no checksum (ETag %r); only its size can be checked",
                        repo, path, meta.etag)
        return FileTask(path=path, size=int(meta.size), sha256=sha256, blob_id=blob_id)

    def jobs(self) -> list[DownloadJob]:
        with self._lock:
            return [j.snapshot() for j in sorted(self._jobs.values(), key=lambda j: j.created)]

    def job(self, job_id: str) -> DownloadJob:
        with self._lock:
            return self._get(job_id).snapshot()

    def pause(self, job_id: str) -> None:
        self._set_state(job_id, PAUSED, from_states=ACTIVE_STATES)

    def resume(self, job_id: str) -> None:
        """Resume a paused job, or retry a failed one (its files start from their .part)."""
        self._wait_idle(job_id)            # workers told to stop on pause/failure have let go of their files
        with self._lock:
            job = self._get(job_id)
            if job.state not in (PAUSED, FAILED):
                return
            for f in job.files:
                if f.state == FAILED:
                    f.state, f.error = QUEUED, ""
            job.error = ""
            self._scan_disk(job)
        self._check_disk(job)
        self._set_state(job_id, QUEUED, from_states=(PAUSED, FAILED))

    retry_job = resume

    def cancel(self, job_id: str, *, delete_files: bool = True) -> None:
        """Stop a job; its partial files go (and with `delete_files`, the finished ones of an unfinished repo)."""
        with self._lock:
            job = self._get(job_id)
            was_done = job.state == DONE
            self._stop_job(job)
            job.state = CANCELLED
        self._wait_idle(job_id)
        shutil.rmtree(job.dest_path / PARTIAL_DIR, ignore_errors=True)
        if delete_files and not was_done:
            for f in job.files:
                (job.dest_path / f.path).unlink(missing_ok=True)
        with self._lock:
            self._jobs.pop(job_id, None)
        self._save()
        self._emit("state", job)

    def wait(self, job_id: str, *, timeout: float | None = None,
             states: tuple[str, ...] = (DONE, FAILED, CANCELLED, PAUSED)) -> DownloadJob | None:
        """Block until the job reaches one of `states`; its snapshot, or None once it was cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                job = self._jobs.get(job_id)
                if job is None or job.state in states:
                    return job.snapshot() if job else None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"download {job_id} still {job.state} after {timeout} s")
                self._wake.wait(0.1 if remaining is None else min(remaining, 0.1))

    # ----------------------------------------------------------------------------- internals

    def _get(self, job_id: str) -> DownloadJob:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise DownloadError(f"no download with id {job_id}") from None

    def _set_state(self, job_id: str, state: str, *, from_states: tuple[str, ...]) -> None:
        with self._lock:
            job = self._get(job_id)
            if job.state not in from_states:
                return
            if state == PAUSED:
                self._stop_job(job)
            job.state = state
            self._wake.notify_all()
        self._save()
        self._emit("state", job)

    def _stop_job(self, job: DownloadJob) -> None:
        for (jid, _), stop in self._active.items():
            if jid == job.id:
                stop.set()

    def _wait_idle(self, job_id: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(jid == job_id for jid, _ in self._active) and time.monotonic() < deadline:
                self._wake.wait(0.05)

    def _scan_disk(self, job: DownloadJob) -> None:
        """What is already on disk: finished files (verified before they were renamed into place) and partials."""
        for f in job.files:
            final = job.dest_path / f.path
            part = job.dest_path / PARTIAL_DIR / (f.path + ".part")
            if f.state == DONE and final.is_file() and final.stat().st_size == f.size:
                f.done = f.size
            elif part.is_file():
                f.done, f.state = min(part.stat().st_size, f.size), QUEUED
            else:
                f.done = 0
                if f.state == DONE:
                    f.state = QUEUED

    def _check_disk(self, job: DownloadJob) -> None:
        need = sum(f.size - f.done for f in job.files if f.state != DONE)
        probe = job.dest_path
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        try:
            free = int(self.disk_usage(probe).free)
        except OSError as exc:
            log.warning("cannot read free disk at %s: %s", probe, exc)
            return
        if need + DISK_MARGIN_BYTES > free:
            raise DiskSpaceError(f"{job.repo}: not enough disk space at {probe}: the download needs "
                                 f"{_human(need)} (+{_human(DISK_MARGIN_BYTES)} margin), {_human(free)} free")

    def _emit(self, kind: str, job: DownloadJob, file: str | None = None) -> None:
        with self._lock:
            snap = job.snapshot()
        for listener in list(self._listeners):
            try:
                listener(DownloadEvent(kind, snap, file))
            except Exception:      # a listener's bug must not kill a download worker
                log.exception("download listener failed")

    def _progress(self, job: DownloadJob, *, task: FileTask | None = None, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if task is not None:
                file_meter = self._meters.setdefault(f"{job.id}/{task.path}", _RateMeter())
                task.rate = file_meter.add(task.done)
                task.eta_s = (task.size - task.done) / task.rate if task.rate > 0 else None
            meter = self._meters.setdefault(job.id, _RateMeter())
            job.rate = meter.add(job.done_bytes)
            remaining = job.total_bytes - job.done_bytes
            job.eta_s = remaining / job.rate if job.rate > 0 else None
            if not force and now - self._last_progress.get(job.id, 0.0) < PROGRESS_EVERY_S:
                return
            self._last_progress[job.id] = now
        self._emit("progress", job)

    # ----------------------------------------------------------------------------- persistence

    def _load(self) -> None:
        if not self.state_file.exists():
            return
        try:
            raw = json.loads(self.state_file.read_text(encoding="utf-8"))
            for item in raw.get("jobs", []):
                files = [FileTask(**f) for f in item.pop("files")]
                job = DownloadJob(files=files, **item)
                if job.state == DOWNLOADING:
                    job.state = QUEUED            # it was running when the app stopped: carry on
                for f in job.files:
                    if f.state == DOWNLOADING:
                        f.state = QUEUED
                self._scan_disk(job)
                self._jobs[job.id] = job
        except (OSError, ValueError, TypeError, KeyError) as exc:
            bad = self.state_file.with_suffix(".bad.json")
            log.error("download queue %s is unreadable (%s); moved to %s", self.state_file, exc, bad)
            os.replace(self.state_file, bad)
            self._jobs.clear()

    def _save(self) -> None:
        with self._save_lock:            # snapshot and write in one step: an older snapshot never lands last
            self._save_locked()

    def _save_locked(self) -> None:
        with self._lock:
            data = {"version": 1, "jobs": [j.to_json() for j in self._jobs.values()]}
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.state_file.parent, prefix=".downloads-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1)
            os.replace(tmp, self.state_file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # ----------------------------------------------------------------------------- workers

    def _next_task(self) -> tuple[DownloadJob, FileTask, threading.Event] | None:
        for job in sorted(self._jobs.values(), key=lambda j: j.created):
            if job.state not in ACTIVE_STATES:
                continue
            for f in job.files:
                if f.state == QUEUED and (job.id, f.path) not in self._active:
                    stop = threading.Event()
                    self._active[(job.id, f.path)] = stop
                    f.state = DOWNLOADING
                    if job.state == QUEUED:
                        job.state = DOWNLOADING
                    return job, f, stop
        return None

    def _worker(self) -> None:
        while not self._shutdown.is_set():
            with self._lock:
                picked = self._next_task()
                if picked is None:
                    self._wake.wait(0.5)
                    continue
            job, task, stop = picked
            self._emit("state", job, task.path)
            try:
                self._fetch(job, task, stop)
            except _Interrupted:
                with self._lock:
                    if task.state == DOWNLOADING:
                        task.state = QUEUED     # paused, cancelled or shut down: picks up from the .part
            except (DownloadError, OSError, ValueError) as exc:
                # OSError/ValueError: the file system or a server answer we did not foresee; the job fails
                # with the cause instead of the worker thread dying and the job hanging
                message = str(exc) if isinstance(exc, DownloadError) else f"{job.repo}: {task.path}: {exc}"
                with self._lock:
                    task.state, task.error = FAILED, message
                    if job.state in ACTIVE_STATES:
                        job.state, job.error = FAILED, message
                        self._stop_job(job)
                log.error("%s", message, exc_info=not isinstance(exc, DownloadError))
            finally:
                with self._lock:
                    self._active.pop((job.id, task.path), None)
                    self._meters.pop(f"{job.id}/{task.path}", None)
                    task.rate, task.eta_s = 0.0, None
                    self._wake.notify_all()
            self._after_file(job, task)

    def _after_file(self, job: DownloadJob, task: FileTask) -> None:
        with self._lock:
            busy = any(jid == job.id for jid, _ in self._active)
            # the last two files may finish together: exactly one worker claims the job's completion
            finished = (job.state in ACTIVE_STATES and not busy and job.id not in self._finishing
                        and all(f.state == DONE for f in job.files))
            if finished:
                self._finishing.add(job.id)
        if task.state == DONE:
            self._emit("file_done", job, task.path)
        if finished:
            try:
                self._finish(job)
            except OSError as exc:
                with self._lock:
                    job.state, job.error = FAILED, f"{job.repo}: cannot write {SOURCE_FILE} ({exc})"
            finally:
                with self._lock:
                    self._finishing.discard(job.id)
        self._save()
        self._progress(job, force=True)
        self._emit("state", job, task.path)
        if finished and job.state == DONE:
            self._emit("completed", job)
            for hook in list(self._completion_hooks):
                try:
                    hook(job.snapshot())
                except Exception:
                    log.exception("download completion hook failed for %s", job.repo)

    def _finish(self, job: DownloadJob) -> None:
        source = {"repo_id": job.repo, "revision": job.revision, "endpoint": self.endpoint,
                  "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "files": {f.path: {"size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in job.files}}
        tmp = job.dest_path / (SOURCE_FILE + ".tmp")
        tmp.write_text(json.dumps(source, indent=1), encoding="utf-8")
        os.replace(tmp, job.dest_path / SOURCE_FILE)
        shutil.rmtree(job.dest_path / PARTIAL_DIR, ignore_errors=True)
        with self._lock:
            job.state, job.error = DONE, ""

    def _fetch(self, job: DownloadJob, task: FileTask, stop: threading.Event) -> None:
        final = job.dest_path / task.path
        part = job.dest_path / PARTIAL_DIR / (task.path + ".part")
        if final.is_file() and final.stat().st_size == task.size and self._verify_file(final, task):
            with self._lock:
                task.done, task.state = task.size, DONE
            return
        part.parent.mkdir(parents=True, exist_ok=True)
        failures, checksum_failures = 0, 0
        while True:
            if stop.is_set() or self._shutdown.is_set():
                raise _Interrupted
            before = part.stat().st_size if part.exists() else 0
            try:
                digest = self._stream(job, task, part, stop)
                self._verify_part(digest, task)
                final.parent.mkdir(parents=True, exist_ok=True)     # repo files may sit in subfolders
                os.replace(part, final)
                with self._lock:
                    task.state, task.done, task.error = DONE, task.size, ""
                return
            except _ChecksumMismatch as exc:
                part.unlink(missing_ok=True)
                with self._lock:
                    task.done = 0
                checksum_failures += 1
                if checksum_failures > self.retry.checksum_retries:
                    raise DownloadError(f"{job.repo}: {task.path}: checksum mismatch ({exc}); the file was "
                                        f"rejected and deleted") from None
                log.warning("%s: %s: checksum mismatch (%s); fetching it again", job.repo, task.path, exc)
            except _Retryable as exc:
                after = part.stat().st_size if part.exists() else 0
                failures = 1 if after > before else failures + 1    # progress resets the count
                if failures >= self.retry.attempts:
                    raise DownloadError(f"{job.repo}: {task.path}: {exc} (gave up after {failures} attempts)") from None
                delay = min(self.retry.max_delay_s, self.retry.base_delay_s * 2 ** (failures - 1))
                delay *= 0.5 + random.random() / 2
                log.warning("%s: %s: %s; retrying in %.1f s", job.repo, task.path, exc, delay)
                if stop.wait(delay):
                    raise _Interrupted from None

    def _headers(self, offset: int) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers(token=self.token, library_name="freetoken")
        headers["Accept-Encoding"] = "identity"     # sizes and ranges are of the bytes on the hub
        if offset:
            headers["Range"] = f"bytes={offset}-"
        return headers

    def _stream(self, job: DownloadJob, task: FileTask, part: Path, stop: threading.Event) -> str:
        """Bring `part` to the file's full size; returns its digest, hashed as the bytes arrive (a resumed
        file's prefix is hashed from disk first), so verifying costs no second read of the file."""
        import httpx2
        from huggingface_hub import hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import get_session, hf_raise_for_status

        offset = part.stat().st_size if part.exists() else 0
        if offset > task.size:
            part.unlink()
            offset = 0
        with self._lock:
            task.done = offset
        hasher = _new_hasher(task)
        if offset:
            with open(part, "rb") as fh:
                while chunk := fh.read(4 * 1024 * 1024):
                    hasher.update(chunk)
        if offset == task.size:
            return hasher.hexdigest()
        url = hf_hub_url(job.repo, task.path, revision=job.revision, endpoint=self.endpoint)
        timeout = httpx2.Timeout(self.retry.stall_timeout_s, connect=self.retry.connect_timeout_s)
        try:
            with get_session().stream("GET", url, headers=self._headers(offset), timeout=timeout) as resp:
                if resp.status_code == 416:                    # our partial is stale: start over
                    part.unlink(missing_ok=True)
                    raise _Retryable("the server refused the resume range")
                if resp.status_code >= 400:
                    resp.read()
                    try:
                        hf_raise_for_status(resp)
                    except HfHubHTTPError as exc:
                        if resp.status_code >= 500 or resp.status_code in (408, 429):
                            raise _Retryable(f"server error {resp.status_code}") from None
                        raise DownloadError(f"{job.repo}: {task.path}: {_http_reason(exc)}") from None
                mode = "ab"
                if offset and resp.status_code == 200:         # the server ignored Range: whole file again
                    mode, offset, hasher = "wb", 0, _new_hasher(task)
                try:
                    with self.open_part(part, mode) as fh:
                        received = offset
                        for chunk in resp.iter_bytes(CHUNK_BYTES):
                            if stop.is_set() or self._shutdown.is_set():
                                raise _Interrupted
                            self._limiter.wait(len(chunk), stop)
                            fh.write(chunk)
                            hasher.update(chunk)
                            received += len(chunk)
                            with self._lock:
                                task.done = min(received, task.size)
                            self._progress(job, task=task)
                        fh.flush()
                        os.fsync(fh.fileno())
                except OSError as exc:
                    self._write_failed(exc, job, task, part)
        except httpx2.TransportError as exc:   # connect errors, read timeouts (stalls), bodies cut short
            kind = "stalled" if isinstance(exc, httpx2.TimeoutException) else "network error"
            raise _Retryable(f"{kind}: {exc or type(exc).__name__}") from None
        size = part.stat().st_size
        if size != task.size:
            raise _Retryable(f"got {size} of {task.size} bytes")
        return hasher.hexdigest()

    def _write_failed(self, exc: OSError, job: DownloadJob, task: FileTask, part: Path) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            part.unlink(missing_ok=True)             # nothing half-written is left behind
            with self._lock:
                task.done = 0
            raise DownloadError(f"{job.repo}: {task.path}: disk full at {job.dest} — free "
                                f"{_human(task.size)} or more and resume") from None
        raise DownloadError(f"{job.repo}: {task.path}: cannot write {part} ({exc})") from None

    def _verify_part(self, actual: str, task: FileTask) -> None:
        wanted = task.sha256 or task.blob_id
        if wanted and actual != wanted:
            raise _ChecksumMismatch(f"expected {task.expected}, got {actual}")

    def _verify_file(self, path: Path, task: FileTask) -> bool:
        wanted = task.sha256 or task.blob_id
        return not wanted or _file_digest(path, task) == wanted


class _ChecksumMismatch(Exception):
    pass


def _new_hasher(task: FileTask):
    """LFS files: sha256 of the content. Git files: the blob sha1 (`sha1("blob <size>\\0" + content)`)."""
    return hashlib.sha256() if task.sha256 else hashlib.sha1(b"blob %d\0" % task.size)


def _file_digest(path: Path, task: FileTask) -> str:
    if path.stat().st_size != task.size:
        return ""
    h = _new_hasher(task)
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def _http_reason(exc: Exception) -> str:
    """A hub error in words a user can act on."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if isinstance(exc, GatedRepoError):
        return ("this model is gated: accept its licence on the model's hub page, then log in with "
                "`hf auth login` (FreeToken uses the token huggingface_hub keeps)")
    if isinstance(exc, RepositoryNotFoundError):
        return "repository not found (check the name; private repos need a token)"
    if isinstance(exc, RevisionNotFoundError):
        return "revision not found"
    if isinstance(exc, EntryNotFoundError):
        return "file not found in the repository"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return f"hub answered {status}" if status else str(exc).splitlines()[0]
