"""Layouts recorded beside a disk store's index, and the warning about other layouts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_recoverssm.vllm_plugin.distributed.kv_connector.index import (
    INDEX_DIR,
    LAYOUT_FILE,
    MAX_LAYOUT_BYTES,
    other_layouts,
    write_layout,
)
from vllm_recoverssm.vllm_plugin.distributed.kv_connector.scheduler import foreign_layouts

A, B, C = "a" * 64, "b" * 64, "c" * 64


def layout(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        model="m", revision="r", tp_rank=0, tp_size=1, num_speculative_tokens=3,
        mode="recovery", layout_version=1, dtypes={"state": "float32"},
        extra={"vllm": "0.32", "weights": "w", "vocab": 512, "kv_groups": "g"})
    return {**base, **changes}


def test_other_layouts_reads_every_identity_but_ours(tmp_path: Path) -> None:
    write_layout(tmp_path, A, layout())
    write_layout(tmp_path, B, layout(tp_size=2))
    write_layout(tmp_path, B, layout(tp_size=4))  # written once: the first stays
    (tmp_path / INDEX_DIR / C).mkdir()
    (tmp_path / INDEX_DIR / C / LAYOUT_FILE).write_text("{not json")
    assert other_layouts(tmp_path, {A}) == [layout(tp_size=2)]
    assert other_layouts(tmp_path / "missing", set()) == []


def test_planted_or_oversized_layouts_are_skipped(tmp_path: Path) -> None:
    write_layout(tmp_path, A, layout())
    big = tmp_path / INDEX_DIR / B
    big.mkdir()
    (big / LAYOUT_FILE).write_text(json.dumps(layout(pad="x" * MAX_LAYOUT_BYTES)))
    link = tmp_path / INDEX_DIR / C
    link.mkdir()
    os.symlink(tmp_path / INDEX_DIR / A / LAYOUT_FILE, link / LAYOUT_FILE)
    assert other_layouts(tmp_path, {A}) == []


def test_the_differences_of_the_same_model_are_named() -> None:
    own = layout()
    others = [layout(tp_size=2, tp_rank=1, extra={**own["extra"], "kv_groups": "h"}),
              layout(tp_size=2, extra={**own["extra"], "kv_groups": "h"}),
              layout(mode="full_state", extra={**own["extra"], "vllm": "0.33"}),
              layout(model="another"), layout(tp_rank=1)]
    assert foreign_layouts(own, others) == [
        "tensor parallel 2 (here 1)",
        "mode full_state (here recovery), vLLM 0.33 (here 0.32)",
    ]
