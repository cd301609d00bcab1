"""kvspec: the executable reference specification for hybrid KV-cache hand-off between engines.

The top level is the specification itself: the models of a KV cache, the
reference functions of each rule, the planner, the sans-IO sessions, the
messages and their codec, and the errors. Tools built on it live in named
submodules (docs/explanation/layers.md):

- :mod:`kvspec.exchange`: drivers that run a request over a transport.
- :mod:`kvspec.fast`: the definitions' fast twins, for an engine's hot path.
- :mod:`kvspec.transport`: the Transport interface and its backends.
- :mod:`kvspec.presets`: KV-cache configs of real models.
- :mod:`kvspec.rules`: the rule registry (ids, titles, levels).
- :mod:`kvspec.schema`: JSON Schemas of the messages.
- :mod:`kvspec.summary`: what a request would move, with and without clipping.
- :mod:`kvspec.testing`: pools, keyed pages and the page oracle.
"""

# The spec-layer submodules load with the spec (the redundant aliases mark them as re-exported).
from typing import TYPE_CHECKING

from kvspec import presets as presets
from kvspec import rules as rules
from kvspec import schema as schema
from kvspec import summary as summary
from kvspec._version import __version__
from kvspec.core._deprecation import moved_names
from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import (
    BackendUnavailableError,
    BlockAlignmentError,
    CacheAccountingError,
    ConfigError,
    FieldError,
    GroupCountError,
    IncompatiblePeerError,
    IntegrityMismatchError,
    KVSpecError,
    LocalProtocolError,
    MalformedMessageError,
    OutOfBlocksError,
    ParallelismError,
    PlanError,
    ProtocolError,
    RemoteError,
    RemoteProtocolError,
    StatePositionError,
    StateSlotError,
    TransportError,
    UnknownRuleError,
    UnsupportedHybridError,
    UnsupportedVersionError,
    WindowCoverageError,
    decode_error,
    encode_error,
    format_error,
)
from kvspec.core._models import (
    DTYPE_SIZES,
    NULL_BLOCK_ID,
    AttentionSpec,
    BlockIds,
    CacheDeclaration,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    DType,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    LayerLocation,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SpecKind,
    StateProfile,
)
from kvspec.protocol._codec import decode, encode
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._plan import BlockPairsLike, GroupPlan, PageCopy, TransferPlan, plan_transfer
from kvspec.protocol._session import (
    ConsumerEvent,
    ConsumerSession,
    ConsumerState,
    FailureInfo,
    Output,
    ProducerEvent,
    ProducerSession,
    ProducerState,
)
from kvspec.reference._integrity import BlockDigests, PageDigester
from kvspec.reference._messages import (
    PROTOCOL_VERSION,
    Abort,
    BlockOffer,
    Completion,
    EngineDescriptor,
    Failure,
    GroupDescriptor,
    Message,
    Release,
    ReleaseOutcome,
    TransferParams,
    TransportData,
)

# Offload rules (OFF-1 ... OFF-9): one contiguous block, kept apart for easy merges.
from kvspec.reference._offload import (
    LoadSet,
    OffloadConfig,
    OffloadKey,
    StoreSet,
    check_offload_support,
    get_chunk_sizes,
    get_load_set,
    get_offload_keys,
    get_retained_chunk_starts,
    get_store_set,
    get_sub_block_offset,
    map_sub_blocks,
)
from kvspec.reference._reference import (
    BlockIdsLike,
    BlockPairs,
    TokenBasis,
    check_hybrid_support,
    get_block_ends,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_logical_block_count,
    get_needed_block_range,
    get_needed_token_range,
    get_num_skipped_tokens,
    get_token_basis_group,
    is_full_attention_spec,
    is_hma_required,
)

# These names are the definitions themselves (kvspec.X is kvspec.spec.X); their fast twins are kvspec.fast's.
from kvspec.spec import (
    BlockLists,
    TransferRequest,
    check_request_blocks,
    check_window_coverage,
    compute_block_pairs,
    compute_transfer_pairs,
    get_exchange_clipped_blocks,
    get_offload_hit_tokens,
    get_pruned_block_ids,
)

__all__ = [
    "DTYPE_SIZES",
    "NULL_BLOCK_ID",
    "PROTOCOL_VERSION",
    "Abort",
    "AttentionSpec",
    "BackendUnavailableError",
    "BlockAlignmentError",
    "BlockDigests",
    "BlockIds",
    "BlockIdsLike",
    "BlockLists",
    "BlockOffer",
    "BlockPairs",
    "BlockPairsLike",
    "CacheAccountingError",
    "CacheDeclaration",
    "ChunkedLocalAttentionSpec",
    "Completion",
    "ConfigError",
    "ConsumerEvent",
    "ConsumerSession",
    "ConsumerState",
    "CrossAttentionSpec",
    "DType",
    "EngineDescriptor",
    "Failure",
    "FailureInfo",
    "FailureReason",
    "FieldError",
    "FullAttentionSpec",
    "GroupCountError",
    "GroupDescriptor",
    "GroupPlan",
    "IncompatiblePeerError",
    "IndexerSpec",
    "IntegrityMismatchError",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVSpecError",
    "LayerLocation",
    "LoadSet",
    "LocalProtocolError",
    "MLAAttentionSpec",
    "MalformedMessageError",
    "MambaSpec",
    "Message",
    "OffloadConfig",
    "OffloadKey",
    "OutOfBlocksError",
    "Output",
    "PageCopy",
    "PageDigester",
    "ParallelismError",
    "PlanError",
    "ProducerEvent",
    "ProducerSession",
    "ProducerState",
    "ProtocolError",
    "Release",
    "ReleaseOutcome",
    "RemoteError",
    "RemoteProtocolError",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "SpecKind",
    "StatePositionError",
    "StateProfile",
    "StateSlotError",
    "StoreSet",
    "TokenBasis",
    "TransferMode",
    "TransferParams",
    "TransferPlan",
    "TransferRequest",
    "TransportData",
    "TransportError",
    "UnknownRuleError",
    "UnsupportedHybridError",
    "UnsupportedVersionError",
    "WindowCoverageError",
    "__version__",
    "check_compatibility",
    "check_hybrid_support",
    "check_offload_support",
    "check_request_blocks",
    "check_window_coverage",
    "compute_block_pairs",
    "compute_transfer_pairs",
    "decode",
    "decode_error",
    "encode",
    "encode_error",
    "format_error",
    "get_block_ends",
    "get_blocks_per_sw",
    "get_chunk_sizes",
    "get_consumer_block_counts",
    "get_exchange_clipped_blocks",
    "get_load_set",
    "get_logical_block_count",
    "get_needed_block_range",
    "get_needed_token_range",
    "get_num_skipped_tokens",
    "get_offload_hit_tokens",
    "get_offload_keys",
    "get_pruned_block_ids",
    "get_retained_chunk_starts",
    "get_store_set",
    "get_sub_block_offset",
    "get_token_basis_group",
    "is_full_attention_spec",
    "is_hma_required",
    "map_sub_blocks",
    "plan_transfer",
]

# Names that moved to a submodule or were renamed in 0.2.0: they still work, with a
# DeprecationWarning, until 0.3.0 (CHANGELOG.md lists each one).
_MOVED: dict[str, tuple[str, str, str]] = {
    **{
        name: ("kvspec.drivers._exchange", name, f"kvspec.exchange.{name}")
        for name in (
            "BlockAllocator",
            "ConsumerEndpoint",
            "ConsumerResult",
            "ExchangeResult",
            "ProducerEndpoint",
            "ProducerResult",
            "connect",
            "run_request",
        )
    },
    **{
        name: ("kvspec.reference._presets", name, f"kvspec.presets.{name}")
        for name in ("ModelPreset", "get_preset", "list_presets")
    },
    **{name: ("kvspec.core._rules", name, f"kvspec.rules.{name}") for name in ("RULES", "Level", "Rule", "get_rule")},
    **{
        name: ("kvspec.protocol._summary", name, f"kvspec.summary.{name}")
        for name in ("GroupSummary", "PlanSummary", "blocks_needed_for", "summarize_plan")
    },
    "message_schemas": ("kvspec.protocol._schema", "message_schemas", "kvspec.schema.message_schemas"),
    "PairedBlocks": ("kvspec.protocol._plan", "BlockPairsLike", "kvspec.BlockPairsLike"),
    "blocks_per_sw": ("kvspec.reference._reference", "get_blocks_per_sw", "kvspec.get_blocks_per_sw"),
    "align_block_ids": ("kvspec.spec", "compute_block_pairs", "kvspec.compute_block_pairs"),
    "validate_hybrid_support": (
        "kvspec.reference._reference",
        "validate_hybrid_support",
        "kvspec.check_hybrid_support(config, mode=...)",
    ),
}

# kvspec.exchange, kvspec.transport and kvspec.testing load on first use: the spec never imports them.
# Hidden from type checkers, so that a misspelt name stays an error there; old names are flagged too.
if not TYPE_CHECKING:
    __getattr__ = moved_names("kvspec", _MOVED, lazy_submodules=("exchange", "testing", "transport"))
