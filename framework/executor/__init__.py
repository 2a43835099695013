"""The executor layer: one forward pass over the paged KV cache.

``ModelRunner`` loads the model plugin and sizes and builds the KV cache, request pool, page
allocator and attention backend; ``ForwardBatch`` is one forward's inputs; ``CudaGraphRunner``
replays captured decode graphs on a GPU. The scheduler drives it; it imports nothing above it.
"""
