"""Built-in request pools: ``standard`` and the decode-side ``decode_prealloc``."""
