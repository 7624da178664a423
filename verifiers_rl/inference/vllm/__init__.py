"""A vLLM server: its client engine, HTTP, recovery, weight loads and its launcher."""
