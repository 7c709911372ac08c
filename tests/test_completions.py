import os
import subprocess
import sys

import pytest

from regenerate_completions import FOLDER, SHELLS, script


@pytest.mark.parametrize("shell", list(SHELLS))
def test_completion_scripts_are_current(shell):
    committed = (FOLDER / SHELLS[shell]).read_text()
    assert committed == script(shell), f"completions/{SHELLS[shell]} is stale: run `make completions`"


def test_profile_names_complete(tmp_path):
    env = dict(os.environ, _RSD_COMPLETE="complete_bash", COMP_WORDS="rsd generate --profile de", COMP_CWORD="3",
               RSD_CONFIG_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "rsd_cli"], env=env, capture_output=True, text=True).stdout
    assert out.split() == ["default"]


def test_help_is_fast_because_imports_are_lazy():
    """`rsd --help` must not import torch or transformers (they take seconds)."""
    code = "import sys; from rsd_cli.cli import app; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
