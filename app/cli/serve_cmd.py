"""`freetoken serve [MODEL]`: the OpenAI/Anthropic API over one model, headless, until Ctrl+C / SIGTERM.

MODEL is resolved by app/resolve.py. Without MODEL: the one model in the library, or — when the library
is empty — the built-in demo model (created on first use; random weights, it writes gibberish). The
defaults of every option come from the settings (`server_host`, `server_port`, `api_key`, `device`,
`context_length`, `vram_budget_gib`). Binding anything but loopback needs an API key.
"""
from __future__ import annotations

import re
import sys

EXIT_BAD_ARGS, EXIT_LOAD_FAILED, EXIT_PORT = 2, 3, 4
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(b|kib|mib|gib|tib|kb|mb|gb|tb|k|m|g|t)?\s*$", re.IGNORECASE)
_UNITS = {None: 1 << 30, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
          "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """'6' (GiB), '6GiB', '512MiB', '8GB' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 6, 6GiB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower() if match.group(2) else None])


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic APIs (headless)",
                       description="Serve MODEL on a local OpenAI- and Anthropic-compatible API until interrupted. "
                                   "Without MODEL: the only model in the library, or the built-in demo model.")
    p.add_argument("model", nargs="?", metavar="MODEL", help="FTW folder, Hugging Face model folder, or library name")
    p.add_argument("--host", help="address to bind (default: the server_host setting, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: the server_port setting, 1919)")
    p.add_argument("--api-key", help="key clients must send (required to bind anything but loopback)")
    p.add_argument("--vram-budget", metavar="SIZE", help="cap on VRAM use: 6 (GiB), 6GiB, 512MiB")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where the engine runs")
    p.add_argument("--dense", choices=("auto", "int8", "model"),
                   help="dense weights on a GPU: int8, the model's precision, or auto (default: the setting)")
    p.add_argument("--context", type=int, metavar="N", help="context length in tokens")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests admitted at once before answering 429/529 (default 64)")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; '*' for any). Off by default")
    p.set_defaults(run=run)


def pick_model(model: str | None, models_dir, say) -> str:
    """MODEL as given, else the library's only model, else the demo model (created when missing)."""
    from pathlib import Path

    from app.resolve import is_checkpoint, is_package

    if model:
        return model
    models_dir = Path(models_dir)
    installed = sorted(p.name for p in models_dir.iterdir() if p.is_dir() and (is_package(p) or is_checkpoint(p))) \
        if models_dir.is_dir() else []
    if len(installed) == 1:
        return installed[0]
    if installed:
        raise ValueError(f"several models are installed ({', '.join(installed)}); name the one to serve")
    from app.demo import ensure_demo_model

    say("no model installed: serving the built-in demo model (random weights: it writes gibberish)")
    return str(ensure_demo_model(models_dir, progress=say).path)


def run(args) -> int:
    import signal
    import threading

    from app.paths import model_state_dir, user_paths
    from app.resolve import ResolveError, resolve_model
    from app.settings import Settings, dense_int8_option

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    settings = Settings()
    paths = user_paths(settings.get("models_dir") or None)
    host = args.host or settings.get("server_host")
    port = args.port if args.port is not None else settings.get("server_port")
    api_key = args.api_key if args.api_key is not None else (settings.get("api_key") or None)

    from runtime.server.security import SecurityConfig, SecurityConfigError

    security = SecurityConfig(host=host, api_key=api_key, cors_origins=tuple(args.cors))
    try:
        security.check()
        budget = parse_size(args.vram_budget) if args.vram_budget else (
            int(settings.get("vram_budget_gib") * (1 << 30)) or None)
        model = pick_model(args.model, paths.models, say)
        package = resolve_model(model, models_dir=paths.models, cache_dir=paths.cache,
                                progress=lambda *a: None)
    except (SecurityConfigError, ValueError, ResolveError) as exc:
        say(f"error: {exc}")
        return EXIT_BAD_ARGS

    from runtime.server.app import ServerThread, create_app
    from runtime.server.context import ServerConfig
    from runtime.service import LoadOptions, Service, ServiceError

    options = LoadOptions(device=args.device or settings.get("device"), max_batch=args.max_batch,
                          dense_int8=dense_int8_option(args.dense or settings.get("dense_precision")),
                          context_length=args.context or settings.get("context_length"), vram_budget=budget,
                          state_dir=str(model_state_dir(paths, package)))
    service = Service(max_queue=args.max_queue)
    try:
        try:
            server = ServerThread(create_app(service, ServerConfig(security=security, port=port)), host=host,
                                 port=port)
        except OSError as exc:
            say(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}")
            return EXIT_PORT
        say(f"loading {package} ...")
        try:
            info = service.load_sync(package, _clamp_context(options, package))
        except ServiceError as exc:
            say(f"error: the model could not be loaded: {exc}")
            return EXIT_LOAD_FAILED
        server.start()
        print(f"FreeToken is serving {info.model_id} ({info.model_type}, context {info.context_length} tokens)")
        print("memory plan:")
        for line in plan_lines(info.plan):
            print(f"  {line}")
        print(f"OpenAI API:    {server.url}/v1   (chat/completions, completions, responses, models)")
        print(f"Anthropic API: {server.url}      (v1/messages, v1/messages/count_tokens)")
        print(f"OpenAPI doc:   {server.url}/docs")
        print("API key:       " + ("required" if api_key else "none (loopback only)"))
        print("Press Ctrl+C to stop.", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
        say("stopping ...")
        server.stop()
        return 0
    finally:
        service.close()


def _clamp_context(options, package):
    """The context setting, but never past what the model supports (the setting is a wish, not an order)."""
    import dataclasses

    from runtime.ftw.reader import FTWPackage

    limit = int(FTWPackage.open(package).config.get("max_position_embeddings") or 0)
    if limit and options.context_length and options.context_length > limit:
        return dataclasses.replace(options, context_length=limit)
    return options


def plan_lines(plan: dict) -> list[str]:
    """The engine's plan dict as lines; the expert tier's part (slots, pool, policy...) prefixed 'experts'."""
    lines = []
    for key, value in plan.items():
        if key == "experts" and isinstance(value, dict):
            lines += [f"experts {line}" for line in plan_lines(value)]
            continue
        if key.endswith("bytes") and isinstance(value, int):
            value = f"{value / (1 << 30):.2f} GiB" if value >= 1 << 30 else f"{value / (1 << 20):.1f} MiB"
        lines.append(f"{key.replace('_', ' ')}: {value}")
    return lines
