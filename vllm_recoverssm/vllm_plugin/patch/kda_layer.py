"""vLLM's GLM-5.3 KDA layer: its forward without the capture-break decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def undecorated_forward(layer_cls: Any) -> Callable[..., Any]:
    """``layer_cls._forward`` as written, without the decorator vLLM wraps it in.

    The plugin's layer carries the same decorator on its own ``_forward``; calling the
    decorated parent from it would break the CUDA-graph capture twice.
    """
    forward = layer_cls._forward
    return getattr(forward, "__wrapped__", forward)  # type: ignore[no-any-return]
