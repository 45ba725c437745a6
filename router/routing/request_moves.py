"""Moving a dead worker's requests: each resumes on a live or restarted
worker, its prompt and its answer so far prefilled again (mostly from the
prefix cache) and the stream going on where it was; it fails only if no
worker comes back within migrate_timeout_s, or when workers keep dying
under it with no token gained between (max_migrations).

Apart from the dispatcher's protocol (dispatcher.py) because it is the one
path where a request changes workers and wire ids.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protos.messages import Cancel
from router.routing.engine_api import EngineError
from router.routing.request_state import VISION_LOST, RequestState
from router.routing.worker_table import WorkerState

# The dispatcher's logger: a request's moves are read with its other lines.
log = logging.getLogger("router.routing.dispatcher")


class RequestMoves:
    """The Dispatcher's moves (router.routing.dispatcher.Dispatcher inherits
    them), over its requests, worker table, settings, metrics and moving
    tasks, and its _send, _prefill, _keys and _orphaned."""

    def _relocate(self, st: RequestState, why: str, wid: str = "", strike: bool = True) -> None:
        """Worker `wid` holding `st` died: resume it elsewhere (`_move`) unless
        it is over. `strike`: it died running it (not: it never got there)."""
        if st.phase == "done" or self.requests.get(st.wire_id) is not st:
            return
        if st.phase == "vision":
            if wid == st.vision_worker:
                st.events.put_nowait(VISION_LOST)  # prefill encodes the images itself
            return  # a prefill worker that died meanwhile: _prefill finds another
        # Detached now: nothing its old worker sends from here on is taken.
        old_wire, old_worker = st.wire_id, st.decode_worker if st.phase == "decode" else st.prefill_worker
        role = st.phase
        if role == "decode" and st.handoff is not None:  # its worker may have died before reading it
            self.kv.free(st.handoff)
        st.handoff = None
        self.requests.pop(old_wire, None)
        self._orphaned(old_wire)  # cancelled below, not again as an orphan
        self.table.unassign(old_wire, st.prefill_worker, st.decode_worker)
        st.moves += 1
        if strike:
            st.strikes = 1 if len(st.answer) > st.struck_at else st.strikes + 1
            st.struck_at = len(st.answer)
        st.wire_id = f"{st.req.request_id}~{st.moves}"
        st.phase, st.first_token, st.prefill_worker, st.decode_worker = "prefill", None, "", ""
        self.requests[st.wire_id] = st
        task = asyncio.create_task(self._move(st, why, role, old_worker and (old_worker, old_wire)))
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    async def _move(self, st: RequestState, why: str, role: str, old: tuple | str) -> None:
        """Resume `st` on live workers: its prompt and answer so far prefilled
        again (mostly from the prefix cache), the next token continuing the
        stream. It waits up to migrate_timeout_s for a worker of each role."""
        if old:  # a worker declared dead may be alive and still running it
            await self._send(old[0], Cancel(old[1]), quiet=True)
        if st.strikes > self.settings.max_migrations:
            st.events.put_nowait(EngineError(502, f"{why}; {st.strikes} workers died running this request with no "
                                                  "token gained between, so it is not moved again"))
            return
        log.info("request %s: %s; resuming after %d token(s) (move %d)", st.req.request_id, why,
                 len(st.answer), st.moves)
        self.metrics.moves.labels(role).inc()
        roles = ("prefill",) if self.settings.colocate else ("prefill", "decode")
        deadline = time.monotonic() + self.settings.migrate_timeout_s
        if not await self.table.wait_ready(roles, deadline, gone=lambda: self.requests.get(st.wire_id) is not st):
            if self.requests.get(st.wire_id) is st:
                st.events.put_nowait(EngineError(
                    503, f"{why}, and no worker took its place within {self.settings.migrate_timeout_s:.0f}s",
                    retry_after=1.0))
            return
        st.resumed = len(st.answer)
        keys = self._keys(st)
        w = self.table.pick_prefill(keys)
        st.prefill_worker = w.hello.worker_id
        w.assigned.add(st.wire_id)
        await self._prefill(st, pixels=True)

    def _moved_off(self, wid: str, w: WorkerState, why: str) -> None:
        """A worker is gone: every request it held resumes elsewhere."""
        log.warning("worker %s (%s, pid %d) %s; moving %d request(s)", wid, "+".join(w.hello.roles),
                    w.hello.pid, why, len(w.assigned))
        for wire_id in list(w.assigned):
            st = self.requests.get(wire_id)
            if st is not None:
                self._relocate(st, f"{'+'.join(w.hello.roles)} worker (pid {w.hello.pid}) {why}", wid)
