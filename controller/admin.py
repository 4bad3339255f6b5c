"""The admin endpoint of a running job: resize the roller pool and read its state.

::

    hflow-async scale --rollers N [--run-dir DIR]      (or ``request_scale(run_dir, N)`` from Python)
        │  reads RUN_DIR/admin.json (address) and RUN_DIR/admin_token (owner-only, 0600)
        ▼
    AdminServer (aiohttp, in the controller's event loop, 127.0.0.1, a free port)
        GET  /pool               → the pool's state
        POST /scale {"rollers": N} → PoolKeeper.scale_to(N): joins or drains, one request at a time;
                                    answers once done, with the pool's state

Every request needs ``Authorization: Bearer <token>`` with the token of ``RUN_DIR/admin_token``; a wrong or
missing token gets 401 and changes nothing. A malformed request gets 400 naming what was wrong. A request
for the size the pool already has (active and joining rollers) changes nothing: requests are idempotent.
Bodies are JSON (no pickle); at most ``MAX_BODY_BYTES``.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import urllib.error
import urllib.request
from pathlib import Path

ADDRESS_FILE = "admin.json"   # {"host", "port"} while the job runs; removed at its end
TOKEN_FILE = "admin_token"    # owner-only (0600)
MAX_BODY_BYTES = 4096
REQUEST_TIMEOUT_S = 1800.0    # a scale request answers once its rollers joined or drained


class AdminError(RuntimeError):
    """A request to a job's admin endpoint failed (no job there, refused, or a bad request)."""


def write_token(run_dir: Path) -> str:
    """A fresh random token in ``RUN_DIR/admin_token``, created owner-only (0600); returns it."""
    token = secrets.token_urlsafe(32)
    path = run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    return token


class AdminServer:
    """Serves the admin endpoint of ``keeper`` (a ``controller.pool_keeper.PoolKeeper``) on ``host``
    (loopback by default) for the run in ``run_dir``. ``start()`` binds a free port and writes the address
    and token files; ``close()`` stops it and removes the address file."""

    def __init__(self, keeper, run_dir: Path, host: str = "127.0.0.1"):
        self.keeper, self.run_dir, self.host = keeper, Path(run_dir), host
        self.token = ""
        self._runner = None

    async def start(self) -> int:
        from aiohttp import web

        self.token = write_token(self.run_dir)
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.add_routes([web.get("/pool", self._pool), web.post("/scale", self._scale)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        (self.run_dir / ADDRESS_FILE).write_text(json.dumps({"host": self.host, "port": port}) + "\n")
        return port

    async def close(self) -> None:
        (self.run_dir / ADDRESS_FILE).unlink(missing_ok=True)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------------------------------- handlers

    @property
    def _auth(self):
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return web.json_response({"error": "missing or wrong token (see RUN_DIR/admin_token)"}, status=401)
            return await handler(request)

        return auth

    async def _pool(self, request):
        from aiohttp import web

        return web.json_response(self.keeper.pool.state())

    async def _scale(self, request):
        from aiohttp import web

        try:
            body = json.loads(await request.read())
            rollers = body["rollers"] if isinstance(body, dict) else None
            if not isinstance(rollers, int) or isinstance(rollers, bool):
                raise ValueError(f"'rollers' must be an integer, got {rollers!r:.50}")
            self.keeper.check_target(rollers)
        except (ValueError, KeyError, UnicodeDecodeError) as exc:
            return web.json_response({"error": f"bad scale request: {exc}; send {{\"rollers\": N}}"}, status=400)
        await self.keeper.scale_to(rollers)
        return web.json_response(self.keeper.pool.state())


# ------------------------------------------------------------------------------------------ client


def _address(run_dir: Path) -> str:
    try:
        where = json.loads((run_dir / ADDRESS_FILE).read_text())
        return f"http://{where['host']}:{int(where['port'])}"
    except (OSError, ValueError, KeyError) as exc:
        raise AdminError(f"no running job in {run_dir} ({ADDRESS_FILE} unreadable: {exc})") from None


def request(run_dir: str | Path, method: str, path: str, body: dict | None = None, token: str | None = None,
            timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
    """One request to the job in ``run_dir`` (its token unless ``token`` is given); the JSON answer.
    Raises AdminError naming the status and the job's message."""
    run_dir = Path(run_dir)
    if token is None:
        try:
            token = (run_dir / TOKEN_FILE).read_text().strip()
        except OSError as exc:
            raise AdminError(f"cannot read the admin token of {run_dir}: {exc}") from None
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(_address(run_dir) + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise AdminError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"no answer from the job in {run_dir}: {exc}") from None


def request_scale(run_dir: str | Path, num_rollers: int, token: str | None = None) -> dict:
    """Resize the roller pool of the job in ``run_dir`` to ``num_rollers``; the pool's state once done."""
    return request(run_dir, "POST", "/scale", {"rollers": num_rollers}, token)


def pool_state(run_dir: str | Path, token: str | None = None) -> dict:
    """The roller pool's state of the job in ``run_dir``."""
    return request(run_dir, "GET", "/pool", token=token, timeout_s=30.0)
