#!/usr/bin/env bash
# On the GPU machine: build for sm_90, run the `gpu` tests and the benchmarks, print a short
# table last. Logs go to <build>/gpu-logs; when $OUT is set (the device tool's return folder, at
# most 8 files) they come back as one archive, $OUT/gpu-logs.tgz, beside $OUT/summary.txt.
#   bash scripts/gpu-check.sh
# PARTS (default "tests bench reference") picks sections: the gpu/host tests, the benchmarks, the
# reference checks against PyTorch/transformers (one decoder layer, small and at the 5.13B widths;
# 50 training steps of oom-train),
# and "train" (the CUDA executor's tests and compute-sanitizer runs, 50 GPU steps vs PyTorch,
# SIGKILL/resume on the GPU, the 5.13B model at $SEQS with a traced step). One device call is at
# most 10 minutes, so split: e.g. PARTS=tests, then PARTS="reference train" SEQS="4096 32768",
# then PARTS=train SEQS=131072 TRAIN_CUDA_LRS=" " (each builds only what it needs when warm).
# PARTS=kernels builds and runs only the gpu tests and the kernel benchmarks (issue 5's checks).
# PARTS=hybrid builds and runs only the gated delta rule's and the hybrid model's GPU tests,
# bench_gated_delta and a 2-layer Qwen3-Next-80B slice at HYBRID_SEQS (default "32768 262144").
# PARTS=families builds and runs only the GPU checks of Mixtral, OLMoE and Qwen2-MoE (the layer
# against the host layer, every plan bit for bit, Qwen2-MoE 50 steps against transformers).
# PARTS=balance builds and runs only the load-balancing loss's GPU checks (its kernels, the
# executor's plans, 50 steps of two router-loss configs against transformers).
# PARTS=layers builds and runs only the CudaLayerExecutor's test and oom-custom-layer on both
# backends (a user's own CUDA layers).
# PARTS=moments builds and runs only what AdamW moments in bf16 (--moments bf16) touch on a GPU: the
# GPU AdamW's, CudaCausalLm's and the CudaLayerExecutor's tests, a GPU run killed and resumed with
# them, and the 5.13B model (or MOMENTS_CONFIG) at MOMENTS_SEQ (4096) with fp32 then bf16 moments
# in one call (tokens/s, residency, memory; docs/runtime.md); MOMENTS_PRECISIONS="bf16" runs only
# those (a MOMENTS_CONFIG only bf16 moments fit).
# PARTS=group builds and runs only the multi-GPU group's tests and a quick oom-calibrate over every
# GPU (kind nvidia-h200-x2: docs/multi-gpu.md, slice 1).
# On a fresh machine that build can outlast a device call (580 s, 2026-12-01): the build stops
# after BUILD_LIMIT seconds (default 480) and says so (exit 3); call again while the machine is
# warm. BUILD_ONLY=1 only builds. Its run is longer than one call, too (the gpu tests several
# minutes, test_attention ~4 of them; bench_moe_kernels, bench_attention and the SDPA script up to
# 5 min each): TIME_BUDGET (below) cuts it short with its logs returned. To run all of it, split
# it over calls: KERNEL_BENCH=0 GPU_CTEST_ARGS="-E ^test_attention$", then KERNEL_BENCH=0
# GPU_CTEST_ARGS="-R ^test_attention$", then KERNEL_TESTS=0 (the benchmarks alone; if they do not
# fit either, OOM_BENCH_TOKENS and OOM_BENCH_VARIANTS pick bench_moe_kernels' rows).
# PARTS=peers runs the 5.13B model (or PEER_CONFIG's) in oom-train and in its peers (bench/baselines/: PyTorch FSDP2,
# DeepSpeed) at the same seq and batch, one after the other, and prints the ratios (PEERS,
# PEER_MODES below).
# PARTS="calibrate train" first measures a machine profile ($out/profile.json, oom-calibrate) and
# the 5.13B runs plan and predict with it (else with PROFILE=path, if given). GRAD_STAGING=N runs them with a pinned gradient
# staging ring of N layers (oom-train --grad-staging, default 3; 0 per parameter); KEEP_ATTENTION=0
# adds --no-keep-attention-state; BUCKETED=0 adds --no-bucketed-expert-gemms;
# WIDE=1 also trains a 2-layer model of the 5.13B widths against PyTorch (20 steps); CLIP=X
# trains the tiny model 50 steps with --max-grad-norm X against PyTorch.
set -uo pipefail
cd "$(dirname "$0")/.."
# PREBUILT=DIR: run binaries already built in DIR (this toolkit's libraries, sm_90), no configure,
# no build; DIR is the build directory. A fresh device machine's build takes most of a call: build
# on the workstation, `bash scripts/pack-gpubin.sh`, then a call with carry ["gpubin"] runs
# `tar xzf gpubin/build.tgz && PREBUILT=build PARTS=... bash scripts/gpu-check.sh`.
build_dir=${PREBUILT:-${BUILD_DIR:-build-gpu}}
if [[ -n "${PREBUILT:-}" && ! -f "$PREBUILT/CTestTestfile.cmake" ]]; then
  echo "PREBUILT=$PREBUILT: no build there (unpack gpubin/build.tgz first: scripts/pack-gpubin.sh)" >&2
  exit 2
fi
# The libraries the archive carries (Debian's Google Benchmark for the micro benchmarks).
[[ -n "${PREBUILT:-}" && -d "$PREBUILT/carried-lib" ]] &&
  export LD_LIBRARY_PATH="$(realpath "$PREBUILT/carried-lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out="$build_dir/gpu-logs"
rm -rf "$out"
mkdir -p "$out"
jobs=${JOBS:-$(nproc)}
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared machines

# TIME_BUDGET: seconds for the whole script, build included (default 570 where $OUT is set, i.e.
# in a device call of the default 600 s: set it to about the call's limit_s - 30 for a shorter
# call; 0 or unset without $OUT: no budget). Every step's timeout is cut to what is left, less 30
# s to pack the logs; a step with under 30 s left is skipped and named in skipped.log (exit 124,
# counted as a failure). The logs go to $OUT before each step and at the end, so a call cut short
# still returns what it measured (a run of PARTS=kernels killed from outside at 570 s returned
# nothing, 2026-12-01).
SECONDS=0
budget=${TIME_BUDGET:-$([[ -n "${OUT:-}" ]] && echo 570 || echo 0)}
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "TIME_BUDGET must be a whole number of seconds (0: none), not '$budget'"; exit 2; }
save_logs() {  # written to a temporary name and renamed: a call killed mid-write keeps the last archive
  [[ -n "${OUT:-}" ]] && tar czf "$OUT/.gpu-logs.tgz.tmp" -C "$build_dir" gpu-logs 2> /dev/null &&
    mv -f "$OUT/.gpu-logs.tgz.tmp" "$OUT/gpu-logs.tgz"
  return 0
}
# limited SECONDS COMMAND...: COMMAND under `timeout` (0: no limit of its own), cut to the budget
# left; a command that ignores the TERM is killed 10 s later. Leaves the limit it ran under in
# limited_s (0: skipped, or no limit at all) and the seconds it took in limited_took.
limited_s=0 limited_took=0
limited() {
  local want=$1
  shift
  limited_s=0 limited_took=0
  [[ "$want" =~ ^[0-9]+$ ]] || { echo "limited: '$want' is not a whole number of seconds ($*)" >&2; return 2; }
  save_logs
  if ((budget > 0)); then
    local left=$((budget - SECONDS - 30))
    if ((left < 30)); then
      echo "skipped, TIME_BUDGET of ${budget} s spent: $*" >> "$out/skipped.log"
      return 124
    fi
    if ((want == 0 || want > left)); then want=$left; fi
  fi
  local start=$SECONDS rc
  timeout -k 10 "$want" "$@"
  rc=$?
  limited_s=$want limited_took=$((SECONDS - start))
  return $rc
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -1
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

[[ -n "${PREBUILT:-}" ]] ||
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOOM_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
parts=" ${PARTS:-tests bench reference} "
targets=()  # everything, unless only the reference checks and the trainer run, or only the kernels
[[ "$parts" != *" tests "* && "$parts" != *" bench "* ]] &&
  targets=(--target oom-train oom-layer-check oom-calibrate test_cuda_causal_lm test_lm_ends ${EXTRA_TARGETS:-})
# PARTS=kernels: the gpu-labelled tests and the two kernel benchmarks (with SDPA) only, built as
# just those targets: a whole build on a fresh device machine took more than 8 of a call's 10
# minutes (eighth session), these ~4.
kernel_tests=(test_gpu_device test_gpu_streaming test_cuda_causal_lm test_norm_kernels test_moe_kernels test_attention
  test_lm_ends test_cuda_decoder_layer test_wgmma test_attention_wgmma test_attention_backward_wgmma test_grouped_wgrad
  test_grouped_rows test_gated_delta_kernels test_deltanet_kernels)
[[ "$parts" == *" kernels "* ]] && targets=(--target "${kernel_tests[@]}" bench_attention bench_moe_kernels bench_gated_delta ${EXTRA_TARGETS:-})
# PARTS=group (docs/multi-gpu.md; run it with kind nvidia-h200-x2): DeviceGroup's tests over every
# visible GPU, then a quick oom-calibrate over all of them (NCCL rates, the host links together).
[[ "$parts" == " group " ]] && targets=(--target test_device_group test_device_group_check oom-calibrate ${EXTRA_TARGETS:-})
# PARTS=hybrid: the gated delta rule's kernels and the hybrid model's GPU tests, bench_gated_delta,
# and a 2-layer Qwen3-Next-80B slice in oom-train at $HYBRID_SEQS (predicted vs measured).
hybrid_targets=(test_gated_delta_kernels test_deltanet_kernels test_cuda_deltanet test_cuda_hybrid_layer test_cuda_causal_lm
  bench_gated_delta oom-train)
if [[ "$parts" == " hybrid " ]]; then targets=(--target "${hybrid_targets[@]}" ${EXTRA_TARGETS:-})
elif [[ "$parts" == *" hybrid "* && ${#targets[@]} -gt 0 ]]; then targets+=("${hybrid_targets[@]}"); fi
# PARTS=families: the CUDA layer's families beyond Qwen3-MoE that need no Gated DeltaNet (Mixtral,
# OLMoE, Qwen2-MoE; docs/trainer.md): the bias kernels' test, test_cuda_hybrid_layer's cases of
# those families, test_cuda_causal_lm's, and 50 Qwen2-MoE GPU steps against transformers.
families_targets=(test_norm_kernels test_cuda_hybrid_layer test_cuda_causal_lm oom-train)
if [[ "$parts" == " families " ]]; then targets=(--target "${families_targets[@]}" ${EXTRA_TARGETS:-})
elif [[ "$parts" == *" families "* && ${#targets[@]} -gt 0 ]]; then targets+=("${families_targets[@]}"); fi
# PARTS=balance: the load-balancing loss on the GPU (docs/runtime.md): its kernels' and the
# executor's tests, and 50 GPU steps of two router-loss configs against transformers.
balance_targets=(test_moe_kernels test_cuda_causal_lm test_cuda_deltanet_shape oom-train)
if [[ "$parts" == " balance " ]]; then targets=(--target "${balance_targets[@]}" ${EXTRA_TARGETS:-})
elif [[ "$parts" == *" balance "* && ${#targets[@]} -gt 0 ]]; then targets+=("${balance_targets[@]}"); fi
# PARTS=layers: a user's own CUDA layers on the CudaLayerExecutor (docs/runtime.md, "Your own
# layers"): test_cuda_layer_executor and oom-custom-layer on both backends.
layers_targets=(test_cuda_layer_executor oom-custom-layer)
if [[ "$parts" == " layers " ]]; then targets=(--target "${layers_targets[@]}" ${EXTRA_TARGETS:-})
elif [[ "$parts" == " calibrate layers " || "$parts" == " layers calibrate " ]]; then
  targets=(--target "${layers_targets[@]}" oom-calibrate ${EXTRA_TARGETS:-})
elif [[ "$parts" == *" layers "* && ${#targets[@]} -gt 0 ]]; then targets+=("${layers_targets[@]}"); fi
moments_targets=(test_norm_kernels test_cuda_causal_lm test_cuda_layer_executor test_cuda_footprint oom-train)
if [[ "$parts" == " moments " ]]; then targets=(--target "${moments_targets[@]}" ${EXTRA_TARGETS:-})
elif [[ "$parts" == *" moments "* && ${#targets[@]} -gt 0 ]]; then targets+=("${moments_targets[@]}"); fi
# PARTS=peers needs oom-train: alone, only it; beside other parts that name their targets, it too.
if [[ "$parts" == " peers " ]]; then targets=(--target oom-train ${EXTRA_TARGETS:-})
elif [[ "$parts" == *" peers "* && ${#targets[@]} -gt 0 ]]; then targets+=(oom-train); fi
# The build stops after BUILD_LIMIT seconds (default 480) with its progress printed, so that a
# device call (at most 600 s) on a fresh machine returns something and the next call, on the warm
# machine, finishes the build and runs. BUILD_ONLY=1 stops after a completed build.
build_limit=${BUILD_LIMIT:-480}
if ((budget > 0 && build_limit > budget - 60)); then build_limit=$((budget > 120 ? budget - 60 : 60)); fi
if [[ -n "${PREBUILT:-}" ]]; then
  echo "PREBUILT=$PREBUILT: not built here" > "$out/build.log"
  build_rc=0
else
  timeout -k 10 "$build_limit" cmake --build "$build_dir" -j "$jobs" "${targets[@]}" > "$out/build.log" 2>&1
  build_rc=$?
fi
if (( build_rc == 124 || build_rc == 137 )); then
  echo "build stopped after ${build_limit} s (BUILD_LIMIT) at $(grep -o '^\[[0-9]*/[0-9]*\]' "$out/build.log" | tail -1):" \
    "call again while the machine is warm to finish it"
  [[ -n "${OUT:-}" ]] && tail -40 "$out/build.log" > "$OUT/build-tail.log"
  save_logs
  exit 3
elif (( build_rc != 0 )); then
  grep -E -A5 'error|FAILED' "$out/build.log" | head -60
  save_logs
  exit 1
fi
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then
  echo "built ($(grep -o '^\[[0-9]*/[0-9]*\]' "$out/build.log" | tail -1 || echo 'nothing to do'))"
  exit 0
fi

gpu_rc=0 host_rc=0 bench_rc=0 ref_rc=0

# versus_pytorch NAME TIMEOUT LABEL OOM-TRAIN-ARGS...: oom-train with those arguments into
# $build_dir/NAME (from saved initial weights, its batches dumped), then the same steps in PyTorch
# on the GPU (scripts/compare_train_pytorch.py); logs $out/NAME.log and $out/compare-NAME.log. A
# non-empty LABEL adds the comparison's verdict (and any logged grad norms) to train-summary.log.
# COMPARE_ARGS: more arguments for the comparison (e.g. --noise-device cuda --noise-bf16).
versus_pytorch() {
  local name="$1" limit="$2" label="$3"
  shift 3
  local run="$build_dir/$name" batches="$build_dir/$name.tok"
  rm -rf "$run"
  if limited "$limit" "$build_dir/examples/train/oom-train" "$@" --out "$run" --save-initial --dump-batches "$batches" \
      --keep 3 --checkpoint-every 1000 > "$out/$name.log" 2>&1; then
    limited 300 env PYTHONUNBUFFERED=1 python3 scripts/compare_train_pytorch.py --run "$run" --batches "$batches" --device cuda \
      ${COMPARE_ARGS:-} > "$out/compare-$name.log" 2>&1 || ref_rc=1
  else
    ref_rc=1
  fi
  [[ -z "$label" ]] && return
  echo "$label: $(grep -E '^(PASS|FAIL)|worst relative|noise floor' "$out/compare-$name.log" 2> /dev/null | tr '\n' ' ')$(grep -o 'grad norm [0-9.]*' "$out/$name.log" | head -2 | tr '\n' ' ')" >> "$out/train-summary.log"
}
touch "$out/gpu-tests.log"
if [[ "$parts" == *" tests "* || ( "$parts" == *" kernels "* && "${KERNEL_TESTS:-1}" == 1 ) ]]; then
# GPU_CTEST_ARGS: more ctest arguments, e.g. -E '^test_attention$' to leave out the longest (~4 min).
limited 0 ctest --test-dir "$build_dir" -L gpu --no-tests=error --output-on-failure -V ${GPU_CTEST_ARGS:-} > "$out/gpu-tests.log" 2>&1
gpu_rc=$?
fi
if [[ "$parts" == *" tests "* ]]; then
# A PREBUILT archive holds programs, not the install tree the package tests install, nor the
# build the pack test packs.
host_excluded=()
[[ -n "${PREBUILT:-}" ]] && host_excluded=(-E '^(package\.|scripts\.pack_gpubin$)')
limited 0 ctest --test-dir "$build_dir" -LE gpu --no-tests=error "${host_excluded[@]}" --output-on-failure > "$out/host-tests.log" 2>&1
host_rc=$?
fi

if [[ "$parts" == *" reference "* ]]; then
  # One decoder layer (attention + MoE) fwd+bwd vs transformers' Qwen3MoeDecoderLayer.
  if [[ -f scripts/compare_decoder_layer.py ]]; then
    limited 300 env PYTHONUNBUFFERED=1 python3 scripts/compare_decoder_layer.py \
      --tool "$build_dir/examples/layer-check/oom-layer-check" --workdir "$build_dir/layer-check" \
      > "$out/compare-layer.log" 2>&1 || ref_rc=1
    # The same at the 5.13B model's widths (hidden 2048, 64 experts top-8, I = 768), where the
    # product's Hopper grouped expert GEMMs and register-path norms run; T = 4096 as its trainer's.
    limited 200 env PYTHONUNBUFFERED=1 python3 scripts/compare_decoder_layer.py \
      --tool "$build_dir/examples/layer-check/oom-layer-check" --model-config examples/configs/moe-5b.json \
      --tokens 4096 --workdir "$build_dir/layer-check-5b" > "$out/compare-layer-5b.log" 2>&1 || ref_rc=1
    # And as transformers initialises such a layer (N(0, 0.02) matrices, norms 1): the literal
    # "transformers' Qwen3-MoE layer" of issue 5's item 2.
    limited 200 env PYTHONUNBUFFERED=1 python3 scripts/compare_decoder_layer.py \
      --tool "$build_dir/examples/layer-check/oom-layer-check" --model-config examples/configs/moe-5b.json \
      --tokens 4096 --init transformers --workdir "$build_dir/layer-check-5b-hf" > "$out/compare-layer-5b-hf.log" 2>&1 || ref_rc=1
    # The same layer under compute-sanitizer: memcheck and racecheck must report no errors.
    lc="$build_dir/layer-check"
    if command -v compute-sanitizer > /dev/null && [[ -f "$lc/in.safetensors" ]]; then
      for tool in memcheck racecheck; do
        limited 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
          "$build_dir/examples/layer-check/oom-layer-check" --config "$lc/config.json" --in "$lc/in.safetensors" \
          --out "$lc/sanitized.safetensors" > "$out/sanitizer-$tool.log" 2>&1
        rc=$?
        [[ $rc -eq 0 ]] || ref_rc=1
        echo "compute-sanitizer $tool: exit $rc — $(tail -1 "$out/sanitizer-$tool.log")" >> "$out/sanitizer.log"
      done
    fi
  fi
  # 50 steps of the example trainer vs the same 50 steps in PyTorch, from the same weights and data,
  # at two learning rates (Adam amplifies rounding differences faster at the larger one).
  for lr in ${TRAIN_LRS:-3e-3 1e-3}; do
    versus_pytorch "train-$lr" 400 "" --steps 50 --seq 128 --lr "$lr" --log-every 10
  done
fi

if [[ "$parts" == *" group "* ]]; then
  echo "GPUs visible: $(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)" > "$out/group.log"
  nvidia-smi topo -m >> "$out/group.log" 2>&1
  for t in test_device_group_check test_device_group; do
    limited 120 "$build_dir/tests/$t" -s > "$out/$t.log" 2>&1 || gpu_rc=1
    echo "$t: $(grep -E '^(NOTE|group of)|test cases:' "$out/$t.log" | tr '\n' ' ')" >> "$out/group.log"
  done
  limited 300 "$build_dir/examples/calibrate/oom-calibrate" --quick --out "$out/profile-group.json" \
    > "$out/calibrate-group.log" 2>&1 || ref_rc=1
  grep -E 'host_link_total|all_reduce|all_to_all|h2d' "$out/calibrate-group.log" >> "$out/group.log"
  cat "$out/group.log"
fi

if [[ "$parts" == *" hybrid "* ]]; then
  # The hybrid family's GPU checks (docs/hybrid.md): the rule's kernels against their references in
  # both forms, the Gated DeltaNet layer, a hybrid layer against transformers' fixture, and the
  # executor's hybrid plans against the resident one (and Mixtral's and OLMoE's, where the build
  # has them); then the rule's forms side by side.
  for t in test_gated_delta_kernels test_deltanet_kernels test_cuda_deltanet test_cuda_hybrid_layer; do
    limited 300 "$build_dir/tests/$t" > "$out/$t.log" 2>&1 || gpu_rc=1
    echo "$t: $(grep -E 'test cases:|assertions:' "$out/$t.log" | tr '\n' ' ')" >> "$out/hybrid-summary.log"
  done
  limited 300 "$build_dir/tests/test_cuda_causal_lm" -tc="*hybrid*,Mixtral*" > "$out/test_cuda_causal_lm-hybrid.log" 2>&1 || gpu_rc=1
  echo "test_cuda_causal_lm (hybrid, Mixtral/OLMoE/Qwen2-MoE cases): $(grep -E 'test cases:|assertions:' "$out/test_cuda_causal_lm-hybrid.log" | tr '\n' ' ')" \
    >> "$out/hybrid-summary.log"
  limited 200 "$build_dir/bench/kernels/bench_gated_delta" > "$out/bench_gated_delta.log" 2>&1 || bench_rc=1
  # Qwen3-Next-80B's widths in 2 layers (one Gated DeltaNet, one gated attention; the slice of
  # docs/performance.md's thirty-ninth to forty-first sessions), 3 steps a length, the last traced.
  python3 -c "import json; c = json.load(open('examples/configs/qwen3-next-80b-a3b.json')); c['num_hidden_layers'] = 2; c['full_attention_interval'] = 2; json.dump(c, open('$build_dir/qn2.json', 'w'))"
  for seq in ${HYBRID_SEQS:-32768 262144}; do
    steps=$((seq > 131072 ? 2 : 3))
    limited "${SEQ_TIMEOUT:-200}" "$build_dir/examples/train/oom-train" --backend cuda --config "$build_dir/qn2.json" \
      --out "$build_dir/train-qn2-$seq" --overwrite --seq "$seq" --steps "$steps" --lr 3e-4 --log-every 1 \
      --checkpoint-every 0 --trace-step "$steps" --trace "$out/trace-qn2-$seq.json" > "$out/train-qn2-$seq.log" 2>&1
    rc=$?
    ((rc == 0)) || ref_rc=1
    # The step measured / predicted for the plan that ran: the "recorded in" line's last pair.
    echo "qn2 seq $seq: exit $rc — $(grep '^step' "$out/train-qn2-$seq.log" | tail -1)" >> "$out/hybrid-summary.log"
    grep "recorded in" "$out/train-qn2-$seq.log" >> "$out/hybrid-summary.log"
  done
fi

if [[ "$parts" == *" families "* ]]; then
  limited 120 "$build_dir/tests/test_norm_kernels" -tc="repeat_row*,casts*" > "$out/test_norm_kernels-families.log" 2>&1 || gpu_rc=1
  echo "test_norm_kernels (bias rows, fills, casts): $(grep -E 'test cases:|assertions:' "$out/test_norm_kernels-families.log" | tr '\n' ' ')" \
    >> "$out/families-summary.log"
  limited 300 "$build_dir/tests/test_cuda_hybrid_layer" -s -tc="Mixtral*,Qwen2*" > "$out/test_cuda_hybrid_layer-families.log" 2>&1 || gpu_rc=1
  grep -E "MESSAGE: ((mixtral|olmoe|qwen2-moe) layer|  (chunked vs|query chunks|with |bias gradients))" "$out/test_cuda_hybrid_layer-families.log" |
    sed 's/.*MESSAGE: //' >> "$out/families-summary.log"
  echo "test_cuda_hybrid_layer (Mixtral, OLMoE, Qwen2-MoE): $(grep -E 'test cases:|assertions:' "$out/test_cuda_hybrid_layer-families.log" | tr '\n' ' ')" \
    >> "$out/families-summary.log"
  limited 300 "$build_dir/tests/test_cuda_causal_lm" -s -tc="Mixtral*" > "$out/test_cuda_causal_lm-families.log" 2>&1 || gpu_rc=1
  echo "test_cuda_causal_lm (Mixtral, OLMoE, Qwen2-MoE models): $(grep -E 'resident plan:|test cases:|assertions:' "$out/test_cuda_causal_lm-families.log" | sed 's/.*MESSAGE: //' | tr '\n' ' ')" \
    >> "$out/families-summary.log"
  # PyTorch's own bf16 Qwen2-MoE layer against its fp32 one on that test's shapes: the bias
  # gradients' floor and how much each cancels over the tokens (scripts/diag/qwen2_bias_floor.py).
  # A measurement, not a check: its failure is reported, not counted against the GPU tests.
  if limited 180 env PYTHONUNBUFFERED=1 python3 scripts/diag/qwen2_bias_floor.py > "$out/qwen2-bias-floor.log" 2>&1; then
    { echo "PyTorch bf16 Qwen2-MoE layer vs fp32 (qwen2_bias_floor.py):"; tail -n 1 "$out/qwen2-bias-floor.log"; } >> "$out/families-summary.log"
  else
    echo "qwen2_bias_floor.py failed (exit $?; qwen2-bias-floor.log): $(tail -n 1 "$out/qwen2-bias-floor.log")" >> "$out/families-summary.log"
  fi
  # Qwen2-MoE: q/k/v biases, a shared expert, top-k not renormalised; PyTorch's own bf16 run beside
  # its fp32 one as the noise floor.
  COMPARE_ARGS="--noise-device cuda --noise-bf16" versus_pytorch train-cuda-qwen2-moe 300 "Qwen2-MoE: 50 GPU steps vs PyTorch at lr 3e-4" \
    --backend cuda --config examples/configs/tiny-qwen2-moe-d128.json --steps 50 --seq 128 --lr 3e-4 --log-every 10
  grep -E '^Qwen2-MoE' "$out/train-summary.log" >> "$out/families-summary.log"
  cat "$out/families-summary.log"
fi

if [[ "$parts" == *" balance "* ]]; then
  # transformers' load-balancing loss (output_router_logits) in the CUDA executor: the router's
  # probability sums and loss kernels against their references, every plan's step against the
  # resident one with the loss, and 50 GPU steps against transformers (Qwen3-MoE with 2
  # micro-batches; OLMoE, whose top-k weights are not renormalised), coefficient 0.5.
  limited 200 "$build_dir/tests/test_moe_kernels" -tc="router*" > "$out/test_moe_kernels-router.log" 2>&1 || gpu_rc=1
  limited 300 "$build_dir/tests/test_cuda_causal_lm" -tc="*load-balancing*" > "$out/test_cuda_causal_lm-balance.log" 2>&1 || gpu_rc=1
  limited 60 "$build_dir/tests/test_cuda_deltanet_shape" > "$out/test_cuda_deltanet_shape.log" 2>&1 || host_rc=1
  for t in test_moe_kernels-router test_cuda_causal_lm-balance test_cuda_deltanet_shape; do
    echo "$t: $(grep -E 'test cases:|assertions:|aux at|losses' "$out/$t.log" | tr '\n' ' ')" >> "$out/train-summary.log"
  done
  COMPARE_ARGS="${BALANCE_COMPARE_ARGS:-}" versus_pytorch train-cuda-qwen3-router-loss 300 "Qwen3-MoE + load-balancing loss: 50 GPU steps vs PyTorch" \
    --backend cuda --config tests/data/gpu-qwen3-moe-router-loss.json --steps 50 --seq 128 --micro-batches 2 --lr 3e-4 --log-every 10
  COMPARE_ARGS="${BALANCE_COMPARE_ARGS:-}" versus_pytorch train-cuda-olmoe-router-loss 300 "OLMoE + load-balancing loss: 50 GPU steps vs PyTorch" \
    --backend cuda --config tests/data/gpu-olmoe-router-loss.json --steps 50 --seq 128 --lr 3e-4 --log-every 10
fi

if [[ "$parts" == *" calibrate "* ]]; then
  # A machine profile measured now (PCIe, GEMMs, OOM's attention passes, CPU AdamW, ...): the layer
  # bench and the 5.13B runs below plan and predict with it, so predicted vs measured compares like
  # with like.
  limited 400 "$build_dir/examples/calibrate/oom-calibrate" --out "$out/profile.json" --name h200 \
    > "$out/calibrate.log" 2>&1 || ref_rc=1
fi

if [[ "$parts" == *" moments "* ]]; then
  # bf16 moments: the kernels' and executors' bits (each test whole: the fp32 cases beside them are
  # the regression check), a CUDA run killed and resumed bit for bit, then the trainer both ways.
  for t in test_norm_kernels test_cuda_footprint test_cuda_layer_executor test_cuda_causal_lm; do
    limited 200 "$build_dir/tests/$t" > "$out/$t.log" 2>&1 || gpu_rc=1
    echo "$t: $(grep -E 'test cases:|assertions:|Status' "$out/$t.log" | tr '\n' ' ')" >> "$out/train-summary.log"
  done
  # At --seq 1024: at 64 an H100's steps came ~5 ms apart and the kill, polled, landed past the
  # window the script wants (between checkpoints 8 and 20; it tries 3 times).
  TRAIN_ARGS="--backend cuda --config examples/configs/tiny-moe-d128.json --seq 1024 --moments bf16" \
    limited 240 bash tests/train/kill_resume.sh "$build_dir/examples/train/oom-train" > "$out/kill-resume-bf16.log" 2>&1 || gpu_rc=1
  echo "kill+resume, cuda, bf16 moments: $(tail -1 "$out/kill-resume-bf16.log")" >> "$out/train-summary.log"
  mcfg=${MOMENTS_CONFIG:-examples/configs/moe-5b.json}
  for m in ${MOMENTS_PRECISIONS:-fp32 bf16}; do
    limited 150 "$build_dir/examples/train/oom-train" --backend cuda --config "$mcfg" --seq "${MOMENTS_SEQ:-4096}" --steps 6 --lr 3e-4 \
      --moments "$m" --log-every 1 --checkpoint-every 0 --overwrite --out "$out/run-moments-$m" > "$out/train-moments-$m.log" 2>&1 || gpu_rc=1
    {
      echo "moments $m: $(grep -E '^residency|segments resident|^state:|GPU memory' "$out/train-moments-$m.log" | head -5 | tr '\n' ' ')"
      grep '^step' "$out/train-moments-$m.log" | tail -3
    } >> "$out/train-summary.log"
  done
fi

if [[ "$parts" == *" layers "* ]]; then
  # The CudaLayerExecutor: every plan the resident step bit for bit on the GPU, the GPU stack
  # against the HostExecutor's CPU one, the backend's operations; then the example on both
  # backends (same plan, same data: the losses agree to fp32 rounding).
  limited 300 "$build_dir/tests/test_cuda_layer_executor" > "$out/test_cuda_layer_executor.log" 2>&1 || gpu_rc=1
  limited 60 "$build_dir/examples/custom_layer/oom-custom-layer" --backend cuda --steps 20 > "$out/custom-layer-cuda.log" 2>&1 || gpu_rc=1
  limited 60 "$build_dir/examples/custom_layer/oom-custom-layer" --steps 20 > "$out/custom-layer-host.log" 2>&1 || host_rc=1
  {
    echo "test_cuda_layer_executor: $(grep -E 'MESSAGE|test cases:|assertions:' "$out/test_cuda_layer_executor.log" | tr '\n' ' ')"
    echo "oom-custom-layer cuda: $(grep -E '^loss|peak' "$out/custom-layer-cuda.log" | tr '\n' ' ')"
    echo "oom-custom-layer host: $(grep -E '^loss|peak' "$out/custom-layer-host.log" | tr '\n' ' ')"
  } >> "$out/train-summary.log"
  # What streaming costs the CudaLayerExecutor: a stack of 16 layers of 1024 x 4096 (8.4M
  # parameters each, 134M in all) at 512 tokens, all resident (8 GiB) against streamed (400 MiB:
  # the weights through slots, CPU AdamW): the same compute, so the step ratio is the streaming's
  # cost not hidden. Each run plans twice, the second time with the layers' rates measured on a
  # trial step: its predicted step against the median says how well they price the GPU layers.
  # LAYERS_BENCH=0 leaves it out. With PARTS="calibrate layers" the bench plans with the profile
  # measured above (its CPU AdamW and PCIe rates this machine's), else with the built-in H200 one.
  # The same with --no-measure (the declared FLOPs at the profile's GEMM rate), in the same call.
  if [[ "${LAYERS_BENCH:-1}" == 1 ]]; then
    bench_profile=()
    if [[ -s "$out/profile.json" ]]; then
      bench_profile=(--profile "$out/profile.json")
      echo "oom-custom-layer bench: planned with the profile measured in this call ($out/profile.json)" >> "$out/train-summary.log"
    fi
    for budget in 8GiB 400MiB; do
      limited 120 "$build_dir/examples/custom_layer/oom-custom-layer" --backend cuda --layers 16 --hidden 1024 --inter 4096 \
        --tokens 512 --steps 6 --lr 1e-4 --gpu-budget "$budget" --host-budget 8GiB "${bench_profile[@]}" \
        --trace "$out/trace-custom-layer-$budget.json" > "$out/custom-layer-bench-$budget.log" 2>&1 || gpu_rc=1
      echo "oom-custom-layer 16 x 1024 x 4096, 512 tokens, --gpu-budget $budget: $(grep -E '^measured on a trial' \
        "$out/custom-layer-bench-$budget.log") then $(sed -n '/^planned again/,$p' "$out/custom-layer-bench-$budget.log" |
        grep -E '^residency|^retention|^compute|^predicted step|^median|^loss|^last step recorded' | tr '\n' ' ')" >> "$out/train-summary.log"
      limited 120 "$build_dir/examples/custom_layer/oom-custom-layer" --backend cuda --layers 16 --hidden 1024 --inter 4096 \
        --tokens 512 --steps 6 --lr 1e-4 --gpu-budget "$budget" --host-budget 8GiB "${bench_profile[@]}" --no-measure > "$out/custom-layer-bench-$budget-declared.log" 2>&1 ||
        gpu_rc=1
      echo "  the same, --no-measure: $(grep -E '^residency|^retention|^compute|^predicted step|^median|^loss' \
        "$out/custom-layer-bench-$budget-declared.log" | tr '\n' ' ')" >> "$out/train-summary.log"
      # The same stack as cuBLAS layers (bf16 GEMMs on the tensor cores): what streaming and the
      # CPU AdamW cost when the compute is fast.
      limited 120 "$build_dir/examples/custom_layer/oom-custom-layer" --backend cuda --layer cublas --layers 16 --hidden 1024 \
        --inter 4096 --tokens 512 --steps 6 --lr 1e-4 --gpu-budget "$budget" --host-budget 8GiB "${bench_profile[@]}" \
        --trace "$out/trace-custom-layer-cublas-$budget.json" > "$out/custom-layer-cublas-$budget.log" 2>&1 ||
        gpu_rc=1
      echo "  as cuBLAS layers: $(grep -E '^measured on a trial' "$out/custom-layer-cublas-$budget.log") then $(sed -n '/^planned again/,$p' \
        "$out/custom-layer-cublas-$budget.log" | grep -E '^residency|^retention|^predicted step|^median|^loss|^last step recorded' | tr '\n' ' ')" >> "$out/train-summary.log"
    done
    # The recorded steps' spans by kind (count, total, median) for each resource.
    python3 scripts/trace_summary.py "$out"/trace-custom-layer-*[Bb].json > "$out/trace-summary.log" 2>&1 || true
  fi
fi


if [[ "$parts" == *" train "* ]]; then
  # The trainer on the GPU: the CUDA executor's own tests, 50 steps vs PyTorch, SIGKILL + resume,
  # and the 5.13B benchmark model at the sequence lengths in $SEQS.
  for t in test_cuda_causal_lm test_lm_ends; do
    limited 300 "$build_dir/tests/$t" > "$out/$t.log" 2>&1 || ref_rc=1
    echo "$t: $(tail -3 "$out/$t.log" | tr '\n' ' ')" >> "$out/train-summary.log"
  done
  for lr in ${TRAIN_CUDA_LRS:-1e-3 3e-4}; do
    versus_pytorch "train-cuda-$lr" 300 "50 GPU steps vs PyTorch at lr $lr" --backend cuda \
      --config examples/configs/tiny-moe-d128.json --steps 50 --seq 128 --lr "$lr" --log-every 10
  done
  # The hybrid family on the GPU: tiny Qwen3-Next (3 Gated DeltaNet + 1 gated attention layer,
  # shared experts, hidden 256, heads of 128), 50 steps against transformers' Qwen3NextForCausalLM
  # (TRAIN_HYBRID=0 leaves it out). Its noise floor is PyTorch's own bf16 run against its fp32 one:
  # the bf16 Gated DeltaNet's gradients sit a few 1e-2 from fp32 in any implementation, and 50
  # steps of AdamW carry that to ~1.3e-2 in the loss (2026-12-04: ours 1.30e-2, PyTorch bf16
  # 1.35e-2), so this comparison allows 2e-2, about 1.5x that floor, where Qwen3-MoE's allows 1e-2.
  if [[ "${TRAIN_HYBRID:-1}" == 1 ]]; then
    COMPARE_ARGS="--noise-device cuda --noise-bf16 --tolerance 2e-2" versus_pytorch train-cuda-qwen3-next 300 "Qwen3-Next: 50 GPU steps vs PyTorch at lr 3e-4" --backend cuda \
      --config examples/configs/tiny-qwen3-next-d128.json --steps 50 --seq 128 --lr 3e-4 --log-every 10
    # Qwen3.5-MoE: its separate linear-attention projections and stacked experts (2026-12-04:
    # ours 6.90e-3, PyTorch bf16 7.20e-3).
    COMPARE_ARGS="--noise-device cuda --noise-bf16 --tolerance 2e-2" versus_pytorch train-cuda-qwen3.5 300 \
      "Qwen3.5-MoE: 50 GPU steps vs PyTorch at lr 3e-4" --backend cuda \
      --config examples/configs/tiny-qwen3.5-moe-d128.json --steps 50 --seq 128 --lr 3e-4 --log-every 10
  fi
  # Gradient accumulation: 50 GPU steps of MICRO_BATCHES (default 3) sequences each against
  # PyTorch's summed per-micro-batch gradients (TRAIN_ACCUMULATE=0 leaves it out). At lr 3e-4: at
  # 1e-3 this model's 50 steps are chaotic past step ~30 (PyTorch on CPU and on CUDA part by 1.6e-2).
  if [[ "${TRAIN_ACCUMULATE:-1}" == 1 ]]; then
    versus_pytorch train-cuda-accumulated 300 "50 GPU steps of ${MICRO_BATCHES:-3} micro-batches vs PyTorch" --backend cuda \
      --config examples/configs/tiny-moe-d128.json --steps 50 --seq 128 --micro-batches "${MICRO_BATCHES:-3}" --lr 3e-4 --log-every 10
  fi
  # Several sequences per micro-batch: 50 GPU steps of BATCH (default 3) sequences in one
  # micro-batch, 2 micro-batches a step, against PyTorch's input_ids of shape (BATCH, seq)
  # (TRAIN_BATCH=0 leaves it out).
  if [[ "${TRAIN_BATCH:-1}" == 1 ]]; then
    versus_pytorch train-cuda-batch 300 "50 GPU steps of 2 micro-batches of ${BATCH:-3} sequences vs PyTorch" --backend cuda \
      --config examples/configs/tiny-moe-d128.json --steps 50 --seq 128 --batch "${BATCH:-3}" --micro-batches 2 --lr 3e-4 --log-every 10
  fi
  # CLIP=X: 50 GPU steps with --max-grad-norm X against PyTorch's clip_grad_norm_ (lr 1e-3).
  if [[ -n "${CLIP:-}" ]]; then
    versus_pytorch train-cuda-clip 300 "50 GPU steps clipped to $CLIP vs PyTorch" --backend cuda \
      --config examples/configs/tiny-moe-d128.json --steps 50 --seq 128 --lr 1e-3 --max-grad-norm "$CLIP" --log-every 10
  fi
  # WIDE=1: the 5.13B model's layer shapes (hidden 2048, 64 experts top-8, vocab 32000) in 2 layers,
  # 20 steps at the benchmark's lr against PyTorch: does the full-width model train as PyTorch
  # trains it (the 5.13B runs' loss rises at step 3 at lr 3e-4 without warmup)?
  if [[ "${WIDE:-0}" == 1 ]]; then
    python3 -c "import json; c = json.load(open('examples/configs/moe-5b.json')); c['num_hidden_layers'] = 2; json.dump(c, open('$build_dir/moe-5b-2layer.json', 'w'))"
    versus_pytorch train-wide 300 "2-layer 5.13B-wide, 20 GPU steps vs PyTorch" --backend cuda \
      --config "$build_dir/moe-5b-2layer.json" --steps 20 --seq 512 --lr "${LR_5B:-3e-4}" --log-every 5
  fi
  # compute-sanitizer on the executor's smallest complete step (racecheck is slow). SANITIZE=0 and
  # KILL_RESUME=0 skip these and the SIGKILL test (for calls that only measure).
  if [[ "${SANITIZE:-1}" == 1 ]] && command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck; do
      limited "${SANITIZER_TIMEOUT:-400}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$build_dir/tests/test_cuda_causal_lm" \
        -tc="one streamed step*" > "$out/sanitizer-executor-$tool.log" 2>&1
      rc=$?
      [[ $rc -eq 0 ]] || ref_rc=1
      echo "compute-sanitizer $tool on CudaCausalLm: exit $rc — $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer-executor-$tool.log" | tail -1)" >> "$out/train-summary.log"
    done
  fi
  if [[ "${KILL_RESUME:-1}" == 1 ]]; then
    limited 300 env TRAIN_ARGS="--backend cuda --config examples/configs/tiny-moe-d128.json" \
      bash tests/train/kill_resume.sh "$build_dir/examples/train/oom-train" > "$out/kill-resume-cuda.log" 2>&1 || ref_rc=1
    echo "kill/resume on cuda: $(tail -1 "$out/kill-resume-cuda.log")" >> "$out/train-summary.log"
    # The same with gradient accumulation and clipping (the CI runs this pair on the host backend).
    limited 300 env TRAIN_ARGS="--backend cuda --config examples/configs/tiny-moe-d128.json --micro-batches 2 --max-grad-norm 0.5" \
      bash tests/train/kill_resume.sh "$build_dir/examples/train/oom-train" > "$out/kill-resume-cuda-accumulated.log" 2>&1 || ref_rc=1
    echo "kill/resume on cuda, 2 micro-batches, clipped: $(tail -1 "$out/kill-resume-cuda-accumulated.log")" >> "$out/train-summary.log"
  fi
  # The step traced is the last: the first steps still warm cuBLAS' heuristics for new shapes.
  steps_5b=${STEPS_5B:-4}
  profile_args=()
  if [[ -f "$out/profile.json" ]]; then profile_args=(--profile "$out/profile.json")
  elif [[ -n "${PROFILE:-}" ]]; then profile_args=(--profile "$PROFILE"); fi
  for seq in ${SEQS:-4096}; do
    limited "${SEQ_TIMEOUT:-300}" "$build_dir/examples/train/oom-train" --backend cuda --config examples/configs/moe-5b.json \
      --out "$build_dir/train-5b-$seq" --overwrite --seq "$seq" --steps "$steps_5b" --lr "${LR_5B:-3e-4}" --log-every 1 \
      --trace-step "$steps_5b" --trace "$out/trace-5b-$seq.json" "${profile_args[@]}" ${GRAD_STAGING:+--grad-staging "$GRAD_STAGING"} $([[ "${KEEP_ATTENTION:-1}" == 0 ]] && echo --no-keep-attention-state) $([[ "${BUCKETED:-1}" == 0 ]] && echo --no-bucketed-expert-gemms) \
      --checkpoint-every 0 > "$out/train-5b-$seq.log" 2>&1
    echo "5.13B seq $seq: exit $? — $(grep '^step' "$out/train-5b-$seq.log" | tail -1)" >> "$out/train-summary.log"
    grep "recorded in" "$out/train-5b-$seq.log" >> "$out/train-summary.log"
  done
fi

# PARTS=peers: OOM against its peers (bench/baselines/: PyTorch FSDP2, DeepSpeed) on the 5.13B model
# (PEER_CONFIG below)
# in the same call, each run alone on the whole GPU, one after the other, on the same windows of data (the
# peer reads those oom-train dumped; where oom-train did not finish, the peer is not run). PEERS
# (default "4096:1 4096:2") lists seq:batch settings; PEER_MODES (default "plain-nockpt plain": the
# peer at its fastest where its activations fit, and with per-layer checkpointing as MISSION.md's
# figures were taken; both with fused AdamW, PEER_OPTIMIZER=foreach for MISSION.md's; the 5.13B model
# without checkpointing needs ~101 GiB at 4K: an H100 runs it out of memory, exit 3) may add "offload"
# (FSDP2 + CPUOffloadPolicy, ~7 s a step) and either with "-nockpt" (no per-layer activation
# checkpointing), and "deepspeed" (ZeRO-Offload: stage 2, optimizer on the host) or
# "deepspeed-zero3" (parameters on the host too; bench/baselines/deepspeed_offload.py). DeepSpeed
# comes from .whl/ (scripts/fetch-peer-wheels.sh; carry it to the GPU machine), installed into
# $build_dir/peer-python; its CPU Adam is built on first use into $build_dir/torch-extensions.
# PEER_OOM_ARGS: more oom-train flags for OOM's run (e.g. "--moments bf16": then not the peers'
# fp32-moment step, say so beside its figures).
# PEER_STEPS (default 4) steps each, the first not counted. PEER_SAME_INIT=1: oom-train saves its
# initial weights (--save-initial) and the peers start from them (--init-from), so the losses
# compare step for step (the file's pages then count in the peers' host high-water mark; default
# 0: each its own draw of the same distribution). Both train with lr 3e-4 and weight decay 0.01.
# PEER_CONFIG (default
# examples/configs/moe-5b.json) is the model both run. The summary prints the ratios, and names
# a peer that failed: with the host RSS it had reached where the kernel killed it (each peer keeps
# its high-water mark in peer-run-*.json.rss as it runs: bench/baselines/common.py RssWatch). A peer out of memory says so (exit 3); the sweep goes on.
peer_mode_re='^((plain|offload)(-nockpt)?|deepspeed(-zero3)?)$'
if [[ "$parts" == *" peers "* ]]; then
  peer_config=${PEER_CONFIG:-examples/configs/moe-5b.json}
  if [[ ! -f "$peer_config" ]]; then
    echo "PEER_CONFIG: no file '$peer_config': the peers are not run" >&2
    bench_rc=1
    parts=${parts/ peers / }
  fi
fi
if [[ "$parts" == *" peers "* ]]; then
  for mode in ${PEER_MODES:-plain-nockpt plain}; do
    [[ "$mode" =~ $peer_mode_re ]] ||
      { echo "PEER_MODES: '$mode' is not plain, offload (either with -nockpt), deepspeed or deepspeed-zero3" >&2; bench_rc=1; }
  done
  abs_build=$(cd "$build_dir" && pwd)
  peer_python="$abs_build/peer-python"  # absolute: it goes into PYTHONPATH
  if [[ " ${PEER_MODES:-plain-nockpt plain} " == *" deepspeed"* ]]; then
    # Installed again whenever .whl/ changed (its listing is the stamp). Only the projects DeepSpeed
    # needs beyond what the machine has, and typing_extensions only where it is missing; pip picks
    # each one's wheel for this Python from .whl/. Only the DeepSpeed runs see this folder.
    stamp=$(ls -l .whl 2> /dev/null | md5sum | cut -c1-16)
    if [[ "$(cat "$peer_python/.stamp" 2> /dev/null)" != "$stamp" ]]; then
      projects=(deepspeed einops hjson msgpack py-cpuinfo psutil pydantic pydantic-core annotated-types typing-inspection)
      python3 -c "import typing_extensions" 2> /dev/null || projects+=(typing-extensions)
      rm -rf "$peer_python"
      if python3 -m pip install --no-index --no-deps --find-links .whl --target "$peer_python" "${projects[@]}" \
          > "$out/peer-python.log" 2>&1; then
        echo "$stamp" > "$peer_python/.stamp"
      else
        echo "DeepSpeed not installed (peer-python.log): run scripts/fetch-peer-wheels.sh and carry .whl" >&2
        bench_rc=1
      fi
    fi
  fi
  for setting in ${PEERS:-4096:1 4096:2}; do
    if [[ ! "$setting" =~ ^([0-9]+):([0-9]+)$ ]]; then
      echo "PEERS: '$setting' is not seq:batch (e.g. 4096:2)" >&2
      bench_rc=1
      continue
    fi
    seq=${BASH_REMATCH[1]} batch=${BASH_REMATCH[2]}
    run="$build_dir/peer-oom-$seq-$batch"
    rm -rf "$run" "$run.tok"  # nothing of an earlier call may stand in for this one's
    if limited "${SEQ_TIMEOUT:-300}" "$build_dir/examples/train/oom-train" --backend cuda --config "$peer_config" \
        --out "$run" --overwrite --seq "$seq" --batch "$batch" --steps "${PEER_STEPS:-4}" --lr 3e-4 --weight-decay 0.01 \
        --log-every 1 --checkpoint-every 0 --dump-batches "$run.tok" $([[ "${PEER_SAME_INIT:-0}" == 1 ]] && echo --save-initial) \
        ${PEER_OOM_ARGS:-} > "$out/peer-oom-$seq-$batch.log" 2>&1; then
      cp "$run/metrics.jsonl" "$out/peer-oom-$seq-$batch.jsonl"
    else
      echo "oom-train failed at seq $seq x batch $batch (peer-oom-$seq-$batch.log): its peers are not run" >&2
      bench_rc=1
      continue
    fi
    for mode in ${PEER_MODES:-plain-nockpt plain}; do
      [[ "$mode" =~ $peer_mode_re ]] || continue
      peer_args=(--config "$peer_config" --seq "$seq" --batch "$batch" --steps "${PEER_STEPS:-4}"
        --batches "$run.tok" --json "$out/peer-run-$mode-$seq-$batch.json" --lr 3e-4 --weight-decay 0.01)
      [[ "${PEER_SAME_INIT:-0}" == 1 ]] && peer_args+=(--init-from "$run/checkpoint-000000")
      [[ "$mode" != deepspeed* ]] && peer_args+=(--optimizer "${PEER_OPTIMIZER:-fused}")
      [[ "$mode" == offload* ]] && peer_args+=(--offload)
      [[ "$mode" == *-nockpt ]] && peer_args+=(--no-checkpointing)
      script=bench/baselines/fsdp2.py
      if [[ "$mode" == deepspeed* ]]; then
        script=bench/baselines/deepspeed_offload.py
        [[ "$mode" == *-zero3 ]] && peer_args+=(--stage 3)
      fi
      peer_env=(PYTHONUNBUFFERED=1)
      [[ "$mode" == deepspeed* ]] &&
        peer_env+=(PYTHONPATH="$peer_python${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR="$abs_build/torch-extensions")
      limited 420 env "${peer_env[@]}" python3 "$script" "${peer_args[@]}" > "$out/peer-run-$mode-$seq-$batch.log" 2>&1
      rc=$?
      # The exit status, the seconds it ran and its limit (0: skipped): a SIGKILL (137) well inside
      # the limit came from elsewhere, on these machines the host's out-of-memory killer.
      echo "$rc $limited_took $limited_s" > "$out/peer-run-$mode-$seq-$batch.rc"
      ((rc != 0 && rc != 3)) && bench_rc=1
    done
  done
fi

[[ "$parts" == *" bench "* ]] && for b in "$build_dir"/bench/micro/bench_*; do
  [[ -x "$b" ]] || continue
  name=$(basename "$b")
  limited 0 "$b" --benchmark_format=console --benchmark_out="$out/$name.json" --benchmark_out_format=json \
    > "$out/$name.log" 2>&1 || bench_rc=1
done

# Kernel benchmarks print their own tables (ratios to limits measured in the same run); the
# attention one is paired with PyTorch SDPA on the same shapes.
kernel_bench=0
[[ "$parts" == *" bench "* || ( "$parts" == *" kernels "* && "${KERNEL_BENCH:-1}" == 1 ) ]] && kernel_bench=1
((kernel_bench)) &&
  for b in "$build_dir"/bench/bench_moe_kernels "$build_dir"/bench/kernels/bench_attention "$build_dir"/bench/kernels/bench_gated_delta; do
  [[ -x "$b" ]] || continue
  limited 300 "$b" > "$out/$(basename "$b").log" 2>&1 || bench_rc=1
done
if ((kernel_bench)) && [[ -f scripts/bench_attention_sdpa.py ]]; then
  limited 300 env PYTHONUNBUFFERED=1 python3 scripts/bench_attention_sdpa.py > "$out/sdpa.log" 2>&1 || bench_rc=1
fi
# Head dim 256 (the hybrid models' full-attention layers), ours and SDPA's, the same way.
if ((kernel_bench)) && [[ -x "$build_dir/bench/kernels/bench_attention" && -f scripts/bench_attention_sdpa.py ]]; then
  limited 200 "$build_dir/bench/kernels/bench_attention" --head-dim 256 > "$out/bench_attention_d256.log" 2>&1 || bench_rc=1
  limited 200 env PYTHONUNBUFFERED=1 python3 scripts/bench_attention_sdpa.py --head-dim 256 > "$out/sdpa_d256.log" 2>&1 ||
    bench_rc=1
fi
# The memory-bound kernels against the 1 GiB device copy measured in the same process (the
# bandwidth report of test_norm_kernels), so that issue 5's three bars are read from one run.
if ((kernel_bench)) && [[ -x "$build_dir/tests/test_norm_kernels" ]]; then
  limited 120 "$build_dir/tests/test_norm_kernels" -tc="bandwidth*" > "$out/bandwidth.log" 2>&1 || bench_rc=1
fi

python3 scripts/gpu_check_summary.py "$out" > "$out/summary.txt"
cat "$out/summary.txt"
if [[ -n "${OUT:-}" ]]; then
  cp "$out/summary.txt" "$OUT/summary.txt"
  save_logs
fi
echo "exit codes: gpu tests $gpu_rc, host tests $host_rc, benchmarks $bench_rc, reference checks $ref_rc"
exit $(( gpu_rc || host_rc || bench_rc || ref_rc ))
