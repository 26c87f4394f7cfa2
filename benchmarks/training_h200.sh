#!/usr/bin/env bash
# The training benchmark of docs/benchmarks/training.md, as run on one H200:
#   scratchlm's trainer vs the torch.nn reference (benchmarks/reference_trainer.py) on the
#   Gutenberg books, 17M shape, 5000 steps x 32 x 256 = 40.96M tokens, then the four ablations.
# Inputs (carried in the ignored folder .carry/gutenberg): train_00.txt.xz, valid.txt.xz and the
# 10K BPE tokenizer trained on train_00 with `scratchlm train-bpe`. Results go to $OUT.
# SCRATCHLM_OVERRIDES: extra `scratchlm train` overrides of the timed run (default: the fused
# attention kernel and CUDA graphs); ABLATIONS=0 skips the four ablation runs.
set -euo pipefail
source benchmarks/gutenberg_setup.sh
common=(--data.train_path="$W/train_00.bin" --data.val_path="$W/valid.bin" --data.tokenizer_dir="$C/tokenizer"
        --trainer.compile=true --trainer.checkpoint_interval=0 --trainer.sample_tokens=128)
read -r -a tuned <<< "${SCRATCHLM_OVERRIDES---model.attention_backend=flash_triton --trainer.compile_mode=reduce-overhead}"
common+=("${tuned[@]}")
timeout 200 python3 -m scratchlm train configs/tinystories-17m.toml "${common[@]}" --trainer.out_dir="$W/runs/scratchlm" \
  > "$W/scratchlm.log" 2>&1 || echo "scratchlm run failed"
grep -v '%|' "$W/scratchlm.log" | tail -n 12 || true
timeout 200 python3 benchmarks/reference_trainer.py --train-bin "$W/train_00.bin" --val-bin "$W/valid.bin" \
  --out "$W/runs/reference" --compile --warmup 200 --log-interval 50 > "$W/reference.log" 2>&1 || echo "reference run failed"
tail -n 4 "$W/reference.log"
if [ "${ABLATIONS:-1}" = 0 ]; then
  python3 benchmarks/training_report.py "$W/runs" --out "$OUT"
  tar czf "$OUT/runs.tgz" --exclude=checkpoints -C "$W" runs $(cd "$W" && ls *.log)
  exit 0
fi
# Ablations share the GPU (val loss is what they report; their tokens/s are not comparable).
declare -A ablations=(
  [post_norm]="--model.norm_position=post"
  [nope]="--model.use_rope=false"
  [no_rmsnorm]="--model.use_rmsnorm=false"
  [silu_ffn]="--model.ffn=silu --model.d_ff=2016"
)
for name in "${!ablations[@]}"; do
  # shellcheck disable=SC2086
  timeout 330 python3 -m scratchlm train configs/tinystories-17m.toml "${common[@]}" --trainer.sample_tokens=0 \
    --trainer.out_dir="$W/runs/$name" ${ablations[$name]} > "$W/$name.log" 2>&1 &
done
wait || true
for name in "${!ablations[@]}"; do echo "== $name"; grep -v '%|' "$W/$name.log" | tail -n 2; done
python3 benchmarks/training_report.py "$W/runs" --out "$OUT"
tar czf "$OUT/runs.tgz" --exclude=checkpoints -C "$W" runs $(cd "$W" && ls *.log)
