"""Several hosts on this machine, for the multi-host tests: one Linux network namespace per host, each with its own
address on a bridge the helper creates (``ip netns``, ``ip link``: root only), and the machine's hostname resolving
to that address inside it (``ip netns exec`` mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``; gloo, JAX's CPU
collectives, binds to the address the hostname resolves to). A process started with :meth:`Host.command` sees only
its namespace's network: the job's traffic stays on the addresses made here, and everything is removed at the end.
Where the machine does not allow it (not root, no ``ip``, no network namespaces), :func:`hosts` skips the test and
says why."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Host:
    name: str        # the network namespace
    address: str     # its address on the bridge

    def command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """``argv`` run inside this host's namespace, with exactly ``env``."""
        return ["ip", "netns", "exec", self.name, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@contextlib.contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` simulated hosts on a bridge of their own (10.X.Y.0/24, X.Y from this process's id)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("simulated hosts need root and iproute2's `ip` (network namespaces)")
    tag = f"xb{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    bridge, made, hosts_files = f"{tag}br", [], []
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except RuntimeError as exc:
            pytest.skip(f"simulated hosts: this machine does not allow a bridge ({exc})")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index in range(count):
            host = Host(f"{tag}h{index}", f"{subnet}.{index + 1}")
            try:
                _ip("netns", "add", host.name)
            except RuntimeError as exc:
                pytest.skip(f"simulated hosts: this machine does not allow network namespaces ({exc})")
            made.append(host)
            veth = f"{tag}v{index}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("netns", "exec", host.name, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("netns", "exec", host.name, "ip", "link", "set", "eth0", "up")
            _ip("netns", "exec", host.name, "ip", "link", "set", "lo", "up")
            folder = Path("/etc/netns") / host.name
            folder.mkdir(parents=True, exist_ok=True)
            hosts_files.append(folder)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{host.address} {socket.gethostname()}\n")
        yield made
    finally:
        for host in made:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        for index in range(count):
            subprocess.run(["ip", "link", "del", f"{tag}v{index}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        for folder in hosts_files:
            shutil.rmtree(folder, ignore_errors=True)
