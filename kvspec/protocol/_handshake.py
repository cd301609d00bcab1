"""Handshake compatibility: HS-1's check, defined in :mod:`kvspec.spec.handshake`, as the drivers call it.

Unlike NIXL's compatibility hash, which can only say "mismatch", the check
names each differing field with both values, so an operator can fix the
deployment from the error message alone. It runs once per peer, before any
request is accepted and before the transport metadata is loaded, so a
mismatch never surfaces mid-transfer.
"""

from __future__ import annotations

from kvspec.core._deprecation import keyword_only
from kvspec.spec import handshake
from kvspec.spec.handshake import GROUP_FIELDS, RANK_FIELDS, check_cache_compatibility, get_differences

__all__ = ["GROUP_FIELDS", "RANK_FIELDS", "check_cache_compatibility", "check_compatibility", "get_differences"]

# The definition, with the deprecated positional spelling accepted until 0.3.0 (RENAMES.md).
check_compatibility = keyword_only(0, "producer", "consumer")(handshake.check_compatibility)
