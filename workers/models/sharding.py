"""A model split over the ranks of a worker group: tensor parallel (mlx-lm's
`shard`) or pipeline parallel (mlx-lm's `pipeline`).

mlx-lm's `Model.shard(group)` cuts each layer's q/k/v and gate/up
projections by output rows (all-to-sharded) and o/down by input columns
(sharded-to-all, an all_sum after them), and divides each attention's head
counts by the group's size: every rank then holds 1/N of the weights and of
the KV heads. That needs an architecture with a `shard` method and head,
KV-head and intermediate sizes that divide by N.

mlx-lm's `model.model.pipeline(group)` (PipelineMixin, models/pipeline.py)
keeps a contiguous run of layers per rank (rank 0 the last ones), sets the
others to None, and makes the body's forward receive the hidden state from
the rank before, send it on to the next, and all_gather the last one: every
rank computes the same logits, and `model.layers` (so every cache made from
it) is the rank's own layers. That needs an architecture whose body has a
`pipeline` method and at least N layers.

`shard_problem` and `pipeline_problem` say what is wrong from the config
alone (no MLX), so `tandem serve` refuses at the start, before any process
loads the weights; `shard_model` checks again on the loaded model and
splits it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


class ShardError(ValueError):
    """A model that cannot be split over this many ranks; the message says why."""


def _text_config(config: dict) -> dict:
    """The language model's part of a config (a VLM nests it)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _arch_source(model_type: str) -> str:
    """The source of mlx-lm's module for `model_type` ("" when there is none).
    Read instead of imported: the supervisor loads no MLX."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations or not model_type.isidentifier():
        return ""
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / f"{model_type}.py"
    try:
        return path.read_text()
    except OSError:
        return ""


def arch_can_shard(model_type: str) -> bool:
    """mlx-lm's module for `model_type` defines a `shard` method."""
    return "def shard(" in _arch_source(model_type)


def arch_can_pipeline(model_type: str) -> bool:
    """mlx-lm's module for `model_type` has a body with a `pipeline` method
    (PipelineMixin, or its own)."""
    source = _arch_source(model_type)
    return "PipelineMixin" in source or "def pipeline(" in source


def _arch_problem(cfg: dict, can, verb: str, method: str) -> str | None:
    """Why mlx-lm's module for `cfg`'s model type cannot `verb` it (`can`:
    arch_can_shard or arch_can_pipeline), or None."""
    model_type = str(cfg.get("model_type", ""))
    if can(model_type):
        return None
    return f"mlx-lm cannot {verb} a {model_type or 'model of unknown type'} model (its architecture has no {method})"


def shard_problem(config: dict, ranks: int) -> str | None:
    """Why a model of `config` (its config.json) cannot be split over `ranks`
    tensor-parallel ranks, or None when it can."""
    if ranks <= 1:
        return None
    cfg = _text_config(config)
    why = _arch_problem(cfg, arch_can_shard, "shard", "tensor-parallel `shard` method")
    if why:
        return why
    sizes = {"attention heads": cfg.get("num_attention_heads"),
             "KV heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
             "intermediate size": cfg.get("intermediate_size")}
    bad = [f"{n} {what}" for what, n in sizes.items() if isinstance(n, int) and n % ranks]
    if bad:
        return (f"its {', '.join(bad)} do not divide by --tensor-parallel {ranks} "
                f"(each rank takes an equal share of the heads and of the MLP)")
    return None


def pipeline_problem(config: dict, ranks: int) -> str | None:
    """Why a model of `config` cannot be split over `ranks` pipeline ranks
    (a run of whole layers each), or None when it can."""
    if ranks <= 1:
        return None
    cfg = _text_config(config)
    why = _arch_problem(cfg, arch_can_pipeline, "pipeline", "pipeline-parallel `pipeline` method")
    if why:
        return why
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and layers < ranks:
        return f"its {layers} layers are fewer than --pipeline-parallel {ranks} (each rank takes whole layers)"
    return None


def folder_shard_problem(model_dir: str | Path, ranks: int, pipeline: bool = False) -> str | None:
    """`shard_problem` (`pipeline`: `pipeline_problem`) for a model folder (reads its config.json)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read ({exc})"
    return pipeline_problem(config, ranks) if pipeline else shard_problem(config, ranks)


def shard_model(model, group, pipeline: bool = False) -> None:
    """Split `model` (an mlx-lm model, loaded lazily) in place over `group`
    (an mx.distributed.Group): this rank keeps its share of every layer, or
    with `pipeline` its run of whole layers. Raises ShardError when it cannot
    be split over that many ranks."""
    import mlx.core as mx

    if pipeline:
        _pipeline(model, group)
    else:
        _shard(model, group)
    # What the rank keeps, read now; what it dropped was never evaluated (the
    # load was lazy), so its weights are never read.
    mx.eval(model.parameters())


def _pipeline(model, group) -> None:
    ranks = group.size()
    body = getattr(model, "model", None)
    if not callable(getattr(body, "pipeline", None)):
        raise ShardError(f"mlx-lm cannot pipeline a {getattr(model, 'model_type', type(model).__name__)} model "
                         "(its architecture has no pipeline-parallel `pipeline` method)")
    layers = len(body.layers)
    if layers < ranks:
        raise ShardError(f"its {layers} layers are fewer than --pipeline-parallel {ranks} "
                         "(each rank takes whole layers)")
    body.pipeline(group)
    start, end = getattr(body, "start_idx", None), getattr(body, "end_idx", None)  # PipelineMixin's
    if isinstance(start, int) and isinstance(end, int):
        log.info("pipeline rank %d of %d keeps layers %d-%d of %d", group.rank(), ranks, start, end - 1, layers)


def is_pipelined(model) -> bool:
    """`model`'s body runs part of a pipeline (mlx-lm's `pipeline` was called).
    Its forward ties the send of a rank's hidden state to its last layer's
    `cache.keys` (mx.depends), so that evaluating the KV also sends; a cache
    without such an array (workers/decode/ragged_kv.py) would let a rank
    evaluate its KV and leave the next rank waiting in its recv."""
    return getattr(getattr(model, "model", None), "pipeline_size", 1) > 1


def _shard(model, group) -> None:
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
