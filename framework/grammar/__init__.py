"""Constrained decoding: the grammar-backend interface (``base``) and the compile manager."""
