"""`tandem convert-ane`: the model's prefill as Neural Engine programs, made
ahead of serving (workers/prefill/ane/): a Core ML package (one function per
bucket, one copy of the weights) for macOS 15/26 and a Core AI program per
bucket for macOS 27, under the cache folder, keyed by the model's
fingerprint. `--check` runs a converted prefill against MLX's on a prompt and
prints the differences (KV, hidden states, logits, greedy tokens after it).

Converting and compiling take minutes to an hour at full power: refused on
battery unless --on-battery.
"""

from __future__ import annotations

import argparse
import sys
import time

from environment.power.readers import read_power
from environment.settings import Settings, default_cache_dir

CHECK_PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. "
                "Name the capital of Spain and one river that flows through it, then the capital of Portugal.")


def _sizes(text: str) -> tuple:
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError("a comma-separated list of token counts, e.g. 512,1024") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("at least one positive size")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workers.prefill.ane.contract import DEFAULT_CACHES, DEFAULT_CHUNK

    p.add_argument("--model", default=None, help="as for tandem serve (default: the embedded model)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="tokens per program call (Q)")
    p.add_argument("--caches", type=_sizes, default=DEFAULT_CACHES,
                   help="cache lengths (S) to build, comma-separated, e.g. 512,1024,2048")
    p.add_argument("--formats", default="coreml,coreai",
                   help="coreml (macOS 15/26), coreai (macOS 27; where coreai-core installs), or both")
    p.add_argument("--check", action="store_true",
                   help="also run a converted prefill against MLX's and print the differences")
    p.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared after the prefill")
    p.add_argument("--check-only", action="store_true", help="check without converting (nothing written)")
    p.add_argument("--on-battery", action="store_true", help="convert even on battery power")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from environment.model_folder import ModelError
    from workers.models.store import resolve_model

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or any(f not in ("coreml", "coreai") for f in formats):
        print("tandem convert-ane: --formats takes coreml, coreai or both", file=sys.stderr)
        return 2
    if args.chunk < 1 or args.chunk > min(args.caches):
        print("tandem convert-ane: --chunk must be at least 1 and at most the smallest cache", file=sys.stderr)
        return 2
    if not args.check_only and not args.on_battery and read_power(Settings()).source == "battery":
        print("tandem convert-ane: on battery power: converting and the first compile run the machine flat out for "
              "minutes; plug in, or pass --on-battery", file=sys.stderr)
        return 3
    try:
        model_dir = resolve_model(args.model)
    except ModelError as exc:
        print(f"tandem convert-ane: {exc}", file=sys.stderr)
        return 2
    from workers.models.loading import load_model
    from workers.prefill.ane.contract import buckets
    from workers.prefill.ane.weights import UnsupportedModel, body_weights

    model, tokenizer = load_model(str(model_dir))
    wanted = buckets(args.chunk, args.caches)
    try:
        weights = body_weights(model, max(args.caches) + args.chunk)
    except UnsupportedModel as exc:
        print(f"tandem convert-ane: this model cannot be converted: {exc}", file=sys.stderr)
        return 2
    if not args.check_only:
        _convert(model_dir, weights, wanted, formats)
    if args.check or args.check_only:
        from deploy.convert_ane_check import check

        check(model, tokenizer, weights, wanted[-1], CHECK_PROMPT, args.check_tokens, model_dir)
    return 0


def _convert(model_dir, weights, wanted: list, formats: list) -> None:
    from workers.prefill.ane.backend import COREML_PACKAGE
    from workers.prefill.ane.packages import PackageStore

    store = PackageStore(default_cache_dir(), model_dir)
    if "coreml" in formats:
        import coremltools as ct
        from workers.prefill.ane.coreml_program import save_chunk_package

        t0 = time.perf_counter()
        path = store.put("coreml", COREML_PACKAGE, lambda tmp: save_chunk_package(weights, wanted, tmp, stateful=True))
        store.record("coreml", [(b, COREML_PACKAGE) for b in wanted], {"coremltools": ct.__version__})
        print(f"Core ML: {path} ({', '.join(b.name for b in wanted)}) in {time.perf_counter() - t0:.0f} s")
        if sys.platform == "darwin":  # compiled now (the OS caches it), not by the first request
            from workers.prefill.ane.coreml_runner import CoreMLChunkRunner

            for bucket in wanted:
                t0 = time.perf_counter()
                CoreMLChunkRunner(path, bucket).load()
                print(f"Core ML: {bucket.name} compiled for the Neural Engine in {time.perf_counter() - t0:.0f} s")
    if "coreai" in formats:
        try:
            import coreai  # noqa: F401 - coreai-core: Linux x86-64 and macOS 26+ only
        except ImportError:
            print("Core AI: skipped: coreai-core is not installed here (it has wheels for Linux x86-64 and "
                  "macOS 26+ on arm64)")
            return
        from importlib.metadata import version

        from workers.prefill.ane.coreai_program import save_program

        t0, programs = time.perf_counter(), []
        for bucket in wanted:
            name = f"{bucket.name}.aimodel"
            store.put("coreai", name, lambda tmp, b=bucket: save_program(weights, b, tmp, compute="fp16"))
            programs.append((bucket, name))
        store.record("coreai", programs, {"coreai-core": version("coreai-core")})
        print(f"Core AI: {store.folder / 'coreai'} ({len(programs)} programs) in {time.perf_counter() - t0:.0f} s")

