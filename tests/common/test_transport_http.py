"""The bearer-token check every role's servers share (common/transport/http.py)."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from common.errors import Unauthorized
from common.transport.http import (
    PendingAnswer,
    Request,
    Response,
    Route,
    Then,
    TokenCheck,
    auth_headers,
    run_handler,
    start_handler,
)



def test_bearer_check() -> None:
    token = "s3cret"
    check = TokenCheck(token)
    check.check(auth_headers(token))
    for headers in ({}, {"authorization": ""}, {"authorization": "Basic abc"},
                    {"authorization": f"Bearer {token}x"}, {"authorization": "Bearer "}):
        with pytest.raises(Unauthorized):
            check.check(headers)
    TokenCheck(None).check({})


def test_a_request_dropped_before_its_task_ran_leaves_no_handler_coroutine_unawaited() -> None:
    """A server that never awaits a pending answer (its stream was reset before the task for
    it ran) closes it: the handler's own coroutine, made when the handler was called, is
    closed with the `Then` that encodes its answer, and never warns that it was not awaited."""
    async def handler_answer() -> str:
        return "rows"

    route = Route(handler=lambda _: Then(handler_answer(), lambda r: Response(body=r.encode())), public=False)
    request = Request(method="POST", path="/fetch", query={}, headers={}, body=b"")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pending = start_handler(route, request)
        assert isinstance(pending, PendingAnswer)
        pending.close()
        del pending
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


def test_then_encodes_the_answer_once_it_comes() -> None:
    async def handler_answer() -> str:
        return "rows"

    route = Route(handler=lambda _: Then(handler_answer(), lambda r: Response(body=r.encode())), public=False)
    request = Request(method="POST", path="/fetch", query={}, headers={}, body=b"")
    answer = asyncio.run(run_handler(route, request))
    assert isinstance(answer, Response) and answer.body == b"rows"
