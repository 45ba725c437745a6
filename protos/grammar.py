"""The grammar a request may carry (`SamplingParams.grammar`).

It is llguidance's grammar text (JSON schema, Lark or regex, wrapped as
llguidance wants it): the router builds it from `response_format` or a forced
tool call and checks it, and every worker that samples a token for the
request (prefill's first token, decode's others) follows it with a matcher
of its own. Both ends read it against the same vocabulary, built here from
the served model's tokenizer.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def ll_tokenizer(tokenizer, n_vocab: int | None = None):
    """llguidance's view of `tokenizer` (mlx-lm's TokenizerWrapper, or a
    Hugging Face fast tokenizer), with the model's end-of-sequence ids.
    `n_vocab`: the width of the model's logits when it exceeds the
    tokenizer's (padded embeddings). Building one takes ~0.5 s (serializing
    the tokenizer alone ~60 ms): cached by the tokenizer object."""
    import llguidance

    backend = tokenizer.backend_tokenizer  # TokenizerWrapper forwards it to the HF tokenizer
    eos = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=sorted(int(t) for t in eos))


def grammar_error(grammar: str, ll_tok) -> str:
    """What llguidance finds wrong with `grammar` ("" when it compiles)."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar, ll_tok)
