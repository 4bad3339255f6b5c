"""A config key declared once: its default, one-line description, bounds and choices in field metadata.

Every section of the config tree (``controller.config.HFlowConfig``) declares its keys with :func:`setting`
(torchtitan's ``Configurable`` pattern)::

    n: int = setting(4, doc="samples per prompt", ge=1)

From that one declaration :func:`check_settings` (called first in the section's ``__post_init__``) refuses
a value out of bounds or not among the choices, with a ValueError naming the dotted key, the value and
what is accepted, and ``hflow-async show-config --describe`` prints the ``doc`` beside the key
(``controller.config_docs``). Checks that relate several keys stay hand-written in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, *, doc: str, factory: Any = _MISSING, ge: float | None = None,
            gt: float | None = None, le: float | None = None, lt: float | None = None,
            choices: tuple | None = None) -> Any:
    """A dataclass field with ``default`` (or ``factory()`` for a list/dict/dataclass), its one-line ``doc``
    and what it accepts: numbers within ``ge``/``gt``/``le``/``lt`` (finite; an ``int`` key an int), or one
    of ``choices``. Raises ValueError on an empty or multi-line ``doc``."""
    if not doc or "\n" in doc:
        raise ValueError(f"a setting needs a one-line doc, got {doc!r}")
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"doc": doc, "bounds": bounds, "choices": tuple(choices) if choices is not None else None}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def doc_of(f: dataclasses.Field) -> str:
    """The one-line description of a field declared with :func:`setting` ('' for any other field)."""
    return f.metadata.get("doc", "")


def accepted(f: dataclasses.Field) -> str:
    """What the field accepts, in words (``>= 1``, ``in (0, 1]``, ``one of ['a', 'b']``); '' when anything
    of its type is."""
    choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds") or {}
    if choices is not None:
        return f"one of {list(choices)}"
    low = next(((op, bounds[op]) for op in ("ge", "gt") if op in bounds), None)
    high = next(((op, bounds[op]) for op in ("le", "lt") if op in bounds), None)
    if low and high:
        return f"in {'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    symbol = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    op, bound = low or high or (None, None)
    return f"{symbol[op]} {bound}" if op else ""


def _is_int_field(f: dataclasses.Field) -> bool:
    return f.type in (int, "int")


_OPS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _within(value: Any, bounds: dict[str, float]) -> bool:
    return all(_OPS[op](value, bound) for op, bound in bounds.items())


def check_settings(obj: Any, prefix: str) -> None:
    """Check every field of the dataclass ``obj`` declared with :func:`setting` against its bounds and
    choices; ``prefix`` is the section's dotted key (``trainer``, ``model.tiny``). Raises ValueError naming
    ``prefix.key``, the value, what is accepted and the key's description."""
    for f in dataclasses.fields(obj):
        choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
        if choices is None and not bounds:
            continue
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if choices is not None:
            if value not in choices:
                raise ValueError(f"{key}={value!r} is not one of {list(choices)} [{key}: {doc_of(f)}]")
            continue
        number_type = int if _is_int_field(f) else int | float
        is_number = isinstance(value, number_type) and not isinstance(value, bool)
        if not (is_number and math.isfinite(value)):
            kind = "an integer" if _is_int_field(f) else "a finite number"
            raise ValueError(f"{key} must be {kind} {accepted(f)}, got {value!r} [{key}: {doc_of(f)}]")
        if not _within(value, bounds):
            raise ValueError(f"{key} must be {accepted(f)}, got {value!r} [{key}: {doc_of(f)}]")
