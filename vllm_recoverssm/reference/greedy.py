"""Plain greedy decoding without speculation: the continuation the speculative runs must match."""

from __future__ import annotations

from collections.abc import Sequence

from .model import HybridModel
from .runtime import SpecRuntime
from .runtime_config import RuntimeConfig


def greedy_continuations(
    model: HybridModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    max_running: int = 8,
    max_model_len: int = 256,
    block_size: int = 16,
) -> list[list[int]]:
    """Greedy continuation of each prompt, one token per step through the prefill path.

    No drafts, no verify, no commit: the reference an :class:`OracleDrafter` proposes and
    the speculative modes reproduce token for token.
    """
    config = RuntimeConfig(
        num_spec=1, max_running=max_running, max_model_len=max_model_len,
        block_size=block_size,
    )
    runtime = SpecRuntime(model, config, drafter=None)
    for prompt in prompts:
        runtime.add_request(prompt, max_new_tokens)
    return [r.generated for r in runtime.run()]
