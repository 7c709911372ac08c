#!/usr/bin/env bash
# The measurements quoted in docs/benchmarks.md and the issue notes (results/ holds their output).
# Run on a quiet machine: bash benchmarks/run_all.sh [OUT]   (60 minutes on a 2-core AMD EPYC,
# about 25 on a 2-core Intel Xeon). OUT defaults to benchmarks/results; docs/benchmarks.md's Xeon numbers
# are in benchmarks/results/intel-xeon.
set -euo pipefail
cd "$(dirname "$0")/.."
RSD=.venv/bin/rsd
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
# 1. fixed target budget: block efficiency of every variant at T=1
$RSD bench --budgets 6,10,14,21,30 --variants ar,sd,mss,spectr,rsd-c,rsd-s --limit 2 -n 48 --no-assisted \
    --json --plot "$OUT/budgets.svg" > "$OUT/budgets.json"
# 2. fixed draft length: speed against ar and transformers' assisted generation, T=1
$RSD bench --depths 1,2,3 --variants ar,sd,mss,rsd-c,rsd-s --limit 4 -n 64 --assisted \
    --json --plot "$OUT/depths.svg" > "$OUT/depths.json"
# 2b. the same at the default profile's temperature
$RSD bench --depths 1,2 --temperatures 0.7 --variants ar,sd,mss,rsd-c,rsd-s --limit 4 -n 64 --no-assisted \
    --json > "$OUT/depths-t07.json"
# 2c. greedy: every variant gives the target's greedy output; how fast
$RSD bench --depths 1,2,3 --temperatures 0 --variants ar,sd,mss,rsd-c,rsd-s --limit 4 -n 64 --no-assisted \
    --json > "$OUT/depths-t0.json"
# 2d. two root children / beams (the default profile's width) at T=0.7 and T=1
$RSD bench --depths 1,2 --width 2 --temperatures 0.7,1 --variants ar,sd,mss,rsd-c,rsd-s --limit 4 -n 64 \
    --no-assisted --json > "$OUT/width2.json"
$RSD bench --depths 1,2 --width 2 --temperatures 0 --variants ar,sd,rsd-c,rsd-s --limit 4 -n 64 --no-assisted \
    --json > "$OUT/width2-t0.json"
# 3. without vs with replacement at the same shape, more prompts (lower variance than 1.)
$RSD bench --budgets 14,30 --variants ar,mss,rsd-c --limit 8 -n 32 --no-assisted --json \
    > "$OUT/budgets-wor-vs-wr.json"
# 4. sd with γ = 4 against ar (issue #4's benchmark)
$RSD bench --depths 4 --variants ar,sd --limit 8 -n 64 --no-assisted --json > "$OUT/sd-gamma4.json"
# 4b. the shallow trees that pay on a 2-core CPU, on more prompts (less noise), against the peer
$RSD bench --depths 1 --width 2 --variants ar,sd,mss,rsd-c --limit 12 -n 96 --assisted --json \
    > "$OUT/headline.json"
# 5. without vs with replacement on shared contexts (paired; settles what 3. cannot)
.venv/bin/python benchmarks/paired.py --budgets 14,30 --limit 4 -n 48 --draws 16 > "$OUT/paired.json"
# 6. expected acceptance of the default draft on held-out answers
.venv/bin/python benchmarks/acceptance.py | tee "$OUT/acceptance.txt"
# 7. one target forward for 1..32 new tokens, small-batch CPU kernels against torch's default
.venv/bin/python benchmarks/forward_cost.py > "$OUT/forward-cost.json"
# 8. where a step's time goes, per variant (forwards, glue, draws, verification, cache pruning)
.venv/bin/python benchmarks/profile_step.py --json > "$OUT/profile-step.json"
# 9. how far a draft's acceptance could go (draft temperature, the target's own early exits)
.venv/bin/python benchmarks/acceptance_limits.py > "$OUT/acceptance-limits.json"
# 10. would a lower-precision draft pay? call cost and acceptance in float32, bfloat16, int8
.venv/bin/python benchmarks/draft_precision.py | tail -1 > "$OUT/draft-precision.json"
# 11. the runtimes (--compile): one forward of 1..16 tokens on each, then the shallow trees under
# each, interleaved, against transformers' static-cache generate (results/amd-epyc-compile/)
.venv/bin/python benchmarks/runtime_cost.py --out "$OUT/runtime-cost.json"
$RSD bench --variants ar,sd,mss,rsd-c --depths 1 --width 2 --compile on,off,auto --limit 6 -n 64 \
    --temperatures 1 --json > "$OUT/compile-depth1-t1.json"
