"""Drafters: who proposes the ``S`` speculative tokens of each decode step.

* :class:`MTPDrafter` runs the model's MTP head ``S`` times from the hidden state of the
  last computed token (how GLM-5.3 drafts). With random weights it is rarely right, so it
  exercises the reject-most path.
* :class:`OracleDrafter` proposes the model's own greedy continuation (computed beforehand
  without speculation) and replaces each draft token by a wrong one with probability
  ``corruption``: 0 accepts everything, 1 accepts nothing, values in between make every
  accept length ``0..S`` occur. The corruption is a pure function of the request's prompt,
  its position and a seed, so two runs that agree on their outputs see the same drafts.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from .model import HybridModel
from .request import Request


class Drafter(Protocol):
    """Proposes ``num_spec`` draft tokens to follow each request's last sampled token."""

    name: str

    def propose(
        self, model: HybridModel, requests: Sequence[Request], num_spec: int
    ) -> list[list[int]]:
        """One list of ``num_spec`` token ids per request."""
        ...


class MTPDrafter:
    """Drafts with the model's MTP head, applied ``S`` times (greedy)."""

    name = "mtp"

    def propose(
        self, model: HybridModel, requests: Sequence[Request], num_spec: int
    ) -> list[list[int]]:
        """Greedy MTP chain from each request's last hidden state and last token."""
        if not requests:
            return []
        missing = [r.rid for r in requests if r.last_hidden is None]
        if missing:
            raise ValueError(f"argument 'requests': no hidden state yet for requests {missing}")
        hidden = torch.stack([r.last_hidden for r in requests])  # type: ignore[misc]
        token = torch.tensor([r.tokens[-1] for r in requests], device=hidden.device)
        drafted = []
        for _ in range(num_spec):
            hidden = model.mtp_step(hidden, token)
            token = model.logits(hidden).argmax(-1)
            drafted.append(token)
        return torch.stack(drafted, dim=1).tolist()


def expected_acceptance(corruption: float, num_spec: int) -> float:
    """Expected accepted / proposed drafts when each draft is wrong with prob. ``corruption``.

    Drafts are accepted up to the first wrong one, so ``j`` drafts are accepted with
    probability ``q**j`` (``q = 1 - corruption``) for each ``j <= S``.
    """
    q = 1.0 - corruption
    return sum(q**j for j in range(1, num_spec + 1)) / num_spec


def corruption_for_acceptance(acceptance: float, num_spec: int) -> float:
    """The corruption rate whose :func:`expected_acceptance` is ``acceptance`` (bisection)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"argument 'acceptance': expected 0..1, got {acceptance}")
    if not 1 <= num_spec <= 7:
        raise ValueError(f"argument 'num_spec': expected 1..7, got {num_spec}")
    lo, hi = 0.0, 1.0  # expected_acceptance falls as corruption rises
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_acceptance(mid, num_spec) > acceptance:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _prompt_digest(prompt: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()[:16]


class OracleDrafter:
    """Proposes the reference greedy continuation, corrupted at a given rate.

    ``references`` maps a prompt (as a tuple) to its greedy continuation; positions past the
    end of a continuation are drafted as token 0.
    """

    name = "oracle"

    def __init__(
        self,
        references: Mapping[tuple[int, ...], Sequence[int]],
        corruption: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= corruption <= 1.0:
            raise ValueError(f"argument 'corruption': expected 0..1, got {corruption}")
        if vocab_size < 2:
            raise ValueError(f"argument 'vocab_size': expected >= 2, got {vocab_size}")
        self.references = {tuple(k): list(v) for k, v in references.items()}
        self.corruption = corruption
        self.vocab_size = vocab_size
        self.seed = seed

    def propose(
        self, model: HybridModel, requests: Sequence[Request], num_spec: int
    ) -> list[list[int]]:
        """The next ``num_spec`` reference tokens of each request, some corrupted."""
        out = []
        for r in requests:
            key = tuple(r.prompt)
            if key not in self.references:
                raise ValueError(
                    f"argument 'requests': request {r.rid} has a prompt with no reference "
                    "continuation"
                )
            ref = self.references[key]
            g = len(r.generated)  # the draft follows generated token g-1
            rng = random.Random(f"{self.seed}:{_prompt_digest(r.prompt)}:{g}")
            drafts = []
            for j in range(num_spec):
                tok = ref[g + j] if g + j < len(ref) else 0
                if rng.random() < self.corruption:
                    tok = (tok + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
                drafts.append(tok)
            out.append(drafts)
        return out
