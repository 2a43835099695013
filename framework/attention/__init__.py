"""Attention: the backend interface models call, and the per-layer attention module."""
