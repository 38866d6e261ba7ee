"""Throwaway TLS material for ``kpool-pd up --tls`` and the tests: a CA and certificates it
signs (EC P-256, valid two days), made with the ``openssl`` command in a folder the caller owns.

Each leaf certificate names ``localhost``, ``127.0.0.1`` and the extra hosts given, and may
serve as a server and as a client identity, as the daemons use it (mTLS).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL_TIMEOUT_S = 60.0
_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


class CertificateError(RuntimeError):
    pass


@dataclass(frozen=True, kw_only=True)
class Identity:
    cert: Path  # PEM certificate
    key: Path   # PEM private key


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise CertificateError("making throwaway certificates needs the openssl command, which is not on PATH")
    try:
        proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=OPENSSL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CertificateError(f"openssl {args[0]} did not finish within {OPENSSL_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        raise CertificateError(f"openssl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")


def make_ca(directory: Path, name: str = "ca") -> Identity:
    """A self-signed CA in ``directory`` (``<name>.pem``, ``<name>.key``)."""
    _openssl("req", "-x509", *_KEY, "-days", "2", "-subj", f"/CN=kpool-pd throwaway {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)
    return Identity(cert=directory / f"{name}.pem", key=directory / f"{name}.key")


def issue(directory: Path, ca: Identity, name: str, *, hosts: tuple[str, ...] = ()) -> Identity:
    """A certificate for ``name`` signed by ``ca``, for ``localhost``, ``127.0.0.1`` and ``hosts``."""
    names = ["localhost", "127.0.0.1", *hosts]
    alt = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in dict.fromkeys(names))
    (directory / f"{name}.ext").write_text(f"basicConstraints=CA:FALSE\nsubjectAltName={alt}\n"
                                           "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-new", *_KEY, "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key),
             "-set_serial", str(secrets.randbits(63)), "-days", "2", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=directory)
    return Identity(cert=directory / f"{name}.pem", key=directory / f"{name}.key")
