"""`tandem random-model`: an MLX model folder with a real architecture's shape and random weights.

A text model (text.py) or a VLM (vlm.py), its tokenizer borrowed from the
embedded default model.

    tandem random-model --like qwen3-0.6b --out /tmp/qwen3-0.6b-random [--dtype bfloat16] [--seed 0]
    tandem random-model --like tiny-qwen2.5-vl --out /tmp/vlm-tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.random_models import text, vlm
from benchmarks.random_models.embedded import embedded_model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--like", required=True, choices=[*text.SHAPES, *vlm.SHAPES],
                   help="the real model whose shape to copy (a VLM too: benchmarks/random_models/vlm.py)")
    p.add_argument("--out", required=True, help="folder to write (created; must be empty or absent)")
    p.add_argument("--dtype", default=None, choices=text.DTYPES,
                   help="weights' dtype (default: bfloat16; the tiny VLM shapes float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers than the real model (its width and shapes otherwise): a model too large "
                        "for one accelerator that still fits the disk")
    p.add_argument("--tokenizer-from", default=None,
                   help="model folder to copy the tokenizer from (default: the embedded default model)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"tandem: {out} is not empty (use --force to overwrite)", file=sys.stderr)
        return 2
    try:
        tokenizer_dir = Path(args.tokenizer_from) if args.tokenizer_from else embedded_model_dir()
    except Exception as e:  # ModelError and kin: one line for the user
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    if args.like in vlm.SHAPES:
        dtype = args.dtype or vlm.SHAPES[args.like]["dtype"]
        info = vlm.make_random_vlm(args.like, out, args.seed, dtype=dtype, tokenizer_dir=tokenizer_dir)
    else:
        dtype = args.dtype or "bfloat16"
        info = text.write_random_model(args.like, out, dtype=dtype, seed=args.seed, tokenizer_dir=tokenizer_dir,
                                        layers=args.layers)
    print(f"{out}: random {args.like} ({info['model_type']}), {info['params']:,} parameters, "
          f"{info['weight_bytes'] / 2**20:,.1f} MiB of {dtype} weights, seed {args.seed}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem random-model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
