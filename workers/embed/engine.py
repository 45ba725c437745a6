"""An embedding model's forward passes (the embed role's engine, workers/embed/role.py).

Two kinds of model (environment/embedding_config.py says which a folder is):

- Last-token decoders, the Qwen3-Embedding family, through mlx-lm's own model:
  the final hidden state (after the final norm: `model.model(...)`) of each
  input's last token. Inputs share a pass right-padded: under the causal mask
  no real token attends to the padding after it and positions start at 0 in
  every row, so each row's states are its own alone (left padding would need
  a mask and shifted positions); a row's vector is read at its own last
  token, not the pass's. An input longer than a pass runs alone, a pass of
  `tokens_per_pass` at a time, through a KV cache (`Long`).
- BERT-family encoders through mlx-embeddings' models: every token's last
  hidden state under the attention mask (padding masked out), pooled by mean
  over the input's tokens or its first token (CLS), as its
  sentence-transformers files say.

Every vector comes back L2-normalised, float32.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from environment.backend import on_cpu
from environment.embedding_config import embedding_config
from environment.model_folder import ModelError

PAD_ID = 0  # right padding's token: no real token ever attends to it (decoders) or it is masked (encoders)
MIN_BUCKET = 16  # the fewest tokens a bucketed pass pads its rows to


def normalised(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (a zero row stays zero), float32."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def cut(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """Matryoshka: the first `dimensions` components, renormalised (0: as they are)."""
    return vectors if not dimensions or dimensions >= vectors.shape[-1] else normalised(vectors[:, :dimensions])


@dataclass
class Long:
    """A decoder input longer than one pass, run a pass at a time through a KV cache."""

    tokens: list[int]
    cache: list = field(default_factory=list)
    done: int = 0  # tokens run so far


class EmbedEngine:
    """`embed(rows)`: one pass over several inputs; `batch_size(lengths)`: how
    many of the queued inputs' lengths (in order) one pass takes."""

    def __init__(self, model_dir: str, tokens_per_pass: int, model=None, buckets: bool | None = None):
        self.config = embedding_config(model_dir)
        self.tokens_per_pass = max(1, tokens_per_pass)
        # A pass's shape rounded up to powers of two (rows, and tokens from 16, within
        # the model's positions) on a GPU, where a shape's first pass is slow (on the
        # H200 a first pass of 56-58 rows took ~300 ms, against 12 ms once warm):
        # bounded shapes pay that a few dozen times, not per batch size and length.
        # On the CPU padding is only cost.
        self.buckets = not on_cpu() if buckets is None else buckets
        self.model = model if model is not None else (_load_decoder(model_dir) if self.config.decoder
                                                       else _load_encoder(model_dir))
        self.width = _width(self.model)
        self.vocab = _vocab(self.model)  # ids past it would read outside the embedding table
        self.positions = _arg(self.model, "max_position_embeddings") or 1 << 30

    @property
    def matryoshka(self) -> bool:
        return self.config.matryoshka

    def batch_size(self, lengths: list[int]) -> int:
        """How many of the first inputs (by their lengths) one pass takes:
        padded to the longest within tokens_per_pass; always the first."""
        n, longest = 0, 0
        for length in lengths:
            longest = max(longest, length)
            if n and (n + 1) * longest > self.tokens_per_pass:
                break
            n += 1
        return n

    def runs_long(self, length: int) -> bool:
        """Whether an input this long runs a pass at a time (a decoder's past one pass)."""
        return self.config.decoder and length > self.tokens_per_pass

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """One pass over `rows` (each a non-empty list of token ids): [n, width], normalised."""
        n = len(rows)
        lengths = [len(r) for r in rows]
        longest = max(lengths)
        if self.buckets:  # padding rows (one pad token each) and columns: no real token sees them
            longest = max(longest, min(max(MIN_BUCKET, _next_power_of_two(longest)), self.positions))
            rows, lengths = rows + [[PAD_ID]] * (_next_power_of_two(n) - n), lengths + [1] * (_next_power_of_two(n) - n)
        ids = mx.array([r + [PAD_ID] * (longest - len(r)) for r in rows], dtype=mx.int32)
        if self.config.decoder:
            states = self.model.model(ids)  # [n, L, width]: the final norm's output
            pooled = states[mx.arange(len(rows)), mx.array(lengths) - 1]
        else:
            mask = (mx.arange(longest)[None, :] < mx.array(lengths)[:, None]).astype(mx.float32)
            states = self.model(ids, attention_mask=mask).last_hidden_state
            if self.config.pooling == "cls":
                pooled = states[:, 0]
            else:
                pooled = (states * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return normalised(np.array(pooled[:n].astype(mx.float32)))

    def start_long(self, tokens: list[int]) -> Long:
        from mlx_lm.models.cache import make_prompt_cache

        return Long(tokens, make_prompt_cache(self.model))

    def step_long(self, long: Long) -> np.ndarray | None:
        """One pass of a long input; its vector [1, width] after its last."""
        chunk = long.tokens[long.done:long.done + self.tokens_per_pass]
        states = self.model.model(mx.array([chunk], dtype=mx.int32), cache=long.cache)
        long.done += len(chunk)
        if long.done < len(long.tokens):
            mx.eval([c.state for c in long.cache])
            return None
        return normalised(np.array(states[:, -1].astype(mx.float32)))


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _arg(model, name: str):
    """A model's config value: mlx-lm's keep it in `args`, mlx-embeddings' in `config`."""
    return getattr(getattr(model, "args", None) or getattr(model, "config", None), name, None)


def _vocab(model) -> int:
    return int(_arg(model, "vocab_size"))


def _width(model) -> int:
    return int(_arg(model, "hidden_size"))


def _load_decoder(model_dir: str):
    """mlx-lm's model for the folder: an mlx-lm conversion, or Hugging Face's
    own checkpoint of the bare model (Qwen3-Embedding's names its weights
    without the "model." prefix and has no lm_head). Dequantized to float32
    on the CPU backend, as every model worker's (workers/models/loading.py)."""
    from mlx_lm.utils import dequantize_model, load_model

    def classes(config: dict):
        arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        model_class, args_class = arch.Model, arch.ModelArgs

        class Embedder(model_class):
            def sanitize(self, weights):
                if not any(k.startswith("model.") for k in weights):
                    weights = {f"model.{k}": v for k, v in weights.items()}
                if "lm_head.weight" not in weights and "lm_head" in self:
                    self.pop("lm_head")  # never run: the vector is the hidden state
                return super().sanitize(weights)

        return Embedder, args_class

    try:
        model, _ = load_model(Path(model_dir), get_model_classes=classes)
    except (FileNotFoundError, ValueError, KeyError, ImportError) as exc:
        raise ModelError(f"{model_dir}: cannot load embedding model ({' '.join(str(exc).split())})") from None
    return _cpu_float32(model, dequantize_model)


def _load_encoder(model_dir: str):
    try:
        from mlx_embeddings.utils import load_model
    except ImportError:
        raise ModelError(f"{model_dir}: an encoder embedding model needs the mlx-embeddings package") from None
    try:
        model = load_model(Path(model_dir), path_to_repo=str(model_dir))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ModelError(f"{model_dir}: cannot load embedding model ({' '.join(str(exc).split())})") from None
    return _cpu_float32(model, None)


def _cpu_float32(model, dequantize):
    if not on_cpu():
        return model
    if dequantize is not None and any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                                      for _, m in model.named_modules()):
        model.set_dtype(mx.float32)
        model = dequantize(model)
    model.set_dtype(mx.float32)  # no fast fp16 BLAS on the CPU
    mx.eval(model.parameters())
    return model
