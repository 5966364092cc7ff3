"""HPACK coders that remember the header blocks a connection repeats.

A connection's requests (and its answers) mostly carry the same headers, and once HPACK's
dynamic table holds them a header block is a few index bytes: the same block, every time.
hpack still decodes such a block field by field (about 15 us for a PS request's 8 headers,
a tenth of what a small fetch costs the shard) and encodes its headers by searching the
table for each (about 12 us).

These coders keep the last blocks whose coding left the dynamic table as it was, and reuse
one only while the table has not changed since: a block of indexed fields decodes to the
same headers, and the same headers encode to the same block, for as long as the table is
the same. Every change to a table (an entry added, its size changed) counts a generation;
a remembered block is tied to the generation it was coded at. The output is always what
hpack's own coders give (tests/common/test_hpack_memo.py checks it on random sequences).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hpack
from hpack.table import HeaderTable

#: Blocks remembered per coder; past it the memo starts afresh (a peer sending ever new
#: blocks costs a dict of this size, no more).
MEMO_BLOCKS = 64


class _CountedTable(HeaderTable):
    """A dynamic table that counts its changes (`generation`)."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    def _set_maxsize(self, value: int) -> None:
        self.generation += 1
        HeaderTable.maxsize.fset(self, value)  # type: ignore[attr-defined]

    maxsize = property(HeaderTable.maxsize.fget, _set_maxsize)  # type: ignore[attr-defined]


class _Memo:
    def __init__(self) -> None:
        self._blocks: dict[Any, tuple[int, Any]] = {}

    def get(self, key: Any, generation: int) -> Any:
        hit = self._blocks.get(key)
        return hit[1] if hit is not None and hit[0] == generation else None

    def put(self, key: Any, generation: int, value: Any) -> None:
        if len(self._blocks) >= MEMO_BLOCKS:
            self._blocks.clear()
        self._blocks[key] = (generation, value)


class MemoDecoder(hpack.Decoder):
    """`hpack.Decoder` that decodes a repeated block of indexed fields once per table state."""

    def __init__(self, max_header_list_size: int = hpack.hpack.DEFAULT_MAX_HEADER_LIST_SIZE) -> None:
        super().__init__(max_header_list_size)
        self.header_table = _CountedTable()
        self._memo = _Memo()

    def decode(self, data: bytes, raw: bool = False) -> Iterable[hpack.HeaderTuple]:
        table: _CountedTable = self.header_table  # type: ignore[assignment]
        generation = table.generation
        # The limits are part of the key: a block decoded under looser ones is checked again.
        key = (bytes(data), raw, self.max_header_list_size, self.max_allowed_table_size)
        headers = self._memo.get(key, generation)
        if headers is not None:
            return list(headers)
        decoded = list(super().decode(data, raw))
        if table.generation == generation:
            self._memo.put(key, generation, tuple(decoded))
        return decoded


class MemoEncoder(hpack.Encoder):
    """`hpack.Encoder` that encodes a repeated list of plain (name, value) tuples once per
    table state. Other headers (h2's `HeaderTuple`s, which may be marked sensitive, dicts)
    are encoded as hpack does, every time."""

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _CountedTable()
        self._memo = _Memo()

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        table: _CountedTable = self.header_table  # type: ignore[assignment]
        key = _plain(headers, huffman)
        generation = table.generation
        # After a resize, hpack starts the next block with the size update, once: that
        # block is never repeated.
        resized = table.resized
        if key is not None and not resized:
            block = self._memo.get(key, generation)
            if block is not None:
                return block
        block = super().encode(headers, huffman)
        if key is not None and not resized and table.generation == generation:
            self._memo.put(key, generation, block)
        return block


def _plain(headers: Any, huffman: bool) -> tuple[Any, ...] | None:
    """A hashable key for a list of plain 2-tuples of str or bytes, else None."""
    if not isinstance(headers, list | tuple):
        return None
    for header in headers:
        if type(header) is not tuple or len(header) != 2:
            return None
        name, value = header
        if type(name) not in (str, bytes) or type(value) not in (str, bytes):
            return None
    return (huffman, *headers)
