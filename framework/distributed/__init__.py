"""Tensor-parallel process groups and the communicator the parallel layers call."""
