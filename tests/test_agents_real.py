"""The real coding agents complete a turn through `freetoken serve` after our one-click setup.

Opt-in (it installs three npm packages, ~18 s, and each agent's first turn prefills a ~20-50K-token
prompt on the CPU): `FREETOKEN_AGENT_E2E=1 python -m pytest -q tests/test_agents_real.py`, or
`tests/agents_proof.sh`. Needs node/npm and the npm registry. Each agent runs with a temporary HOME
holding only what `AgentSetup` wrote, against a server on a small random-weight model with a
131K-token context; the server's access log must show the wire each agent is documented to use.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from app.agents.base import Endpoint, Platform
from app.agents.setup import AgentSetup
from app.agents.targets import get_agent

pytestmark = pytest.mark.skipif(
    os.environ.get("FREETOKEN_AGENT_E2E") != "1" or shutil.which("npm") is None,
    reason="real-agent proof is opt-in: FREETOKEN_AGENT_E2E=1 and npm on PATH (tests/agents_proof.sh)")

PACKAGES = {"claude-code": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0",
            "opencode": "opencode-ai@1.18.33"}
CONTEXT = 131072
PROMPT = "Reply with one short sentence."


@pytest.fixture(scope="module")
def agents_bin(tmp_path_factory) -> Path:
    prefix = Path(os.environ.get("FREETOKEN_AGENT_PREFIX") or tmp_path_factory.mktemp("npm"))
    if not (prefix / "node_modules" / ".bin" / "opencode").exists():
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", *PACKAGES.values()],
                       check=True, capture_output=True, timeout=600)
    return prefix / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`freetoken serve` on a small random model, with its access log in a file we can read."""
    from app.demo import DemoSpec, ensure_demo_model

    root = tmp_path_factory.mktemp("agent-server")
    # Smaller than the shipped demo so a 50K-token first turn prefills in tens of seconds on 2 cores.
    spec = DemoSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                    experts_per_token=2, moe_intermediate_size=32, max_position_embeddings=CONTEXT)
    model = ensure_demo_model(root / "models", spec=spec).path
    port = _free_port()
    log = root / "serve.log"
    env = dict(os.environ, FREETOKEN_HOME=str(root / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "ui.entry", "-v", "serve", str(model), "--port", str(port),
                             "--context", str(CONTEXT)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
    yield Endpoint(port=port, model=model.name, context_window=CONTEXT), log
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMMANDS = {
    "claude-code": (["claude", "-p", PROMPT], "POST /v1/messages"),
    "codex": (["codex", "exec", "--skip-git-repo-check", PROMPT], "POST /v1/responses"),
    "opencode": (["opencode", "run", PROMPT], "POST /v1/chat/completions"),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_agent_completes_a_turn_through_freetoken(name, agents_bin, server, tmp_path):
    endpoint, log = server
    home = tmp_path / "home"
    home.mkdir()
    setup = AgentSetup(tmp_path / "data", Platform(system="linux", env={"HOME": str(home)}))
    agent = get_agent(name)
    setup.apply(setup.plan(agent, endpoint))
    argv, wire = COMMANDS[name]
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "TERM": "dumb", "NO_COLOR": "1",
           **agent.env(endpoint)}
    before = log.read_text()
    done = subprocess.run([str(agents_bin / argv[0]), *argv[1:]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900, stdin=subprocess.DEVNULL)
    served = log.read_text()[len(before):]
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}\n{served[-2000:]}"
    assert any(wire in line and " 200" in line for line in served.splitlines()), served[-3000:]
    assert "Traceback" not in served
