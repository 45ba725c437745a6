#!/usr/bin/env bash
# Create a separate Python environment with vllm-mlx 0.6.0, the peer that
# `tandem bench --systems ...,vllm-mlx` starts.
#
# Why separate: vllm-mlx 0.6.0 pins mlx-lm < 0.32 and pulls in torchvision,
# so it cannot live in Tandem's environment (mlx-lm 0.32).
#
#   bash benchmarks/bench/peers/setup_vllm_mlx.sh            # creates the default venv
#   VLLM_MLX_VENV=/some/dir bash benchmarks/bench/peers/setup_vllm_mlx.sh
#
# The venv goes to ${VLLM_MLX_VENV:-<tandem cache>/peers/vllm-mlx}, where
# <tandem cache> is $TANDEM_CACHE_DIR, else ~/Library/Caches/tandem (macOS) or
# ${XDG_CACHE_HOME:-~/.cache}/tandem. `tandem bench` looks for
# <venv>/bin/vllm-mlx there (or takes --vllm-mlx-bin).
# Re-running it is safe: pip skips what is already installed.
set -euo pipefail

PYTHON=${PYTHON:-python3}
if [[ -n "${TANDEM_CACHE_DIR:-}" ]]; then
  cache=$TANDEM_CACHE_DIR
elif [[ "$(uname -s)" == Darwin ]]; then
  cache=$HOME/Library/Caches/tandem
else
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/tandem
fi
venv=${VLLM_MLX_VENV:-$cache/peers/vllm-mlx}

echo "vllm-mlx environment: $venv (python: $($PYTHON --version 2>&1))"
[[ -x "$venv/bin/python" ]] || "$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
"${pip[@]}" --upgrade pip

case "$(uname -s)-$(uname -m)" in
  Darwin-*)
    "${pip[@]}" torch torchvision
    mlx_pkg="mlx"
    ;;
  Linux-x86_64)
    # The release pair that pip on Python 3.11 finds in the machine's local
    # wheel cache (a newer torch would be a multi-GB download).
    "${pip[@]}" torch==2.14.1 torchvision==0.29.1
    mlx_pkg="mlx[cpu]"   # on Linux plain `mlx` has no backend
    ;;
  Linux-aarch64)
    "${pip[@]}" torch==2.9.1 torchvision==0.24.1
    mlx_pkg="mlx[cpu]"
    ;;
  *)
    echo "unsupported platform $(uname -s)-$(uname -m)" >&2
    exit 1
    ;;
esac

# Keep the torch we just chose: name it again so the resolver cannot swap it.
torch_pin=$("$venv/bin/python" -c 'import torch, torchvision; print(f"torch=={torch.__version__.split(chr(43))[0]} torchvision=={torchvision.__version__.split(chr(43))[0]}")')
# shellcheck disable=SC2086
"${pip[@]}" "vllm-mlx==0.6.0" "mlx-lm>=0.31.3,<0.32" "$mlx_pkg" $torch_pin

"$venv/bin/python" -c 'import vllm_mlx, mlx_lm, mlx.core as mx; print("vllm-mlx ready:", mlx_lm.__version__, mx.__version__)'
echo "executable: $venv/bin/vllm-mlx"
