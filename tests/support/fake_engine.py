"""A scripted Engine for testing the HTTP layer, and a tiny real tokenizer to go with it.

The tokenizer is a byte-level BPE trained in milliseconds on a few sentences, saved as a
model folder (tokenizer.json + tokenizer_config.json with a ChatML template) and loaded
through mlx-lm like any model's. Its small vocabulary leaves emoji, CJK and rare words in
several tokens, which is what the detokenizer and stop-string tests need.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper, load as load_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from protos.messages import TokenLogprob
from router.routing.engine_api import EngineError, EngineEvent, GenerationRequest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world. The capital of France is Paris. Hello there, how are you?",
    "the quick brown fox jumps over the lazy dog; a cat sat on the mat.",
] * 5


# A reasoning model's template (Qwen3's way): the answer opens with its
# thinking, which the prompt has already begun.
CHATML_THINKING = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")


def build_tokenizer(folder: Path, thinking: bool = False) -> TokenizerWrapper:
    """With `thinking`: <think> and </think> are special tokens, and the
    template opens the answer's thinking."""
    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<think>", "</think>"] if thinking else []),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    bpe.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "chat_template": CHATML_THINKING if thinking else CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


class FakeEngine:
    """Implements router.routing.engine_api.Engine. Set the knobs, then read what happened."""

    def __init__(self, tokenizer: TokenizerWrapper, model_id: str = "tandem-test", max_context: int = 512):
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_context = max_context
        self.eos_id = min(tokenizer.eos_token_ids)
        self.reset()

    def reset(self) -> None:
        # Knobs
        self.script: list[int] = []  # tokens to generate; EOS follows when it runs out
        self.first_token_delay_s = 0.0  # a "prefill"
        self.token_delay_s = 0.0
        self.error_before: EngineError | None = None  # raised before the first token
        self.error_after: tuple[int, EngineError] | None = None  # (tokens sent first, error)
        self.cached_tokens = 0
        self.ready = True
        # Records
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []  # closed or cancelled before finishing
        self.finished: list[str] = []

    def say(self, text: str) -> None:
        self.script = self.tokenizer.encode(text, add_special_tokens=False)

    def health(self) -> tuple[bool, dict]:
        state = "ready" if self.ready else "dead"
        return self.ready, {"model": self.model_id, "workers": [{"role": "decode", "pid": 1, "state": state}]}

    async def metrics_text(self) -> str:
        return "tandem_fake_requests_total %d\n" % len(self.requests)

    async def generate(self, req: GenerationRequest):
        self.requests.append(req)
        done = False
        try:
            if self.error_before is not None:
                raise self.error_before
            await asyncio.sleep(self.first_token_delay_s)
            tokens = self.script + [self.eos_id]
            for i, token in enumerate(tokens):
                if self.error_after is not None and i == self.error_after[0]:
                    raise self.error_after[1]
                if i:
                    await asyncio.sleep(self.token_delay_s)
                finish = "stop" if token == self.eos_id else "length" if i + 1 == req.sampling.max_tokens else None
                done = finish is not None
                yield EngineEvent(token, self._logprob(req, token), finish, self.cached_tokens)
                if done:
                    return
        except EngineError:
            done = True
            raise
        finally:
            (self.finished if done else self.cancelled).append(req.request_id)

    def _logprob(self, req: GenerationRequest, token: int) -> TokenLogprob | None:
        if not req.sampling.logprobs:
            return None
        others = [t for t in range(3, 3 + req.sampling.top_logprobs) if t != token]
        top = [[token, -0.25]] + [[t, -2.0 - i] for i, t in enumerate(others)]
        return TokenLogprob(token, -0.25, top[: req.sampling.top_logprobs])
