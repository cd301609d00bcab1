"""Backends off loopback: the torch ``host``/``interface`` and NIXL ``net_devices`` options, inside a network namespace.

The namespace test creates two namespaces joined by a veth pair (10.78.0.1 and
10.78.0.2), runs a READ and a WRITE between two agents in the first one with
the options pointing at its veth end, and reads /proc to show every TCP socket
of both agents' processes is on 10.78.0.1, none on 127.0.0.1. The namespaces
are deleted in a ``finally``. Without root or iproute2 the tests skip, and
fail under ``--require-backends`` (what CI passes). The default-address tests
(everything on 127.0.0.1) are in tests/test_torch_backend.py and
tests/test_nixl_backend.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from conftest import require_backend_module

from kvspec import ConfigError

TESTS = Path(__file__).resolve().parent
ADDRESS = "10.78.0.1"
PEER_ADDRESS = "10.78.0.2"
# 10.78.0.1 as /proc/net/tcp writes a local address (little-endian hex).
ADDRESS_HEX = "01004E0A"
LOOPBACK_HEX = "0100007F"


@attrs.frozen
class Namespace:
    name: str
    device: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _delete(name: str) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # no ip at all: nothing was created
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


@pytest.fixture
def netns(pytestconfig: pytest.Config) -> Iterator[Namespace]:
    """Two namespaces (kvi-...) joined by a veth pair; yields the first, whose veth end holds 10.78.0.1."""
    tag = secrets.token_hex(3)
    names = (f"kvi-{tag}-a", f"kvi-{tag}-b")
    devices = (f"kvi{tag}a", f"kvi{tag}b")
    try:
        if sys.platform != "linux" or shutil.which("ip") is None:
            raise OSError("needs Linux and iproute2's ip")
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", names[0], "link", "add", devices[0], "type", "veth", "peer", "name", devices[1], "netns", names[1])
        for name, device, address in zip(names, devices, (ADDRESS, PEER_ADDRESS), strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for name in names:
            _delete(name)
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        message = f"cannot create network namespaces (root and iproute2 needed): {detail}"
        if pytestconfig.getoption("--require-backends"):
            pytest.fail(f"--require-backends: {message}", pytrace=False)
        pytest.skip(message)
    try:
        yield Namespace(name=names[0], device=devices[0])
    finally:
        for name in names:
            _delete(name)


def _in_netns(namespace: Namespace, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        ["ip", "netns", "exec", namespace.name, sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=TESTS.parent,
    )


def _pair_in_netns(namespace: Namespace, backend: str, options: dict[str, object]) -> dict[str, object]:
    done = _in_netns(namespace, str(TESTS / "netns_pair.py"), backend, json.dumps(options))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _assert_on_the_chosen_address(result: dict[str, object]) -> None:
    assert result["done"] is True, result
    assert result["intact"] is True, result
    sockets = result["sockets"]
    assert isinstance(sockets, dict)
    for agent, addresses in sockets.items():
        assert addresses, f"expected TCP sockets in {agent}'s process"
        # A socket may be IPv6 to the IPv4-mapped address (::ffff:10.78.0.1), as the old TCPStore client was.
        hosts = {a.split(":")[0].removeprefix("0000000000000000FFFF0000") for a in addresses}
        assert hosts == {ADDRESS_HEX}, (agent, addresses)  # every socket on 10.78.0.1, none on 127.0.0.1
        assert LOOPBACK_HEX not in hosts


def test_torch_traffic_goes_over_the_chosen_host_and_interface(netns: Namespace, pytestconfig: pytest.Config) -> None:
    require_backend_module(pytestconfig, "torch")
    options = {"host": ADDRESS, "interface": netns.device, "prestart": 0}
    _assert_on_the_chosen_address(_pair_in_netns(netns, "torch", options))
    # The same options through the CLI (--option parses host=... as a string), a conformance case in the namespace.
    cli = _in_netns(
        netns,
        *("-m", "kvspec", "conform", "torch", "--option", f"host={ADDRESS}", "--option", f"interface={netns.device}"),
        *("--rule", "DONE-1/read-done-means-visible", "--integrity", "-q"),
    )
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-2000:]


def test_nixl_traffic_goes_over_the_chosen_net_devices(netns: Namespace, pytestconfig: pytest.Config) -> None:
    require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    _assert_on_the_chosen_address(_pair_in_netns(netns, "nixl", {"net_devices": netns.device}))
    cli = _in_netns(
        netns,
        *("-m", "kvspec", "conform", "nixl", "--option", f"net_devices={netns.device}"),
        *("--rule", "DONE-1/read-done-means-visible", "--integrity", "-q"),
    )
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-2000:]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("host", ["localhost", "10.78.0.300", "::1", "", 5])
def test_torch_host_must_be_an_ipv4_address(host: object, pytestconfig: pytest.Config) -> None:
    require_backend_module(pytestconfig, "torch")
    from kvspec.transport.torch_dist import TorchDistributedBackend

    with pytest.raises(ConfigError, match=r"TorchDistributedBackend\.host: expected an IPv4 address"):
        TorchDistributedBackend(host=host, prestart=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("interface", ["", "eth 0", "a/b", "x" * 16, None])
def test_torch_interface_must_be_an_interface_name(interface: object, pytestconfig: pytest.Config) -> None:
    require_backend_module(pytestconfig, "torch")
    from kvspec.transport.torch_dist import TorchDistributedBackend

    with pytest.raises(ConfigError, match=r"TorchDistributedBackend\.interface: expected a network interface"):
        TorchDistributedBackend(interface=interface, prestart=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("devices", ["", "eth0,", "eth 0", "a;b", 3])
def test_nixl_net_devices_must_be_device_names(devices: object, pytestconfig: pytest.Config) -> None:
    require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    from kvspec.transport.nixl import NixlBackend

    with pytest.raises(ConfigError, match=r"NixlBackend\.net_devices: expected UCX device names"):
        NixlBackend(net_devices=devices)  # type: ignore[arg-type]


def test_nixl_net_devices_reach_the_workers_environment(pytestconfig: pytest.Config) -> None:
    require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    from kvspec.transport.nixl import NixlBackend

    assert NixlBackend().worker_env()["UCX_NET_DEVICES"] == "lo"
    backend = NixlBackend(net_devices="eth0,mlx5_0:1")
    try:
        assert backend.worker_env()["UCX_NET_DEVICES"] == "eth0,mlx5_0:1"
    finally:
        backend.close()


# --------------------------------------------------------------------------- no namespaces: skip, or fail in CI


@pytest.mark.parametrize("required", [False, True], ids=["skips", "fails-under-require-backends"])
def test_without_iproute2_the_netns_tests_skip_or_fail(required: bool) -> None:
    """With no ``ip`` on PATH the namespace tests skip; under --require-backends (CI) they fail instead."""
    env = {**os.environ, "PATH": "/nonexistent"}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rsf", str(Path(__file__))]
    args += ["-k", "traffic_goes_over", *(["--require-backends"] if required else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=TESTS.parent)
    assert "cannot create network namespaces" in done.stdout, done.stdout[-3000:]
    if required:
        assert done.returncode == 1, done.stdout[-3000:]
        assert "2 errors" in done.stdout  # a failing fixture: pytest counts an error, never a skip
    else:
        assert done.returncode == 0, done.stdout[-3000:]
        assert "2 skipped" in done.stdout
