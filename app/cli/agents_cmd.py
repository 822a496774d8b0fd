"""`freetoken agents list|setup NAME|undo NAME|env NAME`: point a coding agent at FreeToken."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def register(sub) -> None:
    p = sub.add_parser("agents", help="set up coding agents (Claude Code, Codex, opencode, ...) to use FreeToken")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    verbs.add_parser("list", help="the agents FreeToken knows and what each points at now")
    s = verbs.add_parser("setup", help="write the agent's config (shows the change, backs up the file)")
    s.add_argument("name")
    s.add_argument("--yes", action="store_true", help="apply without asking")
    s.add_argument("--dry-run", action="store_true", help="show the change and stop")
    u = verbs.add_parser("undo", help="restore the agent's config as it was before setup")
    u.add_argument("name")
    u.add_argument("--force", action="store_true", help="restore even if the file was edited since")
    e = verbs.add_parser("env", help="print environment variables to paste into a shell instead")
    e.add_argument("name")
    e.add_argument("--shell", choices=("bash", "powershell", "cmd"), default="bash")
    for q in (s, e):
        q.add_argument("--model", help="model id to write (default: the model the local server has loaded)")
        q.add_argument("--port", type=int, help="server port (default: the setting)")
        q.add_argument("--api-key", help="API key (default: the setting)")
        q.add_argument("--context", type=int, help="context window to announce (default: the server's)")
    p.set_defaults(run=run)


def _loaded_model(port: int, api_key: str) -> tuple[str | None, int | None]:
    """Ask the local server which model is loaded; (None, None) when no server answers."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key or 'freetoken'}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            models = json.load(resp).get("data") or []
    except (urllib.error.URLError, OSError, ValueError):
        return None, None
    if not models:
        return None, None
    first = models[0]
    return first.get("id"), first.get("context_length") or first.get("max_model_len")


def _endpoint(args, settings):
    from app.agents.base import Endpoint

    port = args.port or settings.get("server_port")
    api_key = settings.get("api_key") if args.api_key is None else args.api_key
    model, context = args.model, args.context
    if model is None or context is None:
        served, served_ctx = _loaded_model(port, api_key)
        model = model or served
        context = context or served_ctx or settings.get("context_length")
    if not model:
        raise SystemExit(f"No model is loaded on 127.0.0.1:{port}. Start one (`freetoken serve MODEL`) "
                         "or pass --model ID.")
    return Endpoint(host="127.0.0.1", port=port, api_key=api_key, model=model, context_window=int(context))


def run(args) -> int:
    from app.agents.base import AgentConfigError
    from app.agents.setup import AgentSetup, env_script
    from app.agents.targets import AGENTS, get_agent
    from app.paths import user_paths
    from app.settings import Settings

    setup = AgentSetup(user_paths().data)
    try:
        if args.verb == "list":
            for agent in AGENTS:
                where = str(agent.config_path(setup.platform)) if agent.writes_config else "environment / by hand"
                model = setup.configured_model(agent)
                print(f"{agent.name:<12} {agent.display:<12} {agent.wire:<9} {where}"
                      + (f"  (points at {model})" if model else ""))
            return 0
        agent = get_agent(args.name)
        if args.verb == "undo":
            print(setup.undo(agent.name, force=args.force))
            return 0
        endpoint = _endpoint(args, Settings())
        if args.verb == "env":
            print(agent.instructions(endpoint))
            variables = agent.env(endpoint)
            if variables:
                print(env_script(variables, args.shell))
            return 0
        change = setup.plan(agent, endpoint)
        if not change.changed:
            print(f"{change.path} already points {agent.display} at FreeToken ({endpoint.model}); nothing to do.")
            return 0
        print(change.diff())
        if args.dry_run:
            return 0
        if not args.yes:
            if not sys.stdin.isatty():
                print("Not applied: pass --yes to apply without a prompt.", file=sys.stderr)
                return 1
            if input(f"Apply this change to {change.path}? [y/N] ").strip().lower() not in ("y", "yes"):
                print("Not applied.")
                return 1
        backup = setup.apply(change)
        print(f"Updated {change.path}" + (f" (backup: {backup})" if backup else " (new file)")
              + f". Undo with `freetoken agents undo {agent.name}`.")
        return 0
    except AgentConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
