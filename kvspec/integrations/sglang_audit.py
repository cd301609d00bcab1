"""``kvspec sglang-audit``: whole requests through SGLang 0.5.23's own allocator, index building and pairing.

Per random request (a full pool and, mostly, an SWA pool of one page size and
one window, as SGLang models a hybrid SWA model), each side's pages come from
SGLang's ``PagedTokenToKVPoolAllocator`` (one per pool and side, kept across
requests, so ids are scattered as a live engine's are); decode allocates its
SWA pages only for the tail SGLang's ``DecodePreallocQueue._swa_tail_len``
asks for, and a decode prefix hit H (its radix cache) for the full pool.
SGLang's prefill (``_send_kv_chunk``) and decode (``pop_preallocated``'s
``_swa_payload``) then pick the pages, and each backend pairs them with its
own method (:mod:`kvspec.integrations.sglang`). Both sides' tables say which
logical block each id holds, so every pair is checked by position (ALIGN-1),
for the null page (NULL-1), and against the blocks kvspec says the consumer
needs (WIN-1). Every request also holds a Mamba slot per side from SGLang's
``MambaSlotAllocator``, read back through ``req_index_to_mamba_index_mapping``
by both sides' Mamba payloads and paired by each backend's Mamba path; the
state pair must be the request's two slots (STATE-3, decision 179 in decisions-engines.md).

SGLang computes both lists with one formula, so on a consistent request the
two are of equal length. Its Mooncake and MORI pairing is written to
tolerate a "1-page drift" by pairing the front of the two lists; the audit
probes that path on every request with a window: the producer's list one page
longer at its start, as a producer whose window starts one page earlier would
build it. Those findings are marked ``probe`` (decision 135 in decisions-engines.md).

SGLang's radix cache is not driven: its SWA radix cache needs the hybrid pool
objects, which need a device. A decode prefix hit is drawn instead, and the
cached SWA pages are those ``_swa_tail_len`` keeps (decision 136 in decisions-engines.md).
"""

from __future__ import annotations

import json
import random
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec.core._errors import BlockAlignmentError
from kvspec.core._models import NULL_BLOCK_ID, FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvspec.integrations.sglang import (
    BACKENDS,
    SGLANG_VERSION,
    consumer_pages,
    import_sglang,
    pair_pages,
    producer_pages,
)
from kvspec.reference._reference import get_needed_block_range

__all__ = [
    "AUDIT_BACKENDS",
    "DEVIATIONS",
    "AuditCase",
    "AuditReport",
    "Deviation",
    "check_expected",
    "random_cases",
    "run_audit",
]

AUDIT_BACKENDS = ("mooncake", "nixl", "mori")
_MAX_TOKENS = 20_000


@attrs.frozen
class Deviation:
    """A class of deviation: the rule it breaks, its title, what it does to a request."""

    rule: str
    title: str
    consequence: str
    probe: bool = False


DEVIATIONS: dict[str, Deviation] = {
    "shifted-pair": Deviation(
        "ALIGN-1", "a pair copies one logical block into another", "wrong KV: the consumer attends another position"
    ),
    "reads-null-block": Deviation(
        "NULL-1", "a pair reads the producer's null page", "wrong KV: the null page's bytes are attended"
    ),
    "writes-null-block": Deviation(
        "NULL-1", "a pair writes into the consumer's null page", "the shared padding page is overwritten"
    ),
    "needed-block-not-transferred": Deviation(
        "WIN-1", "a block the consumer needs is not transferred", "the consumer attends a page nobody wrote"
    ),
    "state-slot-mismatch": Deviation(
        "STATE-3",
        "the Mamba state is not copied from the request's slot into the consumer's slot",
        "the consumer decodes from a stale or foreign state",
    ),
    "front-pairs-on-drift": Deviation(
        "ALIGN-1",
        "lists one page apart in length are paired at their fronts",
        "every window page lands one block off, and the consumer's last page is never written",
        probe=True,
    ),
}
"""Every class the audit reports, by name."""


@attrs.frozen
class AuditCase:
    """One random request: page size B, the Hugging Face window W (0: no SWA pool), N tokens, decode prefix H."""

    index: int
    page_size: int
    window: int
    num_tokens: int
    prefix_tokens: int

    def specs(self) -> list[tuple[str, KVCacheSpec]]:
        """The pools as kvspec specs: ``full``, with a window ``swa``, and a Mamba pool ``mamba``.

        Decision 179 in decisions-engines.md.
        """
        common = {"block_size": self.page_size, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
        out: list[tuple[str, KVCacheSpec]] = [("full", FullAttentionSpec(**common))]  # type: ignore[arg-type]
        if self.window:
            out.append(("swa", SlidingWindowSpec(sliding_window=self.window, **common)))  # type: ignore[arg-type]
        state = MambaSpec(block_size=self.page_size, shapes=((3, 8), (2, 4, 4)), dtypes=("float16", "float32"))
        out.append(("mamba", state))
        return out

    def describe(self) -> str:
        """``B=16 W=4096 N=5000 H=0``."""
        return f"B={self.page_size} W={self.window or '-'} N={self.num_tokens} H={self.prefix_tokens}"


def random_cases(requests: int, seed: int) -> list[AuditCase]:
    """``requests`` random cases; windows and lengths chosen so page and window boundaries are hit often."""
    rng = random.Random(seed)
    cases = []
    for index in range(requests):
        page = rng.choice((1, 16, 32, 64))
        window = (
            0
            if rng.random() < 0.1
            else rng.choice((rng.randint(2, 300), rng.choice((128, 512, 4096)) + rng.choice((-1, 0, 1))))
        )
        near = window + rng.randint(-2 * page, 2 * page) if window else rng.randint(1, 4096)
        tokens = min(_MAX_TOKENS, max(1, rng.choice((near, rng.randint(1, _MAX_TOKENS)))))
        prefix = 0
        if tokens > page and rng.random() < 0.3:
            prefix = rng.randint(0, (tokens - 1) // page) * page
        cases.append(AuditCase(index, page, window, tokens, prefix))
    return cases


@attrs.frozen
class Finding:
    """One deviation on one request, with what reproduces it."""

    backend: str
    deviation: str
    case: AuditCase
    group: str
    detail: str
    pair: tuple[int, int] | None
    producer_list: tuple[int, ...]
    consumer_list: tuple[int, ...]


@attrs.frozen
class AuditClass:
    """One deviation class of one backend: how often, and the smallest reproducer."""

    backend: str
    deviation: str
    requests: int
    findings: int
    reproducer: Finding

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the findings page reads."""
        info = DEVIATIONS[self.deviation]
        r = self.reproducer
        return {
            "backend": self.backend,
            "class": self.deviation,
            "rule": info.rule,
            "title": info.title,
            "consequence": info.consequence,
            "probe": info.probe,
            "requests": self.requests,
            "findings": self.findings,
            "reproducer": {
                "page_size": r.case.page_size,
                "window": r.case.window,
                "num_tokens": r.case.num_tokens,
                "prefix_tokens": r.case.prefix_tokens,
                "group": r.group,
                "detail": r.detail,
                "pair": list(r.pair) if r.pair else None,
                "producer_list": _short(r.producer_list),
                "consumer_list": _short(r.consumer_list),
            },
        }


def _short(ids: Sequence[int], limit: int = 12) -> list[int | str]:
    if len(ids) <= limit:
        return list(ids)
    return [*ids[: limit // 2], f"... {len(ids) - limit} more ...", *ids[-limit // 2 :]]


@attrs.frozen
class AuditReport:
    """Counts per backend and every deviation class found."""

    seed: int
    requests: dict[str, int]
    pairs: dict[str, int]
    failed_closed: dict[str, int]
    classes: tuple[AuditClass, ...]

    def to_dict(self) -> dict[str, Any]:
        """The committed ``docs/explanation/sglang-audit.json``."""
        return {
            "sglang_version": SGLANG_VERSION,
            "seed": self.seed,
            "requests": dict(self.requests),
            "pairs": dict(self.pairs),
            "failed_closed": dict(self.failed_closed),
            "classes": [c.to_dict() for c in self.classes],
        }

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON, sorted as found."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    def render(self) -> str:
        """One line per backend, then one per class with its smallest reproducer."""
        out = [f"kvspec sglang-audit: SGLang {SGLANG_VERSION}, seed {self.seed}"]
        for backend, count in self.requests.items():
            out.append(
                f"  {backend}: {count} requests, {self.pairs[backend]} pairs, "
                f"{self.failed_closed[backend]} refused by SGLang"
            )
        for c in self.classes:
            info = DEVIATIONS[c.deviation]
            r = c.reproducer
            out.append(
                f"  {c.backend}/{c.deviation} ({info.rule}{', probe' if info.probe else ''}): {c.requests} requests, "
                f"{c.findings} findings; smallest: {r.case.describe()} group {r.group}: {r.detail}"
            )
        if not self.classes:
            out.append("  no deviation")
        return "\n".join(out) + "\n"


class _Pools:
    """SGLang's ``PagedTokenToKVPoolAllocator`` per (side, pool, page size), reused across requests."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._allocators: dict[tuple[str, str, int], Any] = {}

    def allocator(self, side: str, pool: str, page_size: int) -> Any:
        key = (side, pool, page_size)
        if key not in self._allocators:
            torch = import_sglang("torch")
            paged = import_sglang("sglang.srt.mem_cache.allocator.paged")
            pages = -(-_MAX_TOKENS // page_size) + 64
            self._allocators[key] = paged.PagedTokenToKVPoolAllocator(
                pages * page_size, page_size, torch.int64, "cpu", None, False
            )
        return self._allocators[key]

    def take(self, side: str, pool: str, page_size: int, count: int) -> list[int]:
        """``count`` pages from SGLang's allocator (page ids; page 0 is SGLang's padding page, never handed out)."""
        if count == 0:
            return []
        allocator = self.allocator(side, pool, page_size)
        indices = allocator.alloc(count * page_size)
        if indices is None:
            raise RuntimeError(f"SGLang's {side} {pool} allocator is out of pages for {count}")
        return [int(i) // page_size for i in indices[::page_size]]

    def take_slot(self, side: str) -> int:
        """One Mamba slot from ``side``'s ``MambaSlotAllocator``, as ``HybridReqToTokenPool.alloc`` takes it."""
        key = (side, "mamba", 0)
        if key not in self._allocators:
            mamba = import_sglang("sglang.srt.mem_cache.allocator.mamba")
            self._allocators[key] = mamba.MambaSlotAllocator(size=64, device="cpu")
        slot = self._allocators[key].alloc(1)
        if slot is None:
            raise RuntimeError(f"SGLang's {side} Mamba allocator is out of slots")
        return int(slot[0])

    def give_back(self, side: str, pool: str, page_size: int, pages: Sequence[int]) -> None:
        """Free ``pages`` (shuffled, so later requests get scattered ids) through SGLang's ``free``."""
        torch = import_sglang("torch")
        if pool == "mamba":
            self._allocators[(side, "mamba", 0)].free(torch.tensor(list(pages), dtype=torch.int64))
            return
        real = [p for p in pages if p != NULL_BLOCK_ID]
        self._rng.shuffle(real)
        if real:
            ids = (torch.tensor(real, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
            self.allocator(side, pool, page_size).free(ids)


def _swa_tail_len(page_size: int, sgl_window: int, seq_len: int, radix: bool) -> int:
    """SGLang's ``DecodePreallocQueue._swa_tail_len`` on a stand-in queue: how many tail tokens decode allocates."""
    decode = import_sglang("sglang.srt.disaggregation.decode")
    method = decode.DecodePreallocQueue._swa_tail_len
    disagg = types.SimpleNamespace(disaggregation_decode_enable_radix_cache=radix)
    function = types.FunctionType(
        method.__code__, {**method.__globals__, "get_disagg": lambda: disagg}, method.__name__
    )
    queue = types.SimpleNamespace(
        _uses_swa_tail_prealloc=lambda: True,
        scheduler=types.SimpleNamespace(sliding_window_size=sgl_window),
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=page_size),
    )
    return int(function(queue, seq_len))


def _tables(pools: _Pools, case: AuditCase, pool: str, spec: KVCacheSpec) -> tuple[list[int], list[int]]:
    """Both sides' whole page tables for one pool: page id per logical block, null where none is held."""
    if isinstance(spec, MambaSpec):  # one slot per request and side: SGLang's table for a state pool
        return [pools.take_slot("prefill")], [pools.take_slot("decode")]
    size, tokens = case.page_size, case.num_tokens
    blocks = -(-tokens // size)
    producer = pools.take("prefill", pool, size, blocks)
    if isinstance(spec, SlidingWindowSpec):
        tail = _swa_tail_len(size, spec.sliding_window - 1, tokens, radix=case.prefix_tokens > 0)
        first = (tokens - tail) // size
    else:
        first = 0
    consumer = [NULL_BLOCK_ID] * first + pools.take("decode", pool, size, blocks - first)
    return producer, consumer


def _check(
    backend: str,
    case: AuditCase,
    pool: str,
    spec: KVCacheSpec,
    tables: tuple[list[int], list[int]],
    pairs: tuple[list[int], list[int]],
    deviation_on_shift: str = "shifted-pair",
) -> list[Finding]:
    producer, consumer = tables
    if isinstance(spec, MambaSpec):
        if (list(pairs[0]), list(pairs[1])) != (producer, consumer):
            detail = f"slot {producer} should be copied into slot {consumer}; the copies are {pairs[0]} -> {pairs[1]}"
            return [Finding(backend, "state-slot-mismatch", case, pool, detail, None, tuple(pairs[0]), tuple(pairs[1]))]
        return []
    p_block = {page: i for i, page in enumerate(producer) if page != NULL_BLOCK_ID}
    c_block = {page: i for i, page in enumerate(consumer) if page != NULL_BLOCK_ID}
    lists = (tuple(pairs[0]), tuple(pairs[1]))
    found: list[Finding] = []

    def add(deviation: str, detail: str, pair: tuple[int, int] | None) -> None:
        found.append(Finding(backend, deviation, case, pool, detail, pair, *lists))

    written: set[int] = set()
    for p, c in zip(*pairs, strict=True):
        if p == NULL_BLOCK_ID or p not in p_block:
            add("reads-null-block", f"consumer page {c} is written from the producer's null page", (p, c))
            continue
        if c == NULL_BLOCK_ID or c not in c_block:
            add("writes-null-block", f"producer block {p_block[p]} is written into the consumer's null page", (p, c))
            continue
        if p_block[p] != c_block[c]:
            add(
                deviation_on_shift,
                f"producer block {p_block[p]} is copied into consumer block {c_block[c]}",
                (p, c),
            )
            continue
        written.add(c_block[c])
    needed = get_needed_block_range(spec, num_tokens=case.num_tokens, prefix_hit_tokens=case.prefix_tokens)
    missing = [b for b in needed if b not in written]
    if missing and deviation_on_shift == "shifted-pair":
        size = case.page_size
        add(
            "needed-block-not-transferred",
            f"blocks {missing[0]}..{missing[-1]} (tokens {missing[0] * size}..{(missing[-1] + 1) * size - 1}) "
            "are needed and not transferred",
            None,
        )
    return found


def run_audit(*, backends: Sequence[str] = AUDIT_BACKENDS, requests: int = 200, seed: int = 11) -> AuditReport:
    """Audit ``requests`` random requests per backend (:func:`random_cases` with ``seed``) (ALIGN-1, NULL-1, WIN-1)."""
    for backend in backends:
        if backend not in BACKENDS:
            from kvspec.core._errors import ConfigError

            raise ConfigError(f"sglang-audit --backend {backend}: expected one of {sorted(BACKENDS)}")
    rng = random.Random(seed)
    pools = _Pools(rng)
    counts = {b: 0 for b in backends}
    pairs_total = {b: 0 for b in backends}
    closed = {b: 0 for b in backends}
    findings: list[Finding] = []
    for case in random_cases(requests, seed):
        held: list[tuple[str, str, list[int]]] = []
        for pool, spec in case.specs():
            tables = _tables(pools, case, pool, spec)
            held += [("prefill", pool, tables[0]), ("decode", pool, tables[1])]
            keywords = {"num_tokens": case.num_tokens, "prefix_tokens": case.prefix_tokens}
            src = producer_pages(spec, tables[0], first_block=0, **keywords)
            dst = consumer_pages(spec, tables[1], first_block=0, **keywords)
            window = isinstance(spec, SlidingWindowSpec)
            state = isinstance(spec, MambaSpec)
            first = tables[0].index(src[0]) if src else 0
            for backend in backends:
                try:
                    paired = pair_pages(backend, src, dst, window=window, state=state)
                except BlockAlignmentError:
                    closed[backend] += 1
                    continue
                pairs_total[backend] += len(paired[0])
                findings += _check(backend, case, pool, spec, tables, paired)
                if window and first > 0 and dst:
                    try:
                        drift = pair_pages(backend, [tables[0][first - 1], *src], dst, window=True)
                    except BlockAlignmentError:  # NIXL refuses any mismatch: it fails closed
                        closed[backend] += 1
                        continue
                    findings += _check(backend, case, pool, spec, tables, drift, "front-pairs-on-drift")
        for backend in backends:
            counts[backend] += 1
        for side, pool, table in held:
            pools.give_back(side, pool, case.page_size, table)
    return AuditReport(seed, counts, pairs_total, closed, _classes(findings, backends))


def _classes(findings: Sequence[Finding], backends: Sequence[str]) -> tuple[AuditClass, ...]:
    grouped: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        grouped.setdefault((f.backend, f.deviation), []).append(f)
    out = []
    for (backend, deviation), items in grouped.items():
        smallest = min(items, key=lambda f: (f.case.num_tokens, f.case.page_size, f.case.index))
        out.append(AuditClass(backend, deviation, len({f.case.index for f in items}), len(items), smallest))
    order = list(DEVIATIONS)
    return tuple(sorted(out, key=lambda c: (backends.index(c.backend), order.index(c.deviation))))


def check_expected(report: AuditReport, expected: Mapping[str, str]) -> list[str]:
    """What breaks the expected list: a class not in it, or a listed one no longer found (FAIL-1)."""
    problems = []
    found = {(c.backend, c.deviation) for c in report.classes}
    for backend, deviation in sorted(found):
        if f"{backend}/{deviation}" not in expected and deviation not in expected:
            info = DEVIATIONS[deviation]
            problems.append(f"{backend}: unexpected deviation {deviation} ({info.rule}): {info.title}")
    for key, reason in expected.items():
        backend, _, deviation = key.rpartition("/")
        if deviation not in DEVIATIONS:
            problems.append(f"expected {key}: no deviation class {deviation!r}; expected one of {sorted(DEVIATIONS)}")
            continue
        if backend and backend not in report.requests:
            continue
        audited = [backend] if backend else list(report.requests)
        if not any((name, deviation) in found for name in audited):
            problems.append(f"{key} was expected ({reason}) but no longer found: remove it from the list")
    return problems
