"""What the router takes from a client's headers and what it sends the instances.

The instances get only an allowlist of the client's headers; aiohttp adds its own (Host, Content-Type,
Content-Length, Accept, Accept-Encoding, User-Agent). From the client:

- ``X-Request-Id``: forwarded when it is 1 to 128 printable ASCII characters without spaces; otherwise
  the router's own (uuid4 hex) replaces it, and the replacement is logged. (The producer names a grant by
  it: an id of a few hundred characters left it unable to offer the KV.)
- ``Authorization``: forwarded as it is while the router has no key of its own. With ``api_key`` the router
  checks it (``Bearer <api_key>``, compared in constant time) and does not forward it; the instances get
  ``Bearer <backend_api_key>`` instead when that is set, no Authorization otherwise.

Nothing else of the client's (cookies, forwarding headers, tracing) reaches the instances."""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Mapping

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LENGTH = 128


def acceptable_request_id(value: str | None) -> bool:
    """1 to 128 characters, each printable ASCII other than space (``!`` to ``~``)."""
    return value is not None and 0 < len(value) <= MAX_REQUEST_ID_LENGTH and all("!" <= c <= "~" for c in value)


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id`` when acceptable, else a new uuid4 hex (logged with why)."""
    given = headers.get("X-Request-Id")
    if acceptable_request_id(given):
        return given
    own = uuid.uuid4().hex
    if given is not None:
        logger.warning("request id replaced by %s: the client's (%d characters, starting %r) is not 1-%d printable "
                       "ASCII characters without spaces", own, len(given), given[:32], MAX_REQUEST_ID_LENGTH)
    return own


def authorized(headers: Mapping[str, str], api_key: str) -> bool:
    """The client's Authorization is ``Bearer <api_key>`` (compared in constant time)."""
    given = headers.get("Authorization", "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {api_key}".encode())


def backend_headers(headers: Mapping[str, str], request_id: str, *, api_key: str | None,
                    backend_api_key: str | None) -> dict[str, str]:
    """The headers an instance gets for a client's request (the module docstring says which)."""
    forwarded = {"X-Request-Id": request_id}
    if backend_api_key is not None:
        forwarded["Authorization"] = f"Bearer {backend_api_key}"
    elif api_key is None and "Authorization" in headers:
        forwarded["Authorization"] = headers["Authorization"]
    return forwarded
