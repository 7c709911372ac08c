"""Regenerate completions/ from the app (run by `make completions`; a test fails when stale)."""

import os
import subprocess
import sys
from pathlib import Path

SHELLS = {"bash": "rsd.bash", "zsh": "_rsd", "fish": "rsd.fish"}
FOLDER = Path(__file__).resolve().parent.parent / "completions"


def script(shell: str) -> str:
    env = dict(os.environ, _RSD_COMPLETE=f"source_{shell}")
    return subprocess.run([sys.executable, "-m", "rsd_cli"], env=env, capture_output=True, text=True,
                          check=True).stdout


if __name__ == "__main__":
    FOLDER.mkdir(exist_ok=True)
    for shell, name in SHELLS.items():
        (FOLDER / name).write_text(script(shell))
        print(f"wrote {FOLDER / name}")
