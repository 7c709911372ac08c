import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

# tiny models gain nothing from threads, and the suite runs beside other work
torch.set_num_threads(1)
# torch.compile keeps what it compiled of decoder_layer (every model family, size and token count) per code
# object, up to its recompile limit: rsd sets 64, plenty for the one or two models of a run, but one test process
# compiles it for dozens of tiny models (past torch's limit of all code objects' compiles together too: 256)
for _name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):  # (renamed in torch 2.6)
        setattr(torch._dynamo.config, _name, 4096)

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_tiny_pair  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """Config, chat history and --variant auto's memory in a temp dir; no user profile or environment override
    leaks into a test. Loaded models use oneDNN's CPU linear on packed weights wherever it can apply
    (what "auto" picks on AMD EPYCs), so every engine and CLI test runs through it (its per-machine
    "auto" choice is tested on its own)."""
    monkeypatch.setenv("RSD_CONFIG_DIR", str(tmp_path / "config"))
    for name in list(__import__("os").environ):
        if name.startswith("RSD_") and name not in ("RSD_CONFIG_DIR", "RSD_CACHE_DIR"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    # the tests' models on the CPU on every machine (float32, the CPU kernels), as CI runs them; the
    # tests of a GPU ask for it (test_compiled's CUDA tests, the embedded pair's default profile)
    monkeypatch.setenv("RSD_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("RSD_CHAT_HISTORY", str(tmp_path / "chat_history"))  # chat on a pseudo-terminal
    # transformers' eager forward unless a test asks for the static-cache runtime (test_compiled.py):
    # the default "auto" would make every test's backend depend on this machine's cached verdict
    monkeypatch.setenv("RSD_RUNTIME_COMPILE", "off")
    # what --variant auto learnt in earlier runs: per test (tests must not steer each other's choices)
    from rsd_cli import auto
    monkeypatch.setattr(auto, "memory_path", lambda: tmp_path / "auto.json")
    # the machine as idle for auto's measured costs (cached_costs; what else runs beside a test — another
    # worker — would mark them busy at random): the test of that marking sets it itself
    monkeypatch.setattr(auto, "others_running", lambda: 0)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny-pair")
    save_tiny_pair(root)
    return root


@pytest.fixture
def tiny_profile(tiny_pair_dir, tmp_path) -> Path:
    """A profile with a separate tiny draft model; variant and sampling set by each test."""
    path = tmp_path / "tiny.toml"
    path.write_text(
        f'description = "tiny random pair"\n'
        f'[target]\nsource = "{tiny_pair_dir / "target"}"\n'
        f'[draft]\nkind = "model"\nsource = "{tiny_pair_dir / "draft"}"\n'
        f'[decoding]\nvariant = "rsd-c"\nbranching = [2, 2]\n'
        f'[sampling]\nmax_tokens = 12\nseed = 7\n'
    )
    return path
