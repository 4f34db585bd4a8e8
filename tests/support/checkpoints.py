"""Helpers of the request-boundary checkpoint tests: the scenario, the connector's
settings, HTTP with cached-token counts, a damaged bundle, engines side by side.

Scenario (16-token interval checkpoints, 32-token chunks, 8 generated tokens):

* wave 0 (cold, exports): A (65 tokens), B (40), C (12, shorter than one interval);
* wave 1 (restores): A again (exact prompt: vLLM computes its last token, so 64 tokens
  are restored from the prompt bundle), A's first 50 tokens with a new tail (the interval
  bundle at 48), B's follow-up turn (B + its answer + 5 tokens: the response bundle at
  40 + 8 - 1 = 47), C again (11).
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_recoverssm.harness.run_engine import FollowUp
from vllm_recoverssm.vllm_plugin.distributed.kv_connector.index import INDEX_DIR, LAYOUT_FILE

INTERVAL = 16
MAX_TOKENS = 8
S = 3
ENGINE = dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4)
CONNECTOR = "RecoverSSMCheckpointConnector"
LENGTHS = {"A": 65, "B": 40, "C": 12}
TAIL_KEEP = 50
FOLLOW_UP_EXTRA = [3, 4, 5, 6, 7]
WAVE1_RESTORED = [64, 48, 40 + MAX_TOKENS - 1, 11]
"""Tokens each wave-1 prompt restores (A exact, A's new tail, B's follow-up, C exact)."""



def prompts(seed: int = 7) -> dict[str, list[int]]:
    """The scenario's prompts, by name."""
    rng = random.Random(seed)
    return {name: [rng.randrange(1, 511) for _ in range(n)] for name, n in LENGTHS.items()}


def waves(p: dict[str, list[int]]) -> tuple[list[list[int]], list[list[list[int] | FollowUp]]]:
    """Wave 0 and the waves after it, as :class:`EngineRun` takes them."""
    tail = p["A"][:TAIL_KEEP] + [11, 12, 13]
    wave1: list[list[int] | FollowUp] = [p["A"], tail, FollowUp(after=(0, 1),
                                                                extra=FOLLOW_UP_EXTRA), p["C"]]
    return [p["A"], p["B"], p["C"]], [wave1]


def kv_config(backend: str, path: Path | None = None, **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` a user passes for the connector."""
    settings: dict[str, Any] = {"request_boundary_checkpoints": True, "backend": backend,
                                "checkpoint_interval": INTERVAL, **extra}
    if path is not None:
        settings["path"] = str(path)
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": settings}


def ask(url: str, model: str, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy ``/v1/completions``: the token ids and the prompt's cached-token count
    (the server runs with ``--enable-prompt-tokens-details``)."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        reply = json.loads(r.read())
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return [int(t) for t in reply["choices"][0]["token_ids"]], int(cached or 0)


def wait_for_index(path: Path, lengths: Sequence[int], timeout: float = 60.0) -> None:
    """Wait until the disk store lists a bundle of every length in ``lengths``."""
    deadline = time.monotonic() + timeout
    while True:
        names = [f.name for f in (path / INDEX_DIR).glob("*/*") if f.name != LAYOUT_FILE]
        have = {int(n.split("-", 1)[0]) for n in names}
        if set(lengths) <= have:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the store listed {sorted(have)}, not all of {lengths}")
        time.sleep(0.2)


def damage_bundle(path: Path, num_tokens: int) -> list[Path]:
    """Flip one payload byte in every part file of the bundles of ``num_tokens`` tokens."""
    parts = [f for f in path.iterdir() if f"@kind%chunk@ntok%{num_tokens}@" in f.name]
    for part in parts:
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF  # past the fs backend's header, inside the payload
        part.write_bytes(bytes(data))
    return parts
