"""The `freetoken` command line.

Each subcommand is one module in this package with `register(subparsers)` and `run(args) -> int`.
Modules are imported only when their command runs (and for --help), so `freetoken --version`
stays instant; keep heavy imports (torch, Qt) inside `run`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# name -> module; the order is the order of `freetoken --help`.
COMMANDS: dict[str, str] = {
    "info": "app.cli.info_cmd",
    "models": "app.cli.models_cmd",
    "download": "app.cli.download_cmd",
    "agents": "app.cli.agents_cmd",
    "convert": "app.cli.convert_cmd",
    "verify": "app.cli.verify_cmd",
    "demo": "app.cli.demo_cmd",
    "run": "app.cli.run_cmd",
    "chat": "app.cli.chat_cmd",
    "serve": "app.cli.serve_cmd",
    "worker": "app.cli.worker_cmd",
    "bench": "app.cli.bench_cmd",
    "warm-kernels": "app.cli.warm_cmd",
}


def package_version() -> str:
    try:
        return version("freetoken")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description="Run large MoE models on an ordinary PC.")
    parser.add_argument("--version", action="version", version=f"freetoken {package_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    from app.logs import setup_logging
    from app.paths import user_paths

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    setup_logging(user_paths().logs, name=args.command, level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
