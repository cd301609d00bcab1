"""The Mooncake backend: each agent is a Mooncake Transfer Engine (TCP, P2P handshake) in its own worker process.

Theory of operation (docs/backends/mooncake.md):

* :class:`MooncakeBackend` checks that ``mooncake.engine`` is installed
  (without importing it) and starts one worker process per agent
  (:mod:`kvspec.transport._mooncake_worker`); :class:`MooncakeAgent` is the
  proxy. Both share their plumbing with the NIXL backend
  (:class:`kvspec.transport.nixl.WorkerBackend` and ``WorkerAgent``): the pipe,
  its deadlines, the queued posts, the recycled workers.
* Regions are ``multiprocessing.shared_memory`` blocks, registered with
  ``register_memory``. Every descriptor is checked against both sides'
  regions here, before the engine sees it (PLAN-1): over TCP the engine does
  not check the local buffer at all.
* A transfer is one asynchronous batch; the worker's waiter thread ends it
  with ``get_batch_transfer_status`` (never ``transfer_check_status``, which
  checks only the batch's first task). ``check`` reports what the waiter found.
* The engine has no cancel (``immediate_cancel=False``): a released transfer
  runs to its end, and a removed peer's transfers are drained before they
  report ``FAILED(PEER_DISCONNECTED)`` (SM-2).

Failure mapping (FAIL-1): a descriptor outside either side's regions raises
:class:`kvspec.PlanError` at post; an unknown peer raises
:class:`kvspec.TransportError`; a batch the engine refuses (id 0) reports
``FAILED(POST_FAILED)``; a status of -1 reports ``FAILED(PEER_DISCONNECTED)``
when the peer no longer answers ``send_probe``, ``FAILED(TIMEOUT)`` after
``transfer_timeout``, else ``FAILED(TRANSFER_ERROR)``.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import math
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import ClassVar, cast

from kvspec.core._enums import TransferMode
from kvspec.core._errors import BackendUnavailableError, ConfigError
from kvspec.transport import _mooncake_worker
from kvspec.transport._base import Capabilities
from kvspec.transport.nixl import WorkerAgent, WorkerBackend

__all__ = ["INSTALL_HINT", "MooncakeAgent", "MooncakeBackend", "find_mooncake"]

INSTALL_HINT = (
    "pip install 'kvspec[mooncake]' (mooncake-transfer-engine-non-cuda==0.3.13.post1 and numpy), and the system "
    "libraries it links: apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
)


def find_mooncake() -> bool:
    """Whether ``mooncake.engine`` is installed, found without importing it (its libraries load at import)."""
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except (ImportError, ValueError):
        return False


def _require_mooncake() -> None:
    missing = [name for name in ("numpy",) if importlib.util.find_spec(name) is None]
    if not find_mooncake():
        missing.insert(0, "mooncake")
    if missing:
        raise BackendUnavailableError(f"the mooncake backend needs {' and '.join(missing)}: {INSTALL_HINT}")


class MooncakeAgent(WorkerAgent):
    """One Mooncake Transfer Engine (Transport): a proxy for an engine in a worker process, or the engine itself."""

    label: ClassVar[str] = "mooncake"
    protocol: ClassVar[ModuleType] = _mooncake_worker


class MooncakeBackend(WorkerBackend):
    """Creates Mooncake agents, one worker process (and Transfer Engine) each (Backend).

    Options (all keyword-only, all passable through ``load_backend("mooncake", ...)``):

    - ``host``: the address the engine names itself by and peers connect to
      (default ``"127.0.0.1"``). Across hosts, this host's address on the
      network that reaches the peer. The engine's listeners bind every
      interface whatever this says (docs/backends/mooncake.md, Traps).
    - ``env``: extra environment for the workers, e.g. ``{"MC_LOG_LEVEL": "INFO"}``.
    - ``call_timeout``: seconds any call may wait for its worker (default 60).
    - ``start_timeout``: seconds a worker may take to start (default 60).
    - ``transfer_timeout``: seconds a batch may run before the engine fails it
      (``MC_TRANSFER_TIMEOUT``, whole seconds) and it reports
      ``FAILED(TIMEOUT)`` (default 30, the engine's own default).
    - ``poll_interval``: seconds between an idle worker's notification polls (default 0.0005).
    - ``spare_workers``: worker processes started ahead of ``create_agent``, each
      with its engine's modules loaded (default 2; 0 for a backend that makes
      one pair only). They start when an agent closes, between the caller's
      runs, not while agents work.

    Unlike NIXL's, a worker is never reused and no agent runs in the caller's
    process: a Transfer Engine created in a process where another one was
    closed stalls its transfers until they time out (0.3.13.post1), so every
    agent gets a fresh process, which exits with it; ``spare_workers`` keeps
    some started ahead, so that a new agent rarely waits for one.
    """

    label: ClassVar[str] = "mooncake"
    agent_class: ClassVar[type[WorkerAgent]] = MooncakeAgent
    protocol: ClassVar[ModuleType] = _mooncake_worker
    install_hint: ClassVar[str] = INSTALL_HINT
    in_process_env: ClassVar[tuple[str, ...]] = ("MC_",)
    # The engine logs the first at ERROR hundreds of times a conformance run in which every case passes (0.3.13.post1,
    # TCP); the second comes with glog used before it is initialised. Shown with KVSPEC_BACKEND_LOGS=1.
    quiet_lines: ClassVar[tuple[str, ...]] = (
        "Local segment descriptor not found",
        "Logging before InitGoogleLogging() is written to STDERR",
    )

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        call_timeout: float = 60.0,
        start_timeout: float = 60.0,
        transfer_timeout: float = 30.0,
        poll_interval: float = 0.0005,
        spare_workers: int = 2,
        worker_command: Sequence[str] | None = None,
    ) -> None:
        _require_mooncake()
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(
                f"MooncakeBackend.host: expected an IP address such as '127.0.0.1', got {host!r}"
            ) from None
        if not isinstance(transfer_timeout, (int, float)) or not 1 <= transfer_timeout <= 86400:
            raise ConfigError(
                f"MooncakeBackend.transfer_timeout: expected seconds in [1, 86400], got {transfer_timeout!r}"
            )
        if not isinstance(spare_workers, int) or not 0 <= spare_workers <= 16:
            raise ConfigError(f"MooncakeBackend.spare_workers: expected an integer in [0, 16], got {spare_workers!r}")
        if not isinstance(poll_interval, (int, float)) or not 0 < poll_interval <= 1:
            raise ConfigError(f"MooncakeBackend.poll_interval: expected seconds in (0, 1], got {poll_interval!r}")
        self._env = dict(env or {})
        self._transfer_timeout = float(transfer_timeout)
        capabilities = Capabilities(
            modes=frozenset({TransferMode.READ, TransferMode.WRITE}),
            notifications=True,  # a zero-length transfer_sync carries a TransferNotify
            cross_process=True,
            integrity=False,  # the engine checks no bytes; use the drivers' INT-1 check
            observable_in_flight=True,  # batches run on the engine's threads; check reports them PENDING
            immediate_cancel=False,  # the engine has no cancel: a released batch runs to its end
        )
        options: dict[str, object] = {
            "host": host,
            "transfer_timeout": self._transfer_timeout,
            "poll_interval": float(poll_interval),
        }
        self._init_workers(
            capabilities=capabilities,
            options=options,
            call_timeout=call_timeout,
            start_timeout=start_timeout,
            max_idle_workers=0,  # one engine per process, ever (see above)
            in_process=None,
            worker_command=worker_command,
            spare_workers=spare_workers,
        )

    def create_agent(self, name: str) -> MooncakeAgent:
        """Start a Transfer Engine called ``name`` in a worker process (a reused one when available)."""
        return cast(MooncakeAgent, super().create_agent(name))

    def worker_env(self) -> dict[str, str]:
        """The environment a worker starts with: the engine's timeout, quieter logs, and ``env``."""
        env = self._package_env()
        env["MC_TRANSFER_TIMEOUT"] = str(math.ceil(self._transfer_timeout))
        env.setdefault("MC_LOG_LEVEL", "ERROR")  # "No RDMA devices found" and other start-up noise at INFO/WARNING
        env.update(self._env)
        return env
