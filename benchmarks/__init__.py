"""Side-by-side benchmarks against peer engines (transformers, vLLM, llama.cpp): the drivers,
GGUF conversion and the comparison, kept out of the ``framework`` core.

``plugserve bench compare`` comes from here through the ``plugserve.bench`` entry-point group
(see pyproject.toml): the core's CLI lists the commands registered there and imports nothing of
this package. ``vllm_peer.py`` and ``llamacpp_peer.py`` run as scripts in the peers' own venvs.
"""
