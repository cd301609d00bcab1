"""Block digests, the optional integrity rule: what the sender hashes, which blocks the receiver fails, INT-1.

What must live here
-------------------

This module is INT-1's definition; :class:`kvspec.PageDigester` and the sessions
only carry it out. It holds the text form of one block digest
(:data:`DIGEST_HEX_LENGTH`, :func:`is_block_digest`), the hash and the bytes it
reads (:func:`new_block_hash`, :func:`get_block_byte_ranges`,
:func:`digest_block`), and the rows each side compares: what a WRITE sender
puts in its Completion (:func:`get_written_digests`), which blocks a READ or
WRITE receiver fails (:func:`get_read_mismatches`,
:func:`get_written_mismatches`). A digest is taken in each engine's own layout,
so it is exact between engines of one rank and one page size; across TP, PP or
page sizes a guard uses INT-2's canonical-page digest (:mod:`kvspec.spec.digest`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias

from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig
from kvspec.spec.digest import DigestAlgorithm
from kvspec.spec.plan import BlockPairsLike, get_page_byte_ranges

try:
    import xxhash
except ImportError:  # pragma: no cover - a dependency; without it only BLAKE2b-128 is offered (INT-2)
    xxhash = None  # type: ignore[assignment]

__all__ = [
    "BLOCK_DIGEST_PERSON",
    "DIGEST_HEX_LENGTH",
    "BlockDigests",
    "BlockHash",
    "digest_block",
    "get_block_byte_ranges",
    "get_read_mismatches",
    "get_written_digests",
    "get_written_mismatches",
    "is_block_digest",
    "new_block_hash",
]

BlockDigests: TypeAlias = tuple[tuple[str, ...], ...]
"""One hex digest per entry of a per-group block-id list; ``""`` for the null block (INT-1)."""

BLOCK_DIGEST_PERSON = b"kvspec-INT-1"
"""BLAKE2b's personalisation, and the XXH3-64 of it XXH3-128's seed; no key, no salt (INT-1)."""

DIGEST_HEX_LENGTH = 32
"""Characters in one block digest: 16 bytes as lowercase hex (INT-1)."""

_HEX = frozenset("0123456789abcdef")

Buffer: TypeAlias = memoryview | bytes | bytearray
"""One KV-cache tensor's bytes, as the engine registered it with its transport (INT-1)."""


class BlockHash(Protocol):
    """A running 128-bit hash: :mod:`hashlib`'s BLAKE2b or ``xxhash``'s XXH3-128 (INT-1)."""

    def update(self, data: Buffer, /) -> None: ...

    def hexdigest(self) -> str: ...


def is_block_digest(value: object) -> bool:
    """True for 32 lowercase hex characters: the text form of one block digest (INT-1)."""
    return isinstance(value, str) and len(value) == DIGEST_HEX_LENGTH and _HEX.issuperset(value)


def new_block_hash(algorithm: DigestAlgorithm) -> BlockHash:
    """The hash one block digest starts from: BLAKE2b-128 (1.2 peers), or INT-2's choice between 1.3 peers (INT-1)."""
    if algorithm is DigestAlgorithm.XXH3_128 and xxhash is not None:
        hasher: BlockHash = xxhash.xxh3_128(seed=xxhash.xxh3_64_intdigest(BLOCK_DIGEST_PERSON))
        return hasher
    return hashlib.blake2b(digest_size=DIGEST_HEX_LENGTH // 2, person=BLOCK_DIGEST_PERSON)


def get_block_byte_ranges(config: KVCacheConfig, group: int, block_id: int) -> list[tuple[int, int, int]]:
    """``(tensor index, offset, bytes)`` a block's digest reads, in order (INT-1).

    The page of the block in every layer of its group, in the group's layer
    order, where the engine's own layout puts it; of each page the ranges a
    transfer moves, so a state page's padding is not read (PLAN-1).
    """
    kv_group = config.kv_cache_groups[group]
    ranges = []
    for layer in kv_group.layer_names:
        tensor, page = config.page_offset(layer, block_id)
        for offset, nbytes in get_page_byte_ranges(kv_group.kv_cache_spec):
            ranges.append((tensor, page + offset, nbytes))
    return ranges


def digest_block(
    config: KVCacheConfig,
    buffers: Sequence[Buffer],
    group: int,
    block_id: int,
    algorithm: DigestAlgorithm = DigestAlgorithm.BLAKE2B_128,
) -> str:
    """The digest of one block of an engine's pool, one buffer per KV-cache tensor; ``""`` for the null (INT-1)."""
    if block_id == NULL_BLOCK_ID:
        return ""  # the null block holds nothing (NULL-1)
    hasher = new_block_hash(algorithm)
    for tensor, start, nbytes in get_block_byte_ranges(config, group, block_id):
        hasher.update(memoryview(buffers[tensor]).cast("B")[start : start + nbytes])
    return hasher.hexdigest()


def get_written_digests(
    pairs: BlockPairsLike, consumer_block_ids: BlockIds, digest: Callable[[int, int], str]
) -> BlockDigests:
    """WRITE, on the producer: per entry of the offer, the ``digest(group, id)`` of the block paired with it (INT-1).

    ``""`` for an entry no pair writes (a null id, or one outside the pairs).
    """
    out = []
    for g, ids in enumerate(consumer_block_ids):
        source: dict[int, int] = {}
        if g < len(pairs.consumer_block_ids):
            source = dict(zip(pairs.consumer_block_ids[g], pairs.producer_block_ids[g], strict=True))
        out.append(tuple(digest(g, source[c]) if c in source else "" for c in ids))
    return tuple(out)


def get_read_mismatches(
    pairs: BlockPairsLike,
    producer_block_ids: BlockIds,
    producer_digests: BlockDigests,
    digest: Callable[[int, int], str],
) -> BlockIds:
    """READ, on the consumer: the consumer blocks whose ``digest(group, id)`` differs from the producer's (INT-1).

    A paired producer block with no digest counts as differing: the receiver
    cannot vouch for it.
    """
    bad: list[list[int]] = []
    for g, (p_ids, c_ids) in enumerate(zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)):
        sent: dict[int, str] = {}
        if g < len(producer_block_ids) and g < len(producer_digests):
            sent = dict(zip(producer_block_ids[g], producer_digests[g], strict=False))
        bad.append([c for p, c in zip(p_ids, c_ids, strict=True) if not sent.get(p) or digest(g, c) != sent[p]])
    return BlockIds(bad)


def get_written_mismatches(
    consumer_block_ids: BlockIds, digests: BlockDigests, digest: Callable[[int, int], str]
) -> BlockIds:
    """WRITE, on the consumer: the offered blocks whose ``digest(group, id)`` differs from the Completion's (INT-1).

    Entries with the empty digest were not written and are not checked;
    a digest list of another shape than the offer fails every block.
    """
    shaped = len(digests) == len(consumer_block_ids) and all(
        len(d) == len(ids) for d, ids in zip(digests, consumer_block_ids, strict=True)
    )
    if not shaped:
        return BlockIds([[b for b in ids if b != NULL_BLOCK_ID] for ids in consumer_block_ids])
    return BlockIds(
        [
            [c for c, d in zip(ids, sent, strict=True) if d and c != NULL_BLOCK_ID and digest(g, c) != d]
            for g, (ids, sent) in enumerate(zip(consumer_block_ids, digests, strict=True))
        ]
    )
