"""The chat workload: the sweep's closed-loop levels with ordinary chat
questions, short natural-language ones, instead of its word salad. Little in
an answer copies its prompt, so speculation has less to go on than in the
copy workload (issue 30: speculation must not make this slower).

A question is a pure function of (seed, salt), the salt naming the level and
the request's index in it, as in the copy workload.
"""

from __future__ import annotations

import random
import re

from benchmarks.bench.workloads.core import Target, WorkloadConfig, closed_loop_levels

QUESTIONS = (
    "How does a {a} differ from a {b}?",
    "What should I know before I buy a {a}?",
    "Why do people compare a {a} to a {b}?",
    "Can you explain to a child what a {a} is for?",
    "What are three good ways to look after a {a}?",
    "Write a short note to a friend about a {a} and a {b}.",
    "What is the history of the {a}, briefly?",
    "How would you plan a day around a {a} and a {b}?",
    "What mistakes do beginners make with a {a}?",
    "Which matters more in a small town, a {a} or a {b}, and why?",
    "Describe a {a} to someone who has never seen one.",
    "Give me a simple recipe or routine that involves a {a}.",
)
THINGS = """bicycle garden piano tent kettle camera lighthouse violin canoe telescope bakery library
backpack greenhouse sailboat guitar museum orchard compass lantern fireplace notebook umbrella tractor
windmill aquarium beehive castle harbor vineyard bookshelf train bridge market forest island village
river mountain window letter bread horse apple clock ladder teapot scooter hammock microscope kite
""".split()
OPENERS = ("", "Quick question.", "I am new to this.", "My friend asked me this.", "I have been wondering.",
           "For a school project:", "Out of curiosity:", "Help me out here.", "Something I never understood:",
           "Settle a debate for us.")
CLOSINGS = ("Answer in a few paragraphs.", "Keep it friendly.", "Use simple words.", "Give an example.",
            "Be practical.", "")


def chat_question(seed: int, salt: str) -> str:
    rng = random.Random(f"{seed}:{salt}")
    a, b = rng.sample(THINGS, 2)
    parts = (rng.choice(OPENERS), rng.choice(QUESTIONS).format(a=a, b=b), rng.choice(CLOSINGS))
    return re.sub(r"\ba ([aeiou])", r"an \1", " ".join(p for p in parts if p))


async def chat(target: Target, cfg: WorkloadConfig, energy=None, metrics_url: str | None = None) -> list[dict]:
    """The chat questions at each concurrency level: the sweep's figures per level."""
    def messages(c: int, client_i: int, i: int) -> list[dict]:
        return [{"role": "user", "content": chat_question(cfg.seed, f"chat-c{c}-req{i}")}]

    return await closed_loop_levels(target, cfg, "chat", messages, energy, metrics_url)
