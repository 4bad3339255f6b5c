"""The wire form of a task's ground truth: the ``ground_truth`` field the feeder puts (one compact JSON
text per sample) and the roller reads back for its reward function."""

from __future__ import annotations

import json
from typing import Any


def to_json_object(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``obj`` round-tripped through JSON (tuples become lists); raises ValueError naming ``where`` if it
    holds something JSON cannot carry."""
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ground truth of {where} is not JSON-able: {exc}") from exc


def encode_ground_truth(ground_truth: dict[str, Any]) -> str:
    """The wire form of a ground truth (compact JSON text), as carried in the ``ground_truth`` field."""
    return json.dumps(ground_truth, separators=(",", ":"))


def decode_ground_truth(text: str | bytes) -> dict[str, Any]:
    """Inverse of ``encode_ground_truth``; raises ValueError on malformed input."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"ground truth must decode to a dict, got {type(value).__name__}")
    return value
