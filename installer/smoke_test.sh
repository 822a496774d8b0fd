#!/usr/bin/env bash
# Smoke test of a built bundle, headless: --version, demo, serve answering a real
# /v1/chat/completions request, and the GUI starting offscreen and closing cleanly.
#   installer/smoke_test.sh dist/FreeToken
# Runs in its own FREETOKEN_HOME, so it never touches the user's models.
set -euo pipefail
BUNDLE=$(cd "${1:-dist/FreeToken}" && pwd)
CLI="$BUNDLE/freetoken"; APP="$BUNDLE/FreeToken"
[ -x "$CLI" ] || { CLI="$BUNDLE/freetoken.exe"; APP="$BUNDLE/FreeToken.exe"; }
export FREETOKEN_HOME=$(mktemp -d) QT_QPA_PLATFORM=offscreen
PORT=${PORT:-19191}
trap 'kill ${SERVER:-} 2>/dev/null || true; rm -rf "$FREETOKEN_HOME"' EXIT

step() { printf '\n== %s\n' "$*"; }
t0=$(date +%s.%N)
step "version";   "$CLI" --version
t1=$(date +%s.%N); echo "cold start (--version): $(echo "$t1 - $t0" | bc) s"
step "demo";      "$CLI" demo
step "serve";     "$CLI" serve --port "$PORT" > "$FREETOKEN_HOME/serve.log" 2>&1 & SERVER=$!
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { cat "$FREETOKEN_HOME/serve.log"; exit 1; }
  sleep 1
done
reply=$(curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"any","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}')
echo "$reply"
echo "$reply" | grep -q '"chat.completion"' || { echo "no completion in reply"; exit 1; }
kill -INT $SERVER; wait $SERVER || true; SERVER=
step "gui";       FREETOKEN_QUIT_AFTER_MS=1500 timeout 60 "$APP"
echo; echo "smoke test passed"
