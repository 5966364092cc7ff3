from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from common.errors import WireError
from common import wire
from common.wire import MEMO_HEADER_BYTES, decode, encode, encode_parts, peer_json, require

DTYPES = ["<f4", "<f8", "<i4", "<i8", "|u1"]


@settings(max_examples=200, deadline=None)
@given(
    meta=st.dictionaries(st.text(max_size=5), st.integers(-(2**31), 2**31), max_size=3),
    arrays=st.lists(
        st.sampled_from(DTYPES).flatmap(
            lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
        ),
        max_size=4,
    ),
)
def test_round_trip_is_exact(meta: dict, arrays: list[np.ndarray]) -> None:
    named = {f"a{i}": a for i, a in enumerate(arrays)}
    got_meta, got = decode(encode(meta, named))
    assert got_meta == meta
    assert list(got) == list(named)
    for name, arr in named.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
        assert got[name].tobytes() == arr.tobytes()


def test_decode_is_zero_copy_and_aligned() -> None:
    body = bytearray(encode({}, {"x": np.arange(3, dtype=np.int8), "y": np.ones((4, 4), np.float32)}))
    _, arrays = decode(body)
    assert arrays["y"].ctypes.data % 8 == (np.frombuffer(body, np.uint8).ctypes.data % 8)
    body[-1] ^= 0xFF  # the view sees changes to the buffer: nothing was copied
    assert arrays["y"][-1, -1] != 1.0


def test_parts_join_to_the_message() -> None:
    arrays = {"k": np.arange(7, dtype=np.int64)}
    assert b"".join(bytes(p) for p in encode_parts({"op": 1}, arrays)) == encode({"op": 1}, arrays)


def test_big_endian_input_travels_as_little_endian() -> None:
    _, got = decode(encode({}, {"x": np.arange(3, dtype=">i4")}))
    assert got["x"].dtype == np.dtype("<i4") and got["x"].tolist() == [0, 1, 2]


def test_object_arrays_are_refused() -> None:
    with pytest.raises(WireError, match="cannot travel"):
        encode({}, {"x": np.array(["a"], dtype=object)})


def _raw(header: dict, payload: bytes = b"") -> bytes:
    head = orjson.dumps(header)
    pad = -(4 + len(head)) % 8
    return len(head).to_bytes(4, "little") + head + bytes(pad) + payload


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "shorter than"),
        (b"\xff\xff\xff\x00abc", "does not fit"),
        ((5).to_bytes(4, "little") + b"{nope", "not valid JSON"),
        (_raw([1, 2]), "must be an object"),
        (_raw({"arrays": {}}), "must be a list"),
        (_raw({"arrays": [["x", "<f4"]]}), r"\[name, dtype, shape\]"),
        (_raw({"arrays": [["x", "|O", [1]]]}), "not allowed"),
        (_raw({"arrays": [["x", "<f4", [-1]]]}), "shape"),
        (_raw({"arrays": [["x", "<f4", [2**20, 2**20]]]}), "runs past the end"),
        (_raw({"arrays": [["x", "<f4", [4]]]}, bytes(8)), "runs past the end"),
        # Empty arrays whose other dimensions numpy cannot represent (once a 500).
        (_raw({"arrays": [["keys", "<i8", [0, 2**63]]]}), "too large"),
        (_raw({"arrays": [["keys", "<i8", [0, 2**62]]]}), "too large"),
        (_raw({"arrays": [["x", "|u1", [0, 2**40, 2**40]]]}), "too large"),
        (_raw({"arrays": [["x", "<f4", [0] * 65]]}), "at most 8"),
        (_raw({"arrays": [["x", "<f4", [1] * 9]]}), "at most 8"),
        (_raw({"arrays": [["x", "<f4", [True]]]}), "invalid"),
        (_raw({"arrays": []}, bytes(8)), "unexpected bytes"),
    ],
)
def test_malformed_bodies_raise_wire_error(body: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode(body)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from([*DTYPES, "<i8", "|i1"]),
    shape=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1)), max_size=10),
    payload=st.integers(0, 64),
)
def test_any_shape_decodes_or_raises_wire_error(dtype: str, shape: list[int], payload: int) -> None:
    body = _raw({"arrays": [["x", dtype, shape]]}, bytes(payload))
    try:
        _, arrays = decode(body)
    except WireError:
        return
    assert arrays["x"].shape == tuple(shape)


def test_a_remembered_header_is_checked_against_each_body() -> None:
    """`decode` remembers a header's array layout; the body's length is still checked each
    time, and a header once refused is refused again."""
    header = {"meta": {"n": 1}, "arrays": [["x", "<i8", [2]]]}
    _, first = decode(_raw(header, np.array([5, 6], np.int64).tobytes()))
    meta, again = decode(_raw(header, np.array([7, 8], np.int64).tobytes()))
    assert first["x"].tolist() == [5, 6] and again["x"].tolist() == [7, 8] and meta == {"n": 1}
    meta["n"] = 2  # the caller's copy: the next decode is not affected
    assert decode(_raw(header, bytes(16)))[0] == {"n": 1}
    with pytest.raises(WireError, match="runs past the end"):
        decode(_raw(header, bytes(8)))
    with pytest.raises(WireError, match="unexpected bytes"):
        decode(_raw(header, bytes(24)))
    for _ in range(2):
        with pytest.raises(WireError, match="not allowed"):
            decode(_raw({"arrays": [["x", "|O", [1]]]}))


def test_long_headers_are_decoded_but_not_remembered() -> None:
    """Headers up to MAX_HEADER_BYTES decode; only short ones are remembered, so that a peer
    cannot pin megabytes in the memo with long distinct headers."""
    before = wire._remembered_header.cache_info()
    long_meta = {"pad": "x" * MEMO_HEADER_BYTES}
    meta, arrays = decode(encode(long_meta, {"x": np.arange(2)}))
    assert meta == long_meta and arrays["x"].tolist() == [0, 1]
    after = wire._remembered_header.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)
    decode(encode({"fresh": id(after)}, {"x": np.arange(2)}))  # a short one is looked up
    assert wire._remembered_header.cache_info().misses == after.misses + 1


def test_one_layout_encoded_again_keeps_each_meta_and_payload() -> None:
    """`encode_parts` remembers a layout's header: the meta and the arrays are each body's own."""
    for n in (1, 2, 1):
        meta, arrays = decode(encode({"n": n}, {"x": np.full(3, n)}))
        assert meta == {"n": n} and arrays["x"].tolist() == [n] * 3


def test_require_checks_presence_dtype_and_rank() -> None:
    _, arrays = decode(encode({}, {"k": np.zeros(3, np.int64), "r": np.zeros((3, 2), np.float32)}))
    assert require(arrays, "k", "<i8", 1).shape == (3,)
    with pytest.raises(WireError, match="missing"):
        require(arrays, "nope", "<i8", 1)
    with pytest.raises(WireError, match="must be 1-d int64"):
        require(arrays, "r", "<i8", 1)


def test_an_array_declared_twice_is_refused_naming_it() -> None:
    """The last one won: a body could say two things about its keys."""
    head = orjson.dumps({"arrays": [["keys", "<i8", [1]], ["keys", "<i8", [1]]]})
    body = len(head).to_bytes(4, "little") + head + bytes(-(4 + len(head)) % 8) + bytes(16)
    with pytest.raises(WireError, match="'keys' is declared twice") as caught:
        decode(body)
    assert caught.value.fields["array"] == "keys"


def test_an_error_quotes_at_most_a_few_hundred_bytes_of_the_header() -> None:
    name = "k" * 100_000
    for spec in ([name, "<c16", [1]], [name, "<i8", "x" * 100_000], ["x" * 100_000]):
        head = orjson.dumps({"arrays": [spec]})
        body = len(head).to_bytes(4, "little") + head + bytes(-(4 + len(head)) % 8)
        with pytest.raises(WireError) as caught:
            decode(body)
        assert len(caught.value.message) < 600
        assert all(len(str(v)) < 300 for v in caught.value.fields.values())


def test_a_header_naming_a_key_twice_is_refused() -> None:
    header = b'{"meta":{"version":3,"version":9},"arrays":[]}'
    body = len(header).to_bytes(4, "little") + header
    with pytest.raises(WireError, match="names the key 'version' twice"):
        decode(body + bytes(-len(body) % 8))


def test_peer_json_takes_colons_in_strings_and_refuses_repeats_at_any_depth() -> None:
    assert peer_json(b'{"url": "http://a:1", "n": [{"x": 1}]}') == {"url": "http://a:1", "n": [{"x": 1}]}
    with pytest.raises(WireError, match="'x' twice"):
        peer_json(b'{"n": [{"x": 1, "x": 2}]}')
    with pytest.raises(WireError, match="not valid JSON"):
        peer_json(b"{")
