"""A deliberately wrong implementation of the vector contract: front-trims ALIGN-1 and forgets SW-1's +1.

Every other function is answered by kvspec itself, so ``kvspec vectors check`` must fail exactly the
vectors these two mutants break. Reads one vector per line (``--jsonl``) and answers one line each.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvspec.tools._vectors import answer_vector


def _front_trimmed(producer: list[list[int]], consumer: list[list[int]]) -> dict[str, Any]:
    pairs_p, pairs_c = [], []
    for p, c in zip(producer, consumer, strict=True):
        kept = [(pi, ci) for pi, ci in zip(p[: len(c)], c, strict=True) if 0 not in (pi, ci)]  # front-trim: the bug
        pairs_p.append([pi for pi, _ in kept])
        pairs_c.append([ci for _, ci in kept])
    return {"consumer_block_ids": pairs_c, "producer_block_ids": pairs_p}


def answer(vector: dict[str, Any]) -> dict[str, Any]:
    """kvspec's answer, except for the two mutated functions."""
    result = answer_vector(vector)
    if "output" not in result:
        return result
    data = vector["input"]
    if vector["function"] == "compute_block_pairs" and data["consumer_block_ids"]:
        result["output"] = _front_trimmed(data["producer_block_ids"], data["consumer_block_ids"])
    if vector["function"] == "get_blocks_per_sw":
        result["output"] = [max(0, n - 1) for n in result["output"]]  # cdiv(W, B) without the +1
    return result


if __name__ == "__main__":
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)
