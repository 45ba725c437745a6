"""The `tandem` command line."""

from __future__ import annotations

import argparse
import sys

from deploy import blas


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.bench import bench_cmd
    from benchmarks.random_models import random_model_cmd
    from deploy import cache_cmd, convert_ane_cmd, generate_cmd, serve_cmd
    from deploy.service import service_cmd

    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt in the terminal")
    generate_cmd.add_arguments(gen)
    gen.set_defaults(run=generate_cmd.run)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    serve_cmd.add_arguments(serve)
    serve.set_defaults(run=serve_cmd.run)
    bench = sub.add_parser("bench", help="load-test Tandem and its peers side by side")
    bench_cmd.add_arguments(bench)
    bench.set_defaults(run=bench_cmd.run)
    rand = sub.add_parser("random-model", help="write a random-weight model of a real architecture's shape")
    random_model_cmd.add_arguments(rand)
    rand.set_defaults(run=random_model_cmd.run)
    cache = sub.add_parser("cache", help="manage the KV disk cache (clear)")
    cache_cmd.add_arguments(cache)
    ane = sub.add_parser("convert-ane", help="convert the model's prefill for the Neural Engine (Core ML, Core AI); --check")
    convert_ane_cmd.add_arguments(ane)
    service = sub.add_parser("service", help="run `tandem serve` as a launchd or systemd service (install, status, logs...)")
    service_cmd.add_arguments(service)
    # Models from the Hugging Face Hub: pull, list, rm (deploy/models/).
    from deploy.models import models_cmd, pull_cmd
    pull_cmd.add_arguments(sub.add_parser("pull", help="download a model from the Hugging Face Hub: REPO[:FILE][@REVISION]"))
    models_cmd.add_list_arguments(sub.add_parser("list", help="the downloaded models, their kinds and sizes"))
    models_cmd.add_rm_arguments(sub.add_parser("rm", help="delete a downloaded model"))
    from deploy.models import loaded_cmd  # the running server's loaded models, as `ollama ps` / `ollama stop`
    loaded_cmd.add_ps_arguments(sub.add_parser("ps", help="the models the running server has loaded"))
    loaded_cmd.add_stop_arguments(sub.add_parser("stop", help="unload a model from the running server now"))
    # Remote workers: keys, and a worker on another host joining a router (deploy/keys_cmd.py, worker_cmd.py).
    from deploy import keys_cmd, worker_cmd
    keys_cmd.add_arguments(sub.add_parser("keys", help="make CURVE keys for workers on other hosts (--out DIR)"))
    worker_cmd.add_arguments(sub.add_parser("worker", help="run a worker on this host for a router elsewhere (--connect)"))
    # A group's rank on another host, started there over ssh by `serve --hosts` (deploy/remote_rank.py).
    from deploy import rank_cmd
    rank_cmd.add_arguments(sub.add_parser("rank", help="(internal) one rank of a `serve --hosts` group, over ssh"))
    return parser


def main(argv: list[str] | None = None) -> int:
    blas.reexec_with_openblas()
    parser = build_parser()
    # `tandem service install` takes `tandem serve`'s flags after its own.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_serve_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
