"""TLS for both daemons and the command-line client: the ``--tls-*`` options and their PEM files.

One certificate per daemon serves as its server identity and, on a decode node, as its client
identity towards prefill nodes (mTLS); ``tls-ca`` checks the peers' certificates (clients of a
server when ``tls-require-client-auth`` is on; prefill servers on a decode node's channels).
TLS is on when ``tls-cert`` and ``tls-key`` are given, off when neither is; anything in between
is a ``SettingsError`` naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kpool_pd.connector import TlsConfig
from kpool_pd.runtime.options import Option, SettingsError, parse_bool, text_value

TLS_OPTIONS: tuple[Option, ...] = (
    Option("tls-cert", text_value, "", "PEM certificate chain of this daemon (with tls-key: serve TLS; empty: plaintext)"),
    Option("tls-key", text_value, "", "PEM private key of tls-cert"),
    Option("tls-ca", text_value, "", "PEM CA bundle that peers' certificates are checked against"),
    Option("tls-require-client-auth", parse_bool, False, "refuse clients without a certificate signed by tls-ca"),
)
# Only the decode node opens channels (to prefill nodes) whose name can differ from the certificate's.
TLS_CLIENT_OPTIONS: tuple[Option, ...] = (
    Option("tls-server-name", text_value, "", "name expected in prefill nodes' certificates (empty: the host dialled)"),
)


def read_pem(option: str, path: str) -> bytes:
    """The bytes of the PEM file ``path`` that ``option`` names; SettingsError when unreadable."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"{option} {path}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise SettingsError(f"{option} {path}: not a PEM file (no -----BEGIN line)")
    return data


def tls_config(settings: Mapping[str, Any]) -> TlsConfig | None:
    """The daemon's TlsConfig from its settings (None: plaintext). Reads every file now, so a
    missing or unreadable one fails at start-up with its option and path."""
    cert, key, ca = settings["tls_cert"], settings["tls_key"], settings["tls_ca"]
    require = settings["tls_require_client_auth"]
    server_name = settings.get("tls_server_name", "")
    if not cert and not key:
        given = [name for name, value in (("tls-ca", ca), ("tls-require-client-auth", require),
                                          ("tls-server-name", server_name)) if value]
        if given:
            raise SettingsError(f"{', '.join(given)} given without tls-cert and tls-key: TLS needs this "
                                f"daemon's certificate and key")
        return None
    if not cert:
        raise SettingsError(f"tls-key {key} given without tls-cert: both are needed")
    if not key:
        raise SettingsError(f"tls-cert {cert} given without tls-key: both are needed")
    if require and not ca:
        raise SettingsError("tls-require-client-auth needs tls-ca to check client certificates against")
    return TlsConfig(cert_chain=read_pem("tls-cert", cert), private_key=read_pem("tls-key", key),
                     root_certs=read_pem("tls-ca", ca) if ca else None, require_client_auth=require,
                     server_name_override=server_name or None)


def client_tls(*, ca: str = "", cert: str = "", key: str = "", server_name: str = "") -> TlsConfig | None:
    """A client's TlsConfig from file paths (None: plaintext when none is given). TLS is on with
    any of them; ``cert`` and ``key`` (the client's identity, for mTLS) go together."""
    if not (ca or cert or key):
        if server_name:
            raise SettingsError("tls-server-name given without tls-ca, tls-cert or tls-key")
        return None
    if bool(cert) != bool(key):
        raise SettingsError(f"{'tls-key' if key else 'tls-cert'} given without "
                            f"{'tls-cert' if key else 'tls-key'}: a client certificate needs both")
    return TlsConfig(root_certs=read_pem("tls-ca", ca) if ca else None,
                     cert_chain=read_pem("tls-cert", cert) if cert else None,
                     private_key=read_pem("tls-key", key) if key else None, server_name_override=server_name or None)
