"""CURVE authentication and encryption of ``tcp://`` edges (ZeroMQ's CurveZMQ, RFC 26).

The runner writes one key set per run to ``RUN_DIR/keys/curve.json`` (mode 0600). Producers are
CURVE servers whose ZAP handler admits only the run's client key; consumers are clients that know
the server's public key. A peer without the keys can neither read nor inject a batch, and a
socket refuses connections while no ZAP handler runs.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import zmq

ZAP_DOMAIN = "molt"
KEY_NAMES = ("server_public", "server_secret", "client_public", "client_secret")


@dataclass(frozen=True)
class CurveKeys:
    """The run's two CURVE key pairs."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> CurveKeys:
        server, client = zmq.curve_keypair(), zmq.curve_keypair()
        return cls(*(k.decode() for k in (*server, *client)))

    @classmethod
    def read(cls, path: str | Path) -> CurveKeys:
        """Keys from a JSON file; ValueError naming it and the missing or bad keys."""
        text = json.loads(Path(path).read_text())
        bad = [k for k in KEY_NAMES if not isinstance(text.get(k), str) or len(text[k]) != 40]
        if bad:
            raise ValueError(f"{path}: CURVE keys {bad} missing or not 40 Z85 characters; hint: "
                             "give a keys/curve.json written by an earlier run, or leave "
                             "curve_keys unset")
        return cls(*(text[k] for k in KEY_NAMES))

    def write(self, path: Path) -> None:
        """Write as JSON readable by the owner only."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(self), handle)


@functools.lru_cache(maxsize=8)
def run_keys(path: str) -> CurveKeys:
    """Read once per process."""
    return CurveKeys.read(path)


def make_server(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Call before bind."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public.encode())


def make_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Call before connect."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())


class _RunClient:
    """Admits only the run's client public key."""

    def __init__(self, client_public: str) -> None:
        self.client_public = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def start_authenticator(ctx: zmq.Context[Any], keys: CurveKeys) -> Any:
    """Start ``ctx``'s ZAP handler, admitting only ``keys.client_public``; ``.stop()`` it."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                  credentials_provider=_RunClient(keys.client_public))
    return auth
