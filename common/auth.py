"""Bearer-token check shared by every service."""

from __future__ import annotations

import hmac
import secrets

from common.errors import Unauthorized


def new_token() -> str:
    """A fresh random token for a local cluster."""
    return secrets.token_urlsafe(24)


def bearer(token: str) -> dict[str, str]:
    """The request header that carries `token`."""
    return {"authorization": f"Bearer {token}"}


def check_bearer(header: str | None, token: str) -> None:
    """Raise Unauthorized unless `header` is ``Bearer <token>``; constant time in the token."""
    if not header or not header.startswith("Bearer "):
        raise Unauthorized("missing bearer token")
    if not hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode()):
        raise Unauthorized("wrong bearer token")
