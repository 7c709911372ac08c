"""`rsd cache`: the cache folder's parts, their sizes, clearing them; offload folders of killed runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rsd_cli import cache, models
from rsd_cli.cli import app


def ended_pid() -> int:
    """The id of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """A cache folder as rsd fills it: a converted model, compiled code, two kernel builds, distill
    samples, the measured tables (one partly written), offload folders (this process's, a killed
    one's, another host's, an earlier version's) and a file of no part."""
    root = tmp_path / "cache"
    monkeypatch.setenv("RSD_CACHE_DIR", str(root))
    # (an earlier test's compile pointed torch at that test's cache folder, in this process's environment)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    write(root / "gguf" / "SmolLM2-7d63" / "model.safetensors", 5000)
    write(root / "gguf" / "SmolLM2-7d63.lock", 0)
    write(root / "gguf" / "Other-0a1b" / "model.safetensors", 3000)
    write(root / "inductor" / "ab" / "cabc.py", 700)
    write(root / "inductor" / "rsd-0123456789abcdef-4", 0)
    write(root / "kernels" / "blocks-1111.so", 200)
    write(root / "kernels" / "blocks-2222.so", 300)
    write(root / "distill" / "data-abcd.pt", 4000)
    write(root / "costs.json", 30)
    write(root / "auto.json", 20)
    write(root / f"compile.json.{os.getpid()}.tmp", 5)
    host = cache.host_label()
    write(root / f"offload-{host}-{os.getpid()}-abc_12" / "w.dat", 900)
    write(root / f"offload-{host}-{ended_pid()}-xyz34" / "w.dat", 800)
    write(root / f"offload-elsewhere-{ended_pid()}-q1" / "w.dat", 600)
    write(root / "offload-k2j3_h4" / "w.dat", 100)
    write(root / "notes.txt", 9)
    return root


def test_every_entry_of_the_cache_folder_is_counted_in_its_part(folder):
    parts = {part.name: part for part in cache.survey(folder)}
    assert [part.name for part in cache.survey(folder)] == list(cache.PART_NAMES)
    sizes = {name: part.size for name, part in parts.items()}
    assert sizes == {"models": 8000, "compiled": 700, "kernels": 500, "distill": 4000, "offload": 2400,
                     "measurements": 55, "other": 9}
    assert cache.entry_count(parts["models"]) == "2 models"  # (the folders; a lock file is no model)
    assert cache.entry_count(parts["kernels"]) == "2 builds"
    assert cache.entry_count(parts["offload"]) == "4 folders"
    # in use: this process's folder, and another host's (not ours to judge); not the killed run's, nor
    # an earlier version's (which names no process)
    assert sorted(path.name.split("-")[1] for path in parts["offload"].in_use) == sorted([cache.host_label(), "elsewhere"])


def test_rsd_cache_shows_each_part_its_size_and_the_total(folder):
    result = CliRunner().invoke(app, ["cache"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"rsd's cache folder: {folder} (RSD_CACHE_DIR moves it)"
    assert lines[1].split()[:3] == ["models", "8.0", "KB"] and "(2 models); ~15 s each to convert again" in lines[1]
    assert lines[3].split()[:3] == ["kernels", "500", "B"] and "(2 builds)" in lines[3]
    assert "(4 folders, 2 in use)" in lines[5]
    assert lines[-1].split() == ["total", "15.7", "KB"]
    shown = json.loads(CliRunner().invoke(app, ["cache", "show", "--json"]).stdout)
    assert shown["folder"] == str(folder) and shown["bytes"] == 15664
    assert {part["name"]: part["bytes"] for part in shown["parts"]}["distill"] == 4000
    assert json.loads(CliRunner().invoke(app, ["cache", "--json"]).stdout) == shown
    assert CliRunner().invoke(app, ["cache", "path"]).stdout == f"{folder}\n"


def test_an_empty_or_missing_cache_folder_shows_zeros(tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "never-made"))
    result = CliRunner().invoke(app, ["cache"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[-1].split() == ["total", "0", "B"]
    assert "other" not in result.stdout  # (a part of nothing in particular, shown only when it holds something)


def test_a_cache_folder_that_is_a_file_is_said_so(tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(write(tmp_path / "file", 3)))
    for args in (["cache"], ["cache", "clear", "--all"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and result.stderr == (
            f"rsd: error: rsd's cache folder {tmp_path / 'file'} is not a folder (set RSD_CACHE_DIR to one)\n")
    assert (tmp_path / "file").read_bytes() == b"xxx"


def test_clearing_parts_removes_those_alone_and_keeps_offload_folders_in_use(folder):
    result = CliRunner().invoke(app, ["cache", "clear", "compiled", "offload", "measurements"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == "compiled: removed 700 B"
    assert lines[1].startswith("offload: removed 900 B, kept 2 offload folders in use (offload-")
    assert lines[2] == "measurements: removed 55 B"
    assert not (folder / "inductor").exists() and not (folder / "costs.json").exists()
    assert sorted(path.name for path in folder.glob("offload-*")) == sorted(
        [f"offload-{cache.host_label()}-{os.getpid()}-abc_12", next(folder.glob("offload-elsewhere-*")).name])
    assert (folder / "gguf" / "SmolLM2-7d63" / "model.safetensors").exists()  # (not named: kept)
    assert (folder / "distill" / "data-abcd.pt").exists() and (folder / "notes.txt").exists()

    result = CliRunner().invoke(app, ["cache", "clear", "--all"])
    assert result.exit_code == 0, result.stderr
    assert "models: removed 8.0 KB" in result.stderr and "other: removed 9 B" in result.stderr
    assert sorted(path.name for path in folder.iterdir()) == sorted(path.name for path in folder.glob("offload-*"))


def test_what_cannot_be_removed_is_named_and_the_exit_code_says_so(folder, monkeypatch):
    """(Run as root here, a read-only folder would not stop it: the removal is made to fail instead.)"""
    monkeypatch.setattr(cache.shutil, "rmtree", lambda path, ignore_errors=False: None)
    result = CliRunner().invoke(app, ["cache", "clear", "kernels", "measurements"])
    assert result.exit_code == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"kernels: removed 0 B; could not remove {folder / 'kernels'} (see its permissions)"
    assert lines[1] == "measurements: removed 55 B"  # (files: removed; the folder that failed stopped nothing)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    ([], "name the parts to clear (models, compiled, kernels, distill, offload, measurements, other) or give --all"),
    (["model"], "no cache part 'model': the parts are models, compiled"),
    (["models", "--all"], "give the parts to clear or --all, not both"),
])
def test_clearing_nothing_or_an_unknown_part_is_a_usage_error(folder, args, message):
    result = CliRunner().invoke(app, ["cache", "clear", *args])
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert cache.survey(folder)[0].size == 8000  # (nothing removed)


class SpillingProfile:
    """What _offload_folder reads of a profile whose target may spill to disk (no folder of its own)."""

    def __getitem__(self, table):
        return {"offload_folder": ""}

    origins = {"target": {"offload_folder": "default"}}


def test_a_run_that_spills_to_disk_removes_what_killed_runs_left_and_names_its_own_folder(folder):
    """A run killed while its target was offloaded (out of memory, kill -9) never removed its folder
    of spilled weights: GBs each, kept for good. The next run that spills removes this host's folders
    whose process has ended; its own folder names this host and process."""
    killed = next(folder.glob(f"offload-{cache.host_label()}-*-xyz34"))
    made = Path(models._offload_folder(SpillingProfile(), "target", "auto"))
    assert made.parent == folder and made.name.startswith(f"offload-{cache.host_label()}-{os.getpid()}-")
    assert cache.offload_in_use(made.name)
    assert not killed.exists()
    left = sorted(path.name for path in folder.glob("offload-*"))
    assert f"offload-{cache.host_label()}-{os.getpid()}-abc_12" in left  # (running: this process)
    assert any(name.startswith("offload-elsewhere-") for name in left)  # (another host's)
    assert "offload-k2j3_h4" in left  # (an earlier version's: left to `rsd cache clear offload`)


def test_sizes_read_as_people_read_them():
    assert [cache.size_text(n) for n in (0, 999, 1000, 564_200, 653_115_238, 1_003_498_620, 12 * 10**12)] == [
        "0 B", "999 B", "1.0 KB", "564.2 KB", "653.1 MB", "1.0 GB", "12000.0 GB"]


def test_a_write_cut_short_leaves_the_file_as_it_was(tmp_path):
    """What rsd writes into its cache and `rsd distill --out` (models.write_whole): a full disk or a process
    killed midway leaves the file as it was, and no partial file beside it."""
    path = write(tmp_path / "adapter.safetensors", 3)

    def full_disk(partial: Path) -> None:
        partial.write_bytes(b"y")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        models.write_whole(path, full_disk)
    assert path.read_bytes() == b"xxx" and list(tmp_path.iterdir()) == [path]
    models.write_whole(path, lambda partial: partial.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and list(tmp_path.iterdir()) == [path]


def test_where_compiled_code_goes_is_rsd_s_folder_unless_the_user_chose_another(tmp_path):
    """TORCHINDUCTOR_CACHE_DIR set by the user moves torch.compile's code out of rsd's folder; torch's own
    default (which torch writes into the environment once it has compiled) and rsd's folder do not."""
    rsd_folder, torch_default = tmp_path / "cache", "/tmp/torchinductor_someone"
    chosen = lambda value: cache.chosen_inductor_folder(  # noqa: E731
        rsd_folder, {} if value is None else {"TORCHINDUCTOR_CACHE_DIR": value}, torch_default)
    assert chosen(None) is None and chosen("") is None
    assert chosen(torch_default) is None and chosen(torch_default + "/") is None
    assert chosen(str(rsd_folder / "inductor")) is None
    assert chosen(str(tmp_path / "mine")) == tmp_path / "mine"
    # torch's default without importing torch (`rsd cache` stays light) is the one torch computes
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    assert cache.torch_default_inductor_folder() == default_cache_dir()


def test_rsd_cache_says_where_compiled_code_goes_when_the_user_moved_it(folder, tmp_path, monkeypatch):
    """With TORCHINDUCTOR_CACHE_DIR pointing elsewhere, `compiled` showed 0 B and clearing it did nothing,
    saying neither why nor where the code is."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    write(tmp_path / "mine" / "ab" / "c.py", 50)
    result = CliRunner().invoke(app, ["cache"])
    assert result.exit_code == 0, result.stderr
    line = result.stdout.splitlines()[2]
    assert line.split()[:3] == ["compiled", "700", "B"]
    assert line.endswith(f"new code goes to {tmp_path / 'mine'} (TORCHINDUCTOR_CACHE_DIR), not here")
    shown = json.loads(CliRunner().invoke(app, ["cache", "--json"]).stdout)
    assert shown["compiled_elsewhere"] == str(tmp_path / "mine")
    result = CliRunner().invoke(app, ["cache", "clear", "compiled"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (f"compiled: removed 700 B; torch.compile's code now goes to {tmp_path / 'mine'} "
                             f"(TORCHINDUCTOR_CACHE_DIR), which rsd leaves alone\n")
    assert (tmp_path / "mine" / "ab" / "c.py").exists()

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert json.loads(CliRunner().invoke(app, ["cache", "--json"]).stdout)["compiled_elsewhere"] is None
    assert "not here" not in CliRunner().invoke(app, ["cache"]).stdout
