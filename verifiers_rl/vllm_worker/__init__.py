"""Code that runs INSIDE a vLLM server process (its own venv), put on the server's PYTHONPATH alone.

Nothing here may import ``verifiers_rl`` or the trainer's dependencies: standard library, torch, safetensors and
vllm only. ``verifiers_rl.inference.vllm.server`` passes this folder as ``PYTHONPATH``.
"""
