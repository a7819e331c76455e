"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for multi-node runs.

[Note: loopback-range hosts]
The hosts get loopback-range addresses (127.200.0.1 and 127.200.0.2, a /30 on the veth), so no address outside
the loopback range is ever used. Linux treats 127/8 as local to the loopback device and refuses to route it
elsewhere, so inside each namespace the loopback device keeps only 127.0.0.1/32 (not the whole /8) and
``route_localnet`` lets the veth carry 127.x: the peer's address is then reachable only across the veth, and
every byte between the hosts crosses it. Each veth end is named after its namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator, List, Sequence

import pytest

HOSTS = ("127.200.0.1", "127.200.0.2")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def setup_steps(names: Sequence[str]) -> List[List[str]]:
    """The commands that join two existing namespaces ``names`` with a veth pair and address them."""
    steps = [["ip", "link", "add", names[0], "type", "veth", "peer", "name", names[1]]]
    for ns, addr in zip(names, HOSTS):
        steps += [
            ["ip", "link", "set", ns, "netns", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "del", "127.0.0.1/8", "dev", "lo"],
            ["ip", "-n", ns, "addr", "add", "127.0.0.1/32", "dev", "lo"],
            ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"],
            ["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", ns],
            ["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{ns}.route_localnet=1"],
            ["ip", "-n", ns, "link", "set", ns, "up"],
        ]
    return steps


def join(names: Sequence[str]) -> None:
    """Runs :func:`setup_steps`; raises with the failing command's message."""
    for step in setup_steps(names):
        r = _run(*step)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(step)}: {r.stderr.strip()}")


@contextlib.contextmanager
def namespace_hosts(prefix: str) -> Iterator[List[str]]:
    """Two namespaces, joined (:func:`join`), named ``<prefix><pid>a`` / ``...b`` (the veth ends carry the same
    names, at most 15 characters); both deleted afterwards, which takes the veth pair with them. Skips the test
    where namespaces cannot be made (no iproute2, or neither root nor CAP_NET_ADMIN)."""
    tag = f"{prefix}{os.getpid() % 100000}"
    names = [f"{tag}a", f"{tag}b"]
    if shutil.which("ip") is None:
        pytest.skip("two-host test: the `ip` command (iproute2) is not installed")
    made = []
    try:
        for ns in names:
            r = _run("ip", "netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"two-host test: cannot create a network namespace here ({r.stderr.strip()}); "
                            "it needs root or CAP_NET_ADMIN")
            made.append(ns)
        join(names)
        yield names
    finally:
        for ns in made:
            _run("ip", "netns", "del", ns)
