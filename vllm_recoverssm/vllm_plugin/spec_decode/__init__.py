"""Drafters the plugin provides to vLLM's speculative decoding (``custom_class``)."""
