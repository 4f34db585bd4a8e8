"""What the harness adds to vLLM, only in processes the harness starts.

vLLM loads every ``vllm.general_plugins`` entry point in every process it starts; this
one (``recoverssm_harness``) registers the random-weights load format only where
:data:`HARNESS_ENV` is ``1`` -- set by the harness's engine environment, so a user's
``vllm serve`` gets nothing from it.
"""

from __future__ import annotations

import os

HARNESS_ENV = "RECOVERSSM_HARNESS"
"""Environment variable that turns the harness's vLLM registrations on (``1``)."""


def wanted() -> bool:
    """Whether this process was started by the harness."""
    return os.environ.get(HARNESS_ENV) == "1"


def register() -> None:
    """Entry point: register ``--load-format recoverssm_random`` when the harness asks."""
    if wanted():
        from .random_loader import register_loader

        register_loader()
