"""ZMQ CURVE for sockets that leave the node: keys made per job, an authenticator that admits one key.

One scheme serves both planes that may cross nodes: the TransferQueue (``transferqueue.curve``) and the
weight plane (``checkpointengine.curve``). The party that serves (the TransferQueue launcher for its
servers, trainer rank 0 for the weight sender) calls ``make_job_keys()`` once per job; servers run CURVE
with the server key pair (``serve_curve``) and a ZAP handler (a thread in the server's process,
``start_authenticator``) that accepts only the job's client public key. Clients get
``keys.for_clients()`` (no server secret) inside their handle, which travels through Ray, never over the
socket it protects, and connect with ``connect_curve``. Traffic is then authenticated and encrypted
(CurveZMQ, https://rfc.zeromq.org/spec/26/: Curve25519 + XSalsa20-Poly1305). A peer without the keys
cannot complete the handshake and never gets a reply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator


@dataclass
class CurveKeys:
    """ZMQ CURVE keys of one job (Z85 text, 40 characters each): the server key pair and the one client
    key pair the server accepts. ``server_secret`` is ``""`` in a client's copy (``for_clients``)."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    def for_clients(self) -> CurveKeys:
        """What a client needs (the server's public key and the client key pair): no server secret."""
        return dataclasses.replace(self, server_secret="")


def make_job_keys() -> CurveKeys:
    """Fresh server and client key pairs; raises RuntimeError if libzmq lacks CURVE."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())


class _OneKey:
    def __init__(self, key: str):
        self.key = key.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Start a ZAP handler on ``ctx`` that admits CURVE clients holding ``keys.client_public`` only.
    The caller stops it (``auth.stop()``) before terminating ``ctx``."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OneKey(keys.client_public))
    return auth


def serve_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (not yet bound) a CURVE server with the job's server key pair; its context needs a
    running ``start_authenticator``. Raises ValueError for keys without the server secret."""
    if not keys.server_secret:
        raise ValueError("a CURVE server needs the job's server secret key (a client's copy has none)")
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()


def connect_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Set the client side of CURVE on ``sock`` (before it connects): the server's public key and the
    job's client key pair."""
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_secretkey = keys.client_secret.encode()
