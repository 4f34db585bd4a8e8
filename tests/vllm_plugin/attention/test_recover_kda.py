"""Metadata builders and the page layout vLLM sees, against the real vLLM classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.vllm_configs import MTP3, on_gpu, with_prefix_caching

S = 3


@pytest.fixture(scope="module")
def glm_cfg(build_config: Any) -> Any:
    return build_config(*MTP3)


@pytest.fixture(scope="module")
def model_classes(vllm_module: Any) -> Any:
    from vllm_recoverssm.vllm_plugin.models.glm5next import model

    return model


def mamba_spec(model_classes: Any, cfg: Any, *, recovery: bool, block_size: int = 16) -> Any:
    """The MambaSpec vLLM's platform builds from the model class (hybrid page sizing)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    cls = model_classes.RecoverGlm5NextForConditionalGeneration
    with on_gpu() if recovery else _nothing():
        shapes = cls.get_mamba_state_shape_from_config(cfg)
        dtypes = cls.get_mamba_state_dtype_from_config(cfg)
    return MambaSpec(shapes=tuple(shapes), dtypes=tuple(dtypes), block_size=block_size,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                     mamba_cache_mode=cfg.cache_config.mamba_cache_mode,
                     num_speculative_blocks=0 if recovery else S)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_page_size_vllm_sees_equals_the_planners(
    glm_cfg: Any, model_classes: Any, tiny_glm: Path
) -> None:
    from vllm_recoverssm.config.models import model_spec_from_hf_config
    from vllm_recoverssm.state.planner import PlanConfig, plan

    spec = model_spec_from_hf_config(json.loads((tiny_glm / "config.json").read_text()))
    p = plan(PlanConfig(model=spec, tp=1, num_spec=S))
    recovery = mamba_spec(model_classes, glm_cfg, recovery=True)
    native = mamba_spec(model_classes, glm_cfg, recovery=False)
    # the records live in a scratch, so the page is vLLM's own conv + state in both modes
    assert len(recovery.shapes) == len(native.shapes) == 2
    assert recovery.page_size_bytes == p.layout("recovery_scratch").page_bytes
    assert native.page_size_bytes == p.layout("full").page_bytes
    assert recovery.page_size_bytes == native.page_size_bytes
    # per request: one recovery page against S+1 native pages
    assert recovery.max_memory_usage_bytes(glm_cfg) == recovery.page_size_bytes
    assert native.max_memory_usage_bytes(glm_cfg) == (S + 1) * native.page_size_bytes


def test_align_mode_reserve_vllm_sees_equals_the_planners(
    glm_cfg: Any, model_classes: Any, tiny_glm: Path
) -> None:
    """With prefix caching vLLM keeps 2 (+S) pages per request; the planner agrees."""
    from vllm_recoverssm.config.models import model_spec_from_hf_config
    from vllm_recoverssm.state.planner import PlanConfig, plan

    cfg = with_prefix_caching(glm_cfg, block_size=16)
    spec = model_spec_from_hf_config(json.loads((tiny_glm / "config.json").read_text()))
    p = plan(PlanConfig(model=spec, tp=1, num_spec=S, cache_mode="align", block_size=16))
    recovery = mamba_spec(model_classes, cfg, recovery=True)
    native = mamba_spec(model_classes, cfg, recovery=False)
    assert recovery.mamba_cache_mode == native.mamba_cache_mode == "align"
    for name, vllm_spec in (("recovery_scratch", recovery), ("full", native)):
        layout = p.layout(name)
        assert vllm_spec.page_size_bytes == layout.page_bytes
        assert vllm_spec.max_memory_usage_bytes(cfg) == layout.reserve_bytes_per_layer
    assert recovery.max_memory_usage_bytes(cfg) == 2 * recovery.page_size_bytes
    assert native.max_memory_usage_bytes(cfg) == (2 + S) * native.page_size_bytes


def common_metadata(query_lens: list[int], seq_lens: list[int], table: list[list[int]],
                    prefilling: list[bool]) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(query_lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        is_prefilling=torch.tensor(prefilling),
    )


def builders(glm_cfg: Any, model_classes: Any, block_size: int = 16) -> tuple[Any, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from vllm_recoverssm.vllm_plugin.attention.recover_kda import RecoverKDAMetadataBuilder

    layers = ["model.layers.0.linear_attn"]
    with set_current_vllm_config(glm_cfg):
        generic = GDNAttentionMetadataBuilder(
            mamba_spec(model_classes, glm_cfg, recovery=False, block_size=block_size),
            layers, glm_cfg, torch.device("cpu"))
        recovery = RecoverKDAMetadataBuilder(
            mamba_spec(model_classes, glm_cfg, recovery=True, block_size=block_size),
            layers, glm_cfg, torch.device("cpu"))
    return generic, recovery


TABLE = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]


def test_recovery_builder_narrows_to_one_column_generic_keeps_s_plus_1(
    glm_cfg: Any, model_classes: Any
) -> None:
    generic, recovery = builders(glm_cfg, model_classes)
    m = common_metadata([S + 1, S + 1], [10, 12], TABLE[:2], [False, False])
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    drafts = torch.tensor([S, S], dtype=torch.int32)
    g = generic.build(0, m, accepted, drafts)
    r = recovery.build(0, m, accepted, drafts)
    assert g.spec_state_indices_tensor.shape == (2, S + 1)
    assert g.spec_state_indices_tensor.tolist() == TABLE[:2]
    assert g.num_accepted_tokens.tolist() == [2, 1]
    assert r.spec_state_indices_tensor.shape == (2, 1)
    assert r.spec_state_indices_tensor.tolist() == [[5], [9]]
    assert r.num_accepted_tokens.tolist() == [1, 1]  # zero speculative offset
    assert r.spec_request_rows.tolist() == [0, 1]
    assert r.spec_slots().tolist() == [5, 9]
    # everything else is vLLM's own metadata, unchanged
    assert (r.num_spec_decodes, r.num_spec_decode_tokens) == (2, 2 * (S + 1))
    assert r.spec_query_start_loc.tolist() == g.spec_query_start_loc.tolist()


def test_mixed_batch_keeps_prefill_rows_on_vllms_path(glm_cfg: Any, model_classes: Any) -> None:
    generic, recovery = builders(glm_cfg, model_classes)
    m = common_metadata([S + 1, 5, 2], [10, 5, 20], TABLE, [False, True, False])
    accepted = torch.tensor([3, 1, 2], dtype=torch.int32)
    drafts = torch.tensor([S, -1, 1], dtype=torch.int32)
    g = generic.build(0, m, accepted, drafts)
    r = recovery.build(0, m, accepted, drafts)
    assert g.spec_state_indices_tensor.shape == (2, S + 1)
    assert r.spec_state_indices_tensor.tolist() == [[5], [13]]
    assert r.spec_request_rows.tolist() == [0, 2]
    assert r.num_prefills == g.num_prefills == 1
    assert r.non_spec_state_indices_tensor.tolist() == [9]
    assert r.non_spec_token_indx.tolist() == g.non_spec_token_indx.tolist()


def test_align_mode_reads_the_block_of_the_last_scheduled_token(
    glm_cfg: Any, model_classes: Any
) -> None:
    """Prefix caching: one aligned state column per row, plus what commit needs."""
    B = 4
    cfg = with_prefix_caching(glm_cfg, block_size=B)
    generic, recovery = builders(cfg, model_classes, block_size=B)
    assert hasattr(recovery, "mamba_aligned_state_indices")  # runner V2's opt-in
    # wide enough for the generic builder's 1+S columns from the aligned one
    table = [[5, 6, 7, 8, 20, 21, 22], [9, 10, 11, 12, 23, 24, 25],
             [13, 14, 15, 16, 17, 26, 27]]
    # seq_lens after the step's tokens: blocks (seq_len - 1) // B = 2, 1 and 3
    m = common_metadata([S + 1, S + 1, S + 1], [9, 8, 13], table, [False] * 3)
    accepted = torch.tensor([1, 1, 1], dtype=torch.int32)
    drafts = torch.tensor([S, S, S], dtype=torch.int32)
    r = recovery.build(0, m, accepted, drafts)
    assert r.spec_state_indices_tensor.tolist() == [[7], [10], [16]]
    assert r.align is not None and r.align.block_size == B
    assert r.align.num_computed_tokens.tolist() == [5, 4, 9]
    assert r.align.block_table.tolist() == table
    g = generic.build(0, m, accepted, drafts)
    assert g.spec_state_indices_tensor.tolist() == [[7, 8, 20, 21], [10, 11, 12, 23],
                                                    [16, 17, 26, 27]]
    # without prefix caching there is no align information
    plain = builders(glm_cfg, model_classes)[1].build(
        0, common_metadata([S + 1], [10], [[5]], [False]), accepted[:1], drafts[:1])
    assert plain.align is None


def test_null_block_becomes_the_null_slot(vllm_module: Any) -> None:
    from vllm_recoverssm.vllm_plugin.worker.state_layout import to_ops_slots

    assert to_ops_slots(torch.tensor([0, 3, 0, 7])).tolist() == [-1, 3, -1, 7]
