"""A clear start-up error where vLLM cannot give GLM-5.3 an MTP drafter.

vLLM maps ``"method": "mtp"`` to GLM-5.3's MTP layer (``Glm5NextMTPModel``) only for a
checkpoint whose config is the multimodal one (``model_type`` ``glm5_next``,
``Glm5NextForConditionalGeneration``), and reads the layer count from its text config's
``num_nextn_predict_layers``. A text-only checkpoint (``glm5_next_text``,
``Glm5NextForCausalLM``) stops with "Unsupported speculative method: 'mtp'", and a
config saved by transformers (which does not keep ``num_nextn_predict_layers``) with an
``AttributeError``. :func:`explain` turns either into one line that says what to change.
"""

from __future__ import annotations

from typing import Any

ALTERNATIVES = "or draft with 'dflash' or 'ngram'"


def _method(engine_args: Any) -> str | None:
    spec = getattr(engine_args, "speculative_config", None)
    method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
    return str(method).lower() if method is not None else None


def explain(engine_args: Any, error: BaseException) -> ValueError | None:
    """The start-up error for a GLM-5.3 checkpoint that vLLM gives no MTP drafter, or None
    when ``error`` is about something else."""
    if _method(engine_args) != "mtp" or not isinstance(error, NotImplementedError
                                                         | AttributeError):
        return None
    try:
        hf_config = engine_args.create_model_config().hf_config
    except Exception:  # the model itself cannot be read: vLLM's own error says why
        return None
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "glm5_next_text":
        arch = ", ".join(getattr(hf_config, "architectures", None) or ["Glm5NextForCausalLM"])
        return ValueError(
            f"speculative method 'mtp': vLLM maps GLM-5.3's MTP layer only for "
            f"Glm5NextForConditionalGeneration checkpoints (config model_type 'glm5_next'); "
            f"this checkpoint is {arch} (model_type 'glm5_next_text'), which has no MTP "
            f"drafter in vLLM. Serve the checkpoint's multimodal config, {ALTERNATIVES}")
    text = hf_config.get_text_config() if model_type == "glm5_next" else None
    if text is not None and getattr(text, "num_nextn_predict_layers", None) is None:
        return ValueError(
            "speculative method 'mtp': the checkpoint's text_config has no "
            "num_nextn_predict_layers (its number of MTP layers; transformers does not save "
            f"the field): add it to config.json, {ALTERNATIVES}")
    return None
