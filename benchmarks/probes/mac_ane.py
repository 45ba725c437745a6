"""Does Core ML prefill run on the Neural Engine, how fast, how exactly, and
does it leave MLX decode alone? Run on a Mac (macOS 15+, Apple silicon) and
paste the printed report into issue 29:

    python benchmarks/probes/mac_ane.py [--model M] [--chunk 64] [--cache 512] [--out DIR]

It converts the model's body (workers/prefill/ane/coreml_program.py; default
the embedded SmolLM2-135M) into a stateful chunk package, then:
1. compile and load times: the first load (Core ML compiles for the device)
   against a second one (its cache), with CPU_AND_NE and with ALL;
2. where ops run: MLComputePlan (macOS 14.4+), ops and estimated cost per device;
3. prefill speed: a prompt of whole chunks, tokens per second, against MLX's
   own prefill of it (the GPU);
4. numerics on the hardware: the chunk KV and last hidden state against MLX's
   prefill (max relative error, inf/nan counts: fp16 overflow), next token;
5. MLX decode inter-token latency alone, while the Neural Engine prefills (a
   second process), and while MLX prefills on the GPU (the status quo).
Watts are not read (powermetrics needs sudo): run
`sudo powermetrics --samplers cpu_power,gpu_power,ane_power -i 1000` beside it.

Off macOS it says so and stops; `--convert-only` converts and inspects anywhere.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import numpy as np  # noqa: E402

from workers.prefill.ane.contract import Bucket  # noqa: E402

MACOS_ONLY = ("mac_ane.py measures Core ML on the Neural Engine: macOS only (this is {}). "
              "--convert-only converts and inspects the package here.")
PROMPT = ("The Neural Engine is a matrix accelerator on Apple silicon. It runs fixed-shape fp16 programs "
          "compiled by Core ML, next to the GPU where MLX decodes. ")


def timed(call):
    t0 = time.perf_counter()
    value = call()
    return value, time.perf_counter() - t0


def _units(name: str):
    import coremltools as ct

    return getattr(ct.ComputeUnit, name)


# -- conversion --------------------------------------------------------------------------------------

def convert(model, bucket: Bucket, out: Path, report: list) -> Path:
    from workers.prefill.ane.coreml_inspect import package_functions
    from workers.prefill.ane.coreml_program import package_bytes, save_chunk_package, weight_bytes
    from workers.prefill.ane.weights import body_weights

    weights = body_weights(model, bucket.cache)
    path, seconds = timed(lambda: save_chunk_package(weights, [bucket], out / f"chunk_{bucket.name}.mlpackage"))
    f = package_functions(path)[bucket.name]
    cfg = weights.config
    report += [f"## Conversion ({bucket.name})",
               f"- body: {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}/{cfg.kv_heads}, "
               f"head_dim {cfg.head_dim}, qk_norm {cfg.qk_norm}, traditional rope {cfg.rope_traditional}",
               f"- converted and saved in {seconds:.1f} s: {package_bytes(path) / 1e6:.1f} MB "
               f"(weights {weight_bytes(weights) / 1e6:.1f} MB fp16), {sum(f.ops.values())} ops",
               f"- states {f.states}"]
    return path


# -- compile, load, compute plan ---------------------------------------------------------------------

def compile_and_load(path: Path, bucket: Bucket, out: Path, report: list) -> Path:
    import coremltools as ct

    compiled, seconds = timed(lambda: ct.models.utils.compile_model(str(path), str(out / "chunk.mlmodelc")))
    report += ["## Compile and load", f"- mlpackage -> mlmodelc: {seconds:.1f} s"]
    for units in ("CPU_AND_NE", "ALL"):
        for attempt in ("first", "second"):
            _, seconds = timed(lambda: ct.models.CompiledMLModel(compiled, _units(units), function_name=bucket.name))
            report.append(f"- load {units}, {attempt}: {seconds:.2f} s")
    return Path(compiled)


def compute_plan(compiled: Path, bucket: Bucket, report: list) -> None:
    from coremltools.models.compute_plan import MLComputePlan

    report.append("## Where ops run (MLComputePlan)")
    for units in ("CPU_AND_NE", "ALL"):
        try:
            plan = MLComputePlan.load_from_path(str(compiled), _units(units))
        except Exception as e:  # noqa: BLE001 - macOS before 14.4, or a refusal: report it
            report.append(f"- {units}: no compute plan ({type(e).__name__}: {e})")
            continue
        functions = plan.model_structure.program.functions
        function = functions.get(bucket.name) or next(iter(functions.values()))
        ops, cost = Counter(), Counter()
        unplaced = Counter()
        for op in function.block.operations:
            if op.operator_name == "const":
                continue
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            if usage is None:
                unplaced[op.operator_name] += 1
                continue
            device = type(usage.preferred_compute_device).__name__.replace("ML", "").replace("ComputeDevice", "")
            ops[device] += 1
            estimate = plan.get_estimated_cost_for_mlprogram_operation(op)
            cost[device] += estimate.weight if estimate else 0.0
            if device != "NeuralEngine":
                unplaced[f"{op.operator_name}@{device}"] += 1
        shares = ", ".join(f"{d}: {n} ops, {100 * cost[d]:.0f}% of cost" for d, n in ops.most_common())
        report.append(f"- {units}: {shares}")
        report.append(f"  - off the Neural Engine: {dict(unplaced.most_common(12))}")


# -- prefill: speed and numerics ---------------------------------------------------------------------

def prompt_tokens(tokenizer, bucket: Bucket) -> list:
    """Whole chunks of a real prompt, filling the cache but for one chunk."""
    want = (bucket.cache - bucket.chunk) // bucket.chunk * bucket.chunk
    tokens = []
    while len(tokens) < want:
        tokens += tokenizer.encode(PROMPT)
    return tokens[:want]


def embeddings(model, tokens: list) -> np.ndarray:
    import mlx.core as mx

    return np.array(model.model.embed_tokens(mx.array(tokens)).astype(mx.float32)).astype(np.float16)


def ane_prefill(runner, x: np.ndarray, bucket: Bucket):
    """Chunk by chunk from an empty cache: (keys, values, last h, seconds per chunk)."""
    q = bucket.chunk
    ks, vs, times, h = [], [], [], None
    for start in range(0, len(x), q):
        chunk = x[None, start:start + q]
        args = (chunk, np.array([start], np.int32))
        if start == 0:
            shape = runner.cache_shape
            args += (np.zeros(shape, np.float16), np.zeros(shape, np.float16))
        (k, v, h), seconds = timed(lambda: runner(*args))
        ks.append(k)
        vs.append(v)
        times.append(seconds)
    return np.concatenate(ks, axis=2), np.concatenate(vs, axis=2), h[0, -1], times


def mlx_prefill(model, tokens: list):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    h = model.model(mx.array([tokens]), cache=cache)
    mx.eval(h, [c.state for c in cache])
    seconds = time.perf_counter() - t0
    keys = np.stack([np.array(c.keys[0, :, :len(tokens)].astype(mx.float32)) for c in cache])
    values = np.stack([np.array(c.values[0, :, :len(tokens)].astype(mx.float32)) for c in cache])
    return keys, values, np.array(h[0, -1].astype(mx.float32)), seconds


def next_token(model, h: np.ndarray) -> int:
    import mlx.core as mx

    h = mx.array(np.asarray(h, np.float32))[None]
    head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
    return int(mx.argmax(head(h.astype(model.model.norm.weight.dtype)), axis=-1).item())


def _rel(got: np.ndarray, want: np.ndarray) -> str:
    got = got.astype(np.float32)
    bad = int((~np.isfinite(got)).sum())
    err = np.abs(np.where(np.isfinite(got), got, 0) - want).max() / np.abs(want).max()
    return f"max rel {err:.2e}" + (f", {bad} inf/nan" if bad else "")


def prefill_report(model, tokenizer, path: Path, bucket: Bucket, report: list) -> None:
    from workers.prefill.ane.coreml_runner import CoreMLChunkRunner

    tokens = prompt_tokens(tokenizer, bucket)
    x = embeddings(model, tokens)
    mlx_prefill(model, tokens)  # warm MLX
    keys, values, h_ref, mlx_seconds = mlx_prefill(model, tokens)
    report += ["## Prefill", f"- MLX (GPU), {len(tokens)} tokens at once: {len(tokens) / mlx_seconds:.0f} tok/s"]
    for units in ("CPU_AND_NE", "ALL", "CPU_ONLY"):
        try:
            runner = CoreMLChunkRunner(path, bucket, _units(units))
            _, load_s = timed(runner.load)
            ane_prefill(runner, x, bucket)  # warm
            k, v, h, times = ane_prefill(runner, x, bucket)
        except Exception as e:  # noqa: BLE001 - e.g. the daemon refusing: report it
            report.append(f"- Core ML {units}: failed ({type(e).__name__}: {e})")
            continue
        per_chunk = statistics.median(times)
        report.append(f"- Core ML {units}: {bucket.chunk / per_chunk:.0f} tok/s ({per_chunk * 1000:.1f} ms per "
                      f"{bucket.chunk}-token chunk, median of {len(times)}; first load {load_s:.1f} s)")
        report.append(f"  - vs MLX: K {_rel(k, keys)}, V {_rel(v, values)}, last h {_rel(h, h_ref)}; "
                      f"next token {next_token(model, h)} vs {next_token(model, h_ref)}")


# -- decode inter-token latency under a concurrent prefill -------------------------------------------

def _ane_prefill_loop(path: str, bucket: tuple, hidden: int, ready, stop, done) -> None:
    """A second process: Core ML prefill (CPU_AND_NE) of random chunks until told to stop."""
    from workers.prefill.ane.coreml_runner import CoreMLChunkRunner

    b = Bucket(*bucket)
    runner = CoreMLChunkRunner(path, b)
    runner.load()
    x = np.random.default_rng(0).standard_normal((b.cache - b.chunk, hidden)).astype(np.float16) * 0.05
    ane_prefill(runner, x, b)  # warm before the clock starts
    ready.set()
    chunks, t0 = 0, time.perf_counter()
    while not stop.is_set():
        chunks += len(ane_prefill(runner, x, b)[3])
    done.put(chunks * b.chunk / (time.perf_counter() - t0))


def _mlx_prefill_loop(model_spec, tokens: list, ready, stop, done) -> None:
    """A second process: MLX prefill on the GPU of the same prompt until told to stop."""
    from workers.models.loading import load_model
    from workers.models.store import resolve_model

    model, _ = load_model(str(resolve_model(model_spec)))
    mlx_prefill(model, tokens)
    ready.set()
    count, t0 = 0, time.perf_counter()
    while not stop.is_set():
        mlx_prefill(model, tokens)
        count += len(tokens)
    done.put(count / (time.perf_counter() - t0))


def decode_gaps(model, tokenizer, tokens: int = 200) -> list:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = mx.array(tokenizer.encode(PROMPT))
    gaps, last = [], None
    for _ in generate_step(prompt, model, max_tokens=tokens):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    return gaps[5:]  # past the first steps' warm-up


def _gap_line(label: str, gaps: list, extra: str = "") -> str:
    ms = sorted(g * 1000 for g in gaps)
    return (f"- {label}: median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms, "
            f"max {ms[-1]:.2f} ms{extra}")


def decode_report(model, tokenizer, model_spec, path: Path, bucket: Bucket, report: list) -> None:
    ctx = mp.get_context("spawn")
    hidden = model.args.hidden_size
    decode_gaps(model, tokenizer, 20)
    report += ["## MLX decode inter-token latency", _gap_line("alone", decode_gaps(model, tokenizer))]
    others = (("while Core ML prefills (CPU_AND_NE)", _ane_prefill_loop, (str(path), (bucket.chunk, bucket.cache), hidden)),
              ("while MLX prefills on the GPU", _mlx_prefill_loop, (model_spec, prompt_tokens(tokenizer, bucket))))
    for label, target, args in others:
        ready, stop, done = ctx.Event(), ctx.Event(), ctx.Queue()
        worker = ctx.Process(target=target, args=(*args, ready, stop, done), daemon=True)
        worker.start()
        if not ready.wait(timeout=900):
            report.append(f"- {label}: the prefill process did not start in 15 min")
            worker.kill()
            continue
        gaps = decode_gaps(model, tokenizer)
        stop.set()
        rate = done.get(timeout=120)
        worker.join(timeout=30)
        report.append(_gap_line(label, gaps, f" (the prefill ran at {rate:.0f} tok/s meanwhile)"))


# -- the report --------------------------------------------------------------------------------------

def header() -> list:
    import coremltools as ct
    import mlx.core as mx

    chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
    return ["# mac_ane.py report",
            f"- {chip or platform.machine()}, macOS {platform.mac_ver()[0]}, Python {platform.python_version()}",
            f"- coremltools {ct.__version__}, MLX {mx.__version__}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an MLX model folder, .gguf or HF repo (default: the embedded one)")
    parser.add_argument("--chunk", type=int, default=64, help="Q: tokens per chunk")
    parser.add_argument("--cache", type=int, default=512, help="S: cache slots")
    parser.add_argument("--out", default=None, help="where the packages go (default: a temporary folder)")
    parser.add_argument("--convert-only", action="store_true", help="convert and inspect, no Core ML (any OS)")
    parser.add_argument("--skip-decode", action="store_true", help="skip the decode latency part")
    args = parser.parse_args()
    if sys.platform != "darwin" and not args.convert_only:
        print(MACOS_ONLY.format(sys.platform), file=sys.stderr)
        return 2

    from workers.models.loading import load_model
    from workers.models.store import resolve_model

    bucket = Bucket(args.chunk, args.cache)
    out = Path(args.out or tempfile.mkdtemp(prefix="mac_ane_"))
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(str(resolve_model(args.model)))
    report = [] if args.convert_only else header()
    path = convert(model, bucket, out, report)
    if not args.convert_only:
        steps = [lambda: compute_plan(compile_and_load(path, bucket, out, report), bucket, report),
                 lambda: prefill_report(model, tokenizer, path, bucket, report)]
        if not args.skip_decode:
            steps.append(lambda: decode_report(model, tokenizer, args.model, path, bucket, report))
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - keep what was measured, say what failed
                report.append(f"- failed: {type(e).__name__}: {e}")
    print("\n".join(report))
    print(f"\n(packages in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
