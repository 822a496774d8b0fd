"""PyInstaller's entry script: the same `freetoken` entry as the pip install (ui/entry.py).

The bundle has two executables built from this script: `FreeToken` (windowed: the app, and the worker
it starts with `FreeToken worker --ipc NAME`, so no console window flashes on Windows) and the console
CLI, `serve` and friends (`freetoken` on Linux, `freetoken-cli` where file names ignore case).
"""
import multiprocessing
import sys

from ui.entry import main

if __name__ == "__main__":
    multiprocessing.freeze_support()   # torch and huggingface_hub may spawn helpers on Windows
    sys.exit(main())
