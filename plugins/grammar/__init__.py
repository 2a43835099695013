"""Built-in grammar backends (each module is its own entry point)."""
