"""Cache salts in the prefix cache (workers/kv): the attack is a caller who
sends another tenant's suspected prompt and watches `cached_tokens` (or the
first token's speed) to confirm it. A salted prompt's KV is keyed under its
salt, so a caller of another salt (or of none) never hits it, while callers
of the same salt share as before, and no salt keeps today's keys exactly."""

from __future__ import annotations

import multiprocessing as mp

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cache_service.client import CacheClient
from tests.support.cache_fakes import FakeCacheService
from tests.support.tiny_models import prompt_of
from workers.kv.block_hash import SEED, BlockHasher, block_extra, chain_seed
from workers.kv.prefix_cache import make_prefix_cache
from workers.kv.snapshot import capture_snapshot
from workers.kv.snapshot_cache import SnapshotCache, snapshot_key

BS = 8


def _kv(model, tokens):
    """The prompt's KV as a prefill leaves it."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


# ------------------------------------------------------------------ keys --
def test_no_salt_keeps_the_keys_of_before_salts():
    """Fixed keys computed by the code before salts existed: a disk tier
    written then still hits, and so do peers that do not salt."""
    hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4)
    keys = hasher.hashes(list(range(100, 110)))
    assert [k.hex() for k in keys] == ["8abcb5b8ca72de6bcf70d69ffde0128cc677a307e18c7ba957ca199ad921fe8d",
                                       "52e54f752d778df12988c431d66a172ab99b47285dd21b0445ba02cf239c91a0"]
    assert hasher.tail_key(keys[-1], [108, 109]).hex() == \
        "1995bb99504573a1ea2214ac51f39695a61d50a61eb0a038c16dcecd936d0dc3"
    assert hasher.hashes(list(range(100, 110)), salt="") == keys and chain_seed("") == SEED


def test_salted_chains_meet_no_other_chain():
    hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4)
    tokens = list(range(100, 118))
    chains = {salt: hasher.hashes(tokens, salt=salt) for salt in ("", "a", "b", "ab", "\ud800")}
    every = [k for keys in chains.values() for k in keys]
    assert len(set(every)) == len(every)  # no block of one salt is any block of another
    # The hasher's memo of its last chain never hands one salt's keys to another.
    assert hasher.hashes(tokens, salt="a") == chains["a"] and hasher.hashes(tokens) == chains[""]
    assert hasher.hashes(tokens[:8], salt="b") == chains["b"][:2]
    # Tails and snapshots derive from the salted chain: apart too.
    tails = {hasher.tail_key(keys[-1], [1, 2]) for keys in chains.values()}
    assert len(tails) == len(chains) and not tails & set(every)
    assert len({snapshot_key(keys[1]) for keys in chains.values()}) == len(chains)
    assert len({chain_seed(s) for s in chains}) == len(chains)


# ---------------------------------------------------- the real cache service --
@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A real cache service process: (settings, client, arena buffer of a name)."""
    from cache_service import main as cache_main
    from cache_service.arena import ArenaAttachment, new_arena_name, unlink_arena
    from environment.settings import Settings

    ctx = mp.get_context("spawn")
    settings = Settings(run_dir=str(tmp_path_factory.mktemp("run")), cache_dir=None,
                        arena_name=new_arena_name("tsalt"), cache_memory_bytes=64 << 20, block_size=BS,
                        cache_call_timeout_s=5.0)
    ready = ctx.Event()
    proc = ctx.Process(target=cache_main.run, args=(settings, ready), daemon=True)
    proc.start()
    arenas = ArenaAttachment()
    client = CacheClient(settings)
    try:
        assert ready.wait(30)
        yield client, (lambda name: arenas.get(name).buf)
    finally:
        client.close()
        arenas.close()
        proc.terminate()
        proc.join(10)
        unlink_arena(settings.arena_name)


def test_a_salted_prompt_is_found_only_under_its_salt(model, tiny_dir, service):
    client, arena_buf = service
    # The victim's worker keeps a hot tier (its own memory): the prober may land on it too.
    victim = make_prefix_cache(model, str(tiny_dir), BS, client, arena_buf, hot_bytes=4 << 20)
    prober = make_prefix_cache(model, str(tiny_dir), BS, client, arena_buf)
    prompt = prompt_of(41, 71)
    most = (len(prompt) - 1) // BS
    assert victim.store(prompt, _kv(model, prompt), "victim", salt="tenant-a") == 5
    for cache in (prober, victim):
        for salt in ("", "tenant-b"):
            assert cache.fetch(prompt, most, "probe", salt=salt) == (None, 0)
            assert not cache.hold(prompt, "probe", 5.0, salt=salt).hashes
    # The same salt shares, as the unsalted cache always did.
    kv, hit = prober.fetch(prompt, most, "same tenant", salt="tenant-a")
    assert hit == 40 and kv is not None
    assert victim.fetch(prompt, most, "same tenant", salt="tenant-a")[1] == 40
    held = prober.hold(prompt, "handoff", 5.0, salt="tenant-a")
    assert len(held.hashes) == 5
    prober.release(held.lease)
    # A decode worker's end-of-conversation store (a tail block) stays under its salt.
    answer = prompt + [3, 4, 5]
    prepared = prober.prepare_store(answer, _kv(model, answer), "decode", tail=True, salt="tenant-b")
    mx.eval(prepared.arrays())
    assert prober.finish_store(prepared) == 6  # everything new under tenant-b: 5 blocks and the tail
    assert prober.fetch(answer, len(answer) // BS, "probe")[1] == 0
    assert prober.fetch(answer + [6], len(answer) // BS, "b again", salt="tenant-b")[1] == 44
    # The shared cache is unchanged by all this, and reads its own stores.
    assert prober.store(prompt, _kv(model, prompt), "shared") == 5
    assert prober.fetch(prompt, most, "shared again")[1] == 40
    assert prober.stats.failures == 0 and victim.stats.failures == 0


def test_snapshots_are_found_only_under_their_salt(model, tiny_dir):
    """Models whose cache is snapshotted whole (sliding window, recurrent)
    key snapshots by the salted chain too."""
    fake = FakeCacheService()
    hasher = BlockHasher(block_extra(b"s" * 32, "snapshot-float32", BS), BS)
    prompt = prompt_of(33, 72)
    kv = _kv(model, prompt[:32])
    snapshots = SnapshotCache(fake, lambda name: fake.buf, hasher, [type(c).__name__ for c in kv])
    assert snapshots.store(prompt, None, "victim", snapshot=capture_snapshot(kv, 32), salt="tenant-a") == 1
    assert snapshots.fetch(prompt, 4, "probe") == (None, 0)
    assert snapshots.fetch(prompt, 4, "probe", salt="tenant-b") == (None, 0)
    assert snapshots.fetch(prompt, 4, "same tenant", salt="tenant-a")[1] == 32
