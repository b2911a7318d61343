"""ZeroMQ CURVE for the heads <-> root channel, keyed from the job token (TRAY_JOB_TOKEN).

Both keypairs are derived from the token (HKDF-SHA256, RFC 5869): the root's, which every head pins as
the server key, and one client keypair shared by every head, which the root's ZAP handler is the only
key it admits. So a process without the token can neither pose as the root (the head's handshake
fails) nor connect to it (the root refuses its key); the channel is encrypted either way. The ZAP
handler is a plain socket served from the caller's poll loop, not a thread: the head spawns its
ranks with a preexec hook, which must not run while other threads exist.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import zmq
import zmq.utils.z85

__all__ = ["CurveKeys", "ZapHandler", "job_keys", "make_client", "make_server"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_SALT = b"tray job curve v1"
# NOTE: a port scanner may dial from many addresses; the reports name a few, memory stays bounded.
MAX_REFUSED_ADDRESSES = 8


def _hkdf_sha256(secret: bytes, info: bytes, nbytes: int = 32) -> bytes:
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < nbytes:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:nbytes]


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded 40-byte keys (what pyzmq's CURVE options take)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _keypair(token: str, role: bytes) -> tuple[bytes, bytes]:
    secret = zmq.utils.z85.encode(_hkdf_sha256(token.encode(), role))
    return zmq.curve_public(secret), secret


def job_keys(token: str) -> CurveKeys:
    """The job's keys, the same on every node for the same token; different tokens give unrelated keys."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; install pyzmq's wheels (they bundle libsodium)")
    server_public, server_secret = _keypair(token, b"root")
    client_public, client_secret = _keypair(token, b"head")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def make_server(ctx: zmq.Context, keys: CurveKeys, kind: int = zmq.ROUTER) -> zmq.Socket:
    """A socket that accepts CURVE clients (the ZapHandler decides which); not yet bound."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"tray")
    return sock


def make_client(ctx: zmq.Context, keys: CurveKeys, kind: int = zmq.DEALER) -> zmq.Socket:
    """A socket that talks CURVE to the root whose public key the token gives; not yet connected."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    return sock


class ZapHandler:
    """Admits CURVE clients holding the job's client key; refuses every other, keeping the first
    `MAX_REFUSED_ADDRESSES` distinct peer addresses (IP strings, as ZAP gives them) for the reports.

    Bind it in the server's context before the server socket binds; call `handle()` whenever `socket`
    is readable (poll it with the server socket)."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._allowed = zmq.utils.z85.decode(keys.client_public)
        self.refused: list[str] = []  # distinct peer addresses refused, oldest first, for the root's reports
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        """Answer every pending ZAP request (non-blocking)."""
        while self.socket.poll(0, zmq.POLLIN):
            frames = self.socket.recv_multipart()
            version, request_id = frames[0], frames[1]
            address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
            mechanism = frames[5] if len(frames) > 5 else b""
            key = frames[6] if len(frames) > 6 else b""
            ok = mechanism == b"CURVE" and hmac.compare_digest(key, self._allowed)
            if not ok and address not in self.refused and len(self.refused) < MAX_REFUSED_ADDRESSES:
                self.refused.append(address)
            code, text = (b"200", b"OK") if ok else (b"400", b"not a key of this job")
            self.socket.send_multipart([version, request_id, code, text, b"head" if ok else b"", b""])

    def close(self) -> None:
        self.socket.close()
