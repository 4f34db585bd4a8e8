"""Every change the plugin makes to vLLM is in the patch register, and nowhere else."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from vllm_recoverssm.vllm_plugin import patch

PLUGIN = Path(patch.__file__).parents[1]
CHANGES = {
    "an argparse private": re.compile(r"\._actions\b"),
    "an undecorated vLLM function": re.compile(r"__wrapped__"),
    "the scheduler's private KV manager": re.compile(r"\._kv_cache_manager\b"),
    "a vLLM config write": re.compile(
        r"\.(kv_load_failure_policy|use_kda_recoverssm|model_loader_extra_config)\s*=[^=]"),
    "a replaced vLLM attribute": re.compile(r"\bsetattr\((runner_cls|engine_args_cls)\b"),
}


def test_every_patch_module_is_registered_once_with_its_reasons() -> None:
    modules = {p.stem for p in Path(patch.__file__).parent.glob("*.py")} - {"__init__"}
    named = [p.module for p in patch.REGISTER]
    assert sorted(named) == sorted(modules)
    assert len({p.name for p in patch.REGISTER}) == len(patch.REGISTER)
    for entry in patch.REGISTER:
        assert entry.what and entry.why and entry.versions and entry.until, entry.name
        module = importlib.import_module(f"{patch.__name__}.{entry.module}")
        staged = entry.stage in ("register", "model")
        assert callable(getattr(module, "install", None)) == staged, entry.name


def test_no_module_outside_the_seam_changes_vllm() -> None:
    found = []
    for path in PLUGIN.rglob("*.py"):
        if path.parent.name == "patch" or path.name == "compat.py":
            continue
        text = path.read_text()
        found += [f"{path.relative_to(PLUGIN)}: {what}" for what, pattern in CHANGES.items()
                  if pattern.search(text)]
    assert found == []


def test_the_scan_sees_a_change_where_there_is_one() -> None:
    text = Path(patch.__file__).with_name("kv_connector.py").read_text()
    assert CHANGES["a vLLM config write"].search(text)
    assert CHANGES["the scheduler's private KV manager"].search(text)


@pytest.mark.vllm
def test_register_installs_the_engine_argument_patch_and_says_so(
    vllm_module: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    from vllm_recoverssm import vllm_plugin
    from vllm_recoverssm.vllm_plugin import compat

    vllm_plugin.register()
    assert "engine-args" in patch.installed()
    assert getattr(compat.EngineArgs, "_recoverssm_hooked", False)
    assert all(p.stage != "called" for p in patch.REGISTER if p.name in patch.installed())
