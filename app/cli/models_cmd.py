"""`freetoken models`: the catalog and the local models with fit badges; hub search; delete.

    freetoken models [list] [--context N] [--json]     catalog + local, status and fit on this machine
    freetoken models search [QUERY] [--arch T] [--quant Q] [--all]
    freetoken models show REPO                          card basics, files, support verdict
    freetoken models delete KEY [--keep-source | --keep-package]
"""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("models", help="list, search and delete models (with fit on this machine)")
    p.set_defaults(run=run, models_action="list", context=None, json=False, cpu_gbps=None, vram_budget_gib=None)
    actions = p.add_subparsers(dest="models_action", metavar="ACTION")

    ls = actions.add_parser("list", help="catalog and local models with status and fit (the default)")
    for parser in (p, ls):
        parser.add_argument("--context", type=int, help="context length the KV cache is sized for "
                                                        "(default: the context_length setting)")
        parser.add_argument("--vram-budget-gib", type=float, help="cap on VRAM (default: the setting)")
        parser.add_argument("--cpu-gbps", type=float, help="CPU read bandwidth in GB/s (default: measured now)")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    search = actions.add_parser("search", help="search the hub for MoE models")
    search.add_argument("query", nargs="?", default="")
    search.add_argument("--author")
    search.add_argument("--arch", action="append", help="model_type in config.json (repeatable), e.g. qwen3_moe")
    search.add_argument("--quant", choices=("none", "fp8", "mxfp4", "nvfp4"), help="quantization of the weights")
    search.add_argument("--all", action="store_true", help="also list models FreeToken cannot run")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true")

    show = actions.add_parser("show", help="one hub model: card basics, files, whether FreeToken runs it")
    show.add_argument("repo")
    show.add_argument("--json", action="store_true")

    delete = actions.add_parser("delete", help="delete a local model's files")
    delete.add_argument("key", help="hub repo id or catalog id")
    keep = delete.add_mutually_exclusive_group()
    keep.add_argument("--keep-source", action="store_true", help="delete only the converted package")
    keep.add_argument("--keep-package", action="store_true", help="delete only the downloaded checkpoint")


def _gib(n: int) -> str:
    from app.downloads import _human

    return _human(n)


def run(args) -> int:
    from app.paths import user_paths
    from app.settings import Settings

    settings = Settings()
    paths = user_paths(settings.get("models_dir") or None)
    endpoint = settings.get("hf_endpoint") or None
    action = args.models_action or "list"
    if action == "list":
        return _list(args, settings, paths)
    if action in ("search", "show"):
        from app.hub import HubBrowser, HubError

        browser = HubBrowser(endpoint=endpoint)
        try:
            if action == "search":
                found = browser.search(args.query, author=args.author, model_types=args.arch, quantization=args.quant,
                                       supported_only=not args.all, limit=args.limit)
                if args.json:
                    print(json.dumps([vars(m) for m in found], indent=2))
                else:
                    for m in found:
                        print(m.line())
                    if not found:
                        print("no matching MoE models", file=sys.stderr)
                return 0
            d = browser.details(args.repo)
        except HubError as exc:
            print(f"freetoken models: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({**vars(d), "files": [vars(f) for f in d.files]}, indent=2, default=str))
            return 0
        print(f"{d.repo} @ {d.revision[:12]}")
        print(f"  architecture: {d.model_type} {d.architectures}; quantization: {d.quantization}")
        print(f"  licence: {d.licence or 'not stated'}; gated: {'yes' if d.gated else 'no'}; "
              f"parameters: {d.params / 1e9:.2f}B" if d.params else f"  licence: {d.licence or 'not stated'}")
        print(f"  FreeToken: {'runs it' if d.supported else d.reason}")
        print(f"  files: {len(d.files)}, {_gib(d.download_size())} in all; weights "
              f"{_gib(d.download_size(['*.safetensors']))}")
        return 0
    if action == "delete":
        from app.downloads import DownloadManager
        from app.library import Library, LibraryError

        lib = Library(paths.models, downloads=DownloadManager(paths.models, paths.data / "downloads.json"))
        try:
            freed = lib.delete(args.key, source=not args.keep_source, packages=not args.keep_package)
        except LibraryError as exc:
            print(f"freetoken models: {exc}", file=sys.stderr)
            return 1
        print(f"deleted {args.key}: {_gib(freed)} freed")
        return 0
    return 2


def _list(args, settings, paths) -> int:
    from app.downloads import DownloadManager
    from app.fit import estimate, fit_catalog, local_fit_inputs, machine_from_report
    from app.hardware import probe
    from app.library import Library

    context = args.context or settings.get("context_length")
    budget = args.vram_budget_gib if args.vram_budget_gib is not None else settings.get("vram_budget_gib")
    vram_budget = int(budget * 1024 ** 3) if budget else None
    report = probe(paths.models)
    machine = machine_from_report(report, cpu_read_gbps=args.cpu_gbps)     # measures the CPU once when not given
    fits = {f.id: f for f in fit_catalog(report, context_length=context, vram_budget=vram_budget, machine=machine)}
    lib = Library(paths.models, downloads=DownloadManager(paths.models, paths.data / "downloads.json"))
    rows = []
    for model in lib.models():
        fit = fits.get(model.catalog.id) if model.catalog else None
        if fit is None and model.catalog is None:
            # a model outside the catalog: its package's manifest or its config.json
            inputs = local_fit_inputs(model.source_dir, model.package_dir)
            if inputs is not None:
                config, options = inputs
                fit = estimate(config, machine=machine, context_length=context, vram_budget=vram_budget,
                               id=model.key, name=model.key, **options)
        rows.append({
            "key": model.key, "id": model.catalog.id if model.catalog else None,
            "name": model.catalog.name if model.catalog else model.key, "status": model.status,
            "detail": model.detail, "bytes_on_disk": model.bytes_on_disk,
            "download_bytes": model.catalog.download_bytes if model.catalog else None,
            "total_params": model.catalog.total_params if model.catalog else None,
            "active_params": model.catalog.active_params if model.catalog else None,
            "fit": fit.to_dict() if fit else None,
            "fit_badge": fit.badge if fit else "", "speed": fit.speed_text if fit else "",
        })
    if args.json:
        print(json.dumps({"context_length": context, "machine": report.gpu_status, "models": rows}, indent=2,
                         default=str))
        return 0
    print(f"Fit on this machine at {context:,} tokens of context ({report.gpu_status}). Speeds are estimates.")
    for row in rows:
        size = f"{row['total_params'] / 1e9:.0f}B/{row['active_params'] / 1e9:.1f}B, {row['download_bytes'] / 1e9:.0f} GB" \
            if row["total_params"] else f"{_gib(row['bytes_on_disk'])} on disk"
        print(f"{row['name']:<34} {row['status']:<17} {size:<22} {row['fit_badge']}")
        if row["speed"]:
            print(f"{'':<34} {row['speed']}")
        if row["status"] not in ("not downloaded", "ready") and row["detail"]:
            print(f"{'':<34} {row['detail']}")
    return 0
