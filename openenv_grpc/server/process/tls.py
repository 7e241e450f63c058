"""Server TLS: certificates from files, optionally requiring client certificates (mTLS)."""

from __future__ import annotations

from pathlib import Path

import grpc

from openenv_grpc.server.config import ServerConfig

__all__ = ["server_credentials"]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for ``config`` (None: plaintext); a client CA requires client certs.
    ValueError: incomplete settings; OSError: a file cannot be read."""
    if not (config.tls_cert or config.tls_key):
        if config.tls_client_ca:
            raise ValueError("TLS_CLIENT_CA needs TLS_CERT and TLS_KEY as well")
        return None
    if not (config.tls_cert and config.tls_key):
        raise ValueError("TLS needs both TLS_CERT and TLS_KEY")
    key = Path(config.tls_key).read_bytes()
    cert = Path(config.tls_cert).read_bytes()
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
