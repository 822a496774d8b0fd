"""`freetoken run MODEL --prompt TEXT`: one answer, streamed to the terminal, then a stats line.

MODEL is an FTW package folder, a Hugging Face model folder (converted on the fly into the cache) or
the name of a model in the library (app/resolve.py decides). The prompt goes through the model's own
chat template unless `--raw`; the output is split into reasoning, answer and tool calls by the
family's parser. `--json` prints one JSON object instead (prompt and generated ids, text, stats).

The sampling defaults are the model's own (generation_config.json), each overridable by a flag;
`--temperature 0` is greedy. `chat_cmd` shares the helpers below.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

# generation_config.json keys -> SamplingParams fields that a model may set as its defaults.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty"}
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def register(sub) -> None:
    p = sub.add_parser("run", help="generate one answer from a model and print it",
                       description="Generate one answer. MODEL: an FTW folder, a Hugging Face model folder, "
                                   "or a model name from the library (try `freetoken demo` first).")
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", metavar="TEXT",
                   help="the user message (or the raw text with --raw); '-' or none reads standard input")
    p.add_argument("--system", metavar="TEXT", help="a system prompt (ignored with --raw)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (prompt and generated token ids, text, stats) instead of streaming")
    p.add_argument("--hide-reasoning", action="store_true", help="do not print the model's reasoning")
    p.add_argument("--truncate", action="store_true",
                   help="cut the start of a prompt too long for the context instead of refusing it")
    add_sampling_arguments(p)
    p.set_defaults(run=run)


def add_model_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help="FTW folder, Hugging Face model folder, or library name")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="where to run (default: the `device` setting, auto)")
    p.add_argument("--context", type=int, metavar="N", help="context length in tokens (default: the model's)")


def add_sampling_arguments(p) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json)")
    g.add_argument("--max-tokens", type=int, default=512, metavar="N", help="most tokens to generate (default 512)")
    g.add_argument("--temperature", "-t", type=float, metavar="T", help="0 is greedy")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling (1: off)")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the top probability (0: off)")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="1: off")
    g.add_argument("--presence-penalty", type=float, metavar="X", help="0: off")
    g.add_argument("--frequency-penalty", type=float, metavar="X", help="0: off")
    g.add_argument("--seed", type=int, help="a seed makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("--think", dest="thinking", action="store_const", const=True, default=None,
                   help="ask a model that can reason to think first (templates with enable_thinking)")
    g.add_argument("--no-think", dest="thinking", action="store_const", const=False,
                   help="ask a model that can reason to answer directly")
    g.add_argument("--reasoning-effort", choices=("low", "medium", "high"), help="gpt-oss reasoning effort")


# ---- helpers shared with `chat` ------------------------------------------------------------------------


class CliError(Exception):
    """A problem to print as one line and exit 1."""


def sampling_from_args(args, generation_config: dict | None):
    """SamplingParams: the model's defaults, then the flags the user gave."""
    from runtime.sampling import SamplingParams

    values: dict[str, Any] = {}
    config = generation_config or {}
    if config.get("do_sample") is not False:   # do_sample false means the model's authors want greedy
        for key, name in GENERATION_DEFAULTS.items():
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool):
                values[name] = config[key]
    else:
        values["temperature"] = 0.0
    for name in SAMPLING_FLAGS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    values = {k: (int(v) if k == "top_k" else float(v)) for k, v in values.items()}
    try:
        return SamplingParams(**values, seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def template_kwargs(args) -> dict:
    kwargs = {}
    if getattr(args, "thinking", None) is not None:
        kwargs["enable_thinking"] = args.thinking
    if getattr(args, "reasoning_effort", None):
        kwargs["reasoning_effort"] = args.reasoning_effort
    return kwargs


def load_engine(args, *, quiet: bool):
    """Resolve MODEL and load it, with a progress line on stderr unless quiet."""
    from app.paths import user_paths
    from app.resolve import resolve_model
    from app.settings import Settings
    from runtime.engine import Engine

    settings = Settings()
    device = args.device or settings.get("device") or "auto"
    models_dir = user_paths(settings.get("models_dir") or None).models

    live = not quiet and sys.stderr.isatty()   # a self-overwriting line only where someone watches it

    def progress(done: int, total: int, stage: str) -> None:
        if total:
            print(f"\rloading {stage}: {100 * done / total:5.1f}%".ljust(40), end="", file=sys.stderr, flush=True)

    def converting(event) -> None:   # a Hugging Face folder is converted once, into the cache
        total = getattr(event, "bytes_total", 0)
        if total:
            print(f"\rconverting: {100 * event.bytes_done / total:5.1f}%".ljust(40), end="", file=sys.stderr,
                  flush=True)

    path = resolve_model(args.model, models_dir=models_dir, progress=converting if live else None)
    engine = Engine.load(path, device=device, context_length=args.context, max_batch=1,
                         progress=progress if live else None)
    if live:
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)
    return engine


def prompt_ids_for(engine, messages: list[dict], *, raw_text: str | None = None,
                   kwargs: dict | None = None) -> tuple[str, list[int]]:
    """(prompt text, ids): the raw text encoded as the tokenizer would (with its BOS), or the chat template's render."""
    if raw_text is not None:
        return raw_text, engine.tokenizer.encode(raw_text, add_special_tokens=True)
    if engine.chat_template is None:
        raise CliError(f"model {engine.model_id} has no chat template; use --raw to send the text as is")
    text = engine.chat_template.render(messages, add_generation_prompt=True, **(kwargs or {}))
    return text, engine.tokenizer.encode(text)


def fit_prompt(engine, messages: list[dict], *, raw_text: str | None = None, kwargs: dict | None = None,
               truncate: bool = False) -> tuple[str, list[int], int]:
    """(prompt text, ids, tokens cut): the prompt, leaving room for at least one new token.

    Too long and not `truncate`: the engine's own error says so. With `truncate`, the start goes: of the
    raw text, or of the last message's content (the template's frame and the system prompt stay whole).
    """
    text, ids = prompt_ids_for(engine, messages, raw_text=raw_text, kwargs=kwargs)
    limit = engine.context_length - 1
    if len(ids) <= limit or not truncate:
        return text, ids, 0
    tok = engine.tokenizer
    if raw_text is not None:
        kept = ids[-limit:]
        return tok.decode(kept), kept, len(ids) - len(kept)
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise CliError("the prompt does not fit the context and its last message cannot be shortened")
    content_ids = tok.encode(content)
    keep = len(content_ids) - (len(ids) - limit)
    while keep > 0:
        shorter = [*messages[:-1], {**messages[-1], "content": tok.decode(content_ids[-keep:])}]
        text, new_ids = prompt_ids_for(engine, shorter, kwargs=kwargs)
        if len(new_ids) <= limit:     # re-tokenising at the cut can differ by a token: check, not assume
            return text, new_ids, len(ids) - len(new_ids)
        keep -= max(1, len(new_ids) - limit)
    raise CliError(f"the prompt does not fit the {engine.context_length}-token context even with the last "
                   "message emptied (the system prompt and template take it all)")


@dataclass
class Outcome:
    """What one generation produced, parsed."""

    result: Any                      # runtime.engine.GenerationResult
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class TerminalPrinter:
    """Streams parsed deltas: reasoning dimmed (on a terminal) or hidden, answer as is, tool calls on their own lines."""

    def __init__(self, out: TextIO, *, show_reasoning: bool = True):
        self.out, self.show_reasoning = out, show_reasoning
        self.color = out.isatty()
        self._kind: str | None = None

    def _switch(self, kind: str) -> None:
        if kind == self._kind:
            return
        if self._kind == "reasoning":
            self.out.write("\x1b[0m\n" if self.color else "\n[/thinking]\n")
        if kind == "reasoning":
            self.out.write("\x1b[2m" if self.color else "[thinking]\n")
        self._kind = kind

    def delta(self, d) -> None:
        if d.kind == "reasoning":
            if not self.show_reasoning:
                return
            self._switch("reasoning")
            self.out.write(d.text)
        elif d.kind == "text":
            self._switch("text")
            self.out.write(d.text)
        elif d.name is not None:
            self._switch("tool_call")
            self.out.write(f"\n[tool call] {d.name}(")
        else:
            self.out.write(d.arguments + ")\n")
        self.out.flush()

    def end(self) -> None:
        self._switch("end")
        self.out.write("\n")
        self.out.flush()


def generate(engine, prompt_text: str, prompt_ids: list[int], params, *, printer: TerminalPrinter | None) -> Outcome:
    """Run one request to its end, feeding the parser as tokens arrive."""
    from runtime.text.parsers import collect, make_output_parser

    parser = make_output_parser(engine.model_type, prompt_text)
    deltas = []
    rid = engine.add_request(prompt_ids, params)
    try:
        while True:
            finished = False
            for event in engine.step():
                if event.request_id != rid:
                    continue
                new = parser.feed(event.text) if event.text else []
                if event.finished:
                    new += parser.finish()
                    finished = True
                deltas += new
                if printer:
                    for d in new:
                        printer.delta(d)
            if finished:
                break
    except KeyboardInterrupt:
        engine.cancel(rid)
        while engine.has_work():
            engine.step()
        raise
    if printer:
        printer.end()
    parsed = collect(deltas)
    return Outcome(result=engine.result(rid), text=parsed["text"], reasoning=parsed["reasoning"],
                   tool_calls=parsed["tool_calls"])


def stats_dict(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
            "generated_tokens": len(result.tokens), "finish_reason": result.finish_reason,
            "time_to_first_token_s": round(result.ttft, 4),
            "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)}


def stats_line(result) -> str:
    cached = f" ({result.cached_tokens} cached)" if result.cached_tokens else ""
    return (f"{result.prompt_tokens} prompt tokens{cached}, {len(result.tokens)} generated · "
            f"TTFT {result.ttft * 1000:.0f} ms · prefill {result.prefill_tokens_per_s:.1f} tok/s · "
            f"decode {result.decode_tokens_per_s:.1f} tok/s · finish: {result.finish_reason}")


def user_errors():
    """The exceptions that are the user's input or the model folder, reported as one line."""
    from runtime.engine import EngineError
    from runtime.ftw.errors import FTWError
    from runtime.text.chat_template import ChatTemplateError
    from runtime.text.tokenizer import TokenizerError

    errors = [CliError, EngineError, FTWError, ChatTemplateError, TokenizerError, FileNotFoundError]
    try:
        from app.resolve import ResolveError
        errors.append(ResolveError)
    except ImportError:
        pass
    return tuple(errors)


# ---- run ---------------------------------------------------------------------------------------------------


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin is None or (sys.stdin.isatty() and args.prompt is None):
        raise CliError("no prompt: pass --prompt TEXT (or pipe the text in with --prompt -)")
    return sys.stdin.read()


def run(args) -> int:
    errors = user_errors()
    try:
        prompt = _read_prompt(args)
        engine = load_engine(args, quiet=args.json)
        params = sampling_from_args(args, engine.package.generation_config)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        prompt_text, prompt_ids, cut = fit_prompt(engine, messages, raw_text=prompt if args.raw else None,
                                                  kwargs=template_kwargs(args), truncate=args.truncate)
        if cut and not args.json:
            print(f"(the prompt's first {cut} tokens were cut to fit the {engine.context_length}-token context)",
                  file=sys.stderr)
        printer = None if args.json else TerminalPrinter(sys.stdout, show_reasoning=not args.hide_reasoning)
        outcome = generate(engine, prompt_text, prompt_ids, params, printer=printer)
    except errors as exc:
        print(f"run: {exc}", file=sys.stderr)
        return 1
    result = outcome.result
    if args.json:
        print(json.dumps({
            "model": engine.model_id, "model_type": engine.model_type, "device": str(engine.device),
            "prompt": prompt_text, "prompt_ids": prompt_ids, "generated_ids": list(result.tokens), "text": outcome.text,
            "raw_text": result.text, "reasoning": outcome.reasoning, "tool_calls": outcome.tool_calls,
            "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                         "min_p": params.min_p, "seed": params.seed, "max_tokens": params.max_tokens},
            "truncated_tokens": cut, "stats": stats_dict(result),
        }, ensure_ascii=False))
    else:
        print(stats_line(result), file=sys.stderr)
    return 0
