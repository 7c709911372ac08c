#!/usr/bin/env bash
# The measurements quoted in the README and the issue notes. Run on a quiet machine:
#   bash benchmarks/run_all.sh      (about 20 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RSD=.venv/bin/rsd
OUT=benchmarks/results
mkdir -p "$OUT"
# 1. fixed target budget: block efficiency of every variant at T=1
$RSD bench --budgets 6,10,14,21,30 --variants ar,sd,mss,spectr,rsd-c,rsd-s --limit 2 -n 48 --no-assisted \
    --json --plot "$OUT/budgets.svg" > "$OUT/budgets.json"
# 2. fixed draft length: speed against ar and transformers' assisted generation, T=1
$RSD bench --depths 1,2,4 --variants ar,sd,mss,spectr,rsd-c,rsd-s --limit 2 -n 48 --assisted \
    --json --plot "$OUT/depths.svg" > "$OUT/depths.json"
# 3. the same with an 8192-token draft head
RSD_DRAFT_VOCAB=8192 $RSD bench --depths 1,2,4 --variants ar,sd,rsd-s --limit 2 -n 48 --no-assisted \
    --json > "$OUT/depths-vocab8192.json"
# 4. greedy decoding
$RSD bench --temperatures 0 --depths 2,4 --variants ar,sd,rsd-c,rsd-s --limit 2 -n 48 --assisted \
    --json > "$OUT/greedy.json"
