"""Calling a user's function (a reward, a tool, a hook) from a roller's event loop, bounded by a timeout.

An async function is awaited; a sync one runs in a thread of its own (a daemon thread, started per call),
so a call that blocks past its timeout holds only that thread: later calls still get theirs (a shared
worker pool, ``asyncio.to_thread``'s, is used up by a few such calls and every later call then times out
behind them). Python cannot stop a thread, so an overdue call keeps running until it returns; at most
``MAX_OVERDUE`` may be running at once in a process, beyond which new sync calls are refused
(:class:`TooManyOverdueCalls`) instead of piling up threads without bound.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

MAX_OVERDUE = 64  # sync calls still running past their timeout, per process

_overdue: Counter[str] = Counter()  # name of each sync call running past its timeout -> how many
_overdue_lock = threading.Lock()


class TooManyOverdueCalls(RuntimeError):
    """``MAX_OVERDUE`` sync calls are still running past their timeout: no new thread is started."""


def num_overdue() -> int:
    """Sync calls of this process still running past their timeout."""
    with _overdue_lock:  # the threads change the counter as they return
        return _overdue.total()


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


async def call_user(timeout_s: float, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (awaited when it is async or returns an awaitable), within ``timeout_s`` seconds
    (positional-only, so any keyword, ``timeout_s`` included, goes to ``fn``).

    Returns its result; raises what it raises (StopIteration, SystemExit, KeyboardInterrupt as RuntimeError),
    TimeoutError past ``timeout_s``, and TooManyOverdueCalls when ``MAX_OVERDUE`` earlier sync calls are
    still running past their timeouts.
    """
    deadline = time.monotonic() + timeout_s
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(_contained(fn(*args, **kwargs)), timeout_s)
    result = await _in_thread(fn, args, kwargs, timeout_s)
    if inspect.isawaitable(result):  # e.g. an object whose __call__ is async, a lambda returning a coroutine
        return await asyncio.wait_for(_contained(result), max(deadline - time.monotonic(), 0.0))
    return result


def _plain(exc: BaseException) -> BaseException:
    """``exc`` as the caller may receive it: an Exception other than StopIteration (which a future cannot
    carry) as it is; StopIteration, SystemExit (a ``sys.exit()`` in user code), KeyboardInterrupt and
    other BaseExceptions as a RuntimeError naming them, so that they fail the call, not the process."""
    if isinstance(exc, Exception) and not isinstance(exc, StopIteration):
        return exc
    error = RuntimeError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    error.__cause__ = exc
    return error


async def _contained(awaitable) -> Any:
    try:
        return await awaitable
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # SystemExit and the like would stop the event loop (see _plain)
        raise _plain(exc) from exc


async def _in_thread(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> Any:
    name = _name(fn)
    with _overdue_lock:  # the threads change the counter as they return
        overdue, held = _overdue.total(), ", ".join(f"{n} ×{k}" for n, k in _overdue.most_common(3))
    if overdue >= MAX_OVERDUE:
        raise TooManyOverdueCalls(f"{overdue} earlier calls are still running past their timeouts "
                                  f"(at most {MAX_OVERDUE}; the most: {held}); {name!r} was not started")
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    state = {"overdue": False, "returned": False}  # guarded by _overdue_lock, as the count is

    def settle(result, error) -> None:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def work() -> None:
        result, error = None, None
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller (_plain: never one that would end its process)
            error = _plain(exc)
        with _overdue_lock:
            if state["overdue"]:  # the caller gave up on it: only the count is left to settle
                _overdue[name] -= 1
                if not _overdue[name]:
                    del _overdue[name]
                return
            state["returned"] = True
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for the result
            pass

    threading.Thread(target=work, name=f"user-call-{name}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        with _overdue_lock:
            if not state["returned"]:
                state["overdue"] = True
                _overdue[name] += 1
        raise
