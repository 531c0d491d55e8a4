#!/usr/bin/env bash
# The GPU test and benchmark suite, one mode per question (the device machine has torch, triton,
# scikit-image and mpi4py but not hydra/omegaconf/submitit/diffusers: carry them as wheels in
# .whl/). Writes logs and JSON under $OUT (default results/gpu). Each mode fits one 10-minute command.
#   bash benchmarks/gpu_suite.sh [tests|layouts|cli|workload|all]   (one GPU: GPU tests; layouts and the memory
#                                                            estimate; the CLI on flux-dev; the published workload)
#   bash benchmarks/gpu_suite.sh tests [--jobs N] [--budget-s S] [FILE ...]  (every -m gpu test file under tests/,
#                                                            each in its own process: benchmarks/gpu_tests.py)
#   bash benchmarks/gpu_suite.sh precision                (one GPU: precision tests, GEMM and attention benchmarks)
#   bash benchmarks/gpu_suite.sh precision-sweep          (one GPU: ditrun tune, then the 1024x1024 flux-dev
#                                                            precision sweep)
#   bash benchmarks/gpu_suite.sh kernels                  (one GPU: the Triton kernels' GPU tests, attention and GEMM
#                                                            benchmarks, the Triton attention kernel's tiles; ~4 min)
#   bash benchmarks/gpu_suite.sh quantizers               (one GPU: the activation quantizers' GPU tests, their tilings
#                                                            per K, the GEMM table; ~3 min)
#   bash benchmarks/gpu_suite.sh attention                (one GPU: the Hopper Gluon kernel's and the FP8 attention
#                                                            GPU tests, the compiled worker's among them, then every
#                                                            attention kernel at 20992 and 8704 tokens; ~5 min)
#   bash benchmarks/gpu_suite.sh vs-diffusers [TOKENS] [MODES]  (one GPU: ditrun against diffusers eager, compiled
#                                                            and torchao FP8 at TOKENS = 8704, 20992 or 4608; ~9 min;
#                                                            needs the diffusers and torchao wheels in .whl/)
#   bash benchmarks/gpu_suite.sh fast-path [STEPS]        (one GPU: precision=fp8_all through the CLI at the published
#                                                            shape; its forward beside torchao's in one process:
#                                                            vs-diffusers 20992 "diffusers ditrun-fp8_all diffusers-torchao-fp8")
#   bash benchmarks/gpu_suite.sh cache [LIMIT] [THRESHOLD] [SETTINGS]  (one GPU: precision=fp8_all through the CLI at the published
#                                                            shape without a cache, with static masks computing 14 and
#                                                            10 of 28 steps and with first_block at THRESHOLD (default
#                                                            0.3), LIMIT edits each; ditrun report over the
#                                                            four; then the step cache's GPU tests. SETTINGS: a quoted
#                                                            subset of "none static14 static10 first_block")
#   bash benchmarks/gpu_suite.sh startup [LIMIT] [STEPS] [RUNS]  (one GPU: precision=fp8_all through the CLI at the
#                                                            published shape three ways: cold, warm on the same node, a
#                                                            fresh node loading the compile cache the cold run wrote;
#                                                            LIMIT edits (default 2), STEPS steps (default 28), RUNS a
#                                                            quoted subset of "cold warm fresh"; < 9 min)
#   bash benchmarks/gpu_suite.sh editor                   (one GPU: the trained editor's precision table and its cache table
#                                                            at 28 steps, judged by ditrun report; ~8 min)
#   bash benchmarks/gpu_suite.sh exchange                 (one GPU: the quantized exchange's fused Q/K producer, its GPU
#                                                            tests, then against the unfused sequence at 20992 tokens,
#                                                            24 heads, P = 2, 4, 8 (benchmarks/qk_producer.py, --tune),
#                                                            then a CFG step over two ranks sharing the GPU, values
#                                                            against codes (benchmarks/quantized_exchange.py; COMPILE=1
#                                                            compiles the blocks); ~6 min)
#   bash benchmarks/gpu_suite.sh aoti                     (one GPU: the compiled blocks' start-up, Inductor's JIT path cold
#                                                            and warm against AOTInductor packages, flux-dev at the
#                                                            published shape (benchmarks/aoti_startup.py); ~8 min)
#   bash benchmarks/gpu_suite.sh transport                (2 GPUs: copy_engine vs collective, ~5 min)
#   bash benchmarks/gpu_suite.sh multi                    (2+ GPUs: NCCL tests, layouts side by side)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
source benchmarks/wheels.sh
# Pure-Python packages that have no wheel (hydra's antlr4 runtime), carried as an unpacked folder.
[[ -d .site ]] && export PYTHONPATH=$PWD/.site:$PYTHONPATH
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"

if [[ $what == tests || $what == all ]]; then
  # Every -m gpu test under tests/, each file in its own process; the table in $OUT/gpu_tests.md.
  [[ $what == tests ]] && shift
  python3 benchmarks/gpu_tests.py --out "$OUT" "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [[ $what == layouts || $what == all ]]; then
  python3 benchmarks/bench_layouts.py --out "$OUT" 2>&1 | tee "$OUT/bench_layouts.log" | tail -20
  # The memory estimate that refuses too-large edits, beside the measured peak (flux-dev, bf16).
  python3 benchmarks/memory_estimate.py --sizes 512 1024 2048 4096 2>&1 | tee "$OUT/memory_estimate.log" | tail -6
fi
if [[ $what == cli || $what == all ]]; then
  # The whole CLI path on the GPU: flux-dev geometry, random weights, bf16, SSIM vs cached reference.
  python3 -m ditrun model=flux-dev workload.width=512 workload.height=512 workload.steps=4 workload.limit=3 \
    workload.text_len=256 wandb.mode=disabled hydra.run.dir=/tmp/cli-flux-dev 2>&1 | tee "$OUT/cli.log" | tail -12
  cp /tmp/cli-flux-dev/summary.json "$OUT/cli_summary.json"; cp /tmp/cli-flux-dev/edits.jsonl "$OUT/cli_edits.jsonl"
fi
if [[ $what == precision ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_precision.py tests/test_formats.py tests/test_triton_kernels.py 2>&1 \
    | tee "$OUT/tests_precision.log" | tail -8
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_precision_layouts.py 2>&1 \
    | tee "$OUT/tests_precision_gpu.log" | tail -8
  python3 benchmarks/gemm.py 2>&1 | tee "$OUT/gemm.txt"
  python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.txt"
fi
if [[ $what == precision-sweep ]]; then
  # The dispatch table for the krea mix on the sweep's real shapes (the sweep's runs load it).
  python3 -m ditrun tune model=flux-dev precision=krea workload.width=1024 workload.height=1024 \
    workload.text_len=512 precision.tuning_file="$OUT/dispatch.json" 2>&1 | tee "$OUT/tune.log" | tail -25
  # SSIM vs the BF16 output and a BF16 rerun, and DiT time per edit, per precision, in one sweep
  # (random weights: numerical drift, not image quality). The first job makes the cached references.
  python3 -m ditrun -m model=flux-dev precision=bf16,fp8,fp8_all,mxfp6,mxfp4,krea workload.width=1024 \
    workload.height=1024 workload.steps=8 workload.limit=3 workload.text_len=512 wandb.mode=disabled progress=false \
    precision.tuning_file="$OUT/dispatch.json" hydra.sweep.dir=/tmp/precision-sweep 2>&1 | tee "$OUT/precision_sweep.log" | tail -14
  for job in /tmp/precision-sweep/[0-9]*; do cp "$job/summary.json" "$OUT/precision_summary_$(basename "$job").json"; done
fi
if [[ $what == transport ]]; then
  # The copy-engine GPU tests, then per exchange the time with and without the host's issuing and the host's cost,
  # kernel slowdown beside a transfer that outlasts it, and ulysses / cfg_batch with 1, 2 and 4 head groups on both
  # transports (GPU backlog, exposed transfer per kind).
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_copy_engine_schedule.py tests/test_copy_engine.py \
    2>&1 | tee "$OUT/tests_transport.log" | tail -4
  python3 benchmarks/alltoall.py --out "$OUT" 2>&1 | tee "$OUT/alltoall.log" | tail -22
  python3 benchmarks/bench_layouts.py --world 2 --repeats 5 --layouts ulysses cfg_batch --head-groups 1 2 4 \
    --out "$OUT" 2>&1 | tee "$OUT/bench_layouts_multi.log" | tail -18
fi
if [[ $what == vs-diffusers ]]; then
  # One shape per command; MODES: a space-separated subset of vs_diffusers.py's modes (default all).
  python3 benchmarks/vs_diffusers.py --tokens "${2:-8704}" ${3:+--modes $3} --out "$OUT" 2>&1 \
    | tee "$OUT/vs_diffusers.log" | tail -40
fi
if [[ $what == fast-path ]]; then
  # The fast preset through the CLI at the published shape (one edit after the warm-up one): its DiT time per
  # step is vs_diffusers.py's ditrun-fp8_all forward (same configuration, composed the same way) at 20992 tokens.
  python3 benchmarks/bench_workload.py --limit 2 --steps "${2:-8}" --out "$OUT" -- precision=fp8_all 2>&1 \
    | tee "$OUT/bench_workload_fp8_all.log" | tail -8
fi
if [[ $what == cache ]]; then
  # One run per setting (each keeps its own directory, so a run cut short leaves the ones before it whole).
  runs=/tmp/cache-runs; rm -rf "$runs"
  common=(model=flux-dev workload=benchmark "workload.limit=${2:-3}" precision=fp8_all metrics.ssim=false
          metrics.report=false wandb.mode=disabled progress=false)
  for setting in "none cache=none" \
                 "static14 cache=static cache.compute_first=0 cache.compute_last=0 cache.compute_every=2" \
                 "static10 cache=static cache.compute_first=0 cache.compute_last=0 cache.compute_every=3" \
                 "first_block cache=first_block cache.threshold=${3:-0.3}"; do
    name=${setting%% *}
    [[ " ${4:-none static14 static10 first_block} " == *" $name "* ]] || continue
    date +"%T $name" | tee -a "$OUT/cache_runs.log"
    # shellcheck disable=SC2086
    python3 -m ditrun "${common[@]}" ${setting#* } hydra.run.dir="$runs/$name" 2>&1 | tee -a "$OUT/cache_runs.log" \
      | grep -v "^\[" | tail -3
    cp "$runs/$name/summary.json" "$OUT/cache_summary_$name.json"
  done
  python3 -m ditrun report "$runs" --baseline none --out "$OUT/cache_report" 2>&1 | tail -3
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_step_cache.py 2>&1 \
    | tee "$OUT/tests_cache.log" | tail -4
fi
if [[ $what == startup ]]; then
  # docs/PERFORMANCE.md#the-compile-cache. Each run's Inductor cache (and Triton's, inside it) stands for a node's:
  # node a's is empty for the cold run and warm for the next; node b's is empty, with the cold run's entry in the
  # shared compile cache. The first edit carries the start-up; warmup_excess_s is its excess over a steady edit.
  runs=/tmp/startup-runs; rm -rf "$runs"; unset TRITON_CACHE_DIR
  common=(model=flux-dev workload=benchmark "workload.limit=${2:-2}" "workload.steps=${3:-28}" precision=fp8_all
          metrics.ssim=false metrics.report=false wandb.mode=disabled progress=false)
  for run in "cold a $runs/shared 250" "warm a off 140" "fresh b $runs/shared 140"; do
    read -r name node cache limit_s <<< "$run"
    [[ " ${4:-cold warm fresh} " == *" $name "* ]] || continue
    date +"%T $name" | tee -a "$OUT/startup_runs.log"
    TORCHINDUCTOR_CACHE_DIR="$runs/inductor-$node" timeout "$limit_s" python3 -m ditrun "${common[@]}" \
      model.compile_cache="$cache" hydra.run.dir="$runs/$name" 2>&1 | tee -a "$OUT/startup_runs.log" \
      | grep -E "compile cache|median DiT"
    cp "$runs/$name/summary.json" "$OUT/startup_summary_$name.json"
    # The Triton kernels in the node's cache after the run, by name (Inductor's are triton_*; ditrun's custom ops'
    # are named after their functions).
    find "$runs/inductor-$node/triton" -name "__grp__*.json" 2>/dev/null | sed 's/.*__grp__//; s/\.json$//' \
      | sed -E 's/_[0-9]+$//' | sort | uniq -c | sort -rn | head -30 > "$OUT/startup_kernels_$name.txt"
  done
  python3 - "$OUT" <<'EOF' | tee "$OUT/startup_cache.md"
import json, sys
cells = ("startup_s_max", "warmup_excess_s", "compile_s_max", "graphs_s_max", "build_s_max", "compile_cache_s_max",
         "dit_s_median")
print("| run | compile cache | start-up s | first edit's excess s | compile s | graphs s | build s | cache s | DiT s / edit |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name in ("cold", "warm", "fresh"):
    try:
        summary = json.load(open(f"{sys.argv[1]}/startup_summary_{name}.json"))
    except OSError:
        print(f"| {name} | (no summary) |")
        continue
    status = (summary.get("compile_cache") or {}).get("status")
    print(f"| {name} | {status} | " + " | ".join("-" if summary.get(c) is None else f"{summary[c]:.2f}" for c in cells)
          + " |")
EOF
fi
if [[ $what == editor ]]; then
  # docs/PRECISION.md#quality-on-a-trained-model and docs/CACHE.md#on-the-trained-editor-which-cache-to-choose: the
  # default model and workload (four held-out pictures, 256x256). Eager: the tables are about quality.
  common=(model.compile=off wandb.mode=disabled progress=false)
  rm -rf /tmp/editor-precision  # a sweep of another folder left there is refused, not resumed, by ditrun
  python3 -m ditrun -m precision=bf16,fp8,fp8_all,mxfp8,mxfp6,mxfp4,krea "${common[@]}" \
    hydra.sweep.dir=/tmp/editor-precision 2>&1 | tee "$OUT/editor_precision.log" | tail -4
  python3 benchmarks/quality_table.py /tmp/editor-precision --json "$OUT/quality_editor_h200.json" \
    | tee "$OUT/quality_editor_h200.md"
  # The step caches at the published step count, every run judged against the uncached BF16 run of the sweep.
  sweep=/tmp/editor-cache; rm -rf "$sweep"
  python3 -m ditrun -m precision=bf16,fp8_all workload.steps=28 cache=none "${common[@]}" \
    hydra.sweep.dir="$sweep/none" 2>&1 | tee "$OUT/editor_cache.log" | tail -2
  python3 -m ditrun -m precision=bf16,fp8_all workload.steps=28 cache=static cache.compute_every=2,3,4 "${common[@]}" \
    hydra.sweep.dir="$sweep/static" 2>&1 | tee -a "$OUT/editor_cache.log" | tail -2
  python3 -m ditrun -m precision=bf16,fp8_all workload.steps=28 cache=first_block cache.threshold=0.08,0.15,0.3 \
    "${common[@]}" hydra.sweep.dir="$sweep/first_block" 2>&1 | tee -a "$OUT/editor_cache.log" | tail -2
  python3 -m ditrun report "$sweep" 2>&1 | tail -3
  cp "$sweep/report.md" "$OUT/cache_editor_h200.md"
fi
if [[ $what == kernels ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py 2>&1 \
    | tee "$OUT/tests_kernels.log" | tail -15
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_builds.py 2>&1 \
    | tee "$OUT/tests_mx_gemm.log" | tail -8  # the MX GEMM's sm_90 build (Triton emulates the scaled dot)
  python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.txt"
  python3 benchmarks/gemm.py --formats fp8 fp8_fast mxfp6 mxfp4 2>&1 | tee "$OUT/gemm.txt"
  python3 benchmarks/attention.py --configs --s 8704 --repeats 5 2>&1 | grep -v "^{" | tee "$OUT/attention_configs.txt"
fi
if [[ $what == quantizers ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py -k "quantizer or repack" 2>&1 \
    | tee "$OUT/tests_quantizers.log" | tail -3
  timeout 250 python3 benchmarks/gemm.py --tilings 2>&1 | tee "$OUT/tilings.txt" | grep -E "default|\*"
  timeout 200 python3 benchmarks/gemm.py --formats fp8 fp8_fast mxfp8 mxfp6 mxfp4 2>&1 | tee "$OUT/gemm.txt"
fi
if [[ $what == attention ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py -k "gluon or v_codes or fp8" \
    2>&1 | tee "$OUT/tests_attention.log" | tail -5
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compile.py -k fp8_product 2>&1 \
    | tee -a "$OUT/tests_attention.log" | tail -5
  timeout 200 python3 benchmarks/attention.py --s 20992 8704 --repeats 10 2>&1 | tee "$OUT/attention.txt"
fi
if [[ $what == exchange ]]; then
  for f in tests/test_qk_producer.py tests/test_quantized_exchange.py; do
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$f" 2>&1 | tee -a "$OUT/tests_exchange.log" | tail -5
  done
  timeout 300 python3 benchmarks/qk_producer.py --s 20992 --shards 2 4 8 --tune 2>&1 | tee "$OUT/qk_producer.txt"
  # the whole step over two ranks sharing the GPU, values against codes (eager; COMPILE=1: the blocks compiled)
  timeout 400 python3 benchmarks/quantized_exchange.py --share-gpu ${COMPILE:+--compile} 2>&1 \
    | tee "$OUT/quantized_exchange.txt" | tail -8
fi
if [[ $what == aoti ]]; then
  timeout 580 python3 benchmarks/aoti_startup.py --preset flux-dev --width 1024 --height 1024 --text-len 512 \
    --device cuda --repeats 3 2>&1 | tee "$OUT/aoti_startup.txt" | tail -8
fi
if [[ $what == workload || $what == all ]]; then
  # The published Kontext shape (1 MP reference + 4 MP output, 28 steps), 2 edits, flux-dev geometry.
  python3 benchmarks/bench_workload.py --limit 2 --steps 28 --out "$OUT" 2>&1 | tee "$OUT/bench_workload.log" | tail -8
fi
if [[ $what == multi ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_layouts.py tests/test_launchers.py tests/test_copy_engine.py \
    tests/test_copy_engine_schedule.py \
    2>&1 | tee "$OUT/tests_multi.log" | tail -8
  # collective vs copy_engine per message, kernel slowdown beside transfers, profile; then every layout x transport x
  # head groups {1, 2} against single. With one GPU both ranks share it (CUDA IPC).
  share=""; [[ $(python3 -c "import torch; print(torch.cuda.device_count())") -lt 2 ]] && share="--share-gpu"
  python3 benchmarks/alltoall.py $share --out "$OUT" 2>&1 | tee "$OUT/alltoall.log" | tail -25
  python3 benchmarks/bench_layouts.py --world 2 $share --out "$OUT" 2>&1 | tee "$OUT/bench_layouts_multi.log" | tail -20
  # The layouts side by side on the same 1024x1024 Kontext-style edits, FLUX.1-dev geometry, bf16;
  # the first run also makes the cached bf16 references every later run's SSIM is measured against.
  i=0
  for spec in "layout=single launcher.world=1" "layout=ulysses launcher.world=2" \
              "layout=ulysses launcher.world=2 layout.head_groups=2" "layout=cfg_batch launcher.world=2" \
              "layout=cfg_split launcher.world=2" "layout=single launcher.world=2 layout.replicas=2" \
              "layout=ulysses launcher.world=2 transport=copy_engine" \
              "layout=ulysses launcher.world=2 layout.head_groups=2 transport=copy_engine" \
              "layout=cfg_batch launcher.world=2 transport=copy_engine" \
              "layout=cfg_split launcher.world=2 transport=copy_engine"; do
    # shellcheck disable=SC2086
    python3 -m ditrun model=flux-dev workload.width=1024 workload.height=1024 workload.steps=4 \
      workload.limit=3 workload.text_len=512 wandb.mode=disabled metrics.report=false progress=false \
      $spec hydra.run.dir=/tmp/multi/$i 2>&1 | tail -3
    i=$((i + 1))
  done
  python3 -m ditrun report /tmp/multi --out /tmp/multi-report 2>&1 | tee "$OUT/multi_report.txt"
fi
