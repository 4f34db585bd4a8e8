"""The plugin's additions to vLLM's ``vllm.distributed`` (KV connectors)."""
