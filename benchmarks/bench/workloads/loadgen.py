"""The closed-loop load generator: streamed chat requests, their timings, and the statistics of a run.

Closed loop: each simulated client sends its next request only after its
previous one ended, so offered load = concurrency. Every request has a hard
deadline (asyncio.timeout around the whole exchange, not only per read: a
server that trickles bytes cannot hold a client forever).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds from sending."""

    status: int | str  # HTTP status, or "timeout", "connect", "stream-error", "protocol"
    ok: bool = False
    sent_at: float = 0.0  # time.perf_counter() when sent, to line requests up against each other
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    latency: float = 0.0
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else text chunks
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    text: str = ""
    error: str = ""
    retry_after: float | None = None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive text chunks (one token each on servers that stream per token)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """Greedy, streamed, with usage in the last chunk (for token and cache counts)."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


def completion_body(model: str, prompt: str | list[int], max_tokens: int) -> dict:
    """chat_body's twin for /v1/completions (a prompt as text or token ids)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(client: httpx.AsyncClient, base_url: str, body: dict, timeout: float,
                      headers: dict | None = None, first_token: asyncio.Event | None = None) -> RequestResult:
    """POST /v1/chat/completions (/v1/completions for a body with a
    "prompt") and read the SSE stream to its end (or the deadline).
    `first_token` is set when the first text arrives."""
    t0 = time.perf_counter()
    res = RequestResult(status=0, sent_at=t0)
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", base_url.rstrip("/") + path, json=body,
                                     headers=headers, timeout=httpx.Timeout(timeout, connect=min(10.0, timeout))) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.error = (await r.aread()).decode(errors="replace")[:300]
                    res.retry_after = _retry_after(r.headers.get("retry-after"))
                else:
                    await _read_sse(r, res, t0, first_token)
    except TimeoutError:
        res.status, res.error = "timeout", f"no complete answer within {timeout:g}s"
    except httpx.ConnectError as e:
        res.status, res.error = "connect", str(e) or "connection refused"
    except httpx.HTTPError as e:  # reset mid-stream, bad chunking, ...
        res.status, res.error = "stream-error", f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.ok = res.status == 200 and not res.error
    if res.ok and res.output_tokens == 0:
        res.output_tokens = len(res.chunk_times)
    return res


async def _read_sse(r: httpx.Response, res: RequestResult, t0: float, first_token: asyncio.Event | None) -> None:
    pieces = []
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            res.status, res.error = "protocol", f"not JSON: {data[:80]!r}"
            return
        if chunk.get("error"):
            res.status, res.error = "stream-error", str(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or []:
            text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                now = time.perf_counter() - t0
                if res.ttft is None:
                    res.ttft = now
                    if first_token is not None:
                        first_token.set()
                res.chunk_times.append(now)
                pieces.append(text)
        usage = chunk.get("usage")
        if usage:
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            res.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
    res.text = "".join(pieces)


def stream_once(base_url: str, body: dict, timeout: float) -> RequestResult:
    """One streamed chat from synchronous code (the single-request benchmarks)."""

    async def one() -> RequestResult:
        async with httpx.AsyncClient() as client:
            return await stream_chat(client, base_url, body, timeout)

    return asyncio.run(one())


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


SendFn = Callable[[int, int], Awaitable[RequestResult]]  # (client index, request index) -> result


async def closed_loop(send: SendFn, concurrency: int, *, requests: int | None = None,
                      duration: float | None = None, progress: "Progress | None" = None,
                      backoff_cap: float = 1.0) -> tuple[list[RequestResult], float]:
    """Run `concurrency` clients until `requests` were sent or `duration` passed
    (requests in flight at the end finish; each has its own deadline). After a
    429 a client waits Retry-After (at most `backoff_cap` s), as a polite client
    would, instead of hammering. Returns (results, wall seconds)."""
    if requests is None and duration is None:
        raise ValueError("give requests or duration")
    results: list[RequestResult] = []
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + duration if duration is not None else math.inf

    async def client(c: int) -> None:
        nonlocal next_index
        while time.perf_counter() < deadline and (requests is None or next_index < requests):
            i = next_index
            next_index += 1
            r = await send(c, i)
            results.append(r)
            if progress:
                progress.update(r)
            if r.status == 429:
                await asyncio.sleep(min(backoff_cap, r.retry_after if r.retry_after is not None else 0.2))

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall: float, *, ttft_budget: float, itl_budget: float) -> dict:
    """Statistics of one level. Throughput counts successful requests only;
    ITL percentiles pool the gaps of every successful request; TPOT percentiles
    are of each request's time per output token after the first. A request is
    'good' when it succeeded with TTFT <= ttft_budget and its mean inter-token
    time (time per output token after the first) <= itl_budget."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok and r.status != 429:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls]
    tpots = [t for r in ok if (t := _time_per_output_token(r)) is not None]
    good = [r for r in ok if r.ttft is not None and r.ttft <= ttft_budget and _mean_itl(r) <= itl_budget]
    out_tokens = sum(r.output_tokens for r in ok)
    n = len(results)
    return {
        "requests": n,
        "ok": len(ok),
        "errors": errors,
        "error_count": sum(errors.values()),
        "rejected_429": sum(1 for r in results if r.status == 429),
        # How promptly a full server says no: a 429 should take milliseconds, not a timeout.
        "rejected_latency_p99_s": percentile([r.latency for r in results if r.status == 429], 99),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "requests_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "itl_max_s": max(itls) if itls else None,
        # Per request, time per output token after the first: with speculative decoding a
        # chunk can carry several tokens, so chunk gaps (ITL) alone understate the wait.
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "goodput": len(good) / n if n else 0.0,
        "goodput_requests_s": len(good) / wall if wall > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok if r.cached_tokens is not None)
        if any(r.cached_tokens is not None for r in ok) else None,
        "first_error": next((f"{r.status}: {r.error}" for r in results if not r.ok), None),
    }


def _time_per_output_token(r: RequestResult) -> float | None:
    """(last text - first text) / (output tokens - 1), None with fewer than two tokens."""
    if r.ttft is None or not r.chunk_times or r.output_tokens < 2:
        return None
    return (r.chunk_times[-1] - r.ttft) / (r.output_tokens - 1)


def _mean_itl(r: RequestResult) -> float:
    gaps = r.itls
    return sum(gaps) / len(gaps) if gaps else 0.0


class Progress:
    """A one-line text progress bar on stderr. On a terminal it redraws in
    place (at most 10 times a second); elsewhere (logs, CI) it prints a line
    at each quarter, so logs stay short."""

    def __init__(self, label: str, total: int | None, duration: float | None = None, stream=None):
        self.label, self.total, self.duration = label, total, duration
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.done = self.failed = self.tokens = 0
        self._last_draw = 0.0
        self._last_quarter = -1
        self._printed_done = -1  # what the last printed line showed, so close() does not repeat it

    def update(self, r: RequestResult) -> None:
        self.done += 1
        self.failed += 0 if r.ok else 1
        self.tokens += r.output_tokens if r.ok else 0
        self._draw()

    def fraction(self) -> float:
        if self.total:
            return min(1.0, self.done / self.total)
        if self.duration:
            return min(1.0, (time.perf_counter() - self.t0) / self.duration)
        return 0.0

    def _draw(self, final: bool = False) -> None:
        now = time.perf_counter()
        frac = self.fraction()
        if self.tty:
            if not final and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            end = "\n" if final else ""
            self.stream.write("\r" + self.line(now) + end)
        else:
            quarter = int(frac * 4)
            if quarter == self._last_quarter and (not final or self._printed_done == self.done):
                return
            self._last_quarter, self._printed_done = quarter, self.done
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def line(self, now: float) -> str:
        frac = self.fraction()
        bar = "#" * int(frac * 24)
        elapsed = now - self.t0
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (f"{self.label:<28} [{bar:<24}] {count:>9} req  {rate:7.1f} tok/s  "
                f"{self.failed} failed  {elapsed:6.1f}s")

    def close(self) -> None:
        self._draw(final=True)
