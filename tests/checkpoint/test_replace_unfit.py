"""A bundle that decodes but does not fit is replaced by the next store of its prefix.

Before, ``store()`` saw such a bundle as "exists": every later request for that prompt logged
a warning and recomputed it, for ever. Now a stored bundle whose tensors (names, dtypes,
shapes) differ from the checkpoint being stored, or that a caller rejected, is replaced; and a
forged or unfitting bundle never fails the runtime's requests.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.checkpoint_stores import (
    make_checkpoint,
    make_tokens,
    manifest_body,
    part_files,
    put_manifest,
    rewrap,
)
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore, RequestCheckpoint
from vllm_recoverssm.reference import (
    TEST_MODEL,
    HybridModel,
    RuntimeConfig,
    SpecRuntime,
    build_model,
)

pytestmark = pytest.mark.lmcache


def _unfit(ck: RequestCheckpoint) -> RequestCheckpoint:
    """The same prefix with one tensor of another shape (another model's state)."""
    layers = {k: dict(v) for k, v in ck.layers.items()}
    layers["layers.0"]["state"] = torch.zeros(3, 8, 8)
    return RequestCheckpoint(tokens=ck.tokens, layers=layers, logits=ck.logits)


def test_a_bundle_with_other_tensors_is_replaced(store: CheckpointStore) -> None:
    ck = make_checkpoint(make_tokens(60))
    assert store.store(_unfit(ck)).stored
    assert store.store(ck).stored and store.stats.replaced == 1
    hit = store.lookup(ck.tokens)
    assert hit is not None and hit.checkpoint.same_as(ck)
    assert store.store(ck).reason == "exists"  # a fitting bundle is kept
    if store.config.path is not None:  # the replaced bundle's parts went with it
        bundles = {p.name.split("bundle%")[1][:32] for p in part_files(store.config.path, 60)}
        assert bundles == {hit.bundle_id}


def test_a_rejected_bundle_is_replaced(store: CheckpointStore) -> None:
    ck = make_checkpoint(make_tokens(60))
    assert store.store(ck).stored
    hit = store.lookup(ck.tokens)
    assert hit is not None and hit.bundle_id
    newer = make_checkpoint(ck.tokens, seed=3)  # same tensors, other values
    assert store.store(newer).reason == "exists"
    store.reject(hit)
    assert store.store(newer).stored
    assert store.lookup(ck.tokens).checkpoint.same_as(newer)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return build_model(TEST_MODEL)


def _runtime(model: HybridModel, path: Path | None) -> SpecRuntime:
    ckpt = None if path is None else CheckpointConfig(
        backend="disk", path=path, ram_bytes=8 * 2**20, chunk_bytes=4096)
    cfg = RuntimeConfig(num_spec=3, block_size=8, max_model_len=64, checkpoint=ckpt)
    return SpecRuntime(model, cfg, None)


def _serve(rt: SpecRuntime, prompt: list[int]) -> list[int]:
    rt.add_request(prompt, 6)
    return rt.run()[0].generated


def test_the_runtime_replaces_an_unfitting_and_survives_a_forged_bundle(
    model: HybridModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = torch.randint(0, model.config.vocab_size, (20,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    cold = _serve(_runtime(model, None), prompt)
    root = tmp_path / "ckpt"
    rt = _runtime(model, root)
    store = rt.checkpoint_store
    assert store is not None
    toks = tuple(prompt)
    assert store.store(make_checkpoint(toks)).stored  # right prefix, wrong model shapes
    with caplog.at_level(logging.WARNING):
        assert _serve(rt, prompt) == cold
    assert rt.stats.checkpoint_rejected == 1 and "does not fit" in caplog.text
    assert store.stats.replaced == 1  # the prompt-boundary export replaced it

    again = _runtime(model, root)  # a fresh runtime restores the replacement
    assert _serve(again, prompt) == cold and again.stats.restored_tokens > 0
    assert again.stats.checkpoint_rejected == 0

    body = manifest_body(store, toks)  # a forged manifest with an overflowing shape
    body["tensors"][1].update(shape=[2**64, 0], nbytes=0)
    put_manifest(store, toks, rewrap(body))
    third = _runtime(model, root)
    assert _serve(third, prompt) == cold  # no exception out of run(), the cold tokens
    assert third.checkpoint_store is not None and third.checkpoint_store.stats.rejected == 1
