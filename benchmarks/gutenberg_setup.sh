# Sourced by the H200 training benchmarks (training_h200.sh, training_seeds_h200.sh): the
# environment, the output folder $OUT, and the Gutenberg books under $W encoded with the carried
# tokenizer in $C (benchmarks/prepare_gutenberg.sh; skipped when already encoded).
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=/tmp/gutenberg
C=.carry/gutenberg
mkdir -p "$W" "$OUT"
if [ ! -s "$W/train_00.bin" ] || [ ! -s "$W/valid.bin" ]; then
  W="$W" bash benchmarks/prepare_gutenberg.sh
fi
