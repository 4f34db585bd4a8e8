"""``RecoverSSMCheckpointConnector``: vLLM KV connector for request-boundary checkpoints.

The connector class lives in :mod:`.connector` and is imported by vLLM's connector factory
only where a connector is built (the plugin registers the name, :func:`register`); the
other modules here import nothing from vLLM at package import, so the plugin's KDA layer
can consult :mod:`.taps` cheaply.
"""

from __future__ import annotations

from .settings import CONNECTOR_NAME

CONNECTOR_MODULE = "vllm_recoverssm.vllm_plugin.distributed.kv_connector.connector"
CONNECTOR_CLASS = "RecoverSSMCheckpointConnector"

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (idempotent)."""
    from ... import compat

    compat.register_kv_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
