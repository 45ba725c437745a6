"""`tandem generate`: answer one prompt from the command line, streaming.

Runs the model in this process (no router or workers): the quickest check
that a model resolves, converts, loads and talks.
"""

from __future__ import annotations

import argparse
import sys

from deploy.blas import reexec_with_openblas
from environment.model_folder import ModelError
from workers.models.store import resolve_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the user message to answer")
    parser.add_argument(
        "--model",
        default=None,
        help="MLX model folder, .gguf file or Hugging Face repo id (cached); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def run(args: argparse.Namespace) -> int:
    """Stream the answer to stdout; returns the exit code (2 for a model
    that cannot be found or loaded, with one line on stderr)."""
    try:
        return _generate(args)
    except ModelError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _generate(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from workers.models.loading import load_model  # MLX: only to generate

    if args.max_tokens < 1:
        raise ModelError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    model, tokenizer = load_model(resolve_model(args.model))
    if args.seed is not None:
        mx.random.seed(args.seed)
    messages = [{"role": "user", "content": args.prompt}]
    if tokenizer.has_chat_template:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:  # base models have no template: the prompt is the raw text
        prompt = tokenizer.encode(args.prompt)
    sampler = make_sampler(temp=args.temperature)
    for response in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler):
        sys.stdout.write(response.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy.generate_cmd ...`, the same as `tandem generate ...`."""
    reexec_with_openblas()
    parser = argparse.ArgumentParser(prog="tandem generate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
