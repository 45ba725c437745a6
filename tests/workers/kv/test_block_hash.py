"""Chained block hashes: the keys the prefix cache and the cache service share
(workers/kv/block_hash.py), stable across processes and restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.tiny_models import prompt_of
from workers.kv.block_hash import SEED, BlockHasher, block_extra, model_fingerprint

BS = 8  # small blocks: short prompts span several
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ------------------------------------------------------------- block hashes --
def test_block_hashes_chain():
    hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4)
    toks = list(range(100, 118))  # 4 full blocks + 2 tokens
    hs = hasher.hashes(toks)
    assert len(hs) == 4 and all(len(h) == 32 for h in hs) and len(set(hs)) == 4
    assert hasher.hashes(toks[:16]) == hs  # the partial block never gets a key
    assert hasher.hashes(toks, 2) == hs[:2]
    other = toks[:5] + [999] + toks[6:]  # one token changed in block 1
    ho = hasher.hashes(other)
    assert ho[0] == hs[0] and all(a != b for a, b in zip(ho[1:], hs[1:]))  # chained
    # Every extra key matters: weights, dtype, block size.
    for extra in (block_extra(b"g" * 32, "float32", 4), block_extra(b"f" * 32, "float16", 4),
                  block_extra(b"f" * 32, "float32", 4, adapter="lora")):
        assert BlockHasher(extra, 4).hashes(toks)[0] != hs[0]
    assert BlockHasher(block_extra(b"f" * 32, "float32", 2), 4).hashes(toks)[0] != hs[0]
    # Per-block extra (image hashes later): changes that block and all after.
    hi = hasher.hashes(toks, per_block=lambda i: b"img" if i == 2 else b"")
    assert hi[:2] == hs[:2] and hi[2] != hs[2] and hi[3] != hs[3]
    with pytest.raises(ValueError):
        hasher.hashes([-1] * 4)
    assert SEED != hs[0]


def test_tail_keys_name_their_prefix_and_their_length():
    """A tail block (the tokens after a conversation's last full block) is
    keyed by its parent block, its exact tokens and the model's extra: never
    a full block's key; its candidates come longest first, within a block
    and the given end."""
    hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4)
    toks = list(range(100, 111))  # 2 full blocks + 3
    hs = hasher.hashes(toks)
    t = hasher.tail_key(hs[-1], toks[8:11])
    assert len(t) == 32 and t not in hs and t not in hasher.hashes(toks[:8] + toks[8:11] + [5])
    assert t != hasher.tail_key(hs[-1], toks[8:10]) and t != hasher.tail_key(hs[0], toks[8:11])
    assert t != BlockHasher(block_extra(b"g" * 32, "float32", 4), 4).tail_key(hs[-1], toks[8:11])
    assert hasher.tail_keys(toks, hs[-1], 8, 11) == [(k, hasher.tail_key(hs[-1], toks[8:8 + k])) for k in (3, 2, 1)]
    assert [k for k, _ in hasher.tail_keys(toks, hs[-1], 8, 10)] == [2, 1]
    assert hasher.tail_keys(toks, hs[-1], 8, 8) == []
    assert [k for k, _ in hasher.tail_keys(list(range(40)), hs[0], 4, 40)] == [3, 2, 1]  # less than a block
    for bad in (toks[:4], []):
        with pytest.raises(ValueError):
            hasher.tail_key(hs[-1], bad)


def test_block_hashes_reuse_a_shared_leading_run_and_stay_exact(monkeypatch):
    """A prompt is hashed for its lookup, its handoff's lease and its store,
    and a swarm's prompts share a system prompt: the hasher reuses the keys
    of the leading run it computed last and hashes only the rest. Every
    answer equals a fresh hasher's, whatever came before it."""
    import random

    import workers.kv.block_hash as bh

    extra = block_extra(b"f" * 32, "float32", 4)
    fresh = lambda toks, n=None, per_block=None: BlockHasher(extra, 4).hashes(toks, n, per_block)  # noqa: E731
    hasher = BlockHasher(extra, 4)
    system = list(range(100, 164))  # 16 blocks every prompt starts with
    img = lambda i: b"img" if i == 3 else b""  # noqa: E731
    rng = random.Random(0)
    calls = [(system + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))], rng.choice([None, 5, 40]),
              rng.choice([None, None, img])) for _ in range(40)]
    calls += [(system[:30], None, None), (list(range(500, 540)), None, None), (system, None, None)]
    real_sha = bh.hashlib.sha256
    counted = []

    def counting_sha(*a):
        counted.append(1)
        return real_sha(*a)

    for toks, n, per_block in calls:
        monkeypatch.setattr(bh.hashlib, "sha256", real_sha)
        want = fresh(toks, n, per_block)
        monkeypatch.setattr(bh.hashlib, "sha256", counting_sha)
        assert hasher.hashes(toks, n, per_block) == want
    counted.clear()
    prompt = system + list(range(900, 923))  # 21 full blocks + 3 tokens
    hasher.hashes(prompt, 20)  # its lookup: (n-1)//bs blocks
    hasher.hashes(prompt)  # its lease: all full blocks
    hasher.hashes(prompt)  # its store
    assert len(counted) == 5  # the 16 system blocks were hashed already; then blocks 16-20, once
    counted.clear()
    swarm = [system + [2000 + 40 * a + i for i in range(12 + a)] for a in range(10)]
    for toks in swarm:
        hasher.hashes(toks)
    assert len(counted) == sum(len(t) // 4 - 16 for t in swarm)  # the system prompt's blocks: never again


def test_block_hashes_same_in_another_process(tiny_dir):
    """No per-process salt: a fresh interpreter (other PYTHONHASHSEED) and a
    restart compute the very same keys and fingerprint."""
    toks = prompt_of(70, 1)
    fp = model_fingerprint(tiny_dir)
    mine = [h.hex() for h in BlockHasher(block_extra(fp, "float32", 16), 16).hashes(toks)]
    code = ("import json,sys; from workers.kv.block_hash import *; "
            "a=json.loads(sys.argv[1]); fp=model_fingerprint(a['dir']); "
            "print(json.dumps([h.hex() for h in BlockHasher(block_extra(fp,'float32',16),16).hashes(a['toks'])]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"dir": str(tiny_dir), "toks": toks})],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == mine and len(mine) == 4


def test_model_fingerprint(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"x": 1}')
    (a / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    fp = model_fingerprint(a)
    assert len(fp) == 32 and model_fingerprint(a) == fp
    b = tmp_path / "b"  # same files, another folder name (GGUF folders are named by its hash)
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
    assert model_fingerprint(b) != fp
    data = bytearray((a / "model.safetensors").read_bytes())
    data[-10] = 1  # a change in the last MiB
    (a / "model.safetensors").write_bytes(bytes(data))
    fp2 = model_fingerprint(a)
    assert fp2 != fp
    (a / "config.json").write_text('{"x": 2}')
    assert model_fingerprint(a) != fp2
