"""The checkpoint connector's parts against vLLM's real configs, specs, tensors and
requests, and LMCache's real RAM backend (through the checkpoint store).

What the engine tests cannot reach on vLLM's CPU engine is here: attention KV blocks in a
bundle (the tiny CPU model is all KDA: GLM-5.3's MLA has no CPU kernels), tensor-parallel
completeness, and every start-up refusal.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.bundles import through_ram_store
from tests.support.kda_layers import bind_pages, make_layer, prompt_meta
from tests.support.tiny_glm import HEAD_DIM, LINEAR_HEADS, write_tiny_qwen3_next
from tests.support.vllm_configs import (
    MTP3,
    kv_cache_configs,
    on_gpu,
    with_prefix_caching,
    with_recovery_mode,
)
from vllm_recoverssm.checkpoint import RequestCheckpoint
from vllm_recoverssm.config import IneligibleError

CONNECTOR = "RecoverSSMCheckpointConnector"
GOOD = {"request_boundary_checkpoints": True, "backend": "ram", "checkpoint_interval": 16}


def kv_arg(extra: dict[str, Any], name: str = CONNECTOR, role: str = "kv_both") -> list[str]:
    return ["--kv-transfer-config", json.dumps(
        {"kv_connector": name, "kv_role": role, "kv_connector_extra_config": extra})]


# -- settings and start-up ------------------------------------------------------------------

def _bad_settings(tmp_path: Path) -> list[tuple[dict[str, Any], str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [
        ({"backend": "tape"}, "['backend']"),
        ({"backend": "disk"}, "['path']"),
        ({"backend": "disk", "path": "relative/dir"}, "['path']"),
        ({"backend": "disk", "path": str(a_file / "sub")}, "['path']"),
        ({"backend": "ram", "path": str(tmp_path)}, "['path']"),
        ({"checkpoint_interval": 0}, "['checkpoint_interval']"),
        ({"checkpoint_interval": -16}, "['checkpoint_interval']"),
        ({"checkpoint_interval": "64"}, "['checkpoint_interval']"),
        ({"checkpoint_interval": True}, "['checkpoint_interval']"),
        ({"request_boundary_checkpoints": False}, "['request_boundary_checkpoints']"),
        ({"interval": 16}, "['interval']"),
        ({"ram_bytes": 1024}, "['ram_bytes']"),
        ({"_test_capture_stage": "pre_commit"}, "['_test_capture_stage']"),
    ]


def test_every_bad_setting_is_one_line_naming_its_key(tmp_path: Path, vllm_module: Any) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.settings import (
        ConnectorSettingsError,
        parse_settings,
    )

    os.environ.pop("VLLM_RECOVERSSM_TESTING", None)
    for override, key in _bad_settings(tmp_path):
        with pytest.raises(ConnectorSettingsError) as info:
            parse_settings({**GOOD, **override}, "kv_both")
        text = str(info.value)
        assert text.startswith(f"kv_connector_extra_config{key}:"), (override, text)
        assert "\n" not in text
    with pytest.raises(ConnectorSettingsError, match="^kv_role: .*'kv_both'"):
        parse_settings(GOOD, "kv_producer")
    disk = parse_settings({**GOOD, "backend": "disk", "path": str(tmp_path / "new")}, "kv_both")
    assert disk.path == tmp_path / "new" and disk.path.is_dir()  # created at start-up
    assert disk.checkpoint_config().backend == "disk"


@pytest.mark.parametrize("override, key", [
    ({"backend": "tape"}, "['backend']"),
    ({"backend": "disk"}, "['path']"),
    ({"checkpoint_interval": 0}, "['checkpoint_interval']"),
], ids=["backend", "path", "interval"])
def test_bad_settings_fail_when_the_engine_config_is_built(
    build_config: Any, override: dict[str, Any], key: str,
) -> None:
    """``vllm serve`` and ``LLM(...)`` build their config through ``EngineArgs``: the
    connector's settings are checked there, before any engine process starts."""
    with pytest.raises(ValueError) as info:
        build_config(*MTP3, *kv_arg({**GOOD, **override}))
    assert str(info.value).startswith(f"kv_connector_extra_config{key}:")
    assert "\n" not in str(info.value)


def test_a_good_connector_keeps_recovery_and_recomputes_failed_loads(build_config: Any) -> None:
    from vllm_recoverssm.vllm_plugin.config import decide_for_vllm_config, kv_connector_kind
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.settings import (
        DEFAULT_INTERVAL,
        checkpoint_interval,
        settings_from_config,
    )

    cfg = build_config(*MTP3, *kv_arg({k: v for k, v in GOOD.items()
                                       if k != "checkpoint_interval"}))
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert kv_connector_kind(cfg) == "request_boundary"
    with on_gpu():
        assert decide_for_vllm_config(cfg).use_recovery  # eligibility keeps recovery on
    settings = settings_from_config(cfg)
    assert checkpoint_interval(settings, cfg) == DEFAULT_INTERVAL == 64
    # with prefix caching the default follows the state block size
    assert checkpoint_interval(settings, with_prefix_caching(cfg, 32)) == 32


def test_start_up_refuses_what_the_connector_cannot_checkpoint(
    build_config: Any, tmp_path: Path,
) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.startup import (
        ConnectorRefusedError,
        check_kv_connector,
    )

    cfg = build_config(*MTP3, *kv_arg(GOOD))
    with pytest.raises(ConnectorRefusedError,
                       match="prefix caching .* needs vLLM's model runner V2.*"
                             "--no-enable-prefix-caching"):
        check_kv_connector(with_prefix_caching(cfg, 16))
    sched = copy.copy(cfg.scheduler_config)
    sched.async_scheduling = True
    async_cfg = copy.copy(cfg)
    object.__setattr__(async_cfg, "scheduler_config", sched)
    with pytest.raises(ConnectorRefusedError,
                       match="asynchronous scheduling needs vLLM's model runner V2.*"
                             "--no-async-scheduling"):
        check_kv_connector(async_cfg)
    with on_gpu():  # runner V2 (vLLM's GPU default): async scheduling, prefix caching
        check_kv_connector(cfg)
        check_kv_connector(async_cfg)
        check_kv_connector(with_prefix_caching(async_cfg, 16))
    qwen = write_tiny_qwen3_next(tmp_path / "qwen3-next")
    with pytest.raises(ValueError, match="is not GLM-5.3"):
        build_config(*MTP3, *kv_arg(GOOD), model=qwen)


def test_lmcache_connectors_are_refused_where_they_cannot_be_correct(build_config: Any) -> None:
    from vllm_recoverssm.vllm_plugin.config import decide_for_vllm_config
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.startup import check_kv_connector

    with pytest.raises(ValueError, match="LMCacheConnectorV1 cannot store GLM-5.3"):
        build_config(*MTP3, *kv_arg({}, "LMCacheConnectorV1"))
    with pytest.raises(ValueError, match="LMCacheMPConnector stores block-aligned"):
        build_config(*MTP3, *kv_arg({}, "LMCacheMPConnector"))
    # with prefix caching LMCache's own path stands, under full state only
    mp = _with_connector(build_config(*MTP3), "LMCacheMPConnector")
    aligned = with_prefix_caching(mp, 16)
    check_kv_connector(aligned)
    with on_gpu():
        auto = decide_for_vllm_config(aligned)
        assert not auto.use_recovery
        assert [f.name for f in auto.failures] == ["kv_connector"]
        with pytest.raises(IneligibleError, match="kv_connector"):
            decide_for_vllm_config(with_recovery_mode(aligned, "on"))


def _with_connector(cfg: Any, name: str) -> Any:
    from vllm.config import KVTransferConfig

    out = copy.copy(cfg)
    object.__setattr__(out, "kv_transfer_config",
                       KVTransferConfig(kv_connector=name, kv_role="kv_both"))
    return out


# -- state taps inside a prefill chunk ---------------------------------------------------------

def _rows(layer: Any, cfg: Any, qkv: torch.Tensor, g1: torch.Tensor, beta: torch.Tensor,
          qsl: list[int], slots: list[int], has_state: list[bool]) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    meta = prompt_meta(qsl, slots, has_state)
    out = torch.zeros(1, qsl[-1], LINEAR_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with set_forward_context({layer.prefix: meta}, cfg):
        layer._forward(qkv, g1, beta, out)
    return out


@pytest.mark.parametrize("recovery", [True, False], ids=["recovery", "full-state"])
def test_state_taps_copy_the_state_inside_a_chunk_and_change_nothing(
    build_config: Any, distributed: None, recovery: bool,
) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector import taps
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import BundleKey

    cfg = build_config(*MTP3)
    layer = make_layer(cfg, recovery=recovery)
    bind_pages(layer, cfg, 8)
    h, d = LINEAR_HEADS, HEAD_DIM
    gen = torch.Generator().manual_seed(21)
    T = 9
    qkv = torch.randn(T, 3 * h * d, generator=gen).to(torch.bfloat16)
    g1 = torch.randn(1, T, h, d, generator=gen).to(torch.bfloat16)
    beta = torch.randn(1, T, h, generator=gen).to(torch.bfloat16)
    conv = layer.conv_state_dim_first_view(layer.kv_cache[0])
    pages0 = (layer.kv_cache[0].clone(), layer.kv_cache[1].clone())
    # row 0: a fresh request (slot 3); row 1: continues from slot 4
    plain = _rows(layer, cfg, qkv, g1, beta, [0, 5, 9], [3, 4], [False, True])
    after = (layer.kv_cache[0].clone(), layer.kv_cache[1].clone())

    layer.kv_cache[0].copy_(pages0[0])
    layer.kv_cache[1].copy_(pages0[1])
    keys = {o: BundleKey(o, f"{o:064x}") for o in (0, 2, 3, 4)}
    taps.set_layer_groups({layer.prefix: 0})
    taps.install({(0, 3): taps.RowTaps((4, 2), (keys[4], keys[2]), 5),
                  (0, 4): taps.RowTaps((0, 3), (keys[0], keys[3]), 4),
                  (0, 6): taps.RowTaps((1,), (BundleKey(1, "0" * 64),), 7)})  # no such row
    tapped = _rows(layer, cfg, qkv, g1, beta, [0, 5, 9], [3, 4], [False, True])
    got = taps.collect()
    assert torch.equal(tapped, plain)  # taps change no arithmetic
    assert torch.equal(layer.kv_cache[0], after[0]) and torch.equal(layer.kv_cache[1], after[1])
    assert set(got) == set(keys.values())

    # each tapped state is the state a prefill of just those tokens leaves
    def alone(lo: int, hi: int, start_slot: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        slot = 7
        if start_slot is None:
            fresh = [False]
        else:
            layer.kv_cache[0][slot] = pages0[0][start_slot]
            layer.kv_cache[1][slot] = pages0[1][start_slot]
            fresh = [True]
        if hi > lo:
            _rows(layer, cfg, qkv[lo:hi], g1[:, lo:hi], beta[:, lo:hi], [0, hi - lo], [slot],
                  fresh)
        return conv[slot, :, :3].clone(), layer.kv_cache[1][slot].clone()

    for key, (lo, hi, start) in {keys[2]: (0, 2, None), keys[4]: (0, 4, None),
                                 keys[0]: (5, 5, 4), keys[3]: (5, 8, 4)}.items():
        want_conv, want_state = alone(lo, hi, start)
        tensors = got[key][layer.prefix]
        assert torch.equal(tensors["conv"], want_conv), key
        assert torch.equal(tensors["state"], want_state), key
    taps.install({})


# -- pages: KDA state and attention KV through vLLM's own KV-cache tensors ----------------------

ATTN = "model.layers.3.self_attn.attn"


def _hybrid_pages(cfg: Any, layer: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's KV-cache config and tensors for one KDA layer and one full-attention layer,
    as the engine core and worker build them (layout resolution, grouping, allocation)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    work = copy.copy(cfg)
    object.__setattr__(work, "cache_config", copy.copy(cfg.cache_config))
    specs = {layer.prefix: layer.get_kv_cache_spec(work),
             ATTN: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                     dtype=torch.bfloat16)}
    layout = resolve_kv_cache_layout(work, [[x.name for x in KVCacheLayout]],
                                     list(specs.values()))
    with set_current_vllm_config(work):
        kv_config = kv_cache_configs(work, [specs], [16 << 20])[0]
    tensors = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    layer.bind_kv_cache(tensors[layer.prefix])
    gen = torch.Generator().manual_seed(8)
    for t in (layer.kv_cache[0], layer.kv_cache[1], tensors[ATTN]):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return kv_config, tensors


def _hybrid_setup(build_config: Any) -> tuple[Any, Any, dict[str, torch.Tensor], dict[str, int]]:
    """A KDA layer and vLLM's pages for it and one attention layer; each layer's group."""
    cfg = build_config(*MTP3)
    layer = make_layer(cfg, recovery=True)
    kv_config, tensors = _hybrid_pages(cfg, layer)
    groups = {g.layer_names[0]: i for i, g in enumerate(kv_config.kv_cache_groups)}
    return layer, kv_config, tensors, groups


def test_a_bundle_carries_kda_pages_and_attention_blocks_into_other_blocks(
    build_config: Any, distributed: None,
) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.pages import (
        BundleMismatch,
        KdaSource,
        LayoutError,
        PageLayout,
    )

    layer, kv_config, tensors, groups = _hybrid_setup(build_config)
    gk, ga = groups[layer.prefix], groups[ATTN]
    pages = PageLayout(kv_config, tensors, {layer.prefix: layer})
    assert pages.kda_groups == [gk] and pages.attention_groups == [ga]
    k = 40  # three 16-token attention blocks, the last one partly filled
    src: list[tuple[int, ...]] = [(), ()]
    src[gk], src[ga] = (7,), (3, 9, 4)
    kda = pages.read_kda(KdaSource({gk: (7, 0, 7)}))
    attention = pages.read_attention(tuple(src), k)
    assert attention[ATTN].shape == (3, *tensors[ATTN].shape[1:])
    checkpoint = RequestCheckpoint(tokens=tuple(range(1, k + 1)),
                                   layers={**kda, ATTN: {"kv": attention[ATTN]}},
                                   logits=torch.zeros(4), boundary="prompt")
    restored = through_ram_store(checkpoint, "tiny")
    pages.check(restored, k)
    before = tensors[ATTN].clone()
    dst: list[tuple[int, ...]] = [(), ()]
    dst[gk], dst[ga] = (11,), (20, 21, 22)
    pages.write(restored, tuple(dst), k, local_tokens=16)  # block 20: vLLM's own hit
    conv = layer.conv_state_dim_first_view(layer.kv_cache[0])
    assert torch.equal(conv[11, :, :3], conv[7, :, :3])
    assert torch.equal(layer.kv_cache[1][11], layer.kv_cache[1][7])
    assert torch.equal(tensors[ATTN][21], before[9]) and torch.equal(tensors[ATTN][22], before[4])
    assert torch.equal(tensors[ATTN][20], before[20])  # the local hit is never written
    # a bundle of another shape is refused before anything is written
    wrong = {**restored, layer.prefix: {"conv": restored[layer.prefix]["conv"][:, :2],
                                        "state": restored[layer.prefix]["state"]}}
    with pytest.raises(BundleMismatch, match="conv"):
        pages.check(wrong, k)
    with pytest.raises(BundleMismatch, match="layers differ"):
        pages.check({layer.prefix: restored[layer.prefix]}, k)
    with pytest.raises(BundleMismatch, match=ATTN):
        pages.check(restored, 60)  # a fourth block the bundle does not hold
    with pytest.raises(LayoutError, match="KDA layers only"):
        PageLayout(kv_config, tensors, {})


# -- the scheduler side: index, tensor parallelism, offers, response exports -------------------

def _request(req_id: str, tokens: list[int], max_tokens: int = 8, **kwargs: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), None, **kwargs)


def _scheduler(cfg: Any, kv_config: Any, tp_size: int = 1, backend: str = "ram",
               path: Path | None = None) -> Any:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.scheduler import SchedulerSide
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.settings import parse_settings

    work = copy.copy(cfg)
    parallel = copy.copy(cfg.parallel_config)
    parallel.tensor_parallel_size = tp_size
    object.__setattr__(work, "parallel_config", parallel)
    extra = {**GOOD, "backend": backend}
    if path is not None:
        extra["path"] = str(path)
    blocks = {"r": ((5,), (1, 2, 3, 4))}
    return SchedulerSide(work, kv_config, parse_settings(extra, "kv_both"),
                         lambda req_id: blocks.get(req_id, ((), ())))


def _publish(side: Any, key: Any, ranks: list[int]) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.metadata import (
        RecoverSSMWorkerMetadata,
    )

    meta = RecoverSSMWorkerMetadata(published=[(key.num_tokens, key.digest, r) for r in ranks])
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))


def test_a_bundle_counts_only_when_every_rank_published_its_part(
    build_config: Any, distributed: None,
) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import bundle_key

    cfg = build_config(*MTP3)
    kv_config, _ = _hybrid_pages(cfg, make_layer(cfg, recovery=True))
    side = _scheduler(cfg, kv_config, tp_size=2)
    prompt = list(range(1, 41))
    key = bundle_key(prompt[:32])
    req = _request("a", prompt)
    side.on_new_request(req)
    _publish(side, key, [1])
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # rank 0's part missing
    _publish(side, key, [1, 0])
    assert side.get_num_new_matched_tokens(req, 0) == (32, True)
    assert side.get_num_new_matched_tokens(req, 16) == (16, True)  # past vLLM's own hit
    assert side.get_num_new_matched_tokens(req, 32) == (0, False)
    # a bundle of the whole request is never offered: vLLM computes the last token
    whole = _request("b", prompt[:32])
    side.on_new_request(whole)
    assert side.get_num_new_matched_tokens(whole, 0) == (0, False)


def test_a_failed_load_is_not_offered_again_and_a_pending_export_is_waited_for(
    build_config: Any, distributed: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector import scheduler as sched
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import bundle_key

    cfg = build_config(*MTP3)
    kv_config, _ = _hybrid_pages(cfg, make_layer(cfg, recovery=True))
    side = _scheduler(cfg, kv_config)
    prompt = list(range(100, 140))
    # a turn ends: its response bundle (state after 40 + 3 - 1 tokens) is queued
    turn = _request("t", prompt, max_tokens=3)
    side.on_new_request(turn)
    turn.append_output_token_ids([7, 8, 9])
    turn.num_computed_tokens = 42
    turn.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(turn, ([5], [1, 2, 3])) is True
    meta = side.build_connector_meta(_empty_output())
    assert [e.key.num_tokens for e in meta.exports] == [42]
    follow = _request("f", prompt + [7, 8, 9, 1, 2])
    side.on_new_request(follow)
    assert side.get_num_new_matched_tokens(follow, 0) == (None, False)  # being written
    _publish(side, meta.exports[0].key, [0])
    assert side.get_num_new_matched_tokens(follow, 0) == (42, True)
    blocks = KVCacheBlocks.__new__(KVCacheBlocks)
    monkeypatch.setattr(KVCacheBlocks, "get_block_ids", lambda self: ([6], [1, 2, 3]))
    side.update_state_after_alloc(follow, blocks, 42)
    load = side.build_connector_meta(_empty_output()).loads[0]
    assert (load.key, load.tokens, load.local_tokens, load.valid) == (
        bundle_key(prompt + [7, 8]), tuple(prompt + [7, 8]), 0, True)
    # the load fails on a worker: vLLM recomputes, the bundle is not offered again
    side.update_connector_output(KVConnectorOutput(finished_recving={"f"},
                                                   failed_recving={"f"}))
    assert side.get_num_new_matched_tokens(follow, 0) == (0, False)
    # an export that never reports back is waited for a bounded time only
    monkeypatch.setattr(sched, "WAIT_SECONDS", 0.05)
    other = _request("o", list(range(300, 340)), max_tokens=2)
    side.on_new_request(other)
    other.append_output_token_ids([1, 2])
    other.num_computed_tokens = 41
    other.status = RequestStatus.FINISHED_STOPPED
    assert side.request_finished(other, ([5], [1])) is True
    again = _request("o2", list(range(300, 340)) + [1, 2, 3])
    side.on_new_request(again)
    assert side.get_num_new_matched_tokens(again, 0) == (None, False)
    time.sleep(0.1)
    assert side.get_num_new_matched_tokens(again, 0) == (0, False)


def _empty_output() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={})


def test_which_requests_are_exported(build_config: Any, distributed: None) -> None:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import RequestStatus

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import bundle_key

    cfg = build_config(*MTP3)
    kv_config, _ = _hybrid_pages(cfg, make_layer(cfg, recovery=True))
    side = _scheduler(cfg, kv_config)
    seen: list[str] = []

    def finished(req_id: str, computed: int, status: Any = RequestStatus.FINISHED_STOPPED,
                 **kwargs: Any) -> bool:
        # tokens of its own: a response already queued for the same tokens is not repeated
        base = 1000 * (len(seen) + 1)
        seen.append(req_id)
        req = _request(req_id, list(range(base, base + 20)), **kwargs)
        side.on_new_request(req)
        req.append_output_token_ids([5, 6, 7])
        req.num_computed_tokens = computed
        req.status = status
        return bool(side.request_finished(req, ([5], [1, 2])))

    assert finished("ok", 22)
    assert not finished("cut", 23)  # a stop inside accepted drafts: state past the tokens
    assert not finished("aborted", 22, RequestStatus.FINISHED_ABORTED)
    assert not finished("salted", 22, cache_salt="tenant-1")
    assert not finished("embeds", 22, prompt_embeds=torch.zeros(20, 8))
    image = [MultiModalFeatureSpec(data=None, modality="image", identifier="img-0",
                                   mm_position=PlaceholderRange(offset=2, length=4))]
    assert not finished("image", 22, mm_features=image)
    # nor restored, even where a bundle of the same token ids exists
    _publish(side, bundle_key(list(range(1, 17))), [0])
    text = _request("text", list(range(1, 21)))
    side.on_new_request(text)
    assert side.get_num_new_matched_tokens(text, 0) == (16, True)
    picture = _request("picture", list(range(1, 21)), mm_features=image)
    side.on_new_request(picture)
    assert side.get_num_new_matched_tokens(picture, 0) == (0, False)


def test_a_window_past_max_tokens_counts_only_the_kept_tokens(
    build_config: Any, distributed: None,
) -> None:
    """vLLM ends a request whose accepted drafts reach past ``max_tokens`` and cuts the
    rest; the workers then keep the state of the kept tokens, and the export matches."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    cfg = build_config(*MTP3)
    kv_config, _ = _hybrid_pages(cfg, make_layer(cfg, recovery=True))
    side = _scheduler(cfg, kv_config)
    req = _request("r", list(range(1, 21)), max_tokens=6)
    side.on_new_request(req)
    req.append_output_token_ids([1, 2, 3, 4])
    req.num_computed_tokens = 23  # the step feeds token 23 and three drafts
    step = SimpleNamespace(num_scheduled_tokens={"r": 4},
                           scheduled_spec_decode_tokens={"r": [9, 9, 9]})
    assert side.build_connector_meta(step).limits == {"r": 2}  # two more tokens to go
    # all four sampled, two kept: vLLM's count says 27, the state holds 25 = 20 + 6 - 1
    req.append_output_token_ids([5, 6])
    req.num_computed_tokens = 27
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, ([5], [1, 2])) is True
    export = side.build_connector_meta(_empty_output()).exports[0]
    assert export.key.num_tokens == 25 and len(export.tokens) == 25


def test_a_restarted_scheduler_lists_the_disk_store(
    build_config: Any, distributed: None, tmp_path: Path,
) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.index import (
        INDEX_DIR,
        add_entry,
        read_entries,
    )
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import bundle_key

    cfg = build_config(*MTP3)
    kv_config, _ = _hybrid_pages(cfg, make_layer(cfg, recovery=True))
    first = _scheduler(cfg, kv_config, tp_size=2, backend="disk", path=tmp_path)
    prompt = list(range(1, 30))
    key = bundle_key(prompt[:16])
    for digest in first._identities:
        add_entry(tmp_path, digest, key)
    junk = tmp_path / INDEX_DIR / first._identities[0]
    (junk / "not-an-entry").write_text("")
    (junk / f"17-{'a' * 64}").symlink_to(tmp_path)
    assert read_entries(tmp_path, first._identities[0]) == {key}
    fresh = _scheduler(cfg, kv_config, tp_size=2, backend="disk", path=tmp_path)
    req = _request("q", prompt)
    fresh.on_new_request(req)
    assert fresh.complete_bundles() == [key]
    assert fresh.get_num_new_matched_tokens(req, 0) == (16, True)


def test_worker_reports_merge_across_ranks_once(vllm_module: Any) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.metadata import (
        RecoverSSMWorkerMetadata,
    )

    a = RecoverSSMWorkerMetadata(published=[(16, "d", 0)], failed=[(32, "e", 0)])
    b = RecoverSSMWorkerMetadata(published=[(16, "d", 1), (16, "d", 0)])
    merged = a.aggregate(b).aggregate(b)
    assert merged.published == [(16, "d", 0), (16, "d", 1)]
    assert merged.failed == [(32, "e", 0)]


def test_a_chunk_end_the_step_did_not_reach_is_not_stored(
    build_config: Any, distributed: None,
) -> None:
    """LMCache#4984: a connector stored a block whose state the step never wrote (vLLM
    merged the prompt's last block into a speculative step). A chunk-end bundle is taken
    only when runner V2's count of the row's state after the step is the bundle's."""
    from types import SimpleNamespace

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import bundle_key
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.metadata import Capture
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.pages import PageLayout
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.worker import (
        Sampled,
        WorkerSide,
        WorkerStats,
    )

    layer, kv_config, tensors, groups = _hybrid_setup(build_config)
    ids: list[tuple[int, ...]] = [(), ()]
    ids[groups[layer.prefix]], ids[groups[ATTN]] = (7,), (3, 9)
    prompt = list(range(1, 41))
    submitted: list[Any] = []
    worker = WorkerSide.__new__(WorkerSide)  # only what a step's captures use
    worker.layout = PageLayout(kv_config, tensors, {layer.prefix: layer})
    worker.align_block, worker._step, worker.stats = 0, 1, WorkerStats()
    worker._failed_keys, worker._at_start, worker._prompts = [], {}, {"r": prompt}
    worker._meta = SimpleNamespace(block_ids={"r": tuple(ids)})
    worker.writer = SimpleNamespace(submit=lambda key, bundle: submitted.append(key))
    key = bundle_key(prompt[:32])
    for held in (24, 32):  # the step computed 24 tokens, then the planned 32
        worker._last = {"r": Sampled(1, 1, torch.zeros(4), torch.tensor(held))}
        worker._captures = [Capture("r", key, "interval", offset=16, chunk_len=16)]
        worker.finish_captures()
    assert worker.stats.stale_exports == 1 and worker._failed_keys == [key]
    assert submitted == [key] and worker.stats.exported["interval"] == 1
