#!/usr/bin/env bash
# The MoE benchmark of docs/benchmarks/moe.md on one H200, in under 9 minutes:
#   1. the MoE layer vs a dense SwiGLU of equal active FLOPs at the GPT-2-small shape (eager);
#   2. each training variant alone for a short eager run: isolated tokens/s;
#   3. the layer benchmark compiled (dense, 8x top-2 dropless and capacity 1.25, grouped GEMM),
#      then the same cases compiled with CUDA graphs (mode="reduce-overhead");
#   4. dense vs MoE variants on the Gutenberg books at the 17M preset's shape, all at once on the
#      GPU with trainer.compile, 40.96M tokens each or as many as the time left allows (each run
#      stops at its time budget, evaluates and logs, so every variant reports);
#   5. the report: $OUT/moe_results.{md,json} and the run logs.
# Inputs (environment): TRAIN_BIN, VAL_BIN (encoded token files), TOKENIZER_DIR, OUT.
# Knobs, defaults for the H200: CONFIG, TOKENS (40960000), BATCH_SIZE (32), CONTEXT (256),
# EXTRA (overrides for every training run), LAYER_ARGS, LAYER_COMPILE (1; 0 skips step 3's plain
# compiled run), LAYER_CUDAGRAPHS (1; 0 skips step 3's CUDA-graph run), TRAIN_COMPILE (1),
# THROUGHPUT_STEPS (300; 0 skips step 2), TIME_LIMIT_S (540), RUNS (/tmp/moe_runs), BEFORE_TRAINING (a
# command started in the background before step 4, e.g. another job sharing the GPU).
set -uo pipefail
: "${TRAIN_BIN:?set TRAIN_BIN}" "${VAL_BIN:?set VAL_BIN}" "${TOKENIZER_DIR:?set TOKENIZER_DIR}"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/out}
RUNS=${RUNS:-/tmp/moe_runs}
CONFIG=${CONFIG:-configs/tinystories-17m.toml}
TOKENS=${TOKENS:-40960000}
BATCH_SIZE=${BATCH_SIZE:-32}
CONTEXT=${CONTEXT:-256}
EXTRA=${EXTRA:-}
LAYER_ARGS=${LAYER_ARGS:-}
LAYER_COMPILE=${LAYER_COMPILE:-1}
LAYER_CUDAGRAPHS=${LAYER_CUDAGRAPHS:-1}
TRAIN_COMPILE=${TRAIN_COMPILE:-1}
THROUGHPUT_STEPS=${THROUGHPUT_STEPS:-300}
TIME_LIMIT_S=${TIME_LIMIT_S:-540}
START=$SECONDS
left() { echo $(( TIME_LIMIT_S - (SECONDS - START) )); }
rm -rf "$RUNS"
mkdir -p "$RUNS" "$OUT"
data=(--train-bin "$TRAIN_BIN" --val-bin "$VAL_BIN" --tokenizer-dir "$TOKENIZER_DIR" --runs "$RUNS"
      --config "$CONFIG" --batch-size "$BATCH_SIZE" --context-length "$CONTEXT" --extra="$EXTRA")
[ -n "${VARIANTS:-}" ] && data+=(--variants "$VARIANTS")

echo "== 1. layer, eager ($(left) s left)"
# shellcheck disable=SC2086
timeout 75 $PY benchmarks/moe.py layer --json "$RUNS/layer_eager.json" $LAYER_ARGS 2>&1 | tee "$RUNS/layer_eager.log"

if [ "$THROUGHPUT_STEPS" -gt 0 ]; then
  echo "== 2. isolated throughput, eager ($(left) s left)"
  timeout 100 $PY benchmarks/moe.py throughput "${data[@]}" --compile 0 --steps "$THROUGHPUT_STEPS" \
    --deadline-s 90 --min-run-s 8 2>&1 | tee "$RUNS/throughput.log"
fi

if [ "$LAYER_COMPILE" = 1 ]; then
  echo "== 3. layer, compiled ($(left) s left)"
  # shellcheck disable=SC2086
  timeout 80 $PY benchmarks/moe.py layer --compile --cases 0,1,3 --json "$RUNS/layer_compiled.json" $LAYER_ARGS \
    2>&1 | tee "$RUNS/layer_compiled.log"
fi
if [ "$LAYER_CUDAGRAPHS" = 1 ]; then
  echo "== 3. layer, compiled with CUDA graphs ($(left) s left)"
  # shellcheck disable=SC2086
  timeout 80 $PY benchmarks/moe.py layer --cudagraphs --cases 0,1,3 --json "$RUNS/layer_cudagraphs.json" \
    $LAYER_ARGS 2>&1 | tee "$RUNS/layer_cudagraphs.log"
fi

# What is left, less the evaluation after the budget, the report and a margin.
[ -n "${BEFORE_TRAINING:-}" ] && { bash -c "$BEFORE_TRAINING" & }
budget=$(( $(left) - 55 ))
echo "== 4. training, all variants at once, ${budget} s budget each ($(left) s left)"
if [ "$budget" -gt 20 ]; then
  timeout $(( budget + 40 )) $PY benchmarks/moe.py train "${data[@]}" --compile "$TRAIN_COMPILE" --tokens "$TOKENS" \
    --budget-s "$budget" --grace-s 30 2>&1 | tee "$RUNS/train.log"
  for log in "$RUNS"/train/*.log; do echo "-- $(basename "$log")"; grep -v '%|' "$log" | tail -n 3; done
else
  echo "no time left for training"
fi

echo "== 5. report ($(left) s left)"
$PY benchmarks/moe.py report "$RUNS" --out "$OUT"
tar czf "$OUT/moe_runs.tgz" --exclude=checkpoints -C "$RUNS" . 2>/dev/null || true
echo "done in $(( SECONDS - START )) s"
