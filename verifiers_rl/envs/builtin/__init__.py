"""Built-in environments, each a module exposing ``load_environment(tokenizer=..., **kwargs)``."""
