"""GLM-5.3 KDA rows computed with the project's own ops: vLLM's CPU platform, where vLLM
has no KDA kernels, and the recovery and full-state paths everywhere vLLM's kernels do not
reach."""
