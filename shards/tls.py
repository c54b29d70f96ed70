"""TLS for the shard channel (shards/direct.py), with Ray's own setting and files.

Why: with Ray's TLS on (``RAY_USE_TLS``), Ray's traffic between nodes is encrypted and each end
checks the other's certificate against the cluster's CA; a shard channel beside it in plaintext
would carry the same queries and answers readable (and its handshake key's proofs) on the same
network. So the channel follows Ray: TLS with the files Ray uses (``RAY_TLS_SERVER_CERT``,
``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT``), both ends presenting the certificate and requiring
the peer's (as Ray's gRPC servers require client certificates), no host name check (nodes are
reached by IP, and Ray's own certificates name them in DNS entries Python does not match against
an IP). TLS on without its files is an error (``TlsSetupError``), never a fall back to plaintext.
"""

from __future__ import annotations

import functools
import os
import ssl

TLS_ENV = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


class TlsSetupError(RuntimeError):
    """Ray's TLS is on (``RAY_USE_TLS``) but the channel cannot run it (files not named, missing or
    unreadable, or the other end without TLS): the channel refuses to run in plaintext."""


def tls_files() -> tuple[str, str, str] | None:
    """(certificate, key, CA) files of Ray's TLS where ``RAY_USE_TLS`` is on (Ray's reading: "1"
    or "true"), else None; TlsSetupError where it is on and a file is not named or not there."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return None
    missing = [name for name in TLS_ENV if not os.environ.get(name)]
    if missing:
        raise TlsSetupError(
            f"RAY_USE_TLS is on but {', '.join(missing)} not set: the shard channel does not run in plaintext"
        )
    absent = [f"{name}={os.environ[name]}" for name in TLS_ENV if not os.path.isfile(os.environ[name])]
    if absent:
        raise TlsSetupError(f"RAY_USE_TLS is on but no such file: {', '.join(absent)}")
    cert, key, ca = (os.environ[name] for name in TLS_ENV)
    return cert, key, ca


@functools.lru_cache(maxsize=8)
def tls_context(server: bool, cert: str, key: str, ca: str) -> ssl.SSLContext:
    """A context presenting ``cert`` and requiring the peer's certificate signed by ``ca``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # nodes are reached by IP, as Ray's gRPC reaches them
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(cert, key)
        context.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSetupError(f"cannot load Ray's TLS files ({cert}, {key}, {ca}): {exc}") from exc
    return context


def this_process_tls(server: bool) -> ssl.SSLContext | None:
    """This process's server or client context where Ray's TLS is on, else None."""
    files = tls_files()
    return None if files is None else tls_context(server, *files)
