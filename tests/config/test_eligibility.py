"""Eligibility: every condition both ways, the three modes, validation of bad values."""

from __future__ import annotations

import pydantic
import pytest

from vllm_recoverssm.config import (
    GLM53_ARCHITECTURES,
    Decision,
    Deployment,
    IneligibleError,
    RecoveryMode,
    check_conditions,
    decide,
)

GOOD = dict(
    architecture="Glm5NextForConditionalGeneration",
    spec_method="mtp",
    num_spec=3,
    activation_dtype="bfloat16",
    state_dtype="float32",
    head_dim=128,
    pipeline_parallel_size=1,
    model_runner="v2",
    gpu_capability=(9, 0),
    kernel_backend="triton",
    kv_connector=None,
    cache_mode="none",
)


def dep(**kw):
    return Deployment(**{**GOOD, **kw})


# (condition name, passing overrides, failing overrides, words the message must contain)
CONDITIONS = [
    ("architecture", dict(architecture="Glm5NextForCausalLM"),
     dict(architecture="LlamaForCausalLM"), ["LlamaForCausalLM", "supported"]),
    ("spec_method", dict(spec_method="dflash"), dict(spec_method="medusa"),
     ["medusa", "one chain of tokens"]),
    ("spec_method", dict(spec_method="ngram"), dict(spec_method="extract_hidden_states"),
     ["extract_hidden_states", "mtp, dflash"]),
    ("spec_method", dict(spec_method="glm5_next_mtp"), dict(spec_method=None, num_spec=0),
     ["no speculative decoding"]),
    ("num_spec", dict(num_spec=7), dict(num_spec=8), ["8 draft", "1..7"]),
    ("num_spec", dict(num_spec=1), dict(num_spec=0), ["0 draft"]),
    ("activation_dtype", dict(activation_dtype="bf16"), dict(activation_dtype="float16"),
     ["float16", "bfloat16 or float32"]),
    ("activation_dtype", dict(activation_dtype="float32"), dict(activation_dtype="fp16"),
     ["float16", "bfloat16 or float32"]),
    ("state_dtype", dict(state_dtype="auto"), dict(state_dtype="bfloat16"),
     ["bfloat16", "float32"]),
    ("head_dim", dict(head_dim=128), dict(head_dim=64), ["64", "128"]),
    ("conv_width", dict(conv_width=4), dict(conv_width=3), ["3 wide", "width of 4"]),
    ("pipeline_parallel_size", dict(pipeline_parallel_size=1),
     dict(pipeline_parallel_size=2), ["2", "needs 1"]),
    ("model_runner", dict(model_runner="v1"), dict(model_runner="v1", cache_mode="align"),
     ["v1", "V2", "prefix caching"]),
    ("device", dict(device="cpu", gpu_capability=None, kernel_backend="reference"),
     dict(device="other", gpu_capability=None), ["CUDA GPUs", "CPU platform"]),
    ("gpu", dict(gpu_capability=(8, 0)), dict(gpu_capability=(7, 5)), ["7.5", "8.0"]),
    ("gpu", dict(gpu_capability=(12, 1)), dict(gpu_capability=None), ["no CUDA GPU"]),
    ("kernel_backend", dict(kernel_backend="b12x", gpu_capability=(12, 0)),
     dict(kernel_backend="b12x", gpu_capability=(10, 0)), ["b12x", "SM12x"]),
    ("kernel_backend", dict(kernel_backend="triton"), dict(kernel_backend=None),
     ["no recovery kernel backend"]),
    ("kernel_backend", dict(device="cpu", gpu_capability=None, kernel_backend="reference"),
     dict(device="cpu", gpu_capability=None, kernel_backend="triton"),
     ["triton", "needs a CUDA GPU"]),
    ("kv_connector", dict(kv_connector="request_boundary"), dict(kv_connector="generic"),
     ["generic", "only an atomic request-boundary connector can export recovery state"]),
    ("kv_connector", dict(kv_connector=None), dict(kv_connector="pd"),
     ["prefill/decode", "only an atomic request-boundary connector can export recovery state"]),
    ("stochastic_rounding", dict(stochastic_rounding=False), dict(stochastic_rounding=True),
     ["stochastic rounding"]),
]


def test_good_deployment_is_eligible_everywhere():
    d = dep()
    assert check_conditions(d) == []
    for mode in ("auto", "on", RecoveryMode.ON):
        got = decide(d, mode)
        assert got.use_recovery and got.failures == []
    off = decide(d, "off")
    assert not off.use_recovery and "no-use-replayssm" in off.reasons[0]


@pytest.mark.parametrize("name, ok, bad, words", CONDITIONS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CONDITIONS)])
def test_each_condition_both_ways(name, ok, bad, words):
    assert check_conditions(dep(**ok)) == [], ok
    assert decide(dep(**ok), "on").use_recovery

    failing = dep(**bad)
    fails = check_conditions(failing)
    assert [f.name for f in fails] == [name]
    for w in words:
        assert w in fails[0].message
    auto = decide(failing, "auto")
    assert not auto.use_recovery and [f.name for f in auto.failures] == [name]
    assert name in auto.reasons[0]
    with pytest.raises(IneligibleError) as ei:
        decide(failing, "on")
    assert [f.name for f in ei.value.failures] == [name]
    assert isinstance(ei.value, ValueError)
    for w in words:
        assert w in str(ei.value)
    off = decide(failing, "off")
    assert not off.use_recovery and [f.name for f in off.failures] == [name]


def test_forced_lists_every_failing_condition():
    d = dep(architecture="X", spec_method="medusa", num_spec=9, activation_dtype="float16",
            head_dim=64, conv_width=2, pipeline_parallel_size=2, model_runner="v1",
            cache_mode="align", gpu_capability=None, kernel_backend=None, kv_connector="pd")
    with pytest.raises(IneligibleError) as ei:
        decide(d, "on")
    names = [f.name for f in ei.value.failures]
    assert names == ["architecture", "spec_method", "num_spec", "activation_dtype",
                     "head_dim", "conv_width", "pipeline_parallel_size", "model_runner",
                     "gpu", "kernel_backend", "kv_connector"]
    msg = str(ei.value)
    assert "11 condition(s)" in msg
    for n in names:
        assert n + ":" in msg
    assert "only an atomic request-boundary connector can export recovery state" in msg


@pytest.mark.parametrize("arch", ["KimiLinearForCausalLM", "KimiK3ForConditionalGeneration",
                                  "Qwen3NextForCausalLM"])
def test_opt_in_architectures(arch):
    d = dep(architecture=arch)
    auto = decide(d)
    assert not auto.use_recovery and auto.failures == []
    assert "only for GLM-5.3" in auto.reasons[0]
    assert decide(d, "on").use_recovery
    assert not decide(d, "off").use_recovery


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (10, 0), (12, 0), (12, 1)])
def test_auto_keeps_full_states_on_a_gpu_not_yet_proven(cap):
    d = dep(gpu_capability=cap, kernel_backend="triton")
    assert check_conditions(d) == []
    auto = decide(d)
    assert not auto.use_recovery and auto.failures == []
    [reason] = auto.reasons
    assert f"SM{cap[0]}{cap[1]}" in reason and "SM90 (H100, H200)" in reason
    assert "--use-replayssm" in reason
    forced = decide(d, "on")
    assert forced.use_recovery and "not yet proven" in forced.reasons[-1]


@pytest.mark.parametrize("cap", [(9, 0), (9, 1)])
def test_auto_turns_recovery_on_where_the_gpu_engine_tests_passed(cap):
    got = decide(dep(gpu_capability=cap))
    assert got.use_recovery and len(got.reasons) == 1 and "SM" not in got.reasons[0]


def test_auto_on_the_cpu_platform_needs_no_proven_gpu():
    assert decide(dep(device="cpu", gpu_capability=None, kernel_backend="reference")).use_recovery


@pytest.mark.parametrize("arch", GLM53_ARCHITECTURES)
def test_glm_automatic(arch):
    assert decide(dep(architecture=arch)).use_recovery


@pytest.mark.parametrize("cache_mode", ["none", "align"])
def test_both_cache_modes_eligible(cache_mode):
    assert decide(dep(cache_mode=cache_mode)).use_recovery


def test_summary_and_json():
    s = decide(dep(head_dim=64)).summary()
    assert s.startswith("recovery: off") and "head_dim: head dim is 64" in s
    assert "recovery: on [mode auto]" in decide(dep()).summary()
    d = Decision.model_validate_json(decide(dep(kv_connector="pd")).model_dump_json())
    assert d.failures[0].name == "kv_connector" and d.mode is RecoveryMode.AUTO


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        decide(dep(), "sometimes")
    assert decide(dep(), "ON").mode is RecoveryMode.ON


@pytest.mark.parametrize(
    "field, value",
    [
        ("spec_method", "telepathy"),
        ("activation_dtype", "int8"),
        ("activation_dtype", "auto"),
        ("state_dtype", "float64"),
        ("model_runner", "v3"),
        ("kernel_backend", "cuda"),
        ("kv_connector", "lmcache"),
        ("cache_mode", "all"),
        ("gpu_capability", (0, 0)),
        ("gpu_capability", "nine"),
        ("num_spec", -1),
        ("head_dim", 0),
        ("pipeline_parallel_size", 0),
        ("architecture", ""),
        ("unknown_field", 1),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(pydantic.ValidationError) as ei:
        dep(**{field: value})
    assert field in str(ei.value)


def test_num_spec_needs_a_method():
    with pytest.raises(pydantic.ValidationError, match="spec_method"):
        dep(spec_method=None, num_spec=3)


def test_aliases_and_normalisation():
    d = dep(activation_dtype="torch.bfloat16", state_dtype="fp32", spec_method="KIMI_K3_MTP")
    assert d.activation_dtype == "bfloat16" and d.state_dtype == "float32"
    assert d.normalised_spec_method == "mtp"
    assert dep(gpu_capability=[9, 0]).gpu_capability == (9, 0)
