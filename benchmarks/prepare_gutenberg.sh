#!/usr/bin/env bash
# Decompress the carried Gutenberg books (.carry/gutenberg/{train_00,valid}.txt.xz) to $W and
# encode them with the carried 10K tokenizer into $W/{train_00,valid}.bin (all cores).
# Used by the H200 scripts; W defaults to /tmp/gutenberg.
set -euo pipefail
export PYTHONPATH="$PWD/src"
W=${W:-/tmp/gutenberg}
mkdir -p "$W"
W="$W" python3 - <<'PY'
import lzma, os, shutil
for name in ("train_00", "valid"):
    with lzma.open(f".carry/gutenberg/{name}.txt.xz") as src, open(f"{os.environ['W']}/{name}.txt", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
PY
for name in train_00 valid; do
  python3 -m scratchlm encode "$W/$name.txt" --tokenizer .carry/gutenberg/tokenizer --out "$W/$name.bin" \
    --workers "$(nproc)" --no-progress
done
