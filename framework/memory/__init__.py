"""KV memory: request pools, the token/page allocator, per-layer K/V buffers, prefix caches."""
