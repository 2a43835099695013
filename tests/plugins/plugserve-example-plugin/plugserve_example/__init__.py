"""An example third-party plugserve plugin.

It registers, through the ``plugserve`` entry-point group exactly as any external package would:

- ``example_lifo``: a request pool that reuses the most recently freed row first (keeps hot rows
  of ``req_to_token`` in cache), with its own options dataclass;
- ``example_naive``: an attention backend written as plain per-request math (matmul, mask,
  softmax). It is slow and simple on purpose: a readable second implementation to check others by;
- ``ExampleLlamaForCausalLM``: a model for Llama checkpoints written with plugserve's
  tensor-parallel layers, so it runs on any ``parallel.tp_size``.
"""

from __future__ import annotations

from framework.hookspecs import hookimpl
from plugserve_example.attention import NaiveAttnBackend, NaiveOptions
from plugserve_example.model import ExampleLlamaForCausalLM
from plugserve_example.pool import LifoPoolOptions, LifoRequestPool


@hookimpl
def register_memory_pools(register) -> None:
    """Register the LIFO pool."""
    register("example_lifo", LifoRequestPool.create, config=LifoPoolOptions)


@hookimpl
def register_attention_backends(register) -> None:
    """Register the naive attention backend."""
    register("example_naive", NaiveAttnBackend.create, config=NaiveOptions)


@hookimpl
def register_models(register) -> None:
    """Register the tensor-parallel example model."""
    register("ExampleLlamaForCausalLM", ExampleLlamaForCausalLM)
