"""`tandem pull REPO[:FILE][@REVISION]`: download a model from the Hugging
Face Hub through huggingface_hub (its progress bars; HF_ENDPOINT, HF_TOKEN,
HF_HOME and HF_HUB_OFFLINE as it reads them), only the files a model needs,
and convert a GGUF as `tandem serve --model x.gguf` would. Run again after an
interruption, it fetches only what is still missing."""

from __future__ import annotations

import argparse
import sys

from environment.hub_cache import size_text
from environment.model_folder import ModelError, model_kind, weight_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="REPO[:FILE][@REVISION]",
                        help="a Hugging Face repo id, e.g. mlx-community/Qwen3-4B-4bit; @REVISION a branch, tag or "
                        "commit (default: main); :FILE one .gguf file of a GGUF repo, by name or quantization (:Q8_0)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """0 with one line saying where the model is; 2 with one line on stderr
    when it cannot be pulled; 130 when interrupted (what finished is kept)."""
    from workers.models.store import pull_model

    try:
        folder = pull_model(args.model)
    except ModelError as exc:
        print(f"tandem pull: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ntandem pull: interrupted; the files finished are kept: `tandem pull {args.model}` "
              "fetches the rest", file=sys.stderr)
        return 130
    print(f"{args.model}: {model_kind(folder)} model, {size_text(weight_bytes(folder))} of weights, in {folder}")
    return 0
