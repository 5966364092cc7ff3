"""One error family for every role.

Each class carries the HTTP status it maps to, so a service turns any `BagpipeError` raised
by a sans-IO core into the right 4xx/5xx answer in one place, and a client turns the answer
back into the same class.
"""

from __future__ import annotations

import reprlib
from typing import Any, ClassVar

#: The most of a peer's value an error message quotes: enough to recognise it, never a body's
#: worth (the message travels back in the answer and into the logs of both ends).
QUOTE_LIMIT = 200

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = QUOTE_LIMIT
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 10
_REPR.maxlevel = 3


def quoted(value: object) -> str:
    """`repr(value)` for an error message, at most about `QUOTE_LIMIT` characters whatever
    the value's size (reprlib: a long string or list is cut without being formatted whole)."""
    text = _REPR.repr(value)
    return text if len(text) <= QUOTE_LIMIT + 10 else text[:QUOTE_LIMIT] + "...'"


def clipped(text: str) -> str:
    """`text` (a peer's, for an error's structured field) cut to `QUOTE_LIMIT` characters."""
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "..."


class BagpipeError(Exception):
    """Root of every error this project raises on purpose."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def to_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.fields}


class ConfigError(BagpipeError):
    """A cluster spec, data file or command-line value is invalid; names the field."""

    code = "config"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)
        self.field = field


class BadRequest(BagpipeError):
    status = 400
    code = "bad_request"


class WireError(BadRequest):
    """A binary body does not follow the wire format."""

    code = "bad_body"


class Unauthorized(BagpipeError):
    status = 401
    code = "unauthorized"


class NotFound(BagpipeError):
    status = 404
    code = "not_found"


class MethodNotAllowed(BagpipeError):
    status = 405
    code = "method_not_allowed"


class Conflict(BagpipeError):
    """The request is well formed but contradicts stored state (e.g. a stale version)."""

    status = 409
    code = "conflict"


class Restarted(Conflict):
    """The request was meant for an earlier incarnation of a service that has restarted
    since (its ``incarnation`` field names the current one)."""

    code = "restarted"


class Regrouped(Conflict):
    """The job regrouped since this role joined: a trainer left or one joined, and every role
    starts again from the job's latest complete checkpoint (docs/design.md#elastic-trainers).
    The role that meets it restarts itself and registers again."""

    code = "regrouped"


class PayloadTooLarge(BagpipeError):
    status = 413
    code = "payload_too_large"


class StorageFailed(BagpipeError):
    """Something could not be written to disk (a checkpoint on a full or unwritable disk)."""

    status = 507
    code = "storage"


class Unavailable(BagpipeError):
    """A peer could not be reached or stopped answering."""

    status = 503
    code = "unavailable"


class TlsError(BagpipeError):
    """TLS could not be agreed with a peer: one end speaks TLS and the other does not, a
    certificate does not verify, a client certificate is missing. Not retried: only a change
    of configuration mends it (docs/design.md#authentication-and-limits)."""

    status = 400
    code = "tls"


class TimedOut(BagpipeError):
    """A wait (for a version, a peer, a response) ran past its limit."""

    status = 504
    code = "timeout"


_BY_CODE: dict[str, type[BagpipeError]] = {
    cls.code: cls
    for cls in (
        BagpipeError,
        BadRequest,
        WireError,
        Unauthorized,
        NotFound,
        MethodNotAllowed,
        Conflict,
        Restarted,
        Regrouped,
        PayloadTooLarge,
        StorageFailed,
        Unavailable,
        TlsError,
        TimedOut,
    )
}


def error_from_json(status: int, payload: dict[str, Any]) -> BagpipeError:
    """Rebuild the error a peer answered with, keeping its class where it is known."""
    cls = _BY_CODE.get(str(payload.get("error")), BagpipeError)
    fields = {k: v for k, v in payload.items() if k not in ("error", "message")}
    err = cls(str(payload.get("message", f"HTTP {status}")), **fields)
    return err
