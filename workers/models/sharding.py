"""A model split over the ranks of a tensor-parallel group (mlx-lm's `shard`).

mlx-lm's `Model.shard(group)` cuts each layer's q/k/v and gate/up
projections by output rows (all-to-sharded) and o/down by input columns
(sharded-to-all, an all_sum after them), and divides each attention's head
counts by the group's size: every rank then holds 1/N of the weights and of
the KV heads. That needs an architecture with a `shard` method and head,
KV-head and intermediate sizes that divide by N.

`shard_problem` says what is wrong from the config alone (no MLX), so
`tandem serve` refuses at the start, before any process loads the weights;
`shard_model` checks again on the loaded model and shards it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


class ShardError(ValueError):
    """A model that cannot be split over this many ranks; the message says why."""


def _text_config(config: dict) -> dict:
    """The language model's part of a config (a VLM nests it)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def arch_can_shard(model_type: str) -> bool:
    """mlx-lm's module for `model_type` defines a `shard` method. Reads the
    module's source instead of importing it (the supervisor loads no MLX)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / f"{model_type}.py"
    try:
        return "def shard(" in path.read_text()
    except OSError:
        return False


def shard_problem(config: dict, ranks: int) -> str | None:
    """Why a model of `config` (its config.json) cannot be split over `ranks`
    tensor-parallel ranks, or None when it can."""
    if ranks <= 1:
        return None
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type", ""))
    if not arch_can_shard(model_type):
        return (f"mlx-lm cannot shard a {model_type or 'model of unknown type'} model "
                f"(its architecture has no tensor-parallel `shard` method)")
    sizes = {"attention heads": cfg.get("num_attention_heads"),
             "KV heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
             "intermediate size": cfg.get("intermediate_size")}
    bad = [f"{n} {what}" for what, n in sizes.items() if isinstance(n, int) and n % ranks]
    if bad:
        return (f"its {', '.join(bad)} do not divide by --tensor-parallel {ranks} "
                f"(each rank takes an equal share of the heads and of the MLP)")
    return None


def folder_shard_problem(model_dir: str | Path, ranks: int) -> str | None:
    """`shard_problem` for a model folder (reads its config.json)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read ({exc})"
    return shard_problem(config, ranks)


def shard_model(model, group) -> None:
    """Split `model` (an mlx-lm model, loaded whole) in place over `group`
    (an mx.distributed.Group): this rank keeps its share of every layer.
    Raises ShardError when it cannot be split over that many ranks."""
    import mlx.core as mx

    ranks = group.size()
    if not callable(getattr(model, "shard", None)):
        raise ShardError(f"mlx-lm cannot shard a {getattr(model, 'model_type', type(model).__name__)} model "
                         "(its architecture has no tensor-parallel `shard` method)")
    args = getattr(model, "args", None)
    if args is not None:
        why = shard_problem({"model_type": getattr(args, "model_type", "") or getattr(model, "model_type", ""),
                             "num_attention_heads": getattr(args, "num_attention_heads", None),
                             "num_key_value_heads": getattr(args, "num_key_value_heads", None),
                             "intermediate_size": getattr(args, "intermediate_size", None)}, ranks)
        if why:
            raise ShardError(why)
    model.shard(group)
    mx.eval(model.parameters())  # the shards now; the whole matrices can go
