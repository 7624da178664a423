"""The embedded engine: a transformers model decoding on its own copy of the weights."""
