"""The bearer-token check every role's servers share (common/transport/http.py)."""

from __future__ import annotations

import pytest

from common.errors import Unauthorized
from common.transport.http import TokenCheck, auth_headers



def test_bearer_check() -> None:
    token = "s3cret"
    check = TokenCheck(token)
    check.check(auth_headers(token))
    for headers in ({}, {"authorization": ""}, {"authorization": "Basic abc"},
                    {"authorization": f"Bearer {token}x"}, {"authorization": "Bearer "}):
        with pytest.raises(Unauthorized):
            check.check(headers)
    TokenCheck(None).check({})
