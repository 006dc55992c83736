#!/usr/bin/env bash
# Kill/restart loop: a two-rank run under `loom train --max-restarts` has a
# process killed with SIGKILL CYCLES times at random moments (in a step, in a
# checkpoint write, in the optimizer); the supervisor restarts it
# from its newest checkpoint each time. The finished run must have lost no
# step and end bit-identical to an uninterrupted run: the same loss at every
# step (the last record of each: steps after a checkpoint run again) and the
# same bytes in its final checkpoint's tensor files.
#
#   tests/train/kill_loop.sh [CYCLES] [LOOM] [BACKEND]   (defaults: 50, build/loom, local)
#
# BACKEND local: the two ranks are threads of the process the supervisor
# starts, and that process is killed. BACKEND mpi: the supervisor starts
# mpirun with two rank processes (LOOM_MPIRUN) and a random one of them is
# killed; mpirun then ends the other. The uninterrupted run is the local
# backend's either way (the same sums of two gradients).
#
# CI runs short versions (ctest train_kill_loop and train_kill_loop_mpi, 3
# cycles each).
set -euo pipefail
cycles=${1:-50}
loom=${2:-build/loom}
backend=${3:-local}
case "$backend" in
  local) backend_sets=() ;;
  mpi)
    backend_sets=(--set parallel.backend=mpi)
    # As ctest's MPI tests run (tests/CMakeLists.txt): as root in CI, without
    # cross-process memory copies.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
    export LOOM_MPIRUN="${LOOM_MPIRUN:-mpirun --oversubscribe}"
    ;;
  *) echo "kill loop: BACKEND is local or mpi, not '$backend'"; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Kill i waits for step 20 i; 20 more steps follow the last.
steps=$((20 * cycles + 20))
corpus="$work/corpus.txt"
head -c 200000 "$root/../shared/data/tinyshakespeare.txt" > "$corpus"
common=(--config "$root/configs/tiny-test.toml"
        --set "data.text=$corpus" --set "data.dir=$work/data" --set parallel.dp=2
        --set "train.steps=$steps" --set train.checkpoint_interval=2 --set train.keep_last=2
        --set train.eval_interval=0 --set train.sample_tokens=0)

"$loom" train "${common[@]}" --set "train.out_dir=$work/whole" > "$work/whole.log" 2>&1

"$loom" train "${common[@]}" "${backend_sets[@]}" --set "train.out_dir=$work/killed" --max-restarts "$cycles" \
  > "$work/killed.log" 2>&1 &
supervisor=$!
# Records in the killed run's metrics.jsonl holding "$1" (0 before it exists).
count() { local n; n=$(grep -c "\"$1\"" "$work/killed/metrics.jsonl" 2>/dev/null); echo "${n:-0}"; }
# The newest step the run has logged (0 before its first).
logged_step() {
  local line
  line=$(grep '"loss"' "$work/killed/metrics.jsonl" 2>/dev/null | tail -1)
  [[ -n "$line" ]] && sed -E 's/.*"step":([0-9]+).*/\1/' <<< "$line" || echo 0
}
# Kill i lands at a random moment 10 to 40 ms after step 20 i is logged
# (within a step, a checkpoint write or the optimizer), so every kill lands
# however fast or slow the machine runs the steps.
killed=0
while ((killed < cycles)) && kill -0 "$supervisor" 2>/dev/null; do
  until (($(logged_step) >= 20 * (killed + 1))) || ! kill -0 "$supervisor" 2>/dev/null; do sleep 0.002; done
  sleep "0.0$((RANDOM % 30 + 10))"
  child=$(cat "/proc/$supervisor/task/$supervisor/children" 2>/dev/null | awk '{print $1}' || true)
  # Under mpirun: a random one of its rank processes.
  if [[ "$backend" == mpi && -n "$child" ]]; then
    child=$(cat "/proc/$child/task/$child/children" 2>/dev/null | tr ' ' '\n' | grep . | shuf -n 1 || true)
  fi
  if [[ -n "$child" ]] && kill -KILL "$child" 2>/dev/null; then
    killed=$((killed + 1))
    # Time to the supervisor's restart record (the run's ranks all gone) and
    # to the first step the restarted run logs.
    t0=$(date +%s.%N)
    records=$(count loss)
    until (($(count restart) >= killed)) || ! kill -0 "$supervisor" 2>/dev/null; do sleep 0.002; done
    t1=$(date +%s.%N)
    until (($(count loss) > records)) || ! kill -0 "$supervisor" 2>/dev/null; do sleep 0.002; done
    t2=$(date +%s.%N)
    echo "$t0 $t1 $t2" >> "$work/times.txt"
  fi
done
status=0
wait "$supervisor" || status=$?
if ((status != 0)); then
  echo "kill loop: the supervised run exited $status after $killed kills"; tail -20 "$work/killed.log"; exit 1
fi
if ((killed < cycles)); then echo "kill loop: the run finished after only $killed of $cycles kills"; exit 1; fi

# step -> loss, the last record of each step.
losses() {
  grep '"loss"' "$1" | sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/;t;s/.*"step":([0-9]+).*"loss":([^,}]*).*/\1 \2/' |
    awk '{last[$1] = $2} END {for (s in last) print s, last[s]}' | sort -n
}
if ! diff <(losses "$work/whole/metrics.jsonl") <(losses "$work/killed/metrics.jsonl") > "$work/diff.txt"; then
  echo "kill loop: losses differ from the uninterrupted run after $killed kills:"; head -20 "$work/diff.txt"; exit 1
fi
logged=$(losses "$work/killed/metrics.jsonl" | wc -l)
if ((logged != steps)); then echo "kill loop: $logged steps logged, expected $steps"; exit 1; fi
final=$(printf "step_%08d" "$steps")
for f in "$work/whole/$final"/*.safetensors; do
  if ! cmp -s "$f" "$work/killed/$final/$(basename "$f")"; then
    echo "kill loop: $(basename "$f") of the final checkpoint differs from the uninterrupted run's"; exit 1
  fi
done
restarts=$(grep -c '"restart"' "$work/killed/metrics.jsonl" || true)
echo "kill loop ($backend): $killed kills, $restarts restarts, $steps steps, losses and final weights bit-identical"
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
echo "kill loop: median from the kill to the restart recorded $(awk '{printf "%.3f\n", $2 - $1}' "$work/times.txt" | median) s," \
  "to the restarted run's first step $(awk '{printf "%.3f\n", $3 - $1}' "$work/times.txt" | median) s"
