"""Engines under test: adapters that run inside another engine's process (transformers
continuous batching, vLLM, llama.cpp) and record kvdiff's probe points from its own tensors.

`protocol.Target` is what an adapter implements; `open_target(name, folder)` starts one.
"""
