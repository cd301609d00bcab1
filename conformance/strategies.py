"""Public hypothesis strategies: small hybrid configs, requests and whole scenarios for the suite or your tests."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from kvspec import KVCacheConfig

from ._scenario import Request, Scenario
from .configs import ConfigLayout, GroupShape, full, make_config, mla, sw, sw_mla

__all__ = ["configs", "group_shapes", "requests", "scenarios"]


@st.composite
def group_shapes(draw: st.DrawFn) -> GroupShape:
    """One admitted group: full attention, MLA, sliding window or SW-MLA, block size 1-8, window 1-20."""
    block = draw(st.sampled_from([1, 2, 4, 8]))
    kind = draw(st.sampled_from(["full", "mla", "sw", "sw_mla"]))
    if kind == "full":
        return full(block)
    if kind == "mla":
        return mla(block)
    window = draw(st.integers(1, 20))
    return sw(window, block) if kind == "sw" else sw_mla(window, block)


@st.composite
def configs(draw: st.DrawFn, *, max_groups: int = 3, num_blocks: int = 400) -> KVCacheConfig:
    """A small admitted config: 1-``max_groups`` groups, 1-2 layers each, any of the four layouts."""
    shapes = draw(st.lists(group_shapes(), min_size=1, max_size=max_groups))
    layouts: list[ConfigLayout] = ["separate", "layers_first", "per_layer", "shared"]
    layout = draw(st.sampled_from(layouts))
    layers = draw(st.lists(st.integers(1, 2), min_size=len(shapes), max_size=len(shapes)))
    return make_config(*shapes, num_blocks=num_blocks, layers=layers, layout=layout)


def _lcm_block(config: KVCacheConfig) -> int:
    from math import lcm

    return lcm(*(g.kv_cache_spec.block_size for g in config.kv_cache_groups))


@st.composite
def requests(draw: st.DrawFn, config: KVCacheConfig, *, max_requests: int = 3, max_tokens: int = 40) -> list[Request]:
    """Requests for ``config``: token counts 1-``max_tokens``, prefix hits in whole blocks of every group (WIN-1)."""
    unit = _lcm_block(config)
    count = draw(st.integers(1, max_requests))
    found = []
    for index in range(count):
        tokens = draw(st.integers(1, max_tokens))
        hit = unit * draw(st.integers(0, tokens // unit))
        found.append(Request(request_id=f"r{index}", num_tokens=tokens, prefix_hit_tokens=hit))
    return found


@st.composite
def scenarios(draw: st.DrawFn, *, modes: Sequence[str] = ("read", "write")) -> Scenario:
    """A whole fault-free scenario: a generated config, mode and requests, sized to fit the pool."""
    config = draw(configs())
    mode = draw(st.sampled_from(list(modes)))
    return Scenario(config=config, mode=mode, requests=draw(requests(config)))
