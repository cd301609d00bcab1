"""Plan reporting: what one request would move for a config, with and without clipping (CLIP-1, PLAN-1).

:func:`summarize_parallel_plan` does it per consumer rank when the engines' parallelism differs (PAR-1 .. PAR-7).
"""

from kvspec.protocol._summary import (
    GroupSummary,
    ParallelPlanSummary,
    PlanSummary,
    RankRead,
    blocks_needed_for,
    get_stage_bands,
    summarize_parallel_plan,
    summarize_plan,
    without_state_groups,
)

__all__ = [
    "GroupSummary",
    "ParallelPlanSummary",
    "PlanSummary",
    "RankRead",
    "blocks_needed_for",
    "get_stage_bands",
    "summarize_parallel_plan",
    "summarize_plan",
    "without_state_groups",
]
