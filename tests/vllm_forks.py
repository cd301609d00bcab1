"""Forks of vLLM's NIXL connector for the tests of ``--connector vllm:MODULE:CLASS``: one correct, one clipping short;
and a worker stand-in for the guard's tests.

Public vLLM names only, as a connector author's repository would have.
"""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
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


class ArrivalConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A worker-side stand-in for a transport that runs on a CPU: it moves nothing and reports as received the
    request ids a test puts in ``arrived`` (the guard's worker checks run on what the test wrote into the pool)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.arrived: set[str] = set()
        self.bound: list[Any] = []

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.bound.append(connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        arrived, self.arrived = self.arrived, set()
        return None, arrived

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None
