"""GLM-5.3 ("glm5next"): the recovery KDA layer and the model classes that use it.

Importing this package imports vLLM's GLM-5.3 model code; vLLM does that only when a
GLM-5.3 architecture is resolved.
"""
