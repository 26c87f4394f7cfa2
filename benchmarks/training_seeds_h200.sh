#!/usr/bin/env bash
# Seed study of the training benchmark of docs/benchmarks/training.md, on one H200: for each seed
# of SEEDS (default "0 1 2") scratchlm's trainer (--trainer.seed=S) and the torch.nn reference
# (--seed S) train the 17M shape on the Gutenberg books, 5000 steps x 32 x 256 tokens, side by side
# on the same GPU (only their validation losses are compared, not their speed).
# Inputs as for training_h200.sh (.carry/gutenberg). SCRATCHLM_OVERRIDES: extra `scratchlm train`
# overrides (default: math attention with CUDA graphs). Writes $OUT/seeds.json and the logs.
set -euo pipefail
source benchmarks/gutenberg_setup.sh
read -r -a tuned <<< "${SCRATCHLM_OVERRIDES---model.attention_backend=math --trainer.compile_mode=reduce-overhead}"
for s in ${SEEDS:-0 1 2}; do
  timeout 240 python3 -m scratchlm train configs/tinystories-17m.toml --data.train_path="$W/train_00.bin" \
    --data.val_path="$W/valid.bin" --data.tokenizer_dir="$C/tokenizer" --trainer.compile=true \
    --trainer.checkpoint_interval=0 --trainer.sample_tokens=0 --trainer.progress=false "${tuned[@]}" \
    --trainer.seed="$s" --trainer.out_dir="$W/runs/scratchlm_s$s" > "$W/scratchlm_s$s.log" 2>&1 \
    || echo "scratchlm seed $s failed" &
  timeout 240 python3 benchmarks/reference_trainer.py --train-bin "$W/train_00.bin" --val-bin "$W/valid.bin" \
    --out "$W/runs/reference_s$s" --compile --warmup 200 --log-interval 50 --seed "$s" \
    > "$W/reference_s$s.log" 2>&1 || echo "reference seed $s failed" &
  wait
done
python3 - "$W/runs" "$OUT/seeds.json" <<'PY'
import json, re, statistics, sys
from pathlib import Path

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
final = {}
for run in sorted(runs.iterdir()):
    if not re.search(r"_s\d+$", run.name):  # other benchmarks' runs share the folder
        continue
    evals = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in l]
    final[run.name] = {e["step"]: e["val_loss"] for e in evals if e.get("event") == "eval"}
seeds = sorted({name.split("_s")[-1] for name in final})
last = lambda name: final[name][max(final[name])] if final.get(name) else None  # noqa: E731
pairs = {s: (last(f"scratchlm_s{s}"), last(f"reference_s{s}")) for s in seeds}
for s, (a, b) in pairs.items():
    print(f"seed {s}: scratchlm {a}  reference {b}" + (f"  delta {a - b:+.4f}" if a and b else ""))
both = [(a, b) for a, b in pairs.values() if a and b]
if both:
    print(f"mean: scratchlm {statistics.mean(a for a, _ in both):.4f}  reference "
          f"{statistics.mean(b for _, b in both):.4f}  delta {statistics.mean(a - b for a, b in both):+.4f}")
out.write_text(json.dumps({"val_loss_by_step": final}, indent=2))
PY
tar czf "$OUT/runs.tgz" --exclude=checkpoints -C "$W" runs $(cd "$W" && ls *.log)
