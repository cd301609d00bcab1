"""Bind addresses and interfaces derived from the addresses a two-host run already names (stdlib only).

``kvspec conform BACKEND --peer ADDR`` and ``kvspec agent serve BACKEND
--listen ADDR`` know one address each: the local address is the one the
kernel routes to the peer from (``--peer``), or the one to listen on
(``--listen``), and the interface is the one that owns that address. From
these two facts come the options each built-in backend needs off loopback:
``host`` and ``interface`` for ``torch`` (control sockets, gloo), and
``net_devices`` for ``nixl`` (``UCX_NET_DEVICES``), with ``tls="tcp"`` when
the interface is a network one: the derived device is a TCP interface, and
UCX's TCP transport is the one every pair of hosts has (without it UCX may
pick shared memory between two network namespaces of one machine). An
``--option`` the user gives always wins, and naming ``net_devices`` (an RDMA
device, say) leaves ``tls`` to the user too; so does ``UCX_NET_DEVICES`` set
in the environment, which is kept as the user's ``net_devices``
(docs/how-to/run-across-two-hosts.md). The NIXL worker's UCX then listens
only on the interface that faces the peer, never on every interface: UCX over
TCP lets whoever reaches that port read and write the worker's memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
from collections.abc import Mapping

__all__ = ["derived_options", "interface_of", "is_loopback", "route_source"]

_SIOCGIFADDR = 0x8915  # linux/sockios.h
_ANY = {"", "0.0.0.0", "::"}  # the wildcard addresses, recognised, never bound here


def _ipv4(host: str) -> str | None:
    """``host`` as a dotted IPv4 address (names are resolved), or ``None``."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is on loopback; ``False`` when it cannot be resolved."""
    address = _ipv4(host)
    return address is not None and ipaddress.IPv4Address(address).is_loopback


def route_source(peer_host: str) -> str | None:
    """The local IPv4 address the kernel sends from to reach ``peer_host`` (a UDP ``connect``: no packet is sent)."""
    peer = _ipv4(peer_host)
    if peer is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer, 9))
        except OSError:
            return None
        source: str = sock.getsockname()[0]
    return None if source in _ANY else source


def _ioctl_address(sock: socket.socket, name: str) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None  # no IPv4 address on this interface
    return socket.inet_ntoa(packed[20:24])


def _ip_addr_lines() -> list[str]:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5)
        return done.stdout.splitlines()
    return []


def interface_of(address: str) -> str | None:
    """The network interface that owns the IPv4 ``address`` (``lo`` for 127.0.0.1), or ``None``.

    Each interface's first address comes from the ``SIOCGIFADDR`` ioctl; secondary addresses from ``ip -o addr``.
    """
    local = _ipv4(address)
    if local is None or local in _ANY:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            if _ioctl_address(sock, name) == local:
                return name
    for line in _ip_addr_lines():  # "2: eth0    inet 10.0.0.5/24 brd ... scope global eth0"
        fields = line.split()
        if len(fields) > 3 and fields[2] == "inet" and fields[3].split("/")[0] == local:
            return fields[1].split("@")[0]
    return None


def derived_options(
    backend: str,
    local_address: str | None,
    given: Mapping[str, object],
    environ: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """The options of built-in ``backend`` that ``local_address`` implies, less those in ``given`` (which win).

    ``torch``: ``host`` (control sockets, which carry the rendezvous) and ``interface`` (gloo); ``nixl``:
    ``net_devices``, and ``tls="tcp"`` off loopback unless ``given`` names ``net_devices``; ``mooncake``:
    ``host`` (the engine's name and the address its peers connect to). Nothing for other backends, or
    when the address or its interface is unknown. For ``nixl``, a ``UCX_NET_DEVICES`` in ``environ``
    (default :data:`os.environ`) is the user's choice: it is kept as ``net_devices``, and ``tls`` left alone.
    """
    if backend == "nixl" and "net_devices" not in given:
        theirs = (os.environ if environ is None else environ).get("UCX_NET_DEVICES", "").strip()
        if theirs:
            return {"net_devices": theirs}
    if local_address is None or backend not in ("torch", "nixl", "mooncake"):
        return {}
    local = _ipv4(local_address)
    interface = interface_of(local) if local is not None else None
    if local is None or interface is None:
        return {}
    if backend == "torch":
        found: dict[str, object] = {"host": local, "interface": interface}
    elif backend == "mooncake":
        found = {"host": local}
    else:
        found = {"net_devices": interface}
        if interface != "lo" and "net_devices" not in given:
            found["tls"] = "tcp"
    return {key: value for key, value in found.items() if key not in given}
