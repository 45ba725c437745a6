"""`tandem list` and `tandem rm`: the models downloaded into the Hugging Face
cache (environment/hub_cache.py), and deleting one through huggingface_hub's
cache API, with the conversion of a GGUF it held."""

from __future__ import annotations

import argparse
import shutil
import sys

from environment.hub_cache import downloaded_models, parse_ref, remove, size_text
from environment.model_folder import ModelError


def add_list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=run_list)


def add_rm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="REPO[@REVISION]",
                        help="a downloaded repo (all its revisions), or one revision of it")
    parser.set_defaults(run=run_rm)


def run_list(args: argparse.Namespace) -> int:
    """A table of the servable models: name (what --model takes), kind, size
    on disk, format; one that a pull left incomplete says what it lacks."""
    from huggingface_hub import constants

    models = downloaded_models()
    if not models:
        print(f"no models in the Hugging Face cache ({constants.HF_HUB_CACHE}): `tandem pull REPO` downloads one")
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'MODEL':<{width}}  {'KIND':<9}  {'SIZE':>10}  FORMAT")
    for m in models:
        note = f"incomplete: {m.lacks} (`tandem pull {m.name}` finishes it)" if m.lacks else m.format
        print(f"{m.name:<{width}}  {m.kind:<9}  {size_text(m.size):>10}  {note}")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    from workers.models.store import models_dir

    try:
        ref = parse_ref(args.model)
        freed, ggufs = remove(ref)
    except ModelError as exc:
        print(f"tandem rm: {exc}", file=sys.stderr)
        return 2
    for digest in ggufs:  # the MLX folder a GGUF was converted into is named by the file's sha256
        conversion = models_dir() / digest
        if conversion.is_dir():
            freed += sum(p.stat().st_size for p in conversion.rglob("*") if p.is_file())
            shutil.rmtree(conversion, ignore_errors=True)
    print(f"{args.model}: deleted ({size_text(freed)} freed)")
    return 0
