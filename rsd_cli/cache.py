"""What rsd keeps in its cache folder, part by part, and clearing it (`rsd cache`).

Everything there is remade when it is missing; a part's `remade` says at what cost. The one part a
process owns while it runs is a temporary offload folder (a target's weights spilled to disk): its
name carries the host and process it belongs to, so a folder whose process died without removing
it (killed, out of memory) is told from one in use, and removed.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# (name, what it is, what clearing it costs); the order `rsd cache` lists them in
PARTS = (
    ("models", "GGUF models converted", "~15 s each to convert again"),
    ("compiled", "torch.compile's code", "30-80 s a shape to compile again"),
    ("kernels", "the C layers for this CPU", "seconds to build again"),
    ("distill", "rsd distill's samples", "up to an hour to sample again"),
    ("offload", "targets' weights spilled to disk", ""),
    ("measurements", "measured costs and verdicts", "seconds to measure again"),
    ("other", "anything else", ""),
)
PART_NAMES = tuple(name for name, _, _ in PARTS)
FOLDERS = {"gguf": "models", "inductor": "compiled", "kernels": "kernels", "distill": "distill"}
TABLES = ("costs.json", "compile.json", "small-batch.json", "auto.json")  # (the JSON tables rsd measures into)
OFFLOAD_PREFIX = "offload-"
# offload-{host}-{pid}-{tempfile's suffix: letters, digits, _}; earlier versions wrote offload-{suffix}
_OFFLOAD_NAME = re.compile(r"offload-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")


@dataclass
class Part:
    name: str
    what: str
    remade: str
    paths: list[Path] = field(default_factory=list)
    size: int = 0  # bytes (apparent sizes of the files, links not followed)
    in_use: list[Path] = field(default_factory=list)  # offload folders of processes still running


def torch_default_inductor_folder() -> str:
    """Where torch puts torch.compile's code by default (torch._inductor.runtime.cache_dir_utils.
    default_cache_dir, which imports torch: `rsd cache` stays light)."""
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def chosen_inductor_folder(folder: Path, environ=os.environ, torch_default: str | None = None) -> Path | None:
    """The folder the user chose for torch.compile's code (TORCHINDUCTOR_CACHE_DIR), or None where rsd's
    cache folder (`folder`) holds it: unset, empty, rsd's own, or torch's default (which torch writes into
    the environment once it has compiled; torch_default: torch's own answer where torch is imported)."""
    chosen = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen:
        return None
    default = torch_default_inductor_folder() if torch_default is None else torch_default
    if os.path.abspath(chosen) in (os.path.abspath(default), os.path.abspath(folder / "inductor")):
        return None
    return Path(chosen)


def part_of(entry: str) -> str:
    """Which part a top-level entry of the cache folder belongs to."""
    if entry in FOLDERS:
        return FOLDERS[entry]
    if entry.startswith(OFFLOAD_PREFIX):
        return "offload"
    if entry in TABLES or any(entry.startswith(f"{table}.") and entry.endswith(".tmp") for table in TABLES):
        return "measurements"  # (with write_json_table's partial files)
    return "other"


def size_of(path: Path) -> int:
    """Bytes under path (a file's own size; a folder's files', recursively; links not followed)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
        total = 0
        with os.scandir(path) as entries:
            for entry in entries:
                total += size_of(Path(entry.path))
        return total
    except OSError:  # (removed meanwhile, unreadable)
        return 0


def host_label(host: str | None = None) -> str:
    """This host's name (or host) as it goes into a folder's name: letters, digits, '.', '_'."""
    import socket

    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname() if host is None else host) or "host"


def offload_folder_name(host: str | None = None, pid: int | None = None) -> str:
    """The prefix of a temporary offload folder: this host's and process's (tempfile adds a suffix)."""
    return f"{OFFLOAD_PREFIX}{host_label(host)}-{os.getpid() if pid is None else pid}-"


def process_running(pid: int) -> bool:
    """Whether a process of that id runs on this machine (where that cannot be told: True)."""
    if os.name != "posix":  # (os.kill there ends the process)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: it runs)
        return True
    return True


def offload_in_use(name: str, host: str | None = None, running=process_running) -> bool:
    """Whether an offload folder of that name belongs to a process still running: one of this host's
    whose process runs, or another host's (a cache folder shared over the network: not ours to judge).
    An earlier version's folder names no process: not in use."""
    match = _OFFLOAD_NAME.fullmatch(name)
    if match is None:
        return False
    return match["host"] != host_label(host) or running(int(match["pid"]))


def remove_dead_offload_folders(folder: Path, host: str | None = None, running=process_running) -> list[Path]:
    """Remove this host's offload folders whose process has ended (it would have removed them at its
    exit: these were killed); the ones removed. Earlier versions' folders are left to `rsd cache clear`."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for path in entries:
        if _OFFLOAD_NAME.fullmatch(path.name) and not offload_in_use(path.name, host, running):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def survey(folder: Path, running=process_running) -> list[Part]:
    """The cache folder's parts, in PARTS's order, each with its entries and their size."""
    from .errors import RsdError

    parts = {name: Part(name, what, remade) for name, what, remade in PARTS}
    if os.path.lexists(folder) and not folder.is_dir():
        raise RsdError(f"rsd's cache folder {folder} is not a folder (set RSD_CACHE_DIR to one)")
    try:
        entries = sorted(folder.iterdir())
    except FileNotFoundError:  # (no cache folder yet)
        entries = []
    for path in entries:
        part = parts[part_of(path.name)]
        part.paths.append(path)
        part.size += size_of(path)
        if part.name == "offload" and offload_in_use(path.name, running=running):
            part.in_use.append(path)
    return list(parts.values())


@dataclass
class Cleared:
    part: Part
    removed: int  # bytes
    in_use: list[Path]  # offload folders of processes still running: kept
    failed: list[Path]  # what could not be removed (a file of another user, a read-only folder), whole or in part


def clear(parts: list[Part], names: set[str]) -> list[Cleared]:
    """Remove the named parts' entries, but offload folders in use."""
    done = []
    for part in parts:
        if part.name not in names:
            continue
        cleared = Cleared(part, 0, [], [])
        for path in part.paths:
            if path in part.in_use:
                cleared.in_use.append(path)
                continue
            size = size_of(path)
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                pass
            if os.path.lexists(path):
                cleared.failed.append(path)
            cleared.removed += size - (size_of(path) if os.path.lexists(path) else 0)
        done.append(cleared)
    return done


def size_text(size: int) -> str:
    """Bytes as people read them: 0 B, 812 B, 564.0 KB, 623.4 MB, 1.2 GB (powers of 1000, as du -h --si)."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError  # (unreachable)


def entry_count(part: Part) -> str:
    """How many things a part holds, in its own words ("1 model", "3 builds"), or ""."""
    if part.name == "models":  # (a folder each in gguf/; its lock file beside it is no model)
        count, unit = sum(1 for path in part.paths for model in path.glob("*") if model.is_dir()), "model"
    elif part.name == "kernels":
        count, unit = sum(len(list(path.glob("blocks-*.so"))) for path in part.paths), "build"
    elif part.name == "distill":
        count, unit = sum(len(list(path.glob("*.pt"))) for path in part.paths), "set"
    elif part.name == "offload":
        count, unit = len(part.paths), "folder"
    else:
        return ""
    from .prompting import counted

    return counted(count, unit) if count else ""
