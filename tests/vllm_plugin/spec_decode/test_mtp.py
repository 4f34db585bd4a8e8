"""GLM-5.3 checkpoints that vLLM gives no MTP drafter fail at start-up in one clear line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from vllm_recoverssm.harness.hf_glm53 import make_in_subprocess
from vllm_recoverssm.harness.tiny_model import write_tiny_glm53

MTP = {"method": "mtp", "num_speculative_tokens": 1}


def engine_config(model: Path, **extra: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
                      load_format="dummy", speculative_config=MTP, enable_prefix_caching=False,
                      **extra).create_engine_config()


@pytest.fixture(scope="module")
def flash_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The transformers checkpoint's config and processor (no weights are read)."""
    made = make_in_subprocess(tmp_path_factory.mktemp("flash") / "model")
    (made / "model.safetensors").unlink(missing_ok=True)
    return made


def test_a_text_only_checkpoint_names_the_architecture_mtp_needs(
        vllm_module: Any, tmp_path: Path) -> None:
    model = write_tiny_glm53(tmp_path / "text")
    with pytest.raises(ValueError) as ei:
        engine_config(model, skip_tokenizer_init=True)
    message = str(ei.value)
    assert "Glm5NextForCausalLM (model_type 'glm5_next_text')" in message
    assert "only for Glm5NextForConditionalGeneration checkpoints" in message
    assert "'dflash' or 'ngram'" in message
    assert isinstance(ei.value.__cause__, NotImplementedError)


def test_a_config_saved_by_transformers_names_the_missing_layer_count(
        vllm_module: Any, flash_config: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no num_nextn_predict_layers"):
        engine_config(flash_config)
    fixed = tmp_path / "fixed"
    shutil.copytree(flash_config, fixed)
    config = json.loads((fixed / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (fixed / "config.json").write_text(json.dumps(config))
    vllm_config = engine_config(fixed)  # vLLM maps its MTP layer once the count is there
    assert vllm_config.speculative_config.draft_model_config.architectures == [
        "Glm5NextMTPModel"]
