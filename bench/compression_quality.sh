#!/bin/sh
# The quality half of the compression benchmark: what each compression costs
# in validation perplexity, on one model trained here (or given by
# --teacher), every figure measured in this run by the built `loom` binary.
#
#   bench/compression_quality.sh              # the issue's figures
#   bench/compression_quality.sh --quick      # a smoke run: about a minute idle
#   bench/compression_quality.sh --teacher DIR --data DIR   # reuse a model
#
# Every validation loss is `loom eval` over the whole val.bin of the
# teacher's data (the same windows for every model); calibration (Wanda,
# W8A8) reads train.bin, never the split it is judged on. Each loom command
# and its output go to WORK/logs; the command lines are printed as they run.
set -eu

repo=$(cd "$(dirname "$0")/.." && pwd)
loom=$repo/build/loom
work=/tmp/loom-compression-quality
text=$repo/data/tinyshakespeare.txt
text_bytes=0
teacher=""
data=""
layers=4 heads=4 embd=256 block=128 batch=32 micro=16
steps=500 ft_steps=200 student_steps="" timing_steps=8 calib_batches=16 parallel=0

# The quantization methods: name | `loom quantize` arguments | the issue's
# target for the perplexity change, in percent. A method the binary does not
# know is reported as not available.
quant_methods='int8|--method int8|0.5
int4-g128|--method int4 --group 128|5
w8a8|--method w8a8 --data @TRAIN@|2'

usage() {
  cat <<EOF
usage: $0 [options]
  --quick               tiny model and step counts: a smoke run (about a minute on idle cores)
  --loom PATH           the loom binary ($loom)
  --work DIR            work directory ($work); refused if it exists and is not this bench's
  --teacher DIR         use this trained checkpoint (a run or step directory) instead of training one
  --data DIR            the prepared data directory of --teacher (holds train.bin, val.bin)
  --text FILE           text to train on ($text)
  --text-bytes N        train on the first N bytes of --text only (whole lines; 0 = all)
  --layers N --heads N --embd N --block N    model shape (4, 4, 256, 128: configs/shakespeare.toml)
  --batch N --micro N   sequences per step and per micro-batch (32, 16)
  --steps N             teacher and student training steps ($steps)
  --ft-steps N          sparse fine-tuning steps after pruning ($ft_steps)
  --student-steps N     student training steps (default: --steps)
  --timing-steps N      steps per step-time run, two runs per model ($timing_steps)
  --calib-batches N     calibration batches of 8 from train.bin for Wanda and W8A8 ($calib_batches)
  --parallel            run the students' and fine-tunings' trainings at once (after the timing)
EOF
}

while [ $# -gt 0 ]; do
  case $1 in
    --quick) layers=2 heads=2 embd=128 block=64 batch=8 micro=8 steps=10 ft_steps=4 timing_steps=4
             calib_batches=2 text_bytes=100000 ;;
    --loom | --work | --teacher | --data | --text | --text-bytes | --layers | --heads | --embd | --block | --batch | \
      --micro | --steps | --ft-steps | --student-steps | --timing-steps | --calib-batches)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }
      # Each sets the variable of its name (--ft-steps: ft_steps).
      eval "$(echo "${1#--}" | tr - _)=\$2"
      shift ;;
    --parallel) parallel=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ -n "$student_steps" ] || student_steps=$steps
[ -x "$loom" ] || { echo "error: no loom binary at '$loom': build it (cmake --build build --target loom_cli) or pass --loom" >&2; exit 2; }
if [ -n "$teacher" ] && [ -z "$data" ]; then
  echo "error: --teacher needs --data, the data directory it was trained on (its val.bin is the held-out split)" >&2
  exit 2
fi
[ $((layers / 2)) -ge 1 ] || { echo "error: --layers $layers: the student has half the layers, so at least 2" >&2; exit 2; }

# The work directory is this bench's own (a marker file says so) or new.
marker=.loom-compression-quality
if [ -e "$work" ] && [ ! -e "$work/$marker" ]; then
  echo "error: --work '$work' exists and is not this bench's work directory; choose another (or remove it)" >&2
  exit 2
fi
mkdir -p "$work"
: >"$work/$marker"
# Every output but the trained models goes; a model stays for the next run
# when the same command, from the same teacher, would train it again.
for d in logs quant prune channels timing; do rm -rf "${work:?}/$d"; done
mkdir -p "$work/logs" "$work/quant" "$work/prune" "$work/finetune" "$work/student" "$work/channels" "$work/timing"

# Runs loom with its output in logs/NAME.log; prints the command line.
# (Helpers' variables start with _: sh has no locals.)
run() {
  _log=$work/logs/$1.log
  shift
  echo "+ loom $*" >&2
  "$loom" "$@" >"$_log" 2>&1
}
fail() {
  echo "error: '$1' failed; its output ($work/logs/$1.log) ends:" >&2
  tail -n 5 "$work/logs/$1.log" >&2
  exit 1
}
# Trains NAME into OUT with the given --set keys, unless OUT holds what the
# same command trained before from the same inputs (INPUTS: checksums of the
# text or data, and of the teacher).
train_run() {
  _name=$1 _out=$2 _inputs=$3
  shift 3
  _cmd="train --config $repo/configs/shakespeare.toml --set $* train.out_dir=$_out"
  if [ -e "$_out/latest" ] && [ "$(cat "$_out.stamp" 2>/dev/null)" = "$_cmd $_inputs" ]; then
    echo "= $_out: trained by this command in an earlier run, reused" >&2
    return
  fi
  rm -rf "$_out" "$_out.stamp"
  # shellcheck disable=SC2086
  run "$_name" $_cmd || fail "$_name"
  echo "$_cmd $_inputs" >"$_out.stamp"
}

warmup() { _w=$(($1 / 10)); [ "$_w" -ge 1 ] || _w=1; echo "$_w"; }
# The keys every training run sets: the shape (which init.from checkpoints
# repeat), the data, and no periodic validation, checkpoints or sample.
common_keys() {
  echo "model.n_layer=$1 model.n_head=$heads model.n_embd=$embd model.block_size=$block train.seq_len=$block" \
    "train.batch_size=$batch train.micro_batch_size=$micro data.dir=$data data.text=$train_text" \
    "train.eval_interval=0 train.checkpoint_interval=0 train.sample_tokens=0"
}

if [ -z "$teacher" ]; then
  train_text=$text
  if [ "$text_bytes" -gt 0 ]; then
    # Whole lines, so that no UTF-8 character is cut.
    head -c "$text_bytes" "$text" | sed '$d' >"$work/text.txt"
    train_text=$work/text.txt
  fi
  data=$work/data
  teacher=$work/teacher
  text_sum="text $(cksum <"$train_text")"
  # Data prepared from another text is refused: prepared again.
  [ "$(cat "$data.stamp" 2>/dev/null)" = "$text_sum" ] || rm -rf "$data"
  echo "$text_sum" >"$data.stamp"
  # shellcheck disable=SC2046
  train_run teacher "$teacher" "$text_sum" $(common_keys "$layers") train.steps="$steps" \
    train.warmup_steps="$(warmup "$steps")"
else
  train_text=""  # a prepared data.dir with an empty data.text is taken as it is
fi
val=$data/val.bin
train_bin=$data/train.bin
for f in "$val" "$train_bin"; do
  [ -f "$f" ] || { echo "error: '$f' not found: --data must be a prepared data directory" >&2; exit 2; }
done

# Sets loss and loss_tokens to what `loom eval` of checkpoint $2 prints
# ("loss L nats/token ... over N tokens").
eval_loss() {
  run "eval-$1" eval --checkpoint "$2" --data "$val" || fail "eval-$1"
  loss=$(sed -n 's/^loss \([0-9.eE+-]*\) nats\/token.*/\1/p' "$work/logs/eval-$1.log")
  loss_tokens=$(sed -n 's/.* over \([0-9]*\) tokens$/\1/p' "$work/logs/eval-$1.log")
  [ -n "$loss" ] || fail "eval-$1"
}
# A checkpoint's manifest (a step directory, or a run directory's latest).
manifest() {
  if [ -f "$1/manifest.json" ]; then echo "$1/manifest.json"; else echo "$1/$(cat "$1/latest")/manifest.json"; fi
}
# fp32 bytes of a checkpoint's parameters (its manifest's count).
fp32_bytes() { echo $(($(grep -o '"numel": *[0-9]*' "$(manifest "$1")" | head -n 1 | sed 's/.*: *//') * 4)); }

eval_loss teacher "$teacher"
base=$loss
fp32=$(fp32_bytes "$teacher")
# What the models trained here depend on besides their command.
data_sum="data $(cksum <"$data/dataset.json")"
teacher_sum="teacher $(cksum <"$(manifest "$teacher")") $data_sum"

echo
echo "compression quality: $layers layers, width $embd, $steps steps; val loss over $loss_tokens tokens of $val"
echo "('loss base' is the model each change is measured against: the trained fp32 model, but for the"
echo " distilled student the student trained without a teacher; logs in $work/logs)"
printf "%-30s %12s %6s %9s %9s %10s  %-20s %s\n" method bytes ratio "loss base" loss "ppl chg" target result
# One table row: NAME BYTES BEFORE AFTER TARGET RESULT ("-" where the issue
# sets no target); the ratio to fp32 and the perplexity change computed here.
row() {
  awk -v n="$1" -v b="$2" -v f="$fp32" -v l0="$3" -v l1="$4" -v t="$5" -v r="$6" 'BEGIN {
    printf "%-30s %12s %6.3f %9.5f %9.5f %+9.3f%%  %-20s %s\n", n, b, b / f, l0, l1, 100 * (exp(l1 - l0) - 1), t, r }'
}
ppl_change() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%+.3f", 100 * (exp(b - a) - 1) }'; }
# PASS when the perplexity change is at most TARGET percent.
within() { awk -v c="$1" -v t="$2" 'BEGIN { print (c <= t ? "PASS" : "MISS") }'; }
below() { awk -v a="$1" -v b="$2" 'BEGIN { print (a < b ? "PASS" : "MISS") }'; }

row "fp32 (trained)" "$fp32" "$base" "$base" - -

# Quantization (a subshell per method: the pipe).
echo "$quant_methods" | while IFS='|' read -r name args target; do
  # shellcheck disable=SC2046
  if ! run "quant-$name" quantize --checkpoint "$teacher" $(echo "$args" | sed "s|@TRAIN@|$train_bin|g") \
    --out "$work/quant/$name"; then
    if grep -q "not known\|were not expected" "$work/logs/quant-$name.log"; then
      echo "$name: not available in this loom ($(grep error "$work/logs/quant-$name.log" | head -n 1))"
      continue
    fi
    fail "quant-$name"
  fi
  bytes=$(sed -n 's/.*weights \([0-9]*\) bytes.*/\1/p' "$work/logs/quant-$name.log")
  eval_loss "quant-$name" "$work/quant/$name"
  row "$name" "$bytes" "$base" "$loss" "<= +$target%" "$(within "$(ppl_change "$base" "$loss")" "$target")"
done

# Unstructured pruning at 50%, no fine-tuning. The zeros are stored densely:
# the size is fp32's (half the weights of the blocks' matrices are zero).
for method in magnitude wanda; do
  calibration=""
  [ "$method" = magnitude ] || calibration="--data $train_bin --batches $calib_batches"
  # shellcheck disable=SC2086
  run "prune-$method" prune --checkpoint "$teacher" --method "$method" --sparsity 0.5 $calibration \
    --out "$work/prune/$method" || fail "prune-$method"
  eval_loss "prune-$method" "$work/prune/$method"
  case $method in magnitude) pruned_magnitude=$loss ;; wanda) pruned_wanda=$loss ;; esac
done
row "magnitude 50%" "$fp32" "$base" "$pruned_magnitude" - -
row "wanda 50%" "$fp32" "$base" "$pruned_wanda" "< magnitude's $(ppl_change "$base" "$pruned_magnitude")%" \
  "$(below "$pruned_wanda" "$pruned_magnitude")"

# Structured pruning: half the MLP channels, a smaller dense model.
run prune-channels prune --checkpoint "$teacher" --method channels --sparsity 0.5 --out "$work/channels/model" ||
  fail prune-channels
width=$(sed -n 's/.*MLP channels [0-9]* -> \([0-9]*\) per layer.*/\1/p' "$work/logs/prune-channels.log")
eval_loss prune-channels "$work/channels/model"
row "MLP channels 50%" "$(fp32_bytes "$work/channels/model")" "$base" "$loss" - -

# Its training step time against the unpruned model's: both trained from
# their checkpoint in the same layout, alternately, twice; the median over
# all steps after each run's first two (warm-up).
step_times=$work/timing/step_times.txt
: >"$step_times"
for round in 1 2; do
  for model in dense channels; do
    from=$teacher shape=""
    [ "$model" = dense ] || from=$work/channels/model shape="model.intermediate_size=$width"
    out=$work/timing/$model-$round
    # shellcheck disable=SC2046,SC2086
    run "timing-$model-$round" train --config "$repo/configs/shakespeare.toml" --set $(common_keys "$layers") \
      $shape init.from="$from" train.out_dir="$out" train.steps="$timing_steps" train.log_interval=1 \
      train.warmup_steps=1 train.lr=2e-4 train.min_lr=2e-5 || fail "timing-$model-$round"
    # Seconds per step: the step's tokens over its tokens_per_s.
    sed -n 's/.*"step":\([0-9]*\),.*"tokens_per_s":\([0-9.eE+-]*\).*/\1 \2/p' "$out/metrics.jsonl" |
      awk -v m="$model" -v tok=$((batch * block)) '$1 > 2 { print m, tok / $2 }' >>"$step_times"
  done
done
median() {
  grep "^$1 " "$step_times" | awk '{ print $2 }' | sort -g |
    awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'
}
awk -v d="$(median dense)" -v c="$(median channels)" -v n="$(grep -c '^dense ' "$step_times")" -v w="$width" 'BEGIN {
  printf "training step time, MLP channels 50%% (%d wide): %.4f s vs %.4f s unpruned = %.3f (median of %d steps each)\n",
         w, c, d, c / d, n }'

# The trainings left need nothing from each other: with --parallel they run
# at once (the timing above is done; the losses do not depend on it).
pids=""
train_job() {
  if [ "$parallel" = 1 ]; then
    train_run "$@" &
    pids="$pids $!"
  else
    train_run "$@"
  fi
}
# Distillation: a student of half the layers, with and without the teacher.
student_layers=$((layers / 2))
# shellcheck disable=SC2046
train_job student-plain "$work/student/plain" "$data_sum" $(common_keys "$student_layers") \
  train.steps="$student_steps" train.warmup_steps="$(warmup "$student_steps")"
# shellcheck disable=SC2046
train_job student-distilled "$work/student/distilled" "$teacher_sum" $(common_keys "$student_layers") \
  train.steps="$student_steps" train.warmup_steps="$(warmup "$student_steps")" distill.teacher="$teacher"
# Sparse fine-tuning from the pruned models (their zeros kept).
for method in magnitude wanda; do
  # shellcheck disable=SC2046
  train_job "finetune-$method" "$work/finetune/$method" "$teacher_sum" $(common_keys "$layers") \
    init.from="$work/prune/$method" train.steps="$ft_steps" train.warmup_steps="$(warmup "$ft_steps")" \
    train.lr=2e-4 train.min_lr=2e-5
done
for pid in $pids; do wait "$pid" || exit 1; done  # a failed one said which

eval_loss student-plain "$work/student/plain"
student_plain=$loss
eval_loss student-distilled "$work/student/distilled"
student_bytes=$(fp32_bytes "$work/student/plain")
row "student ${student_layers}L, no teacher" "$student_bytes" "$base" "$student_plain" - -
row "student ${student_layers}L, distilled" "$student_bytes" "$student_plain" "$loss" \
  "< no teacher's loss" "$(below "$loss" "$student_plain")"
for method in magnitude wanda; do
  eval_loss "finetune-$method" "$work/finetune/$method"
  row "$method 50% + $ft_steps steps ft" "$fp32" "$base" "$loss" - -
done
