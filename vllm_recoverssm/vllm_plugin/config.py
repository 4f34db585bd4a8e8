"""Recovery selection from vLLM's own ``VllmConfig``.

The plugin never keeps a second copy of the configuration: the mode the user asked for
travels inside ``VllmConfig.additional_config["recoverssm"]`` (set from the command line by
:mod:`.engine_args`, or given directly), and every process — front end, engine core,
workers — derives the same :class:`~vllm_recoverssm.config.Decision` from the config it
was handed. Only GLM-5.3 architectures are changed by the plugin; every other model is
left to vLLM.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..config import (
    COMMIT_MODES,
    DEFAULT_COMMIT,
    GLM53_ARCHITECTURES,
    CommitMode,
    Decision,
    Deployment,
    Failure,
    IneligibleError,
    RecoveryMode,
    check_conditions,
    decide,
)
from ..config import commit_summary as summarize_commit
from ..config import fused_commit_blockers as deployment_commit_blockers
from . import compat
from .compat import cuda_capability
from .kernels import plugin_kernel_backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig

LOGGER_NAME = "vllm.recoverssm"
"""A child of vLLM's logger, so our lines use vLLM's handlers and format."""

CONFIG_KEY = "recoverssm"
"""Key in ``--additional-config``: ``{"recoverssm": "auto" | "on" | "off"}``."""

COMMIT_KEY = "recoverssm_commit"
"""Key in ``--additional-config``: ``{"recoverssm_commit": "auto" | "eager" | "fused"}``
(:data:`vllm_recoverssm.config.COMMIT_MODES` says what each does; ``auto`` when absent)."""

REQUEST_BOUNDARY_KEY = "request_boundary_checkpoints"
"""``kv_connector_extra_config`` flag a connector sets when it only exports atomic
request-boundary checkpoints (the one kind of connector recovery state can go through)."""

_logged: set[tuple[Any, ...]] = set()


def _say_info(message: str) -> None:
    plugin_logger().info("vllm-recoverssm: %s", message)


def plugin_logger() -> logging.Logger:
    """The plugin's logger, after vLLM has configured its logging (on first import)."""
    from .compat import configure_vllm_logging

    configure_vllm_logging()
    return logging.getLogger(LOGGER_NAME)


def requested_mode(vllm_config: VllmConfig) -> RecoveryMode:
    """The mode asked for in ``additional_config`` (``auto`` when absent)."""
    extra = vllm_config.additional_config
    value = extra.get(CONFIG_KEY, "auto") if isinstance(extra, dict) else "auto"
    try:
        return RecoveryMode(str(value).lower())
    except ValueError:
        raise ValueError(
            f"additional_config['{CONFIG_KEY}']: expected one of auto, on, off, got {value!r}"
        ) from None


def requested_commit(vllm_config: VllmConfig) -> CommitMode:
    """The commit mode asked for in ``additional_config`` (``auto`` when absent)."""
    extra = vllm_config.additional_config
    value = extra.get(COMMIT_KEY, DEFAULT_COMMIT) if isinstance(extra, dict) else DEFAULT_COMMIT
    mode = str(value).lower()
    for known in COMMIT_MODES:
        if mode == known:
            return known
    raise ValueError(
        f"additional_config['{COMMIT_KEY}']: expected one of {', '.join(COMMIT_MODES)}, "
        f"got {value!r}"
    )


def fused_commit_blockers(vllm_config: VllmConfig) -> list[str]:
    """Why the commit cannot be fused into the next verify here (empty: it can); the rule
    is :func:`vllm_recoverssm.config.fused_commit_blockers`, applied to this config."""
    return deployment_commit_blockers(deployment_from_vllm_config(vllm_config),
                                      own_connector=_own_connector(vllm_config))


def _own_connector(vllm_config: VllmConfig) -> bool:
    from .distributed.kv_connector.settings import CONNECTOR_NAME

    kt = vllm_config.kv_transfer_config
    return kt is not None and kt.kv_connector == CONNECTOR_NAME


def _fused_commit_asked(vllm_config: VllmConfig) -> bool:
    return requested_commit(vllm_config) != "eager" and recovery_enabled(vllm_config)


def fused_commit_enabled(vllm_config: VllmConfig) -> bool:
    """Whether this process defers each step's commit into the next verify."""
    return _fused_commit_asked(vllm_config) and not fused_commit_blockers(vllm_config)


def is_glm53(vllm_config: VllmConfig) -> bool:
    """Whether the served architecture is GLM-5.3, the one the plugin changes."""
    mc = vllm_config.model_config
    return mc is not None and mc.architecture in GLM53_ARCHITECTURES


def kv_connector_kind(vllm_config: VllmConfig) -> str | None:
    """Classify the KV connector: None, ``request_boundary``, ``pd`` or ``generic``.

    A producer or consumer role is prefill/decode disaggregation. A connector that declares
    ``request_boundary_checkpoints`` in its extra config exports whole request-boundary
    checkpoints atomically; anything else (e.g. block-aligned KV offload) is generic.
    """
    kt = vllm_config.kv_transfer_config
    if kt is None or kt.kv_connector is None:
        return None
    if kt.kv_role in ("kv_producer", "kv_consumer"):
        return "pd"
    if kt.kv_connector_extra_config.get(REQUEST_BOUNDARY_KEY) is True:
        return "request_boundary"
    return "generic"


def _text_int(vllm_config: VllmConfig, names: tuple[str, ...], default: int) -> int:
    """The first of ``names`` the model's text config holds as an integer."""
    text = vllm_config.model_config.hf_text_config
    for name in names:
        value = getattr(text, name, None)
        if isinstance(value, int):
            return value
    return default


def deployment_from_vllm_config(
    vllm_config: VllmConfig, *, gpu_capability: tuple[int, int] | None | str = "detect"
) -> Deployment:
    """Describe the deployment ``vllm_config`` configures, for :func:`decide`.

    ``gpu_capability`` defaults to the CUDA device's (None without one); pass a tuple to
    decide for another GPU. Without a GPU the device is vLLM's platform (``cpu`` on its CPU
    platform, where the plugin runs the PyTorch reference ops). The state dtype is the one
    vLLM resolves for KDA state (``auto`` is float32).
    """
    cap = cuda_capability() if gpu_capability == "detect" else gpu_capability
    assert cap is None or isinstance(cap, tuple)
    device = "cuda" if cap is not None else compat.platform_name()
    if device not in ("cuda", "cpu"):
        device = "other"
    spec = vllm_config.speculative_config
    cache = vllm_config.cache_config
    mamba = getattr(vllm_config, "mamba_config", None)
    return Deployment.model_validate({
        "architecture": vllm_config.model_config.architecture,
        "spec_method": spec.method if spec is not None else None,
        "num_spec": vllm_config.num_speculative_tokens,
        "activation_dtype": str(vllm_config.model_config.dtype),
        "state_dtype": str(compat.kda_state_dtypes(vllm_config)[1]),
        "head_dim": _text_int(vllm_config, ("linear_head_dim", "head_dim"), 0),
        "conv_width": _text_int(vllm_config, ("linear_conv_kernel_dim",
                                              "short_conv_kernel_size"), 4),
        "pipeline_parallel_size": vllm_config.parallel_config.pipeline_parallel_size,
        "model_runner": "v2" if vllm_config.use_v2_model_runner else "v1",
        "device": device,
        "gpu_capability": cap,
        "kernel_backend": "reference" if device == "cpu" else plugin_kernel_backend(cap, _say_info),
        "kv_connector": kv_connector_kind(vllm_config),
        "cache_mode": "align" if cache.mamba_cache_mode == "align" else "none",
        "stochastic_rounding": bool(getattr(mamba, "enable_stochastic_rounding", False)),
    })


def plugin_limits(vllm_config: VllmConfig) -> list[Failure]:
    """Conditions the vLLM integration adds to the general ones.

    Prefix caching (mamba cache mode ``align``) needs state blocks of at least ``S+1``
    tokens, so that one verify window crosses at most one block boundary.
    """
    out: list[Failure] = []
    cache = vllm_config.cache_config
    block = cache.mamba_block_size
    window = vllm_config.num_speculative_tokens + 1
    if cache.mamba_cache_mode == "align" and block is not None and block < window:
        out.append(Failure(
            name="mamba_block_size",
            message=f"prefix caching keeps a state block every {block} tokens, fewer than "
            f"the verify window of {window} (S+1); raise --mamba-block-size (or "
            "--block-size) to at least S+1, or pass --no-enable-prefix-caching",
        ))
    return out


def decide_for_vllm_config(
    vllm_config: VllmConfig, *, gpu_capability: tuple[int, int] | None | str = "detect"
) -> Decision:
    """The recovery decision for ``vllm_config`` under the mode it carries.

    Architectures other than GLM-5.3 always get ``use_recovery=False`` in auto and off
    mode (vLLM keeps its own behaviour); forcing recovery (``on``) on anything ineligible
    raises :class:`IneligibleError` listing every failing condition.
    """
    mode = requested_mode(vllm_config)
    deployment = deployment_from_vllm_config(vllm_config, gpu_capability=gpu_capability)
    extra = plugin_limits(vllm_config)
    if not is_glm53(vllm_config):
        arch = deployment.architecture
        if mode is RecoveryMode.ON:
            failures = [f for f in check_conditions(deployment) if f.name != "architecture"]
            raise IneligibleError([Failure(
                name="architecture",
                message=f"the vLLM plugin implements recovery for GLM-5.3 "
                f"({', '.join(GLM53_ARCHITECTURES)}) only, not {arch}; for Kimi use vLLM's "
                "own --use-replayssm",
            ), *failures, *extra])
        return Decision(mode=mode, use_recovery=False, reasons=[
            f"{arch} is not GLM-5.3: the plugin leaves it to vLLM"
        ])
    if extra and mode is not RecoveryMode.OFF:
        failures = check_conditions(deployment) + extra
        if mode is RecoveryMode.ON:
            raise IneligibleError(failures)
        return Decision(mode=mode, use_recovery=False, failures=failures, reasons=[
            f"{len(failures)} condition(s) fail, so full speculative states are kept: "
            + ", ".join(f.name for f in failures)
        ])
    return decide(deployment, mode)


def recovery_enabled(vllm_config: VllmConfig) -> bool:
    """Whether this process serves GLM-5.3 with recovery (never raises for 'on')."""
    try:
        return decide_for_vllm_config(vllm_config).use_recovery
    except IneligibleError:
        # Start-up (the front end) already refused this deployment; a process that gets
        # here anyway keeps full states rather than failing again mid-initialisation.
        return False


def commit_summary(vllm_config: VllmConfig) -> str | None:
    """One line on the commit mode unless ``eager`` was asked for (None then)."""
    if not _fused_commit_asked(vllm_config):
        return None
    return summarize_commit(requested_commit(vllm_config), fused_commit_blockers(vllm_config),
                            vllm_config.scheduler_config.max_num_seqs)


def log_decision_once(vllm_config: VllmConfig, decision: Decision) -> None:
    """Log ``decision`` with its reasons, once per process and deployment."""
    key = (vllm_config.model_config.architecture, decision.mode, decision.use_recovery,
           tuple(decision.reasons), requested_commit(vllm_config))
    if key in _logged:
        return
    _logged.add(key)
    plugin_logger().info("vllm-recoverssm: %s", decision.summary().replace("\n", "\n  "))
    commit = commit_summary(vllm_config) if decision.use_recovery else None
    if commit is not None:
        # a fallback from a fused commit the user named is worth a warning; from the
        # default it is information
        asked = requested_commit(vllm_config) == "fused"
        level = logging.WARNING if asked and not fused_commit_enabled(vllm_config) else logging.INFO
        plugin_logger().log(level, "vllm-recoverssm: %s", commit)
