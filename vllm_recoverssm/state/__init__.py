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
from .layout import (
    LAYOUT_NAMES,
    LinearLayerDims,
    PoolLayout,
    TensorSpec,
    blocks_per_request,
    build_layout,
    build_layouts,
    linear_layer_dims,
    state_bytes_per_request,
    state_pool_bytes,
)
from .planner import LayoutPlan, Plan, PlanConfig, format_plan, plan
from .slots import PoolExhaustedError, SlotAllocator

__all__ = [
    "LAYOUT_NAMES",
    "AlignRow",
    "LayoutPlan",
    "LinearLayerDims",
    "Plan",
    "PlanConfig",
    "PoolExhaustedError",
    "PoolLayout",
    "SlotAllocator",
    "TensorSpec",
    "align_source_columns",
    "blocks_per_request",
    "build_align_commit_plan",
    "build_commit_plan",
    "build_layout",
    "build_layouts",
    "format_plan",
    "linear_layer_dims",
    "plan",
    "plan_rows",
    "query_lens_from_start_loc",
    "reference_align_commit_plan",
    "state_bytes_per_request",
    "state_pool_bytes",
]
