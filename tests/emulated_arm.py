"""rsd's C kernel built for 64-bit ARM (NEON with GCC and with clang, and its plain loops) and run under
qemu-user, so that an x86 machine checks the ARM builds' products: where `aarch64-linux-gnu-gcc` and
`qemu-aarch64` are installed (Debian: `apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross
qemu-user`, and clang for the clang build; .ci/run installs them where it can). The kernel's source is
compiled with a small driver into a static program that answers one library call a run, read from a
file; `EmulatedKernel` makes those calls look like the ctypes library's (blocks.blocks_linear,
blocks.dequantised and blocks.vectorised take it as `lib`)."""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path

from rsd_cli import blocks

CROSS_COMPILER = "aarch64-linux-gnu-gcc"
EMULATOR = "qemu-aarch64"
GCC = (CROSS_COMPILER, "-fopenmp")
# clang for ARM (Apple's compiler is a clang: its arm_neon.h defines intrinsics as macros, which GCC's does
# not), with the cross toolchain's C library, linker and OpenMP runtime (GCC's: there is no static ARM libomp)
CLANG = ("clang", "--target=aarch64-linux-gnu", "-fopenmp=libgomp")
# (compiler, flags): as an ARM machine builds it (blocks.FLAGS there: no -march, NEON is in every 64-bit ARM
# CPU), with GCC and with clang, and the plain loops (NEON left out)
ARM_BUILDS = {"neon": (GCC, ()), "neon-clang": (CLANG, ()), "arm-loops": (GCC, ("-march=armv8-a+nosimd",))}

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
/* a request: op, M, N, K, format, threads (int32), then for op 1 x (M * K floats) and the weight's blocks,
   for op 2 the blocks; the reply: op 0 blocks_vectorised() (int32), op 1 y (M * N floats), op 2 the
   weight (N * K floats) */
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = fopen(argv[1], "rb");
  int32_t h[6];
  if (!in || fread(h, 4, 6, in) != 6) return 3;
  const int op = h[0], M = h[1], N = h[2], K = h[3], format = h[4], threads = h[5];
  const size_t w_bytes = op ? (size_t)N * (K / BLOCK) * FORMAT_BYTES[format] : 0;
  const size_t x_floats = op == 1 ? (size_t)M * K : 0;
  const size_t out_floats = op == 1 ? (size_t)M * N : op == 2 ? (size_t)N * K : 0;
  float* x = malloc(x_floats * 4 + 4);
  uint8_t* w = malloc(w_bytes + 4);
  float* out = malloc(out_floats * 4 + 4);
  if (fread(x, 4, x_floats, in) != x_floats || fread(w, 1, w_bytes, in) != w_bytes) return 4;
  fclose(in);
  int32_t answer = 0;
  if (op == 0) answer = blocks_vectorised();
  if (op == 1) blocks_linear(x, w, out, M, N, K, format, threads);
  if (op == 2) blocks_dequantise(w, out, N, K, format, threads);
  FILE* reply = fopen(argv[2], "wb");
  if (op == 0) fwrite(&answer, 4, 1, reply);
  else fwrite(out, 4, out_floats, reply);
  fclose(reply);
  return 0;
}
"""


def tools(build: str = "neon") -> bool:
    """Whether this machine can build and run that ARM build (an x86 one with the tools installed: the
    cross compiler with the static C and OpenMP libraries the driver links, and the emulator; for
    neon-clang clang too)."""
    if shutil.which(CROSS_COMPILER) is None or shutil.which(EMULATOR) is None:
        return False
    if shutil.which(ARM_BUILDS[build][0][0]) is None:
        return False
    for library in ("libc.a", "libgomp.a"):  # (a bare name back: the compiler has no such file)
        found = subprocess.run([CROSS_COMPILER, f"-print-file-name={library}"], capture_output=True, text=True)
        if found.returncode or "/" not in found.stdout:
            return False
    return True


class EmulatedKernel:
    """The kernel built for 64-bit ARM (one of ARM_BUILDS) into `folder`, its calls run under qemu-user."""

    def __init__(self, folder: Path, build: str):
        compiler, flags = ARM_BUILDS[build]
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.c").write_text(blocks.SOURCE)
        (folder / "driver.c").write_text('#include "kernel.c"\n' + DRIVER)
        self.program = folder / "driver"
        made = subprocess.run([*compiler, "-O3", *flags, "-static", str(folder / "driver.c"), "-o", str(self.program),
                               "-lm"], capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, f"the {build} build failed:\n{made.stderr[-3000:]}"

    def _call(self, header: tuple, *parts: bytes) -> bytes:
        request, reply = self.folder / "request", self.folder / "reply"
        request.write_bytes(struct.pack("6i", *header) + b"".join(parts))
        subprocess.run([EMULATOR, str(self.program), str(request), str(reply)], check=True, timeout=300)
        return reply.read_bytes()

    def blocks_vectorised(self) -> int:
        return struct.unpack("i", self._call((0, 0, 0, 0, 0, 1)))[0]

    def blocks_linear(self, x: int, w: int, y: int, M: int, N: int, K: int, fmt: int, threads: int) -> None:
        w_bytes = N * (K // blocks.BLOCK) * _block_bytes(fmt)
        out = self._call((1, M, N, K, fmt, threads), ctypes.string_at(x, M * K * 4), ctypes.string_at(w, w_bytes))
        ctypes.memmove(y, out, M * N * 4)

    def blocks_dequantise(self, w: int, out: int, N: int, K: int, fmt: int, threads: int) -> None:
        w_bytes = N * (K // blocks.BLOCK) * _block_bytes(fmt)
        values = self._call((2, 0, N, K, fmt, threads), ctypes.string_at(w, w_bytes))
        ctypes.memmove(out, values, N * K * 4)


def _block_bytes(fmt: int) -> int:
    name = blocks.FORMATS[fmt]
    return blocks.BYTES.get(name, 2 * blocks.BLOCK)  # (16-bit floats: 2 bytes a weight)
