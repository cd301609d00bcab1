"""Offload copies as sessions run by the driver (OFF-3, OFF-6, FAIL-1), and the one poll loop, poll_until."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence

import pytest
from kvspec_conformance import OffloadRequest, OffloadScenario, run_offload_scenario
from kvspec_conformance.configs import full, make_config
from mutants import MutantBackend, _Agent

import kvspec.drivers._driver as _driver
from kvspec import Abort, FailureReason, LocalProtocolError, RemoteProtocolError, TransferMode, TransportError
from kvspec.exchange import ChunkCopy, OffloadKind, OffloadSession, OffloadState, poll_until
from kvspec.transport import Descriptor, TransferHandle, TransferState, TransferStatus


def _copy(**overrides: object) -> OffloadSession:
    fields: dict[str, object] = {
        "request_id": "r store",
        "kind": OffloadKind.STORE,
        "mode": TransferMode.WRITE,
        "copies": [ChunkCopy(gpu_region=0, gpu_offset=64, chunk_region=1, chunk_offset=0, nbytes=64)],
        "timeout": 2.0,
    }
    fields.update(overrides)
    return OffloadSession(**fields)  # type: ignore[arg-type]


def test_a_copy_posts_once_then_lands_or_fails() -> None:
    session = _copy()
    with pytest.raises(LocalProtocolError, match="no posted transfer"):
        session.transfer_done(now=0.0)
    assert session.start(now=1.0).post
    with pytest.raises(LocalProtocolError, match="already started"):
        session.start(now=1.0)
    assert session.tick(now=2.9).ignored
    assert session.state is OffloadState.COPYING
    session.transfer_done(now=3.0)
    assert session.state is OffloadState.DONE  # type: ignore[comparison-overlap]  # mypy narrowed it above
    assert session.is_terminal
    failed = _copy()
    failed.start(now=0.0)
    failed.transfer_failed(FailureReason.TRANSFER_ERROR, now=0.5, detail="bad")
    assert (failed.state, failed.reason, failed.detail) == (OffloadState.FAILED, FailureReason.TRANSFER_ERROR, "bad")


def test_a_copy_past_its_timeout_fails_and_is_cancelled() -> None:
    session = _copy(timeout=0.5)
    session.start(now=10.0)
    assert session.next_deadline == 10.5
    out = session.tick(now=10.5)
    assert out.cancel
    assert (session.state, session.reason) == (OffloadState.FAILED, FailureReason.TIMEOUT)
    session.transfer_done(now=11.0)  # the cancelled copy's late report changes nothing
    assert session.state is OffloadState.FAILED
    assert session.next_deadline is None


def test_a_copy_takes_no_message_and_says_which_side_posts() -> None:
    with pytest.raises(RemoteProtocolError, match="takes no Abort"):
        _copy().receive(Abort(request_id="r", engine_id="C"), now=0.0)
    assert _copy().gpu_posts
    assert _copy(kind=OffloadKind.LOAD, mode=TransferMode.READ).gpu_posts
    assert not _copy(mode=TransferMode.READ).gpu_posts
    assert not _copy(kind=OffloadKind.LOAD, mode=TransferMode.WRITE).gpu_posts


def test_poll_until_stops_when_done_or_at_its_bound() -> None:
    polls: list[int] = []
    pauses: list[int] = []
    now = [0.0]
    done = poll_until(
        lambda: polls.append(1), done=lambda: len(polls) >= 5, pause=lambda: pauses.append(1), spin=2, clock=lambda: 0
    )
    assert done
    assert len(polls) == 5
    assert len(pauses) == 2  # no pause after the first two polls, none once done

    def tick() -> None:
        now[0] += 1.0

    assert not poll_until(tick, done=lambda: False, until=3.0, pause=lambda: None, clock=lambda: now[0])
    assert now[0] == 4.0  # polled at 0, 1, 2 and 3; stopped once past the bound
    polls.clear()
    assert poll_until(lambda: polls.append(1), done=lambda: True, min_polls=3, pause=lambda: None)
    assert len(polls) == 3


def test_the_driver_never_branches_on_session_classes() -> None:
    """Issue 24: a role per side, never ``isinstance(session, ...)`` (nor ``isinstance(request.session, ...)``)."""
    tree = ast.parse(inspect.getsource(_driver.Driver))
    branches = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and "session" in ast.unparse(node.args[0])
    ]
    assert branches == []


# --------------------------------------------------------------------------- the offload scenario's copies


class _Refuses(_Agent):
    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        raise TransportError("no room", reason=FailureReason.POST_FAILED.value)


class _Fails(_Agent):
    def check(self, handle: TransferHandle) -> TransferStatus:
        self.inner.check(handle)
        return TransferStatus(state=TransferState.FAILED, reason=FailureReason.TRANSFER_ERROR, detail="lost")


class _Hangs(_Agent):
    def check(self, handle: TransferHandle) -> TransferStatus:
        return TransferStatus(state=TransferState.PENDING)


class _Backend(MutantBackend):
    def __init__(self, agent_class: type[_Agent]) -> None:
        super().__init__()
        self.agent_class = agent_class


@pytest.mark.parametrize(
    ("agent_class", "found"),
    [
        (_Agent, None),
        (_Refuses, "the backend refused the store of 'r' at 8 tokens: TransportError: no room"),
        (_Fails, "the backend failed the store of 'r' at 8 tokens: transfer_error lost"),
        (_Hangs, "the store of 'r' at 8 tokens did not complete within 0.02s"),
    ],
)
def test_each_copy_of_the_offload_scenario_is_a_driven_session(agent_class: type[_Agent], found: str | None) -> None:
    """The driver posts each store, reports how it ended, and fails it past the scenario's deadline (FAIL-1)."""
    # Only the copy that never ends waits out its deadline; the others get one no loaded machine misses.
    scenario = OffloadScenario(
        config=make_config(full(4), num_blocks=8),
        requests=[OffloadRequest(request_id="r", num_tokens=8)],
        deadline=0.02 if agent_class is _Hangs else 5.0,
    )
    result = run_offload_scenario(scenario, backend=_Backend(agent_class))
    assert result.problems == (() if found is None else (found,))
    assert (result.stored_pages > 0) is (agent_class is not _Refuses)
