"""Bridges between kvspec and the engines it specifies; each imports its engine lazily.

``kvspec.integrations.vllm`` translates configs to and from vLLM's and runs
vLLM's own connector code under the conformance suite and the audit.
``import kvspec`` never imports an engine.
"""

__all__: list[str] = []
