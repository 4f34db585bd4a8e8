"""``RecoverSSMCheckpointConnector``: request-boundary checkpoints of GLM-5.3 inside vLLM.

A vLLM KV connector (``KVConnectorBase_V1`` with ``SupportsHMA``, so vLLM keeps its hybrid
KV-cache manager) registered by the plugin. vLLM builds one instance next to its scheduler
(:class:`.scheduler.SchedulerSide`) and one per worker (:class:`.worker.WorkerSide`); this
class only routes vLLM's calls to the side it was built for.

Bundles go through :mod:`vllm_recoverssm.checkpoint` into LMCache's storage backends:
``LocalCPUBackend`` for ``backend: "ram"``, the restart-safe ``fs`` backend for ``"disk"``.
Restored tokens are reported to vLLM as external cache hits (host memory or disk), so
``RequestOutput.num_cached_tokens`` counts them and vLLM's
``prompt_tokens_cached_by_source`` metric names the tier; vLLM's own prefix-cache hits stay
separate.
"""

from __future__ import annotations

from typing import Any

from ... import compat
from ...patch.kv_connector import recompute_failed_loads, scheduler_block_ids
from .scheduler import SchedulerSide
from .settings import settings_from_config
from .worker import WorkerSide

_Base: Any = compat.KVConnectorBase_V1
_HMA: Any = compat.SupportsHMA


class RecoverSSMCheckpointConnector(_Base, _HMA):  # type: ignore[misc]
    """Exports and restores atomic request-boundary checkpoints (see the module docstring)."""

    exports_request_boundary_checkpoints = True
    """Read by the plugin's eligibility: recovery state can go through this connector."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = settings_from_config(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == compat.KVConnectorRole.SCHEDULER:
            recompute_failed_loads(vllm_config.kv_transfer_config)
            hit = compat.CacheHitSource
            self._cache_hit_source = hit.DISK if settings.backend == "disk" else hit.HOST
            self._scheduler = SchedulerSide(
                vllm_config, kv_cache_config, settings,
                scheduler_block_ids(self))
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, settings)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped export is a future miss."""
        return False

    @property
    def scheduler_side(self) -> SchedulerSide:
        """The scheduler side (only in the scheduler's instance)."""
        assert self._scheduler is not None, "not the scheduler's connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        """The worker side (only in a worker's instance)."""
        assert self._worker is not None, "not a worker's connector"
        return self._worker

    # -- worker ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Resolve the KV-cache groups to layers and tensors."""
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """The step's first hook: exports from held blocks, state taps."""
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Restores (asynchronous for vLLM: the requests wait outside the batch)."""
        self.worker_side.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: no layer-wise transfer."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save per layer: bundles are whole request states."""
        return

    def wait_for_save(self) -> None:
        """The step's captures (after commit and drafter when speculation is on)."""
        self.worker_side.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Exports done, loads done and failed."""
        return self.worker_side.get_transfer_results(finished_req_ids)

    def build_connector_worker_meta(self) -> Any:
        """Bundles this rank published or failed to store."""
        return self.worker_side.build_connector_worker_meta()

    def shutdown(self) -> None:
        """Drain the writer and release the store (workers); nothing on the scheduler."""
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler -------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """Track an eligible request."""
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """The longest stored prefix past vLLM's own hit, loaded asynchronously."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Plan the restore into the blocks vLLM allocated."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's loads, exports and captures."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Published bundles and finished or failed loads."""
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Export the response bundle; keep the blocks until it is copied."""
        return self.scheduler_side.request_finished(request, block_ids), None

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form (vLLM calls :meth:`request_finished_all_groups` with HMA)."""
        return self.request_finished_all_groups(request, (block_ids,))
