"""Automatic eligibility: does a deployment use recovery, and why (DESIGN.md section 4).

A :class:`Deployment` describes what decides it; :func:`decide` checks every condition and
reports each failing one by a stable name (:class:`Failure`):

=======================  ================================================================
name                     condition
=======================  ================================================================
architecture             GLM-5.3 (automatic), Kimi-Linear / Kimi-K3 or Qwen3-Next (opt-in)
spec_method              a linear-chain drafter: MTP, DFlash, EAGLE, n-gram, suffix or a
                         draft model (the target only sees a window and an accepted count)
num_spec                 1..7 draft tokens (the verify window holds at most 8 tokens)
activation_dtype         bfloat16 or float32 activations (the CUDA verify has no float16)
state_dtype              float32 recurrent state ("auto" resolves to float32 for KDA)
head_dim                 128
conv_width               4 (GLM-5.3's short conv; the conv kernels hold a window of 4)
pipeline_parallel_size   1 (non-last PP ranks never run the commit)
model_runner             V1 or V2; prefix caching (cache mode ``align``) needs V2, whose
                         runner moves the running-state block after the commit
device                   a CUDA GPU, or vLLM's CPU platform (the PyTorch reference ops)
gpu                      on CUDA: compute capability 8.0 or newer
kernel_backend           triton (SM80+), b12x (SM12x only) or reference (CPU)
kv_connector             none, or an atomic request-boundary connector
stochastic_rounding      off
=======================  ================================================================

Modes: ``auto`` (default) turns recovery on for GLM-5.3 when every condition holds and,
on a CUDA GPU, the GPU is of an architecture where vLLM's GPU engine tests passed
(:mod:`.proven_gpus`); it keeps full states otherwise (Kimi and Qwen3-Next only when
asked); ``on`` forces it and
raises :class:`IneligibleError` listing every failing condition; ``off`` keeps full
speculative states (``--no-use-replayssm``).

Architecture names are vLLM 0.32's registry keys
(``vllm/model_executor/models/registry.py``: ``Glm5NextForCausalLM``,
``Glm5NextForConditionalGeneration``, ``KimiLinearForCausalLM``,
``KimiK3ForConditionalGeneration``, ``Qwen3NextForCausalLM``); speculative
methods are ``SpeculativeMethod`` in ``vllm/config/speculative.py``.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .proven_gpus import is_proven_gpu, unproven_gpu_reason

GLM53_ARCHITECTURES: tuple[str, ...] = (
    "Glm5NextForCausalLM",
    "Glm5NextForConditionalGeneration",
)
KIMI_ARCHITECTURES: tuple[str, ...] = (
    "KimiLinearForCausalLM",
    "KimiK3ForConditionalGeneration",
)
QWEN3_NEXT_ARCHITECTURES: tuple[str, ...] = ("Qwen3NextForCausalLM",)
AUTO_ARCHITECTURES = GLM53_ARCHITECTURES
RECOVERY_ACTIVATION_DTYPES: tuple[str, ...] = ("bfloat16", "float32")
"""Activation dtypes every recovery backend reads (the CUDA verify has no float16 build)."""
OPT_IN_ARCHITECTURES = KIMI_ARCHITECTURES + QWEN3_NEXT_ARCHITECTURES
SUPPORTED_ARCHITECTURES = AUTO_ARCHITECTURES + OPT_IN_ARCHITECTURES

# vLLM 0.32 MTPModelTypes (vllm/config/speculative.py): all are normalised to "mtp".
MTP_METHODS: frozenset[str] = frozenset({
    "mtp", "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp",
})
# The rest of SpeculativeMethod (vllm/config/speculative.py).
OTHER_SPEC_METHODS: frozenset[str] = frozenset({
    "ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle",
    "eagle3", "extract_hidden_states", "dflash", "ngram_gpu", "dspark",
})
SPEC_METHODS = MTP_METHODS | OTHER_SPEC_METHODS
RECOVERY_SPEC_METHODS = ("mtp", "dflash", "eagle", "eagle3", "ngram", "ngram_gpu", "suffix",
                         "draft_model", "custom_class")
"""Drafters that propose one chain of tokens: the target verifies a window of up to S+1
tokens and keeps an accepted prefix, which is all recovery sees."""
MIN_NUM_SPEC, MAX_NUM_SPEC = 1, 7
MIN_GPU_CAPABILITY = (8, 0)

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32",
}

ActivationDType = Literal["bfloat16", "float16", "float32"]
StateDType = Literal["auto", "float32", "float16", "bfloat16"]
ModelRunner = Literal["v1", "v2"]
KernelBackend = Literal["triton", "b12x", "reference"]
Device = Literal["cuda", "cpu", "other"]
KVConnectorKind = Literal["request_boundary", "generic", "pd"]
CacheMode = Literal["none", "align"]

CONNECTOR_MESSAGE = (
    "only an atomic request-boundary connector can export recovery state"
)


class RecoveryMode(str, Enum):
    """``auto``: on when eligible (GLM-5.3); ``on``: forced; ``off``: full states."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def _normalise_dtype(value: object) -> object:
    if isinstance(value, str):
        v = value.strip().lower().removeprefix("torch.")
        return _DTYPE_ALIASES.get(v, v)
    return value


class Deployment(BaseModel):
    """What decides whether a deployment can use recovery."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str = Field(min_length=1, description="HF architecture name")
    spec_method: str | None = Field(
        default=None, description="speculative method (mtp, dflash, eagle, ngram, ...)"
    )
    num_spec: int = Field(default=0, ge=0, le=64, description="draft tokens per step (S)")
    activation_dtype: ActivationDType = "bfloat16"
    state_dtype: StateDType = "auto"
    head_dim: int = Field(default=128, ge=1)
    conv_width: int = Field(default=4, ge=1, description="short-conv kernel width (Kc)")
    pipeline_parallel_size: int = Field(default=1, ge=1)
    model_runner: ModelRunner = "v2"
    device: Device = "cuda"
    gpu_capability: tuple[int, int] | None = Field(
        default=None, description="CUDA compute capability (major, minor); None = no GPU"
    )
    kernel_backend: KernelBackend | None = "triton"
    kv_connector: KVConnectorKind | None = None
    cache_mode: CacheMode = "none"
    stochastic_rounding: bool = False

    @field_validator("activation_dtype", "state_dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: object) -> object:
        return _normalise_dtype(value)

    @field_validator("spec_method", mode="before")
    @classmethod
    def _known_spec_method(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str):
            return value  # pydantic reports the type
        v = value.strip().lower()
        if v in ("", "none"):
            return None
        if v not in SPEC_METHODS:
            raise ValueError(
                f"unknown speculative method {value!r}; expected one of vLLM 0.32's: "
                + ", ".join(sorted(SPEC_METHODS))
            )
        return v

    @field_validator("gpu_capability")
    @classmethod
    def _capability(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and (value[0] < 1 or value[1] < 0):
            raise ValueError(f"expected a compute capability like (9, 0), got {value}")
        return value

    @model_validator(mode="after")
    def _spec_consistent(self) -> Deployment:
        if self.spec_method is None and self.num_spec > 0:
            raise ValueError(
                f"num_spec={self.num_spec} draft tokens need a spec_method (mtp, dflash, ...)"
            )
        return self

    @property
    def normalised_spec_method(self) -> str | None:
        """``mtp`` for every MTP model type (as vLLM does), otherwise the method."""
        if self.spec_method in MTP_METHODS:
            return "mtp"
        return self.spec_method


class Failure(BaseModel):
    """One failing eligibility condition: a stable ``name`` and plain-words ``message``."""

    model_config = ConfigDict(frozen=True)

    name: str
    message: str


class Decision(BaseModel):
    """The outcome: the mode asked for, whether recovery is used, and why."""

    mode: RecoveryMode
    use_recovery: bool
    failures: list[Failure] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)

    def summary(self) -> str:
        """A few readable lines: the decision, then the reasons and failing conditions."""
        state = "on" if self.use_recovery else "off (full speculative states)"
        lines = [f"recovery: {state} [mode {self.mode.value}]"]
        lines += [f"  - {r}" for r in self.reasons]
        if self.failures:
            lines.append("failing conditions:")
            lines += [f"  - {f.name}: {f.message}" for f in self.failures]
        return "\n".join(lines)


class IneligibleError(ValueError):
    """Recovery was forced on a deployment that does not meet every condition."""

    def __init__(self, failures: list[Failure]) -> None:
        self.failures = list(failures)
        listed = "; ".join(f"{f.name}: {f.message}" for f in self.failures)
        super().__init__(
            f"recovery forced on (mode 'on') but {len(self.failures)} condition(s) fail: "
            f"{listed}"
        )


def _fmt_cap(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]} (SM{cap[0]}{cap[1]})"


def check_conditions(d: Deployment) -> list[Failure]:
    """Every failing condition of ``d``, in a fixed order (empty when eligible)."""
    out: list[Failure] = []

    def fail(name: str, message: str) -> None:
        out.append(Failure(name=name, message=message))

    if d.architecture not in SUPPORTED_ARCHITECTURES:
        fail("architecture",
             f"architecture {d.architecture} has no KDA/GDN recovery path; supported: "
             + ", ".join(SUPPORTED_ARCHITECTURES))
    method = d.normalised_spec_method
    if method is None:
        fail("spec_method", "no speculative decoding is configured; recovery needs MTP or "
             "DFlash drafts")
    elif method not in RECOVERY_SPEC_METHODS:
        fail("spec_method", f"speculative method {d.spec_method} is not supported; recovery "
             "needs a drafter that proposes one chain of tokens: "
             + ", ".join(RECOVERY_SPEC_METHODS))
    if method is not None and not MIN_NUM_SPEC <= d.num_spec <= MAX_NUM_SPEC:
        fail("num_spec", f"{d.num_spec} draft tokens per step; recovery needs "
             f"{MIN_NUM_SPEC}..{MAX_NUM_SPEC} (a verify window of at most 8 tokens)")
    if d.activation_dtype not in RECOVERY_ACTIVATION_DTYPES:
        fail("activation_dtype", f"activations are {d.activation_dtype}; recovery needs "
             + " or ".join(RECOVERY_ACTIVATION_DTYPES))
    if d.state_dtype not in ("float32", "auto"):
        fail("state_dtype", f"the recurrent state is {d.state_dtype}; recovery needs float32 "
             "(or auto, which is float32 for KDA)")
    if d.head_dim != 128:
        fail("head_dim", f"head dim is {d.head_dim}; recovery kernels need 128")
    if d.conv_width != 4:
        fail("conv_width", f"the short conv is {d.conv_width} wide; recovery's conv kernels "
             "need GLM-5.3's width of 4")
    if d.pipeline_parallel_size != 1:
        fail("pipeline_parallel_size", f"pipeline parallel size is "
             f"{d.pipeline_parallel_size}; recovery needs 1 (non-last pipeline ranks never "
             "run the commit)")
    if d.model_runner != "v2" and d.cache_mode == "align":
        fail("model_runner", f"model runner is {d.model_runner} with prefix caching (mamba "
             "cache mode align); recovery there needs vLLM's GPU model runner V2 "
             "(VLLM_USE_V2_MODEL_RUNNER=1), which moves the running-state block after the "
             "commit, or --no-enable-prefix-caching")
    if d.device == "cpu":
        if d.kernel_backend not in (None, "reference"):
            fail("kernel_backend", f"the {d.kernel_backend} backend needs a CUDA GPU; on the "
                 "CPU the PyTorch reference ops run")
    elif d.device != "cuda":
        fail("device", "recovery runs on CUDA GPUs and on vLLM's CPU platform only")
    elif d.gpu_capability is None:
        fail("gpu", "no CUDA GPU; recovery kernels need an NVIDIA GPU of compute "
             f"capability {_fmt_cap(MIN_GPU_CAPABILITY)} or newer")
    elif tuple(d.gpu_capability) < MIN_GPU_CAPABILITY:
        fail("gpu", f"GPU compute capability is {_fmt_cap(d.gpu_capability)}; recovery "
             f"needs {_fmt_cap(MIN_GPU_CAPABILITY)} or newer")
    if d.device == "cuda" and d.kernel_backend in (None, "reference"):
        fail("kernel_backend", "no recovery kernel backend is available; install Triton "
             "(or b12x on SM12x)")
    elif d.kernel_backend == "b12x" and (d.gpu_capability is None
                                         or d.gpu_capability[0] != 12):
        have = "no GPU" if d.gpu_capability is None else _fmt_cap(d.gpu_capability)
        fail("kernel_backend", f"the b12x backend runs only on SM12x GPUs, this is {have}; "
             "use the triton backend")
    if d.kv_connector in ("generic", "pd"):
        kind = ("a generic aligned KV connector" if d.kv_connector == "generic"
                else "prefill/decode disaggregation")
        fail("kv_connector", f"{kind} is configured; {CONNECTOR_MESSAGE}")
    if d.stochastic_rounding:
        fail("stochastic_rounding", "stochastic rounding is on; recovery needs it off (the "
             "commit must reproduce verify's state exactly)")
    return out


def decide(deployment: Deployment, mode: RecoveryMode | str = RecoveryMode.AUTO) -> Decision:
    """Decide whether ``deployment`` uses recovery under ``mode`` and say why.

    ``mode="on"`` raises :class:`IneligibleError` listing every failing condition.
    """
    try:
        m = RecoveryMode(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise ValueError(
            f"argument 'mode': expected one of auto, on, off, got {mode!r}"
        ) from None
    failures = check_conditions(deployment)
    arch = deployment.architecture
    if m is RecoveryMode.OFF:
        return Decision(mode=m, use_recovery=False, failures=failures, reasons=[
            "recovery turned off (--no-use-replayssm): full speculative states are kept, "
            f"{deployment.num_spec + 1} state copies per request and layer"
            if deployment.num_spec else
            "recovery turned off (--no-use-replayssm): full states are kept"
        ])
    cap = deployment.gpu_capability
    unproven = deployment.device == "cuda" and cap is not None and not is_proven_gpu(cap)
    if m is RecoveryMode.ON:
        if failures:
            raise IneligibleError(failures)
        reasons = [
            f"recovery forced on and every condition holds for {arch}: one checkpoint per "
            f"request and layer instead of {deployment.num_spec + 1}",
        ]
        if unproven:
            assert cap is not None
            reasons.append(f"SM{cap[0]}{cap[1]} is not yet proven in vLLM's GPU engine; "
                           "recovery runs there because it was asked for")
        return Decision(mode=m, use_recovery=True, reasons=reasons)
    # auto
    if failures:
        return Decision(mode=m, use_recovery=False, failures=failures, reasons=[
            f"{len(failures)} condition(s) fail, so full speculative states are kept: "
            + ", ".join(f.name for f in failures)
        ])
    if arch in OPT_IN_ARCHITECTURES:
        family = "Kimi" if arch in KIMI_ARCHITECTURES else "Qwen3-Next"
        return Decision(mode=m, use_recovery=False, reasons=[
            f"{arch} is eligible, but recovery is automatic only for GLM-5.3; {family} "
            "models use it when asked (mode on / --use-replayssm)"
        ])
    if unproven:
        assert cap is not None
        return Decision(mode=m, use_recovery=False, reasons=[unproven_gpu_reason(cap)])
    return Decision(mode=m, use_recovery=True, reasons=[
        f"every condition holds for {arch}: one checkpoint per request and layer instead "
        f"of {deployment.num_spec + 1}; use --no-use-replayssm (mode off) to keep full "
        "speculative states",
    ])
