"""``--load-format recoverssm_random``: seeded random weights wide enough to matter.

vLLM's ``dummy`` format fills every weight from U(-1e-3, 1e-3): fine for timing, but a
model that small emits one token over and over, so greedy outputs cannot tell two state
layouts apart. This format fills every floating-point parameter from U(-scale, scale)
with a generator seeded per parameter (its position in ``named_parameters`` order and the
format's seed), so two engines built from the same config -- recovery on and off, or a
``vllm serve`` process and an ``LLM`` -- hold bit-identical weights and produce varied
greedy text. ``--model-loader-extra-config '{"scale": 0.5, "seed": 7}'`` changes them.
Buffers (e.g. the recovery record scratch) are left alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import vllm_engine

LOAD_FORMAT = "recoverssm_random"
DEFAULT_SCALE = 1.0
DEFAULT_SEED = 1234
_OPTIONS = ("scale", "seed")

_DummyLoader: Any = vllm_engine.dummy_model_loader_cls()


def loader_options(extra: dict[str, Any] | None) -> tuple[float, int]:
    """``(scale, seed)`` from ``--model-loader-extra-config``; bad values raise."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"--model-loader-extra-config for load format {LOAD_FORMAT}: unknown key(s) "
            f"{unknown}; expected only {list(_OPTIONS)}"
        )
    scale = extra.get("scale", DEFAULT_SCALE)
    seed = extra.get("seed", DEFAULT_SEED)
    if (isinstance(scale, bool) or not isinstance(scale, int | float)
            or not math.isfinite(scale) or not 0 < scale <= 100):
        raise ValueError(
            f"--model-loader-extra-config 'scale': expected a number in (0, 100], got {scale!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(
            f"--model-loader-extra-config 'seed': expected an integer in [0, 2**63), got "
            f"{seed!r}"
        )
    return float(scale), int(seed)


def fill_random(model: torch.nn.Module, scale: float, seed: int) -> int:
    """Fill every floating-point parameter of ``model``; returns how many were filled."""
    filled = 0
    with torch.no_grad():
        for index, (_, param) in enumerate(model.named_parameters()):
            if not torch.is_floating_point(param) or param.device.type == "meta":
                continue
            gen = torch.Generator(device="cpu").manual_seed(seed + index)
            values = torch.rand(param.shape, generator=gen, dtype=torch.float32)
            param.copy_((values * 2 - 1).mul_(scale).to(param.dtype))
            filled += 1
    return filled


class RandomWeightsLoader(_DummyLoader):  # type: ignore[misc]
    """vLLM's dummy loader with seeded U(-scale, scale) weights (see the module docstring)."""

    def __init__(self, load_config: Any) -> None:
        extra = load_config.model_loader_extra_config
        self.scale, self.seed = loader_options(extra)
        load_config.model_loader_extra_config = {}
        try:
            super().__init__(load_config)
        finally:
            load_config.model_loader_extra_config = extra

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        """Seeded random weights for every floating-point parameter, then what the
        model's own weight loading would derive from them."""
        fill_random(model, self.scale, self.seed)
        vllm_engine.build_weight_derived_buffers(model)


_registered = False


def register_loader() -> None:
    """Make ``--load-format recoverssm_random`` available (idempotent)."""
    global _registered
    if not _registered:
        vllm_engine.register_model_loader(LOAD_FORMAT, RandomWeightsLoader)
        _registered = True
