"""`tandem serve`: resolve the model once, then hand everything to the supervisor."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import replace

from deploy.hosts_flags import add_hosts_arguments, hosts_settings
from deploy.keys_cmd import worker_listen_error
from environment.logs import setup_logging
from environment.model_folder import ModelError, is_vlm, vocabulary_mismatch, weight_bytes
from environment.settings import Settings, default_cache_memory
from deploy.supervisor import Supervisor
from workers.models.sharding import folder_shard_problem
from workers.models.store import model_id_for, resolve_model


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _bytes(text: str) -> int:
    """'2G', '512M', '1048576' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _seconds(text: str) -> float:
    """'7d', '12h', '30m', '45s', '90' -> seconds."""
    units = {"S": 1, "M": 60, "H": 3600, "D": 86400}
    text = text.strip().upper()
    value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _keep_alive(text: str) -> float:
    """Ollama's keep_alive: '5m', '1h30m', '30s', '0', '-1' -> seconds (-1: forever)."""
    from router.models.keep_alive import KeepAliveError, parse_keep_alive

    try:
        return parse_keep_alive(text, "--keep-alive")
    except KeepAliveError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> tuple:
    """'a, b,c' -> ('a', 'b', 'c')."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def api_keys(args: argparse.Namespace) -> tuple:
    """--api-key (repeatable) and --api-key-file (one key a line; '#' comments)."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(keys))


def draft_model_dir(args: argparse.Namespace, model_dir) -> str | None:
    """The draft model's folder (None: none), checked against the target's
    tokenizer; ModelError says why it cannot draft."""
    if args.speculative == "draft" and not args.draft_model:
        raise ModelError("--speculative draft needs --draft-model")
    if not args.draft_model:
        return None
    if args.speculative not in ("draft", "auto"):
        raise ModelError(f"--draft-model drafts only with --speculative draft or auto (not {args.speculative})")
    draft_dir = resolve_model(args.draft_model, pull=True)
    why = vocabulary_mismatch(model_dir, draft_dir)
    if why:
        raise ModelError(f"--draft-model {args.draft_model}: {why}")
    return str(draft_dir)


def group_error(args: argparse.Namespace, model_dir) -> str | None:
    """Why --tensor-parallel or --pipeline-parallel cannot run as asked
    (None: it can, or both are 1)."""
    tp, pp = args.tensor_parallel, args.pipeline_parallel
    if tp > 1 and pp > 1:
        return (f"--tensor-parallel {tp} and --pipeline-parallel {pp} together would need a 2-D group, "
                "which is not built: give one of them")
    if tp <= 1 and pp <= 1:
        return None
    flag = f"--tensor-parallel {tp}" if tp > 1 else f"--pipeline-parallel {pp}"
    if not args.colocate and args.hosts:
        return (f"{flag} --hosts needs --colocate: split prefill and decode groups hand KV off rank by rank "
                "through each host's arena, and the other hosts run no cache service")
    if args.prefill_backend == "ane":
        return f"{flag} prefills with MLX only (not --prefill-backend ane)"
    if is_vlm(model_dir):
        return f"{flag}: vision-language models are not sharded yet ({model_dir})"
    why = folder_shard_problem(model_dir, max(tp, pp), pipeline=pp > 1)
    return f"{flag} cannot split {model_dir}: {why}" if why else None


def add_layout_arguments(p: argparse.ArgumentParser, d: Settings) -> None:
    """How each model worker runs: both roles in one process, split over ranks (workers/group/)."""
    p.add_argument("--colocate", action="store_true", help="prefill and decode in one process (one copy of the weights)")
    p.add_argument("--tensor-parallel", type=_positive, default=d.tensor_parallel, metavar="N",
                   help="split each worker's model over N processes of this host (or several: --hosts; mx.distributed: ring on the CPU "
                        "and Metal, NCCL with one GPU a rank on CUDA); split layout: a prefill "
                        "and a decode group, rank i handing its KV shard to rank i through the arena; a draft "
                        "model runs whole on every rank")
    p.add_argument("--pipeline-parallel", type=_positive, default=d.pipeline_parallel, metavar="N",
                   help="split each worker's model by layers over N processes of this host (a run of whole layers "
                        "each; architectures with mlx-lm's `pipeline`: qwen2, qwen3_moe, deepseek_v3, ...); "
                        "as --tensor-parallel otherwise, and not with it")
    p.add_argument("--tensor-parallel-timeout", type=_positive, default=int(d.group_unit_timeout_s), metavar="S",
                   help="a group's prefill chunk or decode step running longer than this means a rank is stuck: "
                        "the group restarts and its requests move (default %(default)s s)")
    add_remote_worker_arguments(p)  # workers of other hosts (deploy/worker_cmd.py)
    add_hosts_arguments(p)  # a group's ranks on several hosts (deploy/hosts_flags.py)


def add_remote_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Workers of other hosts (`tandem worker`, deploy/worker_cmd.py) joining this router."""
    p.add_argument("--worker-listen", default="", metavar="tcp://HOST:PORT",
                   help="also take workers of other hosts (`tandem worker`) there, CURVE-encrypted (needs --worker-keys)")
    p.add_argument("--worker-keys", default="", metavar="DIR",
                   help="the router's key pair and the public keys of the workers allowed to join (`tandem keys`)")


def add_client_bound_arguments(p: argparse.ArgumentParser, d: Settings) -> None:
    """How long a client may take, and the router's byte budgets on what it keeps for clients
    (router/guards/slow_clients.py, router/guards/admission.py, router/api/response_store.py)."""
    p.add_argument("--http-keep-alive", type=float, default=d.keep_alive_s,
                   help="seconds an idle HTTP connection stays open")
    p.add_argument("--client-timeout", type=_seconds, default=d.client_timeout_s,
                   help="seconds a client has to send its request headers and body, and to take its answer "
                        "(a full write buffer not drained in time closes the connection and cancels the request)")
    p.add_argument("--request-bodies-memory", type=_bytes, default=d.admitted_body_bytes, metavar="SIZE",
                   help="bytes of request bodies admitted at once; past them 429 with Retry-After")
    p.add_argument("--stored-responses-memory", type=_bytes, default=d.stored_responses_bytes, metavar="SIZE",
                   help="bytes of stored Responses (previous_response_id) kept in all")
    p.add_argument("--stored-responses-memory-per-key", type=_bytes, default=d.stored_responses_key_bytes,
                   metavar="SIZE", help="bytes of stored Responses kept per API key (its own oldest dropped first)")


def add_model_service_arguments(p: argparse.ArgumentParser, d: Settings) -> None:
    """Other models loaded on demand (router/models/pool.py)."""
    p.add_argument("--keep-alive", type=_keep_alive, default=d.model_keep_alive_s, metavar="DURATION",
                   help="how long a model loaded on demand stays once idle, as Ollama's keep_alive: 5m, 1h, 30s, "
                        "0 (unload after each answer), -1 (forever); a request's keep_alive or ttl overrides it "
                        "(default 5m; the --model one stays loaded unless a request says otherwise)")
    p.add_argument("--max-loaded-models", type=_positive, default=d.max_loaded_models,
                   help="models loaded at once; a load past it unloads the least recently used idle one")
    p.add_argument("--models-memory", type=_bytes, default=None, metavar="SIZE",
                   help="bytes the loaded models' weights may take, all processes together (default: three "
                        "quarters of physical memory less the KV cache)")
    p.add_argument("--model-load-timeout", type=_seconds, default=d.model_load_timeout_s,
                   help="seconds a request waits for its model to load")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--model", default=None, help="MLX folder, .gguf file or Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--prefill-workers", type=_positive, default=d.prefill_workers)
    p.add_argument("--decode-workers", type=_positive, default=d.decode_workers)
    add_layout_arguments(p, d)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes; repeat for several keys (each its own cache tenant)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one a line (keeps them out of the process list)")
    p.add_argument("--cors-origins", type=_names, default=d.cors_origins, metavar="ORIGINS",
                   help="comma-separated browser Origins allowed to call the API ('*': any); none by default")
    p.add_argument("--allowed-hosts", type=_names, default=d.allowed_hosts, metavar="HOSTS",
                   help="comma-separated Host names the server answers to besides localhost and --host ('*': any)")
    p.add_argument("--cache-memory", type=_bytes, default=None,
                   help="shared-memory KV arena, e.g. 2G (default: a tenth of RAM, 256M-8G, at most a quarter of "
                        f"what the model workers' weights leave; here at most {d.cache_memory_bytes / 2**30:.1f}G)")
    p.add_argument("--cache-dir", default=d.cache_dir, help="disk tier for KV blocks, kept across restarts")
    p.add_argument("--no-disk-cache", action="store_true", help="keep KV blocks in memory only")
    p.add_argument("--cache-disk-bytes", type=_bytes, default=d.cache_disk_bytes, help="disk tier size limit, e.g. 8G")
    p.add_argument("--cache-disk-ttl", type=_seconds, default=d.cache_disk_ttl_s,
                   help="disk-tier blocks unused this long are deleted, e.g. 7d, 12h")
    p.add_argument("--hot-kv-memory", type=_bytes, default=None,
                   help="KV blocks each model worker keeps in its own (GPU) memory, e.g. 2G; 0 for none "
                        "(default: an eighth of a GPU's memory, a 32nd of a Mac's, shared among all model processes; 64M each on a CPU)")
    p.add_argument("--block-size", type=_positive, default=d.block_size,
                   help="tokens per KV block (default: 4 where MLX runs on the CPU, 8 on a GPU)")
    p.add_argument("--max-batch", type=_positive, default=d.max_batch, help="decode batch size per decode worker")
    p.add_argument("--prefill-chunk", type=_positive, default=d.prefill_chunk, help="tokens per prefill step")
    p.add_argument("--prefill-batch", type=_positive, default=d.prefill_batch,
                   help="prompts one prefill step may take together (their new tokens within --prefill-chunk); "
                        "1: one at a time (default: 16 on a GPU, 1 where MLX runs on the CPU)")
    p.add_argument("--prefill-backend", default=d.prefill_backend, choices=["mlx", "ane", "auto"],
                   help="mlx: prefill on the GPU; ane: on the Neural Engine (macOS; programs from `tandem convert-ane`); "
                        "auto: long uncached prompts there, short ones on the GPU")
    p.add_argument("--ane-min-tokens", type=_positive, default=d.ane_min_tokens,
                   help="--prefill-backend auto: uncached prompt tokens from which a prompt goes to the Neural Engine")
    p.add_argument("--speculative", default=d.speculative, choices=["auto", "off", "prompt-lookup", "draft"],
                   help="speculative decoding in the decode batch: prompt-lookup drafts from the request's own text, "
                        "draft from --draft-model; auto: draft when --draft-model is given, else prompt-lookup")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a small model with the target's tokenizer that drafts tokens (as --model takes it)")
    p.add_argument("--spec-tokens", type=_positive, default=d.spec_tokens,
                   help="tokens a row drafts per step at most (adapted per row to what is accepted)")
    p.add_argument("--spec-max-batch", type=_positive, default=d.spec_max_batch,
                   help="decode rows above which steps do not speculate (compute-bound; "
                        "default: 4 where MLX runs on the CPU, 8 on a GPU)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="workers say ready without first running a short prompt (faster start, slower first request)")
    p.add_argument("--max-queue", type=_positive, default=d.max_queue,
                   help="requests admitted beyond what the decode batches hold (--max-batch x decode workers); past them 429 with Retry-After")
    add_client_bound_arguments(p, d)
    add_model_service_arguments(p, d)
    p.add_argument("--migrate-timeout", type=_seconds, default=d.migrate_timeout_s,
                   help="seconds a request whose worker died waits for another before it fails")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s, help="seconds in-flight streams get on shutdown")
    p.add_argument("--allow-local-media", default=None, metavar="DIR",
                   help="VLMs: serve file:// image and video URLs from under DIR (default: refused)")
    p.add_argument("--allow-media-hosts", type=_names, default=d.allow_media_hosts, metavar="HOSTS",
                   help="comma-separated host names or networks (CIDR) http(s) media may come from besides public addresses")
    p.add_argument("--media-memory", type=_bytes, default=d.media_budget_bytes,
                   help="bytes of media all requests may hold at once while fetching and decoding")
    p.add_argument("--max-images", type=_positive, default=d.max_images, help="VLMs: image parts per request")
    p.add_argument("--max-image-pixels", type=_positive, default=d.max_image_pixels, help="VLMs: pixels per image")
    p.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout_s,
                   help="VLMs: seconds an http(s) image download may take")
    p.add_argument("--max-video-frames", type=_positive, default=d.max_video_frames,
                   help="VLMs: frames sampled per video at most")
    p.add_argument("--power-policy", default=d.power_policy, choices=["auto", "performance", "balanced", "saver"],
                   help="auto: performance on AC power, balanced on battery, saver in Low Power Mode, under 20%% "
                        "or when hot; the others pin one (docs/power.md)")
    p.add_argument("--power-poll", type=_seconds, default=d.power_poll_s, help="seconds between power readings")
    p.add_argument("--power-state-file", default=None, metavar="FILE",
                   help="read the power state from this JSON file instead of the machine (testing a policy)")
    p.add_argument("--memory-pressure-file", default=None, metavar="FILE",
                   help="read the memory-pressure level (normal, warn, critical) from this file instead of the system")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    why = worker_listen_error(args.worker_listen, args.worker_keys)  # remote workers (deploy/worker_cmd.py)
    if why:
        print(f"tandem: {why}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, "supervisor")
    if args.prefill_backend == "ane" and sys.platform != "darwin":
        print("tandem: --prefill-backend ane needs macOS: the Neural Engine runs Core ML programs, whose predict "
              f"exists on macOS only (this is {sys.platform}); use --prefill-backend mlx (or auto, which falls "
              "back to MLX here)", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model, pull=True)  # a repo the cache lacks is downloaded
        draft_dir = draft_model_dir(args, model_dir)
    except ModelError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    why, group_size = group_error(args, model_dir), max(args.tensor_parallel, args.pipeline_parallel)
    try:  # a group across hosts: its hostfile and keys, checked before anything starts
        across_hosts = hosts_settings(args, group_size) if not why else {}
    except ValueError as exc:
        why = str(exc)
    if why:
        print(f"tandem: {why}", file=sys.stderr)
        return 2
    settings = Settings(
        model=args.model, model_dir=str(model_dir), model_id=model_id_for(args.model, model_dir),
        host=args.host, port=args.port, api_keys=api_keys(args), cors_origins=args.cors_origins,
        allowed_hosts=args.allowed_hosts,
        client_timeout_s=args.client_timeout, cache_disk_ttl_s=args.cache_disk_ttl,
        migrate_timeout_s=args.migrate_timeout, allow_media_hosts=args.allow_media_hosts,
        media_budget_bytes=args.media_memory,
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, colocate=args.colocate,
        cache_memory_bytes=args.cache_memory or 0, cache_dir=None if args.no_disk_cache else args.cache_dir,
        cache_disk_bytes=args.cache_disk_bytes, hot_kv_bytes=args.hot_kv_memory, block_size=args.block_size, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch, warm_up=args.warm_up,
        max_queue=args.max_queue, admitted_body_bytes=args.request_bodies_memory,
        stored_responses_bytes=args.stored_responses_memory,
        stored_responses_key_bytes=args.stored_responses_memory_per_key, drain_timeout_s=args.drain_timeout, keep_alive_s=args.http_keep_alive, log_level=args.log_level,
        model_keep_alive_s=args.keep_alive, max_loaded_models=args.max_loaded_models,
        models_memory_bytes=args.models_memory, model_load_timeout_s=args.model_load_timeout,
        allow_local_media=args.allow_local_media, max_images=args.max_images,
        max_image_pixels=args.max_image_pixels, media_fetch_timeout_s=args.media_fetch_timeout,
        max_video_frames=args.max_video_frames,
        power_policy=args.power_policy, power_poll_s=args.power_poll, power_state_file=args.power_state_file,
        memory_pressure_file=args.memory_pressure_file,
        prefill_backend=args.prefill_backend, ane_min_tokens=args.ane_min_tokens,
        speculative=args.speculative, draft_model_dir=draft_dir, spec_tokens=args.spec_tokens,
        spec_max_batch=args.spec_max_batch, worker_listen=args.worker_listen, worker_keys=args.worker_keys,
    )
    if group_size > 1:  # a group (its ranks turn drafts and the ANE off)
        settings = replace(settings, tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                           group_unit_timeout_s=float(args.tensor_parallel_timeout), **across_hosts)
    if not args.cache_memory:  # sized by the machine and the model (environment/settings.py)
        copies = sum(1 for _, roles in settings.worker_plan() if {"prefill", "decode"} & set(roles))
        settings = replace(settings, cache_memory_bytes=default_cache_memory(weights=weight_bytes(model_dir),
                                                                             copies=copies))
    logging.getLogger(__name__).info(
        "KV cache: %.0f MiB of shared memory, disk tier %s", settings.cache_memory_bytes / 2**20,
        f"{settings.cache_dir} ({settings.cache_disk_bytes / 2**30:.1f} GiB)" if settings.cache_dir else "off")
    supervisor = Supervisor(settings)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    return supervisor.run()
