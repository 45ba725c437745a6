"""Speculative decoding's policy in the decode batch: who drafts, how much, when.

A speculative step (workers/kernels/verify_step.py) checks every row's
drafts in one forward pass of the batch; a drafter proposes them
(workers/decode/prompt_lookup.py's `PromptLookup`: the row's own text;
workers/decode/draft_model.py's `DraftModel`: a small model of the same
tokenizer). This module decides, step by step:

  * whether to speculate at all: not when the batch has more rows than
    `max_rows` (past that a step of k + 1 tokens a row costs more than the
    tokens it gains: the step is compute-bound; BENCHMARKS.md has where that
    is per machine), nor while a row has just joined;
  * which rows draft: not rows with logits processors (penalties, bias: they
    need the context token by token), nor rows that follow a grammar (their
    masks are token by token); those rows ride along and are sampled from
    the step's first position, as an ordinary step samples them;
  * how many tokens each row drafts: the count that gives the most tokens
    per second, from the row's acceptance and what a drafted position
    costs on this machine at this batch size (`StepCosts`, timed as steps
    run: much of a step on a CPU, little on a GPU); none when no draft pays;
  * when a row stops drafting: when its acceptance (a running average)
    falls below `MIN_RATE` it rests for a while, longer each time; a new
    row starts from the acceptance of the rows before it (resting first
    when drafting has not paid lately: a draft model that is never right
    costs a few steps, not a few steps a request); a row whose lookups
    find nothing is asked again only every few steps. A step
    without drafts is an ordinary, pipelined step: an ordinary chat pays
    almost nothing (only the steps that look, which wait for the step
    before: a drafter needs the row's next input).

Counts (`proposed`, `accepted`) feed /metrics; each request's own counts
are logged (debug) when it ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from workers.kernels.verify_step import Verified, can_trim

log = logging.getLogger(__name__)

# A row whose drafts are accepted less than this (running average) rests.
MIN_RATE = 0.2
# Steps a resting row waits first; doubled each time it rests again, up to the longest.
REST_STEPS, LONGEST_REST = 8, 256
# Steps a row whose lookup found nothing waits before it looks again, at most.
IDLE_STEPS = 8


@dataclass
class RowSpeculation:
    """One request's drafting state and counts."""

    k: int
    rate: float = 0.5  # running average of the drafts kept / drafted (a neutral start)
    verified: int = 0  # steps its drafts were checked
    proposed: int = 0
    accepted: int = 0
    wait: int = 0  # steps before it drafts (or looks) again
    rest: int = REST_STEPS  # the next rest's length
    idle: int = 0  # consecutive looks that found nothing
    probe: bool = False  # after a rest: draft at least one token, to learn the rate again


class StepCosts:
    """What a speculative step costs on this machine against an ordinary
    one, learnt from the steps as they run, per batch size: an ordinary
    step's seconds (timed between two ordinary steps: pipelined, as they
    run), and a speculative step's as that times (fixed + per_draft x k),
    fitted to the recent steps (k: the most drafts a row ran). `fixed` is
    what waiting for the step's tokens costs (no pipelining: much of a step
    on a GPU bound by the host), `per_draft` the arithmetic of one more
    position a row (much of a step on a CPU, little on a GPU)."""

    SMOOTHING = 0.2

    def __init__(self, fixed: float = 1.0, per_draft: float = 0.1):
        self.default = (fixed, per_draft)  # until a batch size has both kinds of step timed
        self.plain: Dict[int, float] = {}
        self.moments: Dict[int, List[float]] = {}  # rows -> running means of k, ratio, k x ratio, k x k

    def ordinary(self, rows: int, seconds: float) -> None:
        self.plain[rows] = _average(self.plain.get(rows), seconds, self.SMOOTHING)
        m = self.moments.get(rows)
        if m is not None:
            # A dear speculative step fades back toward the default (1% a
            # step): drafts are tried again now and then, and timed again.
            m[:] = [_average(a, b, 0.01) for a, b in zip(m, self._default_moments(m[0]))]

    def speculative(self, rows: int, width: int, seconds: float) -> None:
        plain = self.plain.get(rows)
        if not plain or width < 2:
            return
        k, ratio = float(width - 1), seconds / plain
        new = [k, ratio, k * ratio, k * k]
        old = self.moments.get(rows)
        self.moments[rows] = new if old is None else [_average(a, b, self.SMOOTHING) for a, b in zip(old, new)]

    def state(self) -> list:
        """What it learnt, as msgpack-ready lists (a group's rank 0 sends its
        own to the followers before each decode step: workers/group/members.py)."""
        return [[[r, s] for r, s in self.plain.items()], [[r, list(m)] for r, m in self.moments.items()]]

    def load(self, state: list) -> None:
        """Take another's `state()`: its choices of k are this one's from now."""
        plain, moments = state
        self.plain = {int(r): float(s) for r, s in plain}
        self.moments = {int(r): [float(x) for x in m] for r, m in moments}

    def model(self, rows: int) -> Tuple[float, float]:
        """(fixed, per_draft): a speculative step of k drafts a row costs
        fixed + per_draft x k ordinary steps of `rows` rows."""
        m = self.moments.get(rows)
        if m is None:
            return self.default
        k, ratio, k_ratio, k_k = m
        spread = k_k - k * k
        if spread > 0.25:  # several widths seen: a line through them
            per_draft = max((k_ratio - k * ratio) / spread, 0.0)
            return max(ratio - per_draft * k, 1.0), per_draft
        # One width: all of the excess on the drafts (a cheap first draft, a dear long one, alike).
        return 1.0, max(ratio - 1.0, 0.0) / max(k, 1.0)

    def _default_moments(self, k: float) -> List[float]:
        fixed, per_draft = self.default
        ratio = fixed + per_draft * k
        return [k, ratio, k * ratio, k * k]


def _average(old: Optional[float], new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class Speculation:
    """The decode engine's speculative decoding (see the module doc)."""

    def __init__(self, drafter, max_tokens: int = 8, max_rows: int = 8, costs: Optional["StepCosts"] = None):
        self.drafter = drafter
        self.method = drafter.method
        self.max_tokens = max(1, int(max_tokens))
        self.max_rows = int(max_rows)
        self.rows: Dict[int, RowSpeculation] = {}
        self.proposed = self.accepted = 0  # since start, for /metrics
        self.recent_rate = 0.5  # drafts kept / drafted, a running average over every row's steps
        self.costs = costs if costs is not None else StepCosts()  # timed by the engine

    # ------------------------------------------------------------- rows --
    def leave(self, uid: int, request_id: str) -> None:
        """A request left the batch: its state goes, its counts are logged."""
        row = self.rows.pop(uid, None)
        self.drafter.leave(uid)
        if row is not None and row.proposed:
            log.debug("request %s: %s drafted %d tokens, %d accepted (%.0f%%) in %d steps", request_id,
                      self.method, row.proposed, row.accepted, 100.0 * row.accepted / row.proposed, row.verified)

    def _row(self, uid: int) -> RowSpeculation:
        row = self.rows.get(uid)
        if row is None:
            # A new request starts from what drafting has been worth lately
            # (a draft model of another family, text that never repeats):
            # below MIN_RATE it rests before its first draft.
            row = self.rows[uid] = RowSpeculation(k=1, rate=max(self.recent_rate, MIN_RATE))
            if self.recent_rate < MIN_RATE:
                row.wait, row.probe = REST_STEPS, True
        return row

    # ------------------------------------------------------------- steps --
    def plan(self, batch, fresh: bool) -> Optional[Tuple[List[int], List[List[int]]]]:
        """(the rows' next inputs, their drafts) for a speculative step, or
        None for an ordinary one. `fresh`: a row joined since the last step."""
        n = len(batch.uids)
        if fresh or n == 0 or n > self.max_rows or not can_trim(batch):
            return None
        asking: List[Tuple[int, int, int]] = []  # (row index, uid, k)
        for i, uid in enumerate(batch.uids):
            row = self._row(uid)
            if row.wait > 0:
                row.wait -= 1
                continue
            row.k = self.best_k(row.rate, n)
            if row.k == 0 and not row.probe:
                # No draft pays at this rate: rest, then try one (a rate that
                # is never tested again would never change).
                self._rest(row)
                continue
            row.k, row.probe = batch.budget(i).fit_draft(max(row.k, 1)), False
            if row.k > 0 and self._may_draft(batch, i, uid):
                asking.append((i, uid, row.k))
        if not asking:
            return None
        inputs = batch.next_inputs()
        drafts: List[List[int]] = [[] for _ in range(n)]
        for (i, uid, _), proposal in zip(asking, self.drafter.propose(batch, asking, inputs)):
            drafts[i] = proposal
            row = self.rows[uid]
            if proposal:
                row.idle = 0
            else:
                row.idle += 1
                row.wait = min(row.idle, IDLE_STEPS)
        return inputs, drafts

    def best_k(self, rate: float, rows: int) -> int:
        """Drafts for a row whose drafts are kept at `rate`, in a batch of
        `rows`: the k that gives the most tokens per unit of step time. A
        step gains 1 + rate + ... + rate^k tokens on average (runs of kept
        drafts, then the model's own) and costs 1 + k x the machine's cost of
        a position (StepCosts); 0 when no draft pays."""
        fixed, per_draft = self.costs.model(rows)
        best, best_value, gain, term = 0, 1.0, 1.0, 1.0
        for k in range(1, self.max_tokens + 1):
            term *= rate
            gain += term
            value = gain / (fixed + per_draft * k)
            if value > best_value * 1.02:  # a longer draft must pay clearly
                best, best_value = k, value
        return best

    @staticmethod
    def _rest(row: RowSpeculation) -> None:
        """No drafts for a while (longer each time), then at least one."""
        row.wait, row.rest, row.probe = row.rest, min(2 * row.rest, LONGEST_REST), True

    @staticmethod
    def _may_draft(batch, i: int, uid: int) -> bool:
        if batch.logits_processors and batch.logits_processors[i]:
            return False
        constrained = batch.constrained
        return not (constrained and uid in constrained.matchers)

    def record(self, uids: List[int], verified: Verified) -> None:
        """Learn from a speculative step (`uids`: the batch's rows before it)."""
        for uid, drafted, kept in zip(uids, verified.drafted, verified.accepted):
            if not drafted:
                continue
            self.proposed += drafted
            self.accepted += kept
            self.recent_rate = 0.9 * self.recent_rate + 0.1 * kept / drafted
            row = self.rows.get(uid)
            if row is None:
                continue
            row.verified += 1
            row.proposed += drafted
            row.accepted += kept
            row.rate = 0.7 * row.rate + 0.3 * kept / drafted
            # From a neutral start (0.5) three rejections in a row rest it;
            # from a poor recent record (MIN_RATE), one.
            if row.rate < MIN_RATE:
                self._rest(row)
                row.rate = max(self.recent_rate, MIN_RATE)  # a fresh start after the rest
            elif row.rate >= 0.5:
                row.rest = REST_STEPS


def speculation_for(settings, model) -> Optional[Speculation]:
    """The decode engine's Speculation under `settings` (environment/settings.py
    spec_method), or None (--speculative off)."""
    method = settings.spec_method()
    if method is None:
        return None
    if method == "draft":
        from workers.decode.draft_model import DraftModel
        from workers.grammar import logits_width
        from workers.models.loading import load_model

        draft, _ = load_model(settings.draft_model_dir)
        try:
            drafter = DraftModel(draft, vocab_limit=logits_width(model))
        except ValueError as exc:  # a draft whose KV cannot be cut back: say so, and draft from the text
            log.error("--draft-model %s cannot draft: %s; drafting by prompt lookup instead",
                      settings.draft_model_dir, exc)
            from workers.decode.prompt_lookup import PromptLookup

            drafter = PromptLookup()
    else:
        from workers.decode.prompt_lookup import PromptLookup

        drafter = PromptLookup()
    log.info("speculative decoding: %s, up to %d tokens a row, batches of up to %d rows", drafter.method,
             settings.spec_tokens, settings.spec_max_batch)
    return Speculation(drafter, settings.spec_tokens, settings.spec_max_batch)
