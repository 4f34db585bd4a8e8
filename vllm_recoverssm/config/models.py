"""Model specs: the dimensions the memory planner needs, shipped with the package.

Each built-in spec cites the public configuration every value comes from. A Hugging Face
``config.json`` can be loaded too (:func:`load_hf_config`); the architecture decides how
it is read (GLM-5.3 ``glm5_next``, Kimi-Linear / Kimi-K3 ``kimi_linear``, Qwen3-Next
``qwen3_next``). A malformed or incomplete file raises :class:`ModelConfigError` with a
one-line message naming the file and the field.

Linear-attention layers are described in vLLM's terms (``MambaStateShapeCalculator`` in
``vllm/model_executor/layers/mamba/mamba_utils.py``): ``linear_num_heads`` value heads of
``linear_head_dim`` (the recurrent state is ``[heads, V, K]``), ``linear_num_k_heads`` key
heads of ``linear_k_head_dim``; the conv channels are ``H*V + 2*Hk*K``
(``kda_state_shape``, ``gated_delta_net_state_shape``). For KDA the
key and value heads are the same.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .eligibility import (
    GLM53_ARCHITECTURES,
    KIMI_ARCHITECTURES,
    QWEN3_NEXT_ARCHITECTURES,
)


class ModelConfigError(ValueError):
    """A model config that cannot be read: the message names the file and the field."""


class AttentionSpec(BaseModel):
    """The softmax-attention layers' KV cache, per token and per layer.

    ``mla``: one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token,
    the same on every TP rank (vLLM's MLA cache is not sharded by TP); DSA models add a
    sparse-indexer key cache of ``index_head_dim + index_head_dim // 128 * 4`` bytes
    (FP8 values plus one FP32 scale per 128) per ``index_kpool`` tokens, plus a small
    per-request tail ring of raw BF16 keys and gate scores
    (``vllm/models/glm5next/common/attention.py``).
    ``gqa``: K and V of ``max(1, num_kv_heads // tp)`` heads of ``head_dim`` per rank.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["mla", "gqa"]
    kv_lora_rank: int = Field(default=0, ge=0)
    qk_rope_head_dim: int = Field(default=0, ge=0)
    index_head_dim: int = Field(default=0, ge=0)
    index_kpool: int = Field(default=1, ge=1)
    num_kv_heads: int = Field(default=0, ge=0)
    head_dim: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _complete(self) -> AttentionSpec:
        if self.kind == "mla" and self.kv_lora_rank + self.qk_rope_head_dim <= 0:
            raise ValueError("an MLA cache needs kv_lora_rank + qk_rope_head_dim > 0")
        if self.kind == "gqa" and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise ValueError("a GQA cache needs num_kv_heads > 0 and head_dim > 0")
        return self

    def bytes_per_token(self, tp: int, kv_bytes: int) -> int:
        """KV bytes one token occupies in one attention layer on one GPU."""
        if self.kind == "mla":
            latent = (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes
            return latent
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * kv_bytes

    def indexer_bytes_per_state(self) -> int:
        """Bytes of one sparse-indexer entry (covers ``index_kpool`` tokens); 0 if none."""
        if self.index_head_dim == 0:
            return 0
        return self.index_head_dim + self.index_head_dim // 128 * 4

    def tail_ring_bytes(self, num_spec: int) -> int:
        """Per-request indexer tail ring of one layer (``Glm5NextTailCache``); 0 if none.

        ``ring = kpool * next_pow2(ceil((kpool + S) / kpool))`` slots of raw BF16 K and
        gate score (``attention.py``).
        """
        if self.index_head_dim == 0 or self.index_kpool <= 1:
            return 0
        kp = self.index_kpool
        pools = -(-(kp + num_spec) // kp)
        ring = kp * (1 << (pools - 1).bit_length())
        return ring * 2 * self.index_head_dim * 2


class ModelSpec(BaseModel):
    """What the planner needs to know about a hybrid linear-attention model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    architecture: str = Field(min_length=1)
    kind: Literal["kda", "gdn"]
    num_layers: int = Field(ge=1)
    num_linear_layers: int = Field(ge=1)
    num_attention_layers: int = Field(ge=0)
    linear_num_heads: int = Field(ge=1)
    linear_head_dim: int = Field(ge=1)
    linear_num_k_heads: int = Field(ge=1)
    linear_k_head_dim: int = Field(ge=1)
    conv_kernel: int = Field(ge=1)
    lower_bound: float | None = None
    attention: AttentionSpec | None = None
    num_mtp_layers: int = Field(default=0, ge=0)
    max_model_len: int = Field(ge=1)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    source: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.num_linear_layers + self.num_attention_layers != self.num_layers:
            raise ValueError(
                f"num_linear_layers ({self.num_linear_layers}) + num_attention_layers "
                f"({self.num_attention_layers}) must equal num_layers ({self.num_layers})"
            )
        if self.num_attention_layers and self.attention is None:
            raise ValueError("a model with attention layers needs an attention spec")
        if self.kind == "kda" and (self.linear_num_k_heads != self.linear_num_heads
                                   or self.linear_k_head_dim != self.linear_head_dim):
            raise ValueError("KDA uses the same key and value heads and head dims")
        return self

    @property
    def conv_channels(self) -> int:
        """Conv channels of one linear layer over all ranks: ``H*V + 2*Hk*K``."""
        return (self.linear_num_heads * self.linear_head_dim
                + 2 * self.linear_num_k_heads * self.linear_k_head_dim)


# ---------------------------------------------------------------------------------------
# Built-in specs
# ---------------------------------------------------------------------------------------

GLM_5_3 = ModelSpec(
    name="glm-5.3",
    architecture="Glm5NextForConditionalGeneration",
    kind="kda",
    # transformers 5.19 Glm5NextTextConfig (checkpoint zai-org/GLM-5.3-Flash),
    # models/glm5_next/configuration_glm5_next.py:
    num_layers=45,  # num_hidden_layers
    # default layer_types: KDA where idx % 4 != 3 -> 34 KDA + 11 DSA/MLA
    num_linear_layers=34,
    num_attention_layers=11,
    linear_num_heads=64,  # linear_num_heads
    linear_head_dim=128,  # linear_head_dim
    linear_num_k_heads=64,  # KDA: key heads == value heads
    linear_k_head_dim=128,
    conv_kernel=4,  # linear_conv_kernel_dim
    lower_bound=-5.0,  # linear_lower_bound
    attention=AttentionSpec(
        kind="mla",
        kv_lora_rank=512,  # kv_lora_rank
        qk_rope_head_dim=0,  # qk_rope_head_dim (NoPE)
        index_head_dim=128,  # index_head_dim
        index_kpool=16,  # index_kpool (the fork's 300B checkpoint ships 4)
    ),
    # one MTP layer (MLA, never KDA): num_nextn_predict_layers=1 in the
    # local-inference-lab/vllm fork config; vllm/models/glm5next/common/model.py
    num_mtp_layers=1,
    max_model_len=1048576,  # max_position_embeddings
    source="transformers 5.19 Glm5NextTextConfig defaults (zai-org/GLM-5.3-Flash)",
)

KIMI_LINEAR = ModelSpec(
    name="kimi-linear",
    architecture="KimiLinearForCausalLM",
    kind="kda",
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json:
    num_layers=27,  # "num_hidden_layers": 27
    # "linear_attn_config": "kda_layers" lists 20 layers, "full_attn_layers"
    # [4, 8, 12, 16, 20, 24, 27] (1-based) -> 7 MLA layers
    num_linear_layers=20,
    num_attention_layers=7,
    linear_num_heads=32,  # linear_attn_config "num_heads": 32
    linear_head_dim=128,  # linear_attn_config "head_dim": 128
    linear_num_k_heads=32,
    linear_k_head_dim=128,
    conv_kernel=4,  # linear_attn_config "short_conv_kernel_size": 4
    lower_bound=None,  # no "gate_lower_bound": softplus gate
    attention=AttentionSpec(
        kind="mla",
        kv_lora_rank=512,  # "kv_lora_rank": 512
        qk_rope_head_dim=64,  # "qk_rope_head_dim": 64
    ),
    num_mtp_layers=0,  # "num_nextn_predict_layers": 0
    max_model_len=1048576,  # "model_max_length": 1048576
    source="moonshotai/Kimi-Linear-48B-A3B-Instruct config.json",
)

QWEN3_NEXT_80B_A3B = ModelSpec(
    name="qwen3-next-80b-a3b",
    architecture="Qwen3NextForCausalLM",
    kind="gdn",
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json; apart from the context length these
    # are also the defaults of transformers' Qwen3NextConfig
    # (models/qwen3_next/configuration_qwen3_next.py):
    num_layers=48,  # "num_hidden_layers": 48
    # "full_attention_interval": 4 -> every 4th layer full attention: 36 GDN + 12
    num_linear_layers=36,
    num_attention_layers=12,
    linear_num_heads=32,  # "linear_num_value_heads": 32
    linear_head_dim=128,  # "linear_value_head_dim": 128
    linear_num_k_heads=16,  # "linear_num_key_heads": 16
    linear_k_head_dim=128,  # "linear_key_head_dim": 128
    conv_kernel=4,  # "linear_conv_kernel_dim": 4
    lower_bound=None,
    attention=AttentionSpec(
        kind="gqa",
        num_kv_heads=2,  # "num_key_value_heads": 2
        head_dim=256,  # "head_dim": 256
    ),
    num_mtp_layers=1,  # "mtp_num_hidden_layers": 1
    max_model_len=262144,  # "max_position_embeddings": 262144
    source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
)

BUILTIN_MODELS: dict[str, ModelSpec] = {
    m.name: m for m in (GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B)
}
_ALIASES = {
    "glm5.3": "glm-5.3", "glm-5.3-flash": "glm-5.3", "glm5next": "glm-5.3",
    "kimi_linear": "kimi-linear", "kimi-linear-48b-a3b": "kimi-linear",
    "qwen3-next": "qwen3-next-80b-a3b", "qwen3_next": "qwen3-next-80b-a3b",
}


def get_model_spec(name: str) -> ModelSpec:
    """A built-in spec by name (``glm-5.3``, ``kimi-linear``, ``qwen3-next-80b-a3b``)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    try:
        return BUILTIN_MODELS[key]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)} "
            "(or pass --config path/config.json)"
        ) from None


# ---------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------


MAX_CONFIG_BYTES = 4 * 2**20
"""A Hugging Face config.json is a few KiB; anything past this is not one."""
MAX_DIMENSION = 2**20
"""Bound of every count and size read from a config (layers, heads, dims, ranks)."""
MAX_LAYERS = 4096
MAX_CONTEXT = 2**31


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


class _Reader:
    """Typed field access into one config dict, with errors naming the file and field."""

    def __init__(self, data: dict[str, Any], where: str, prefix: str = "") -> None:
        self.data = data
        self.where = where
        self.prefix = prefix

    def _err(self, key: str, what: str) -> ModelConfigError:
        return ModelConfigError(f"{self.where}: field '{self.prefix}{key}' {what}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def integer(self, key: str, default: int | None = None, minimum: int = 0,
                maximum: int = MAX_DIMENSION) -> int:
        v = self.data.get(key, default)
        if v is None:
            raise self._err(key, "is missing")
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(key, f"must be an integer, got {_short(v)}")
        if v < minimum:
            raise self._err(key, f"must be >= {minimum}, got {_short(v)}")
        if v > maximum:
            raise self._err(key, f"must be <= {maximum}, got {_short(v)}")
        return v

    def opt_float(self, key: str, default: float | None = None) -> float | None:
        v = self.data.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._err(key, f"must be a number, got {_short(v)}")
        if not math.isfinite(float(v)) or abs(v) > MAX_DIMENSION:
            raise self._err(key, f"must be a finite number of at most {MAX_DIMENSION}, got "
                                 f"{_short(v)}")
        return float(v)

    def obj(self, key: str) -> _Reader:
        v = self.data.get(key)
        if not isinstance(v, dict):
            raise self._err(key, "is missing" if v is None else
                            f"must be an object, got {_short(v)}")
        return _Reader(v, self.where, f"{self.prefix}{key}.")

    def int_list(self, key: str) -> list[int]:
        v = self.data.get(key)
        if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v
        ):
            raise self._err(key, "is missing" if v is None else f"must be a list of integers, "
                            f"got {_short(v)}")
        return v

    def str_list(self, key: str) -> list[str] | None:
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self._err(key, f"must be a list of strings, got {_short(v)}")
        return v


def _dtype(r: _Reader) -> Literal["bfloat16", "float16", "float32"]:
    v = r.data.get("torch_dtype", r.data.get("dtype", "bfloat16"))
    aliases = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16",
               "float32": "float32", "float": "float32"}
    if not isinstance(v, str) or v.removeprefix("torch.") not in aliases:
        raise r._err("torch_dtype", f"must be bfloat16, float16 or float32, got {_short(v)}")
    return aliases[v.removeprefix("torch.")]  # type: ignore[return-value]


def _max_len(r: _Reader, default: int) -> int:
    for key in ("max_position_embeddings", "model_max_length"):
        if r.has(key):
            return r.integer(key, minimum=1, maximum=MAX_CONTEXT)
    return default


def _layer_counts(r: _Reader, n: int, linear_name: str,
                  default_linear: list[bool]) -> tuple[int, int]:
    types = r.str_list("layer_types")
    if types is None:
        lin = sum(default_linear)
        return lin, n - lin
    if len(types) != n:
        raise r._err("layer_types", f"has {len(types)} entries but num_hidden_layers is {n}")
    lin = sum(t == linear_name for t in types)
    return lin, n - lin


def _glm(r: _Reader, arch: str, name: str) -> ModelSpec:
    n = r.integer("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    heads, dim = r.integer("linear_num_heads", 64, 1), r.integer("linear_head_dim", 128, 1)
    conv = r.integer("linear_conv_kernel_dim", 4, 1)
    lower = r.opt_float("linear_lower_bound", -5.0)
    if r.has("linear_attn_config"):
        la = r.obj("linear_attn_config")
        heads = la.integer("num_heads", heads, 1)
        dim = la.integer("head_dim", dim, 1)
        conv = la.integer("short_conv_kernel_size", conv, 1)
        lower = la.opt_float("gate_lower_bound", lower)
        if lower is None and la.data.get("safe_gate", True):
            lower = -5.0
    lin, att = _layer_counts(r, n, "linear_attention", [i % 4 != 3 for i in range(n)])
    if r.has("linear_attn_config") and r.str_list("layer_types") is None \
            and "kda_layers" in r.data["linear_attn_config"]:
        kda = r.obj("linear_attn_config").int_list("kda_layers")
        lin, att = len(kda), n - len(kda)
    return ModelSpec(
        name=name, architecture=arch, kind="kda", num_layers=n, num_linear_layers=lin,
        num_attention_layers=att, linear_num_heads=heads, linear_head_dim=dim,
        linear_num_k_heads=heads, linear_k_head_dim=dim, conv_kernel=conv,
        lower_bound=lower,
        attention=AttentionSpec(
            kind="mla", kv_lora_rank=r.integer("kv_lora_rank", 512),
            qk_rope_head_dim=r.integer("qk_rope_head_dim", 0),
            index_head_dim=r.integer("index_head_dim", 128) if r.data.get("index_topk", 1) else 0,
            index_kpool=r.integer("index_kpool", 16, 1),
        ),
        num_mtp_layers=r.integer("num_nextn_predict_layers", 0),
        max_model_len=_max_len(r, 1048576), dtype=_dtype(r), source=r.where,
    )


def _kimi(r: _Reader, arch: str, name: str) -> ModelSpec:
    n = r.integer("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    la = r.obj("linear_attn_config")
    kda = la.int_list("kda_layers")
    full = la.int_list("full_attn_layers")
    if len(kda) + len(full) != n:
        raise r._err("linear_attn_config", f"lists {len(kda)} KDA + {len(full)} full-attention "
                     f"layers but num_hidden_layers is {n}")
    heads = la.integer("num_heads", minimum=1)
    dim = la.integer("head_dim", minimum=1)
    return ModelSpec(
        name=name, architecture=arch, kind="kda", num_layers=n, num_linear_layers=len(kda),
        num_attention_layers=len(full), linear_num_heads=heads, linear_head_dim=dim,
        linear_num_k_heads=heads, linear_k_head_dim=dim,
        conv_kernel=la.integer("short_conv_kernel_size", 4, 1),
        lower_bound=la.opt_float("gate_lower_bound"),
        attention=AttentionSpec(kind="mla", kv_lora_rank=r.integer("kv_lora_rank", minimum=1),
                                qk_rope_head_dim=r.integer("qk_rope_head_dim", 0)),
        num_mtp_layers=r.integer("num_nextn_predict_layers", 0),
        max_model_len=_max_len(r, 1048576), dtype=_dtype(r), source=r.where,
    )


def _qwen3_next(r: _Reader, arch: str, name: str) -> ModelSpec:
    n = r.integer("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    interval = r.integer("full_attention_interval", 4, 1)
    lin, att = _layer_counts(r, n, "linear_attention",
                             [(i + 1) % interval != 0 for i in range(n)])
    return ModelSpec(
        name=name, architecture=arch, kind="gdn", num_layers=n, num_linear_layers=lin,
        num_attention_layers=att,
        linear_num_heads=r.integer("linear_num_value_heads", minimum=1),
        linear_head_dim=r.integer("linear_value_head_dim", minimum=1),
        linear_num_k_heads=r.integer("linear_num_key_heads", minimum=1),
        linear_k_head_dim=r.integer("linear_key_head_dim", minimum=1),
        conv_kernel=r.integer("linear_conv_kernel_dim", 4, 1),
        attention=AttentionSpec(kind="gqa",
                                num_kv_heads=r.integer("num_key_value_heads", minimum=1),
                                head_dim=r.integer("head_dim", minimum=1)),
        num_mtp_layers=r.integer("mtp_num_hidden_layers", 0),
        max_model_len=_max_len(r, 262144), dtype=_dtype(r), source=r.where,
    )


def model_spec_from_hf_config(data: object, where: str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed Hugging Face config dict."""
    if not isinstance(data, dict):
        raise ModelConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    top = _Reader(data, where)
    archs = top.str_list("architectures")
    if not archs:
        raise ModelConfigError(f"{where}: field 'architectures' is missing")
    arch = archs[0]
    text = top
    if data.get("text_config") is not None:
        text = top.obj("text_config")
        if "torch_dtype" not in text.data and "dtype" not in text.data:
            text.data = {**text.data, "torch_dtype": data.get("torch_dtype",
                                                            data.get("dtype", "bfloat16"))}
    name = Path(where).parent.name or arch
    try:
        if arch in GLM53_ARCHITECTURES:
            return _glm(text, arch, name)
        if arch in KIMI_ARCHITECTURES:
            return _kimi(text, arch, name)
        if arch in QWEN3_NEXT_ARCHITECTURES:
            return _qwen3_next(text, arch, name)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        raise ModelConfigError(f"{where}: {loc}: {err['msg']}") from None
    supported = GLM53_ARCHITECTURES + KIMI_ARCHITECTURES + QWEN3_NEXT_ARCHITECTURES
    raise ModelConfigError(
        f"{where}: field 'architectures' is {arch!r}; supported: {', '.join(supported)}"
    )


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a file, or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    text = _read_config_text(p)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(
            f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise ModelConfigError(f"{p}: not a model config (JSON nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal of thousands of digits
        raise ModelConfigError(f"{p}: not a model config ({exc})") from None
    return model_spec_from_hf_config(data, str(p))


def _read_config_text(p: Path) -> str:
    """The file's text: a regular file of at most ``MAX_CONFIG_BYTES``, opened without
    waiting (a FIFO or a device is refused, never read)."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: no such file") from None
    except OSError as exc:
        raise ModelConfigError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelConfigError(f"{p}: not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ModelConfigError(
                f"{p}: {st.st_size:,} bytes, a config.json has at most {MAX_CONFIG_BYTES:,}"
            )
        raw = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ModelConfigError(f"{p}: cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{p}: more than {MAX_CONFIG_BYTES:,} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{p}: cannot read: {exc}") from None
