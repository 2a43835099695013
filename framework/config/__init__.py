"""Structured configuration: the schema dataclasses and the loader that merges presets."""
