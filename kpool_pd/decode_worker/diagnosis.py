"""Why a prefill node cannot be used, in words an operator can act on.

gRPC reports a failed connection as UNAVAILABLE with details such as ``failed to connect to all
addresses; last error: UNKNOWN: ipv4:10.0.0.7:50051: Failed to connect to remote host:
Connection refused``. ``failure_reason`` keeps the part that says why (``connection refused``)
and names TLS failures as such (``TLS handshake failed: CERTIFICATE_VERIFY_FAILED: ...``).

One TLS mismatch leaves no trace in gRPC's details: a decode node dialling in plaintext a
prefill node that serves TLS sees only ``Socket closed``. ``speaks_tls`` tells that case apart
by opening one TLS handshake to the address (certificates unchecked: it only asks whether TLS
answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl

import grpc

TLS_PROBE_TIMEOUT_S = 1.0
_PREFIX = re.compile(r"^(failed to connect to all addresses; last error: )?"
                     r"(?:[A-Z_]+: )?(?:(?:ipv4|ipv6|unix|dns):[^ ]+: )?")
_TLS = re.compile(r"ssl|tls|certificate|handshake", re.IGNORECASE)
_OPENSSL_NOISE = re.compile(r"SSL_ERROR_SSL: error:[0-9a-f]+:SSL routines:OPENSSL_internal:|: OK$|"
                            r"\(TSI_PROTOCOL_FAILURE\)")


def failure_reason(exc: grpc.aio.AioRpcError, *, timeout_s: float) -> str:
    """A short reason for a failed call to a prefill node (a health check): ``connection
    refused``, ``TLS handshake failed: ...``, ``no answer within 5.0 s``, or the status and details."""
    code, details = exc.code(), (exc.details() or "").strip()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {timeout_s:.1f} s"
    if code is not grpc.StatusCode.UNAVAILABLE:
        return f"{code.name}: {details}" if details else code.name
    text = _PREFIX.sub("", details, count=1)
    if "connection refused" in text.lower():
        return "connection refused"
    if _TLS.search(text):
        if "WRONG_VERSION_NUMBER" in text:
            return ("TLS handshake failed: the prefill node answers in plaintext (WRONG_VERSION_NUMBER): "
                    "it serves no TLS, and this node dials it over TLS")
        text = re.sub(r"^tls handshake failed\s*:?\s*", "", _OPENSSL_NOISE.sub("", text), flags=re.IGNORECASE)
        return f"TLS handshake failed: {text.strip(' :')}"
    return text or "unavailable"


def closed_at_once(reason: str) -> bool:
    """True for a reason that says the peer accepted the connection and closed it (what a TLS
    server does to a plaintext client, and an mTLS server to a client it does not trust)."""
    lowered = reason.lower()
    return "socket closed" in lowered or "connection reset" in lowered or "end of file" in lowered


async def speaks_tls(address: str, timeout_s: float = TLS_PROBE_TIMEOUT_S) -> bool:
    """Whether ``host:port`` completes (or at least answers) a TLS handshake; False when it does
    not answer TLS or cannot be reached within ``timeout_s``. Certificates are not checked."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    writer = None
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), ssl=context), timeout_s)
        return True
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
        return False  # closed without a TLS answer
    except ssl.SSLError as exc:
        # An answer in TLS that refuses us (a client certificate it wants) is TLS; a reply that
        # is not a TLS record (an HTTP/2 server's bytes) is not.
        return "WRONG_VERSION_NUMBER" not in str(exc) and "record layer failure" not in str(exc)
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), timeout_s)


def plaintext_to_tls_reason() -> str:
    return ("TLS handshake failed: the prefill node serves TLS and this node dials it in plaintext "
            "(give it --tls-cert, --tls-key and --tls-ca)")
