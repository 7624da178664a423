"""Faster steps the embedded engine takes: CPU matmuls, a lean Llama decode step, CUDA graphs."""
