#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md, in two stages that each fit one 10-minute device call.
#   bash benchmarks/gpu.sh checks   # versions, kernel checks (cuDNN attention, chunked log-probs), GPU pytest
#   bash benchmarks/gpu.sh sample   # sampler throughput and memory-bandwidth fraction, Qwen2.5-0.5B shapes
#   bash benchmarks/gpu.sh sample-flags  # the decode loop under XLA command buffers
#   bash benchmarks/gpu.sh train    # RL train step throughput and MFU
#   bash benchmarks/gpu.sh profile  # the sampler's kernels, batch 64 and 256 (benchmarks/profile_decode.py)
#   bash benchmarks/gpu.sh overlap  # the default recipe, synchronous vs one-step overlap (needs grain)
#   bash benchmarks/gpu.sh plan [qwen|llama]  # each phase of an RL step beside jaxrl plan's prediction
#                                   # (benchmarks/plan_check.py); both recipes, or one with the whole call
#   bash benchmarks/gpu.sh ragged   # packed rows (issue 36): cuDNN's variable-length attention and a packed
#                                   # Qwen2.5-0.5B forward checked (benchmarks/gpu_packed.py), then the ragged
#                                   # sampler and train benchmarks; about 8.5 minutes
# Logs go to $OUT (or ./gpu-logs). Uses the machine's python3 with jax[cuda], flax, optax installed.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# models/ and kernels/ import as jaxrl.models and jaxrl.kernels once installed (pyproject's package-dir). Without
# an install (the device machine's python3) links inside jaxrl/ stand in for it (untracked files of this copy).
if ! $PY -c "import jaxrl.kernels, jaxrl.models" 2>/dev/null; then
  for package in kernels models; do [ -e "jaxrl/$package" ] || ln -s "../$package" "jaxrl/$package"; done
fi
QWEN="--model qwen2.5-0.5b --dtype bfloat16 --group 8 --prompt-len 256 --new-tokens 256 --bandwidth"

case "${1:-checks}" in
checks)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  $PY benchmarks/gpu_checks.py 2>&1 | tee "$OUT/gpu_checks.txt"
  # The sampler/kernel tests on the GPU, float32 matmuls at full precision (no TF32) as on CPU.
  JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 $PY -m pytest -q -p no:cacheprovider \
    tests/test_sampling.py tests/test_attention.py tests/test_logprobs.py -k "not long_run" 2>&1 | tail -25 \
    | tee "$OUT/gpu_pytest.txt"
  ;;
sample)
  for prompts in 8 16 32; do  # batch 64, 128, 256
    $PY -m jaxrl.bench sample $QWEN --prompts $prompts 2>&1 | tee "$OUT/sample_qwen_$prompts.txt"
  done
  $PY -m jaxrl.bench sample $QWEN --prompts 32 --no-prefix-sharing 2>&1 | tee "$OUT/sample_qwen_32_unshared.txt"
  $PY -m jaxrl.bench sample $QWEN --prompts 32 --kv-cache int8 2>&1 | tee "$OUT/sample_qwen_32_int8.txt"
  $PY -m jaxrl.bench sample --compare 2>&1 | tee "$OUT/sample_bench_small.txt"
  ;;
sample-flags)  # decode loop launch overhead: XLA command buffers (CUDA graphs) around while-loop bodies
  $PY -m jaxrl.bench sample $QWEN --prompts 8 --repeats 5 2>&1 | tee "$OUT/flags_default.txt"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
    $PY -m jaxrl.bench sample $QWEN --prompts 8 --repeats 5 2>&1 | tee "$OUT/flags_while.txt"
  $PY -m jaxrl.bench sample $QWEN --prompts 8 --repeats 5 --decode-segments 1 2>&1 | tee "$OUT/flags_segments1.txt"
  ;;
train)
  $PY -m jaxrl.bench train --model qwen2.5-0.5b --dtype bfloat16 --sequences 64 --prompt-len 256 \
    --completion-len 256 --peak-tflops 989 2>&1 | tee "$OUT/train_qwen.txt"
  $PY -m jaxrl.bench train --model qwen2.5-0.5b --dtype bfloat16 --sequences 64 --prompt-len 256 \
    --completion-len 256 --peak-tflops 989 --remat full 2>&1 | tee "$OUT/train_qwen_remat.txt"
  $PY -m jaxrl.bench train --dtype bfloat16 --peak-tflops 989 2>&1 | tee "$OUT/train_bench_small.txt"
  ;;
profile)
  for prompts in 8 32; do  # batch 64, 256
    $PY benchmarks/profile_decode.py --prompts $prompts --step-file "$OUT/step_kernels_$prompts.jsonl" 2>&1 \
      | tee "$OUT/profile_qwen_$prompts.txt"
  done
  ;;
overlap)  # deterministic reductions, so both modes warm-start from the same policy
  XLA_FLAGS=--xla_gpu_deterministic_ops=true $PY benchmarks/overlap.py --seeds 0 2>&1 | tee "$OUT/overlap.txt"
  for mode in sync overlap; do cp "runs/overlap-$mode-s0-0/timings.jsonl" "$OUT/timings_$mode.jsonl"; done
  ;;
plan)  # real lengths, random weights, 3 RL steps per phase; each recipe bounded so that the call ends in 10 min.
  # Both recipes in one call give each 290 s (--budget: phases not started in time are reported as skipped);
  # `plan qwen` or `plan llama` gives one recipe the whole call (the way to get every phase of both: two calls).
  which=${2:-both}
  limit=$([ "$which" = both ] && echo 290 || echo 580)
  for recipe in qwen2.5-math-1.5b-gsm8k:qwen2.5-math-1.5b llama3.2-1b-instruct-gsm8k:llama3.2-1b; do
    name=${recipe%%:*} model=${recipe##*:}
    case "$which" in both) ;; qwen) [ "${name#qwen}" != "$name" ] || continue ;;
      llama) [ "${name#llama}" != "$name" ] || continue ;; *) echo "plan: qwen, llama or nothing" >&2; exit 2 ;; esac
    timeout $limit $PY benchmarks/plan_check.py "configs/$name.yaml" "plan.model=$model" --steps 3 \
      --budget $((limit - 20)) --out "$OUT/plan_check_$name.json" 2>&1 | tee "$OUT/plan_check_$name.txt"
  done
  ;;
ragged)  # each stage bounded so that the whole case ends in about 8.5 minutes (a stage cut short says so in its log)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
    | tee "$OUT/ragged_versions.txt"
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', \
    optax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/ragged_versions.txt"
  timeout 150 $PY benchmarks/gpu_packed.py 2>&1 | tee "$OUT/gpu_packed.txt"
  echo "gpu_packed exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_packed.txt"
  timeout 200 $PY -m jaxrl.bench sample --model qwen2.5-0.5b --dtype bfloat16 --lengths ragged --compare-compaction \
    --prompts 8 --group 8 --prompt-len 256 --new-tokens 512 --bandwidth 2>&1 | tee "$OUT/sample_ragged.txt"
  echo "bench sample exit ${PIPESTATUS[0]}" | tee -a "$OUT/sample_ragged.txt"
  timeout 150 $PY -m jaxrl.bench train --model qwen2.5-0.5b --dtype bfloat16 --lengths ragged --packing compare \
    --sequences 64 --prompt-len 256 --completion-len 512 2>&1 | tee "$OUT/train_ragged.txt"
  echo "bench train exit ${PIPESTATUS[0]}" | tee -a "$OUT/train_ragged.txt"
  ;;
*)
  echo "usage: bash benchmarks/gpu.sh checks|sample|sample-flags|train|profile|overlap|plan [qwen|llama]|ragged" >&2
  exit 2
  ;;
esac
