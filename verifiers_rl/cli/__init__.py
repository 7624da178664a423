"""Command-line entry points: ``verifiers-rl train | eval | vllm-serve | fields | config`` (``cli.main``)."""
