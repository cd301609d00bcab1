"""Plan reporting: what one request would move for a config, with and without clipping (CLIP-1, PLAN-1)."""

from kvspec.protocol._summary import GroupSummary, PlanSummary, blocks_needed_for, summarize_plan, without_state_groups

__all__ = ["GroupSummary", "PlanSummary", "blocks_needed_for", "summarize_plan", "without_state_groups"]
