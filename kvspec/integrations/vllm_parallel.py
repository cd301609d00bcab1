"""vLLM 0.33's NIXL (pull) mapping across TP sizes behind kvspec's parallel seam: its own reads, as rank copies.

:func:`plan_nixl_consumer_rank` answers :class:`kvspec.connector.ParallelConnector`
for ``--connector vllm:nixl``. Which producer ranks a consumer rank reads
from, where its head slice sits and how many notifications free a producer
rank are vLLM's ``compute_tp_mapping`` (``nixl/tp_mapping.py``); the conv
sub-projection split is vLLM's ``derive_mamba_conv_split`` and
``MambaConvSplitInfo.remote_conv_offsets`` (``ssm_conv_transfer_utils.py``);
the descriptors are built by the NIXL worker's own ``_build_fa_local``,
``_build_fa_remote``, ``_build_mamba_local``, ``_build_mamba_remote`` and
``_build_local_splits_from_plan``, called on a worker built without its
constructor (which needs a device) and given only the attributes those
methods read. kvspec only lays the suite's pages out as vLLM regions (one
region per attention tensor, one per state layer, one block each) and reads
each local/remote descriptor pair back as a :class:`RankCopy`.

What vLLM's worker refuses at handshake or construction (pipeline parallel
with hybrid layouts, head slicing of a page that is not block-contiguous,
NVFP4-like opaque pages, P TP > D TP with replicated KV heads, DCP outside
MLA) is checked here by the same conditions, vLLM's message quoted, since
those checks sit inside methods that need a live NIXL agent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from kvspec.connector import ConsumerRankPlan
from kvspec.core._errors import ParallelismError
from kvspec.integrations._vllm_versions import nixl_mamba_remote_pairs
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, RankCopy, SubBlock, get_owned_units

__all__ = ["TpAuditReport", "TpDraw", "TpFinding", "audit_tp_pairs", "generate_tp_draws", "plan_nixl_consumer_rank"]

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1."
_SHIFT = 40  # a region's address: its layer index above this bit, the offset in the layer's page below
_LAYOUT = "VLLM_SSM_CONV_STATE_LAYOUT"
_STRIDE = 1 << 32  # one block per region: the stride is never stepped
_CONV_KINDS = {("x",): "MAMBA1", ("x", "B", "C"): "MAMBA2", ("q", "k", "v"): "GDN_ATTN"}
"""Conv sub-block names -> vLLM's ``MambaAttentionBackendEnum`` member (KDA runs as vLLM's GDN backend)."""


@attrs.frozen
class _Region:
    """One vLLM region of the suite's pages: where it starts (layer, offset in the page) on each side, and its sizes."""

    layer: int
    consumer_offset: int
    producer_offset: int
    consumer_len: int
    producer_len: int
    mla: bool = False


def _tensor_bytes(tensor: PageTensor, tp: int, rank: int) -> int:
    units = 0
    for block in tensor.sub_blocks:
        start, end = get_owned_units(block, tp_size=tp, tp_rank=rank)
        units += (end - start) * block.width
    return tensor.rows * units * tensor.element_bytes


def _is_attention(page: CanonicalPage) -> bool:
    return all(t.token_rows for t in page.tensors)


def _is_mla(page: CanonicalPage) -> bool:
    return len(page.tensors) == 1 and all(b.replicated for b in page.tensors[0].sub_blocks)


def _kv_heads(pages: Sequence[CanonicalPage]) -> int | None:
    heads = {t.sub_blocks[0].extent for p in pages if _is_attention(p) and not _is_mla(p) for t in p.tensors}
    for page in pages:
        if _is_attention(page) and not _is_mla(page) and any(len(t.sub_blocks) != 1 for t in page.tensors):
            raise NotImplementedError("vLLM's NIXL splits an attention page on one axis of KV heads only")
    if len(heads) > 1:
        raise NotImplementedError(
            f"vLLM's TransferTopology holds one total_num_kv_heads per engine; the case's layers have {sorted(heads)}"
        )
    return heads.pop() if heads else None


def _refusals(pages: Sequence[CanonicalPage], *, push: bool, producer_tp: int, consumer_tp: int, pp: int) -> None:
    """vLLM's worker refusals for this pair, by its own conditions and words (NotImplementedError: skipped)."""
    has_state = any(not _is_attention(p) for p in pages)
    hybrid = has_state or len({_is_mla(p) for p in pages if _is_attention(p)}) > 1
    if pp > 1 and hybrid and not push:
        raise NotImplementedError(
            "vLLM's NIXL pull worker refuses PP > 1 with hybrid layouts: 'NixlConnector (pull) does not support "
            "pipeline_parallel_size > 1 with hybrid KV cache layouts (HMA); use NixlPushConnector for PP + HMA.'"
        )
    if pp > 1 and has_state:
        raise NotImplementedError(
            "vLLM's NIXL worker refuses PP > 1 with Mamba: 'NixlPushConnector does not support "
            "pipeline_parallel_size > 1 with Mamba/SSM hybrid KV cache layouts yet.'"
        )
    heads = _kv_heads(pages)
    mla = all(_is_mla(p) for p in pages if _is_attention(p))
    if heads is not None and producer_tp > consumer_tp and producer_tp > heads and not has_state:
        raise NotImplementedError(
            f"vLLM's NIXL worker refuses P TP > D TP when P replicates KV heads (P TP {producer_tp} > "
            f"{heads} KV heads): 'num_kv_heads > tp_size with P_TP > D_TP not supported for non-mamba' "
            "(an assert in _validate_remote_agent_handshake)"
        )
    if producer_tp == consumer_tp or heads is None or mla:
        return
    replicated = producer_tp > heads  # vLLM's TransferTopology.is_kv_replicated: no head slicing
    layout = _import("vllm.v1.kv_cache_layout").KVCacheLayout
    for page in pages:
        if not _is_attention(page) or _is_mla(page):
            continue
        for tensor in page.tensors:
            # vLLM's NVFP4 refusal: a page of heads then scales is not sliceable by heads.
            if tensor.order is PageOrder.OPAQUE and max(1, heads // consumer_tp) != max(1, heads // producer_tp):
                raise ParallelismError(
                    f"{tensor.name}.order: vLLM refuses to re-shard an 'opaque' page: 'NIXL KV-head re-sharding is "
                    f"not supported for NVFP4 KV cache (local TP {consumer_tp}, remote TP {producer_tp})' (PAR-5)"
                )
            name = "LBHNC" if tensor.order is PageOrder.HND else "LBNHC"
            if not replicated and not layout[name].is_block_contiguous:
                raise NotImplementedError(
                    f"vLLM's NIXL slices heads only in block-contiguous pages; {tensor.name} is "
                    f"{tensor.order.value} ({name}): 'Heterogeneous TP head-dimension splitting requires contiguous "
                    "heads. Use a block-contiguous layout (e.g. LBHNC) on the prefill side.'"
                )


def _import(module: str) -> Any:
    from kvspec.integrations.vllm import import_vllm

    return import_vllm(module)


def _conv_split(page: CanonicalPage, tp: int, rank: int) -> Any:
    """vLLM's ``derive_mamba_conv_split`` for this rank's state page, from a vLLM MambaSpec of its local shapes."""
    torch = _import("torch")
    interface = _import("vllm.v1.kv_cache_interface")
    registry = _import("vllm.v1.attention.backends.registry")
    utils = _import(_V1 + "ssm_conv_transfer_utils")
    if len(page.tensors) != 2 or len(page.tensors[1].sub_blocks) != 1:
        raise NotImplementedError("vLLM's NIXL moves a state page as a conv state and one temporal state")
    conv, ssm = page.tensors
    names = tuple(b.name for b in conv.sub_blocks)
    if names not in _CONV_KINDS:
        raise NotImplementedError(
            f"vLLM's NIXL conv split knows [x], [x, B, C] and [q, k, v] sub-projections, got {list(names)}"
        )
    kind = _CONV_KINDS[names]
    for block in conv.sub_blocks:
        # What vLLM's layers build: Mamba2 replicates B/C only for n_groups == 1 (mamba_mixer2.py); GDN shards
        # key_dim and value_dim by TP (qwen_gdn_linear_attn.py); any other replication is no vLLM layout.
        if block.extent % tp and not (kind == "MAMBA2" and block.name in ("B", "C") and block.extent == 1):
            raise NotImplementedError(
                f"vLLM's {kind} layer at TP {tp} shards {block.name} by TP and builds no layout with "
                f"{block.extent} {block.name} units replicated across ranks"
            )
    if conv.order is not PageOrder.HND:
        raise NotImplementedError("vLLM's NIXL conv split needs the DS conv layout (dim, state_len), got SD")
    dtypes = {1: torch.int8, 2: torch.float16, 4: torch.float32}
    if conv.element_bytes not in dtypes:
        raise NotImplementedError(f"conv element of {conv.element_bytes} bytes has no torch dtype")
    start, end = get_owned_units(ssm.sub_blocks[0], tp_size=tp, tp_rank=rank)
    width = conv.sub_blocks[-1].width  # x's head_dim (Mamba2), V's head_v_dim (GDN)
    per_width, rest = divmod(ssm.element_bytes, width)
    size = next((s for s in (4, 2, 1) if not rest and per_width % s == 0), None)
    if size is None:
        raise NotImplementedError(f"temporal state of {ssm.element_bytes} bytes per head is not a vLLM shape")
    channels = sum(
        (e - s) * b.width for b in conv.sub_blocks for s, e in [get_owned_units(b, tp_size=tp, tp_rank=rank)]
    )
    temporal = (end - start, width) if kind == "MAMBA2" else (end - start, width, per_width // size)
    if kind == "MAMBA1":
        temporal = (channels, per_width // size)
    spec = interface.MambaSpec(
        block_size=1,
        shapes=((channels, conv.rows), temporal),
        dtypes=(dtypes[conv.element_bytes], dtypes[size]),
        mamba_type=getattr(registry.MambaAttentionBackendEnum, kind),
    )
    # vLLM's NIXL worker asserts the DS conv layout at construction; the suite's conv pages are DS. Set for this
    # call only: other vLLM code in the process keeps its own layout.
    before = os.environ.get(_LAYOUT)
    os.environ[_LAYOUT] = "DS"
    try:
        return utils.derive_mamba_conv_split(spec, tp)
    except AssertionError as exc:
        raise NotImplementedError(f"vLLM's derive_mamba_conv_split refuses the page: {exc}") from None
    finally:
        if before is None:
            del os.environ[_LAYOUT]
        else:
            os.environ[_LAYOUT] = before


def _worker(topology: Any, group_types: tuple[Any, ...], attention: list[_Region], conv: Any, rank: int) -> Any:
    """A NIXL worker built without its constructor, holding only what the descriptor builders read."""
    base = _import(_V1 + "nixl.base_worker")
    stand_in = type("NixlWorkerStandIn", (base.NixlBaseConnectorWorker,), {"__del__": lambda self: None})
    worker: Any = object.__new__(stand_in)
    worker.transfer_topo = topology
    worker.tp_rank = rank
    worker.use_mla = topology.is_mla
    worker.device_id = 0
    worker._group_spec_types = group_types
    worker._transfer_layer_region_indices = []
    worker._region_is_mla = [r.mla for r in attention]
    worker.block_len_per_layer = [r.consumer_len for r in attention]
    worker.block_stride_per_layer = [_STRIDE] * (len(attention) + 64)
    worker.region_num_blocks = [1] * len(attention)
    worker.num_regions = len(attention)
    worker.draft_tp_mappings = {}
    worker._head_sharded_draft_regions = set()
    worker._conv_decomp = conv
    worker._mamba_ssm_size = conv.ssm_sizes if conv is not None else (0, 0)
    worker._logical_num_blocks = 1
    worker._physical_blocks_per_logical_kv_block = 1
    worker._ssm_region_indices = []
    worker._ple_region_index = None
    return worker


def _address(layer: int, offset: int) -> int:
    return (layer << _SHIFT) + offset


def _copies(local: Any, remote: Any, producer_rank: int, what: str) -> list[tuple[int, RankCopy]]:
    """Each (local, remote) descriptor pair, NIXL's pairing by position, as (layer, RankCopy)."""
    if len(local) != len(remote):
        raise ParallelismError(f"vLLM {what}: {len(local)} local descriptors against {len(remote)} remote ones")
    found = []
    for row_local, row_remote in zip(local.tolist(), remote.tolist(), strict=True):
        (c_addr, c_len, _, _, c_count), (p_addr, p_len, _, _, p_count) = row_local, row_remote
        layer, p_layer = c_addr >> _SHIFT, p_addr >> _SHIFT
        if c_len != p_len or c_count != 1 or p_count != 1 or layer != p_layer:
            raise ParallelismError(
                f"vLLM {what}: reads {p_len} bytes of layer {p_layer} into {c_len} bytes of layer {layer} "
                "(NIXL refuses descriptors of different lengths)"
            )
        copy = RankCopy(
            producer_rank=producer_rank,
            consumer_rank=0,
            producer_offset=p_addr - (p_layer << _SHIFT),
            consumer_offset=c_addr - (layer << _SHIFT),
            nbytes=c_len,
        )
        found.append((layer, copy))
    return found


def plan_nixl_consumer_rank(
    pages: Sequence[CanonicalPage],
    *,
    producer_tp: int,
    consumer_tp: int,
    consumer_rank: int,
    consumer_dcp: int = 1,
    producer_pp: int = 1,
    push: bool = False,
) -> ConsumerRankPlan:
    """What vLLM's NIXL pull worker (0.33 or 0.34) reads into consumer rank ``consumer_rank``, and whom it notifies.

    Raises :class:`NotImplementedError` naming what vLLM does not support
    (the suite skips the case) and :class:`ParallelismError` for a layout
    vLLM refuses by name (PAR-5).
    """
    if push:
        raise NotImplementedError("the vllm:nixl-push adapter does not run the push worker's per-rank writes yet")
    if consumer_dcp > 1:
        raise NotImplementedError(
            "vLLM's NIXL keeps DCP ranks inside TP (dcp_size 1 or tp_size, TransferTopology.dcp_rank) and maps a "
            "DCP consumer of a producer without DCP for no page kind"
        )
    _refusals(pages, push=push, producer_tp=producer_tp, consumer_tp=consumer_tp, pp=producer_pp)
    heads = _kv_heads(pages)
    attention_pages = [p for p in pages if _is_attention(p)]
    mla = bool(attention_pages) and all(_is_mla(p) for p in attention_pages)
    has_state = len(attention_pages) != len(pages)
    interface = _import("vllm.v1.kv_cache_interface")
    mapping = _import(_V1 + "nixl.tp_mapping")
    topo_module = _import("vllm.distributed.kv_transfer.kv_connector.utils")
    # vLLM's hybrid models always hold an attention group; its descriptor builders look for one.
    group_types = (interface.MLAAttentionSpec if mla else interface.FullAttentionSpec,) + (
        (interface.MambaSpec,) if has_state else ()
    )
    topology = topo_module.TransferTopology(
        tp_rank=consumer_rank,
        tp_size=consumer_tp,
        block_size=1,
        engine_id="kvspec-decode",
        is_mla=mla,
        is_mamba=has_state,
        total_num_kv_heads=heads or max(producer_tp, consumer_tp),
        attn_backends=[],
    )
    plan = mapping.compute_tp_mapping(topology, producer_tp, group_types)
    tp_ratio = topology.tp_ratio(producer_tp)

    attention: list[_Region] = []
    state_layers: list[int] = []
    for index, page in enumerate(pages):
        if not _is_attention(page):
            state_layers.append(index)
            continue
        c_at = p_at = 0
        for tensor in page.tensors:
            c_len, p_len = _tensor_bytes(tensor, consumer_tp, consumer_rank), _tensor_bytes(tensor, producer_tp, 0)
            attention.append(_Region(index, c_at, p_at, c_len, p_len, mla=_is_mla(page)))
            c_at, p_at = c_at + c_len, p_at + p_len
    conv = producer_conv = None
    if state_layers:
        kinds = {tuple(b.name for b in pages[i].tensors[0].sub_blocks) for i in state_layers}
        if len(kinds) > 1:
            raise NotImplementedError(f"vLLM's NIXL worker holds one conv split per engine; the case has {kinds}")
        conv = _conv_split(pages[state_layers[0]], consumer_tp, consumer_rank)
        producer_conv = _conv_split(pages[state_layers[0]], producer_tp, 0)
    worker = _worker(topology, group_types, attention, conv, consumer_rank)
    np = _import("numpy")
    empty = np.zeros((0, 5), dtype=np.uint64)

    local_fa = remote_fa = local_ssm = remote_ssm = empty
    if attention:
        local_fa = worker._build_fa_local([_address(r.layer, r.consumer_offset) for r in attention], 1)
        meta = _meta([_address(r.layer, r.producer_offset) for r in attention], (0, 0))
        remote_fa = worker._build_fa_remote(plan, meta, 1)
    if state_layers and producer_conv is not None:
        local_ssm = worker._build_mamba_local([_address(i, 0) for i in state_layers])
        meta = _meta([_address(i, 0) for i in state_layers], producer_conv.ssm_sizes)
        info = topo_module.EngineTransferInfo(
            remote_tp_size=producer_tp,
            remote_block_len=1,
            remote_block_size=1,
            remote_physical_blocks_per_logical=1,
        )
        remote_ssm = worker._build_mamba_remote(
            meta, tp_ratio, info, *nixl_mamba_remote_pairs(_import(_V1 + "nixl.base_worker"), len(state_layers))
        )
    local = np.concatenate([local_fa, local_ssm])
    split = worker._needs_split_local_xfer_handles(tp_ratio, plan)
    handles = (
        list(worker._build_local_splits_from_plan(plan, local, len(local_fa), 1))
        if split
        else [local] * len(plan.all_source_ranks)
    )
    found: list[tuple[int, RankCopy]] = []
    for source, handle in zip(plan.all_source_ranks, handles, strict=True):
        reads_fa = source in plan.source_ranks_per_group[0]
        reads_ssm = has_state and source in plan.source_ranks_per_group[1]
        if attention and reads_fa:
            found += _copies(handle[: len(local_fa)], remote_fa, source, "attention read")
        if state_layers and reads_ssm:
            found += _copies(handle[len(local_fa) :], remote_ssm, source, "state read")
    copies: list[list[RankCopy]] = [[] for _ in pages]
    for layer, copy in found:
        copies[layer].append(attrs.evolve(copy, consumer_rank=consumer_rank))
    notified = set(plan.all_source_ranks)
    if mla and not has_state and tp_ratio < 0 and len(plan.all_source_ranks) == 1:
        # The pull worker notifies the remote ranks it does not read, so that they free (pull_worker.py).
        notified |= set(topology.handshake_target_ranks(producer_tp))
    # The count travels in every notification ("request_id:count", pull_worker.py): the same for each rank.
    ranks = sorted(notified)
    return ConsumerRankPlan(copies=copies, notified=ranks, completion_counts=[plan.local_consumers] * len(ranks))


def _meta(bases: list[int], ssm_sizes: tuple[int, int]) -> Any:
    """The fields of vLLM's ``NixlAgentMetadata`` the remote descriptor builders read, for one block per region."""
    metadata = _import(_V1 + "nixl.metadata")
    return metadata.NixlAgentMetadata(
        engine_id="kvspec-prefill",
        agent_metadata=b"",
        kv_caches_base_addr=bases,
        device_id=0,
        num_blocks=1,
        block_lens=[0] * len(bases),
        block_strides=[_STRIDE] * len(bases),
        kv_cache_layout="LBHNC",
        block_size=1,
        ssm_sizes=ssm_sizes,
        attn_backend_name="kvspec",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[1] * len(bases),
    )


# --------------------------------------------------------------------------- the TP-pair audit (vllm-audit --tp)

_TP_SIZES = (1, 2, 4, 8, 16)
_KINDS = ("attention", "mla", "mamba2", "gdn")


@attrs.frozen(kw_only=True)
class TpDraw:
    """One drawn layer and TP pair: its kind, its sizes (heads, groups), the two TP sizes."""

    index: int
    kind: str
    heads: int
    groups: int
    producer_tp: int
    consumer_tp: int

    def page(self) -> CanonicalPage:
        """The layer's canonical page: attention K then V (HND, 2 tokens), MLA a latent, a state conv then SSM."""
        if self.kind in ("attention", "mla"):
            block = SubBlock(
                name="latent" if self.kind == "mla" else "kv_heads", extent=self.heads, replicated=self.kind == "mla"
            )
            names = ("latent",) if self.kind == "mla" else ("k", "v")
            return CanonicalPage(
                tensors=[
                    PageTensor(name=n, sub_blocks=[block], rows=2, element_bytes=2, token_rows=True) for n in names
                ]
            )
        if self.kind == "mamba2":  # x per head, B and C per group (n_groups), 2 channels each
            conv = [SubBlock(name="x", extent=self.heads, width=2)] + [
                SubBlock(name=n, extent=self.groups, width=2) for n in ("B", "C")
            ]
        else:  # GDN: Q and K per K head (groups), V per V head
            conv = [SubBlock(name=n, extent=self.groups, width=2) for n in ("q", "k")]
            conv.append(SubBlock(name="v", extent=self.heads, width=2))
        ssm = PageTensor(name="ssm", sub_blocks=[SubBlock(name="heads", extent=self.heads)], rows=1, element_bytes=4)
        return CanonicalPage(tensors=[PageTensor(name="conv", sub_blocks=conv, rows=2, element_bytes=1), ssm])


def generate_tp_draws(count: int, seed: int) -> list[TpDraw]:
    """``count`` random draws: a kind, sizes a vLLM layer builds at the larger TP, and two different TP sizes."""
    import random

    rng = random.Random(seed)
    draws: list[TpDraw] = []
    while len(draws) < count:
        kind = rng.choice(_KINDS)
        producer_tp, consumer_tp = rng.sample(_TP_SIZES, 2)
        top = max(producer_tp, consumer_tp)
        if kind == "attention":
            heads, groups = rng.choice((1, 2, 4, 8, 16)), 0
        elif kind == "mla":
            heads, groups = 1, 0
        else:
            heads = top * rng.choice((1, 2))  # SSM / V heads shard by TP in vLLM's layers
            # Mamba-2: n_groups 1 (replicated) or a multiple of TP; GDN: K heads a multiple of TP.
            groups = rng.choice((1, top)) if kind == "mamba2" else top
        draws.append(
            TpDraw(
                index=len(draws),
                kind=kind,
                heads=heads,
                groups=groups,
                producer_tp=producer_tp,
                consumer_tp=consumer_tp,
            )
        )
    return draws


@attrs.frozen(kw_only=True)
class TpFinding:
    """One consumer rank whose bytes vLLM reads from elsewhere than kvspec: the first such byte and its sub-block."""

    draw: TpDraw
    consumer_rank: int
    sub_block: str
    consumer_byte: int
    vllm_source: tuple[int, int] | None
    kvspec_source: tuple[int, int]

    @property
    def deviation(self) -> str:
        """The class: kind and sub-block, e.g. ``mamba2/C``."""
        return f"{self.draw.kind}/{self.sub_block}"


@attrs.frozen(kw_only=True)
class TpAuditReport:
    """What ``kvspec vllm-audit --tp`` found: per kind the draws, refusals and deviating ranks; the findings."""

    seed: int
    draws: dict[str, int]
    refused: dict[str, int]
    ranks: dict[str, int]
    findings: tuple[TpFinding, ...]

    @property
    def classes(self) -> dict[str, list[TpFinding]]:
        """Findings by class, each list smallest reproducer first (fewest ranks, then fewest heads)."""
        out: dict[str, list[TpFinding]] = {}
        for finding in self.findings:
            out.setdefault(finding.deviation, []).append(finding)
        for items in out.values():
            items.sort(key=lambda f: (f.draw.producer_tp + f.draw.consumer_tp, f.draw.heads, f.draw.index))
        return out

    def render(self) -> str:
        """A table per kind, then each class with its smallest reproducer."""
        lines = [
            f"vLLM {_vllm_version()} NIXL TP mapping against kvspec (PAR-1 .. PAR-4), seed {self.seed}",
            "",
            "kind        draws  refused  deviating ranks",
        ]
        for kind in _KINDS:
            counts = (self.draws.get(kind, 0), self.refused.get(kind, 0), self.ranks.get(kind, 0))
            lines.append(f"{kind:<11} {counts[0]:>5}  {counts[1]:>7}  {counts[2]:>15}")
        for name, items in sorted(self.classes.items()):
            first = items[0]
            d = first.draw
            lines += [
                "",
                f"{name}: {len(items)} consumer ranks; smallest: {d.kind} heads={d.heads} groups={d.groups} "
                f"TP{d.producer_tp} -> TP{d.consumer_tp}, consumer rank {first.consumer_rank}:",
                f"  consumer byte {first.consumer_byte} ({first.sub_block}) read from {_at(first.vllm_source)}; "
                f"kvspec reads it from {_at(first.kvspec_source)}",
            ]
        return "\n".join(lines) + "\n"


def _at(source: tuple[int, int] | None) -> str:
    return "nowhere" if source is None else f"producer rank {source[0]} byte {source[1]}"


def _vllm_version() -> str:
    from kvspec.integrations.vllm import installed_vllm_version

    return installed_vllm_version() or "?"


def _sources(copies: Sequence[RankCopy]) -> dict[int, tuple[int, int]]:
    return {c.consumer_offset + i: (c.producer_rank, c.producer_offset + i) for c in copies for i in range(c.nbytes)}


def _sub_block_at(page: CanonicalPage, tp: int, rank: int, offset: int) -> str:
    """The sub-block a rank's page byte holds (HND pages: each sub-block's units are one run per tensor)."""
    at = 0
    for tensor in page.tensors:
        for block in tensor.sub_blocks:
            start, end = get_owned_units(block, tp_size=tp, tp_rank=rank)
            size = (end - start) * block.width * tensor.rows * tensor.element_bytes
            if at <= offset < at + size:
                return f"{tensor.name}.{block.name}" if len(tensor.sub_blocks) > 1 else tensor.name
            at += size
    return "padding"


def audit_tp_pairs(*, requests: int, seed: int) -> TpAuditReport:
    """Draw ``requests`` layers and TP pairs; plan every consumer rank with vLLM's NIXL mapping and with kvspec's.

    A pair vLLM refuses (:class:`NotImplementedError`, or a layout refused by
    name) counts as refused; a rank whose any byte vLLM reads from another
    producer byte than kvspec's ``compute_rank_copies`` is a finding.
    """
    from kvspec.spec.parallel import compute_rank_copies

    draws: dict[str, int] = {}
    refused: dict[str, int] = {}
    ranks: dict[str, int] = {}
    findings: list[TpFinding] = []
    for draw in generate_tp_draws(requests, seed):
        draws[draw.kind] = draws.get(draw.kind, 0) + 1
        page = draw.page()
        p_tp, d_tp = draw.producer_tp, draw.consumer_tp
        try:
            plans = [
                plan_nixl_consumer_rank([page], producer_tp=p_tp, consumer_tp=d_tp, consumer_rank=rank)
                for rank in range(d_tp)
            ]
        except (NotImplementedError, ParallelismError):
            refused[draw.kind] = refused.get(draw.kind, 0) + 1
            continue
        for rank, plan in enumerate(plans):
            got = _sources(plan.copies[0])
            want = _sources(compute_rank_copies(page, producer_tp=p_tp, consumer_tp=d_tp, consumer_rank=rank))
            wrong = sorted(b for b in want if got.get(b) != want[b])
            if not wrong:
                continue
            ranks[draw.kind] = ranks.get(draw.kind, 0) + 1
            byte = wrong[0]
            findings.append(
                TpFinding(
                    draw=draw,
                    consumer_rank=rank,
                    sub_block=_sub_block_at(page, draw.consumer_tp, rank, byte),
                    consumer_byte=byte,
                    vllm_source=got.get(byte),
                    kvspec_source=want[byte],
                )
            )
    return TpAuditReport(seed=seed, draws=draws, refused=refused, ranks=ranks, findings=tuple(findings))
