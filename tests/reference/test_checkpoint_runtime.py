"""The runtime with a checkpoint store (real LMCache): export at boundaries, restore on admission.

Wave 1 runs a batch and exports a bundle at the end of every prompt and every response. Wave
2 asks for follow-up turns (prompt + answer + new text), the same prompts again and prompts
that extend a stored prompt; it must produce the cold run's tokens while computing only what
no bundle covers.
"""

from __future__ import annotations

import gc
import logging
import shutil
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.support.checkpoint_stores import HEADER, flip_bit, manifest_file, part_files
from tests.support.reference_runs import MAX_MODEL_LEN, MAX_NEW
from vllm_recoverssm.checkpoint import (
    CheckpointConfig,
    CheckpointConfigError,
    RequestCheckpoint,
)
from vllm_recoverssm.reference import (
    FULL_STATE,
    MODES,
    RECOVERY,
    HybridModel,
    OracleDrafter,
    Request,
    RuntimeConfig,
    SpecRuntime,
    capture_request,
    greedy_continuations,
    layout_identity,
)

pytestmark = pytest.mark.lmcache
MiB = 2**20
NEW_TEXT = [3, 1, 4]
EXTRA = [5, 6]


def ram() -> CheckpointConfig:
    """A small RAM store; 4 KiB parts so that every bundle has several."""
    return CheckpointConfig(backend="ram", ram_bytes=8 * MiB, chunk_bytes=4096)


def disk(path: Path) -> CheckpointConfig:
    """A disk store under ``path``."""
    return CheckpointConfig(backend="disk", path=path, ram_bytes=8 * MiB, chunk_bytes=4096)


def runtime(
    model: HybridModel, mode: str, drafter: OracleDrafter | None, **config: object
) -> SpecRuntime:
    """A runtime with the tests' sizes (block size 8, room for a follow-up turn)."""
    settings: dict[str, object] = dict(mode=mode, num_spec=3, block_size=8,
                                       max_model_len=MAX_MODEL_LEN)
    settings.update(config)
    return SpecRuntime(model, RuntimeConfig(**settings), drafter)  # type: ignore[arg-type]


def serve(rt: SpecRuntime, prompts: Sequence[Sequence[int]], has_images: bool = False
          ) -> list[Request]:
    """Run ``prompts`` on ``rt``; returns the requests in submission order."""
    for p in prompts:
        rt.add_request(p, MAX_NEW, has_images=has_images)
    return rt.run()


@pytest.fixture(scope="module")
def waves(tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]]
          ) -> tuple[list[list[int]], list[list[int]], OracleDrafter]:
    """Wave 2 (follow-ups, repeats, extensions), its greedy outputs and a drafter for both."""
    answers = [r[:MAX_NEW] for r in references]
    wave2 = ([p + a + NEW_TEXT for p, a in zip(prompts, answers, strict=True)]
             + [list(p) for p in prompts]
             + [p + EXTRA for p in prompts[2:]])
    refs2 = greedy_continuations(tiny_model, wave2, MAX_NEW + 4, max_model_len=MAX_MODEL_LEN + 8)
    table = {tuple(p): r for p, r in zip([*prompts, *wave2], [*references, *refs2], strict=True)}
    drafter = OracleDrafter(table, 0.3, tiny_model.config.vocab_size)
    return wave2, [r[:MAX_NEW] for r in refs2], drafter


def expected_restored(prompts: list[list[int]]) -> list[int]:
    """Tokens wave 2 restores: the response bundle (all but the last answer token), the
    prompt bundle for a repeat and for an extension."""
    return ([len(p) + MAX_NEW - 1 for p in prompts] + [len(p) for p in prompts]
            + [len(p) for p in prompts[2:]])


def test_a_closed_runtime_is_freed_without_a_garbage_collection(
    tiny_model: HybridModel, prompts: list[list[int]],
    waves: tuple[list[list[int]], list[list[int]], OracleDrafter],
) -> None:
    """Leaving the ``with`` block releases the checkpoint store (which points back at the
    runtime), so the last reference to the runtime frees it and its state pools at once:
    a demo or server that runs one runtime after another does not pile them up."""
    gc.disable()
    try:
        with runtime(tiny_model, RECOVERY, waves[2], checkpoint=ram()) as rt:
            serve(rt, prompts[:2])
            assert rt.stats.checkpoints_exported > 0
        ref = weakref.ref(rt)
        del rt
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", MODES)
def test_second_wave_restores_from_ram_and_equals_a_cold_run(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    waves: tuple[list[list[int]], list[list[int]], OracleDrafter], mode: str,
) -> None:
    wave2, greedy2, drafter = waves
    with runtime(tiny_model, mode, drafter, checkpoint=ram()) as rt:
        first = serve(rt, prompts)
        assert [r.generated for r in first] == [r[:MAX_NEW] for r in references]
        assert rt.stats.external_hits == 0 and rt.stats.checkpoints_exported == 2 * len(prompts)
        prefill_before = rt.stats.prefill_tokens
        second = serve(rt, wave2)
        store = rt.checkpoint_store
        assert store is not None
        # follow-ups and extensions export their prompt; responses of repeats exist already
        assert store.stats.already_stored == len(prompts)
    cold = serve(runtime(tiny_model, mode, drafter), wave2)
    assert [r.generated for r in second] == [r.generated for r in cold] == greedy2
    restored = [r.restored_tokens for r in second]
    assert restored == expected_restored(prompts)
    assert rt.stats.external_hits == len(wave2)
    assert rt.stats.restored_tokens == sum(restored)
    # only the tails were computed: new text + the last answer token, nothing, the extra
    tails = [len(NEW_TEXT) + 1] * len(prompts) + [0] * len(prompts) + [len(EXTRA)] * 2
    assert rt.stats.prefill_tokens - prefill_before == sum(tails)
    assert cold[0].restored_tokens == 0


@pytest.mark.parametrize("mode", MODES)
def test_fresh_runtime_restores_from_disk_and_its_prefix_cache_reports_no_hits(
    tiny_model: HybridModel, prompts: list[list[int]],
    waves: tuple[list[list[int]], list[list[int]], OracleDrafter], mode: str, tmp_path: Path,
) -> None:
    wave2, greedy2, drafter = waves
    config = dict(checkpoint=disk(tmp_path / "ckpt"), prefix_caching=True)
    with runtime(tiny_model, mode, drafter, **config) as rt:
        serve(rt, prompts)
    with runtime(tiny_model, mode, drafter, **config) as rt:
        second = serve(rt, wave2)
        assert [r.generated for r in second] == greedy2
        assert [r.restored_tokens for r in second] == expected_restored(prompts)
        assert rt.stats.external_hits == len(wave2)
        # restored tokens are external hits, never hits of the runtime's own cache
        assert rt.cache.stats.hits == 0 and rt.cache.stats.hit_tokens == 0
        assert all(r.prefix_hit_tokens == 0 for r in second)
        assert rt.cache.stats.stored_blocks > 0  # the cache itself kept working


def test_capturing_before_the_commit_restores_a_wrong_state(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    waves: tuple[list[list[int]], list[list[int]], OracleDrafter],
) -> None:
    """Recovery must commit, compact, then capture; the reverse order is caught here."""
    wave2, greedy2, drafter = waves
    follow_ups, follow_greedy = wave2[: len(prompts)], greedy2[: len(prompts)]
    runs: dict[bool, tuple[list[list[int]], list[RequestCheckpoint]]] = {}
    for early in (False, True):
        with runtime(tiny_model, RECOVERY, drafter, checkpoint=ram(),
                     debug_capture_before_commit=early) as rt:
            first = serve(rt, prompts)
            assert rt.checkpoint_store is not None
            bundles = []
            for p, r in zip(prompts, first, strict=True):
                hit = rt.checkpoint_store.lookup(p + r.generated[:-1])
                assert hit is not None and hit.checkpoint.boundary == "response"
                bundles.append(hit.checkpoint)
            runs[early] = ([r.generated for r in serve(rt, follow_ups)], bundles)
    # the response state, computed independently: the same tokens prefilled as a prompt
    for good, bad in zip(runs[False][1], runs[True][1], strict=True):
        cold = _prompt_capture(tiny_model, list(good.tokens))
        for name in ("layer.0", "layer.1", "layer.2"):
            torch.testing.assert_close(good.layers[name]["state"], cold.layers[name]["state"],
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(good.layers[name]["conv"], cold.layers[name]["conv"],
                                       rtol=0, atol=1e-5)
            # captured before the commit: the state misses the last step's accepted tokens
            assert (bad.layers[name]["state"] - cold.layers[name]["state"]).abs().max() > 0.05
    assert runs[False][0] == follow_greedy
    assert runs[True][0] != follow_greedy


def _prompt_capture(model: HybridModel, tokens: list[int]) -> RequestCheckpoint:
    caught: list[RequestCheckpoint] = []

    def hook(rt: SpecRuntime, req: Request, boundary: str) -> None:
        if boundary == "prompt":
            caught.append(capture_request(rt, req, boundary))

    rt = SpecRuntime(model, RuntimeConfig(block_size=8, max_model_len=MAX_MODEL_LEN), None,
                     on_boundary=hook)
    rt.add_request(tokens, 1)
    rt.run()
    return caught[0]


def test_requests_with_images_are_never_exported_nor_restored(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    waves: tuple[list[list[int]], list[list[int]], OracleDrafter],
) -> None:
    _, _, drafter = waves
    with runtime(tiny_model, RECOVERY, drafter, checkpoint=ram()) as rt:
        store = rt.checkpoint_store
        assert store is not None
        (img,) = serve(rt, prompts[3:], has_images=True)
        assert store.stats.skipped_images == 2 and rt.stats.checkpoints_exported == 0
        assert not store.contains(prompts[3])
        (text,) = serve(rt, prompts[3:])  # the same tokens without images: exported
        assert store.contains(prompts[3]) and text.restored_tokens == 0
        (img2,) = serve(rt, prompts[3:], has_images=True)  # a bundle exists, yet not used
        assert img2.restored_tokens == 0 and store.stats.skipped_images == 4
        assert img.generated == text.generated == img2.generated == references[3][:MAX_NEW]
    with pytest.raises(ValueError, match="has_images"):
        SpecRuntime(tiny_model, RuntimeConfig()).add_request([1, 2], 1, has_images=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- faults


@pytest.fixture
def exported(tiny_model: HybridModel, prompts: list[list[int]],
             waves: tuple[list[list[int]], list[list[int]], OracleDrafter], tmp_path: Path
             ) -> Iterator[tuple[Path, OracleDrafter]]:
    """A disk store holding recovery-mode prompt and response bundles of ``prompts``."""
    _, _, drafter = waves
    root = tmp_path / "ckpt"
    with runtime(tiny_model, RECOVERY, drafter, checkpoint=disk(root)) as rt:
        serve(rt, prompts)
    yield root, drafter


def _restore_prompts(model: HybridModel, prompts: list[list[int]], references: list[list[int]],
                     root: Path, drafter: OracleDrafter) -> list[Request]:
    with runtime(model, RECOVERY, drafter, checkpoint=disk(root)) as rt:
        out = serve(rt, prompts)
    assert [r.generated for r in out] == [r[:MAX_NEW] for r in references]
    return out


def test_corrupt_bundle_on_disk_is_computed_cold(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    exported: tuple[Path, OracleDrafter], caplog: pytest.LogCaptureFixture,
) -> None:
    root, drafter = exported
    flip_bit(part_files(root, len(prompts[2]))[1], HEADER + 17)
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm"):
        out = _restore_prompts(tiny_model, prompts, references, root, drafter)
    assert [r.restored_tokens for r in out] == [3, 9, 0, 21]
    assert "checksum mismatch" in caplog.text and f"{len(prompts[2])}-token prefix" in caplog.text


def test_bundle_of_another_layout_on_disk_is_computed_cold(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    exported: tuple[Path, OracleDrafter], caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    root, drafter = exported
    other = tmp_path / "full"
    with runtime(tiny_model, FULL_STATE, drafter, checkpoint=disk(other)) as full_rt:
        serve(full_rt, prompts[:1])
        theirs = layout_identity(full_rt).digest()[:32]
    mine = layout_identity(runtime(tiny_model, RECOVERY, None)).digest()[:32]
    # a stray copy: the full-state bundle of prompt 0 under the recovery bundle's names
    n = len(prompts[0])
    for path in [manifest_file(root, n), *part_files(root, n)]:
        path.unlink()
    for path in [manifest_file(other, n), *part_files(other, n)]:
        shutil.copyfile(path, root / path.name.replace(theirs, mine))
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm"):
        out = _restore_prompts(tiny_model, prompts, references, root, drafter)
    assert [r.restored_tokens for r in out] == [0, 9, 15, 21]
    assert "another layout" in caplog.text


def test_bundle_that_does_not_fit_the_model_is_computed_cold(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    exported: tuple[Path, OracleDrafter], caplog: pytest.LogCaptureFixture,
) -> None:
    """A bundle the store accepts (right identity, sound checksums) but of wrong shapes."""
    root, drafter = exported
    with runtime(tiny_model, RECOVERY, drafter, checkpoint=disk(root)) as rt:
        store = rt.checkpoint_store
        assert store is not None
        good = store.lookup(prompts[2])
        assert good is not None
        ck = good.checkpoint
        bad_layers = {k: dict(v) for k, v in ck.layers.items()}
        bad_layers["layer.3"]["keys"] = bad_layers["layer.3"]["keys"][:-1]
        extended = prompts[2] + EXTRA
        assert store.store(RequestCheckpoint(tokens=tuple(extended), layers=bad_layers,
                                             logits=ck.logits)).stored
        with caplog.at_level(logging.WARNING, logger="vllm_recoverssm"):
            (req,) = serve(rt, [extended])
        assert rt.stats.checkpoint_rejected == 1
    assert req.restored_tokens == len(prompts[2])  # the next shorter bundle, not the bad one
    assert "does not fit this runtime" in caplog.text and "layer.3" in caplog.text
    cold = serve(runtime(tiny_model, RECOVERY, drafter), [extended])
    assert req.generated == cold[0].generated


# ----------------------------------------------------------------------------- start-up


def test_lmcache_missing_fails_when_the_runtime_is_built(
    tiny_model: HybridModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "lmcache":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(CheckpointConfigError, match="LMCache is not installed"):
        runtime(tiny_model, RECOVERY, None, checkpoint=ram())


def test_unusable_checkpoint_directory_fails_when_the_runtime_is_built(
    tiny_model: HybridModel, tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointConfigError, match="checkpoint directory"):
        runtime(tiny_model, RECOVERY, None, checkpoint=disk(blocker / "ckpt"))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"checkpoint": {"backend": "ram"}}, "argument 'checkpoint'"),
        ({"debug_capture_before_commit": True}, "debug_capture_before_commit"),
        ({"mode": FULL_STATE, "debug_capture_before_commit": True, "checkpoint": "ram"},
         "debug_capture_before_commit"),
    ],
)
def test_bad_checkpoint_settings(settings: dict[str, object], message: str) -> None:
    if settings.get("checkpoint") == "ram":
        settings["checkpoint"] = ram()
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**settings)  # type: ignore[arg-type]
