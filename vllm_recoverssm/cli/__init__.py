"""The ``recoverssm`` command line."""
