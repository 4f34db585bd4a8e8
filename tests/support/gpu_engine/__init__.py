"""vLLM's real engine on a CUDA GPU with the plugin: the session that runs the GPU engine
tests' cases (:mod:`.session`) and the stand-ins for vLLM's compiled modules
(``standins/``, copied over vLLM's Python tree by ``scripts/gpu-engine/device-run.sh``)."""
