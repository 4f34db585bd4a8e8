"""Finish the checkpoint exports an offline ``vllm.LLM`` still owes before it exits.

A response bundle is copied out of a finished request's blocks in the engine step after
the request ended (vLLM keeps the blocks for the connector until then). ``vllm serve``
steps on by itself while such requests remain; an offline ``LLM`` whose engine core runs
in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) only steps inside
``generate``, so the responses of the requests that finished in the last step would never
be exported. :func:`flush_checkpoints` takes those steps and waits for the writes of every
rank (each worker process's connector, under tensor parallelism).
"""

from __future__ import annotations

import time
from typing import Any

from ... import compat

MAX_STEPS = 64


def flush_checkpoints(llm: Any, timeout: float = 60.0) -> bool:
    """Step ``llm``'s in-process engine until no ended request waits for an export, then
    wait until every queued bundle is written; True when all of it finished in ``timeout``.

    Call it after the last ``generate`` when the request-boundary checkpoint connector is
    set. An engine core in a process of its own exports by itself: nothing to do (True).
    """
    core = compat.in_process_engine_core(llm)
    if core is None:
        return True
    deadline = time.monotonic() + timeout
    steps = 0
    while compat.engine_has_connector_work(core) and steps < MAX_STEPS:
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        steps += 1
    remaining = max(0.0, deadline - time.monotonic())
    written = all(llm.collective_rpc(writes_finished, args=(remaining,)))
    return written and not compat.engine_has_connector_work(core)


def writes_finished(worker: Any, timeout: float) -> bool:
    """In a worker (``LLM.collective_rpc``): wait up to ``timeout`` seconds until this
    rank's queued bundles are written; True when they are (or no connector runs here)."""
    del worker  # the connector is this process's, one per rank
    writer = getattr(compat.kv_connector_worker(), "writer", None)
    return writer is None or bool(writer.wait_idle(timeout))
