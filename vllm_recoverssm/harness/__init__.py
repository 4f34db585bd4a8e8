"""Test and demo harnesses: what ``recoverssm`` sub-commands and the tests run around the
product (the vLLM plugin). Nothing here is imported by ``vllm serve``."""
