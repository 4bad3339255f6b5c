"""Every server-side ``torch.distributed.TCPStore`` in production code is made by ``common.net.tcp_store``,
which binds its listening socket to the configured host: c10d's own server listens on every interface.

Production code is every ``.py`` file of the repository but ``tests/`` (``bench/`` and ``deploy/`` are
included: they run stores on users' machines too), found by reading the source, so a new module is
covered without being listed.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path("common/net.py")


def production_files() -> list[Path]:
    """Repository-relative paths of the production ``.py`` files (not hidden dirs, the venv or egg-info)."""
    found = []
    for top, dirs, names in os.walk(ROOT):
        here = Path(top).relative_to(ROOT)
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d.endswith(".egg-info") or d == "__pycache__"
                                           or (here == Path() and d == "tests"))]
        found.extend(here / n for n in names if n.endswith(".py"))
    return sorted(found)


def server_side_stores(source: str) -> Iterator[int]:
    """Line numbers of the ``TCPStore(...)`` calls in ``source`` that may be a server: ``is_master`` (keyword
    or fourth argument) is anything but the constant False, or hidden in ``**kwargs``. A call without it
    is a client (c10d's default)."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name != "TCPStore":
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        flag = keywords.get("is_master", node.args[3] if len(node.args) > 3 else None)
        client = flag is None or (isinstance(flag, ast.Constant) and flag.value is False)
        if None in keywords or not client:
            yield node.lineno


def test_the_scan_finds_a_server_side_store_however_it_is_spelled():
    spelled = ["dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)",  # transferqueue/p2p.py before
               "torch.distributed.TCPStore(host, port, 2, True)", "TCPStore(host, port, is_master=rank == 0)",
               "TCPStore(host, port, **kwargs)"]
    for line in spelled:
        assert list(server_side_stores(line)) == [1], line
    for line in ("dist.TCPStore(host, port, is_master=False)", "dist.TCPStore(host, port, 2, False)",
                 "dist.TCPStore(host, port)", "net.tcp_store(host, 0, None, True, 10.0)"):
        assert list(server_side_stores(line)) == [], line


def test_no_server_side_tcp_store_outside_common_net():
    files = production_files()
    assert HELPER in files and Path("transferqueue/p2p.py") in files and Path("bench/modes_bench.py") in files
    assert len(list(server_side_stores((ROOT / HELPER).read_text()))) == 1  # the helper's own
    found = [f"{rel}:{line}" for rel in files if rel != HELPER
             for line in server_side_stores((ROOT / rel).read_text())]
    assert found == [], (f"server-side TCPStore outside {HELPER} (it listens on every interface): use "
                         f"common.net.tcp_store, which binds the configured host only: {found}")
