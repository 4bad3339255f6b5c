"""HTTP pieces shared by the endpoints of ``rollers.sglang_server``: typed JSON bodies, SGLang's error and
result shapes, the loopback check."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from aiohttp import web


class BadRequest(Exception):
    """A request the server refuses with HTTP 400 (the message says why)."""


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's error answer: ``success`` false, the message, and an OpenAI-style ``error`` object."""
    body = {"success": False, "message": message,
            "error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)


def result(success: bool, message: str, **extra) -> web.Response:
    """SGLang's answer to a control request: 200 on success, else 400."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def read_json(request: web.Request, max_body_bytes: int, fields: tuple[str, ...],
                    required: tuple[str, ...] = ()) -> dict:
    """The request's body as a JSON object (empty body: ``{}``). ``fields``: the accepted keys (empty:
    any); ``required``: keys that must be there. Raises BadRequest naming what is wrong."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BadRequest(f"request body exceeds the limit of {max_body_bytes} bytes") from exc
    if not raw.strip():
        body: Any = {}
    else:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if fields:
        unknown = sorted(set(body) - set(fields))
        if unknown:
            raise BadRequest(f"{request.path}: unknown field(s) {unknown}; accepted: {list(fields)}")
        missing = [k for k in required if k not in body]
        if missing:
            raise BadRequest(f"{request.path}: missing field(s) {missing}")
    return body
