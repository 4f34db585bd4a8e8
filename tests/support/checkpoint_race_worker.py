"""One of several processes storing the same prefixes into one directory at the same time.

python checkpoint_race_worker.py DIR GO_FILE -> waits for GO_FILE, stores every RACE_PROMPTS bundle,
prints one JSON line: [[num_tokens, stored, reason], ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the tests package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.checkpoint_stores import RACE_PROMPTS, make_checkpoint, make_identity  # noqa: E402
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore  # noqa: E402


def main(root: str, go_file: str) -> None:
    cfg = CheckpointConfig(backend="disk", path=Path(root), ram_bytes=2**24, chunk_bytes=4096)
    checkpoints = [make_checkpoint(p) for p in RACE_PROMPTS]
    with CheckpointStore(cfg, make_identity()) as store:
        print("ready", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(go_file) and time.monotonic() < deadline:
            time.sleep(0.001)  # both writers start together, so they contend on each prefix
        results = []
        for ck in checkpoints:
            r = store.store(ck)
            results.append([ck.num_tokens, r.stored, r.reason])
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
