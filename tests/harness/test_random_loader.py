"""``--load-format recoverssm_random``: options, seeded weights, weight-derived buffers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm


class _FusedDraftLayer(torch.nn.Module):
    """Stands in for a module whose own ``load_weights`` stacks weights into a buffer
    (vLLM's DFlash draft does this with ``_build_fused_kv_buffers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.k_proj = torch.nn.Linear(8, 4, bias=False)
        self.v_proj = torch.nn.Linear(8, 4, bias=False)
        self.fused: torch.Tensor | None = None

    def _build_fused_kv_buffers(self) -> None:
        self.fused = torch.cat([self.k_proj.weight, self.v_proj.weight]).detach().clone()


def _loader(vllm_module: Any, extra: dict[str, Any] | None = None) -> Any:
    from vllm.config import LoadConfig

    from vllm_recoverssm.harness.random_loader import LOAD_FORMAT, RandomWeightsLoader

    return RandomWeightsLoader(LoadConfig(load_format=LOAD_FORMAT,
                                          model_loader_extra_config=extra or {}))


def test_loader_builds_weight_derived_buffers_from_the_filled_weights(vllm_module: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _FusedDraftLayer())
    _loader(vllm_module).load_weights(model, SimpleNamespace())
    draft = model[1]
    assert draft.fused is not None
    expected = torch.cat([draft.k_proj.weight, draft.v_proj.weight])
    assert torch.equal(draft.fused, expected)


def test_loader_weights_are_seeded_and_options_are_checked(vllm_module: Any) -> None:
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    _loader(vllm_module, {"seed": 7}).load_weights(a, SimpleNamespace())
    _loader(vllm_module, {"seed": 7}).load_weights(b, SimpleNamespace())
    assert torch.equal(a.weight, b.weight) and a.weight.abs().max() <= 1.0
    with pytest.raises(ValueError, match="unknown key"):
        _loader(vllm_module, {"sed": 7})
    with pytest.raises(ValueError, match="'scale'"):
        _loader(vllm_module, {"scale": 0})


_LOAD_FORMATS = (
    "import json, vllm.model_executor.model_loader as ml; "
    "from vllm.plugins import load_general_plugins; load_general_plugins(); "
    "print(json.dumps(sorted(ml._LOAD_FORMAT_TO_MODEL_LOADER)))"
)


@pytest.mark.parametrize("asked", [False, True], ids=["vllm-serve", "harness"])
def test_the_random_format_is_registered_only_where_the_harness_asks(
    vllm_module: Any, asked: bool,
) -> None:
    """vLLM loads every plugin entry point in every process; a user's ``vllm serve`` must
    not get the harness's load format, a process the harness starts must."""
    import json
    import os
    import subprocess
    import sys

    from vllm_recoverssm.harness.random_loader import LOAD_FORMAT
    from vllm_recoverssm.harness.vllm_registration import HARNESS_ENV

    env = {k: v for k, v in os.environ.items() if k != HARNESS_ENV}
    if asked:
        env[HARNESS_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", _LOAD_FORMATS], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    formats = json.loads(out.strip().splitlines()[-1])
    assert "dummy" in formats
    assert (LOAD_FORMAT in formats) == asked
