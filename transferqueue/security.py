"""ZMQ CURVE for sockets that leave the node: keys made per job, an authenticator that admits one key.

The controller calls ``make_job_keys()`` once per job and puts the result into the ``TQHandle`` it gives
every worker. Servers run CURVE with the job's server key pair and a ZAP handler (a thread in the server
process) that accepts only the job's client public key; traffic is then authenticated and encrypted
(CurveZMQ: Curve25519 + XSalsa20-Poly1305). A peer without the keys cannot complete the handshake and
never gets a reply.
"""

from __future__ import annotations

import zmq
from zmq.auth.thread import ThreadAuthenticator

from transferqueue.records import CurveKeys


def make_job_keys() -> CurveKeys:
    """Fresh server and client key pairs (Z85 text); raises RuntimeError if libzmq lacks CURVE."""
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
    """Start a ZAP handler on ``ctx`` that admits CURVE clients holding ``keys.client_public`` only."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OneKey(keys.client_public))
    return auth
