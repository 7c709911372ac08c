#!/usr/bin/env bash
# The GPU checks and figures issue #14 asks for, in parts that each fit one device call (10 min).
# On the GPU machine of the `device` tool, after the three staging calls of
# ../shared/device/stage-embedded (carry .device-stage/3, .device-stage/whl, .device-stage/env.sh):
#
#   source .device-stage/env.sh && bash benchmarks/device_check.sh tests     # the suite on CUDA
#   source .device-stage/env.sh && bash benchmarks/device_check.sh costs     # one forward: eager / static / CUDA graphs
#   source .device-stage/env.sh && bash benchmarks/device_check.sh bench     # end to end, bf16, with hf-static
#   source .device-stage/env.sh && bash benchmarks/device_check.sh cpu16     # the same on the 16-core CPU
#   source .device-stage/env.sh && bash benchmarks/device_check.sh lookup    # lookup on grounded prompts, GPU then 16 cores
#   source .device-stage/env.sh && bash benchmarks/device_check.sh profile   # where a step's time goes on the GPU
#   source .device-stage/env.sh && bash benchmarks/device_check.sh trace     # a step's launches, copies, syncs
#   source .device-stage/env.sh && bash benchmarks/device_check.sh kernel16  # the C kernel's prefetch on 16 cores; auto's policy
#   source .device-stage/env.sh && bash benchmarks/device_check.sh stepgraphs  # device steps' maths as CUDA graphs, steps queued ahead: A/B
#   source .device-stage/env.sh && bash benchmarks/device_check.sh auto      # auto against ar, prompt by prompt: GPU, then 16 cores
#   source .device-stage/env.sh && bash benchmarks/device_check.sh together  # --samples decoded together vs one after the other
#   source .device-stage/env.sh && bash benchmarks/device_check.sh busy16    # the thread governor on 16 cores beside busy processes
#   source .device-stage/env.sh && bash benchmarks/device_check.sh prompts   # a long prompt's causal attention against the mask: GPU, 16 cores
#   source .device-stage/env.sh && bash benchmarks/device_check.sh architectures  # 59 families on that machine's transformers
#   source .device-stage/env.sh && bash benchmarks/device_check.sh controls  # logit bias, --ignore-eos, windows in CUDA graphs
#   source .device-stage/env.sh && bash benchmarks/device_check.sh decoders  # a fresh decoder per answer: step graphs shared or not
#   source .device-stage/env.sh && bash benchmarks/device_check.sh families  # gpt-oss, OPT, GPT-2, Gemma 4, DeepSeek V3 in CUDA graphs against eager
#   source .device-stage/env.sh && bash benchmarks/device_check.sh families2  # GPT-J, Falcon, Gemma 3n, and BLOOM's, GPT-Neo's, Llama 4's, LFM2's, Qwen3.5's, Granite 4's, Nemotron-H's, Bamba's and Mamba-2's trees
#   source .device-stage/env.sh && bash benchmarks/device_check.sh bf16      # bf16 logits against transformers' (compiled: rounding each result or not) and its cost
#   source .device-stage/env.sh && bash benchmarks/device_check.sh catchup   # the draft's catch-up past 64 tokens: graphed pieces or one forward; auto vs ar
#   source .device-stage/env.sh && bash benchmarks/device_check.sh distill   # distill's sampling: rsd's runtime (answers together) against generate
#   source .device-stage/env.sh && bash benchmarks/device_check.sh lookupsteps  # lookup chains decided on the device against the host path; auto vs ar
#
# Results go to $OUT (what the device tool brings back), else benchmarks/results/gpu/.
set -uo pipefail
part=${1:?which part: tests, costs, bench, cpu16, lookup, profile, trace, kernel16, stepgraphs, auto, together, busy16, prompts, architectures, controls, decoders, families, families2, bf16, catchup, distill or lookupsteps}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# that machine's packages keep no bytecode (every process compiled ~2,300 modules' source, ~12 s):
# a writable cache of its own, so only the first process of a lease pays
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
py=python3
# sized to end well inside one call (on the H100: ~150 s for `bench`, ~100 s for `costs`, ~280 s
# for the suite with 8 workers); eager rows (--compile off) cost ~10x a compiled one there
bench=(-m rsd_cli bench --variants ar,sd,rsd-c,auto --depths 1,2 --width 3 --temperatures 0,1
       --limit 2 -n 96 --no-assisted --json)
# the peer a GPU user would pick, against `ar` and `auto` compiled, measured in one run of its own
peer=(-m rsd_cli bench --variants ar,auto --depths 1 --temperatures 0,1 --limit 2 -n 96 --no-assisted
      --compile on --hf-static --json)
case $part in
  tests)  # the GPU-only tests first (CUDA graphs), then everything; the log comes back either way, a line
    # per test as it ends (-o addopts= -v: a run cut by the call's limit still names what failed)
    each=(-p no:warnings -p no:logging -p no:benchmark -o addopts= -v -rfEs --tb=short)
    $py -m pytest "${each[@]}" tests/test_compiled.py -k "cuda or CUDA" 2>&1 | grep -v vectorized_gather_kernel |
      tee "$out/cuda-tests.txt"
    workers=(); $py -c "import xdist" 2>/dev/null && workers=(-n 8)  # pytest-xdist where it is installed
    $py -m pytest "${each[@]}" -x "${workers[@]}" 2>&1 | grep -v vectorized_gather_kernel | tee "$out/suite.txt" ;;
  costs)
    $py benchmarks/runtime_cost.py --rows 1,4,16 --out "$out/runtime-cost.json" 2>&1 |
      tee "$out/runtime-cost.txt" ;;
  bench)  # the default profile: bf16 on a GPU. transformers' static-cache generate runs in a process of
    # its own, after rsd's rows are saved: a device-side assert in it (seen in an earlier trial of its
    # compiled static cache) poisons the CUDA context for every later call of the process
    $py "${bench[@]}" --compile on > "$out/bench-gpu.json"
    $py "${peer[@]}" > "$out/bench-gpu-hf-static.json"
    # what `auto` measured and learnt there (its forward costs, its per-shape timings and acceptance)
    for f in costs auto compile; do cp "${RSD_CACHE_DIR:-$HOME/.cache/rsd}/$f.json" "$out/gpu-$f.json" 2>/dev/null; done ;;
  cpu16)  # the runtime `auto` picks there (C layers on the embedded model's blocks), T=1; compiling on
    # the CPU (--compile on, and transformers' static-cache peer) takes minutes of its own
    CUDA_VISIBLE_DEVICES= $py -m rsd_cli bench --variants ar,sd,rsd-c,auto --depths 1 --width 3 --temperatures 1 \
      --limit 2 -n 96 --no-assisted --json --compile auto > "$out/bench-cpu16.json" ;;
  lookup)  # where an extra verified token is nearly free, lookup's block efficiency should be its speed-up
    grounded=(-m rsd_cli bench --prompts benchmarks/grounded-prompts.txt --limit 8 --variants ar,sd,lookup,auto
              --depths 1,4 --temperatures 0.7,0 -n 128 --no-assisted --json)
    $py "${grounded[@]}" > "$out/lookup-gpu.json"
    CUDA_VISIBLE_DEVICES= $py "${grounded[@]}" > "$out/lookup-cpu16.json" ;;
  profile)  # parts of a step, synchronised around each; transfers to the host per step
    $py benchmarks/profile_step.py --compile on --variants ar,sd,rsd-c --depths 1,2 --limit 2 2>&1 |
      tee "$out/profile-step.txt" ;;
  trace)  # host work a step: torch operations, launches, copies, synchronisations; GPU busy time
    $py benchmarks/trace_step.py --compile on --variants ar,sd,rsd-c --temperatures 1 -n 48 --top 8 \
      --json "$out/trace.json" 2>&1 | grep -v "Warning\|USDT\|forward_call" | tee "$out/trace.txt" ;;
  kernel16)  # the 16-core CPU's forward with and without the kernel's prefetch (that machine has no
    # git: the "before" source is this one without it), interleaved; then what auto's choosing costs
    sed '/^        PREFETCH_AHEAD(wn, row_bytes)/d' rsd_cli/blocks.py > /tmp/blocks-no-prefetch.py
    for role in target draft; do
      CUDA_VISIBLE_DEVICES= $py benchmarks/c_layers_ab.py --before /tmp/blocks-no-prefetch.py --before-rule same \
        --role $role --prefixes 150,1000 --rows 1,2,4,8 --rounds 5 --no-prefill
    done 2>&1 | grep -v Warning | tee "$out/prefetch-ab-cpu16.txt"
    $py benchmarks/auto_policy_cost.py 2>&1 | tee "$out/auto-policy-cost.txt" ;;
  auto)  # the default profile's `auto` against `ar`, each prompt answered by both one after the other (its
    # shapes, its learnt forward factors): on the GPU (only device-decided shapes there), then the 16-core CPU
    for t in 1 0; do $py benchmarks/auto_vs_ar.py --temperature $t 2>&1 | grep -v Warning; done | tee "$out/auto-vs-ar-gpu.txt"
    for t in 1 0; do CUDA_VISIBLE_DEVICES= $py benchmarks/auto_vs_ar.py --temperature $t 2>&1 | grep -v Warning; done |
      tee "$out/auto-vs-ar-cpu16.txt" ;;
  stepgraphs)  # a device step's maths replayed as CUDA graphs (StepGraphs) against launched op by op: the
    # GPU tests of it (and of steps queued ahead: ar, auto, sd chains, rsd-c fans), then tokens/s per
    # shape both ways and of the "ahead" rows, interleaved, at T=1 and T=0; then the trace
    $py -m pytest -p no:warnings -p no:logging -q -rs tests/test_compiled.py -k "step_maths or cuda_graphs or queued_ahead" 2>&1 |
      tee "$out/step-graphs-tests.txt"
    for t in 1 0; do
      $py benchmarks/step_graphs_ab.py --compile on --temperature $t --rounds 3 --limit 2 -n 96 \
        --json "$out/step-graphs-t$t.json" 2>&1 | grep -v Warning
    done | tee "$out/step-graphs-ab.txt"
    $py benchmarks/trace_step.py --compile on --variants ar,sd,rsd-c --temperatures 1 -n 48 --top 8 \
      --json "$out/trace-step-graphs.json" 2>&1 | grep -v "Warning\|USDT\|forward_call" | tee "$out/trace-step-graphs.txt" ;;
  together)  # samples decoded together (a forward of a row each) against one after the other: the GPU
    # (compiled graphs; rows padded to buckets up to 64), then the 16-core CPU (C layers)
    $py -m pytest -p no:warnings -p no:logging -q tests/test_engine.py -k together 2>&1 | tail -3 | tee "$out/together-tests.txt"
    $py benchmarks/samples_together.py --compile on --samples 2,4,8,16,32 --json "$out/together-gpu.json" 2>&1 |
      grep -v Warning | tee "$out/together-gpu.txt"
    CUDA_VISIBLE_DEVICES= $py benchmarks/samples_together.py --samples 2,4,8,16 --json "$out/together-cpu16.json" 2>&1 |
      grep -v Warning | tee "$out/together-cpu16.txt" ;;
  prompts)  # reading a prompt: attention told it is causal (compiled.Sight) against the mask, on the GPU (flash
    # attention where causal) and on the 16-core CPU (there against the C layers too), then a whole command
    $py benchmarks/prompt_path_ab.py --prefixes 256,1000,4000 --rounds 3 2>&1 | tee "$out/prompts-gpu.txt"
    CUDA_VISIBLE_DEVICES= $py benchmarks/prompt_path_ab.py --prefixes 256,1000,4000 --rounds 3 2>&1 |
      tee "$out/prompts-cpu16.txt"
    head -3 benchmarks/long-prompts.txt | tr '\n' ' ' > /tmp/long3.txt
    TIMEFORMAT="rsd generate - -n 8 -t 0 -v ar, a 3655-token prompt (the GPU): %R s"
    for run in 1 2; do
      { time $py -m rsd_cli generate - -n 8 -t 0 -v ar < /tmp/long3.txt > /dev/null 2>&1; } 2>&1 |
        tee -a "$out/prompts-gpu.txt"
    done ;;
  architectures)  # tiny models of 59 families, exact or refused (benchmarks/architectures.py) on that machine's
    # transformers (5.17 there, 5.24 here: caches, masks by layer kind and text configs may differ), on the CPU
    CUDA_VISIBLE_DEVICES= $py benchmarks/architectures.py 2>&1 | grep -v "falling back" | tee "$out/architectures.txt" ;;
  busy16)  # the 16-core CPU alone and beside 8 and 16 busy processes: the governor against torch's fixed
    # count, on the C layers and on torch's (whether it keeps 16 threads alone; nan: over 30 s, collapsed)
    # (first, once: the per-machine verdicts torch's layers need, so that no timed run measures them)
    CUDA_VISIBLE_DEVICES= RSD_BLOCK_KERNELS=0 $py -m rsd_cli generate Hi -n 2 -v ar < /dev/null > /dev/null 2>&1
    CUDA_VISIBLE_DEVICES= $py benchmarks/busy_cpu.py --hogs 0,8,16 --rounds 2 -n 48 --timeout 30 \
      --json "$out/busy16.json" "governed=" "fixed=RSD_ADAPTIVE_THREADS=0" "torch=RSD_BLOCK_KERNELS=0" \
      "torch-fixed=RSD_BLOCK_KERNELS=0 RSD_ADAPTIVE_THREADS=0" 2>&1 | tee "$out/busy16.txt" ;;
  controls)  # a logit bias in step maths captured as CUDA graphs, windowed models (Mistral's every layer, Gemma 3's
    # some) in CUDA graphs (the CUDA-only tests), the other families on the static-cache runtime, then the embedded pair with --ignore-eos, as a bias and as min_tokens (the same
    # processing: the fast steps' speed), and bench's rows and peers at the same length
    $py -m pytest -p no:warnings -p no:logging -q -rs tests/test_compiled.py -k "logit_bias or windowed or other_llama_style" 2>&1 | tee "$out/controls-tests.txt"
    for extra in "" "--ignore-eos" "--logit-bias 2=-inf"; do
      for variant in ar sd rsd-c; do
        $py -m rsd_cli generate "Write a long story about a robot who learns to paint." -n 256 -t 1 --seed 3 \
          -v "$variant" --json $extra < /dev/null 2>/dev/null | $py -c "import json, sys; r = json.load(sys.stdin); \
print('$variant', '$extra', r['finish_reason'], len(r['token_ids']), round(r['stats']['tokens_per_second'], 1))"
      done
    done 2>&1 | tee "$out/controls-generate.txt"
    $py -m rsd_cli bench --variants ar,sd,auto --depths 1 --temperatures 1 --limit 2 -n 128 --no-assisted \
      --ignore-eos --compile on --json > "$out/controls-bench.json" ;;
  families)  # the families new on the runtime (random weights, the embedded tokenizer): `rsd generate` on the
    # runtime (`auto`: CUDA graphs there) against transformers' forward, the same tokens; ~1 min a row
    for family in gpt_oss opt gpt2 gemma4 gemma4_moe deepseek_v3; do
      $py benchmarks/windowed_runtime.py --family $family --rounds 1 -n 64 2>&1 | grep -v "Writing" |
        sed "s/^/$family /" | tee -a "$out/families.txt"
    done ;;
  families2)  # as `families`, GPT-J, Falcon, Gemma 3n, and BLOOM, GPT-Neo, Llama 4, LFM2, Qwen3.5, Granite 4, Nemotron-H,
    # Bamba, Mamba-2 with
    # a tree (ALiBi, windows, chunks by position, states by path: refused on transformers' forward, so compared with
    # `ar` there)
    for family in gptj falcon bloom gpt_neo gemma3n llama4 lfm2 qwen3_5 granite4 nemotron_h bamba mamba2; do
      variants=ar,sd; case $family in bloom|gpt_neo|llama4|lfm2|qwen3_5|granite4|nemotron_h|bamba|mamba2) variants=ar,rsd-c ;; esac
      $py benchmarks/windowed_runtime.py --family $family --rounds 1 -n 64 --variants $variants 2>&1 |
        grep -v "Writing" | sed "s/^/$family /" | tee -a "$out/families2.txt"
    done ;;
  bf16)  # a GPU's default dtype: the runtime's logits against transformers' forward on tiny models,
    # uncompiled and in CUDA graphs, with compiled results rounded to bf16 (emulate_precision_casts) or not;
    # and the embedded target's compiled forward (1 and 4 tokens) with and without that rounding
    # (Falcon, BLOOM, MPT, GPT-Neo, DeepSeek V2: their own attention or rounding, mended on the CPU only)
    kinds=qwen3,gemma3,olmo2,granite4,mamba2,falcon,falcon-7b,bloom,mpt,gpt_neo,deepseek_v2
    $py benchmarks/bf16_fidelity.py --kinds $kinds --out "$out/bf16-fidelity.json" 2>&1 | tee "$out/bf16-fidelity.txt" ;;
  decoders)  # a decoder made afresh per answer (a chat's turns, bench's runs): the step maths' graphs captured by each
    # at a site's first call (rsd before 2026-11-28) against shared by the model's decoders and captured at the third
    # (H200, T=1: auto 0.70x -> 0.81x ar, rsd-c b=(3) 0.80x -> 0.91x)
    for t in 1 0; do
      $py benchmarks/fresh_decoders_ab.py --temperature $t --shapes "ar,auto,sd γ=1,rsd-c b=(3)" \
        --json "$out/fresh-decoders-t$t.json" 2>&1 | grep -v Warning
    done | tee "$out/fresh-decoders.txt" ;;
  catchup)  # the draft's catch-up on more tokens than the widest graph (auto's plain steps before a drafting
    # step): graphed pieces of 64 (compiled.GRAPHED_PIECES) against one forward off the graphs; then auto
    # against ar on answers long enough for catch-ups past 64 tokens (auto explores after 128 plain steps)
    # (--trace: one catch-up of 65 and of 128 tokens each way under torch.profiler — where a 64-token
    # piece's ~5 ms went on the H200, 2026-11-30, against ~1.6 ms for a 64-token forward in auto's costs)
    $py benchmarks/catch_up_cost.py --repeats 5 --trace 65,128 --out "$out/catch-up-cost.json" 2>&1 |
      grep -v Warning | tee "$out/catch-up-cost.txt"
    $py benchmarks/auto_vs_ar.py --rounds 2 --limit 2 -n 384 2>&1 | grep -v Warning | tee "$out/auto-vs-ar-long.txt" ;;
  distill)  # `rsd distill`'s sampling of the target's answers: transformers' generate (eager, bf16) against rsd's
    # runtime, a batch of 32 answers decoded together in CUDA graphs (1.67x on the 2-core AMD EPYC's C layers);
    # then the same on the 16-core CPU
    $py benchmarks/distill_sampling.py --tokens 12000 --compile on --json "$out/distill-sampling-gpu.json" 2>&1 |
      grep -v Warning | tee "$out/distill-sampling-gpu.txt"
    CUDA_VISIBLE_DEVICES= $py benchmarks/distill_sampling.py --tokens 6000 --compile auto \
      --json "$out/distill-sampling-cpu16.json" 2>&1 | grep -v Warning | tee "$out/distill-sampling-cpu16.txt" ;;
  lookupsteps)  # lookup chains decided on the device (Decoder._lookup_step: one transfer a step) against the host
    # path (a transfer and a dozen kernels per tried node), which auto's lookup steps took on a GPU before
    # 2026-11-30 (H200: auto 0.66x ar with 88-94% plain steps, ~6 ms more for each non-plain one): their CUDA
    # tests, ms a step outside the forwards on grounded prompts, then auto against ar there and on the eval prompts
    $py -m pytest -p no:warnings -p no:logging -q -rs tests/test_compiled.py -k "step_maths_replayed" 2>&1 |
      tee "$out/lookup-steps-tests.txt"
    $py benchmarks/device_steps_ab.py --compile on --rounds 3 --prompts benchmarks/grounded-prompts.txt 2>&1 |
      grep -v Warning | tee "$out/lookup-steps-ab.txt"
    $py benchmarks/auto_vs_ar.py --temperature 1 --prompts benchmarks/grounded-prompts.txt 2>&1 | grep -v Warning |
      tee "$out/auto-vs-ar-grounded-gpu.txt"
    $py benchmarks/auto_vs_ar.py --temperature 1 2>&1 | grep -v Warning | tee "$out/auto-vs-ar-gpu.txt" ;;
  *) echo "unknown part $part: tests, costs, bench, cpu16, lookup, profile, trace, kernel16, stepgraphs, auto, together, busy16, prompts, architectures, controls, decoders, families, families2, bf16, catchup, distill or lookupsteps" >&2
     exit 2 ;;
esac
