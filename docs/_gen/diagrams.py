"""Mermaid diagrams for the docs: state diagrams from the transition tables, sequences from running the sessions."""

from __future__ import annotations

from collections.abc import Callable

import kvspec
import kvspec.protocol._session as _session

__all__ = ["SEQUENCES", "sequence_diagram", "state_diagram", "transition_table"]

READ, WRITE = kvspec.TransferMode.READ, kvspec.TransferMode.WRITE


def state_diagram(role: _session.Role, mode: kvspec.TransferMode | None = None) -> str:
    """The role's state diagram, drawn from the table the session executes (SM-1, SM-2).

    Rows with the same source and target become one arrow, and events with
    the same actions share one label (``release, abort / cancel``), so
    parallel arrows do not overlap.
    """
    merged: dict[tuple[str, str], dict[str, list[str]]] = {}
    other: list[str] = []
    for line in _session.to_mermaid(role, mode).splitlines():
        head, sep, label = line.partition(": ")
        source, arrow, target = head.strip().partition(" --> ")
        if sep and arrow and "[*]" not in head:
            event, _, actions = label.partition(" / ")
            merged.setdefault((source, target), {}).setdefault(actions, []).append(event)
        else:
            other.append(line)
    edges = []
    for (source, target), by_actions in merged.items():
        labels = [", ".join(events) + (f" / {actions}" if actions else "") for actions, events in by_actions.items()]
        edges.append(f"    {source} --> {target}: {' | '.join(labels)}")
    # Keep the header and the initial arrow first, the final arrows last.
    return "\n".join(other[:2] + edges + other[2:]) + "\n"


def transition_table(role: _session.Role) -> str:
    """The role's transition table as Markdown, then the events each state ignores by an explicit row."""
    table = _session.PRODUCER_TRANSITIONS if role == "producer" else _session.CONSUMER_TRANSITIONS
    ignored: dict[str, list[str]] = {}
    for row in table:
        if row.ignored:
            modes = "" if len(row.modes) == 2 else f" ({'/'.join(sorted(m.value for m in row.modes))})"
            ignored.setdefault(row.source.name, []).append(f"`{row.event.value}`{modes}")
    lines = [f"- {state}: {', '.join(events)}" for state, events in ignored.items()]
    return (
        _session.to_markdown(role)
        + "\nIgnored by an explicit row (no change, no action; any event with no row at all raises"
        + " `LocalProtocolError`):\n\n"
        + "\n".join(lines)
        + "\n"
    )


class _Recorder:
    """Turns session outputs into mermaid sequence lines."""

    def __init__(self, mode: kvspec.TransferMode) -> None:
        self.mode = mode
        self.lines = [
            "sequenceDiagram",
            "    participant P as Producer (prefill)",
            "    participant R as Router",
            "    participant C as Consumer (decode)",
            "    participant T as Transport",
        ]

    def say(self, line: str) -> None:
        self.lines.append(f"    {line}")

    def record(self, who: str, out: _session.Output) -> None:
        peer = "C" if who == "P" else "P"
        for step in out.steps:
            self.say(f"Note over {who}: {step.source.name} → {step.target.name} ({step.event.value})")
        # The actions in the order the table lists them, as a driver carries them out.
        for action in out.actions:
            if isinstance(action, _session.Post):
                note = action.notification
                extra = f" + {type(note).__name__} as its notification" if note is not None else ""
                self.say(f"{who}->>T: post {self.mode.value.upper()} descriptors{extra}")
            elif isinstance(action, _session.Cancel):
                self.say(f"{who}->>T: cancel the transfer, keep polling until it ends")
            elif isinstance(action, _session.Send):
                name = type(action.message).__name__
                self.say(f"{who}-){peer}: {name} (encoded, sent as a transport notification)")
            else:
                self.say(f"Note over {who}: blocks {action.block_ids.to_lists()} may be reused")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _producer(mode: kvspec.TransferMode) -> _session.ProducerSession:
    return _session.ProducerSession.create(
        request_id="req-1",
        producer_engine_id="prefill-0",
        producer_block_ids=[[1, 2, 3], [7, 8]],
        num_tokens=40,
        mode=mode,
        now=0.0,
        lease_duration=30.0,
    )


def _handoff(
    rec: _Recorder, producer: _session.ProducerSession, consumer_ids: list[list[int]]
) -> _session.ConsumerSession:
    rec.say(f"Note over P: prefill done, {producer.state.name}: blocks pinned until the lease deadline")
    rec.say("P->>R: TransferParams (kv_transfer_params: clipped producer_block_ids, num_tokens, lease)")
    rec.say("R->>C: TransferParams")
    return _session.ConsumerSession(
        params=producer.params, consumer_engine_id="decode-0", consumer_block_ids=consumer_ids
    )


def _read() -> str:
    rec = _Recorder(READ)
    producer = _producer(READ)
    consumer = _handoff(rec, producer, [[11, 12], [13, 14]])
    rec.record("C", out := consumer.start(now=1.0))
    rec.say("T->>T: copy P's paired pages into C's blocks")
    rec.say("T-->>C: check(): DONE, every byte readable on C (DONE-1)")
    rec.record("C", out := consumer.transfer_done(now=2.0))
    for message in out.send:
        rec.record("P", producer.receive(message, now=2.5))
    return rec.text()


def _write() -> str:
    rec = _Recorder(WRITE)
    producer = _producer(WRITE)
    consumer = _handoff(rec, producer, [[11, 12], [13, 14]])
    rec.record("C", out := consumer.start(now=1.0))
    for message in out.send:
        rec.record("P", producer.receive(message, now=1.5))
    rec.say("T->>T: copy P's paired pages into C's blocks")
    rec.say("T-->>P: check(): DONE")
    rec.record("P", producer.transfer_done(now=2.0))
    rec.say("T-->>C: notification Completion, delivered after the data (DONE-1)")
    rec.record("C", out := consumer.receive(producer.completion, now=2.1))
    for message in out.send:
        rec.record("P", producer.receive(message, now=2.5))
    return rec.text()


def _read_failure() -> str:
    rec = _Recorder(READ)
    producer = _producer(READ)
    consumer = _handoff(rec, producer, [[11, 12], [13, 14]])
    rec.record("C", consumer.start(now=1.0))
    rec.say("T-->>C: check(): FAILED (peer_disconnected)")
    out = consumer.transfer_failed(kvspec.FailureReason.PEER_DISCONNECTED, now=2.0)
    rec.record("C", out)
    if consumer.failure is not None:
        ids = consumer.failure.failed_consumer_block_ids.to_lists()
        rec.say(f"Note over C: FAILED, never LOADED; possibly invalid blocks {ids} (FAIL-1)")
    for message in out.send:
        rec.record("P", producer.receive(message, now=2.5))
    return rec.text()


def _abort_while_loading() -> str:
    rec = _Recorder(READ)
    producer = _producer(READ)
    consumer = _handoff(rec, producer, [[11, 12], [13, 14]])
    rec.record("C", consumer.start(now=1.0))
    rec.say("Note over C: the request is aborted while its read is in flight")
    rec.record("C", consumer.abort(now=1.5))
    rec.say("Note over C: blocks stay allocated: bytes may still land in them (SM-2)")
    rec.say("T-->>C: check(): the cancelled transfer has stopped")
    out = consumer.transfer_done(now=2.0)
    rec.record("C", out)
    for message in out.send:
        rec.record("P", producer.receive(message, now=2.5))
    return rec.text()


def _prefix_hit() -> str:
    rec = _Recorder(READ)
    producer = _producer(READ)
    consumer = _handoff(rec, producer, [])
    rec.say("Note over C: full prefix hit: zero groups to load, nothing is posted")
    rec.record("C", out := consumer.start(now=1.0))
    for message in out.send:
        rec.record("P", producer.receive(message, now=1.5))
    return rec.text()


SEQUENCES: dict[str, tuple[str, Callable[[], str]]] = {
    "read": ("READ: the consumer pulls", _read),
    "write": ("WRITE: the producer pushes into the blocks the consumer offered", _write),
    "read-failure": ("READ, the transfer fails: FAILED, then the one release", _read_failure),
    "abort-while-loading": ("READ, aborted mid-transfer: cancel, drain, only then free (SM-2)", _abort_while_loading),
    "prefix-hit": ("Full prefix hit: nothing moves, the release still goes out (REL-1)", _prefix_hit),
}


def sequence_diagram(name: str) -> str:
    """A sequence diagram made by running both sessions through one scenario."""
    return SEQUENCES[name][1]()
