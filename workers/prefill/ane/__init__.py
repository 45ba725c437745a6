"""Prefill on the Neural Engine: the transformer body's prefill as a converted
program (Core ML for macOS 15/26, Core AI for macOS 27), its KV bridged back
to MLX so the prefix cache, the handoff and decode need no change.

`contract.py`: what one converted chunk takes and returns (every builder and
runner keeps to it); `weights.py`: an mlx-lm model's weights and rope in that
program's layout; the builders and the NumPy reference build or compute it.
"""
