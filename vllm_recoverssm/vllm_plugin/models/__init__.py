"""Model-side pieces of the plugin, by model family (names follow ``vllm.models``)."""
