#!/usr/bin/env bash
# Smoke test of a built bundle, headless: --version, demo, serve answering a real
# /v1/chat/completions request, the GUI starting offscreen and closing cleanly, and (where makensis
# exists) the Windows installer script compiled around this bundle as a stand-in payload.
#   installer/smoke_test.sh dist/FreeToken
# Runs in its own FREETOKEN_HOME, so it never touches the user's models. Prints the timings that
# docs/benchmarks.md records.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BUNDLE=$(cd "${1:-dist/FreeToken}" && pwd)
# The console executable is `freetoken` on Linux, `freetoken-cli` where file names ignore case.
for name in freetoken freetoken-cli freetoken-cli.exe; do
  [ -x "$BUNDLE/$name" ] && [ ! -d "$BUNDLE/$name" ] && CLI="$BUNDLE/$name" && break
done
[ -n "${CLI:-}" ] || { echo "no console executable in $BUNDLE"; exit 1; }
APP="$BUNDLE/FreeToken"; [ -x "$APP" ] || APP="$BUNDLE/FreeToken.exe"
[ -x "$APP" ] || { echo "no FreeToken app executable in $BUNDLE"; exit 1; }
export FREETOKEN_HOME=$(mktemp -d) QT_QPA_PLATFORM=offscreen
PORT=${PORT:-19191}
trap 'kill ${SERVER:-} 2>/dev/null || true; rm -rf "$FREETOKEN_HOME"' EXIT

step() { printf '\n== %s\n' "$*"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

step "version"
t0=$(now); out=$("$CLI" --version); t1=$(now)
echo "$out"
case "$out" in "freetoken "[0-9]*) ;; *) echo "unexpected --version output"; exit 1 ;; esac
case "$out" in *unknown*) echo "package metadata missing from the bundle"; exit 1 ;; esac
echo "cold start (--version): $(secs "$t0" "$t1") s"

step "demo"
t0=$(now); "$CLI" demo; t1=$(now)
echo "demo: $(secs "$t0" "$t1") s"

# The worker the app starts (`FreeToken worker --ipc NAME`), driven by the app's own WorkerClient from the
# source checkout's Python: load the demo model, generate, shut down. Skipped where that Python is missing.
PYTHON=${PYTHON:-python}
if "$PYTHON" -c "import app.worker_client" >/dev/null 2>&1; then
  step "worker (started as the app starts it)"
  model=$("$CLI" demo --json | "$PYTHON" -c "import json,sys; print(json.load(sys.stdin)['path'])")
  "$PYTHON" "$HERE/bundle_worker_check.py" "$APP" "$model"
else
  step "worker: SKIPPED ($PYTHON cannot import the checkout's app package; set PYTHON=.venv/bin/python)"
fi

step "numba CPU expert kernels (compiled and cached inside the bundle)"
t0=$(now); "$CLI" bench probe --layers 1 --only-numba --out "$FREETOKEN_HOME/probe" > /dev/null; t1=$(now)
grep -q "\"us_per_layer\"" "$FREETOKEN_HOME/probe/probe.json" || { echo "the kernel probe measured nothing"; exit 1; }
echo "kernel probe (1 layer; compiles on the first run of a bundle, then numba's cache): $(secs "$t0" "$t1") s"

step "serve"
t0=$(now)
"$CLI" serve --port "$PORT" > "$FREETOKEN_HOME/serve.log" 2>&1 & SERVER=$!
for _ in $(seq 1 300); do
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "serve exited:"; cat "$FREETOKEN_HOME/serve.log"; exit 1; }
  sleep 0.2
done
reply=$(curl -fsS --max-time 120 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"any","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}') \
  || { echo "no answer:"; cat "$FREETOKEN_HOME/serve.log"; exit 1; }
t1=$(now)
echo "$reply"
echo "$reply" | grep -q '"chat.completion"' || { echo "no completion in reply"; exit 1; }
echo "$reply" | grep -q '"completion_tokens":[1-9]' || { echo "the completion generated no tokens"; exit 1; }
echo "cold start (serve to first answer): $(secs "$t0" "$t1") s"
kill -INT $SERVER
wait $SERVER && rc=0 || rc=$?
SERVER=
[ "$rc" -eq 0 ] || [ "$rc" -eq 130 ] || { echo "serve exited $rc on Ctrl-C:"; cat "$FREETOKEN_HOME/serve.log"; exit 1; }
if grep -q Traceback "$FREETOKEN_HOME/serve.log"; then cat "$FREETOKEN_HOME/serve.log"; exit 1; fi

step "gui"
t0=$(now)
FREETOKEN_QUIT_AFTER_MS=${QUIT_AFTER_MS:-4000} timeout 120 "$APP" > "$FREETOKEN_HOME/gui.log" 2>&1 && rc=0 || rc=$?
t1=$(now)
cat "$FREETOKEN_HOME/gui.log"
[ "$rc" -eq 0 ] || { echo "the app exited $rc"; exit 1; }
if grep -q Traceback "$FREETOKEN_HOME/gui.log"; then echo "the app raised"; exit 1; fi
echo "gui start to clean exit (incl. ${QUIT_AFTER_MS:-4000} ms shown): $(secs "$t0" "$t1") s"

if command -v makensis >/dev/null 2>&1; then
  step "windows installer script (this bundle as a stand-in payload)"
  out_exe="$FREETOKEN_HOME/FreeToken-setup.exe"
  (cd "$HERE/windows" && makensis -V2 -DFAST_COMPRESSION -DVERSION=0.0.0-smoke -DBUNDLE="$BUNDLE" -DOUTFILE="$out_exe" freetoken.nsi)
  [ -s "$out_exe" ] || { echo "makensis wrote no installer"; exit 1; }
  echo "installer compiled: $(du -h "$out_exe" | cut -f1)"
fi
echo; echo "smoke test passed"
