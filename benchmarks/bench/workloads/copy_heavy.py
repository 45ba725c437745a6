"""The copy workload: closed-loop clients at each concurrency level (as the
sweep), every answer mostly a copy of its prompt: what speculative decoding
by prompt lookup speeds up (issue 30). Three kinds of request in rotation:

- edit: a seeded passage of ~prompt_words words, to be returned unchanged but
  for one named word replaced by another;
- extract: a seeded order record, part prose and part `key: value` lines, to be
  returned as a JSON object with the keys named. A plain instruction, not
  `response_format`: not every peer constrains decoding, and a grammar would
  change what a speculative step may propose;
- tool: a tool loop: the assistant called write_file with long JSON arguments
  (a path and a seeded content string), the tool result echoes them, and the
  user asks for the call again with the same arguments, answered as text with
  the arguments verbatim. No `tools` in the request, so the answer streams as
  text on every server and counts as tokens like the others.

Greedy, answers of cfg.max_tokens. A prompt is a pure function of (seed,
salt), the salt naming the level and the request's index in it: every system
gets the same prompts at a level whatever order its clients take them in.
"""

from __future__ import annotations

import hashlib
import json
import random

from benchmarks.bench.workloads.core import Target, WorkloadConfig, closed_loop_levels, words

COPY_KINDS = ("edit", "extract", "tool")
# Not among workloads.words' words, so the edit's new word is not in the passage already.
_NEW_WORDS = ("lantern", "violet", "harbor", "copper", "meadow", "falcon", "marble", "canyon", "velvet", "orchard")
_CITIES = ("Lisbon", "Oslo", "Austin", "Dublin", "Kyoto", "Nairobi", "Lima", "Tallinn", "Perth", "Quebec")
_STATUSES = ("pending", "paid", "shipped", "delivered", "returned")
EXTRACT_KEYS = ("order_id", "customer", "email", "city", "order_date", "product", "quantity", "unit_price",
                "status", "notes")


def copy_kind(request: int) -> str:
    """The kind of the level's `request`-th request: the three in turn."""
    return COPY_KINDS[request % len(COPY_KINDS)]


def copy_messages(seed: int, salt: str, kind: str, n_words: int) -> list[dict]:
    """The messages of one copy request of `kind`; ~n_words words to copy."""
    if kind == "edit":
        return [{"role": "user", "content": edit_prompt(seed, salt, n_words)}]
    if kind == "extract":
        return [{"role": "user", "content": extract_prompt(seed, salt, n_words)}]
    if kind == "tool":
        return tool_loop_messages(seed, salt, n_words)
    raise ValueError(f"unknown copy kind {kind!r} (known: {', '.join(COPY_KINDS)})")


def edit_prompt(seed: int, salt: str, n_words: int) -> str:
    """Return the passage with one word replaced. The salt leads, so two prompts share no prefix."""
    passage = words(n_words, seed, f"{salt}:passage")
    rng = random.Random(f"{seed}:{salt}:edit")
    old = rng.choice(passage.split())
    new = rng.choice(_NEW_WORDS)
    return (f"[{salt}] Return the text between the markers exactly as it is, except that every \"{old}\" "
            f"becomes \"{new}\". Write the text only, without the markers.\n<<<\n{passage}\n>>>")


def order_record(seed: int, salt: str, n_words: int) -> dict:
    """A seeded order, its notes long enough that the record is ~n_words words."""
    rng = random.Random(f"{seed}:{salt}:record")
    first, last, host = words(3, seed, f"{salt}:name").split()
    return {"order_id": f"ORD-{rng.randrange(10**6, 10**7)}", "customer": f"{first.title()} {last.title()}",
            "email": f"{first}.{last}@{host}.example.com", "city": rng.choice(_CITIES),
            "order_date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "product": words(3, seed, f"{salt}:product"), "quantity": rng.randint(1, 50),
            "unit_price": round(rng.uniform(1, 500), 2), "status": rng.choice(_STATUSES),
            # ~30 words of the record as the prompt writes it are not notes
            "notes": words(max(8, n_words - 30), seed, f"{salt}:notes")}


def extract_prompt(seed: int, salt: str, n_words: int) -> str:
    """Return a record's fields, written half as prose and half as `key: value` lines, as JSON."""
    r = order_record(seed, salt, n_words)
    prose = (f"Order {r['order_id']} was placed by {r['customer']} ({r['email']}) from {r['city']} "
             f"on {r['order_date']}.")
    lines = "\n".join(f"{k}: {r[k]}" for k in ("product", "quantity", "unit_price", "status", "notes"))
    return (f"[{salt}] Extract the order below into one JSON object with exactly the keys "
            f"{', '.join(EXTRACT_KEYS)}, each value copied from the record as it is written (quantity and "
            f"unit_price as numbers). Write the JSON only.\n\n{prose}\n{lines}")


def tool_loop_messages(seed: int, salt: str, n_words: int) -> list[dict]:
    """A write_file call with long arguments, a result that echoes them, and a
    user turn asking for the same call again, answered as the arguments verbatim."""
    rng = random.Random(f"{seed}:{salt}:tool")
    path = f"/srv/{rng.choice(('notes', 'docs', 'wiki'))}/{'/'.join(words(2, seed, f'{salt}:path').split())}.md"
    arguments = {"path": path, "content": words(n_words, seed, f"{salt}:content")}
    call_id = "call_" + hashlib.sha256(f"{seed}:{salt}".encode()).hexdigest()[:16]
    return [
        {"role": "system", "content": f"[{salt}] You are a file agent. The write_file tool saves a file; its "
                                      "arguments are a JSON object with a path and the content as a string."},
        {"role": "user", "content": f"Save the notes we drafted to {path}."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "write_file", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(
            {"written": False, "error": "conflict: the file changed while it was written", "arguments": arguments})},
        {"role": "user", "content": "It did not save. Call write_file again with exactly the same arguments: "
                                    "answer with the arguments JSON object verbatim and nothing else."},
    ]


async def copy(target: Target, cfg: WorkloadConfig, energy=None, metrics_url: str | None = None) -> list[dict]:
    """The copy requests at each concurrency level: the sweep's figures per level."""
    def messages(c: int, client_i: int, i: int) -> list[dict]:
        return copy_messages(cfg.seed, f"copy-c{c}-req{i}", copy_kind(i), cfg.prompt_words)

    return await closed_loop_levels(target, cfg, "copy", messages, energy, metrics_url)
