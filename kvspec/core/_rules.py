"""The numbered rules of the specification, in one place: id, title, level and summary."""

from __future__ import annotations

import enum

import attrs

from kvspec.core._errors import UnknownRuleError

__all__ = ["RULES", "Level", "Rule", "get_rule"]


class Level(str, enum.Enum):
    """How binding a rule or a conformance case is (RFC 2119 words)."""

    MUST = "MUST"
    SHOULD = "SHOULD"


@attrs.frozen(kw_only=True)
class Rule:
    """One rule of the specification (docs/spec/); docs and conformance cases cite it by ``id``."""

    id: str
    title: str
    level: Level
    summary: str
    checked_by: str | None = None
    """For a rule no conformance case checks yet: the test module that checks the reference (OFF-*)."""


RULES: tuple[Rule, ...] = (
    Rule(
        id="HMA-1",
        title="When the hybrid manager is required",
        level=Level.MUST,
        summary="HMA is required iff the flag is off and some group is not full attention (MLA counts as full).",
    ),
    Rule(
        id="ADM-1",
        title="Fail closed on group kinds",
        level=Level.MUST,
        summary="Under HMA full attention (incl. MLA), sliding window (incl. SW-MLA) and state groups "
        "(mamba1, mamba2, GDN, KDA) are admitted; other kinds, state with the flag or under pipeline parallelism "
        "raise UnsupportedHybridError naming the group, its layers, kind and remedy.",
    ),
    Rule(
        id="ADM-2",
        title="READ and WRITE under HMA",
        level=Level.MUST,
        summary="Both modes are specified under HMA; a READ-only connector gets the same fail-closed check by keyword.",
    ),
    Rule(
        id="STATE-1",
        title="A transferred state stands where the consumer resumes",
        level=Level.MUST,
        summary="With state groups the transfer carries state_tokens t; t must equal T = num_tokens, else "
        "StatePositionError before any byte moves; a missing t (a 1.1 peer) is refused; prebuilt needs R = 0; "
        "peers of different state profiles are refused at handshake.",
    ),
    Rule(
        id="STATE-2",
        title="Exactly one state slot travels",
        level=Level.MUST,
        summary="Per state group drop min(num_speculative_blocks, len - 1) trailing scratch slots, keep the last: "
        "one slot travels; a null kept slot is a StateSlotError.",
    ),
    Rule(
        id="STATE-3",
        title="State slots pair by slot",
        level=Level.MUST,
        summary="The producer's last slot pairs with the consumer's last; the consumer may list at most one more "
        "slot; an empty list, a null slot or a longer consumer list is a StateSlotError.",
    ),
    Rule(
        id="STATE-4",
        title="Prefix hits end on a state boundary",
        level=Level.MUST,
        summary="In align mode a hit H must be a multiple of the state block size, in none mode 0; per-group hits "
        "reconcile to their minimum; H == T transfers nothing.",
    ),
    Rule(
        id="STATE-5",
        title="State layouts match",
        level=Level.MUST,
        summary="Per state group the state shapes, dtypes, kind, conv layout and padded page size match between "
        "peers, else IncompatiblePeerError naming the field.",
    ),
    Rule(
        id="SW-1",
        title="Blocks a sliding window needs",
        level=Level.MUST,
        summary="blocks_per_sw[g] = cdiv(W_g, B_g) + 1 for sliding-window groups, 0 otherwise.",
    ),
    Rule(
        id="CLIP-1",
        title="Clipping at every exchange point",
        level=Level.MUST,
        summary="Each group with budget n > 0 keeps its last n ids; other groups unchanged; zero groups stay zero; "
        "a group-count mismatch is an error. P clips before advertising, C its uncached suffix.",
    ),
    Rule(
        id="ALIGN-1",
        title="Tail alignment of block pairs",
        level=Level.MUST,
        summary="Per group len(C) <= len(P) or BlockAlignmentError; C's i-th id pairs with P's id at "
        "len(P) - len(C) + i; never front-trim. Lists that say where they end (protocol 1.1) must end at the "
        "same logical block.",
    ),
    Rule(
        id="NULL-1",
        title="The null block never moves",
        level=Level.MUST,
        summary="Block id 0 never appears in a descriptor; a pair with a null side is dropped unless needed (WIN-1).",
    ),
    Rule(
        id="WIN-1",
        title="Window coverage",
        level=Level.MUST,
        summary="Every block covering a needed position (full attention [H, T-1], sliding window "
        "[max(H, T-W+1), T-1]) is real on both sides, or WindowCoverageError before any byte moves. Lists cover "
        "T + R tokens when C recomputes R (vLLM: the last prompt token); a list ending past that is refused.",
    ),
    Rule(
        id="TOK-1",
        title="Token counts travel explicitly",
        level=Level.MUST,
        summary="Token counts are carried in the transfer parameters, never inferred from a clipped group.",
    ),
    Rule(
        id="HS-1",
        title="Handshake compatibility",
        level=Level.MUST,
        summary="Peers agree on major version, mode, HMA flag, group count and every per-group field, or "
        "IncompatiblePeerError lists each difference, at handshake, never mid-transfer.",
    ),
    Rule(
        id="VER-1",
        title="Protocol versioning",
        level=Level.MUST,
        summary="Another major is refused; unknown minor fields ignored; missing or mistyped fields raise "
        "MalformedMessageError; arbitrary bytes raise only kvspec errors.",
    ),
    Rule(
        id="SM-1",
        title="Producer request states",
        level=Level.MUST,
        summary="HELD -> RELEASED | EXPIRED | ABORTED; blocks freed only in a terminal state, never while a "
        "transfer touching them is in flight; late or duplicate signals are ignored.",
    ),
    Rule(
        id="SM-2",
        title="Consumer request states",
        level=Level.MUST,
        summary="ALLOCATED -> LOADING -> LOADED | FAILED; an abort while LOADING drains the transfer before its "
        "blocks may be reused.",
    ),
    Rule(
        id="DONE-1",
        title="Completion means visible",
        level=Level.MUST,
        summary="LOADED means every paired byte is readable on C; a backend never reports completion earlier.",
    ),
    Rule(
        id="FAIL-1",
        title="Failures are typed and bounded",
        level=Level.MUST,
        summary="A failed or partial transfer ends FAILED with the possibly invalid consumer block ids and a typed "
        "reason, never LOADED; every phase has a deadline.",
    ),
    Rule(
        id="REL-1",
        title="Exactly one release",
        level=Level.MUST,
        summary="Every consumer request sends exactly one release to the producer; repeats are no-ops.",
    ),
    Rule(
        id="INT-1",
        title="Integrity (optional): digests before LOADED",
        level=Level.MUST,
        summary="Optional, off by default. When on: the sender digests every block it sends (READ: in the transfer "
        "params; WRITE: in the Completion); the receiver checks them before LOADED; a difference, or no digests, "
        "ends FAILED(integrity), never LOADED.",
    ),
    Rule(
        id="INT-2",
        title="A digest over the canonical page",
        level=Level.MUST,
        summary="Protocol 1.3: the digest is defined over the canonical page's cells (PAR-2), so producer and "
        "consumer of any TP, PP or page size compare sums of what each rank holds; modes full, sampled (seeded "
        "per request) and partial (n bytes a page, size, index and position bound in); XXH3-128 by default, "
        "BLAKE2b-128 negotiable in the handshake.",
        checked_by="tests/test_digest.py",
    ),
    Rule(
        id="INT-3",
        title="Guard: verify before loaded, fail typed, ranks agree",
        level=Level.MUST,
        summary="A guarding consumer runs the rule checks on the block lists used and the INT-2 digest before the "
        "request is loaded; a mismatch fails it with IntegrityMismatchError naming rule, request and first "
        "differing page; the ranks of one consumer drop the union of their verdicts; raise mode (CI) raises.",
        checked_by="tests/test_guard.py",
    ),
    Rule(
        id="PLAN-1",
        title="Byte layout and the plan",
        level=Level.MUST,
        summary="Page of layer l for block b starts at offset + l*layer_stride + b*block_stride; the plan moves "
        "exactly the bytes of the pairs, merging contiguous runs.",
    ),
)

# The offload path (docs/spec/offload.md). The suite's offload scenarios (a GPU pool and a chunk pool under
# the oracle, conformance/cases/offload.py) check the rules a connector's hooks decide; keys (OFF-2) and
# retention (OFF-8) are the chunk pool's, which the suite models itself, so the reference's own tests check them.
_OFFLOAD_TESTS = "tests/test_offload.py"

RULES += (
    Rule(
        id="OFF-1",
        title="Chunk geometry",
        level=Level.MUST,
        summary="C_g = B_g * f tokens per chunk; f > 1 only when every group has one block size; the hash block "
        "size divides every B_g; ConfigError naming the group otherwise.",
    ),
    Rule(
        id="OFF-2",
        title="Offload keys",
        level=Level.MUST,
        summary="Group g has len(hashes) // (C_g / h) keys; key k is the hash at index (k+1)*C_g/h - 1 with g.",
        checked_by=_OFFLOAD_TESTS,
    ),
    Rule(
        id="OFF-3",
        title="Store set",
        level=Level.MUST,
        summary="Chunks [next_g, O // C_g) whose last GPU block is real; sources are their real blocks, the count "
        "never includes a null (#42945); windows are not clipped when storing.",
    ),
    Rule(
        id="OFF-4",
        title="Partial chunks are never present",
        level=Level.MUST,
        summary="A chunk a store writes only in part (leading null sub-blocks) never counts as present for a hit, "
        "so no load reads a sub-block that was never written.",
    ),
    Rule(
        id="OFF-5",
        title="Hit length",
        level=Level.MUST,
        summary="Hit end starts at N (N - 1 with a window or state group), at most keys * C_g; full attention "
        "needs a prefix run, a window the chunks over [max(C, M-W+1), M-1], a state group a present chunk ending "
        "at M; re-check until stable; 0 below one chunk.",
    ),
    Rule(
        id="OFF-6",
        title="Load set",
        level=Level.MUST,
        summary="Per group GPU [L, G) from chunks [L // f, cdiv(T, C_g)), G = cdiv(T, B), L = C // B or "
        "max(C, T-W+1) // B for a window, so G - L <= cdiv(W + B - 1, B) (#48959); a state group one slot at "
        "T / B - 1 with state_tokens = T; destinations are real.",
    ),
    Rule(
        id="OFF-7",
        title="Sub-block map and address",
        level=Level.MUST,
        summary="Block i of a group starting at L pairs with chunk entry (s+i) // f, sub-block (s+i) % f, s = L % f "
        "(never -L % f); sub-block s of chunk row c starts at c*f*page + s*page.",
    ),
    Rule(
        id="OFF-8",
        title="Retention (touch)",
        level=Level.SHOULD,
        summary="A request keeps alive every full-attention key and each window group's keys from "
        "max(0, E - W + 1) // C_g on, E = C + hit at its first lookup.",
        checked_by=_OFFLOAD_TESTS,
    ),
    Rule(
        id="OFF-9",
        title="Offload admits attention groups and aligned state groups",
        level=Level.MUST,
        summary="Full attention (incl. MLA), sliding window (incl. SW-MLA) and align-mode state groups with "
        "f = 1; none-mode state, chunked-local, cross attention and unknown kinds raise UnsupportedHybridError.",
    ),
)

# Many ranks, one canonical page (docs/spec/parallelism.md). Definitions in kvspec/spec/parallel.py; the planner
# and `kvspec plan --producer-tp/--consumer-tp` use them. The PAR-* suite cases (conformance/cases/parallel.py)
# run one agent per rank over the backend under test; tests/test_parallel.py checks the definitions themselves.

RULES += (
    Rule(
        id="PAR-1",
        title="Rank ownership per sub-block",
        level=Level.MUST,
        summary="Per sub-block of E units over T ranks: replicated, all; T divides E, [r*E/T, (r+1)*E/T); E divides "
        "T, unit r*E/T; otherwise ParallelismError naming the sub-block's extent.",
    ),
    Rule(
        id="PAR-2",
        title="Every rank's page is a projection of the canonical page",
        level=Level.MUST,
        summary="The canonical page holds one block of one layer at TP 1; a rank's page holds the same tensors and "
        "sub-blocks in order with its own units, one run per sub-block (hnd) or per row (nhd).",
    ),
    Rule(
        id="PAR-3",
        title="Coverage: each consumer rank's page tiled exactly once",
        level=Level.MUST,
        summary="Each copy reads the very canonical bytes it writes; the copies into a consumer rank tile its "
        "tensors with no gap, no overlap and no byte from padding or another tensor.",
    ),
    Rule(
        id="PAR-4",
        title="One elected source per destination",
        level=Level.MUST,
        summary="One TP size divides the other; consumer rank c faces producer ranks c*P/D .. (P >= D) or c*P/D; "
        "each unit comes from the first of them that holds it.",
    ),
    Rule(
        id="PAR-5",
        title="Layouts that cannot be sliced are refused",
        level=Level.MUST,
        summary="An opaque tensor moves whole only when source and destination ranks own the same units; otherwise "
        "ParallelismError naming the tensor's order, before any byte moves.",
    ),
    Rule(
        id="PAR-6",
        title="Completion count",
        level=Level.MUST,
        summary="Each consumer rank notifies every producer rank it faces, read or not; a producer rank frees after "
        "exactly max(1, D/P) notifications, times the consumer's DCP size.",
    ),
    Rule(
        id="PAR-7",
        title="Layers pair by name; a PP stage owns its band",
        level=Level.MUST,
        summary="Each layer is held by one producer stage; a consumer layer no stage holds, or one held twice, is "
        "refused by name; never paired by position.",
    ),
    Rule(
        id="PAR-8",
        title="DCP token interleaving",
        level=Level.MUST,
        summary="Local token i of DCP rank r of S, interleave I, is canonical token (i // I * S + r) * I + i % I.",
    ),
    Rule(
        id="PAR-9",
        title="The handshake compares the derived byte maps",
        level=Level.MUST,
        summary="When both descriptors carry a parallel layout (protocol 1.3), HS-1 admits unequal TP, PP and DCP "
        "when the byte maps compose, and otherwise refuses naming the first field and rule; without one, equal TP.",
    ),
)

# Every cache accounted for (docs/spec/caches.md). Definitions in kvspec/spec/caches.py; the handshake checks them
# (kvspec/protocol/_handshake.py, check_cache_compatibility); the suite cases: conformance/cases/caches.py.

RULES += (
    Rule(
        id="CACHE-1",
        title="Every cache accounted for",
        level=Level.MUST,
        summary="Every cache a model keeps (attention, MLA, SW-MLA, chunked-local, indexer, state, draft, scratch) "
        "is exchanged by its groups or declared ephemeral (draft and scratch only), on both sides, with equal "
        "declarations; an unknown kind is refused naming the field and the known kinds.",
    ),
)

_BY_ID = {rule.id: rule for rule in RULES}


def get_rule(rule_id: str) -> Rule:
    """The rule with this id; raises :class:`kvspec.UnknownRuleError` (a ``KeyError``) naming the known ids."""
    try:
        return _BY_ID[rule_id]
    except KeyError:
        raise UnknownRuleError(f"unknown rule {rule_id!r}; known: {', '.join(_BY_ID)}") from None
