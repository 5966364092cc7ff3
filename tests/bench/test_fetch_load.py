"""bench/fetch_load.py against a real PS shard in this process: its prepared requests are
answered like PsClient's, and its framing-only counting tells right answers from wrong."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from bench.fetch_load import FetchLoad, Fetches, H2Requests
from common.keys import TableLayout
from common.transport import H2Server, Http1Server
from ps.service import PsService
from ps.store import ShardConfig, ShardStore

TOKEN = "t"
KEYS, DIM = 4, 8


def _fetches(port: int, service: PsService, token: str = TOKEN, incarnation: str | None = None) -> Fetches:
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, 1000, KEYS, dtype=np.int64) for _ in range(4)]
    return Fetches.of_keys(keys, dim=DIM, state_width=0, host="127.0.0.1", port=port, token=token,
                           incarnation=incarnation or service.incarnation)


def _shard(kind: str, tmp_path: Path) -> tuple[PsService, H2Server | Http1Server]:
    config = ShardConfig(shard=0, num_shards=1, layout=TableLayout((1000,)), dim=DIM, state_width=0)
    service = PsService(ShardStore(config), checkpoint_dir=tmp_path, fetch_timeout_s=5)
    return service, (H2Server if kind == "h2" else Http1Server)(service.router(), token=TOKEN)


@pytest.mark.parametrize("kind", ["h2", "http1"])
@pytest.mark.parametrize("incarnation", [None, "an-earlier-process"])
async def test_answers_are_counted_right_or_wrong(kind: str, incarnation: str | None, tmp_path: Path) -> None:
    service, server = _shard(kind, tmp_path)
    await server.start()
    load = await FetchLoad.connect(kind, _fetches(server.port, service, incarnation=incarnation), in_flight=4)
    try:
        await load.run(0.0)  # one fetch per slot
        right, wrong = await load.run(time.perf_counter() + 0.3)
    finally:
        load.close()
        await server.stop()
    answered = service.metrics.value("requests_total", {"op": "fetch"})
    if incarnation is None:
        assert right > 0 and wrong == 0
        assert answered >= right + 4
    else:  # every fetch refused (409: meant for an earlier process), none served
        assert right == 0 and wrong > 0
        assert answered == 0


@pytest.mark.parametrize("kind", ["h2", "http1"])
async def test_a_wrong_token_fails_the_load_at_once(kind: str, tmp_path: Path) -> None:
    """The shard answers the first fetch of a connection without the token 401 and closes it:
    the HTTP/2 load fails in its first round, the HTTP/1.1 one (a fetch per connection,
    each answered 401) when it sends again."""
    service, server = _shard(kind, tmp_path)
    await server.start()
    load = await FetchLoad.connect(kind, _fetches(server.port, service, token="wrong"), in_flight=4)
    try:
        with pytest.raises(ConnectionError, match="connection to the shard lost"):
            await load.run(0.0)
            await load.run(time.perf_counter() + 0.3)
    finally:
        load.close()
        await server.stop()
    assert service.metrics.value("requests_total", {"op": "fetch"}) == 0


def test_the_in_process_protocol_measure_answers_every_fetch() -> None:
    """bench/ps_fetch.py's in-process section drives a real h2 server connection with the
    prepared bytes; it raises unless every fetch was answered at once, and OK."""
    from bench.ps_fetch import measure_protocol

    figures = measure_protocol(rounds=1, requests=64, rows=1000)
    for key in ("protocol_h2_us_per_req_1", "protocol_h2_us_per_req", "protocol_handler_us_per_req"):
        assert figures[key] > 0 and figures[f"{key}_range"] == [figures[key], figures[key]]


def test_prepared_h2_requests_number_their_streams_in_order() -> None:
    service = PsService(ShardStore(ShardConfig(shard=0, num_shards=1, layout=TableLayout((1000,)), dim=DIM,
                                               state_width=0)), checkpoint_dir=Path("/nonexistent"),
                        fetch_timeout_s=5)
    requests = H2Requests(_fetches(1, service))
    first, ids = requests.next(3)
    assert list(ids) == [1, 3, 5] and first
    assert list(requests.next(2)[1]) == [7, 9]
    assert list(requests.next(0)[1]) == [] and list(requests.next(1)[1]) == [11]
