"""Engines that run outside this process, each from its own installation: vLLM's OpenAI-compatible
server (``vllm``) and llama.cpp's ``llama-server`` (``llamacpp``), driven over HTTP on localhost.
Nothing here imports an engine: they pin their own torch and transformers, or are not Python."""
