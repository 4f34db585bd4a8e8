"""State management: slot allocation, commit plans, pool layouts and the memory planner."""

from .commit_plan import (
    AlignRow,
    align_source_columns,
    build_align_commit_plan,
    build_commit_plan,
    plan_rows,
    query_lens_from_start_loc,
    reference_align_commit_plan,
)
from .slots import PoolExhaustedError, SlotAllocator

__all__ = [
    "AlignRow",
    "PoolExhaustedError",
    "SlotAllocator",
    "align_source_columns",
    "build_align_commit_plan",
    "build_commit_plan",
    "plan_rows",
    "query_lens_from_start_loc",
    "reference_align_commit_plan",
]
