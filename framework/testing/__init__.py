"""Testing helpers for plugserve and for plugin authors (tiny models, conformance checks)."""
