"""Fair prefill (workers/prefill/turns.py, driven by workers/prefill/role.py):
a short prompt that arrives while a long one prefills waits for at most one
of the long one's chunks, counted in steps (the turns' clock stands still
unless a test says otherwise: `_WorkClock`), and both prompts' KV and greedy
answers are those of each prompt prefilled alone (mlx-lm's); colocated and
split (with prefix-cache hits and batched passes), with a prompt with
images, cancelled midway, and on a worker group's ranks in lockstep."""

from __future__ import annotations

import gc
import queue
import weakref
from types import SimpleNamespace

import mlx.core as mx
import pytest

from environment.settings import Settings
from protos.messages import KVHandoff, PrefillDone, PrefillRequest, SamplingParams, WorkerHello
from tests.support.cache_fakes import FakeCacheService
from tests.support.decoding import decode_greedy
from tests.support.prefix import prefix_for
from tests.support.tiny_models import greedy, prompt_of, reference
from workers.kv import handoff as kv_handoff
from workers.loop_clock import LoopClock
from workers.prefill.engine import PrefillEngine
from workers.prefill.role import PrefillRole
from workers.prefill.turns import OVERTAKE_SHARE, Turns

CHUNK = 16
LONG = 150  # ten chunks
ANSWER = 6  # greedy tokens compared with mlx-lm's


class Sent(list):
    def send(self, msg, wait_s=None):
        self.append(msg)

    def close(self):
        pass


def _role(engine, *, fake=None, batch=1, colocated=True, vision=None, outbox=None, clock=None) -> PrefillRole:
    """A prefill role whose turns time steps on `clock` (None: one that
    stands still, so no prompt is ever owed time and the order is the
    shortest remaining first)."""
    settings = Settings(prefill_batch=batch, prefill_chunk=CHUNK)
    role = PrefillRole(settings, engine, worker_id="w", prefix=engine.prefix, cache=fake,
                       arena_buf=fake.buffer if fake else None, outbox=outbox if outbox is not None else Sent(),
                       clock=LoopClock("test"), hello=WorkerHello("w", ["prefill"], 1, "ready"), local_kv={},
                       colocated=colocated, vision=vision)
    role.turns.clock = clock or (lambda: 0.0)
    return role


class _WorkClock:
    """The turns' clock for a test: time passes only as `engine` computes,
    PASS units a chunk plus one a token (a short prompt's pass costs about
    half a long one's chunk, as on a GPU), whatever the machine."""

    PASS = 16

    def __init__(self, engine, rate: float = 1.0):
        self.now = 0.0
        engine.observe_compute = lambda tokens, seconds: self.advance(rate * (self.PASS + tokens))

    def advance(self, units: float) -> None:
        self.now += units

    def __call__(self) -> float:
        return self.now


def _request(rid: str, prompt, colocated=True, **kw) -> PrefillRequest:
    return PrefillRequest(rid, prompt, greedy(ANSWER), "w" if colocated else "", **kw)


def _done(role) -> dict:
    return {m.request_id: m for m in role.outbox if isinstance(m, PrefillDone)}


def _steps_until(role, rid: str, limit: int = 40) -> int:
    """Steps of the role until `rid`'s first token is out."""
    for n in range(1, limit + 1):
        role.step()
        if rid in _done(role):
            return n
    raise AssertionError(f"{rid} not prefilled in {limit} steps")


def _same_kv(a: list, b: list) -> bool:
    return all(x.offset == y.offset and mx.array_equal(x.keys[..., :x.offset, :], y.keys[..., :y.offset, :])
               and mx.array_equal(x.values[..., :x.offset, :], y.values[..., :y.offset, :]) for x, y in zip(a, b))


# ------------------------------------------------------------ colocated --
@pytest.mark.parametrize("batch", [1, 4])
def test_a_short_prompt_waits_for_one_chunk_of_a_long_one_colocated(model, batch):
    """Colocated (the KV stays in the process): a short prompt that arrives
    after two of a long prompt's ten chunks gets its first token at the
    next step; the long one then needs its eight other chunks and so takes
    one step more than alone. Each prompt's KV is bit for bit the KV of
    that prompt prefilled alone, and decoding it gives mlx-lm's answer."""
    engine = PrefillEngine(model, chunk_size=CHUNK)
    long, short = prompt_of(LONG, 1), prompt_of(9, 2)
    role = _role(engine, batch=batch)
    role.handle(_request("long", long))
    role.step(), role.step()
    role.handle(_request("short", short))
    assert _steps_until(role, "short") == 1  # on the old queue: the long prompt's 8 chunks first
    assert set(_done(role)) == {"short"} and role.running == 1
    assert _steps_until(role, "long") == LONG // CHUNK + 1 - 2  # 11 steps in all, against 10 alone
    assert not role.has_work() and role.turns.started == {}
    for rid, prompt in (("long", long), ("short", short)):
        done = _done(role)[rid]
        assert done.handoff.local and rid in role.local_kv
        assert _same_kv(role.local_kv[rid], engine.run(prompt, greedy()).cache)
        answer = [done.first_token] + decode_greedy(model, role.local_kv[rid], done.first_token, ANSWER - 1)
        assert answer == reference(model, prompt, ANSWER), rid


def test_long_prompts_run_one_after_the_other_and_a_passed_over_one_is_not_starved(model):
    """Two long prompts run in the order they came, not alternately (the
    first would be as late as the second). Short prompts that keep coming
    take at most OVERTAKE_SHARE of a long one's own time (on the turns'
    clock), plus the one overtake that crossed the line: the long one
    earns each overtake back before the next, a short prompt meanwhile
    waiting for those chunks (at most one overtake's time / the share)."""
    engine = PrefillEngine(model, chunk_size=CHUNK)
    clock = _WorkClock(engine)
    role = _role(engine, clock=clock)
    role.handle(_request("a", prompt_of(4 * CHUNK, 3)))
    role.handle(_request("b", prompt_of(4 * CHUNK, 4)))
    assert _steps_until(role, "a") == 4 and _steps_until(role, "b") == 4

    role.handle(_request("long", prompt_of(8 * CHUNK, 5)))
    role.step()
    start, order = clock.now - (_WorkClock.PASS + CHUNK), []
    while "long" not in _done(role):
        role.handle(_request(f"s{len(order)}", prompt_of(5, 10 + len(order))))  # a new short prompt every step
        before = role.turns.started["long"].job.processed
        role.step()
        order.append("long" if "long" in _done(role) or role.turns.started["long"].job.processed != before
                     else "short")
    own, short = 8 * (_WorkClock.PASS + CHUNK), _WorkClock.PASS + 5
    # A chunk costs 32, a short prompt 21: after one chunk a short one goes past (nothing owed yet); the
    # long one is then owed 21 until its own time x 0.15 covers it (5 chunks: 160), and so on.
    assert order == ["short"] + ["long"] * 4 + ["short"] + ["long"] * 3
    assert clock.now - start == own + 2 * short <= (1 + OVERTAKE_SHARE) * own + short


# ---------------------------------------------------------------- split --
@pytest.mark.parametrize("batch", [1, 4])
def test_short_prompts_beside_a_long_one_split_with_prefix_hits(model, tiny_dir, batch):
    """Split (the KV handed off through the arena, blocks by reference): a
    short prompt and a follow-up turn longer than the long prompt's rest but
    with all but its tail cached arrive after the long prompt's first chunk;
    both are out within two steps (one batched pass on a GPU), the cached one
    computing only its tail. Every handoff, taken in as a decode worker does,
    decodes to mlx-lm's answer."""
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    engine = PrefillEngine(model, chunk_size=CHUNK, prefix=prefix)
    system = prompt_of(LONG + 2, 20)
    engine.run(system + prompt_of(3, 21), greedy(), owner="warm")  # the conversation so far: 19 blocks
    prompts = {"long": prompt_of(LONG, 22), "cached": system + prompt_of(8, 23), "new": prompt_of(7, 24)}
    role = _role(engine, fake=fake, batch=batch, colocated=False)
    role.handle(_request("long", prompts["long"], colocated=False))
    role.step()
    role.handle(_request("cached", prompts["cached"], colocated=False))
    role.handle(_request("new", prompts["new"], colocated=False))
    assert _steps_until(role, "cached") <= 2 and "new" in _done(role) and "long" not in _done(role)
    assert role.hello.batched_prompts == (2 if batch > 1 else 0)
    _steps_until(role, "long")
    done = _done(role)
    assert done["cached"].cached_tokens == LONG + 2 and done["long"].cached_tokens == 0
    handoffs = {m.request_id: m for m in role.outbox if isinstance(m, KVHandoff)}
    assert set(handoffs) == set(prompts)
    for rid, prompt in prompts.items():
        cache = kv_handoff.take_in(handoffs[rid], fake, fake.buffer, prefix, LoopClock("decode"))
        answer = [done[rid].first_token] + decode_greedy(model, cache, done[rid].first_token, ANSWER - 1)
        assert answer == reference(model, prompt, ANSWER), rid
    assert not fake.allocations and not role.held


def test_a_prompt_cancelled_midway_frees_its_state(model, tiny_dir):
    """A long prompt cancelled after some chunks leaves nothing behind: no
    turn, no job (its KV is freed), no held blocks; the prompt behind it runs."""
    fake = FakeCacheService()
    engine = PrefillEngine(model, chunk_size=CHUNK, prefix=prefix_for(model, tiny_dir, fake))
    role = _role(engine, fake=fake, colocated=False)
    role.handle(_request("long", prompt_of(LONG, 30), colocated=False))
    role.step(), role.step()
    job = weakref.ref(role.turns.started["long"].job)
    role.handle(_request("next", prompt_of(3 * CHUNK, 31), colocated=False))
    role.cancel("long")
    gc.collect()
    assert job() is None and "long" not in role.turns.started and not role.held
    assert _steps_until(role, "next") == 3 and not role.has_work()
    assert "long" not in _done(role) and not fake.leases


# --------------------------------------------------------------- images --
def test_a_prompt_with_images_is_interleaved_like_text(tmp_path_factory):
    """A long prompt with a picture (workers/prefill/vlm.py) takes turns as
    text does: a short text prompt arriving after its first chunks is out
    at the next step, and the picture prompt's first token and KV are
    those of its job run alone."""
    import numpy as np

    from router.media.decode import DecodedImage, image_content_hash
    from router.media.vision_prompt import VisionPrompter
    from tests.support.tiny_vlms import TINY_QWEN_VL, synthetic_image
    from tests.support.vision import user_turn, vlm_setup
    from workers.prefill.vlm import VLMPrefillJob

    s = vlm_setup(tmp_path_factory, TINY_QWEN_VL)
    pixels = np.asarray(synthetic_image(64, 96, 7))
    image = DecodedImage(pixels, 96, 64, image_content_hash(pixels), "data", "messages[0].content[0].image_url")
    turn = [user_turn(None, "What is in this picture? Tell me about every colour and every shape in it, "
                            "which one is the largest, which the smallest, and where each of them lies.")]
    ids, images = VisionPrompter(s.folder).build(turn, [image])
    assert len(ids) > 3 * CHUNK
    sampling = SamplingParams(max_tokens=ANSWER, temperature=0.0)
    alone = VLMPrefillJob(s.engine, ids, images, sampling, chunk_size=CHUNK).run()

    role = _role(PrefillEngine(s.text_model, chunk_size=CHUNK), vision=SimpleNamespace(engine=s.engine,
                                                                                        embeddings=None))
    role.handle(PrefillRequest("picture", ids, sampling, "w", images=images))
    role.step(), role.step(), role.step()  # its picture encoded, two chunks
    short = [int(t) for t in ids[-9:]]
    role.handle(_request("short", short))
    assert _steps_until(role, "short") == 1
    assert _done(role)["short"].first_token == reference(s.text_model, short, 1)[0]
    _steps_until(role, "picture")
    done = _done(role)["picture"]
    assert done.first_token == alone.first_token and done.handoff.rope_offset == alone.rope_offset
    assert _same_kv(role.local_kv["picture"], alone.cache)


# ---------------------------------------------------------------- groups --
def test_every_rank_of_a_group_takes_the_same_turns(model, tmp_path):
    """A worker group's rank 0 records each message and unit and a follower
    replays them on a role of its own (workers/group/members.py): the turns
    depend on what both see and on rank 0's step times, which the follower
    loads before each step, so both finish the same prompts in the same steps
    (the follower's own clock stands still: alone it would run the mid
    prompt before the tiny one)."""
    import zmq

    from protos.group_plan import RankSpec
    from workers.group.lockstep import RecordStream
    from workers.group.members import Follower, Leader
    from workers.group.ranks import lockstep_address
    from workers.power_limits import PowerLimits
    from workers.worker import Worker

    settings = Settings(run_dir=str(tmp_path), prefill_chunk=CHUNK, prefill_batch=1)

    def loop(role, outbox, runner=None):
        hello = WorkerHello(worker_id="g", roles=["prefill"], pid=0, state="ready")
        return Worker([role], {PrefillRequest: role}, worker_id="g", inbox=queue.Queue(), outbox=outbox,
                      hello=hello, power=PowerLimits(settings, may_defer=False), runner=runner)

    spec = RankSpec("g", 0, 2, str(tmp_path / "g.hosts.json"))
    prompts = {"long": prompt_of(LONG, 40), "mid": prompt_of(3 * CHUNK, 41), "short": prompt_of(9, 42),
               "tiny": prompt_of(4, 43)}
    arrivals = {0: ["long"], 2: ["mid", "short"], 4: ["tiny"]}  # before which of rank 0's steps
    ctx = zmq.Context()
    try:
        leader = Leader(settings, ctx, WorkerHello("g", ["prefill"], 0, "loading"), group=None, spec=spec)
        stream = RecordStream(ctx, lockstep_address(spec, settings.run_dir, 1))
        lead_out = Sent()
        lead_engine = PrefillEngine(model, chunk_size=CHUNK)
        lead_role = _role(lead_engine, outbox=leader.wrap_outbox(lead_out), clock=_WorkClock(lead_engine))
        rank0 = loop(lead_role, lead_role.outbox, leader)
        leader.loaded()
        for step in range(12):
            for rid in arrivals.get(step, []):
                rank0.inbox.put(_request(rid, prompts[rid]))
            rank0.drain_inbox(block=False)
            rank0.step()
        leader.close()

        follow_role = _role(PrefillEngine(model, chunk_size=CHUNK))
        follow_role.engine.observe_compute = lambda tokens, seconds: None
        follower = Follower(loop(follow_role, Sent()), stream, settings)
        follower.serve()
        stream.close()
    finally:
        ctx.destroy(linger=0)
    lead = [(m.request_id, m.first_token) for m in lead_out if isinstance(m, PrefillDone)]
    # The short one overtakes the long and the mid one, both then owed its time: the long one earns it
    # back in 4 chunks, then the mid one (which had run none) runs a chunk, which the long one is owed
    # in turn: it runs to its end (the tiny one waits for both debts: turns.py).
    assert [rid for rid, _ in lead] == ["short", "long"]
    assert [(m.request_id, m.first_token) for m in follow_role.outbox if isinstance(m, PrefillDone)] == lead
    assert follow_role.turns.started["mid"].job.processed == lead_role.turns.started["mid"].job.processed == CHUNK


# ----------------------------------------------------------- the order --
class _Job:
    def __init__(self, remaining: int):
        self.remaining = remaining


def test_whose_turn_it_is():
    """Turns alone: shortest remaining first (a queued prompt counts its whole
    length), ties in arrival order; the oldest queued prompt starts first;
    past MAX_STARTED started prompts only prompts that fit one chunk may
    start. (Time owed: tests/workers/prefill/test_turns_budget.py.)"""
    turns = Turns(chunk_size=CHUNK, max_started=2, clock=lambda: 0.0)
    a, b, c = (_request(r, prompt_of(n, 1)) for r, n in (("a", 100), ("b", 100), ("c", 10)))
    for r in (a, b, c):
        turns.add(r)
    assert turns.pick() is c and turns.next_to_start() is a  # the first to arrive starts first
    ta = turns.start(a, _Job(60))
    assert turns.pick() is c  # 10 < 60 < 100
    turns.drop("c")
    assert turns.pick() is ta
    tb = turns.start(b, _Job(60))
    assert turns.pick() is ta  # equal: the first to arrive
    tb.job.remaining = 5
    for _ in range(3):  # steps that take no time owe nothing
        assert turns.pick() is tb
        with turns.timed(tb):
            pass
    big, small = _request("big", prompt_of(2 * CHUNK, 2)), _request("small", prompt_of(CHUNK, 3))
    turns.add(big), turns.add(small)
    assert turns.may_start(small) and not turns.may_start(big)  # two started already
    assert turns.next_to_start() is None
    tb.job.remaining = ta.job.remaining = 1000
    assert turns.pick() is small
    turns.drop("small"), turns.drop("a")
    assert turns.pick() is big and len(turns.started) == 1
