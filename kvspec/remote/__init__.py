"""Two hosts: ``kvspec agent serve`` on one, the suite on the other (docs/how-to/run-across-two-hosts.md).

:class:`AgentServer` owns one backend's agents and pools on the remote host
and serves one authenticated client over one TCP connection;
:class:`AgentClient`, :class:`RemoteAgent`, :class:`RemotePool` and
:class:`PeerBackend` are the suite's side of it. The wire is length-prefixed
JSON headers with raw payloads (never pickle); authentication is a
challenge-response over a shared token, compared in constant time, before
anything is served, and every later frame carries an HMAC tag of the session.
:func:`derived_options`, :func:`route_source` and :func:`is_loopback` turn the
one address each side knows (``--peer``, ``--listen``) into the backend
options a run off loopback needs.
"""

from kvspec.remote._client import AgentClient, PeerBackend, RemoteAgent, RemotePool, parse_address
from kvspec.remote._server import AgentServer
from kvspec.transport._netaddr import derived_options, is_loopback, route_source
from kvspec.transport._wire import AgentAuthError, AgentRefusedError, WireError, read_token

__all__ = [
    "AgentAuthError",
    "AgentClient",
    "AgentRefusedError",
    "AgentServer",
    "PeerBackend",
    "RemoteAgent",
    "RemotePool",
    "WireError",
    "derived_options",
    "is_loopback",
    "parse_address",
    "read_token",
    "route_source",
]
