"""The memoising HPACK coders give exactly what hpack's own give, block by block."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.transport.hpack_memo import MEMO_BLOCKS, MemoDecoder, MemoEncoder

# Few names and values, so that header lists repeat and the tables evict (a small table).
_NAME_VALUE = st.tuples(st.sampled_from(["a", "bb", "content-length", ":path"]),
                        st.sampled_from(["1", "22", "333", "/v1/fetch", "x" * 40]))
# Sometimes h2's HeaderTuple, sometimes marked sensitive (never indexed): coded as hpack does.
_HEADER = st.one_of(
    _NAME_VALUE, _NAME_VALUE, _NAME_VALUE,
    _NAME_VALUE.map(lambda h: hpack.HeaderTuple(*h)),
    _NAME_VALUE.map(lambda h: hpack.NeverIndexedHeaderTuple(*h)),
)
_LIST = st.lists(_HEADER, min_size=1, max_size=4)
_STEP = st.one_of(_LIST, _LIST, _LIST, st.sampled_from([0, 64, 128, 4096]))  # a list, or a resize


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=40))
def test_blocks_and_headers_are_hpacks_through_repeats_resizes_and_evictions(steps) -> None:
    plain_enc, memo_enc = hpack.Encoder(), MemoEncoder()
    plain_dec, memo_dec = hpack.Decoder(), MemoDecoder()
    for step in steps:
        if isinstance(step, int):  # the peer's SETTINGS_HEADER_TABLE_SIZE
            plain_enc.header_table_size = memo_enc.header_table_size = step
            continue
        block = plain_enc.encode(step)
        assert memo_enc.encode(step) == block
        decoded = _outcome(plain_dec, block)
        assert _outcome(memo_dec, block) == decoded
        if isinstance(decoded, str):  # hpack refused it: the connection would end here
            return


def _outcome(decoder: hpack.Decoder, block: bytes) -> list | str:
    """The headers, or the name of the error hpack raised."""
    try:
        return decoder.decode(block, raw=True)
    except hpack.HPACKError as exc:
        return type(exc).__name__


def test_the_block_after_a_resize_carries_the_size_update_once() -> None:
    # Found by the test above: the block that announces a resize was remembered with it.
    plain, memo = hpack.Encoder(), MemoEncoder()
    for step in ([("bb", "22")], 64, [("bb", "22")], [("bb", "22")]):
        if isinstance(step, int):
            plain.header_table_size = memo.header_table_size = step
        else:
            assert memo.encode(step) == plain.encode(step)


def test_a_repeated_block_is_decoded_anew_once_the_table_changed() -> None:
    encoder, decoder = hpack.Encoder(), MemoDecoder()
    decoder.decode(encoder.encode([("x-one", "1")]))
    newest = encoder.encode([("x-one", "1")])  # one index byte: the newest dynamic entry
    assert decoder.decode(newest) == [("x-one", "1")]
    assert decoder.decode(newest) == [("x-one", "1")]  # from the memo
    decoder.decode(encoder.encode([("x-two", "2")]))  # a new newest entry
    assert encoder.encode([("x-two", "2")]) == newest  # the very same byte ...
    assert decoder.decode(newest) == [("x-two", "2")]  # ... now means the other header


@pytest.mark.parametrize("coder", [MemoEncoder, MemoDecoder])
def test_the_memo_stays_bounded(coder) -> None:
    memo = coder()
    encoder = hpack.Encoder()
    for i in range(3 * MEMO_BLOCKS):
        headers = [(":path", "/v1/fetch"), ("content-type", f"t{i % 7}")]
        if coder is MemoEncoder:
            memo.encode(headers)
        else:
            memo.decode(encoder.encode(headers))
        assert len(memo._memo._blocks) <= MEMO_BLOCKS
