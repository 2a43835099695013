"""Multimodal inputs: images turned into tensors in the HTTP process and placed in the prompt by
the model in the scheduler process (see docs/architecture.md, "Multimodal data path")."""
