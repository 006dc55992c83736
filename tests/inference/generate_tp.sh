#!/usr/bin/env bash
# `loom generate --tp N` prints what `loom generate` prints: a tiny model
# trained for a few steps, then greedy and seeded sampling, one prompt and a
# prompts file, on one rank and split over two tensor-parallel ranks; and
# a --tp the model's heads do not split over is refused, naming valid values.
# Usage: generate_tp.sh LOOM SOURCE_DIR
set -euo pipefail
loom=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

head -c 40000 "$src/data/tinyshakespeare.txt" > "$tmp/corpus.txt"
"$loom" train --config "$src/configs/tiny-test.toml" --set "data.dir=$tmp/data" --set "data.text=$tmp/corpus.txt" \
  --set "train.out_dir=$tmp/run" --set train.steps=150 --set train.checkpoint_interval=150 --set train.eval_interval=0 \
  --set train.sample_tokens=0 > "$tmp/train.log" 2>&1 || { cat "$tmp/train.log"; exit 1; }
printf '{"prompt": "ROMEO:", "temperature": 0}\n{"prompt": "KING", "max_tokens": 7, "seed": 5}\n' > "$tmp/prompts.jsonl"

for tp in 1 2; do
  "$loom" generate --checkpoint "$tmp/run" --prompt "KING RICHARD" --tokens 24 --temperature 0 --tp $tp > "$tmp/greedy.$tp"
  "$loom" generate --checkpoint "$tmp/run" --prompt "KING" --tokens 24 --temperature 0.9 --top-k 40 --seed 7 \
    --tp $tp > "$tmp/sampled.$tp"
  "$loom" generate --checkpoint "$tmp/run" --prompts "$tmp/prompts.jsonl" --tokens 16 --max-batch 2 --tp $tp \
    --out "$tmp/results.$tp"
done
for f in greedy sampled results; do
  a="$tmp/$f.1"; b="$tmp/$f.2"
  [ -s "$a" ] || { echo "$a is empty"; exit 1; }
  if ! cmp -s "$a" "$b"; then
    echo "--tp 2 printed other text than --tp 1 ($f):"
    diff "$a" "$b" || true
    exit 1
  fi
done
echo "greedy: $(cat "$tmp/greedy.1")"; echo "sampled: $(cat "$tmp/sampled.1")"

# tiny-test has 2 heads: --tp 3 does not split them.
if "$loom" generate --checkpoint "$tmp/run" --prompt "ROMEO:" --tokens 4 --tp 3 > "$tmp/tp3.log" 2>&1; then
  echo "--tp 3 was accepted for a model of 2 heads"
  exit 1
fi
grep -q -- "--tp 3 does not split this model.*valid values for this model: 1, 2" "$tmp/tp3.log" || {
  echo "unexpected error for --tp 3:"
  cat "$tmp/tp3.log"
  exit 1
}
echo "ok"
