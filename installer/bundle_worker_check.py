"""Drive the bundle's worker exactly as the bundled app does: start it, load a model, generate, shut down.

    python installer/bundle_worker_check.py dist/FreeToken/FreeToken MODEL_FOLDER

Run by installer/smoke_test.sh with the source checkout's Python: the UI-side WorkerClient (the same code
the app runs) is told it is frozen, so it starts `<bundle>/FreeToken worker --ipc NAME` like the bundled
app would, and the whole IPC conversation crosses into the bundled executable. Exit 0 when the worker
answered with text and stopped when asked.
"""
from __future__ import annotations

import sys
import time

START_S = 120          # a cold worker imports torch from the bundle
GENERATE_S = 120


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    executable, model = argv
    sys.frozen = True                  # worker_command then launches `executable worker --ipc NAME`
    sys.executable = executable
    from PySide6.QtCore import QCoreApplication

    from app.worker_client import WorkerClient

    app = QCoreApplication.instance() or QCoreApplication([])
    events: list[dict] = []
    crashes: list[str] = []
    stops: list[int] = []
    client = WorkerClient(env={"OMP_NUM_THREADS": "1"})
    client.event.connect(events.append)
    client.crashed.connect(crashes.append)
    client.stopped.connect(stops.append)

    def wait(condition, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            if crashes:
                raise SystemExit(f"the bundled worker crashed while {what}: {crashes[0]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the bundled worker did not finish {what} within {seconds} s")
            app.processEvents()
            time.sleep(0.01)

    started = time.monotonic()
    client.start()
    wait(lambda: client.is_ready, START_S, "starting")
    print(f"worker ready in {time.monotonic() - started:.2f} s (pid {client.worker_pid}, program {executable})")
    rid = client.load(model, device="cpu")
    wait(lambda: any(e.get("id") == rid and e["type"] in ("loaded", "error") for e in events), START_S, "loading")
    failure = [e for e in events if e.get("id") == rid and e["type"] == "error"]
    if failure:
        raise SystemExit(f"the bundled worker could not load {model}: {failure[0]}")
    job = client.generate(messages=[{"role": "user", "content": "Hello"}], sampling={"max_tokens": 8})
    wait(lambda: job.is_finished, GENERATE_S, "generating")
    if not job.text:
        raise SystemExit(f"the bundled worker generated no text: {[e for e in events if e.get('id') == job.request_id]}")
    print(f"worker generated {job.text!r}")
    client.shutdown()
    wait(lambda: bool(stops), 30, "shutting down")
    print(f"worker exited {stops[0]}")
    return 0 if stops[0] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
