"""The transformers GLM-5.3-Flash the oracle tests share: made once per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_recoverssm.cli.oracle import AGREE_GAP
from vllm_recoverssm.harness.hf_compare import word_prompts
from vllm_recoverssm.harness.hf_glm53 import TinyFlash, greedy_in_subprocess, make_in_subprocess

NEW_TOKENS = 32
LOGPROB_TOLERANCE = AGREE_GAP
"""Nats. Both sides compute in float32 with different summation orders (transformers'
chunked KDA against the plugin's sequential one, fused against separate mHC steps); the
differences seen are about 5e-6, a twentieth of this."""


def make_flash(root: Path) -> dict[str, Any]:
    """The checkpoint, its prompts and transformers' greedy result on them."""
    shape = TinyFlash()
    model = make_in_subprocess(root / "model", shape)
    prompt_list = word_prompts(shape)
    reference = greedy_in_subprocess(model, prompt_list, NEW_TOKENS, root)
    return {"model": str(model), "root": root, "prompts": prompt_list, "hf": reference}
