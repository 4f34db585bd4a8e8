"""Recovery selection from real ``VllmConfig`` objects of a tiny GLM-5.3."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.support.tiny_glm import write_tiny_qwen3_next
from tests.support.vllm_configs import MTP3, on_gpu, with_prefix_caching
from vllm_recoverssm.config import IneligibleError, RecoveryMode
from vllm_recoverssm.vllm_plugin import CONFIG_KEY, register
from vllm_recoverssm.vllm_plugin import config as plugin_config
from vllm_recoverssm.vllm_plugin import kernels as plugin_kernels
from vllm_recoverssm.vllm_plugin.config import (
    commit_summary,
    decide_for_vllm_config,
    deployment_from_vllm_config,
    fused_commit_blockers,
    fused_commit_enabled,
    kv_connector_kind,
    recovery_enabled,
    requested_commit,
)


def test_plugin_is_found_through_the_entry_point(vllm_module: Any) -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    eps = {ep.name: ep for ep in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert eps["recoverssm"].value == "vllm_recoverssm.vllm_plugin:register"
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["recoverssm"] is register


def test_registration_overrides_only_glm53(vllm_module: Any) -> None:
    from vllm import ModelRegistry

    register()
    models = ModelRegistry.models
    for arch in ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration"):
        assert models[arch].module_name == "vllm_recoverssm.vllm_plugin.models.glm5next.model"
    # every other architecture keeps vLLM's own class
    for arch in ("KimiLinearForCausalLM", "Qwen3NextForCausalLM", "Glm5NextMTPModel"):
        assert models[arch].module_name.startswith("vllm.")


def test_deployment_is_read_from_the_real_config(build_config: Any) -> None:
    cfg = build_config(*MTP3)
    d = deployment_from_vllm_config(cfg, gpu_capability=(9, 0))
    assert d.architecture == "Glm5NextForConditionalGeneration"
    assert (d.spec_method, d.num_spec) == ("mtp", 3)
    # The state dtype is the one vLLM resolves for KDA state: float32 whether or not this
    # CPU has AVX512-BF16 (vLLM's CPU platform then rewrites "auto" to "float32").
    assert (d.activation_dtype, d.state_dtype, d.head_dim) == ("bfloat16", "float32", 128)
    assert (d.pipeline_parallel_size, d.cache_mode, d.kv_connector) == (1, "none", None)
    # on this CPU machine vLLM itself picks the V1 runner
    assert d.model_runner == "v1"
    assert (d.device, d.kernel_backend) == ("cuda", "triton")


def test_auto_turns_recovery_on_for_an_eligible_glm53(build_config: Any) -> None:
    cfg = build_config(*MTP3)
    assert CONFIG_KEY not in cfg.additional_config  # nothing asked: auto
    assert cfg.cache_config.use_replayssm is False  # vLLM's own flag stays off
    with on_gpu():
        decision = decide_for_vllm_config(cfg)
        assert recovery_enabled(cfg)
    assert decision.mode is RecoveryMode.AUTO and decision.use_recovery
    assert "--no-use-replayssm" in decision.summary()


def test_auto_on_vllms_cpu_platform_runs_the_reference_ops(build_config: Any) -> None:
    cfg = build_config(*MTP3)
    d = deployment_from_vllm_config(cfg)  # this machine: vLLM's CPU platform, V1 runner
    assert (d.device, d.gpu_capability, d.kernel_backend, d.model_runner) == (
        "cpu", None, "reference", "v1")
    decision = decide_for_vllm_config(cfg)
    assert decision.use_recovery and not decision.failures
    with on_gpu(v2_runner=False):  # runner V1 commits after sampling too
        assert decide_for_vllm_config(cfg).use_recovery
    with on_gpu(capability=(7, 5)):
        assert {f.name for f in decide_for_vllm_config(cfg).failures} == {
            "gpu", "kernel_backend"}


def test_prefix_caching_under_runner_v1_keeps_full_states(build_config: Any) -> None:
    cfg = with_prefix_caching(build_config(*MTP3), block_size=16)
    with on_gpu(v2_runner=False):
        decision = decide_for_vllm_config(cfg)
    assert not decision.use_recovery
    assert [f.name for f in decision.failures] == ["model_runner"]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in decision.failures[0].message


def test_prefix_caching_align_mode_keeps_recovery_automatic(build_config: Any) -> None:
    """vLLM's default for hybrids (prefix caching, mamba cache mode align) is eligible."""
    cfg = with_prefix_caching(build_config(*MTP3), block_size=16)
    with on_gpu():
        decision = decide_for_vllm_config(cfg)
        d = deployment_from_vllm_config(cfg)
    assert d.cache_mode == "align"
    assert decision.use_recovery and not decision.failures


def test_align_blocks_shorter_than_the_verify_window_are_refused(build_config: Any) -> None:
    cfg = with_prefix_caching(build_config(*MTP3), block_size=3)  # S+1 = 4
    with on_gpu():
        decision = decide_for_vllm_config(cfg)
    assert not decision.use_recovery
    assert [f.name for f in decision.failures] == ["mamba_block_size"]
    forced = with_prefix_caching(build_config(*MTP3), block_size=3)
    object.__setattr__(forced, "additional_config", {CONFIG_KEY: "on"})
    with on_gpu(), pytest.raises(IneligibleError) as info:
        decide_for_vllm_config(forced)
    assert "state block every 3 tokens, fewer than the verify window of 4" in str(info.value)


def test_no_use_replayssm_keeps_full_states(build_config: Any) -> None:
    cfg = build_config(*MTP3, "--no-use-replayssm")
    assert cfg.additional_config[CONFIG_KEY] == "off"
    with on_gpu():
        decision = decide_for_vllm_config(cfg)
    assert decision.mode is RecoveryMode.OFF and not decision.use_recovery
    assert "--no-use-replayssm" in decision.reasons[0]


def test_forced_recovery_on_an_ineligible_deployment_fails_at_startup(
    build_config: Any,
) -> None:
    with pytest.raises(IneligibleError) as info:
        build_config("--speculative-config",
                     '{"method": "mtp", "num_speculative_tokens": 9}', "--use-replayssm",
                     "--dtype", "float16")
    text = str(info.value)
    names = [f.name for f in info.value.failures]
    assert names == ["num_spec", "activation_dtype"]
    for phrase in ("9 draft tokens per step", "activations are float16"):
        assert phrase in text


def test_forced_recovery_refuses_pd_and_generic_connectors(
    build_config: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a NIXL connector and no layout in os.environ, vLLM's CPU platform writes
    # VLLM_SSM_CONV_STATE_LAYOUT=DS there for the rest of the process, and layers built
    # later in it store their conv state dim-first. On a CPU with AVX512-BF16 any earlier
    # config already wrote SD, so the leak hits only some machines. Keep the default set.
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    pd = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    with pytest.raises(IneligibleError) as info:
        build_config(*MTP3, "--use-replayssm", "--kv-transfer-config", pd)
    message = str(info.value)
    assert "prefill/decode disaggregation" in message
    assert "only an atomic request-boundary connector can export recovery state" in message


def test_connector_kinds(vllm_module: Any) -> None:
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    def kind(**kw: Any) -> str | None:
        cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(**kw) if kw else None)
        return kv_connector_kind(cfg)  # type: ignore[arg-type]

    assert kind() is None
    assert kind(kv_connector="NixlConnector", kv_role="kv_consumer") == "pd"
    assert kind(kv_connector="LMCacheConnectorV1", kv_role="kv_both") == "generic"
    assert kind(kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                kv_connector_extra_config={"request_boundary_checkpoints": True}
                ) == "request_boundary"


def test_explicit_additional_config_and_contradictions(build_config: Any) -> None:
    cfg = build_config(*MTP3, "--additional-config", '{"recoverssm": "off"}')
    with on_gpu():
        assert not decide_for_vllm_config(cfg).use_recovery
    with pytest.raises(ValueError, match="contradicts"):
        build_config(*MTP3, "--no-use-replayssm", "--additional-config",
                     '{"recoverssm": "on"}')
    with pytest.raises(ValueError, match="expected one of auto, on, off"):
        build_config(*MTP3, "--additional-config", '{"recoverssm": "maybe"}')


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3next"))


def test_other_architectures_are_left_to_vllm(build_config: Any, tiny_qwen: Path) -> None:
    cfg = build_config(*MTP3, model=tiny_qwen)
    assert cfg.model_config.architecture == "Qwen3NextForCausalLM"
    assert CONFIG_KEY not in cfg.additional_config
    with on_gpu():
        decision = decide_for_vllm_config(cfg)
    assert not decision.use_recovery and "leaves it to vLLM" in decision.reasons[0]
    # --use-replayssm still reaches vLLM's own check, unchanged
    with pytest.raises(ValueError, match="--use-replayssm is not supported for architecture"):
        build_config(*MTP3, "--use-replayssm", model=tiny_qwen)
    # forcing the plugin's recovery on it is refused, naming the architecture
    with pytest.raises(IneligibleError, match="GLM-5.3 .* only, not Qwen3NextForCausalLM"):
        build_config(*MTP3, "--additional-config", '{"recoverssm": "on"}', model=tiny_qwen)


FUSED = ("--additional-config", '{"recoverssm": "on", "recoverssm_commit": "fused"}')


def test_fused_commit_applies_under_runner_v1_without_a_cache_or_connector(
    build_config: Any,
) -> None:
    cfg = build_config(*MTP3, *FUSED)
    assert requested_commit(cfg) == "fused"
    with on_gpu(v2_runner=False):
        assert fused_commit_blockers(cfg) == []
        assert fused_commit_enabled(cfg)
        assert commit_summary(cfg) == (
            "commit: fused into the next verify (record scratch of 2 x "
            f"{cfg.scheduler_config.max_num_seqs} rows)")
    # auto, the default, fuses it too; eager is asked for by name, and nothing is logged
    plain = build_config(*MTP3)
    assert requested_commit(plain) == "auto"
    with on_gpu(v2_runner=False):
        assert fused_commit_enabled(plain) and commit_summary(plain) == commit_summary(cfg)
    eager = build_config(*MTP3, "--additional-config", '{"recoverssm_commit": "eager"}')
    with on_gpu(v2_runner=False):
        assert not fused_commit_enabled(eager) and commit_summary(eager) is None


def with_other_connector(cfg: Any) -> Any:
    """A copy of ``cfg`` with a request-boundary KV connector that is not the plugin's."""
    import copy

    from vllm.config import KVTransferConfig

    out = copy.copy(cfg)
    object.__setattr__(out, "kv_transfer_config", KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both",
        kv_connector_extra_config={"request_boundary_checkpoints": True}))
    return out


def test_a_fallback_warns_only_when_fused_was_asked_for(
    build_config: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """With another KV connector the commit stays eager: a warning for ``fused``,
    information for the default."""
    import logging

    levels = {}
    for name, extra in (("fused", FUSED), ("auto", ())):
        cfg = with_other_connector(build_config(*MTP3, *extra))
        plugin_config._logged.clear()
        caplog.clear()
        # listen on the plugin's own logger: whether vLLM's logger propagates to the root
        # logger (where caplog listens) depends on what configured logging before
        records: list[logging.LogRecord] = []
        listener = logging.Handler(logging.INFO)
        listener.emit = records.append  # type: ignore[method-assign]
        logger = plugin_config.plugin_logger()
        logger.addHandler(listener)
        try:
            with on_gpu(v2_runner=True), \
                    caplog.at_level(logging.INFO, logger=plugin_config.LOGGER_NAME):
                plugin_config.log_decision_once(cfg, decide_for_vllm_config(cfg))
        finally:
            logger.removeHandler(listener)
        lines = [r for r in records if "commit: eager, not fused" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in records]
        levels[name] = lines[0].levelno
    assert levels == {"fused": logging.WARNING, "auto": logging.INFO}


def test_fused_commit_falls_back_to_eager_and_says_why(build_config: Any) -> None:
    cfg = build_config(*MTP3, *FUSED)
    for v2 in (True, False):  # either runner fuses: V1 after sampling, V2 in its model state
        with on_gpu(v2_runner=v2):
            assert fused_commit_enabled(cfg) and fused_commit_blockers(cfg) == []
    # prefix caching (align) fuses too: rows at a state block's end commit after sampling
    cached = with_prefix_caching(cfg, block_size=16)
    with on_gpu(v2_runner=True):
        assert fused_commit_enabled(cached) and fused_commit_blockers(cached) == []
    other = with_other_connector(cfg)
    with on_gpu(v2_runner=False):
        assert not fused_commit_enabled(other)
        assert commit_summary(other) == (
            "commit: eager, not fused: a KV connector other than the plugin's may export "
            "the state between steps")
    # SM12x with b12x installed: the plugin runs Triton there (vllm_plugin/kernels.py),
    # whose verify fuses
    with on_gpu(capability=(12, 0), v2_runner=False), \
            mock.patch.object(plugin_kernels, "choose_kernel_backend", lambda cap: "b12x"):
        assert deployment_from_vllm_config(cfg).kernel_backend == "triton"
        assert fused_commit_blockers(cfg) == []
    off = build_config(*MTP3, "--additional-config",
                       '{"recoverssm": "off", "recoverssm_commit": "fused"}')
    assert not fused_commit_enabled(off) and commit_summary(off) is None


def test_fused_commit_takes_the_plugins_connector_only(build_config: Any) -> None:
    """The checkpoint connector commits a finished request's records before it exports it;
    another request-boundary connector would read them uncommitted."""
    import copy

    from vllm.config import KVTransferConfig

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector import CONNECTOR_NAME

    cfg = build_config(*MTP3, *FUSED)
    boundary = {"request_boundary_checkpoints": True}
    for name, blocked in ((CONNECTOR_NAME, False), ("LMCacheConnectorV1", True)):
        with_connector = copy.copy(cfg)
        object.__setattr__(with_connector, "kv_transfer_config", KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_connector_extra_config=boundary))
        with on_gpu(v2_runner=False):
            assert fused_commit_enabled(with_connector) is not blocked
            assert fused_commit_blockers(with_connector) == (
                ["a KV connector other than the plugin's may export the state between "
                 "steps"] if blocked else [])


@pytest.mark.parametrize("v2, cached, connector, argv", [
    (False, False, None, ["--runner", "v1"]),
    (True, False, None, ["--runner", "v2"]),
    (True, True, None, ["--runner", "v2", "--cache-mode", "align", "--block-size", "16"]),
    (False, False, "own", ["--runner", "v1", "--kv-connector", "recoverssm"]),
    (False, False, "other", ["--runner", "v1", "--kv-connector", "request_boundary"]),
], ids=["v1", "v2", "v2-prefix-caching", "v1-own-connector", "v1-other-connector"])
def test_check_prints_the_line_the_plugin_logs(
    build_config: Any, capsys: pytest.CaptureFixture[str], v2: bool, cached: bool,
    connector: str | None, argv: list[str],
) -> None:
    """``recoverssm check`` describes the deployment with flags; the plugin reads vLLM's
    config. Both must come to the same commit line."""
    import copy

    from vllm.config import KVTransferConfig

    from vllm_recoverssm.cli.main import main
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector import CONNECTOR_NAME

    cfg = build_config(*MTP3)
    if cached:
        cfg = with_prefix_caching(cfg, block_size=16)
    if connector is not None:
        cfg = copy.copy(cfg)
        name = CONNECTOR_NAME if connector == "own" else "SomeoneElsesConnector"
        object.__setattr__(cfg, "kv_transfer_config", KVTransferConfig(
            kv_connector=name, kv_role="kv_both",
            kv_connector_extra_config={"request_boundary_checkpoints": True}))
    with on_gpu(v2_runner=v2):
        logged = commit_summary(cfg)
    assert logged is not None
    rows = str(cfg.scheduler_config.max_num_seqs)
    assert main(["check", "--gpu-capability", "9.0", "--kernel-backend", "triton",
                 "--num-spec", "3", "--max-num-seqs", rows, *argv]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == logged


def test_an_unknown_commit_mode_is_refused_naming_the_key(build_config: Any) -> None:
    with pytest.raises(ValueError, match=r"additional_config\['recoverssm_commit'\]: "
                       "expected one of auto, eager, fused, got 'later'"):
        build_config(*MTP3, "--additional-config", '{"recoverssm_commit": "later"}')
