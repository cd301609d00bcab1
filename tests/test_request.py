"""A request's geometry is one value, checked once at construction; no public function takes the clump."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from test_public_api import PUBLIC_MODULES

import kvspec
from kvspec import (
    BlockAlignmentError,
    BlockIds,
    BlockLists,
    ConfigError,
    GroupCountError,
    KVSpecError,
    TransferRequest,
    compute_transfer_pairs,
)
from kvspec.connector import Connector, ReferenceConnector, pair_keywords, pair_with, takes_keywords
from kvspec.presets import get_preset

BOTH_ENDS = {"producer_block_ends", "consumer_block_ends"}


def _callables(module: object) -> Iterator[tuple[str, Callable[..., object]]]:
    """Every public function, and every public method of every public class, a module exports."""
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if inspect.isclass(value):
            for attr, member in vars(value).items():
                if attr.startswith("_") or not callable(member):
                    continue
                yield f"{name}.{attr}", member
        elif callable(value):
            yield name, value


def test_no_public_function_takes_both_end_lists() -> None:
    # The done-when of issue 36, item 5: the ends travel in one value, never as two parameters.
    offenders = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name, value in _callables(module):
            try:
                parameters = inspect.signature(value).parameters
            except (TypeError, ValueError):
                continue  # a builtin or a class without a signature
            if parameters.keys() >= BOTH_ENDS:
                offenders.append(f"{module_name}.{name}")
    assert not offenders
    assert not BOTH_ENDS & inspect.signature(Connector.pair_block_ids).parameters.keys()


def test_the_walk_sees_the_functions_it_judges() -> None:
    # The check above would pass vacuously if it saw nothing: it sees the rules and the seam.
    seen = {name for name, _ in _callables(kvspec)}
    assert {"compute_transfer_pairs", "compute_block_pairs", "check_window_coverage"} <= seen
    assert "ReferenceConnector.pair_block_ids" in {name for name, _ in _callables(kvspec.connector)}


def _request(**changes: object) -> TransferRequest:
    fields: dict[str, object] = {
        "num_tokens": 8,
        "prefix_hit_tokens": 4,
        "producer_block_ids": [[1, 2]],
        "consumer_block_ids": [[3]],
    }
    return TransferRequest(**{**fields, **changes})  # type: ignore[arg-type]


def test_a_request_holds_its_fields_checked_and_converted() -> None:
    request = _request(recomputed_tokens=1, producer_block_ends=[2], consumer_block_ends=(2,))
    assert request.producer_block_ids == BlockIds([[1, 2]])
    assert isinstance(request.consumer_block_ids, BlockIds)
    assert request.producer_block_ends == (2,)
    assert request.listed_tokens == 9
    # A 1.0 peer's request: nothing recomputed, no ends.
    assert (_request().recomputed_tokens, _request().producer_block_ends, _request().consumer_block_ends) == (
        0,
        None,
        None,
    )
    assert isinstance(request, BlockLists)
    assert attrs.evolve(request, recomputed_tokens=0).listed_tokens == 8


@pytest.mark.parametrize(
    ("changes", "error", "named"),
    [
        ({"num_tokens": -1}, ConfigError, "num_tokens"),
        ({"num_tokens": True}, ConfigError, "num_tokens"),
        ({"prefix_hit_tokens": -4}, ConfigError, "prefix_hit_tokens"),
        ({"prefix_hit_tokens": 12}, ConfigError, r"prefix_hit_tokens: expected at most num_tokens=8, got 12"),
        ({"recomputed_tokens": -1}, ConfigError, "recomputed_tokens"),
        ({"producer_block_ids": [[-1]]}, KVSpecError, "-1"),
        ({"producer_block_ends": (-1,)}, ConfigError, r"producer_block_ends\[0\]"),
        ({"consumer_block_ends": (1, 1)}, GroupCountError, "consumer block ids have 1 groups, its block ends 2"),
        ({"producer_block_ends": (1,)}, BlockAlignmentError, "the producer's list holds 2 blocks"),
    ],
)
def test_each_bad_field_is_named_at_construction(
    changes: dict[str, object], error: type[Exception], named: str
) -> None:
    with pytest.raises(error, match=named):
        _request(**changes)


def test_block_lists_check_their_ends_without_token_counts() -> None:
    with pytest.raises(GroupCountError, match="producer block ids have 1 groups, its block ends 0"):
        BlockLists(producer_block_ids=[[1]], consumer_block_ids=[[2]], producer_block_ends=())
    lists = BlockLists(producer_block_ids=[[1, 2]], consumer_block_ids=[[3]])
    assert (lists.producer_block_ends, lists.consumer_block_ends) == (None, None)


def _gpt_oss() -> tuple[kvspec.KVCacheConfig, TransferRequest]:
    config = get_preset("gpt-oss-20b").build_config(num_blocks=64, max_layers_per_group=1)
    budgets = kvspec.get_blocks_per_sw(config)
    producer = kvspec.get_exchange_clipped_blocks([range(1, 14), range(14, 27)], budgets)
    consumer = kvspec.get_exchange_clipped_blocks([range(40, 49), range(49, 58)], budgets)
    request = TransferRequest(
        num_tokens=200, prefix_hit_tokens=64, producer_block_ids=producer, consumer_block_ids=consumer
    )
    return config, request


def test_the_seam_takes_the_request() -> None:
    config, request = _gpt_oss()
    connector = ReferenceConnector()
    assert not takes_keywords(connector)
    assert pair_with(connector, config, request) == compute_transfer_pairs(config, request)


class _KeywordForm(ReferenceConnector):
    """The keyword form of pair_block_ids, before the request value; it records what it was told."""

    def __init__(self) -> None:
        self.told: dict[str, object] = {}

    def pair_block_ids(  # type: ignore[override]
        self, config: kvspec.KVCacheConfig, *, num_tokens: int, prefix_hit_tokens: int, **rest: Any
    ) -> kvspec.BlockPairsLike:
        self.told = {"num_tokens": num_tokens, "prefix_hit_tokens": prefix_hit_tokens, **rest}
        request = TransferRequest(num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens, **rest)
        return super().pair_block_ids(config, request)


def test_a_keyword_form_connector_still_pairs_with_a_deprecation_warning() -> None:
    config, request = _gpt_oss()
    connector = _KeywordForm()
    assert takes_keywords(connector)  # type: ignore[arg-type]
    with pytest.warns(DeprecationWarning, match=r"_KeywordForm\.pair_block_ids.*kvspec 0\.3\.0"):
        pairs = pair_with(connector, config, request)  # type: ignore[arg-type]
    assert pairs == compute_transfer_pairs(config, request)
    # Protocol 1.0's keywords always; 1.1's only where they say something.
    assert connector.told.keys() == {"num_tokens", "prefix_hit_tokens", "producer_block_ids", "consumer_block_ids"}
    ended = attrs.evolve(request, recomputed_tokens=1, consumer_block_ends=(13, 13))
    assert pair_keywords(ended).keys() == connector.told.keys() | {"recomputed_tokens", "consumer_block_ends"}
