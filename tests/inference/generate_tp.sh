#!/usr/bin/env bash
# `loom generate --tp N --pp M` prints what `loom generate` prints: a tiny
# model trained for a few steps, then greedy and seeded sampling, one prompt
# and a prompts file, on one rank and split over 2 tensor-parallel ranks, 2
# pipeline stages and both; and a --tp the model's heads do not split over,
# or a --pp beyond its layers, is refused, naming valid values.
# Usage: generate_tp.sh LOOM SOURCE_DIR
set -euo pipefail
loom=$1
src=$2
tmp=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT

head -c 40000 "$src/data/tinyshakespeare.txt" > "$tmp/corpus.txt"
"$loom" train --config "$src/configs/tiny-test.toml" --set "data.dir=$tmp/data" --set "data.text=$tmp/corpus.txt" \
  --set "train.out_dir=$tmp/run" --set train.steps=150 --set train.checkpoint_interval=150 --set train.eval_interval=0 \
  --set train.sample_tokens=0 > "$tmp/train.log" 2>&1 || { cat "$tmp/train.log"; exit 1; }
printf '{"prompt": "ROMEO:", "temperature": 0}\n{"prompt": "KING", "max_tokens": 7, "seed": 5}\n' > "$tmp/prompts.jsonl"

layouts=("--tp 1" "--tp 2" "--pp 2" "--tp 2 --pp 2")
for i in "${!layouts[@]}"; do
  split=${layouts[$i]}
  # shellcheck disable=SC2086
  {
    "$loom" generate --checkpoint "$tmp/run" --prompt "KING RICHARD" --tokens 24 --temperature 0 $split \
      > "$tmp/greedy.$i"
    "$loom" generate --checkpoint "$tmp/run" --prompt "KING" --tokens 24 --temperature 0.9 --top-k 40 --seed 7 \
      $split > "$tmp/sampled.$i"
    "$loom" generate --checkpoint "$tmp/run" --prompts "$tmp/prompts.jsonl" --tokens 16 --max-batch 2 $split \
      --out "$tmp/results.$i"
  }
  for f in greedy sampled results; do
    [ -s "$tmp/$f.0" ] || { echo "$tmp/$f.0 is empty"; exit 1; }
    if ! cmp -s "$tmp/$f.0" "$tmp/$f.$i"; then
      echo "$split printed other text than one rank ($f):"
      diff "$tmp/$f.0" "$tmp/$f.$i" || true
      exit 1
    fi
  done
done
echo "greedy: $(cat "$tmp/greedy.0")"; echo "sampled: $(cat "$tmp/sampled.0")"

# `loom generate ARGS` fails with an error matching PATTERN.
refused() {
  local args=$1 pattern=$2
  # shellcheck disable=SC2086
  if "$loom" generate --checkpoint "$tmp/run" --prompt "ROMEO:" --tokens 4 $args > "$tmp/refused.log" 2>&1; then
    echo "$args was accepted"
    exit 1
  fi
  grep -q -- "$pattern" "$tmp/refused.log" || {
    echo "unexpected error for $args:"
    cat "$tmp/refused.log"
    exit 1
  }
}
# tiny-test has 2 heads and 2 layers.
refused "--tp 3" "--tp 3 does not split this model.*valid values for this model: 1, 2"
refused "--pp 3" "--pp 3 does not split this model.*valid values for this model: 1 to 2"
echo "ok"
