"""`freetoken convert SRC`: a Hugging Face model folder -> an FTW package in the models folder."""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a downloaded Hugging Face model into FreeToken's FTW format")
    p.add_argument("src", metavar="SRC", help="the model folder (config.json, safetensors shards, tokenizer)")
    p.add_argument("--out", metavar="DIR", help="the package folder (default: <models folder>/<model>-<codec>)")
    p.add_argument("--codec", default="auto", choices=("auto", "f32", "bf16", "int4", "fp4"),
                   help="expert codec; auto: fp4 for MXFP4/NVFP4 sources, int4 otherwise")
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="int4 group size")
    p.add_argument("--force", action="store_true", help="replace an existing package at --out")
    p.add_argument("--progress-json", action="store_true",
                   help="print progress as JSON lines on stdout (for the app); the result is the last line")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from app.settings import SettingsError
    from runtime.ftw.converter import convert, default_output_name, resolve_codec
    from runtime.ftw.errors import FTWError

    def emit(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    try:
        src = Path(args.src).expanduser()
        if args.out:
            out = Path(args.out).expanduser()
        else:
            from app.paths import user_paths
            from app.settings import Settings

            models = user_paths(Settings().get("models_dir") or None).models
            out = models / default_output_name(src, resolve_codec(src, args.codec))
        if args.progress_json:
            progress = lambda ev: emit({"event": "progress", **ev.to_json()})   # noqa: E731
        else:
            progress = _TerminalProgress()
        path = convert(src, out, codec=args.codec, group_size=args.group_size, overwrite=args.force,
                       progress=progress)
    except (FTWError, SettingsError) as e:
        if args.progress_json:
            emit({"event": "error", "message": str(e)})
        print(f"convert: {e}", file=sys.stderr)
        return 1
    if args.progress_json:
        emit({"event": "done", "path": str(path)})
    else:
        print(f"\nconverted to {path}")
    return 0


class _TerminalProgress:
    """One self-overwriting status line on stderr."""

    def __call__(self, ev) -> None:
        pct = 100.0 * ev.bytes_done / ev.bytes_total if ev.bytes_total else 0.0
        eta = f"{ev.eta:5.0f}s left" if ev.eta is not None else ""
        line = f"{ev.stage:<9} {pct:5.1f}%  {ev.rate / 2**20:7.1f} MiB/s  {eta}  {ev.tensor[:48]}"
        print("\r" + line.ljust(100), end="", file=sys.stderr, flush=True)
