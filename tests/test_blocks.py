"""Weights held as quantised blocks (Q4_1, Q8_0: what a GGUF file such as the embedded model's
holds) or as 16-bit floats (the embedded draft's adapter, bfloat16 models): recognised from
their float32 values only when every value comes back bit for bit, multiplied by rsd's C kernel
to F.linear's product (AVX-512, AVX2 and the plain loops), chosen per shape like the other
small-batch kernels; whole layers in C give torch's layer; decoding on them keeps its exactness."""

from __future__ import annotations

import copy
import gc
import os
import shutil
import struct
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rsd_cli import auto, blocks, compiled, small_batch, threads
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.drafting import make_shape
from rsd_cli.engine import CachedLM, Decoder, Runtimes
from rsd_cli.models import write_json_table
from rsd_cli.sampling import SamplingParams
import emulated_arm
from test_compiled import run
from test_threads import Alternating
from test_engine import MC_SHAPES, N_SAMPLES, PAIR_DRAW, V, chi_square_pvalue, exact_joint, plain_greedy, shapes
from tiny import quantise_like_gguf, quantise_q4_1, quantise_q8_0, tiny_model

# only a machine without a C compiler skips: a source that does not build fails the tests below
pytestmark = pytest.mark.skipif(blocks._compiler() is None, reason="no C compiler to build the kernel")

FORMATS = {"q4_1": quantise_q4_1, "q8_0": quantise_q8_0, "f16": lambda w: w.detach().half().float(),
           "bf16": lambda w: w.detach().bfloat16().float()}
LAST = {"q4_1": blocks.Q4_1_BYTES, "q8_0": blocks.Q8_0_BYTES, "f16": 32, "bf16": 32}


# the kernel built as other CPUs get it: on x86 without AVX-512, with AVX2 (most laptops and desktops: the
# products in 8-lane vectors) and without AVX2 either (the plain loops); on 64-bit ARM (the machine's own
# build: NEON's 4-lane vectors) without NEON (the plain loops)
ARM = blocks.ARM64
WITHOUT_AVX512 = {"loops": ("-march=armv8-a+nosimd",)} if ARM else \
    {"avx2": ("-mno-avx512f",), "loops": ("-mno-avx512f", "-mno-avx2")}
HAS_AVX2 = " avx2" in blocks._cpu() and " fma" in blocks._cpu()  # (elsewhere the "avx2" build is the loops too)


def other_builds(tmp_path) -> list:
    """The kernel built without AVX-512 (AVX2 vectors) and without AVX2 either (the plain loops); on ARM
    without NEON (the loops)."""
    return [blocks.build(tmp_path, (*blocks.FLAGS, *flags)) for flags in WITHOUT_AVX512.values()]


# a compiler refusing -fopenmp as Apple's clang does (its front end, reached by -Xclang, has OpenMP)
REFUSING_OPENMP = r"""#!/bin/sh
previous=
for a in "$@"; do
  if [ "$a" = -fopenmp ] && [ "$previous" != -Xclang ]; then
    echo "clang: error: unsupported option '-fopenmp' for target 'arm64-apple-darwin24.0.0'" >&2
    exit 1
  fi
  previous=$a
done
exec COMPILER "$@"
"""


def refusing_openmp(folder: Path, compiler: str = "clang") -> Path:
    """`compiler` made to refuse -fopenmp as Apple's clang does (REFUSING_OPENMP), written into `folder`."""
    path = folder / f"{compiler}-refusing-openmp"
    path.write_text(REFUSING_OPENMP.replace("COMPILER", compiler))
    path.chmod(0o755)
    return path


def llvm_libomp() -> Path | None:
    """This machine's LLVM OpenMP runtime beside its clang (Debian: clang and libomp-dev), standing in for the
    libomp torch's macOS wheels ship and load; None without them."""
    if shutil.which("clang") is None:
        return None
    resources = Path(subprocess.run(["clang", "-print-resource-dir"], capture_output=True, text=True).stdout.strip())
    runtimes = sorted(resources.parents[1].glob("libomp.so*")) if len(resources.parents) > 1 else []
    return runtimes[-1] if runtimes else None


def llvm_libomp_or_skip() -> Path:
    """llvm_libomp, or the test skipped saying what it needs."""
    libomp = llvm_libomp()
    if libomp is None:
        pytest.skip("clang with LLVM's OpenMP runtime stands in for Apple's clang and torch's libomp: apt-get install "
                    "clang libomp-dev (.ci/run installs them)")
    return libomp


# set in the process test_a_mac_s_build... starts, with libomp loaded (not RSD_: conftest clears those)
MAC_BUILD = "TESTS_MAC_BUILD"


def apple_clang_build(tmp_path, monkeypatch, loaded: bool = True):
    """The kernel as a Mac builds it with Apple's clang (clang refusing -fopenmp here, x86 code) and the OpenMP
    runtime torch has loaded (this machine's libomp standing in: loaded in a process of its own, so this
    one's other tests keep GCC's): through blocks.build_with_openmp, after -fopenmp is refused. None where
    it does not load."""
    llvm_libomp_or_skip()
    if loaded and os.environ.get(MAC_BUILD) != "1":
        pytest.skip("runs in a process of its own, libomp loaded as torch holds it on a Mac: see "
                    "test_a_mac_s_build_of_the_kernel_runs_on_the_openmp_runtime_torch_has_loaded")
    monkeypatch.setenv("CC", str(refusing_openmp(tmp_path)))
    assert blocks.build(tmp_path / "plain") is None and "unsupported option '-fopenmp'" in blocks.build_error
    return blocks.build_with_openmp(tmp_path / "kernels")


def weight(fmt: str, out_features: int = 40, in_features: int = 96, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    scale = 1e5 if fmt == "bf16" else 0.05  # (small bfloat16 values are half floats too: the smaller form)
    return FORMATS[fmt](torch.randn(out_features, in_features) * scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_recognised_only_where_they_give_back_every_value(fmt):
    w = weight(fmt)
    found = blocks.quantised_blocks(w)
    assert found is not None and blocks.block_format(found) == fmt
    assert found.shape == (40, 3, LAST[fmt])
    nudged = w.clone()
    nudged[7, 50] = torch.nextafter(nudged[7, 50], torch.tensor(1.0))  # one value off by one ulp
    assert blocks.quantised_blocks(nudged) is None
    assert blocks.quantised_blocks(torch.randn(40, 96)) is None  # float weights
    assert blocks.quantised_blocks(w[:, :80]) is None  # rows not made of whole blocks
    assert blocks.quantised_blocks(w.bfloat16()) is None
    for bad in (float("inf"), float("-inf"), float("nan")):
        broken = w.clone()
        broken[13, 40] = bad
        assert blocks.quantised_blocks(broken) is None


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_c_library_makes_the_blocks_torch_makes_and_turns_down_the_same_weights(fmt, tmp_path):
    """q4_1_blocks / q8_0_blocks in one pass of the C library (the default and a build without
    AVX-512) against the same functions on torch's operations: the same bytes, the same refusals."""
    make = {"q4_1": blocks.q4_1_blocks, "q8_0": blocks.q8_0_blocks}[fmt]
    w = weight(fmt, 64, 256, seed=3)
    w[5, :32] = 0.25  # a constant block (d = 0)
    w[6, 32:64] = torch.linspace(-1, 1, 32)
    w[6, 32:64] = FORMATS[fmt](w[6:7])[0, 32:64]
    w[9, 64:96] *= 2**-20  # tiny scales (half-float subnormals)
    w = FORMATS[fmt](w)
    nudged = w.clone()  # one value off by an ulp, not its block's smallest or largest (d and m stay)
    block = nudged[40, 192:224]
    inner = next(j for j in range(32) if block.min() < block[j] < block.max())
    block[inner] = torch.nextafter(block[inner], block.max())
    plain = torch.randn(64, 256) * 0.05
    libraries = [blocks.library(), *other_builds(tmp_path)]
    for lib in libraries:
        found = make(w, lib)
        assert found is not None and torch.equal(found, make(w, False))
        assert make(nudged, lib) is None and make(nudged, False) is None
        assert make(plain, lib) is None and make(plain, False) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 64])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_computes_linear_s_product(fmt, rows):
    w, bias = weight(fmt, seed=rows), torch.randn(40)
    found = blocks.quantised_blocks(w)
    x = torch.randn(2, rows, 96)
    exact = (x.double() @ w.double().T).float()
    atol = 1e-5 * w.abs().max().item() * 20
    torch.testing.assert_close(blocks.blocks_linear(x, found), exact, rtol=1e-5, atol=atol)
    torch.testing.assert_close(blocks.blocks_linear(x[0], found, bias), exact[0] + bias, rtol=1e-5, atol=atol)
    assert blocks.blocks_linear(x[:, :0], found).shape == (2, 0, 40)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_row_and_column_tile_is_computed(threads):
    """The kernel works on tiles of weight rows (a count that depends on the threads) times groups
    of up to 5 rows of x: every tile boundary, full and partial, must give the product."""
    w = weight("q4_1", out_features=75, in_features=64, seed=threads)
    found = blocks.quantised_blocks(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 7, 8, 9, 13, 16, 17, 24, 33):
            x = torch.randn(rows, 64)
            exact = (x.double() @ w.double().T).float()
            torch.testing.assert_close(blocks.blocks_linear(x, found), exact, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("width", [2560, 8192])
def test_wide_rows_give_each_row_the_same_bits_whatever_rows_come_with_it(fmt, width, tmp_path):
    """A row's product has the same bits alone and among 2-9 others (each row tile sums in its
    own registers, in the same order), as a token's logits must alone in a chain or in a tree —
    here for wide rows (2560 weights: up to 3 rows go through whole rows together, what fits the
    first-level cache, 4 or more a chunk of the row at a time; 8192: even one row in chunks) and
    every row tile, with sub-tiles of weight rows cut short (37 rows); AVX-512, AVX2 and the plain
    loop alike."""
    w = weight(fmt, out_features=37, in_features=width, seed=5)
    found = blocks.quantised_blocks(w)
    x = torch.randn(10, width)
    exact = (x.double() @ w.double().T).float()
    for lib in (blocks.library(), *other_builds(tmp_path)):
        alone = torch.cat([blocks.blocks_linear(x[i:i + 1], found, lib=lib) for i in range(10)])
        torch.testing.assert_close(alone, exact, rtol=1e-5, atol=1e-4 * w.abs().max().item())
        for rows in (2, 3, 4, 5, 8, 9, 10):
            assert torch.equal(blocks.blocks_linear(x[:rows], found, lib=lib), alone[:rows]), rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_weight_rows_taken_in_pairs_give_each_the_bits_it_gets_alone(fmt, threads, tmp_path):
    """Rows of x go in groups of up to 5 against weight rows two at a time (side by side in
    registers), a tile's last weight row alone where their count is odd: every weight row's product
    has the same bits either way — alone, as the last row of a tile with an odd count, among 1-9
    rows of x — AVX-512, AVX2 and the plain loops alike."""
    w = weight(fmt, out_features=37, in_features=96, seed=7)
    found = blocks.quantised_blocks(w)
    x = torch.randn(9, 96)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lib in (blocks.library(), *other_builds(tmp_path)):
            alone = torch.cat([blocks.blocks_linear(x[i:i + 1], found, lib=lib) for i in range(9)])
            for j in range(37):  # (one weight row: never paired)
                assert torch.equal(blocks.blocks_linear(x, found[j:j + 1], lib=lib)[:, 0], alone[:, j]), j
            for rows in range(2, 10):
                assert torch.equal(blocks.blocks_linear(x[:rows], found, lib=lib), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_rebuilds_every_weight_exactly(fmt):
    """x = rows of the identity: each output is one weight times 1 plus zeros, so it is the weight
    the kernel rebuilt from its block, bit for bit (1, 2, 3, 5, 7 and 64 rows: every row tile)."""
    w = weight(fmt, out_features=70, in_features=64, seed=3)
    found = blocks.quantised_blocks(w)
    assert found is not None
    for rows in (1, 2, 3, 5, 7, 64):
        assert torch.equal(blocks.blocks_linear(torch.eye(64)[:rows], found), w.T[:rows])


def test_torch_s_gemm_on_a_weight_rebuilt_from_blocks_a_slice_at_a_time(monkeypatch):
    """gemm_on_blocks: F.linear's product on the weight its blocks hold, whole or a slice of rows at
    a time into the scratch buffer (here 7 rows of 96: slices of 7, the last one short)."""
    w, x, bias = weight("q4_1"), torch.randn(70, 96), torch.randn(40)
    made = blocks.quantised_blocks(w)
    assert torch.equal(blocks.dequantised(made), w)
    whole = blocks.gemm_on_blocks(x, made, bias)
    torch.testing.assert_close(whole, F.linear(x, w, bias), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(blocks, "SCRATCH_FLOATS", 7 * 96)
    torch.testing.assert_close(blocks.gemm_on_blocks(x, made, bias), whole, rtol=1e-6, atol=1e-6)
    assert blocks._scratch.buffer.numel() >= 7 * 96


@pytest.mark.parametrize("build", WITHOUT_AVX512)
def test_the_builds_without_avx512_compute_the_same_product(build, tmp_path):
    """Where the CPU lacks AVX-512 the kernel runs its products in AVX2 vectors, and where it lacks AVX2
    too in plain C loops: built here without them, each computes F.linear's product, rebuilds every
    weight exactly (x = rows of the identity: 1, 2, 3, 5 and 7 rows, every row group) and says whether it
    runs on vectors."""
    other = blocks.build(tmp_path, (*blocks.FLAGS, *WITHOUT_AVX512[build]))
    assert other is not None and list(tmp_path.glob("*.c")) == []
    assert blocks.vectorised(other) == (build == "avx2" and HAS_AVX2)
    for fmt in FORMATS:
        w = weight(fmt)
        if fmt == "f16":  # zeros, negative and subnormal half floats widen exactly too
            w[0, :6] = torch.tensor([0.0, -0.0, 2**-24, -3 * 2**-24, 1023 * 2**-24, -(2**-14)])
        x = torch.randn(6, 96)
        if fmt == "f16":
            x[:, :6] = 2.0**20  # (so the subnormal weights' products show in the sums)
        found = blocks.quantised_blocks(w)
        torch.testing.assert_close(blocks.blocks_linear(x, found, lib=other),
                                   F.linear(x, w), rtol=1e-5, atol=1e-5 * w.abs().max().item() * 20)
        for rows in (1, 2, 3, 5, 7):
            assert torch.equal(blocks.blocks_linear(torch.eye(96)[:rows], found, lib=other), w.T[:rows])
        for lib in (blocks.library(), other):  # the weight rebuilt from its blocks: every value
            assert torch.equal(blocks.dequantised(found, lib=lib), w)


def test_a_mac_s_build_of_the_kernel_runs_on_the_openmp_runtime_torch_has_loaded(tmp_path, monkeypatch):
    """Apple's clang refuses -fopenmp; torch's macOS wheels ship libomp, loaded with torch. The kernel is
    then built with OpenMP asked of clang's front end and no runtime linked, binding to the one the process
    holds as it loads: checked in a process of its own with this machine's libomp loaded (the tests that set
    MAC_BUILD). Here, where no libomp is loaded, that kernel does not load (and no second runtime is brought
    in); there is no kernel, and the reason given is the compiler's refusal — as where the compiler that
    refuses -fopenmp has no -Xclang either (GCC)."""
    libomp = llvm_libomp_or_skip()
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:warnings", __file__, "-k",
         "mac_build_runs_its_products or (same_bits_alone and apple)"],
        env={**os.environ, MAC_BUILD: "1", "LD_PRELOAD": str(libomp)}, capture_output=True, text=True, timeout=600)
    passed = any(line.startswith("2 passed") for line in child.stdout.splitlines())
    assert child.returncode == 0 and passed, child.stdout[-3000:] + child.stderr[-2000:]

    assert apple_clang_build(tmp_path, monkeypatch, loaded=False) is None  # (built, its OpenMP calls unbound)
    assert "'-fopenmp'" in blocks.build_error
    assert str(libomp) not in Path("/proc/self/maps").read_text()
    monkeypatch.setenv("CC", str(refusing_openmp(tmp_path, "gcc")))
    assert blocks.build_with_openmp(tmp_path / "gcc") is None and "'-fopenmp'" in blocks.build_error


def load_commands(path: Path) -> list[tuple[int, bytes]]:
    """(command, its bytes) of a 64-bit Mach-O file's load commands."""
    data = path.read_bytes()
    magic, _, _, _, count, _, _, _ = struct.unpack_from("<IiiIIIII", data, 0)
    assert magic == 0xFEEDFACF, "not a 64-bit Mach-O file"
    commands, at = [], 32
    for _ in range(count):
        command, size = struct.unpack_from("<II", data, at)
        commands.append((command, data[at: at + size]))
        at += size
    return commands


def test_the_mac_build_compiles_and_links_for_macos_naming_no_openmp_runtime(tmp_path):
    """The kernel built for an Apple-silicon Mac with the flags rsd gives Apple's clang there (front_end_openmp
    on darwin, ARM64's FLAGS), by zig's clang with macOS's C headers (`pip install ziglang`; .ci/run installs
    it): it compiles for arm64-macos (no omp.h: Apple's clang has none), links as a Mach-O library whose only
    library is libSystem — no OpenMP runtime named, its OpenMP calls left to the one torch has loaded (looked
    up in the flat namespace as it loads) — and calls into OpenMP (the front end made its parallel loops)."""
    pytest.importorskip("ziglang", reason="zig's clang cross-compiles for macOS: pip install ziglang")
    arm64_flags = tuple(flag for flag in blocks.FLAGS if not flag.startswith("-march"))  # (blocks.FLAGS on ARM64)
    flags, links = blocks.front_end_openmp(arm64_flags, system="darwin")
    assert "-fopenmp" not in [f for f, before in zip(flags, ("", *flags)) if before != "-Xclang"]
    source, built = tmp_path / "kernel.c", tmp_path / "kernel.so"
    source.write_text(blocks.SOURCE)
    made = subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-macos", *flags, str(source),
                           "-o", str(built), *links], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(tmp_path / "zig-cache"),
                               "ZIG_LOCAL_CACHE_DIR": str(tmp_path / "zig-cache")})
    assert made.returncode == 0, made.stderr[-3000:]
    LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB = 0xC, 0x80000018
    named = [body[struct.unpack_from("<I", body, 8)[0]:].split(b"\0")[0].decode()
             for command, body in load_commands(built) if command in (LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB)]
    assert named == ["/usr/lib/libSystem.B.dylib"], named
    assert b"___kmpc_fork_call" in built.read_bytes()
    objdump = shutil.which("llvm-objdump") or next(iter(sorted(Path("/usr/lib").glob("llvm-*/bin/llvm-objdump"))), None)
    if objdump:
        bound = subprocess.run([str(objdump), "--macho", "--bind", "--lazy-bind", str(built)], capture_output=True,
                               text=True).stdout
        assert any("flat-namespace" in line and "___kmpc_fork_call" in line for line in bound.splitlines()), bound


def test_the_mac_build_runs_its_products_on_vectors_and_the_runtime_loaded(tmp_path, monkeypatch):
    """(In the process test_a_mac_s_build... starts.) The kernel built as a Mac builds it loads, runs on
    vectors, calls the OpenMP runtime the process holds (its parallel loops start that runtime's threads;
    it names no runtime of its own) and computes the product, each row the same alone and among others."""
    lib = apple_clang_build(tmp_path, monkeypatch)
    assert lib is not None, blocks.build_error
    assert blocks.vectorised(lib) == (ARM or HAS_AVX2)
    if shutil.which("nm"):
        assert "__kmpc_fork_call" in subprocess.run(["nm", "-D", "--undefined-only", lib._name], capture_output=True,
                                                    text=True).stdout
    if shutil.which("readelf"):
        assert "omp" not in subprocess.run(["readelf", "-d", lib._name], capture_output=True, text=True).stdout
    w = weight("q4_1", out_features=64, in_features=256)
    found, x = blocks.quantised_blocks(w), torch.randn(5, 256)
    alone = torch.cat([blocks.blocks_linear(x[i:i + 1], found, lib=lib) for i in range(5)])
    torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(blocks.blocks_linear(x, found, lib=lib), alone)


def test_the_machine_s_own_build_runs_on_vectors_where_it_has_them():
    """-march=native: AVX-512, or AVX2 with FMA, on x86; NEON on 64-bit ARM (the plain loops elsewhere)."""
    assert blocks.vectorised() == (ARM or HAS_AVX2)


@pytest.mark.skipif(ARM, reason="the ARM builds are checked on x86 under qemu-user")
@pytest.mark.parametrize("build", emulated_arm.ARM_BUILDS)
def test_the_arm_builds_compute_the_same_product_under_emulation(build, tmp_path):
    """On 64-bit ARM (Apple silicon, Graviton, Raspberry Pi) the kernel runs its products in NEON's 4-lane
    vectors, and built without NEON in plain loops: built for ARM here (with GCC, and with clang, which
    is what Apple's compiler is) and run under qemu-user, each says whether it runs on vectors, computes
    F.linear's product, rebuilds every weight exactly (identity rows, every row group; dequantised), and
    gives a row of x the same bits alone and among others (wide rows too, taken in chunks) and a weight
    row alone or in a pair — every format, the K-quants' included."""
    from rsd_cli import gguf_hints
    from tiny import dequantise_k, quantise_k

    if not emulated_arm.tools(build):
        pytest.skip("the ARM builds are checked on x86 under qemu-user: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross "
                    "and qemu-user, and clang for neon-clang (apt; .ci/run installs them)")
    lib = emulated_arm.EmulatedKernel(tmp_path, build)
    assert blocks.vectorised(lib) == build.startswith("neon")
    weights = {}
    for fmt in FORMATS:
        w = weight(fmt)
        if fmt == "f16":  # zeros, negative and subnormal half floats widen exactly too
            w[0, :6] = torch.tensor([0.0, -0.0, 2**-24, -3 * 2**-24, 1023 * 2**-24, -(2**-14)])
        weights[fmt] = (w, blocks.quantised_blocks(w))
    torch.manual_seed(2)
    for kind in ("Q6_K", "Q5_1", "IQ4_NL"):  # (blocks of 8-bit with a scale per 16, Q5_1, IQ4; rows of 256s)
        raw = quantise_k(torch.randn(40, 256) * 0.05, kind)
        values, fmt = dequantise_k(raw, kind), gguf_hints.FORMAT_OF[kind]
        scales = torch.from_numpy(gguf_hints.scales_and_offsets(raw, kind))
        made = blocks.hinted_blocks(values, gguf_hints.hint(fmt, scales))
        assert made is not None and blocks.block_format(made) == fmt
        weights[fmt] = (values, made)
    for fmt, (w, found) in weights.items():
        x = torch.randn(6, w.shape[1])
        if fmt == "f16":
            x[:, :6] = 2.0**20  # (so the subnormal weights' products show in the sums)
        alone = torch.cat([blocks.blocks_linear(x[i:i + 1], found, lib=lib) for i in range(6)])
        torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-5, atol=1e-5 * w.abs().max().item() * 20)
        for rows in (2, 5, 6):
            assert torch.equal(blocks.blocks_linear(x[:rows], found, lib=lib), alone[:rows]), (fmt, rows)
        assert torch.equal(blocks.blocks_linear(x, found[7:8], lib=lib)[:, 0], alone[:, 7]), fmt  # (never paired)
        for rows in (1, 3, 7):
            identity = torch.eye(w.shape[1])[:rows]
            assert torch.equal(blocks.blocks_linear(identity, found, lib=lib), w.T[:rows]), (fmt, rows)
        assert torch.equal(blocks.dequantised(found, lib=lib), w), fmt
    for fmt in ("q4_1", "q8_0"):  # wide rows: 2 rows and more of 4096 go through them a chunk at a time
        w = weight(fmt, out_features=37, in_features=4096, seed=5)
        found, x = blocks.quantised_blocks(w), torch.randn(5, 4096)
        alone = torch.cat([blocks.blocks_linear(x[i:i + 1], found, lib=lib) for i in range(5)])
        exact = (x.double() @ w.double().T).float()
        torch.testing.assert_close(alone, exact, rtol=1e-5, atol=1e-4 * w.abs().max().item())
        for rows in (2, 4, 5):
            assert torch.equal(blocks.blocks_linear(x[:rows], found, lib=lib), alone[:rows]), (fmt, rows)


def quantised_layer(fmt="q4_1", in_features=64, out_features=48) -> torch.nn.Linear:
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(FORMATS[fmt](layer.weight))
    return layer


def test_forced_blocks_serve_quantised_layers_and_leave_the_others(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
    model = torch.nn.Sequential(quantised_layer(), torch.nn.Linear(48, 64), quantised_layer("q8_0", 64, 64))
    assert small_batch.install(model) == 2
    assert [small_batch.kernels_of(layer) for layer in model] == [("blocks",) * 3, small_batch.TORCH, ("blocks",) * 3]
    ran = []
    real = blocks.blocks_linear
    monkeypatch.setattr(blocks, "blocks_linear", lambda *args: ran.append(args[1].shape[-1]) or real(*args))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        got = model(x)
        prompt = model(torch.randn(65, 64))  # prompts (more than 64 rows): the blocks kernel too
    assert ran == [LAST["q4_1"], LAST["q8_0"]] * 2
    torch.testing.assert_close(got, F.linear(F.linear(F.linear(x, model[0].weight), model[1].weight, model[1].bias),
                                             model[2].weight), rtol=1e-5, atol=1e-5)
    assert prompt.shape == (65, 64)


class Recorded:
    """Verdicts that record what they were asked: blocks for quantised layers, packed elsewhere."""

    def __init__(self):
        self.asked = []

    def kernels(self, weights, found=None):
        self.asked.append((tuple(weights[0].shape), None if found is None else blocks.block_format(found[0])))
        return ("blocks", "blocks", "torch") if found is not None else ("onednn", "onednn", "torch")

    def save(self):
        pass


def test_auto_measures_quantised_layers_apart_from_float_ones_of_the_same_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    model = torch.nn.Sequential(quantised_layer(), torch.nn.Linear(64, 48, bias=False), quantised_layer())
    verdicts = Recorded()
    small_batch.install(model, verdicts)
    assert sorted(verdicts.asked, key=str) == [((48, 64), "q4_1"), ((48, 64), None)]
    assert [small_batch.kernels_of(layer)[0] for layer in model] == ["blocks", "onednn", "blocks"]
    # measured for real, the verdict of quantised layers has a key of its own and may name blocks
    measured = []
    monkeypatch.setattr(small_batch, "measure_kernels", lambda w, rows, found=None, kernels=None: measured.append(
        (found is not None, rows)) or {k: {"blocks": 0.1, "torch": 1.0}.get(k, 3.0)  # clear verdicts: measured once
                                      for k in kernels or small_batch.available_kernels(found is not None)})
    path = tmp_path / "small-batch.json"
    installed = copy.deepcopy(model)
    monkeypatch.setattr(blocks, "vectorised", lambda lib=None: True)  # (AVX-512: few rows on blocks unmeasured)
    small_batch.install(installed, small_batch.Verdicts.load(path))
    # one and several rows for the float layers; prompts alone for the quantised ones
    assert sorted(measured) == [(False, (1,)), (False, (2, 4, 8)), (True, (128,))]
    assert any(key.endswith("64x48 q4_1 | kernels v3") for key in small_batch.Verdicts.load(path).known)
    assert small_batch.kernels_of(installed[0]) == ("blocks",) * 3 and small_batch.kernels_of(installed[1])[2] == "torch"
    # the plain loops: one and several rows measured for the quantised layers too
    measured.clear()
    monkeypatch.setattr(blocks, "vectorised", lambda lib=None: False)
    small_batch.install(copy.deepcopy(model), small_batch.Verdicts.load(tmp_path / "portable.json"))
    assert sorted(measured) == [(False, (1,)), (False, (2, 4, 8)), (True, (1,)), (True, (2, 4, 8)), (True, (128,))]


def test_few_rows_of_quantised_blocks_take_their_kernel_whatever_a_product_alone_measured(monkeypatch, tmp_path):
    """A forward streams every weight, 0.75-1.125 bytes a weight on blocks against 4 in float32; a
    product timed alone cannot show it where the CPU's cache holds a shape's weights (a 2-core Xeon's
    300 MB: torch's product won alone, and `ar` ran 1.5-1.8x slower on transformers' forward and
    compiled). So one row and 2-64 rows of quantised blocks run on them whatever torch measured,
    earlier verdicts that said otherwise included; prompts and float layers keep their measurements.
    That holds for the kernel's vectorised builds (AVX-512, AVX2): its plain loops (twice torch's time for
    a row, from memory) are measured as before."""
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    monkeypatch.setattr(blocks, "vectorised", lambda lib=None: True)
    monkeypatch.setattr(small_batch, "measure_kernels", lambda w, rows, found=None, kernels=None: {
        k: 1.0 if k == "torch" else 2.0 for k in kernels or small_batch.available_kernels(found is not None)})
    path = tmp_path / "small-batch.json"
    machine = small_batch.machine()
    # what the previous calibration left on such a machine: torch's product for one row of a quantised shape
    write_json_table(path, {f"{machine} | 64x48 q4_1 | kernels v2": ["torch", "blocks", "torch"]})
    model = torch.nn.Sequential(quantised_layer(), torch.nn.Linear(48, 64, bias=False), quantised_layer("q8_0", 64, 64))
    small_batch.install(model, small_batch.Verdicts.load(path))
    assert [small_batch.kernels_of(layer) for layer in model] == [
        ("blocks", "blocks", "torch"), small_batch.TORCH, ("blocks", "blocks", "torch")]
    x = torch.randn(1, 64)
    ran = []
    monkeypatch.setattr(blocks, "blocks_linear", lambda x, found, bias=None, lib=None: ran.append(x.shape[0]) or
                        F.linear(x, blocks.dequantised(found), bias))
    with torch.inference_mode():
        model[0](x), model[0](torch.randn(5, 64)), model[0](torch.randn(65, 64))
    assert ran == [1, 5]  # a prompt of 65 rows: torch's, as measured
    monkeypatch.setattr(blocks, "vectorised", lambda lib=None: False)  # the plain loops: torch's, as measured
    portable = torch.nn.Sequential(quantised_layer(), torch.nn.Linear(48, 64, bias=False),
                                   quantised_layer("q8_0", 64, 64))
    small_batch.install(portable, small_batch.Verdicts.load(tmp_path / "portable.json"))
    assert [small_batch.kernels_of(layer) for layer in portable] == [small_batch.TORCH] * 3


def test_a_changed_weight_gets_its_blocks_again_or_another_kernel(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
    layer = quantised_layer()
    small_batch.install(layer)
    first = small_batch.blocks_of(layer)
    x = torch.randn(2, 64)
    with torch.no_grad():
        layer.weight.copy_(quantise_q4_1(torch.randn(48, 64)))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        assert small_batch.blocks_of(layer) is not first
        layer.weight.add_(1e-3)  # no longer blocks: oneDNN's (or torch's) product on the weight
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        assert small_batch.blocks_of(layer) is None


def test_without_room_for_the_blocks_the_layers_keep_their_float_weights(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
    layer = quantised_layer()
    monkeypatch.setattr(small_batch, "available_memory", lambda: 2 * 48 * 64 * 2 - 1)  # half of it < 2 bytes a weight
    assert small_batch.install(layer) == 0 and small_batch.blocks_of(layer) is None
    monkeypatch.setattr(small_batch, "available_memory", lambda: 2 * 48 * 64 * 2)
    other = quantised_layer()
    assert small_batch.install(other) == 1 and small_batch.blocks_of(other) is not None


def test_gradients_take_torch_s_product(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
    layer = quantised_layer()
    small_batch.install(layer)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).square().sum().backward()
    expected = 2 * F.linear(x, layer.weight).detach() @ layer.weight
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


def test_without_a_c_compiler_the_kernel_is_not_offered(monkeypatch):
    monkeypatch.setattr(blocks, "_compiler", lambda: None)
    blocks.library.cache_clear()
    try:
        assert not blocks.available()
        assert "blocks" not in small_batch.available_kernels(quantised=True)
        monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
        assert small_batch.mode() == "0"
        layer = quantised_layer()
        assert small_batch.install(layer) == 0
    finally:
        blocks.library.cache_clear()


# decoding on quantised weights: the kernel changes no distribution


class AllBlocks:
    def kernels(self, weights, found=None):
        return ("blocks",) * 3 if found is not None else small_batch.TORCH

    def save(self):
        pass


def install_blocks(model) -> None:
    """The blocks kernel wherever the weights are blocks (whatever RSD_SMALL_BATCH_MATMUL the test
    environment sets: verdicts decide here)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
        small_batch.install(model, AllBlocks())


@pytest.fixture(scope="module")
def quantised_pair():
    """A tiny pair quantised as a GGUF file holds it, twice: on torch's product (the reference) and
    on the blocks kernel, with the static-cache runtime compiled (True) and uncompiled (False: C
    layers) for the latter."""
    reference = tuple(quantise_like_gguf(tiny_model(V, layers=layers, seed=seed, scale=0.1))
                      for layers, seed in ((2, 0), (1, 1)))
    kernel = tuple(copy.deepcopy(model) for model in reference)
    for model in kernel:
        install_blocks(model)
    assert small_batch.kernels_of(kernel[0].model.layers[1].mlp.down_proj) == ("blocks",) * 3
    assert small_batch.kernels_of(kernel[0].lm_head) == ("blocks",) * 3  # (Q8_0, one block a row)
    return reference, kernel, {compile: Runtimes(CompiledModel(kernel[0], compile), CompiledModel(kernel[1], compile),
                                                  "on" if compile else "auto") for compile in (True, False)}


@pytest.mark.parametrize("shape", shapes(), ids=lambda s: s.describe())
def test_greedy_on_the_blocks_kernel_equals_plain_greedy(quantised_pair, shape):
    reference, kernel, static = quantised_pair
    expected = plain_greedy(reference[0], 25)
    greedy = SamplingParams(temperature=0)
    assert run(kernel, Runtimes(), shape, greedy, 25, seed=0) == expected
    for runtimes in static.values():  # compiled, and uncompiled with fused projections
        assert run(kernel, runtimes, shape, greedy, 25, seed=0) == expected


@pytest.mark.parametrize("variant", ["ar", "sd", "rsd-c"])
def test_the_threads_of_forwards_in_c_change_their_time_never_a_token(quantised_pair, variant, monkeypatch):
    """With two threads, the forwards of the C layers run on the count the governor picks (here one
    and two in turn), the steps' maths between them on one thread, and the caller keeps its two: a
    seed gives the same tokens at T=1 as with every forward on two threads (RSD_ADAPTIVE_THREADS=0)
    and as with one thread throughout."""
    from rsd_cli import compiled, engine

    _, kernel, static = quantised_pair
    shape = make_shape(variant, draft_len=2, branching=(2, 2))
    sampling = SamplingParams(temperature=1.0)
    forwards, maths = [], []
    native = compiled.NativeForward
    monkeypatch.setattr(compiled, "NativeForward", lambda *args: forwards.append(args[-1]) or native(*args))
    probabilities = engine.logits_to_probs
    monkeypatch.setattr(engine, "logits_to_probs", lambda *args, **kwargs: maths.append(torch.get_num_threads())
                        or probabilities(*args, **kwargs))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [run(kernel, static[False], shape, sampling, 20, seed=seed) for seed in range(3)]
        forwards.clear()
        torch.set_num_threads(2)
        monkeypatch.setenv("RSD_ADAPTIVE_THREADS", "0")
        fixed = [run(kernel, static[False], shape, sampling, 20, seed=seed) for seed in range(3)]
        assert set(forwards) == {2} and set(maths) == {1} and torch.get_num_threads() == 2
        forwards.clear()
        monkeypatch.delenv("RSD_ADAPTIVE_THREADS")
        governor = Alternating()
        monkeypatch.setattr(threads, "GOVERNOR", governor)
        governed = [run(kernel, static[False], shape, sampling, 20, seed=seed) for seed in range(3)]
        assert set(forwards) == {1, 2} and forwards == governor.chosen[:len(forwards)]
        assert set(maths) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert governed == fixed == alone and len({tuple(tokens) for tokens in alone}) > 1


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="torch < 2.4: compiled graphs use torch's product")
def test_one_compiled_graph_serves_layers_of_every_weight_format_and_kernel(monkeypatch):
    """Compiled graphs hold no kernel name and no weight copy (rsd::linear finds them by the
    weight's address): a model whose first layer is Q4_1 blocks and whose second is half-precision
    blocks (a draft's adapter stored in float16 and not rounded) with one product on torch's kernel compiles one
    graph for a token count, not one per layer kind, and each product still runs its own kernel —
    the logits of transformers' forward on the same weights."""
    model = quantise_like_gguf(tiny_model(V, layers=2, seed=4, scale=0.1))
    with torch.no_grad():
        for linear in model.model.layers[1].modules():
            if isinstance(linear, torch.nn.Linear):
                linear.weight.copy_(linear.weight.half().float())
    reference = copy.deepcopy(model)
    install_blocks(model)
    layers = model.model.layers
    assert blocks.block_format(small_batch.blocks_of(layers[0].self_attn.q_proj)) == "q4_1"
    assert blocks.block_format(small_batch.blocks_of(layers[1].self_attn.q_proj)) == "f16"
    layers[1].mlp.up_proj._rsd_kernels = small_batch.TORCH  # (still patched: run_kernel's "torch")
    ran = []
    real = small_batch.run_kernel
    monkeypatch.setattr(small_batch, "run_kernel", lambda kernel, *args: ran.append(kernel) or real(kernel, *args))
    torch._dynamo.reset()  # (graphs other tests compiled would serve this one's layers anyway)
    runtime = CompiledModel(model, compile=True)
    ours = StaticLM(runtime, V, capacity=32)
    ours.extend([3, 1, 4, 1, 5])  # (a first forward: the cache's length is not yet a dynamic dimension)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ran.clear()
    visible = torch.ones(8, 5 + 8, dtype=torch.bool).tril(5)
    logits = ours.forward([t % V for t in range(8)], list(range(5, 13)), visible)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # for both layers
    assert runtime.graphs == {8}
    assert ran.count("blocks") >= 7 + 6 and ran.count("torch") == 1  # each product on its own kernel
    expected = CachedLM(reference, V)
    expected.extend([3, 1, 4, 1, 5])
    torch.testing.assert_close(logits, expected.forward([t % V for t in range(8)], list(range(5, 13)), visible),
                               atol=1e-4, rtol=1e-4)
    blocks_copy = weakref.ref(small_batch.blocks_of(layers[0].self_attn.q_proj))
    del ours, runtime, model, layers
    gc.collect()
    assert blocks_copy() is None  # what rsd::linear was told of goes with the model


def test_auto_stays_uncompiled_without_measuring_where_every_layer_runs_in_c(quantised_pair, tmp_path, monkeypatch):
    """--compile auto on a model whose layers all run in the C library: the uncompiled runtime, with
    no compile to measure (nothing compiled, no verdict written); `on` compiles as asked and says
    in a line that the C layers run faster; a model with a layer outside it is measured as before."""
    from rsd_cli import compiled

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(compiled, "compiled_gain", lambda model: measured.append(model) or 0.5)
    _, kernel, _ = quantised_pair
    runtime = compiled.runtime_for(kernel[0], "auto", "target")
    assert runtime is not None and runtime.all_in_c and not runtime.compiled
    assert measured == [] and not (tmp_path / "cache" / "compile.json").exists()
    notices = []
    assert compiled.runtime_for(kernel[0], "on", "target", notice=notices.append).compiled  # asked for: compiled
    assert notices[-1].startswith("--compile on: the target's layers are compiled as asked, but on this CPU rsd's C "
                                  "library runs them about 2x faster uncompiled")  # ... and told what auto picks
    plain = tiny_model(V, layers=1)  # float weights: torch's layer, so measured (here: compiling pays)
    runtime = compiled.runtime_for(plain, "auto", "target")
    assert measured == [plain] and runtime.compiled and not runtime.all_in_c
    notices.clear()
    assert compiled.runtime_for(plain, "on", "target", notice=notices.append).compiled and not notices


class TorchEverywhere:
    """Verdicts that name torch's product for every shape and row count, quantised or not."""

    def kernels(self, weights, found=None):
        return small_batch.TORCH

    def save(self):
        pass


def test_layers_on_blocks_run_in_c_whatever_kernel_their_products_measured_fastest_alone(monkeypatch):
    """The C layer runs a whole layer (its products and the operations around them) in one call, so
    a layer whose linears all hold quantised blocks runs there — and after such layers the norm and
    the head on its blocks — even where each product alone measured torch's kernel faster (a 2-core
    Intel Xeon's verdicts: 2.5x the forward's time without C layers), with the logits of the layers
    and head in torch operations on those verdicts' kernels. RSD_SMALL_BATCH_MATMUL=torch keeps
    every layer in torch operations."""
    model = quantise_like_gguf(tiny_model(V, layers=2, seed=3, scale=0.1))
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    small_batch.install(model, TorchEverywhere())
    layer = model.model.layers[0]
    assert small_batch.blocks_of(layer.self_attn.k_proj) is not None
    assert small_batch.kernels_of(layer.self_attn.k_proj) == small_batch.TORCH
    runtime = CompiledModel(model, compile=False)
    assert runtime.all_in_c
    assert all(fused == (None, None) for _, _, fused in runtime.layers)  # (torch's layer: torch's products)
    counted = layers_in_c(monkeypatch)
    tokens, visible = [t % V for t in (3, 1, 4, 1, 5, 9)], torch.ones(6, 6, dtype=torch.bool).tril()
    in_c = StaticLM(runtime, V, 16).forward(tokens, list(range(6)), visible)
    assert counted == [2, "head"]  # both layers in one call, then the norm and head
    native, runtime.native = runtime.native, None
    try:
        in_torch = StaticLM(runtime, V, 16).forward(tokens, list(range(6)), visible)
    finally:
        runtime.native = native
    torch.testing.assert_close(in_c, in_torch, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "torch")
    forced = quantise_like_gguf(tiny_model(V, layers=2, seed=3, scale=0.1))
    small_batch.install(forced)
    assert CompiledModel(forced, compile=False).native is None


def layers_in_c(monkeypatch) -> list:
    """Counts the layers the C library runs (one call for them all, or one call a layer), and
    "head" where it runs the final norm and the output head too."""
    counted = []
    from rsd_cli import compiled

    whole, one, head = blocks.NativeForward.layers, blocks.NativeForward.layer, compiled.native_head
    monkeypatch.setattr(blocks.NativeForward, "layers",
                        lambda self, table, *args: counted.append(table.shape[0] // blocks.TABLE_ENTRIES)
                        or whole(self, table, *args))
    monkeypatch.setattr(blocks.NativeForward, "layer", lambda *args: counted.append(1) or one(*args))
    monkeypatch.setattr(compiled, "native_head", lambda *args, **kwargs: counted.append("head") or head(*args, **kwargs))
    return counted


@pytest.mark.parametrize("rows", [1, 3, 8, 34, 35, 65])
def test_whole_layers_in_c_and_fused_projections_give_torch_s_layer(quantised_pair, rows, monkeypatch):
    """On the static-cache runtime uncompiled, each layer whose linears all run on blocks is one
    call of the C library (norms, products, rotary embedding, cache write, attention): the same
    logits as the layer in torch operations; there q/k/v and gate/up run as one product each,
    bit for bit the separate products."""
    _, kernel, static = quantised_pair
    runtime = static[False].target
    assert all(fused[0] is not None and fused[1] is not None for _, _, fused in runtime.layers)
    assert runtime.layers[0][2][0].shape[0] == 32 + 2 * 16  # q rows, then k's and v's (2 of 4 heads' width)
    tokens = torch.randint(0, V, (rows,), generator=torch.Generator().manual_seed(rows))
    mask = torch.zeros(rows, rows).masked_fill_(torch.ones(rows, rows, dtype=torch.bool).triu(1), -torch.inf)
    everything = torch.arange(rows)

    def logits() -> torch.Tensor:
        keys, values = runtime.new_buffers(rows)
        with torch.inference_mode():
            return runtime.forward(tokens, everything, mask, keys, values, everything)

    native, layers = runtime.native, runtime.layers
    assert native is not None and len(native) == len(layers)
    counted = layers_in_c(monkeypatch)
    whole = logits()  # every layer in one call of the C library, whatever the rows (65: a prompt's)
    assert counted == [len(layers), "head"]  # (the head on blocks for every row count: norm and head in C)
    try:
        runtime.native = None  # the layer in torch operations, q/k/v and gate/up fused
        fused = logits()
        runtime.layers = [(weights, small, (None, None)) for weights, small, _ in layers]
        assert torch.equal(fused, logits())
    finally:
        runtime.native, runtime.layers = native, layers
    torch.testing.assert_close(whole, fused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 16, 24])
def test_whole_layers_in_c_with_64_wide_heads_over_a_long_cache_give_torch_s_layer(rows, monkeypatch):
    """Heads 64 wide take the C layer's vectorised attention (16 keys' weights at a time, masked
    keys weighing exactly 0): after 90 cached tokens (192 for 24 new ones), n new ones with a
    tree's mask (some cached keys and some new ones hidden) give the logits of the layer in torch
    operations."""
    from transformers import LlamaForCausalLM

    from tiny import tiny_config

    torch.manual_seed(rows)
    model = quantise_like_gguf(LlamaForCausalLM(tiny_config(V, 2, 0.1, head_dim=64)).eval())
    install_blocks(model)
    runtime = CompiledModel(model, compile=False)
    assert runtime.native is not None and all(runtime.native)
    past, generator = max(90, 8 * rows), torch.Generator().manual_seed(rows)
    keys, values = runtime.new_buffers(past + rows)
    prefix = torch.randint(0, V, (past,), generator=generator)
    causal = torch.zeros(past, past).masked_fill_(torch.ones(past, past, dtype=torch.bool).triu(1), -torch.inf)
    with torch.inference_mode():
        runtime.forward(prefix, torch.arange(past), causal, keys, values, torch.arange(past))
    visible = torch.rand(rows, past + rows, generator=generator) > 0.3  # a tree's: hidden keys here and there
    visible[:, past:] &= torch.ones(rows, rows, dtype=torch.bool).tril()
    visible[:, past:] |= torch.eye(rows, dtype=torch.bool)  # each token sees itself
    visible[:, [3, 50]] = False  # hidden from every row: whatever their values, they weigh nothing
    values[:, :, [3, 50]] = 1e38
    mask = torch.zeros(rows, past + rows).masked_fill_(~visible, -torch.inf)
    tokens = torch.randint(0, V, (rows,), generator=generator)
    positions = past + torch.randint(0, rows, (rows,), generator=generator)

    def logits(out_rows=None) -> torch.Tensor:
        k, v = keys.clone(), values.clone()
        with torch.inference_mode():
            return runtime.forward(tokens, positions, mask, k, v, torch.arange(rows) if out_rows is None else out_rows)

    counted = layers_in_c(monkeypatch)
    whole = logits()
    assert counted == [2, "head"]
    assert torch.equal(logits(torch.tensor([rows - 1, 0])), whole[[rows - 1, 0]])  # the rows asked for, in order
    native, runtime.native = runtime.native, None
    torch.testing.assert_close(whole, logits(), rtol=1e-5, atol=1e-5)
    runtime.native = native
    # one call for every layer is one call a layer, bit for bit (the residual stream and the caches)
    heads, kv_heads, head_dim, scaling, eps = runtime.dims
    run = blocks.NativeForward(runtime.cos[positions], runtime.sin[positions], mask,
                               (32, heads, kv_heads, head_dim, runtime.intermediate, scaling, eps))
    x = torch.randn(rows, 32, generator=generator)
    k1, v1, k2, v2 = keys.clone(), values.clone(), keys.clone(), values.clone()
    together = run.layers(runtime._native_table(native), x.clone(), k1, v1)
    apart = x.clone()
    for index, layer in enumerate(native):
        apart = run.layer(layer, apart, k2[index], v2[index])
    assert torch.equal(together, apart) and torch.equal(k1, k2) and torch.equal(v1, v2)


def _quantised_llama(seed: int):
    from transformers import LlamaForCausalLM

    from tiny import tiny_config

    torch.manual_seed(seed)
    model = quantise_like_gguf(LlamaForCausalLM(tiny_config(V, 2, 0.1, head_dim=64)).eval())
    install_blocks(model)
    return model


def _model_on_c_layers(seed: int) -> CompiledModel:
    runtime = CompiledModel(_quantised_llama(seed), compile=False)
    assert runtime.native is not None and all(runtime.native)
    return runtime


@pytest.mark.parametrize("build", WITHOUT_AVX512)
def test_the_c_layers_run_where_the_kernel_has_vectors_only(build, monkeypatch, tmp_path):
    """Without AVX-512, the C layers run on AVX2's vectors; where the kernel has only its plain loops
    (no AVX2 either) the layers run on torch's operations, each product on its measured kernel (the
    loops' C layers ran the embedded target's `ar` at 0.6x that speed)."""
    lib = blocks.build(tmp_path, (*blocks.FLAGS, *WITHOUT_AVX512[build]))
    assert lib is not None
    monkeypatch.setattr(blocks, "library", lambda: lib)
    monkeypatch.setattr(compiled, "vectorised", blocks.vectorised)  # (bound at import: the library's now)
    runtime = CompiledModel(_quantised_llama(7), compile=False)
    assert (runtime.native is not None and all(runtime.native)) == (build == "avx2" and HAS_AVX2)


@pytest.mark.parametrize("build", ["native", *WITHOUT_AVX512, "apple-clang"])
def test_a_token_gets_the_same_bits_alone_in_a_chain_or_a_tree_over_a_long_cache(build, monkeypatch, tmp_path):
    """The C layer's attention goes over the cache in chunks of keys (several here: 200 cached
    tokens), a key/value head's query heads and a few rows together, and shares chunks out among
    the threads when there are few rows; a query's arithmetic must not depend on any of that: a
    prompt prefilled at once or token by token, and a tree's rows computed together, in part, or
    on one thread, give the same logits and caches bit for bit, and torch's layer within float32
    rounding. Also where the CPU lacks AVX-512 (AVX2 vectors, or the plain loops: built here without
    them), and built as a Mac builds it (Apple's clang, torch's OpenMP runtime: apple_clang_build)."""
    if build == "apple-clang":
        lib = apple_clang_build(tmp_path, monkeypatch)
        assert lib is not None, blocks.build_error
        monkeypatch.setattr(blocks, "library", lambda: lib)
    elif build != "native":
        lib = blocks.build(tmp_path, (*blocks.FLAGS, *WITHOUT_AVX512[build]))
        assert lib is not None
        monkeypatch.setattr(blocks, "library", lambda: lib)
        if build == "loops":  # (the runtime takes the C layers only where they run on vectors: asked for here)
            monkeypatch.setattr(compiled, "vectorised", lambda lib=None: True)
    runtime = _model_on_c_layers(7)
    past, rows, generator = 200, 12, torch.Generator().manual_seed(7)
    prompt = torch.randint(0, V, (past,), generator=generator)

    def causal(n: int, before: int = 0) -> torch.Tensor:
        return torch.zeros(n, before + n).masked_fill_(torch.ones(n, before + n, dtype=torch.bool).triu(before + 1),
                                                       -torch.inf)

    with torch.inference_mode():
        keys, values = runtime.new_buffers(past + rows)
        at_once = runtime.forward(prompt, torch.arange(past), causal(past), keys, values, torch.arange(past))
        one_keys, one_values = runtime.new_buffers(past + rows)
        by_token = torch.cat([runtime.forward(prompt[t:t + 1], torch.tensor([t]), causal(1, t), one_keys, one_values,
                                              torch.tensor([0])) for t in range(past)])
    assert torch.equal(at_once, by_token)
    assert torch.equal(keys, one_keys) and torch.equal(values, one_values)

    visible = torch.rand(rows, past + rows, generator=generator) > 0.2  # a tree's: hidden keys here and there,
    visible[:, 64:128] = False  # a whole chunk hidden from every row,
    visible[:, past:] &= torch.ones(rows, rows, dtype=torch.bool).tril()  # no row sees a later one
    visible[:, past:] |= torch.eye(rows, dtype=torch.bool)
    mask = torch.zeros(rows, past + rows).masked_fill_(~visible, -torch.inf)
    tokens = torch.randint(0, V, (rows,), generator=generator)
    positions = past + torch.randint(0, rows, (rows,), generator=generator)

    def tree(n: int, threads: int | None = None, native=runtime.native) -> tuple:
        k, v = keys.clone(), values.clone()
        before, runtime.native = runtime.native, native
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads or threads_before)
        try:
            with torch.inference_mode():
                logits = runtime.forward(tokens[:n], positions[:n], mask[:n, : past + n], k, v, torch.arange(n))
        finally:
            torch.set_num_threads(threads_before)
            runtime.native = before
        return logits, k[:, :, : past + n], v[:, :, : past + n]

    whole = tree(rows)
    for part in (tree(1), tree(5), tree(rows, threads=1), tree(rows, threads=3)):
        n = part[0].shape[0]
        assert all(torch.equal(a, b[..., :n, :] if a.dim() == 2 else b[:, :, : past + n])
                   for a, b in zip(part, whole))
    torch.testing.assert_close(tree(rows, native=None)[0], whole[0], rtol=1e-5, atol=1e-5)  # torch's layer


def test_prompts_run_in_c_only_where_the_blocks_kernel_measured_faster_for_them(monkeypatch):
    """A forward of more than MAX_ROWS tokens (a prompt) runs in the C layers where the verdicts for
    prompts name the blocks kernel on most of the layers' weights, else on torch's layer, each
    product by its measured kernel; fewer tokens always run in C. Both paths give the same logits
    to within float32 rounding, and neither reads a float32 weight of a layer on blocks (kept
    blocks leave those in a file's pages): torch's GEMM multiplies by the weights rebuilt from
    their blocks, and the head runs on its blocks."""
    runtime = _model_on_c_layers(3)  # (verdicts: the blocks kernel for every row count)
    model = runtime.model
    assert runtime.prompts_in_c
    linears = [module for module in model.model.layers.modules() if hasattr(module, "_rsd_kernels")]
    for module in linears:  # torch's product measured faster for prompts
        module._rsd_kernels = ("blocks", "blocks", "torch")
    model.lm_head._rsd_kernels = ("torch", "blocks", "torch")  # (and for the head's one row: the Xeon's)
    on_torch = CompiledModel(model, compile=False)
    assert not on_torch.prompts_in_c and all(on_torch.native)
    for module in linears:  # the MLP's three products (3/4 of the weights) on blocks: the majority
        module._rsd_kernels = ("blocks", "blocks", "blocks" if module.in_features != module.out_features else "torch")
    assert CompiledModel(model, compile=False).prompts_in_c

    in_c, multiplied = [], []
    layers, linear = blocks.NativeForward.layers, F.linear
    monkeypatch.setattr(blocks.NativeForward, "layers", lambda self, *args: in_c.append(1) or layers(self, *args))
    monkeypatch.setattr(F, "linear", lambda x, weight, *args: multiplied.append(weight.data_ptr())
                        or linear(x, weight, *args))
    float_weights = {module.weight.data_ptr() for module in model.modules() if isinstance(module, torch.nn.Linear)}
    prompt = torch.randint(0, V, (small_batch.MAX_ROWS + 36,), generator=torch.Generator().manual_seed(3))

    def read(runtime: CompiledModel, n: int, last_only: bool = False) -> tuple[torch.Tensor, bool]:
        in_c.clear()
        mask = torch.zeros(n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        keys, values = runtime.new_buffers(n)
        with torch.inference_mode():
            logits = runtime.forward(prompt[:n], torch.arange(n), mask, keys, values,
                                     torch.arange(n - 1 if last_only else 0, n))
        return logits, bool(in_c)

    (c_logits, was_in_c), (torch_logits, was_in_torch) = read(runtime, len(prompt)), read(on_torch, len(prompt))
    assert was_in_c and not was_in_torch
    torch.testing.assert_close(torch_logits, c_logits, rtol=1e-5, atol=1e-5)
    multiplied.clear()
    last, _ = read(on_torch, len(prompt), last_only=True)  # (as a prompt is read: the last row's logits)
    assert len(multiplied) >= 7 * len(model.model.layers) and not float_weights & set(multiplied)
    assert torch.equal(last, torch_logits[-1:])
    few = small_batch.MAX_ROWS
    assert read(on_torch, few)[1] and torch.equal(read(on_torch, few)[0], read(runtime, few)[0])


def test_auto_measures_costs_again_for_another_version_of_the_c_library(quantised_pair, monkeypatch):
    _, kernel, static = quantised_pair
    decoder = Decoder(kernel[0], kernel[1], V, make_shape("auto"), SamplingParams(), {2}, None, static[False])
    key = auto.cost_key(decoder)
    assert key == auto.cost_key(decoder)
    monkeypatch.setattr(blocks, "version", lambda: "another")
    assert auto.cost_key(decoder) != key


@pytest.mark.parametrize("shape", [MC_SHAPES[1], MC_SHAPES[4]], ids=lambda s: s.describe())
def test_first_two_tokens_follow_the_target_distribution_on_the_blocks_kernel(quantised_pair, shape):
    reference, kernel, static = quantised_pair
    sampling = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, V)
    for seed in range(N_SAMPLES):
        first, second = run(kernel, static[False], shape, sampling, PAIR_DRAW, seed)[:2]
        counts[first, second] += 1
    assert chi_square_pvalue(counts, exact_joint(reference[0], sampling) * N_SAMPLES) > 1e-3


def test_the_c_layer_matches_transformers_for_trees_pruning_and_growth(quantised_pair):
    """The tree test of test_compiled on the C layers: a 6-node tree after the prompt, pruning to one
    path, chains past the buffers' first capacity — every logit as transformers' eager forward on
    torch's products."""
    from rsd_cli.compiled import StaticLM
    from rsd_cli.engine import CachedLM
    from test_compiled import assert_same_tree_logits

    reference, _, static = quantised_pair
    ours, theirs = StaticLM(static[False].target, V, capacity=12), CachedLM(reference[0], V)
    base = assert_same_tree_logits(ours, theirs)
    kept = list(range(base)) + [base + n for n in (0, 1, 3, 5)]
    for lm in (ours, theirs):
        lm.keep(kept)
    for chain in ([2], [1, 3], [4, 0, 2], [1] * 9, [3, 2] * 10):
        torch.testing.assert_close(ours.extend(chain, last_only=False), theirs.extend(chain, last_only=False),
                                   atol=1e-5, rtol=1e-5)
    assert ours.capacity > 12 and ours.length == theirs.length


def assert_c_layers_give_transformers_results(monkeypatch, runtimes: tuple, kernel: tuple, reference, shapes_to_try):
    """A 2-layer target on C layers (runtimes: its CompiledModel and its draft's, uncompiled; kernel:
    their models) against transformers' forward of `reference`: a tree's logits with both layers in
    one call of the library and then the head, pruning and growth, and each shape's greedy output
    equal to plain greedy."""
    from test_compiled import assert_same_tree_logits
    from test_engine import PROMPT

    target, draft = runtimes
    counted = layers_in_c(monkeypatch)
    ours, theirs = StaticLM(target, V, capacity=12), CachedLM(reference, V)
    base = assert_same_tree_logits(ours, theirs)
    assert counted[:2] == [2, "head"]
    for lm in (ours, theirs):
        lm.keep(list(range(base)) + [base + n for n in (0, 1, 3, 5)])
    for chain in ([2], [1, 3], [3, 2] * 10):
        torch.testing.assert_close(ours.extend(chain, last_only=False), theirs.extend(chain, last_only=False),
                                   atol=1e-5, rtol=1e-5)
    ours.release()
    decoding = Runtimes(target, draft, "auto")
    for shape in shapes_to_try:
        decoder = Decoder(kernel[0], kernel[1], V, shape, SamplingParams(temperature=0), set(), runtimes=decoding)
        tokens = [t for event in decoder.generate(PROMPT, 20, 0) for t in event.emitted]
        assert tokens == plain_greedy(reference, 20), shape.describe()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_qwen2_qwen3_and_mistral_models_run_every_layer_in_c(kind, monkeypatch):
    """Qwen2's layers add biases to q, k and v, Qwen3's RMS-norm each head of q and k, Mistral's are
    Llama's: on quantised weights every layer runs in C (the biases added to the stacked product,
    the head norms before the rotation), with transformers' logits for trees, pruning and growth,
    and each variant's greedy output is plain greedy."""
    from tiny import tiny_relative

    reference = tuple(quantise_like_gguf(tiny_relative(kind, V, layers=layers, seed=seed, scale=0.1))
                      for layers, seed in ((2, 0), (1, 1)))
    kernel = tuple(copy.deepcopy(model) for model in reference)
    for model in kernel:
        install_blocks(model)
    target, draft = (CompiledModel(model, False) for model in kernel)
    assert target.all_in_c
    assert all((layer.qkv_bias is not None, layer.head_norms[0] is not None) == (kind == "qwen2", kind == "qwen3")
               for layer in target.native)
    assert_c_layers_give_transformers_results(monkeypatch, (target, draft), kernel, reference[0], shapes())


def k_quant_model(layers: int = 2, seed: int = 0):
    """A tiny Llama whose rows are whole K-quant super-blocks, quantised like a Q4_K_M file."""
    from transformers import LlamaForCausalLM
    from tiny import quantise_like_k_quants, tiny_config

    torch.manual_seed(seed)
    config = tiny_config(V, layers, 0.1, hidden_size=256, intermediate_size=512, head_dim=64)
    return quantise_like_k_quants(LlamaForCausalLM(config).eval())


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"])
def test_gguf_types_become_blocks_only_with_their_hint_and_give_back_every_value(kind, tmp_path):
    """A weight of each type the hints serve (made by tests/tiny.py, dequantised by gguf as
    transformers does): its float values alone are no blocks; with the scales and offsets read from
    its bytes it becomes blocks of its format that rebuild every weight bit for bit (identity rows)
    and compute linear's product, with AVX-512 and without; a wrong hint or a nudged value: None."""
    from rsd_cli import gguf_hints
    from tiny import dequantise_k, quantise_k

    torch.manual_seed(1)
    w = torch.randn(48, 512) * 0.05
    w[3] = w[3].abs() + 0.1  # a row of positive values (no offset in K-quants)
    w[5, :32] = 0.0  # a block of zeros
    raw = quantise_k(w, kind)
    values = dequantise_k(raw, kind)
    fmt = gguf_hints.FORMAT_OF[kind]
    group = blocks.scale_group(fmt)
    found = torch.from_numpy(gguf_hints.scales_and_offsets(raw, kind))
    assert found.shape == (48, 2 * 512 // group)
    hint = gguf_hints.hint(fmt, found)
    if kind.endswith("_K") or kind.startswith("IQ"):
        assert blocks.quantised_blocks(values) is None
    x = torch.randn(9, 512)
    exact = (x.double() @ values.double().T).float()
    for lib in (blocks.library(), *other_builds(tmp_path)):
        made = blocks.hinted_blocks(values, hint, lib)
        assert made is not None and blocks.block_format(made) == fmt and made.shape == (48, 16, blocks.BYTES[fmt])
        for rows in (1, 3, 8, 64):
            assert torch.equal(blocks.blocks_linear(torch.eye(512)[:rows], made, lib=lib), values.T[:rows])
        assert torch.equal(blocks.dequantised(made, lib=lib), values)
        torch.testing.assert_close(blocks.blocks_linear(x, made, lib=lib), exact, rtol=1e-5, atol=1e-5)
    setattr(values, blocks.HINT, hint)
    assert blocks.block_format(blocks.quantised_blocks(values)) == fmt
    nudged = values.clone()
    nudged[7, 100] = torch.nextafter(nudged[7, 100], torch.tensor(1.0))
    assert blocks.hinted_blocks(nudged, hint) is None
    wrong = blocks.Hint(fmt, hint.scale * 2, hint.offset)
    assert blocks.hinted_blocks(values, wrong) is None
    assert blocks.hinted_blocks(values[:, :256], hint) is None  # a hint of another shape


def test_a_k_quant_model_runs_every_layer_in_c_with_mixed_formats_in_its_stacks(monkeypatch):
    """Q4_K_M holds v (and down) in Q6_K beside q and k in Q4_K: the C layer runs stacked q/k/v and
    gate/up whose parts have formats of their own (q4_1 + q8_16, q4_1 + q5_1 here), with
    transformers' logits for trees, pruning and growth, and greedy output equal to plain greedy."""
    from test_compiled import assert_same_tree_logits

    reference = k_quant_model()
    kernel = copy.deepcopy(reference)
    for name, parameter in kernel.named_parameters():  # (a deep copy keeps no attributes of a Parameter)
        hint = getattr(dict(reference.named_parameters())[name], blocks.HINT, None)
        if hint is not None:
            setattr(parameter, blocks.HINT, hint)
    install_blocks(kernel)
    layer = kernel.model.layers
    linears = (layer[0].self_attn.q_proj, layer[0].self_attn.v_proj, layer[0].mlp.down_proj, layer[1].mlp.up_proj,
               kernel.lm_head)
    assert [blocks.block_format(small_batch.blocks_of(m)) for m in linears] == ["q4_1", "q8_16", "q8_16", "q5_1", "q8_16"]
    target = CompiledModel(kernel, False)
    assert target.all_in_c
    assert target.native[0].formats.tolist() == [0, 0, 0, 5, 0, 5, 0]  # q o gate down k v up
    assert target.native[1].formats.tolist() == [0, 0, 0, 0, 0, 0, 4]
    assert_c_layers_give_transformers_results(monkeypatch, (target, target), (kernel, kernel), reference, shapes()[:3])
    # compiled (--compile on): the graph's products on the same blocks, new formats included
    assert_same_tree_logits(StaticLM(CompiledModel(kernel, True), V, capacity=12), CachedLM(reference, V))


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_a_model_of_16_bit_values_runs_on_c_layers_greedy_exactly(fmt):
    """A model published in bfloat16 (or float16) and loaded in float32 on a CPU: every linear is kept
    as 16-bit floats, every layer runs in C, and the greedy output is plain decoding's."""
    reference = []
    for layers, seed in ((2, 0), (1, 1)):
        model = tiny_model(V, layers=layers, seed=seed, scale=0.1)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(FORMATS[fmt](parameter) if fmt == "f16" else parameter.bfloat16().float())
        reference.append(model)
    kernel = tuple(copy.deepcopy(model) for model in reference)
    for model in kernel:
        install_blocks(model)
    # (bfloat16 values this small are half floats too, kept as those: the same 2 bytes)
    assert blocks.block_format(small_batch.blocks_of(kernel[0].model.layers[0].mlp.up_proj)) in ("f16", fmt)
    static = Runtimes(CompiledModel(kernel[0], False), CompiledModel(kernel[1], False), "auto")
    assert static.target.native is not None and all(static.target.native)
    expected = plain_greedy(reference[0], 25)
    for shape in shapes()[:5:2]:  # ar, mss, rsd-c
        assert run(kernel, static, shape, SamplingParams(temperature=0), 25, seed=0) == expected


def test_without_room_for_stacked_copies_the_layers_run_in_torch(quantised_pair, monkeypatch):
    _, kernel, static = quantised_pair
    monkeypatch.setattr(small_batch, "available_memory", lambda: 1024)
    tight = CompiledModel(kernel[0], compile=False)
    assert tight.native is None and all(fused == (None, None) for _, _, fused in tight.layers)
    tokens = torch.tensor([1, 3, 4])
    mask = torch.zeros(3, 3).masked_fill_(torch.ones(3, 3, dtype=torch.bool).triu(1), -torch.inf)
    with torch.inference_mode():
        logits = [runtime.forward(tokens, torch.arange(3), mask, *runtime.new_buffers(3), torch.arange(3))
                  for runtime in (tight, static[False].target)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
