"""The embed worker's engine and role (workers/embed/) on tiny random models:
vectors equal to the model's own forward pass called here, inputs of several
requests batched into one pass with the padding out of every vector, long
inputs in passes, Matryoshka `dimensions`, and failures that stay with their requests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protos.messages import EmbedRequest, EmbedResult, RequestFailed
from tests.support.tiny_embedders import make_tiny_bert, make_tiny_qwen3_embedder
from workers.embed.engine import EmbedEngine, cut
from workers.embed.role import EmbedRole

ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


class Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg, **_):
        self.sent.append(msg)


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return EmbedEngine(str(make_tiny_qwen3_embedder(tmp_path_factory.mktemp("qwen3-embed"))), tokens_per_pass=32)


@pytest.fixture(scope="module", params=["mean", "cls"])
def bert(request, tmp_path_factory):
    folder = make_tiny_bert(tmp_path_factory.mktemp(f"bert-{request.param}"), request.param)
    return EmbedEngine(str(folder), tokens_per_pass=32)


def qwen_alone(engine, tokens) -> np.ndarray:
    """The model's own pass over one input: the final norm's state at its last token."""
    return unit(engine.model.model(mx.array([tokens]))[0, -1])


def bert_alone(engine, tokens) -> np.ndarray:
    states = np.array(engine.model(mx.array([tokens])).last_hidden_state[0])
    return unit(states[0] if engine.config.pooling == "cls" else states.mean(axis=0))


def test_a_qwen3_embedders_vectors_are_its_last_tokens_final_state_normalised(qwen):
    assert qwen.config.pooling == "last" and qwen.matryoshka and qwen.width == 64
    for tokens in ROWS:
        np.testing.assert_allclose(qwen.embed([tokens])[0], qwen_alone(qwen, tokens), atol=1e-5)


def test_inputs_batched_right_padded_give_each_its_vector_alone(qwen):
    """Each row's vector is read at its own last token: the padded batch's
    last position (what left padding would need) is a pad for the short rows."""
    batch = qwen.embed(ROWS)
    for tokens, vector in zip(ROWS, batch):
        np.testing.assert_allclose(vector, qwen_alone(qwen, tokens), atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(vector), 1.0, atol=1e-6)
    padded_end = unit(qwen.model.model(mx.array([ROWS[1] + [0] * 5]))[0, -1])
    assert np.abs(padded_end - batch[1]).max() > 1e-2  # the pads' state is another vector


def test_a_gpus_bucketed_shapes_give_the_same_vectors(qwen, bert):
    """Rows and tokens padded up to powers of two (a GPU's passes): the extra
    rows and columns change no vector."""
    for engine in (qwen, bert):
        engine.buckets = True
        try:
            bucketed = engine.embed(ROWS)  # 3 rows of up to 7 tokens run as 4 rows of 16
        finally:
            engine.buckets = False
        np.testing.assert_allclose(bucketed, engine.embed(ROWS), atol=1e-5)


def test_an_input_longer_than_a_pass_runs_a_pass_at_a_time_to_the_same_vector(qwen):
    tokens = list(range(3, 3 + 75))  # 3 passes of 32
    assert qwen.runs_long(len(tokens)) and not qwen.runs_long(32)
    long, passes = qwen.start_long(tokens), 1
    while (vector := qwen.step_long(long)) is None:
        passes += 1
    assert passes == 3
    np.testing.assert_allclose(vector[0], qwen_alone(qwen, tokens), atol=1e-5)


def test_a_bert_pools_its_inputs_tokens_as_its_config_says_the_padding_masked_out(bert):
    assert not bert.matryoshka and not bert.runs_long(100)
    batch = bert.embed(ROWS)
    for tokens, vector in zip(ROWS, batch):
        np.testing.assert_allclose(vector, bert_alone(bert, tokens), atol=1e-5)


def test_a_pass_takes_inputs_in_order_within_its_tokens_padded():
    engine = EmbedEngine.__new__(EmbedEngine)
    engine.tokens_per_pass = 32
    assert engine.batch_size([4, 4, 4, 4, 4, 4, 4, 4, 4]) == 8  # 8 x 4 = 32
    assert engine.batch_size([4, 20, 4]) == 1  # the second pads both to 20: 40 > 32
    assert engine.batch_size([40, 1]) == 1  # the first always goes


def test_dimensions_cut_and_renormalise():
    v = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    np.testing.assert_allclose(cut(v, 2), [[0.6, 0.8]], atol=1e-7)
    assert cut(v, 0) is v and cut(v, 3) is v


def test_the_role_runs_several_requests_inputs_in_one_pass_and_answers_each(qwen):
    out = Outbox()
    role = EmbedRole(qwen, worker_id="embed-0", outbox=out, clock=None)
    role.handle(EmbedRequest("a", [ROWS[0], ROWS[1]]))
    role.handle(EmbedRequest("b", [ROWS[2]], dimensions=16))
    assert role.waiting == 2 and role.has_work()
    role.step()
    assert not role.has_work() and role.passes == 1 and role.running == role.waiting == 0
    a, b = out.sent
    assert isinstance(a, EmbedResult) and a.request_id == "a" and a.prompt_tokens == 9 and a.passes == 1
    assert a.vectors.dtype == np.float32 and a.vectors.shape == (2, 64)
    np.testing.assert_allclose(a.vectors, qwen.embed(ROWS[:2]), atol=1e-5)
    assert b.vectors.shape == (1, 16)
    np.testing.assert_allclose(b.vectors[0], unit(qwen_alone(qwen, ROWS[2])[:16]), atol=1e-5)


def test_the_role_refuses_bad_requests_drops_cancelled_ones_and_fails_a_broken_pass(qwen, bert):
    out = Outbox()
    role = EmbedRole(bert, worker_id="embed-0", outbox=out, clock=None)
    role.handle(EmbedRequest("dims", [[1, 2]], dimensions=8))  # a BERT is not Matryoshka-trained
    role.handle(EmbedRequest("empty", [[1], []]))
    role.handle(EmbedRequest("outside", [[1], [bert.vocab]]))  # past its embedding table
    assert [(m.request_id, m.status) for m in out.sent] == [("dims", 400), ("empty", 400), ("outside", 400)]
    assert not role.has_work()

    out.sent.clear()
    role = EmbedRole(qwen, worker_id="embed-0", outbox=out, clock=None)
    role.handle(EmbedRequest("gone", [[1, 2]]))
    role.handle(EmbedRequest("kept", [[3, 4]]))
    role.cancel("gone")
    role.step()
    assert [m.request_id for m in out.sent] == ["kept"]

    out.sent.clear()
    role.handle(EmbedRequest("x", [[1, 2]]))
    role.handle(EmbedRequest("y", [[5]]))
    failed = []
    role.fail = lambda rid, exc: failed.append(rid)
    role.engine = type("Broken", (), {"runs_long": lambda self, n: False, "batch_size": lambda self, ls: len(ls),
                                      "embed": lambda self, rows: 1 / 0})()
    role.step()
    assert failed == ["x", "y"] and not out.sent


def test_the_role_runs_a_long_input_a_pass_per_unit_then_the_rest(qwen):
    out = Outbox()
    role = EmbedRole(qwen, worker_id="embed-0", outbox=out, clock=None)
    long = list(range(3, 3 + 70))
    role.handle(EmbedRequest("a", [ROWS[1], long, ROWS[2]]))
    role.handle(EmbedRequest("b", [ROWS[0]]))
    steps = 0
    while role.has_work():
        role.step()
        steps += 1
    assert steps == 5  # ROWS[1]; the long one's 3 passes; ROWS[2] with b's
    a, b = sorted(out.sent, key=lambda m: m.request_id)
    for vector, tokens in zip(a.vectors, [ROWS[1], long, ROWS[2]]):
        np.testing.assert_allclose(vector, qwen_alone(qwen, tokens), atol=1e-5)
    assert a.passes == 5 and b.passes == 1
    np.testing.assert_allclose(b.vectors[0], qwen_alone(qwen, ROWS[0]), atol=1e-5)
