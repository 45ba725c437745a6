"""Tiny random-weight embedding models for tests (no downloads; built in a second).

`make_tiny_qwen3_embedder(path)`: a Qwen3 decoder laid out as Qwen3-Embedding
is: mlx-lm's qwen3 weights (tests/support/tiny_models.py make_tiny_model),
the embedded model's tokenizer with a post-processor that appends
`<|endoftext|>` to every text (as Qwen3-Embedding's tokenizer.json does), and
sentence-transformers' files (modules.json, last-token pooling, Normalize),
so environment/model_folder.py `model_kind` says "embedding" and `tandem
serve` runs it as one.

`make_tiny_bert(path, pooling)`: a random BERT as mlx-embeddings builds it
(config `BertModel`: an embedding model by its architecture), with
sentence-transformers' pooling config when `pooling` is given ("mean" or "cls").
No tokenizer: its tests work on token ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.support.tiny_models import make_tiny_model

EOT = "<|endoftext|>"
TINY_QWEN3_EMBEDDER = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],  # as Qwen3-Embedding's config says
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,  # the borrowed tokenizer's
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
}
TINY_BERT = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "vocab_size": 512,
    "layer_norm_eps": 1e-12,
}
_POOLING_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_sentence_transformers(path: Path, pooling: str, width: int) -> None:
    """modules.json (Transformer, Pooling, Normalize) and the pooling's config, as sentence-transformers writes them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: flag == _POOLING_FLAGS[pooling] for flag in _POOLING_FLAGS.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": width, **flags,
                                                                "include_prompt": True}, indent=2))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}))


def make_tiny_qwen3_embedder(path, seed: int = 0) -> Path:
    path = make_tiny_model(path, TINY_QWEN3_EMBEDDER, seed)
    write_embedder_tokenizer(path)
    write_sentence_transformers(path, "last", TINY_QWEN3_EMBEDDER["hidden_size"])
    return path


def write_embedder_tokenizer(path, source: Path | None = None) -> Path:
    """The embedded model's tokenizer (or `source`'s) in `path`, appending
    <|endoftext|> to every text (as Qwen3-Embedding's tokenizer.json does since June 2025)."""
    from tokenizers import Tokenizer, processors

    from benchmarks.random_models.embedded import embedded_model_dir

    path, source = Path(path), Path(source) if source else embedded_model_dir()
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {EOT}:0", pair=f"$A:0 {EOT}:0 $B:1 {EOT}:1", special_tokens=[(EOT, tok.token_to_id(EOT))])
    tok.save(str(path / "tokenizer.json"))
    shutil.copyfile(source / "tokenizer_config.json", path / "tokenizer_config.json")
    return path


def make_tiny_bert(path, pooling: str | None = None, seed: int = 0) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models.bert import Model, ModelArgs

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = Model(ModelArgs.from_dict(TINY_BERT))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("bias"):
            w = rng.standard_normal(p.shape) * 0.1
        elif p.ndim < 2:
            w = 1.0 + rng.standard_normal(p.shape) * 0.1  # LayerNorm scales
        else:
            w = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        weights[name] = mx.array(w.astype(np.float32))
    (path / "config.json").write_text(json.dumps(TINY_BERT, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if pooling is not None:
        write_sentence_transformers(path, pooling, TINY_BERT["hidden_size"])
    return path


def last_token_embedder_files(path) -> Path:
    """A Qwen3-Embedding-like folder without weights (the tokenizer and
    sentence-transformers' files, last-token pooling, 8 wide): what the
    router reads of an embedding model."""
    path = write_embedder_tokenizer(path)
    write_sentence_transformers(path, "last", 8)
    return path


class InlineTicket:
    """An admission ticket (router/guards/admission.py) whose off-loop work runs inline."""

    async def off_loop(self, fn, *args):
        return fn(*args)

    def also_release(self, fn):
        pass
