"""kvspec's conformance suite on this repository's vLLM connector, in CI (docs/how-to/own-vllm-connector.md)."""

from functools import partial

from kvspec_conformance import BackendSuite

from kvspec.integrations.expectations import load_expected
from kvspec.integrations.vllm import vllm_connector
from kvspec.transport.loopback import LoopbackBackend


class TestMyConnector(BackendSuite):
    backend_factory = LoopbackBackend
    connector_factory = partial(vllm_connector, "my_connector:MyConnector")
    xfail_cases = load_expected("vllm:nixl")  # vLLM's NIXL deviations, each with its reason
    rules = ("CLIP-1", "SW-1")  # kvspec's own CI runs two rules; drop this line to run them all
