#!/usr/bin/env bash
# Proof that Claude Code, Codex and opencode complete a turn through FreeToken after one-click setup.
# Needs node/npm and the npm registry; ~5-10 minutes on 2 cores (each agent's first turn is a long prefill).
set -euo pipefail
cd "$(dirname "$0")/.."
FREETOKEN_AGENT_E2E=1 QT_QPA_PLATFORM=offscreen python -m pytest -q -rA tests/test_agents_real.py "$@"
