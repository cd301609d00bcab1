"""Page digests for the optional integrity rule (INT-1), as an engine computes them over its registered pool.

The rule is defined in :mod:`kvspec.spec.integrity`; this module keeps only the
digester, which walks its layout once and calls the definition's hash and checks.

Theory of operation
-------------------

A **block digest** is a 128-bit hash over the pages one block holds in its
group: BLAKE2b (16-byte digest, personalised ``kvspec-INT-1``) between protocol
1.2 peers, or the algorithm two 1.3 peers chose in the handshake (INT-2:
XXH3-128, seeded with the XXH3-64 of ``kvspec-INT-1``, by default). It covers,
for block ``b`` of group ``g``, the page of ``b`` in every layer of the group,
in the group's layer order, each as the ranges a transfer moves (all
``page_size_bytes`` of an attention page; a state page's tensors without its
padding, PLAN-1), read where the engine's own layout puts it
(:meth:`kvspec.KVCacheConfig.page_offset`). Both sides compute it over their
own pool with their own layout, so two blocks hold the same KV exactly when
their digests are equal, whatever the layouts. It travels as 32 lowercase hex
characters; a null block (NULL-1) has the empty digest ``""``.

The sender digests the blocks whose bytes it sends (READ: P's advertised
blocks, in the transfer parameters; WRITE: the producer block written into
each consumer block of the offer, in the Completion). The receiver digests the
blocks that were written and compares before it reports LOADED (INT-1).

The digest is not keyed: INT-1 catches bytes the transfer damaged, lost or
misplaced, not a peer that lies (that is the transport's authentication).
:mod:`hashlib`'s BLAKE2b is in every Python and in every language's standard
crypto library; XXH3-128 reads the same bytes at about the speed of a copy
(its cost: ``benchmarks/bench_integrity.py``). The reference engines are one
rank each with equal page sizes, so a per-block digest in each engine's own
layout is exact there; a guard between engines of other TP, PP or page sizes
uses INT-2's canonical-page digest (:mod:`kvspec.spec.digest`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.core._errors import IncompatiblePeerError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig
from kvspec.spec.digest import DigestAlgorithm, choose_digest_algorithm
from kvspec.spec.integrity import (
    DIGEST_HEX_LENGTH,
    BlockDigests,
    Buffer,
    get_read_mismatches,
    get_written_digests,
    get_written_mismatches,
    is_block_digest,
    new_block_hash,
)
from kvspec.spec.plan import BlockPairsLike, get_page_byte_ranges

__all__ = [
    "DIGEST_HEX_LENGTH",
    "BlockDigests",
    "BlockPairsLike",
    "PageDigester",
    "is_block_digest",
]


def _is_flat(buffer: Buffer) -> bool:
    return not isinstance(buffer, memoryview) or (buffer.format == "B" and buffer.ndim == 1)


class PageDigester:
    """Digests the blocks of one engine's pool: its layout (``config``) and its registered buffers (INT-1).

    ``buffers`` holds one buffer per KV-cache tensor, in config order (the
    regions the engine registered with its transport). The digester keeps
    references to them and makes no lasting view, so a pool in shared memory
    can still be closed while the digester exists. ``algorithm`` is BLAKE2b-128
    until a handshake chooses another (:meth:`choose`).
    """

    def __init__(
        self,
        config: KVCacheConfig,
        buffers: Sequence[Buffer],
        algorithm: DigestAlgorithm = DigestAlgorithm.BLAKE2B_128,
    ) -> None:
        self.config = config
        self.algorithm = DigestAlgorithm(algorithm)
        self._chosen_with: str | None = None
        self._buffers = list(buffers)
        self._flat = all(_is_flat(b) for b in self._buffers)
        # Per group: (tensor, base offset, block stride) per layer, in the group's layer order.
        self._slots: list[list[tuple[int, int, int]]] = []
        for group in config.kv_cache_groups:
            slots = []
            for layer in group.layer_names:
                loc = config.locate(layer)
                tensor = config.kv_cache_tensors[loc.tensor_index]
                slots.append(
                    (loc.tensor_index, tensor.offset + loc.layer_index * tensor.layer_stride, tensor.block_stride)
                )
            self._slots.append(slots)
        # The bytes of a page that a transfer moves: a state page's padding never moves, so it is not digested (PLAN-1).
        self._ranges = [get_page_byte_ranges(g.kv_cache_spec) for g in config.kv_cache_groups]

    def choose(
        self, peer: str, offered: Sequence[str], theirs: Sequence[str], *, peer_version: tuple[int, int]
    ) -> None:
        """Take the algorithm chosen with ``peer``: INT-2's choice between 1.3 peers, BLAKE2b-128 with 1.2 (INT-1).

        One digester serves every peer of its engine, so every peer must
        choose the same algorithm; one that would choose another is refused
        with :class:`IncompatiblePeerError` naming ``digest_algorithms``.
        """
        chosen = DigestAlgorithm.BLAKE2B_128
        if peer_version >= (1, 3):
            found = choose_digest_algorithm(offered, theirs)
            if found is None:
                raise IncompatiblePeerError({"digest_algorithms": (tuple(offered), tuple(theirs))})
            chosen = found
        if self._chosen_with is not None and chosen is not self.algorithm:
            raise IncompatiblePeerError(
                {"digest_algorithms": (f"{self.algorithm.value} (with {self._chosen_with!r})", chosen.value)}
            )
        self.algorithm, self._chosen_with = chosen, peer

    def block_digest(self, group: int, block_id: int) -> str:
        """The digest of block ``block_id`` of group ``group``; ``""`` for the null block (INT-1)."""
        if block_id == NULL_BLOCK_ID:
            return ""
        ranges = self._ranges[group]
        h = new_block_hash(self.algorithm)
        buffers = self._buffers
        for region, base, stride in self._slots[group]:
            buffer = buffers[region] if self._flat else memoryview(buffers[region]).cast("B")
            for offset, nbytes in ranges:
                start = base + block_id * stride + offset
                h.update(buffer[start : start + nbytes])
        return h.hexdigest()

    def digests(self, block_ids: BlockIds) -> BlockDigests:
        """One digest per entry of ``block_ids``, group by group (INT-1)."""
        return tuple(tuple(self.block_digest(g, b) for b in ids) for g, ids in enumerate(block_ids))

    def written_digests(self, pairs: BlockPairsLike, consumer_block_ids: BlockIds) -> BlockDigests:
        """WRITE, on the producer: per entry of the offer, the digest of the producer block paired with it (INT-1)."""
        return get_written_digests(pairs, consumer_block_ids, self.block_digest)

    def check_read(
        self, pairs: BlockPairsLike, producer_block_ids: BlockIds, producer_digests: BlockDigests
    ) -> BlockIds:
        """READ, on the consumer: the consumer blocks whose digest differs from the producer's (INT-1)."""
        return get_read_mismatches(pairs, producer_block_ids, producer_digests, self.block_digest)

    def check_written(self, consumer_block_ids: BlockIds, digests: BlockDigests) -> BlockIds:
        """WRITE, on the consumer: the offered blocks whose digest differs from the Completion's (INT-1)."""
        return get_written_mismatches(consumer_block_ids, digests, self.block_digest)
