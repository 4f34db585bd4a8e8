"""``vllm serve`` under model runner V2 with asynchronous scheduling, on the CPU:
``python -m tests.support.serve_v2 serve MODEL ARGS...`` takes ``vllm``'s arguments.

On a CUDA GPU a default ``vllm serve`` of GLM-5.3 with MTP drafting runs model runner V2,
schedules asynchronously and turns prefix caching on in align mode. This launcher makes
vLLM's CPU engine do the same, with the changes
:mod:`vllm_recoverssm.harness.runner_v2` describes: Triton's
interpreter for V2's kernels, asynchronous scheduling turned back on after vLLM's CPU
platform turned it off, and the oracle drafting in V2's n-gram speculator (pass
``--speculative-config '{"method": "ngram_gpu", ...}'`` and the oracle file in
``--additional-config``). Everything else is ``vllm serve`` itself: its HTTP front end,
its engine-core process and the plugin, loaded through its entry point.

vLLM's CPU platform starts the engine-core process with ``spawn``, which imports the
parent's main module (this one) before anything else, so the changes are made at import
and hold in both processes. Import it nowhere else: it changes the process's environment.
"""

from __future__ import annotations

import sys

from vllm_recoverssm.harness import runner_v2

runner_v2.prepare(asynchronous=True)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
