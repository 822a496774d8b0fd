"""`freetoken chat MODEL`: an interactive conversation in the terminal, with history.

Each turn re-renders the whole conversation with the model's chat template (as an API client would);
the engine's prefix cache makes only the new turn cost prefill. Commands: /reset (forget the history),
/system TEXT (set the system prompt and reset), /exit (or end of input). Ctrl-C stops the answer
being written, not the chat.
"""
from __future__ import annotations

import sys

from app.cli.run_cmd import (TerminalPrinter, add_model_arguments, add_sampling_arguments, fit_prompt, generate,
                             load_engine, sampling_from_args, stats_line, template_kwargs, user_errors)

HELP = "commands: /reset  /system TEXT  /exit"


def register(sub) -> None:
    p = sub.add_parser("chat", help="talk with a model in the terminal",
                       description="An interactive chat. MODEL: an FTW folder, a Hugging Face model folder, "
                                   "or a model name from the library. " + HELP)
    add_model_arguments(p)
    p.add_argument("--system", metavar="TEXT", help="a system prompt")
    p.add_argument("--hide-reasoning", action="store_true", help="do not print the model's reasoning")
    p.add_argument("--truncate", action="store_true",
                   help="forget the oldest turns when the conversation outgrows the context")
    add_sampling_arguments(p)
    p.set_defaults(run=run)


def _fit_conversation(engine, system: str | None, history: list[dict], text: str, kwargs: dict, *,
                      truncate: bool) -> tuple[str, list[int], int]:
    """(prompt text, ids, turns forgotten): with `truncate`, the oldest user/assistant pairs go (from
    `history` itself, so they stay forgotten) until the conversation fits; then the new message is cut."""
    head = [{"role": "system", "content": system}] if system else []
    dropped = 0
    while True:
        messages = head + history + [{"role": "user", "content": text}]
        if not (truncate and history):
            prompt_text, ids, _ = fit_prompt(engine, messages, kwargs=kwargs, truncate=truncate)
            return prompt_text, ids, dropped
        prompt_text, ids, _ = fit_prompt(engine, messages, kwargs=kwargs)
        if len(ids) < engine.context_length:
            return prompt_text, ids, dropped
        del history[:2]
        dropped += 1


def _read_line(interactive: bool) -> str | None:
    if interactive:
        print("\n> ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(args) -> int:
    errors = user_errors()
    try:
        engine = load_engine(args, quiet=False)
        params = sampling_from_args(args, engine.package.generation_config)
        if engine.chat_template is None:
            print(f"chat: model {engine.model_id} has no chat template; use `freetoken run --raw` instead",
                  file=sys.stderr)
            return 1
    except errors as exc:
        print(f"chat: {exc}", file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    print(f"{engine.model_id} ({engine.model_type}, {engine.device}). {HELP}", file=sys.stderr)
    system = args.system
    history: list[dict] = []
    kwargs = template_kwargs(args)
    printer = TerminalPrinter(sys.stdout, show_reasoning=not args.hide_reasoning)
    while True:
        line = _read_line(interactive)
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if text.startswith("/system"):
            system = text[len("/system"):].strip() or None
            history.clear()
            print("(system prompt set; history cleared)", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP}", file=sys.stderr)
            continue
        try:
            prompt_text, prompt_ids, dropped = _fit_conversation(engine, system, history, text, kwargs,
                                                                 truncate=args.truncate)
            if dropped:
                print(f"(forgot the {dropped} oldest turns to fit the {engine.context_length}-token context)",
                      file=sys.stderr)
            outcome = generate(engine, prompt_text, prompt_ids, params, printer=printer)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            continue
        except errors as exc:
            print(f"chat: {exc}" + ("; /reset starts a fresh conversation" if history else ""), file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        reply = {"role": "assistant", "content": outcome.text}
        if outcome.reasoning:
            reply["reasoning_content"] = outcome.reasoning
        history.append(reply)
        print(stats_line(outcome.result), file=sys.stderr)
