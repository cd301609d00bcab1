"""The pinned values of the rules: one table that the tests, the test vectors and the docs all read.

A pin is an input a rule's source names and the output that source states.
Each row says where it comes from: a peer's test (docs/explanation/peers.md),
a preset, or a clause or boundary of the rule's spec page. Three readers use it,
none keeps a copy:

- the tests: ``@example``s and ``parametrize`` lists are built from :data:`PINS`
  (tests/test_spec.py, tests/test_reference.py, tests/test_offload.py), and
  tests/test_pins.py checks every row against the reference, the committed
  vectors, the rendered docs and those examples;
- the test vectors: ``kvspec vectors write`` makes one vector per row and
  function (kvspec/tools/_vector_cases.py); its expected output is computed by the
  reference, and tests/test_pins.py checks it equals the row's;
- the docs: ``<!-- kvspec:pins:RULE -->`` renders a rule's rows as a table
  (docs/hooks.py).

Inputs are plain JSON values, by rule and function:

- HMA-1 ``is_hma_required``, ADM-1 and ADM-2 ``check_hybrid_support``, OFF-9
  ``check_offload_support``: ``kinds``, the kinds of a config's groups in order
  (``full``: full attention, B=16; ``sw``: W=32, B=16; ``mla``, ``sw_mla``,
  ``chunked``, ``cross``, ``mamba``, ``unknown`` with fixed shapes), and the
  function's other arguments; ``None`` is a check that passes.
- SW-1 ``get_blocks_per_sw``: ``window`` and ``block_size`` of a config with
  one sliding-window group; the output is the budget list.
- CLIP-1 ``get_exchange_clipped_blocks``: ``block_ids`` and ``budgets``.
- ALIGN-1 and NULL-1 ``compute_block_pairs``: ``producer_block_ids`` and
  ``consumer_block_ids``; the output is the pairs, per side.
- WIN-1 ``get_needed_token_range``, ``get_needed_block_range``: ``window``
  (``None`` for full attention), ``block_size``, ``num_tokens``,
  ``prefix_hit_tokens``; the output is ``{"start", "stop"}``.
- OFF-5 ``get_offload_hit_tokens``: ``groups`` (per group ``block_size`` and
  ``window``, ``None`` for full attention; ``"state": true`` makes the group an
  ``align``-mode Mamba-2 state group), ``present`` (per group and chunk),
  ``num_tokens``, ``local_hit_tokens``, ``blocks_per_chunk`` (``f``; the hash
  block size is 4); the output is the hit in tokens.
- OFF-7 ``map_sub_blocks``: ``first_block_index``, ``num_blocks``,
  ``blocks_per_chunk``; the output is the ``[entry, sub-block]`` list.
  ``get_sub_block_offset``: its own arguments; the output is a byte offset.
- OFF-1 ``get_chunk_sizes``: ``groups`` as for OFF-5, ``blocks_per_chunk``,
  ``hash_block_size``; the output is C_g per group.
- OFF-8 ``get_retained_chunk_starts``: ``groups`` as for OFF-5,
  ``num_computed_tokens``, ``blocks_per_chunk`` (the hash block size is 4);
  the output is the first retained chunk per group.

An expected value is the vector's ``output``, or :class:`Raises` naming the
error class the vector's ``error`` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["PINS", "Pin", "Raises", "pins_for"]


@attrs.frozen
class Raises:
    """The error class a pinned input must raise (the vector's ``error.class``)."""

    error: str


@attrs.frozen(kw_only=True)
class Pin:
    """One pinned input of a rule, the output each function must give for it, and its source."""

    rule: str
    name: str
    inputs: Mapping[str, Any]
    expected: Mapping[str, Any]
    source: str
    note: str = ""

    @property
    def description(self) -> str:
        """The vector's one-line description: what the pin shows, then its source."""
        return f"{self.note}; source: {self.source}" if self.note else f"source: {self.source}"


_MORIIO = "MoRIIO test_hma_blocks_per_sw_two_groups"
_CLIP_PAGE = "CLIP-1 (docs/spec/window-budget-and-clipping.md)"
_WIN_PAGE = "WIN-1 and its boundaries (docs/spec/alignment-and-coverage.md)"
_ALIGN = "ALIGN-1 (docs/spec/alignment-and-coverage.md)"
_NULL = "NULL-1 (docs/spec/alignment-and-coverage.md)"


def _sw1(window: int, block_size: int, budget: int, source: str) -> Pin:
    return Pin(
        rule="SW-1",
        name=f"w{window}_b{block_size}",
        inputs={"window": window, "block_size": block_size},
        expected={"get_blocks_per_sw": [budget]},
        source=source,
        note=f"cdiv({window}, {block_size}) + 1 = {budget}",
    )


def _clip(name: str, ids: list[list[int]], budgets: list[int], out: object, source: str, note: str = "") -> Pin:
    return Pin(
        rule="CLIP-1",
        name=name,
        inputs={"block_ids": ids, "budgets": budgets},
        expected={"get_exchange_clipped_blocks": out},
        source=source,
        note=note,
    )


def _pairs(
    rule: str, name: str, p: list[list[int]], c: list[list[int]], out: object, source: str, note: str = ""
) -> Pin:
    return Pin(
        rule=rule,
        name=name,
        inputs={"producer_block_ids": p, "consumer_block_ids": c},
        expected={"compute_block_pairs": out},
        source=source,
        note=note,
    )


def _both(p: list[list[int]], c: list[list[int]]) -> dict[str, object]:
    return {"producer_block_ids": p, "consumer_block_ids": c}


def _win(
    name: str, window: int | None, t: int, h: int, tokens: tuple[int, int], blocks: tuple[int, int], note: str
) -> Pin:
    return Pin(
        rule="WIN-1",
        name=name,
        inputs={"window": window, "block_size": 16, "num_tokens": t, "prefix_hit_tokens": h},
        expected={
            "get_needed_token_range": {"start": tokens[0], "stop": tokens[1]},
            "get_needed_block_range": {"start": blocks[0], "stop": blocks[1]},
        },
        source=_WIN_PAGE,
        note=note,
    )


_VLLM_HMA = "vLLM's offloading HMA test"
_OFF5 = "OFF-5 (docs/spec/offload.md)"
_FA_SW = ({"block_size": 4, "window": None}, {"block_size": 4, "window": 8})
_B12_B16 = ({"block_size": 12, "window": None}, {"block_size": 16, "window": None})
_FA_STATE = ({"block_size": 4, "window": None}, {"block_size": 4, "window": None, "state": True})
_STATE_OFF5 = "OFF-5 (docs/spec/offload.md); vLLM 0.33 resolve_mamba_align_size (#44599)"


def _off5(
    name: str,
    groups: tuple[Mapping[str, int | bool | None], ...],
    present: list[list[int]],
    tokens: tuple[int, int],
    hit: object,
    source: str,
    note: str = "",
) -> Pin:
    return Pin(
        rule="OFF-5",
        name=name,
        inputs={
            "groups": list(groups),
            "present": [[bool(chunk) for chunk in group] for group in present],
            "num_tokens": tokens[0],
            "local_hit_tokens": tokens[1],
            "blocks_per_chunk": 1,
        },
        expected={"get_offload_hit_tokens": hit},
        source=source,
        note=note,
    )


_OFF1 = "OFF-1 (docs/spec/offload.md)"
_OFF8 = "OFF-8 (docs/spec/offload.md)"


def _off1(
    name: str, groups: tuple[Mapping[str, int | None], ...], f: int, h: int | None, out: object, note: str = ""
) -> Pin:
    inputs = {"groups": list(groups), "blocks_per_chunk": f, "hash_block_size": h}
    return Pin(rule="OFF-1", name=name, inputs=inputs, expected={"get_chunk_sizes": out}, source=_OFF1, note=note)


def _off8(name: str, e: int, f: int, out: list[int], note: str = "") -> Pin:
    inputs = {"groups": list(_FA_SW), "num_computed_tokens": e, "blocks_per_chunk": f}
    return Pin(
        rule="OFF-8", name=name, inputs=inputs, expected={"get_retained_chunk_starts": out}, source=_OFF8, note=note
    )


def _offset(name: str, row: int, sub: int, page: int, f: int, out: object) -> Pin:
    return Pin(
        rule="OFF-7",
        name=name,
        inputs={"chunk_row": row, "sub_block": sub, "page_size": page, "blocks_per_chunk": f},
        expected={"get_sub_block_offset": out},
        source="OFF-7: chunk_row * f * page_size + sub_block * page_size (docs/spec/offload.md)",
    )


def _off7(name: str, first: int, n: int, f: int, out: object, note: str = "") -> Pin:
    return Pin(
        rule="OFF-7",
        name=name,
        inputs={"first_block_index": first, "num_blocks": n, "blocks_per_chunk": f},
        expected={"map_sub_blocks": out},
        source="OFF-7 (docs/spec/offload.md)",
        note=note,
    )


_FLAG = "disable_hybrid_kv_cache_manager"
_HMA = "HMA-1 (docs/spec/hybrid-admission.md)"
_ADM1 = "ADM-1 (docs/spec/hybrid-admission.md)"
_ADM2 = "ADM-2 (docs/spec/hybrid-admission.md)"
_REFUSED = Raises("UnsupportedHybridError")


def _hma(name: str, kinds: list[str], flag: bool, required: bool, note: str) -> Pin:
    inputs = {"kinds": kinds, _FLAG: flag}
    return Pin(rule="HMA-1", name=name, inputs=inputs, expected={"is_hma_required": required}, source=_HMA, note=note)


def _adm(
    rule: str,
    name: str,
    kinds: list[str],
    out: object,
    *,
    mode: str = "read",
    read_only: bool = False,
    flag: bool = False,
    source: str = "",
    note: str = "",
) -> Pin:
    return Pin(
        rule=rule,
        name=name,
        inputs={"kinds": kinds, "mode": mode, "read_only_hma": read_only, _FLAG: flag},
        expected={"check_hybrid_support": out},
        source=source or (_ADM1 if rule == "ADM-1" else _ADM2),
        note=note,
    )


def _off9(name: str, kinds: list[str], out: object, note: str = "") -> Pin:
    return Pin(
        rule="OFF-9",
        name=name,
        inputs={"kinds": kinds},
        expected={"check_offload_support": out},
        source="OFF-9 (docs/spec/offload.md)",
        note=note,
    )


PINS: tuple[Pin, ...] = (
    # HMA-1
    _hma("full_only", ["full"], False, False, "only full attention: HMA not required"),
    _hma("mla_only", ["mla"], False, False, "MLA counts as full attention"),
    _hma("sliding_only", ["sw"], False, True, "a model whose only group is sliding window is hybrid"),
    _hma("full_and_sliding", ["sw", "full"], False, True, "Gemma-like: hybrid"),
    _hma("full_and_sliding_flag_off", ["sw", "full"], True, False, "the flag turns HMA off"),
    _hma("sliding_mla", ["full", "sw_mla"], False, True, "SW-MLA is not full attention"),
    _hma("mamba_hybrid", ["full", "mamba"], False, True, "Mamba is not full attention"),
    # ADM-1
    _adm("ADM-1", "full_and_sliding", ["full", "sw"], None, note="admitted"),
    _adm("ADM-1", "mla_and_sliding_mla", ["mla", "sw_mla"], None, note="admitted"),
    _adm(
        "ADM-1",
        "chunked_local",
        ["full", "chunked"],
        None,
        source="MoRIIO test_non_sliding_window_hybrid_is_rejected (refused before CACHE-1)",
        note="admitted under HMA since CACHE-1: its window stops at a chunk boundary",
    ),
    _adm("ADM-1", "chunked_local_flag", ["full", "chunked"], None, flag=True, note="flag: admitted"),
    _adm("ADM-1", "cross_attention", ["sw", "cross"], _REFUSED, note="refused under HMA"),
    _adm("ADM-1", "unknown_kind", ["sw", "unknown"], _REFUSED, note="unknown kinds fail closed"),
    _adm(
        "ADM-1",
        "mamba",
        ["full", "mamba"],
        None,
        source="vLLM 0.33 NIXL: Mamba2 state transferred (#36687; nixl/base_scheduler.py clip_ssm_state_blocks)",
        note="a Mamba-2 state group is admitted under HMA (STATE-1 .. STATE-5)",
    ),
    _adm(
        "ADM-1",
        "mamba_flag",
        ["full", "mamba"],
        _REFUSED,
        flag=True,
        source="vLLM: state groups need the hybrid KV-cache manager (per-group block tables)",
        note="state without the hybrid manager is refused",
    ),
    _adm("ADM-1", "full_only_chunked_free", ["full"], None, note="no HMA: nothing to refuse"),
    # ADM-2
    _adm("ADM-2", "read_hma", ["full", "sw"], None),
    _adm("ADM-2", "write_hma", ["full", "sw"], None, mode="write", note="WRITE is specified under HMA"),
    _adm("ADM-2", "read_only_connector_read", ["full", "sw"], None, read_only=True),
    _adm(
        "ADM-2",
        "read_only_connector_write",
        ["full", "sw"],
        _REFUSED,
        mode="write",
        read_only=True,
        source="MoRIIO test_hybrid_write_mode_rejected",
        note="MoRIIO's policy: WRITE with HMA refused",
    ),
    _adm("ADM-2", "read_only_connector_write_flag", ["full", "sw"], None, mode="write", read_only=True, flag=True),
    _adm("ADM-2", "read_only_connector_write_no_hma", ["full"], None, mode="write", read_only=True),
    _adm("ADM-2", "bad_mode", ["full", "sw"], Raises("ConfigError"), mode="push", note="not a TransferMode value"),
    # SW-1: the union of the values the tests, the vectors and the docs pinned before (4, 6 and 7 of them).
    _sw1(32, 16, 3, _MORIIO),
    _sw1(128, 16, 9, "Mooncake store test; the GPT-OSS presets"),
    _sw1(2048, 16, 129, "NIXL test_sw_sizes ([0, 129] with a full-attention group)"),
    _sw1(1024, 16, 65, "Gemma 3 27B preset (kvspec.presets)"),
    _sw1(16, 16, 2, "SW-1 boundary: a window of one block still gets the + 1"),
    _sw1(17, 16, 3, "SW-1 boundary: one token past a block"),
    _sw1(1, 16, 2, "SW-1 boundary: the smallest window"),
    # CLIP-1
    _clip(
        "moriio_example",
        [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]],
        [0, 3],
        [[10, 11, 12, 13, 14], [22, 23, 24]],
        "MoRIIO get_exchange_clipped_blocks test",
        "FA(B=16) + SW(W=32, B=16), budgets (0, 3)",
    ),
    _clip(
        "no_budget_identity",
        [[1, 2, 3], [4, 5]],
        [0, 0],
        [[1, 2, 3], [4, 5]],
        "CLIP-1: identity when no group has a budget",
    ),
    _clip("keep_last_n", [[1, 2, 3, 4, 5], [6, 7, 8, 9]], [0, 3], [[1, 2, 3, 4, 5], [7, 8, 9]], _CLIP_PAGE),
    _clip("shorter_than_budget", [[1, 2], [3]], [0, 3], [[1, 2], [3]], "CLIP-1: all kept when shorter than the budget"),
    _clip("zero_groups_stay_zero", [], [0, 3], [], "CLIP-1: a full prefix hit stays zero groups"),
    _clip(
        "zero_budget_is_not_minus_zero",
        [[1, 2, 3], [4, 5, 6]],
        [2, 0],
        [[2, 3], [4, 5, 6]],
        _CLIP_PAGE,
        "budget 0 keeps the whole group (the ids[-0:] pitfall)",
    ),
    _clip("empty_group", [[], [1, 2]], [3, 0], [[], [1, 2]], _CLIP_PAGE),
    _clip("group_count_mismatch", [[1], [2], [3]], [0, 3], Raises("GroupCountError"), _CLIP_PAGE),
    _clip("negative_budget", [[1, 2], [3]], [0, -1], Raises("ConfigError"), _CLIP_PAGE),
    # ALIGN-1 and NULL-1
    _pairs(
        "ALIGN-1",
        "tail_alignment",
        [[1, 2, 3, 4], [5, 6, 7]],
        [[11, 12], [13, 14, 15]],
        _both([[3, 4], [5, 6, 7]], [[11, 12], [13, 14, 15]]),
        _ALIGN,
        "C's i-th id pairs with P's id at len(P) - len(C) + i; never front-trim",
    ),
    _pairs("ALIGN-1", "equal_lengths", [[1, 2], [3]], [[4, 5], [6]], _both([[1, 2], [3]], [[4, 5], [6]]), _ALIGN),
    _pairs("ALIGN-1", "consumer_longer", [[1, 2], [3]], [[4, 5, 6], [7]], Raises("BlockAlignmentError"), _ALIGN),
    _pairs("ALIGN-1", "group_count_mismatch", [[1, 2], [3]], [[4]], Raises("GroupCountError"), _ALIGN),
    _pairs("ALIGN-1", "zero_consumer_groups", [[1, 2], [3]], [], _both([], []), _ALIGN, "full prefix hit"),
    _pairs("ALIGN-1", "empty_consumer_group", [[1, 2], [3]], [[], [9]], _both([[], [3]], [[], [9]]), _ALIGN),
    _pairs(
        "NULL-1",
        "pruned_producer_ids_dropped",
        [[0, 0, 3, 4]],
        [[11, 12, 13]],
        _both([[3, 4]], [[12, 13]]),
        _NULL,
        "a pair with a null producer side is dropped",
    ),
    _pairs("NULL-1", "null_consumer_id_dropped", [[1, 2, 3]], [[0, 12, 13]], _both([[2, 3]], [[12, 13]]), _NULL),
    _pairs("NULL-1", "all_null", [[0, 0], [5]], [[0, 7], [8]], _both([[], [5]], [[], [8]]), _NULL),
    # WIN-1: W=32, B=16 unless named; both boundaries the spec page names, each at two T.
    _win("t_minus_w_plus_1_on_boundary", 32, 47, 0, (16, 47), (1, 3), "W=32 B=16 T=47: (T-W+1) % B == 0"),
    _win("t_minus_w_plus_2_on_boundary", 32, 46, 0, (15, 46), (0, 3), "W=32 B=16 T=46: (T-W+2) % B == 0"),
    _win("t63_w_plus_1_on_boundary", 32, 63, 0, (32, 63), (2, 4), "W=32 B=16 T=63: (T-W+1) % B == 0"),
    _win("t62_w_plus_2_on_boundary", 32, 62, 0, (31, 62), (1, 4), "W=32 B=16 T=62: (T-W+2) % B == 0"),
    _win("t_one_block", 32, 16, 0, (0, 16), (0, 1), "W=32 B=16 T=16"),
    _win("full_attention_from_prefix", None, 64, 32, (32, 64), (2, 4), "full attention: from the prefix hit"),
    _win("prefix_hit_inside_window", 32, 64, 48, (48, 64), (3, 4), "the prefix hit covers the window's start"),
    _win("full_prefix_hit", 32, 64, 64, (64, 64), (0, 0), "nothing needed (an empty block range is 0..0)"),
    _win("window_longer_than_request", 128, 40, 0, (0, 40), (0, 3), "W=128 B=16 T=40"),
    _win("zero_tokens", None, 0, 0, (0, 0), (0, 0), "full attention, T=0"),
    # OFF-1
    _off1("f3_b4", _FA_SW, 3, 4, [12, 12], "C_g = 12 for both groups"),
    _off1("mixed_block_sizes_f1", _B12_B16, 1, 4, [12, 16], "B = (12, 16): chunk 2 ends at 36 and 48"),
    _off1("mixed_block_sizes_f2_refused", _B12_B16, 2, None, Raises("ConfigError"), "f > 1 needs one block size"),
    _off1("hash_size_not_dividing", _B12_B16, 1, 8, Raises("ConfigError"), "h = 8 does not divide 12"),
    _off1("f0_refused", _FA_SW, 0, None, Raises("ConfigError")),
    # OFF-5: f = 1; present chunks per group (1 present, 0 absent).
    _off5("hma_n13", _FA_SW, [[1] * 3, [1] * 3], (13, 0), 12, _VLLM_HMA, "B=4 W=8, all present"),
    _off5("hma_n17_c12", _FA_SW, [[1] * 4, [1] * 4], (17, 12), 4, _VLLM_HMA, "B=4 W=8 after a 12-token GPU hit"),
    _off5(
        "hma_n12_last_token_recomputed",
        _FA_SW,
        [[1] * 3, [1] * 3],
        (12, 0),
        11,
        _OFF5,
        "N is a multiple of C_g, so M = N - 1 (chunk 2 is loaded whole)",
    ),
    _off5("window_gap", _FA_SW, [[1] * 6, [1, 1, 1, 0, 1, 0]], (25, 0), 12, _OFF5, "window chunks {0, 1, 2, 4} of 6"),
    _off5("b12_b16_n48", _B12_B16, [[1] * 4, [1] * 3], (48, 0), 48, _VLLM_HMA, "full attention only, B = (12, 16)"),
    _off5("b12_b16_n85_c48", _B12_B16, [[1] * 7, [1] * 5], (85, 48), 32, _VLLM_HMA, "M = min(85, 7*12, 5*16) = 80"),
    _off5(
        "window_off_the_chunk_grid",
        ({"block_size": 12, "window": None}, {"block_size": 16, "window": 16}),
        [[1, 1, 1], [1, 0, 1]],
        (48, 0),
        16,
        _OFF5,
        "B=12 full, W=16 B=16 window chunks {0, 2}: M=36 needs chunks 1 and 2",
    ),
    _off5("state_n16_rounds_down", _FA_STATE, [[1] * 4, [1] * 4], (16, 0), 12, _STATE_OFF5, "M = 15 rounds to 12"),
    _off5("state_n17_on_the_grid", _FA_STATE, [[1] * 4, [1] * 4], (17, 0), 16, _STATE_OFF5, "N - 1 = 16"),
    _off5("state_chunk_absent", _FA_STATE, [[1] * 4, [1, 1, 0, 0]], (16, 0), 8, _OFF5, "state chunk 1 ends the hit"),
    _off5("state_only_the_last_chunk", _FA_STATE, [[1] * 4, [0, 0, 1, 0]], (16, 8), 4, _OFF5, "C = 8, chunk 2 only"),
    _off5("too_many_keys", _FA_SW, [[1] * 4, [1] * 4], (13, 0), Raises("ConfigError"), _OFF5, "keys past the request"),
    # OFF-7
    _off7(
        "f3_first_4",
        4,
        5,
        3,
        [[0, 1], [0, 2], [1, 0], [1, 1], [1, 2]],
        "skip 4 % 3 = 1, not -4 % 3 = 2: chunks K1, K2 into GPU blocks 4-8",
    ),
    _off7("f3_first_3", 3, 3, 3, [[0, 0], [0, 1], [0, 2]], "the forms agree on a multiple of 3"),
    _off7("f2_first_1", 1, 3, 2, [[0, 1], [1, 0], [1, 1]]),
    _off7("f1", 5, 2, 1, [[0, 0], [1, 0]]),
    _off7("no_blocks", 4, 0, 3, []),
    _off7("negative_first", -1, 2, 3, Raises("ConfigError")),
    _offset("row2_sub1_f3", 2, 1, 256, 3, 1792),
    _offset("row0_sub0", 0, 0, 512, 4, 0),
    _offset("sub_block_past_chunk", 1, 3, 256, 3, Raises("ConfigError")),
    # OFF-8: B=4 W=8
    _off8("hma_e12", 12, 1, [0, 1], "B=4 W=8: full attention from key 0, the window from key 1"),
    _off8("f3_e40", 40, 3, [0, 2]),
    _off8("nothing_computed", 0, 1, [0, 0]),
    # OFF-9
    _off9("full_and_window", ["full", "sw"], None),
    _off9("mla_and_sw_mla", ["mla", "sw_mla"], None, "MLA is full attention, SW-MLA a window"),
    _off9("mamba_refused", ["full", "mamba"], _REFUSED, "cache mode none: no state at a chunk end (decision 161)"),
    _off9("mamba_align_admitted", ["full", "mamba_align"], None, "a state chunk is the state after its end"),
    _off9("chunked_local_refused", ["full", "chunked"], _REFUSED),
    _off9("cross_attention_refused", ["cross"], _REFUSED),
    _off9("unknown_kind_refused", ["unknown"], _REFUSED),
)
"""Every pin, grouped by rule in the order of the spec pages."""


def pins_for(rule: str, function: str | None = None) -> tuple[Pin, ...]:
    """The pins of one rule (and, when given, those with an expected value for ``function``)."""
    return tuple(p for p in PINS if p.rule == rule and (function is None or function in p.expected))
