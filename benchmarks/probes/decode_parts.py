"""Where a one-row decode step's time goes on MLX's CPU backend.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/probes/decode_parts.py [--model M] [--context 150]

On the embedded model (float32, Tandem's CPU hooks installed, as a worker
runs it), medians of 30: a whole decode step of one row over `context`
cached tokens, then its parts run alone (the 30 layers, their MLPs, their
attention projections, the LM head), each with the bytes of weights it
reads and the rate that makes. A step of one row reads every weight once,
so these rates against the machine's copy bandwidth say how far decode is
from its limit, and which products are to blame.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks.probes.block_size import timed  # noqa: E402
from workers.kernels import mlx_hooks  # noqa: E402
from workers.models.loading import load_model, size_buffer_cache  # noqa: E402
from workers.models.store import resolve_model  # noqa: E402


def nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder, .gguf or repo id (default: embedded)")
    ap.add_argument("--context", type=int, default=150, help="cached tokens the row attends to")
    args = ap.parse_args()
    size_buffer_cache(1)
    model, _ = load_model(str(resolve_model(args.model)))
    mlx_hooks.install(model)
    inner = model.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + args.context))]), cache=cache))
    hidden = mx.random.normal((1, 1, inner.embed_tokens.weight.shape[1]))
    mx.eval(hidden)

    def rewind():  # every pass writes one token; keep the context the same
        for c in cache:
            c.offset -= 1

    def step():
        mx.eval(model(mx.array([[5]]), cache=cache))
        rewind()

    def layers():
        y = hidden
        for layer, c in zip(inner.layers, cache):
            y = layer(y, None, c)
        mx.eval(y)
        rewind()

    def mlps():
        y = hidden
        for layer in inner.layers:
            y = layer.mlp(y)
        mx.eval(y)

    def projections():
        outs = []
        for layer in inner.layers:
            a = layer.self_attn
            outs += [a.o_proj(a.q_proj(hidden)), a.k_proj(hidden), a.v_proj(hidden)]
        mx.eval(outs)

    head = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear

    def lm_head():
        mx.eval(head(hidden))

    head_bytes = nbytes(model.lm_head) if hasattr(model, "lm_head") else inner.embed_tokens.weight.nbytes
    rows = [
        ("whole step", step, nbytes(model)),
        (f"{len(inner.layers)} layers", layers, None),
        ("their MLPs", mlps, sum(nbytes(layer.mlp) for layer in inner.layers)),
        ("their attention projections", projections, sum(nbytes(layer.self_attn) for layer in inner.layers)),
        ("the LM head", lm_head, head_bytes),
    ]
    print(f"{'part':<30} {'ms':>8} {'weights MB':>11} {'GB/s':>6}")
    for name, fn, size in rows:
        ms = timed(fn, 30)
        rate = f"{size / ms / 1e6:6.1f}" if size and name != "whole step" else ""
        print(f"{name:<30} {ms:8.1f} {'' if size is None else f'{size / 1e6:11.0f}'} {rate}")


if __name__ == "__main__":
    main()
