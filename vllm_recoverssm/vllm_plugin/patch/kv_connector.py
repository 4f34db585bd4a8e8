"""vLLM's KV-connector plumbing the checkpoint connector needs and vLLM does not offer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RECOMPUTE = "recompute"


def recompute_failed_loads(kv_transfer_config: Any) -> None:
    """Make a failed checkpoint load a recompute from zero, never an error.

    vLLM reads ``kv_load_failure_policy`` right after it builds the connector's scheduler
    side; a best-effort cache must not fail a request because a bundle went missing.
    """
    kv_transfer_config.kv_load_failure_policy = RECOMPUTE


def scheduler_block_ids(connector: Any) -> Callable[[str], Any]:
    """A request's block ids as the scheduler's KV-cache manager holds them.

    vLLM hands a connector's scheduler side its manager (``_kv_cache_manager``) but no
    accessor; the lookup is deferred because vLLM sets it after building the connector.
    """
    return lambda req_id: connector._kv_cache_manager.get_block_ids(req_id)
