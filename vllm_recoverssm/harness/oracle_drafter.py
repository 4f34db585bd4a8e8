"""An oracle drafter for vLLM: drafts a known continuation, some of it deliberately wrong.

A tiny model's own MTP head is almost never right, so it cannot show what a state layout
does at 50% or 100% acceptance. This proposer drafts the continuation a reference run
produced, with a set share of drafted tokens corrupted, so a test or demo chooses the
acceptance rate per prompt. It plugs into vLLM's ``custom_class`` speculative method::

    speculative_config={"method": "custom_class", "num_speculative_tokens": 3,
                        "model": "vllm_recoverssm.harness.oracle_drafter.OracleProposer"}
    additional_config={"recoverssm_oracle": {"path": "oracle.json"}}

The file (:func:`write_oracle`) lists sequences ``{"tokens": [...], "corrupt": 0.4}``:
the prompt followed by the reference continuation, and the chance that any one drafted
token is replaced by a wrong one. Corruption is a fixed function of the sequence and the
position, so every engine (recovery on or off, in-process or ``vllm serve``) gets the same
drafts for the same history. A request whose history is not a prefix of a listed sequence
(or with no file, or ``"corrupt": 1``) gets drafts that are all wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_KEY = "recoverssm_oracle"
"""``additional_config`` key: ``{"path": FILE}``."""
CLASS_PATH = "vllm_recoverssm.harness.oracle_drafter.OracleProposer"
MAX_SEQUENCES = 4096
MAX_TOKENS = 1 << 20


class OracleFileError(ValueError):
    """The oracle file is missing, unreadable or malformed."""


def _corrupted(seq_index: int, position: int, rate: float) -> bool:
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(f"{seq_index}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < rate


def write_oracle(path: Path, sequences: Sequence[tuple[Sequence[int], float]]) -> Path:
    """Write an oracle file of ``(prompt + continuation tokens, corruption rate)``."""
    rows = [{"tokens": [int(t) for t in tokens], "corrupt": float(rate)}
            for tokens, rate in sequences]
    path.write_text(json.dumps({"sequences": rows}))
    return path


def read_oracle(path: str | Path) -> list[tuple[list[int], float]]:
    """Read and check an oracle file; raises :class:`OracleFileError` naming the problem."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise OracleFileError(f"oracle file {path}: cannot read it as JSON ({exc})") from None
    rows = data.get("sequences") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) > MAX_SEQUENCES:
        raise OracleFileError(
            f"oracle file {path}: expected {{'sequences': [...]}} with at most "
            f"{MAX_SEQUENCES} entries")
    out: list[tuple[list[int], float]] = []
    for i, row in enumerate(rows):
        tokens = row.get("tokens") if isinstance(row, dict) else None
        rate = row.get("corrupt", 0.0) if isinstance(row, dict) else None
        if (not isinstance(tokens, list) or not 0 < len(tokens) <= MAX_TOKENS
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in tokens)):
            raise OracleFileError(
                f"oracle file {path}: sequences[{i}].tokens must be a non-empty list of "
                "token ids")
        if (isinstance(rate, bool) or not isinstance(rate, int | float)
                or not math.isfinite(rate) or not 0.0 <= rate <= 1.0):
            raise OracleFileError(
                f"oracle file {path}: sequences[{i}].corrupt must be a number in 0..1, got "
                f"{rate!r}")
        out.append((tokens, float(rate)))
    return out


class OracleProposer:
    """vLLM ``custom_class`` proposer drafting from an oracle file (module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        extra = vllm_config.additional_config
        options = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        path = options.get("path") if isinstance(options, dict) else None
        self.sequences = read_oracle(path) if path else []

    def load_model(self, model: Any) -> None:
        """Nothing to load (vLLM's runner calls this on every drafter)."""

    def draft_for(self, history: Sequence[int]) -> list[int]:
        """Up to ``k`` drafted tokens following ``history``."""
        n = len(history)
        room = max(0, min(self.k, self.max_model_len - n - 1))
        if room == 0:
            return []
        for index, (tokens, rate) in enumerate(self.sequences):
            if len(tokens) > n and tokens[:n] == list(history):
                ahead = tokens[n: n + room]
                return [(t + 1) % self.vocab if _corrupted(index, n + j, rate) else t
                        for j, t in enumerate(ahead)]
        last = int(history[-1]) if n else 0
        return [(last + 1 + j) % self.vocab for j in range(room)]

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        """Drafts per batch row; rows that sampled nothing (prompt chunks) get none."""
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            n = int(num_tokens_no_spec[i])
            drafts.append(self.draft_for([int(t) for t in token_ids_cpu[i, :n]]))
        return drafts
