"""Prometheus metrics the router exposes at /metrics.

Request-level numbers (latencies, tokens, outcomes) are observed by the
dispatcher as events pass through it; worker and cache-service numbers are
read at scrape time from the latest heartbeats and cache stats, so a scrape
never waits on another process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from environment.power.policy import POLICIES
from router.guards.slow_clients import WriteTimeouts

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120)


class _LiveState:
    """Collector over the dispatcher's view of workers and the cache service."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher

    def collect(self):
        d = self.dispatcher
        running = GaugeMetricFamily("tandem_worker_requests_running", "Requests a worker is prefilling or decoding",
                                    labels=["role", "pid"])
        waiting = GaugeMetricFamily("tandem_worker_requests_waiting", "Requests queued inside a worker",
                                    labels=["role", "pid"])
        kv = GaugeMetricFamily("tandem_worker_kv_bytes", "KV bytes a worker holds for live requests",
                               labels=["role", "pid"])
        hot = GaugeMetricFamily("tandem_worker_hot_kv_bytes", "Prefix-cache KV a worker keeps in its own memory",
                                labels=["role", "pid"])
        hot_hits = CounterMetricFamily("tandem_worker_hot_kv_hit_blocks",
                                       "KV blocks a worker took from its own memory instead of the arena",
                                       labels=["role", "pid"])
        batched = CounterMetricFamily("tandem_worker_batched_prompts",
                                      "Prompts a worker prefilled in one pass with others",
                                      labels=["role", "pid"])
        batch_limit = GaugeMetricFamily("tandem_worker_decode_batch_limit",
                                        "Decode rows per step a worker allows now (the power policy's)",
                                        labels=["role", "pid"])
        for w in d.workers.values():
            labels = ["+".join(w.hello.roles), str(w.hello.pid)]
            running.add_metric(labels, w.hello.running)
            waiting.add_metric(labels, w.hello.waiting)
            kv.add_metric(labels, w.hello.kv_bytes)
            hot.add_metric(labels, w.hello.hot_kv_bytes)
            hot_hits.add_metric(labels, w.hello.hot_kv_hits)
            batched.add_metric(labels, w.hello.batched_prompts)
            if "decode" in w.hello.roles:
                batch_limit.add_metric(labels, w.hello.max_batch)
        yield from (running, waiting, kv, hot, hot_hits, batched, batch_limit)
        yield from _speculation(d.workers)

        in_prefill = sum(1 for st in d.requests.values() if st.phase in ("vision", "prefill"))
        yield GaugeMetricFamily("tandem_requests_running", "Requests decoding", value=len(d.requests) - in_prefill)
        yield GaugeMetricFamily("tandem_requests_waiting", "Requests admitted and not yet decoding", value=in_prefill)

        stats = d.cache_stats or {}
        tier = GaugeMetricFamily("tandem_cache_bytes", "Bytes of cached KV blocks", labels=["tier"])
        tier.add_metric(["memory"], stats.get("memory_bytes", 0))
        tier.add_metric(["disk"], stats.get("disk_bytes", 0))
        yield tier
        yield GaugeMetricFamily("tandem_cache_arena_used_bytes", "Arena bytes in use (blocks and handoffs)",
                                value=stats.get("used_bytes", 0))
        yield GaugeMetricFamily("tandem_cache_disk_writes_deferred",
                                "KV blocks whose disk-tier write waits for the power policy to allow it",
                                value=stats.get("disk_writes_deferred", 0))
        evictions = CounterMetricFamily("tandem_cache_evictions", "KV blocks evicted", labels=["tier"])
        evictions.add_metric(["memory"], stats.get("evictions_total", 0))
        evictions.add_metric(["disk"], stats.get("disk_evictions_total", 0))
        yield evictions
        yield from _memory_pressure(d.workers, stats)


def _speculation(workers: dict):
    """Drafted and accepted tokens of speculative decoding (workers/decode/speculation.py)."""
    proposed = CounterMetricFamily("tandem_spec_proposed_tokens", "Tokens drafted for speculative decoding",
                                   labels=["method", "pid"])
    accepted = CounterMetricFamily("tandem_spec_accepted_tokens",
                                   "Drafted tokens the model agreed with (kept without a step of their own)",
                                   labels=["method", "pid"])
    for w in workers.values():
        if w.hello.spec_method:
            labels = [w.hello.spec_method, str(w.hello.pid)]
            proposed.add_metric(labels, w.hello.spec_proposed)
            accepted.add_metric(labels, w.hello.spec_accepted)
    yield from (proposed, accepted)


def _memory_pressure(workers: dict, cache_stats: dict):
    """Each process's memory-pressure level and what it let go (environment/memory_pressure.py)."""
    level = GaugeMetricFamily("tandem_memory_pressure", "Memory pressure a process reads: 0 normal, 1 warn, 2 critical",
                              labels=["process"])
    freed = CounterMetricFamily("tandem_memory_pressure_freed_bytes",
                                "Bytes of cache a process let go under memory pressure", labels=["process"])
    level.add_metric(["cache"], cache_stats.get("memory_pressure", 0))
    freed.add_metric(["cache"], cache_stats.get("memory_pressure_freed_bytes_total", 0))
    for wid, w in sorted(workers.items()):
        level.add_metric([wid], w.hello.memory_pressure)
        freed.add_metric([wid], w.hello.memory_freed_bytes)
    yield from (level, freed)


class AdmissionMetrics:
    """The router's admission (router/guards/admission.py) and the power policy
    (router/power_watch.py), read at scrape time."""

    def __init__(self, admission, power=None, stored_responses=None):
        self.admission = admission
        self.power = power
        self.stored_responses = stored_responses  # router/api/response_store.py
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        a = self.admission
        yield GaugeMetricFamily("tandem_requests_admitted", "Requests admitted and not yet ended", value=a.admitted)
        yield GaugeMetricFamily("tandem_requests_admitted_limit",
                                "Requests admitted at most: the decode batches' rows plus --max-queue",
                                value=a.capacity)
        yield CounterMetricFamily("tandem_requests_refused", "Requests refused with 429 by admission",
                                  value=a.refused)
        yield GaugeMetricFamily("tandem_admitted_body_bytes", "Bytes of the admitted requests' bodies",
                                value=a.body_bytes)
        yield GaugeMetricFamily("tandem_admitted_body_bytes_limit", "Bytes admitted requests' bodies may hold at once",
                                value=a.body_budget)
        if self.stored_responses is not None:
            yield GaugeMetricFamily("tandem_stored_responses", "Responses kept for previous_response_id",
                                    value=len(self.stored_responses))
            yield GaugeMetricFamily("tandem_stored_response_bytes", "Bytes the responses kept hold",
                                    value=self.stored_responses.size)
        yield CounterMetricFamily("tandem_client_write_timeouts",
                                  "Connections closed (their requests cancelled) because the client took none "
                                  "of its answer within --client-timeout", value=WriteTimeouts.total)
        if self.power is not None:
            yield from _power_families(self.power)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


THERMAL_LEVELS = {"nominal": 0, "fair": 1, "serious": 2, "critical": 3}


def _power_families(power):
    state, policy = power.state, power.policy
    in_force = GaugeMetricFamily("tandem_power_policy", "The power policy in force (1) among all (0)",
                                 labels=["policy"])
    for name in POLICIES:
        in_force.add_metric([name], 1 if name == policy.name else 0)
    yield in_force
    yield GaugeMetricFamily("tandem_power_on_battery", "1 when running on battery", value=state.source == "battery")
    yield GaugeMetricFamily("tandem_power_battery_percent", "Battery charge (-1: none or unknown)",
                            value=-1 if state.percent is None else state.percent)
    yield GaugeMetricFamily("tandem_power_low_power_mode", "1 when Low Power Mode is on", value=state.low_power)
    yield GaugeMetricFamily("tandem_power_thermal_state", "0 nominal, 1 fair, 2 serious, 3 critical",
                            value=THERMAL_LEVELS.get(state.thermal, 0))
    yield GaugeMetricFamily("tandem_power_decode_batch_limit", "Decode rows per worker the policy allows",
                            value=policy.max_batch)
    yield GaugeMetricFamily("tandem_power_prefill_batch_limit", "Prompts per prefill pass the policy allows",
                            value=policy.prefill_batch)
    yield GaugeMetricFamily("tandem_power_pace_tokens_per_second", "Decode pace per stream (0: unpaced)",
                            value=policy.pace_tokens_per_s)
    yield GaugeMetricFamily("tandem_power_refusing_new_requests", "1 while new requests get 429 (critical heat)",
                            value=policy.refuse_new)
    yield CounterMetricFamily("tandem_power_policy_changes", "Power policy changes since start", value=power.changes)


class Metrics:
    def __init__(self, dispatcher=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time from admission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("tandem_request_duration_seconds", "Time from admission to the last token",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("tandem_kv_handoff_seconds", "Prefill-side time to hand the prompt's KV over",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        # How each prompt's KV reached decode: copied through the arena,
        # referred to as prefix-cache blocks, or kept in one process (local).
        self.handoff_tokens = Counter("tandem_kv_handoff_tokens", "Prompt tokens handed from prefill to decode",
                                      ["path"], registry=r)
        for path in ("copied", "referenced", "local", "sent"):  # shown at 0 before the first request
            self.handoff_tokens.labels(path)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("tandem_requests", "Finished requests by outcome", ["status"], registry=r)
        # A request moved to another worker after its own died (router/routing/dispatcher.py).
        self.moves = Counter("tandem_request_moves", "Requests resumed on another worker after one died",
                             ["role"], registry=r)
        for role in ("prefill", "decode"):
            self.moves.labels(role)
        self.prefix_queries = Counter("tandem_prefix_cache_queries", "Prompts looked up in the prefix cache",
                                      registry=r)
        self.prefix_hit_tokens = Counter("tandem_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                         registry=r)
        # Vision: each image of a request is a query; a hit is an image the
        # encoder did not run for (its KV was cached past it).
        self.vision_queries = Counter("tandem_vision_cache_queries", "Images looked up before encoding", registry=r)
        self.vision_hits = Counter("tandem_vision_cache_hits", "Images served without running the encoder",
                                   registry=r)
        self.vision_encode = Histogram("tandem_vision_encode_seconds", "Vision encoder time per request",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        if dispatcher is not None:
            r.register(_LiveState(dispatcher))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def labelled_by_model(texts: list[tuple[str | None, str]]) -> str:
    """One exposition from several dispatchers' (model, text): the server's
    own model's samples (model None) as they are, every other model's with
    a `model` label, each metric family once (Prometheus refuses a family
    whose lines are split or repeated)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for model, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(_labelled(family.samples, model))
            elif model is not None:
                family.samples[:] = _labelled(family.samples, model)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry).decode()


def _labelled(samples, model: str | None) -> list:
    return list(samples) if model is None else [s._replace(labels={**s.labels, "model": model}) for s in samples]


class _Families:
    """A collector of metric families already made (parsed)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families
