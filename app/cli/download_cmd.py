"""`freetoken download REPO [--include PATTERN]`: fetch a model from the hub, verified, with progress.

REPO is a hub repo id (org/name) or a catalog id (`freetoken models` lists them). Ctrl-C pauses: the
queue is saved and the same command resumes where it stopped. When the download completes the model
is converted to FTW (`--convert`, or the auto_convert setting) or the command to do it is printed.
"""
from __future__ import annotations

import json
import sys
import threading
import time


def register(sub) -> None:
    p = sub.add_parser("download", help="download a model from the Hugging Face hub (resumable, verified)")
    p.add_argument("repo", help="hub repo id (org/name) or catalog id")
    p.add_argument("--include", action="append", metavar="PATTERN",
                   help="only files matching this glob (repeatable; default: the catalog's list, else everything)")
    p.add_argument("--exclude", action="append", metavar="PATTERN", help="skip files matching this glob (repeatable)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.add_argument("--endpoint", help="hub endpoint or mirror URL (default: the hf_endpoint setting)")
    p.add_argument("--concurrency", type=int, help="files at once (default: the download_concurrency setting)")
    p.add_argument("--bandwidth", type=float, metavar="MIB_S", help="cap in MiB/s (default: the setting; 0: none)")
    conv = p.add_mutually_exclusive_group()
    conv.add_argument("--convert", action="store_true", help="convert to FTW when the download completes")
    conv.add_argument("--no-convert", action="store_true", help="do not convert, even if auto_convert is on")
    p.add_argument("--force", action="store_true", help="download even if FreeToken cannot run the architecture")
    p.add_argument("--progress-json", action="store_true", help="progress as JSON lines on stdout (for the app)")
    p.set_defaults(run=run)


def _print_progress(job, *, as_json: bool, tty: bool) -> None:
    if as_json:
        print(json.dumps({"event": "progress", "repo": job.repo, "state": job.state, "done": job.done_bytes,
                          "total": job.total_bytes, "rate": job.rate, "eta_s": job.eta_s,
                          "files": [{"path": f.path, "done": f.done, "size": f.size, "state": f.state}
                                    for f in job.files]}), flush=True)
    elif tty:
        print("\r" + job.summary()[:150].ljust(150), end="", file=sys.stderr, flush=True)
    else:
        print(job.summary(), file=sys.stderr, flush=True)


def run(args) -> int:
    from app.catalog import find_entry
    from app.downloads import DONE, FAILED, PAUSED, DownloadError, DownloadManager, repo_folder
    from app.hub import HubBrowser, HubError
    from app.paths import user_paths
    from app.settings import Settings

    settings = Settings()
    paths = user_paths(settings.get("models_dir") or None).ensure()
    endpoint = args.endpoint or settings.get("hf_endpoint") or None
    entry = find_entry(args.repo)
    repo = entry.repo if entry else args.repo
    if "/" not in repo:
        print(f"freetoken download: {args.repo!r} is neither a catalog id nor a hub repo id (org/name)", file=sys.stderr)
        return 2
    include = args.include or (list(entry.allow_patterns) if entry else None)

    if not args.force:
        try:
            details = HubBrowser(endpoint=endpoint).details(repo, revision=args.revision)
        except HubError as exc:
            print(f"freetoken download: {exc}", file=sys.stderr)
            return 1
        if not details.supported:
            print(f"freetoken download: {repo}: {details.reason} (use --force to download anyway)", file=sys.stderr)
            return 1

    bandwidth = args.bandwidth if args.bandwidth is not None else settings.get("download_bandwidth_mib_s")
    manager = DownloadManager(paths.models, paths.data / "downloads.json", endpoint=endpoint,
                              concurrency=args.concurrency or settings.get("download_concurrency"),
                              bandwidth_bytes_s=bandwidth * 1024 ** 2)
    dest = str(repo_folder(paths.models, repo))
    job = next((j for j in manager.jobs() if j.dest == dest and j.state != DONE), None)
    try:
        if job is not None:
            print(f"resuming {repo} ({job.summary()})", file=sys.stderr)
            manager.resume(job.id)
        else:
            job = manager.add(repo, revision=args.revision, allow_patterns=include, ignore_patterns=args.exclude)
    except DownloadError as exc:
        print(f"freetoken download: {exc}", file=sys.stderr)
        return 1

    tty = sys.stderr.isatty()
    last = [0.0]
    # Download workers report from their own threads: one line at a time, or JSON lines interleave.
    printing = threading.Lock()

    def on_event(event) -> None:
        if event.job.id != job.id or event.kind != "progress":
            return
        with printing:
            now = time.monotonic()
            if args.progress_json or tty or now - last[0] >= 2.0:
                last[0] = now
                _print_progress(event.job, as_json=args.progress_json, tty=tty)

    manager.add_listener(on_event)
    manager.start()
    try:
        final = manager.wait(job.id)
    except KeyboardInterrupt:
        manager.pause(job.id)
        manager.shutdown()
        print(f"\npaused {repo}; run the same command to resume", file=sys.stderr)
        return 130
    manager.shutdown()
    if final is None:
        print(f"\nthe download of {repo} was cancelled", file=sys.stderr)
        return 1
    if tty and not args.progress_json:
        print(file=sys.stderr)
    if final.state == FAILED:
        print(f"freetoken download: {final.error}", file=sys.stderr)
        return 1
    if final.state == PAUSED:
        print(f"{repo} is paused", file=sys.stderr)
        return 1
    print(f"downloaded {repo} ({final.total_bytes / 1024 ** 3:.2f} GiB, every file verified) to {final.dest}",
          file=sys.stderr)
    if args.progress_json:
        print(json.dumps({"event": "done", "repo": repo, "path": final.dest}), flush=True)
    convert = args.convert or (settings.get("auto_convert") and not args.no_convert)
    if not convert:
        print(f"convert it with: freetoken convert {final.dest}", file=sys.stderr)
        return 0
    return _convert(final.dest, progress_json=args.progress_json)


def _convert(src: str, *, progress_json: bool) -> int:
    """Run `freetoken convert SRC` with its own defaults (parsed by its own parser, so they stay its)."""
    import argparse

    from app.cli import convert_cmd

    parser = argparse.ArgumentParser(prog="freetoken")
    convert_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["convert", src] + (["--progress-json"] if progress_json else []))
    return convert_cmd.run(args)
