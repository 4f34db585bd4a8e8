"""Keyed integrity for shared storage: with an HMAC key a store restores only what it signed.

The checksums catch accidental damage only: whoever can write the directory can write a
bundle with matching checksums (see test_forged_manifest). With a key from an environment
variable or a file, such a bundle is a miss.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.checkpoint_stores import (
    HEADER,
    MiB,
    make_checkpoint,
    make_identity,
    make_tokens,
    manifest_body,
    manifest_file,
    put_manifest,
    rewrap,
)
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointConfigError, CheckpointStore
from vllm_recoverssm.checkpoint.wire import MAGIC_KEYED

pytestmark = pytest.mark.lmcache

KEY = "k" * 40
OTHER_KEY = "o" * 40


def _open(root: Path, **cfg: object) -> CheckpointStore:
    config = CheckpointConfig(backend="disk", path=root, ram_bytes=16 * MiB, chunk_bytes=4096,
                              **cfg)  # type: ignore[arg-type]
    return CheckpointStore(config, make_identity())


def test_a_keyed_store_restores_only_bundles_signed_with_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    monkeypatch.setenv("CKPT_KEY", KEY)
    monkeypatch.setenv("OTHER_KEY", OTHER_KEY)
    toks = make_tokens(120)
    signed = make_checkpoint(toks[:30])
    with _open(root, hmac_key_env="CKPT_KEY") as keyed:
        assert keyed.store(signed).stored
        raw = manifest_file(root, 30).read_bytes()
        assert raw[HEADER:HEADER + 8] == MAGIC_KEYED
        with _open(root) as plain:  # a store without a key still reads it (checksums only)
            assert plain.lookup(toks[:30]).checkpoint.same_as(signed)  # type: ignore[union-attr]
            assert plain.store(make_checkpoint(toks)).stored  # an unsigned bundle
            # a forgery with a correct checksum, planted by someone who can write the dir
            body = manifest_body(plain, toks[:30])
            body["meta"]["num_accepted"] = 7
            put_manifest(plain, toks[:30], rewrap(body))
            assert plain.lookup(toks[:30]).checkpoint.meta["num_accepted"] == 7  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
            assert keyed.lookup(toks) is None  # unsigned, forged: both misses
        assert "not signed" in caplog.text
        body["meta"]["num_accepted"] = 1
        put_manifest(keyed, toks[:30], rewrap(body, key=OTHER_KEY.encode()))
        with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
            assert keyed.lookup(toks[:30]) is None
        assert "signature (HMAC) does not match" in caplog.text
        assert keyed.store(signed).stored  # the unusable bundle is replaced, signed
        assert keyed.lookup(toks[:30]).checkpoint.same_as(signed)  # type: ignore[union-attr]
    with _open(root, hmac_key_env="OTHER_KEY") as other:
        assert other.lookup(toks) is None


def test_key_from_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    root = tmp_path / "ckpt"
    ck = make_checkpoint(make_tokens(20))
    with _open(root, hmac_key_file=key_file) as a:
        assert a.store(ck).stored
    key_file.write_text(KEY)  # the trailing newline is not part of the key
    with _open(root, hmac_key_file=key_file) as b:
        assert b.lookup(ck.tokens).checkpoint.same_as(ck)  # type: ignore[union-attr]


def test_bad_keys_fail_when_the_store_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(CheckpointConfigError, match="NO_SUCH_KEY is not set"):
        _open(root, hmac_key_env="NO_SUCH_KEY")
    monkeypatch.setenv("SHORT_KEY", "short")
    with pytest.raises(CheckpointConfigError, match="at least|expected 32"):
        _open(root, hmac_key_env="SHORT_KEY")
    with pytest.raises(CheckpointConfigError, match="hmac_key_file"):
        _open(root, hmac_key_file=tmp_path / "missing")
    with pytest.raises(CheckpointConfigError, match="not a regular file"):
        _open(root, hmac_key_file=tmp_path)
    with pytest.raises(ValidationError, match="not both"):
        CheckpointConfig(backend="ram", hmac_key_env="A", hmac_key_file=tmp_path / "k")
    with pytest.raises(ValidationError, match="hmac_key_env"):
        CheckpointConfig(backend="ram", hmac_key_env="NOT A NAME")
