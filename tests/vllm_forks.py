"""Forks of vLLM's NIXL connector for the tests of ``--connector vllm:MODULE:CLASS``: one correct, one clipping short.

Public vLLM names only, as a connector author's repository would have.
"""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler


class ShortClipScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    """Keeps one block too few of each sliding-window list: the oldest in-window block is dropped (breaks CLIP-1)."""

    def get_exchange_clipped_blocks(self, block_ids: Any, clip_ssm: bool = True) -> Any:
        clipped = super().get_exchange_clipped_blocks(block_ids, clip_ssm)
        if len(clipped) == 0:
            return clipped
        return [
            list(ids[1:]) if window and ids else list(ids)
            for ids, window in zip(clipped, self.blocks_per_sw, strict=True)
        ]


class ShortClipConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's NIXL pull connector with :class:`ShortClipScheduler`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ShortClipScheduler(vllm_config, self.engine_id, kv_cache_config)
