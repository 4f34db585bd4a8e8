"""Run one side of the runtime restart test in its own process; prints one JSON object.

python reference_restart_worker.py store DIR           -> wave 1 in both modes, exported to DIR
python reference_restart_worker.py restore DIR ANSWERS -> wave 2 (follow-up turns and repeats of
                                                wave 1, whose answers ANSWERS holds as JSON)
                                                in both modes, restored from DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: make the tests package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.reference_runs import MAX_MODEL_LEN, MAX_NEW, make_prompts  # noqa: E402
from vllm_recoverssm.checkpoint import CheckpointConfig  # noqa: E402
from vllm_recoverssm.reference import (  # noqa: E402
    MODES,
    TEST_MODEL,
    MTPDrafter,
    RuntimeConfig,
    SpecRuntime,
    build_model,
)

NEW_TEXT = [3, 1, 4]


def wave1() -> list[list[int]]:
    """The prompts both processes agree on."""
    return make_prompts(4, TEST_MODEL.vocab_size)


def wave2(answers: dict[str, list[list[int]]], mode: str) -> list[list[int]]:
    """Follow-up turns of wave 1, then its prompts again."""
    prompts = wave1()
    return [p + a + NEW_TEXT for p, a in zip(prompts, answers[mode], strict=True)] + prompts


def runtime(mode: str, root: str | None) -> SpecRuntime:
    """A runtime on the test model, exporting to and restoring from ``root`` when given."""
    checkpoint = (CheckpointConfig(backend="disk", path=Path(root), ram_bytes=2**23,
                                   chunk_bytes=4096) if root else None)
    config = RuntimeConfig(mode=mode, num_spec=3, block_size=8, max_model_len=MAX_MODEL_LEN,
                           checkpoint=checkpoint)
    return SpecRuntime(build_model(TEST_MODEL), config, MTPDrafter())


def serve(rt: SpecRuntime, prompts: list[list[int]]) -> dict[str, object]:
    """Run ``prompts``; what the parent test checks."""
    for p in prompts:
        rt.add_request(p, MAX_NEW)
    done = rt.run()
    store = rt.checkpoint_store
    return {
        "outputs": [r.generated for r in done],
        "restored": [r.restored_tokens for r in done],
        "prefill_tokens": rt.stats.prefill_tokens,
        "external_hits": rt.stats.external_hits,
        "exported": rt.stats.checkpoints_exported,
        "rejected": store.stats.rejected if store is not None else 0,
    }


def main(action: str, root: str, answers_path: str | None = None) -> None:
    torch.set_num_threads(1)
    out = {}
    for mode in MODES:
        with runtime(mode, root) as rt:
            if action == "store":
                out[mode] = serve(rt, wave1())
            else:
                assert answers_path is not None
                answers = json.loads(Path(answers_path).read_text())
                out[mode] = serve(rt, wave2(answers, mode))
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
