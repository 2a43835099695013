"""Benchmarks: ``plugserve bench offline | one-batch`` (and more in later work)."""
