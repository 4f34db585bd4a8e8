"""Run one side of the restart tests in its own process.

python checkpoint_restart_worker.py store DIR   -> stores a prompt and a response bundle,
    prints "stored"
python checkpoint_restart_worker.py check DIR   -> restores both from disk, prints "restored"
python checkpoint_restart_worker.py crash DIR   -> dies (os._exit) between two parts of a write
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the tests package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.checkpoint_stores import (  # noqa: E402
    CRASH_PROMPT,
    make_checkpoint,
    make_identity,
    make_tokens,
)
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore  # noqa: E402

PROMPT = make_tokens(40)
ANSWER = make_tokens(25, seed=1)
IMAGE_PROMPT = make_tokens(30, seed=9)


def open_store(root: str) -> CheckpointStore:
    """The disk store both processes use."""
    cfg = CheckpointConfig(backend="disk", path=Path(root), ram_bytes=2**24, chunk_bytes=4096)
    return CheckpointStore(cfg, make_identity())


def store(root: str) -> None:
    with open_store(root) as s:
        assert s.store(make_checkpoint(PROMPT)).stored
        assert s.store(make_checkpoint(PROMPT + ANSWER, boundary="response")).stored
        assert s.store(make_checkpoint(IMAGE_PROMPT, has_images=True)).reason == "has_images"
    print("stored")


def check(root: str) -> None:
    with open_store(root) as s:
        hit = s.lookup(PROMPT + make_tokens(5, seed=2))
        assert hit is not None and hit.num_tokens == 40, hit
        assert hit.checkpoint.same_as(make_checkpoint(PROMPT))
        hit = s.lookup(PROMPT + ANSWER + make_tokens(5, seed=3))
        assert hit is not None and hit.num_tokens == 65, hit
        assert hit.checkpoint.same_as(make_checkpoint(PROMPT + ANSWER, boundary="response"))
        assert s.lookup(IMAGE_PROMPT) is None
        assert s.stats.rejected == 0
    print("restored")


def crash(root: str) -> None:
    s = open_store(root)
    real_put = s._objects.put
    calls = [0]

    def put(key, data, hold=False):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            os._exit(17)  # the process dies between two parts, without any clean-up
        real_put(key, data, hold=hold)

    s._objects.put = put  # type: ignore[method-assign]
    s.store(make_checkpoint(CRASH_PROMPT))
    raise AssertionError("unreachable: the store should have died")


if __name__ == "__main__":
    {"store": store, "check": check, "crash": crash}[sys.argv[1]](sys.argv[2])
