#!/usr/bin/env bash
# corellm's CUDA platform (plugins/platform_cuda, plugins/attn_triton) on one real GPU, in one go:
#   install   the carried wheels (.whl/: what the offline GPU image lacks) and corellm, editable,
#             without letting pip resolve anything (torch stays the image's)
#   env       GPU, driver, versions; which platform `auto` picks
#   pytest    tests/test_platform_cuda.py, whole (its gpu-marked tests run where CUDA is visible;
#             only this file has them: never collect tests/test_attn_triton.py in a CUDA process,
#             it sets TRITON_INTERPRET=1 at import)
#   parity    greedy tokens vs transformers on the same GPU, float32, with and without CUDA graphs
#   qwen3     a random-weight Qwen3-0.6B-shaped checkpoint (bfloat16)
#   profile   a decode step at batch 256 (Qwen3-0.6B shape): device time, host phases, kernels
#             and host syncs per step against its HBM floor, greedy and at temperature 0.6, with
#             the platform's defaults and with triton_ops on
#   tp_*      output tok/s: corellm (benchmarks/throughput.py) and transformers generate (peer)
#   extras    if time is left: corellm without CUDA graphs, corellm on nano-vllm's whole workload
#             (256 sequences), the attention kernels' micro-benchmark, tests/test_hf_equivalence.py
#             on CUDA (its float32 tests: the bfloat16 ones assert the CPU platform's ops)
# Each step runs under its own timeout (and all of them under BRINGUP_BUDGET_S), logs to its own
# section of $OUT/bringup.log and writes its own JSON, so one failing step hides no other one.
# $OUT ends with 4 files (the device tool brings back 8 at most): bringup.log, summary.json,
# pytest_cuda.xml and steps_json.tar.gz (every step's JSON).
#
#   OUT=/tmp/out bash benchmarks/gpu_bringup.sh            # on the GPU machine
#   BRINGUP_CPU=1 OUT=/tmp/dry bash benchmarks/gpu_bringup.sh   # dry run on a CPU: tiny sizes
#   BRINGUP_STEPS="pytest parity" ...   # only these steps (install and the summary always run)
#   BRINGUP_BUDGET_S=450                # seconds for all the steps together (default 450)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# CC must stay unset: Triton compiles its kernel launchers with $CC (CC=false breaks every kernel)
unset TRITON_INTERPRET CC
OUT=${OUT:-/tmp/gpu-bringup}
WORK=${BRINGUP_WORK:-/tmp/bringup-work}
export PY=${PY:-python3}
export CPU=${BRINGUP_CPU:-0}
DEADLINE=$(( SECONDS + ${BRINGUP_BUDGET_S:-450} ))
ONLY=" ${BRINGUP_STEPS:-} "
mkdir -p "$OUT" "$WORK"
LOG=$OUT/bringup.log
STEPS=$WORK/steps.tsv
: >"$STEPS"
date -u +"start %F %T UTC" | tee -a "$LOG"

# step NAME SECONDS CMD...: CMD under `timeout` (capped by what is left of the budget), its
# output into $LOG under a header; its status into $STEPS.
step() {
  local name=$1 limit=$2; shift 2
  if [[ "$ONLY" != "  " && "$ONLY" != *" $name "* && $name != install ]]; then
    printf '%s\tnot selected\t0s\n' "$name" >>"$STEPS"
    return 0
  fi
  local left=$(( DEADLINE - SECONDS ))
  if (( left < 20 )); then
    printf '%s\tskipped\t0s\tbudget spent\n' "$name" >>"$STEPS"
    echo "=== $name: skipped (budget spent)" | tee -a "$LOG"
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s) $(date -u +%T): $*" | tee -a "$LOG"
  local t0=$SECONDS
  # streamed into $LOG as it runs: a run cut off from outside still brings back what it printed
  local rc
  if declare -F "$1" >/dev/null; then      # a function of this script: `timeout` runs programs
    timeout -k 10 "$limit" bash -c "$(declare -f "$1"); $(printf '%q ' "$@")" 2>&1 \
      | tee "$WORK/$name.log" >>"$LOG"
    rc=${PIPESTATUS[0]}
  else
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" >>"$LOG"
    rc=${PIPESTATUS[0]}
  fi
  local state=ok
  (( rc == 124 || rc == 137 )) && state=timeout
  (( rc != 0 && rc != 124 && rc != 137 )) && state=failed
  printf '%s\t%s(rc=%d)\t%ds\n' "$name" "$state" "$rc" "$(( SECONDS - t0 ))" >>"$STEPS"
  echo "=== $name: $state rc=$rc in $(( SECONDS - t0 ))s" | tee -a "$LOG"
  tail -n 4 "$WORK/$name.log"
  return 0
}

do_install() {
  if [[ "$CPU" == 1 ]]; then echo "dry run: nothing installed"; return 0; fi
  nvidia-smi -L
  # Wheels first, typing_extensions only where the image's is too old for pydantic.
  shopt -s nullglob             # an empty .whl/ gives no literal '.whl/*.whl'
  local w=(); for f in .whl/*.whl; do [[ $f == *typing_extensions* ]] || w+=("$f"); done
  if (( ${#w[@]} )); then
    $PY -m pip install -q --no-index --no-deps --no-compile "${w[@]}" || return 1
  fi
  if ! $PY -c "import pydantic" 2>/dev/null; then
    echo "pydantic needs a newer typing_extensions: installing the carried one"
    local te=(.whl/typing_extensions-*.whl)
    (( ${#te[@]} )) || { echo "no typing_extensions wheel carried in .whl/"; return 1; }
    $PY -m pip install -q --no-index --no-deps --no-compile "${te[@]}" || return 1
  fi
  # Offline: no build isolation (it would fetch setuptools), no dependency resolution.
  if ! $PY -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
    echo "editable install failed: registering the source tree by hand (entry points kept)"
    $PY benchmarks/gpu_bringup.py register-source || return 1
  fi
  $PY -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|pydantic|msgspec|pyzmq|pluggy|corellm|typing.extensions|setuptools) "
  $PY -c "import corellm, corellm_plugins.platform_cuda, pydantic, msgspec, zmq; print('imports ok')" || return 1
  $PY -m corellm plugins 2>&1 | grep -iE "platform|attention|triton|sdpa|cuda" | head -20
}

step install 120 do_install
step env 60 $PY benchmarks/gpu_bringup.py env --json "$OUT/env.json"

# The gpu-marked tests (the marker of pyproject.toml); only this file has any.
timeout 90 $PY -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/test_platform_cuda.py 2>/dev/null \
  | grep "::" | sed 's/.*:://' >"$WORK/gpu_tests.txt" || true
echo "gpu-marked: $(tr '\n' ' ' <"$WORK/gpu_tests.txt")" | tee -a "$LOG"
step pytest 200 $PY -m pytest -v -rA -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml" \
  tests/test_platform_cuda.py

if [[ "$CPU" == 1 ]]; then
  PARITY=(--device cpu --quick); QWEN=(--tiny); N=8; IN=16:64; OUTLEN=16:64; TOK=512
  EAGER='{"name": "cpu"}'
else
  PARITY=(); QWEN=(); N=${BRINGUP_REQUESTS:-128}; IN=100:1024; OUTLEN=100:1024; TOK=16384
  EAGER='{"name": "cuda", "cuda_graphs": false}'

fi
step parity 150 $PY benchmarks/gpu_bringup.py parity "${PARITY[@]}" --json "$OUT/parity.json"

MODEL=$WORK/qwen3-0.6b-random
step qwen3 120 $PY benchmarks/gpu_bringup.py make-qwen3 "$MODEL" "${QWEN[@]}"
if [[ "$CPU" == 1 ]]; then PROF=(--device cpu --dtype float32 --batch 8 --context 64 --steps 5)
  TRITON='{}'   # the CPU platform has no triton_ops: the dry run checks the script only
else PROF=(--batch 256 --context 768); TRITON='{"triton_ops": true}'; fi
step profile 150 $PY benchmarks/gpu_bringup.py profile --model "$MODEL" "${PROF[@]}" \
  --json "$OUT/profile.json"
step profile_triton 120 $PY benchmarks/gpu_bringup.py profile --model "$MODEL" "${PROF[@]}" \
  --platform "$TRITON" --json "$OUT/profile_triton.json"
# corellm through the benchmark harness: platform auto (cuda where visible), graphs on, all
# requests admitted at once, the KV pool sized for the whole workload; transformers is skipped
# there (its runner is CPU-only) and timed on the GPU by the next step, on the same requests.
step tp_corellm 180 $PY benchmarks/throughput.py --model "$MODEL" --dtype bfloat16 \
  --num-requests "$N" --input-len "$IN" --output-len "$OUTLEN" --max-num-seqs "$N" \
  --max-num-batched-tokens "$TOK" --skip-hf --no-phases --no-compute-limit --no-tqdm \
  --json "$OUT/tp_corellm.json"
step tp_hf 150 $PY benchmarks/gpu_bringup.py hf-throughput --model "$MODEL" --num-requests "$N" \
  --input-len "$IN" --output-len "$OUTLEN" --batch-size "$N" --json "$OUT/tp_hf.json"

# Extras, while the budget lasts: corellm again without CUDA graphs (same workload), and on
# nano-vllm's whole workload (256 sequences, in and out 100..1024).
TP_ARGS=(--model "$MODEL" --dtype bfloat16 --input-len "$IN" --output-len "$OUTLEN" \
  --max-num-batched-tokens "$TOK" --skip-hf --no-phases --no-compute-limit --no-tqdm)
step tp_corellm_eager 120 $PY benchmarks/gpu_bringup.py tp-corellm \
  --platform "$EAGER" -- "${TP_ARGS[@]}" --num-requests "$N" --max-num-seqs "$N" \
  --json "$OUT/tp_corellm_eager.json"
if [[ "$CPU" != 1 ]]; then
  step tp_corellm_256 120 $PY benchmarks/throughput.py "${TP_ARGS[@]}" --num-requests 256 \
    --max-num-seqs 256 --json "$OUT/tp_corellm_256.json"
  step tp_corellm_256_t06 120 $PY benchmarks/throughput.py "${TP_ARGS[@]}" --num-requests 256 \
    --max-num-seqs 256 --temperature 0.6 --json "$OUT/tp_corellm_256_t06.json"
fi
if [[ "$CPU" != 1 ]]; then
  step attn_bench 60 $PY benchmarks/attention.py --batch 1,8,64 --context 1024,4096 --iters 10
  step hf_equivalence 150 $PY -m pytest -q -p no:cacheprovider tests/test_hf_equivalence.py \
    -k "not native and not bfloat16"
fi

$PY benchmarks/gpu_bringup.py summarize "$OUT" --steps "$STEPS" --gpu-tests "$WORK/gpu_tests.txt" \
  2>&1 | tee -a "$LOG"
# The device tool brings back 8 files at most: every step's JSON goes into one archive beside
# the summary, the log and the junit file.
(cd "$OUT" && shopt -s nullglob && j=(*.json) && j=("${j[@]/summary.json}") \
  && tar czf steps_json.tar.gz ${j[@]} && rm -f ${j[@]})
ls "$OUT" | tee -a "$LOG"
date -u +"end %F %T UTC" | tee -a "$LOG"
