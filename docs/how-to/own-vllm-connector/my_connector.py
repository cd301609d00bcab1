"""A trivial fork of vLLM's NIXL connector: its own connector class and its own scheduler class.

The example of docs/how-to/own-vllm-connector.md; kvspec's CI runs the suite on it.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler


class MyScheduler(NixlPullConnectorScheduler):
    """Where the fork's scheduler-side changes would go."""


class MyConnector(NixlPullConnector):
    """vLLM's NIXL pull connector, built with the fork's scheduler."""

    def __init__(self, vllm_config, role, kv_cache_config):  # type: ignore[no-untyped-def]
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = MyScheduler(vllm_config, self.engine_id, kv_cache_config)
