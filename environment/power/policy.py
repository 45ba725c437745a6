"""Which serving policy a power state calls for, and what each policy limits.

    auto:   critical thermal state        -> saver, new requests refused (429)
            Low Power Mode, battery under
            LOW_BATTERY_PERCENT, serious
            thermal state                 -> saver
            on battery                    -> balanced
            otherwise (AC, or unknown)    -> performance
    performance | balanced | saver: pinned whatever the state (a user who
            pins a policy is obeyed; the OS still throttles a hot machine).

What a policy limits, each never above what the settings allow:
- the decode batch per worker (rows beyond it finish; none join until below)
  and the prompts one prefill pass takes: smaller batches draw less power
  at a time, and a battery's charge lasts through a conversation;
- saver also: admission (the smaller batches plus a short queue, 429
  beyond), decode paced to a readable speed (a laptop that races through
  an answer nobody reads that fast only heats up), disk-tier writes and
  the warm-up deferred until the policy allows them again.
- saver also sends every prompt to the Neural Engine where
  `--prefill-backend auto` has one (short prompts too: it draws a fraction
  of the GPU's power).
"""

from __future__ import annotations

from dataclasses import dataclass

from environment.power.state import PowerState

POLICIES = ("performance", "balanced", "saver")
LOW_BATTERY_PERCENT = 20
BALANCED_MAX_BATCH = 8
BALANCED_PREFILL_BATCH = 4
SAVER_MAX_BATCH = 4
SAVER_QUEUE = 8  # saver admits its decode rows plus these
# Tokens per second per stream in saver: faster than anyone reads (~5-10
# tokens/s), slow enough that a batch's steps leave the chip idle between.
SAVER_PACE_TOKENS_PER_S = 20.0
THERMAL_RETRY_AFTER_S = 30  # a critical machine cools in tens of seconds, not one


@dataclass(frozen=True)
class PowerPolicy:
    name: str  # one of POLICIES
    reason: str  # why, in words, for the log and /health
    max_batch: int  # decode rows per worker
    prefill_batch: int  # prompts per prefill pass
    max_admitted: int | None = None  # requests admitted at once (None: the settings' capacity)
    pace_tokens_per_s: float = 0.0  # per stream; 0: unpaced
    defer_disk_writes: bool = False
    defer_warm_up: bool = False
    refuse_new: bool = False  # critical thermal state: 429 with Retry-After
    prefill_on_ane: bool = False  # every prompt to the Neural Engine where --prefill-backend auto has it

    def limits(self) -> tuple:
        """What a worker applies; equal limits need no update."""
        return (self.name, self.max_batch, self.prefill_batch, self.pace_tokens_per_s, self.defer_disk_writes,
                self.defer_warm_up, self.prefill_on_ane)


def choose(state: PowerState, requested: str) -> tuple[str, str, bool]:
    """(policy name, reason, refuse new requests?) for `state` under --power-policy."""
    if requested in POLICIES:
        return requested, f"pinned by --power-policy {requested}", False
    where = "on battery" + (f" at {state.percent}%" if state.percent is not None else "") \
        if state.source == "battery" else ("on AC power" if state.source == "ac" else "power source unknown")
    if state.thermal == "critical":
        return "saver", f"thermal state critical ({where}): new requests refused until it cools", True
    if state.low_power:
        return "saver", f"Low Power Mode is on ({where})", False
    if state.source == "battery" and state.percent is not None and state.percent < LOW_BATTERY_PERCENT:
        return "saver", f"{where}, under {LOW_BATTERY_PERCENT}%", False
    if state.thermal == "serious":
        return "saver", f"thermal state serious ({where})", False
    if state.source == "battery":
        return "balanced", where, False
    return "performance", f"{where}, thermal state {state.thermal}", False


def decide(state: PowerState, settings) -> PowerPolicy:
    """The policy in force for `state` under `settings` (environment.settings.Settings)."""
    name, reason, refuse = choose(state, settings.power_policy)
    if name == "performance":
        return PowerPolicy(name, reason, settings.max_batch, settings.prefill_batch)
    if name == "balanced":
        return PowerPolicy(name, reason, min(settings.max_batch, BALANCED_MAX_BATCH),
                           min(settings.prefill_batch, BALANCED_PREFILL_BATCH))
    max_batch = min(settings.max_batch, SAVER_MAX_BATCH)
    decoders = sum(1 for _, roles in settings.worker_plan() if "decode" in roles)
    return PowerPolicy(name, reason, max_batch, 1, max_admitted=max_batch * decoders + min(settings.max_queue, SAVER_QUEUE),
                       pace_tokens_per_s=SAVER_PACE_TOKENS_PER_S, defer_disk_writes=True, defer_warm_up=True,
                       refuse_new=refuse, prefill_on_ane=True)
