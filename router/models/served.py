"""One model as the HTTP side serves it: its engine (the dispatcher that
talks to its workers), its tokenizer and everything kept per model (the
sampling defaults, recent answers' tokens, a VLM's prompter and images).

Every endpoint takes a request's model from the pool (router/models/pool.py)
as one of these and never mixes two models' parts: a prompt is templated by
the tokenizer of the model whose workers run it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from environment.generation_defaults import GenerationDefaults, generation_defaults
from environment.model_folder import is_vlm, model_kind
from router.api.answer_tokens import AnswerTokens
from router.media.decode import RecentImages
from router.routing.engine_api import Engine
from router.text.text_stream import TokenBytes


@dataclass
class ServedModel:
    engine: Engine
    tokenizer: object  # router/text/tokenizer.py ModelTokenizer (or mlx-lm's TokenizerWrapper, whose names it keeps)
    model_dir: str = ""
    kind: str = "chat"  # "chat", "vision" or "embedding" (environment/model_folder.py model_kind)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # for fields a request leaves out
    vision: object | None = None  # a VLM's prompter (router/media/vision_prompt.py)
    token_bytes: TokenBytes | None = None  # a cache over the vocabulary
    answers: AnswerTokens | None = None  # recent answers' tokens, for the next turn's prompt
    recent_images: RecentImages | None = None

    def __post_init__(self):
        if self.token_bytes is None:
            self.token_bytes = TokenBytes(self.tokenizer)
        if self.answers is None:
            self.answers = AnswerTokens(self.token_bytes)
        if self.recent_images is None and self.vision is not None:
            self.recent_images = RecentImages()

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @classmethod
    def of(cls, engine: Engine, tokenizer, model_dir: str = "") -> "ServedModel":
        """A model served from `model_dir` (may be "" for a test's engine):
        its defaults, its kind, and a VLM's prompter."""
        if not model_dir:
            return cls(engine, tokenizer)
        vision = _vision_prompter(model_dir) if is_vlm(model_dir) else None
        return cls(engine, tokenizer, model_dir, model_kind(model_dir), generation_defaults(model_dir), vision)

    @classmethod
    def load(cls, engine: Engine, model_dir: str) -> "ServedModel":
        """(Blocking: run it off the event loop.) The folder's tokenizer read,
        llguidance's view of it built in the background (~0.5 s, not by the
        first request with a schema)."""
        from protos.grammar import ll_tokenizer
        from router.text.tokenizer import ModelTokenizer

        tokenizer = ModelTokenizer.load(model_dir)
        threading.Thread(target=ll_tokenizer, args=(tokenizer,), name="grammar-tokenizer", daemon=True).start()
        return cls.of(engine, tokenizer, model_dir)


def _vision_prompter(model_dir: str):
    """A VLM's prompter: imported only for one, since it brings MLX and
    mlx-vlm (its processor, the placeholders' layout), which a text model's
    router does without."""
    from router.media.vision_prompt import VisionPrompter

    return VisionPrompter(model_dir)
