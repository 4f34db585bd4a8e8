"""Helpers the tests share: tiny models, engine runs, vLLM configs, servers.

Not collected (no ``test_`` modules); test modules import them as ``tests.support.*``.
"""
