"""The router's byte-level BPE table (router/text/text_stream.py) against the
one mlx-lm's detokenizer uses: the router keeps its own so that it touches no
private name of mlx-lm, and the two must never drift apart."""

from mlx_lm.tokenizer_utils import _byte_decoder

from router.text.text_stream import byte_level_bytes


def test_the_byte_table_is_gpt2s_as_mlx_lm_has_it():
    table = byte_level_bytes()
    assert table == _byte_decoder()
    assert sorted(table.values()) == list(range(256))  # every byte, once
    assert table["Ġ"] == 32 and table["A"] == 65  # the space as byte-level BPE writes it
