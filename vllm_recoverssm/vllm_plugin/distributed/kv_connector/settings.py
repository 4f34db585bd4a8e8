"""``kv_connector_extra_config`` of ``RecoverSSMCheckpointConnector``, checked at start-up.

A user enables the connector with::

    --kv-transfer-config '{"kv_connector": "RecoverSSMCheckpointConnector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "request_boundary_checkpoints": true,
                               "backend": "disk", "path": "/abs/dir",
                               "checkpoint_interval": 64}}'

Every problem is one line naming the key (``kv_connector_extra_config['path']: ...``),
raised while vLLM builds its config in the front end, so a bad setting never reaches a
request. The worker builds the store again from the same settings; a store that cannot
work there (LMCache missing, a directory that went away) fails engine start-up too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ....checkpoint import CheckpointConfig
from ....checkpoint.config import MiB

CONNECTOR_NAME = "RecoverSSMCheckpointConnector"
"""The name a user gives as ``kv_connector``."""
BOUNDARY_FLAG = "request_boundary_checkpoints"
TESTING_ENV = "VLLM_RECOVERSSM_TESTING"
"""Set to 1 to allow the deliberately wrong test-only capture stage."""
TEST_STAGE_KEY = "_test_capture_stage"
DEFAULT_INTERVAL = 64
"""Tokens between interval checkpoints of a long prompt when prefix caching is off."""
DEFAULT_RAM_BYTES = 256 * MiB
_KEYS = (BOUNDARY_FLAG, "backend", "path", "checkpoint_interval", "ram_bytes", TEST_STAGE_KEY)

CaptureStage = Literal["post_commit", "pre_commit"]


class ConnectorSettingsError(ValueError):
    """A connector setting is missing or wrong; the message is one line naming the key."""


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings after checking.

    ``checkpoint_interval`` None means the default (:func:`checkpoint_interval`).
    ``capture_stage`` ``pre_commit`` is a deliberately wrong order for a negative test:
    response bundles then hold the state before the last step's commit.
    """

    backend: Literal["ram", "disk"]
    path: Path | None
    checkpoint_interval: int | None
    ram_bytes: int
    capture_stage: CaptureStage = "post_commit"

    def checkpoint_config(self) -> CheckpointConfig:
        """The store configuration these settings describe."""
        return CheckpointConfig(backend=self.backend, path=self.path, ram_bytes=self.ram_bytes)


def _key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _positive_int(extra: Mapping[str, Any], name: str, low: int) -> int | None:
    value = extra.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConnectorSettingsError(
            f"{_key(name)}: expected an integer >= {low}, got {value!r}")
    return value


def _checked_dir(value: object) -> Path:
    if not isinstance(value, str) or not value:
        raise ConnectorSettingsError(
            f"{_key('path')}: backend 'disk' needs the checkpoint directory as an absolute "
            f"path, got {value!r}")
    path = Path(value)
    if not path.is_absolute():
        raise ConnectorSettingsError(f"{_key('path')}: {value!r} is not an absolute path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConnectorSettingsError(
            f"{_key('path')}: cannot create {value!r}: {exc.strerror}") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConnectorSettingsError(f"{_key('path')}: {value!r} is not a writable directory")
    return path


def parse_settings(extra: Mapping[str, Any] | None, kv_role: str | None) -> ConnectorSettings:
    """Check ``kv_connector_extra_config`` and ``kv_role``; raise one line naming the key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ConnectorSettingsError(
            f"{_key(unknown[0])}: unknown setting for {CONNECTOR_NAME} (known: "
            f"{', '.join(k for k in _KEYS if not k.startswith('_'))})")
    if kv_role != "kv_both":
        raise ConnectorSettingsError(
            f"kv_role: {CONNECTOR_NAME} stores and restores its own checkpoints; expected "
            f"'kv_both', got {kv_role!r}")
    if extra.get(BOUNDARY_FLAG) is not True:
        raise ConnectorSettingsError(
            f"{_key(BOUNDARY_FLAG)}: must be true for {CONNECTOR_NAME} (it exports atomic "
            f"request-boundary checkpoints only), got {extra.get(BOUNDARY_FLAG)!r}")
    backend = extra.get("backend")
    if backend not in ("ram", "disk"):
        raise ConnectorSettingsError(
            f"{_key('backend')}: expected 'ram' or 'disk', got {backend!r}")
    path: Path | None = None
    if backend == "disk":
        path = _checked_dir(extra.get("path"))
    elif extra.get("path") is not None:
        raise ConnectorSettingsError(
            f"{_key('path')}: backend 'ram' keeps bundles in memory and takes no path; use "
            "backend 'disk' to write files")
    interval = _positive_int(extra, "checkpoint_interval", 1)
    ram_bytes = _positive_int(extra, "ram_bytes", 16 * MiB) or DEFAULT_RAM_BYTES
    stage = extra.get(TEST_STAGE_KEY, "post_commit")
    if stage != "post_commit":
        if stage != "pre_commit" or os.environ.get(TESTING_ENV) != "1":
            raise ConnectorSettingsError(
                f"{_key(TEST_STAGE_KEY)}: a test-only setting (needs {TESTING_ENV}=1 and the "
                f"value 'pre_commit'), got {stage!r}")
    return ConnectorSettings(backend=backend, path=path, checkpoint_interval=interval,
                             ram_bytes=ram_bytes, capture_stage=stage)


def checkpoint_interval(settings: ConnectorSettings, vllm_config: Any) -> int:
    """Tokens between interval checkpoints: the setting, else the prefix-caching state
    block size (mamba cache mode ``align``), else :data:`DEFAULT_INTERVAL`."""
    if settings.checkpoint_interval is not None:
        return settings.checkpoint_interval
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching and cache.mamba_block_size:
        return int(cache.mamba_block_size)
    return DEFAULT_INTERVAL


def is_our_connector(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` configures ``RecoverSSMCheckpointConnector``."""
    kt = vllm_config.kv_transfer_config
    return kt is not None and kt.kv_connector == CONNECTOR_NAME


def settings_from_config(vllm_config: Any) -> ConnectorSettings:
    """The checked settings of the connector ``vllm_config`` configures."""
    kt = vllm_config.kv_transfer_config
    return parse_settings(kt.kv_connector_extra_config, kt.kv_role)
