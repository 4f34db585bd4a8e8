"""Stand-in for ``vllm/vllm_flash_attn/__init__.py`` (GPU engine tests only): answers "not
supported" for every FlashAttention version.

Why it is needed: vLLM's own package init refuses to import when neither compiled
FlashAttention extension (_vllm_fa2_C / _vllm_fa3_C) loads, and
``v1/attention/backends/fa_utils.py`` imports it unconditionally on CUDA. Here the interface
module is imported as it is: it finds neither extension, so ``is_fa_version_supported``
answers False for every version and vLLM's attention selection treats FlashAttention as not
available. Its functions are re-exported only so that importing modules succeed; calling
one fails inside the interface module.
"""

from vllm.vllm_flash_attn.flash_attn_interface import (  # noqa: F401
    FA2_AVAILABLE,
    FA3_AVAILABLE,
    compile_flash_attn_varlen_func_from_specs,
    fa_version_unsupported_reason,
    flash_attn_varlen_func,
    get_scheduler_metadata,
    is_fa_version_supported,
)
