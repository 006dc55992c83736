#!/usr/bin/env bash
# The main job: installs dependencies, builds loom, trains the default model
# on the embedded tinyshakespeare corpus and prints a generated sample.
# Extra arguments go to `loom train` (e.g. --set train.steps=200; to run again
# into runs/shakespeare, --resume continues that run and --overwrite replaces it).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_BUILD_TESTS=OFF -DLOOM_BUILD_BENCH=OFF >/dev/null
cmake --build build -j "$(nproc)" --target loom_cli
./build/loom train --config configs/shakespeare.toml "$@"
