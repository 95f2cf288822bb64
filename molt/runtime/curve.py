"""CURVE authentication and encryption of ``tcp://`` edges (ZeroMQ's CurveZMQ, RFC 26).

A pipeline with ``transport: tcp`` runs every cross-process edge over CURVE (``curve:
true``, the default): the runner makes one key set per run (or reads ``curve_keys``, a
JSON file of the same form) into ``RUN_DIR/keys/curve.json`` (mode 0600), and every
stage process reads it from there. Producers' ROUTER sockets are CURVE servers holding
the server key pair; consumers' DEALER sockets are CURVE clients holding the client key
pair and the server's public key, so a consumer talks only to a producer that holds the
server secret, and a producer's ZAP handler (`start_authenticator`) admits only the
run's client key: a peer without the keys gets no handshake, so it can neither read a
batch nor inject one (tests/test_edges.py). Sockets refuse connections when no
ZAP handler runs (``zap_enforce_domain``), so a misconfigured process fails closed.

Keys are Z85 text (40 characters), e.g. ``{"server_public": "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
"server_secret": "...", "client_public": "...", "client_secret": "..."}``.
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
    """The run's two CURVE key pairs (Z85 text)."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh key pairs (libzmq's ``zmq_curve_keypair``)."""
        server, client = zmq.curve_keypair(), zmq.curve_keypair()
        return cls(*(k.decode() for k in (*server, *client)))

    @classmethod
    def read(cls, path: str | Path) -> CurveKeys:
        """Keys from a JSON file; ValueError naming the file and the missing or malformed keys."""
        text = json.loads(Path(path).read_text())
        bad = [k for k in KEY_NAMES if not isinstance(text.get(k), str) or len(text[k]) != 40]
        if bad:
            raise ValueError(f"{path}: CURVE keys {bad} missing or not 40 Z85 characters; hint: give a "
                             "keys/curve.json written by an earlier run, or leave curve_keys unset")
        return cls(*(text[k] for k in KEY_NAMES))

    def write(self, path: Path) -> None:
        """Write as JSON, readable by the owner only (0600)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(self), handle)


@functools.lru_cache(maxsize=8)
def run_keys(path: str) -> CurveKeys:
    """The keys a stage process reads from its run's ``keys/curve.json`` (once per process)."""
    return CurveKeys.read(path)


def make_server(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make a producer's socket a CURVE server that asks the ZAP handler; call before bind."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public.encode())


def make_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make a consumer's socket a CURVE client of the run's server key; call before connect."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())


class _RunClient:
    """ZAP credentials check: only the run's client public key."""

    def __init__(self, client_public: str) -> None:
        self.client_public = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def start_authenticator(ctx: zmq.Context[Any], keys: CurveKeys) -> Any:
    """Start the ZAP handler of ``ctx`` (pyzmq's AsyncioAuthenticator, on the running event
    loop) admitting only ``keys.client_public``; call ``.stop()`` on the result when done."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_RunClient(keys.client_public))
    return auth
