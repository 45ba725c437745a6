"""The grammar a request may carry (`SamplingParams.grammar`).

It is llguidance's grammar text (JSON schema, Lark or regex, wrapped as
llguidance wants it): the router builds it from `response_format` or a forced
tool call and checks it, and every worker that samples a token for the
request (prefill's first token, decode's others) follows it with a matcher
of its own. Both ends read it against the same vocabulary, built here from
the served model's tokenizer.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict

# By the tokenizer object, for as long as it lives: a model the router unloads
# takes its llguidance tokenizer (tens of MiB) with it.
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, n_vocab: int | None = None):
    """llguidance's view of `tokenizer` (anything with a `tokenizers`
    `backend_tokenizer`: the router's ModelTokenizer, mlx-lm's
    TokenizerWrapper, a Hugging Face fast tokenizer), with the model's
    end-of-sequence ids.
    `n_vocab`: the width of the model's logits when it exceeds the
    tokenizer's (padded embeddings). Building one takes ~0.5 s (serializing
    the tokenizer alone ~60 ms): kept while the tokenizer object lives."""
    with _LOCK:
        try:
            built = _BUILT.setdefault(tokenizer, {})
        except TypeError:  # an object no weak reference can name: built each time
            built = {}
        found = built.get(n_vocab)
    if found is None:  # built outside the lock: another model's lookups never wait for it
        found = built.setdefault(n_vocab, _build(tokenizer, n_vocab))
    return found


def per_tokenizer(maxsize: int):
    """A cache for `fn(tokenizer, *args)`: per tokenizer object (weakly: an
    unloaded model's tokenizer is not kept by it), its `maxsize` most recent
    argument tuples."""

    def wrap(fn):
        tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        lock = threading.Lock()

        @functools.wraps(fn)
        def cached(tokenizer, *args):
            with lock:
                try:
                    table = tables.setdefault(tokenizer, OrderedDict())
                except TypeError:  # no weak reference to it: not cached
                    table = OrderedDict()
                if args in table:
                    table.move_to_end(args)
                    return table[args]
            value = fn(tokenizer, *args)
            with lock:
                table[args] = value
                while len(table) > maxsize:
                    table.popitem(last=False)
            return value

        return cached

    return wrap


def _build(tokenizer, n_vocab: int | None):
    import llguidance

    backend = tokenizer.backend_tokenizer  # TokenizerWrapper forwards it to the HF tokenizer's
    eos = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=sorted(int(t) for t in eos))


def grammar_error(grammar: str, ll_tok) -> str:
    """What llguidance finds wrong with `grammar` ("" when it compiles and
    its first token has a mask): the router refuses such a grammar, so no
    worker meets it."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar, ll_tok)
    if problem:
        return problem
    return first_mask_error(llguidance.LLMatcher(ll_tok, grammar, log_level=0))


def first_mask_error(matcher) -> str:
    """The error of a freshly compiled `matcher` once its first mask is
    computed ("": none). Some grammars validate and compile, yet nothing can
    follow them: a JSON schema whose `$ref` leads only back to itself fails
    here, at the first token, which a worker would otherwise meet mid-batch."""
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return ""
    error = (matcher.get_error() or "unknown grammar error").strip().splitlines()[0]
    return f"nothing can be generated under it ({error})"
