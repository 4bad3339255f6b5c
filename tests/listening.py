"""Which TCP sockets listen where, read from /proc (no ss or psutil needed): for the loopback-only tests."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def _process_tree(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def listening_inodes() -> dict[int, str]:
    """inode -> ``address:port`` of every listening TCP socket on this machine (IPv4 and IPv6)."""
    out = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A":  # LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            assert len(hex_ip) == width
            out[int(cols[9])] = f"{ipaddress.ip_address(raw)}:{int(hex_port, 16)}"
    return out


def listening_sockets(root: int) -> dict[str, str]:
    """``address:port`` -> process name, for every TCP socket a process of ``root``'s tree listens on."""
    inodes = listening_inodes()
    found = {}
    for pid in _process_tree(root):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                found[inodes[int(target[8:-1])]] = name
    return found


def listening_on(port: int, root: int | None = None) -> list[str]:
    """``address:port`` of each socket ``root``'s process tree (default: this process's) listens on at ``port``.

    Only the tree's own sockets: another process may hold the same port number on another address.
    """
    owned = listening_sockets(os.getpid() if root is None else root)
    return sorted(addr for addr in owned if addr.rsplit(":", 1)[1] == str(port))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
