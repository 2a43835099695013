"""The plugserve hook specifications: the whole contract between the core and its plugins.

A plugin is any module or object with functions decorated by :data:`hookimpl` whose names match
the specs below. Plugins are found through the ``plugserve`` entry-point group (built-ins too), or
registered directly with ``get_plugins().pm.register(obj)`` in tests.

Registration hooks receive a ``register`` callable::

    register(name, factory, config=OptionsDataclass, capabilities=Capabilities(...))

``name`` is what a user writes in the config (``attention.backend: my_backend``); ``factory`` builds
the component; ``config`` is the plugin's own options dataclass (or ``None``): the user's
``options:`` block for that component is validated against it, so typos and wrong types fail at
start naming the key. ``capabilities`` (:class:`Capabilities`, optional) declares the devices it
runs on, its priority under ``auto``, and features the core checks (CUDA graphs, row
pre-allocation), so the core never probes a factory or names a built-in.
Every hookspec here must have a docstring and a section in docs/plugins.md
(a test checks both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from framework.registry import Capabilities

__all__ = ["Capabilities", "Register", "hookimpl", "hookspec"]

PROJECT_NAME = "plugserve"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[..., None]


# --- registration hooks: one per component kind ------------------------------------------------


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends.

    Factory signature: ``factory(runner, options) -> AttentionBackend``, where ``runner`` is the
    :class:`~framework.executor.model_runner.ModelRunner` (a backend should read only its
    ``device``, ``dtype``, ``kv_cache`` and ``req_pool``) and ``options`` is an instance of the
    registered options dataclass (or ``None``). Declare devices, ``auto`` priority and CUDA-graph
    support with ``capabilities=Capabilities(...)``. See
    :class:`framework.attention.base.AttentionBackend` for the interface.
    """


@hookspec
def register_memory_pools(register: Register) -> None:
    """Register request pools (``req_to_token[slot, position] -> KV index`` tables).

    Factory signature: ``factory(size: int, max_context_len: int, device: str, options)
    -> RequestPool``. ``size`` is the running-request cap. See
    :class:`framework.memory.request_pool.RequestPool`.
    """


@hookspec
def register_transfer_backends(register: Register) -> None:
    """Register KV transfer backends for prefill/decode disaggregation.

    Factory signature: ``factory(role: str, kv_layout, options) -> TransferBackend`` where ``role``
    is ``"prefill"`` or ``"decode"`` and ``kv_layout`` describes the per-layer K/V buffers (base
    pointers, bytes per page).
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model definitions, keyed by the Hugging Face ``architectures`` name.

    Factory signature: ``factory(hf_config, options) -> torch.nn.Module`` where the module has
    ``forward(input_ids, positions, forward_batch) -> hidden_states``,
    ``compute_logits(hidden_states) -> logits`` and ``load_weights(iterable of (name, tensor))``.
    Optional class attributes: ``accepts_mm_inputs = True`` (requests may carry images; the
    model reads ``forward_batch.mm_inputs`` and never looks up pad ids ``>= 2**30`` in its
    embedding), ``uses_mrope = True`` (positions arrive as ``[3, num_tokens]`` M-RoPE rows) and
    ``selects_logits_rows = True`` (``forward`` returns only the rows
    ``forward_batch.logits_indices`` names when it is set, so it can skip work on the others;
    otherwise the model runner selects them from every row).
    """


@hookspec
def register_schedule_policies(register: Register) -> None:
    """Register waiting-queue scheduling policies (``fcfs``, ``lpm``, ...).

    Factory signature: ``factory(options) -> SchedulePolicy``; a policy orders the waiting queue
    before each prefill round. See :class:`framework.scheduler.policy.SchedulePolicy`.
    """


@hookspec
def register_communicators(register: Register) -> None:
    """Register communicators: the collectives of tensor parallelism (``parallel.communicator``).

    Factory signature: ``factory(addr, port, rank, size, device, timeout_s, options) -> Communicator``:
    join the group of ``size`` ranks whose rendezvous is ``addr:port`` (rank 0 hosts it) and provide
    ``all_reduce``, ``all_gather``, ``broadcast_bytes``, ``barrier``, ``close``. See
    :class:`framework.distributed.communicator.Communicator`. A GPU build registers its own here
    (e.g. a custom all-reduce) and declares ``devices=("cuda",)`` and an ``auto`` priority.
    """


@hookspec
def register_memory_savers(register: Register) -> None:
    """Register memory savers (what ``/release_memory_occupation`` uses to free memory).

    Factory signature: ``factory(options) -> MemorySaver``. The model runner allocates weights, KV
    cache and request pool inside ``saver.region(tag)`` and then calls ``saver.track(tag, tensors,
    keep_contents)``; releases and resumes call ``pause(tag)`` / ``resume(tag)``. Declare the devices
    it runs on and its ``auto`` priority with ``capabilities``. See
    :class:`framework.memory.memory_saver.MemorySaver`.
    """


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register grammar backends for constrained decoding (``grammar.backend``, options in
    ``grammar.options``): JSON schema, regex, EBNF and structural-tag constraints.

    Factory signature: ``factory(tokenizer, vocab_size, options) -> GrammarBackend``
    (:class:`framework.grammar.base.GrammarBackend`): ``validate(spec)`` (cheap, in the HTTP
    process), ``compile(spec)`` (on a worker thread of the scheduler process; the result is cached
    and shared) and ``matcher(compiled, stop_token_ids)``, whose matchers accept tokens and fill
    int32 token bitmasks. Declare ``auto_priority`` and ``unavailable_reason`` (the library is not
    installed) in ``capabilities``: ``grammar.backend: auto`` picks the highest usable one.
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (``server.tool_call_parser``): they find the tool calls in a chat
    completion's text, whole or streamed.

    Factory signature: ``factory(options) -> ToolParser``
    (:class:`framework.parsing.tool_calls.ToolParser`): ``parse(text) -> (content, calls)`` and
    ``start_marker`` (the text that opens the calls, held back while streaming). They run in the
    HTTP process.
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers (``server.reasoning_parser``): they split a chat completion's
    text into ``reasoning_content`` and ``content``, whole or streamed.

    Factory signature: ``factory(options) -> ReasoningParser``
    (:class:`framework.parsing.reasoning.ReasoningParser`): the start and end markers and whether
    the output begins inside the reasoning. They run in the HTTP process.
    """


@hookspec
def register_logit_processors(register: Register) -> None:
    """Register logit processors: what a request names in SGLang's ``custom_logit_processor``
    (allowed only with ``server.enable_custom_logit_processor=true``; plugserve never runs code
    sent in a request).

    Factory signature: ``factory() -> LogitProcessor``
    (:class:`framework.sampling.logit_processor.LogitProcessor`), built once per scheduler process;
    called each step as ``processor(logits, params, output_ids) -> logits`` with the ``[rows,
    vocab]`` logits of the requests that use it (after ``logit_bias``, before penalties and
    temperature), their ``custom_params`` objects and their output tokens so far. ``config`` is
    the dataclass of ``custom_params``: a request's object must construct it, or it is a 400.
    """


@hookspec
def register_mm_processors(register: Register) -> None:
    """Register multimodal processors, keyed by the Hugging Face ``architectures`` name of the
    model they serve (register the model under the same name with ``register_models``).

    Factory signature: ``factory(model_path, hf_config, tokenizer, options) -> MultimodalProcessor``
    (:class:`framework.multimodal.processor.MultimodalProcessor`): ``process(prompt, images)``
    turns a prompt with one placeholder per image and the decoded ``PIL`` images into token ids
    whose image spans carry hash-derived pad ids, plus the
    :class:`~framework.multimodal.inputs.MultimodalInputs` (pixel tensors, spans, M-RoPE
    positions) the model reads. It runs where tokenization runs (the HTTP process, or the
    caller's process for the in-process Engine), never in the scheduler. A model with no
    processor registered is text-only.
    """


# --- core hooks: observation points with a built-in user ---------------------------------------


@hookspec
def on_batch_scheduled(batch: Any) -> None:
    """Called in the scheduler process each time a batch is about to run.

    ``batch`` is a :class:`framework.scheduler.stats.BatchStats` (mode, number of requests, new
    tokens, cached tokens, KV usage, queue length). Must be cheap: it runs on the hot path. The
    built-in ``batch_logging`` plugin logs prefill batches from here.
    """


@hookspec
def on_batch_finished(batch: Any, elapsed_s: float) -> None:
    """Called in the scheduler process after a batch's forward and sampling, with its wall time.

    The built-in ``batch_logging`` plugin reports decode throughput from here.
    """


@hookspec
def on_request_finished(request: Any) -> None:
    """Called in the scheduler process when a request finishes, is aborted or fails.

    ``request`` is a :class:`framework.scheduler.stats.RequestStats` (rid, prompt and output token
    counts, cached tokens, finish reason, timings).
    """


@hookspec
def extend_http_routes(config: Any) -> list:
    """Return extra Starlette routes (``starlette.routing.Route`` objects) to mount on the HTTP
    server. Called once in the HTTP process with the resolved config. The built-in server's
    ``/metrics`` route is added this way.
    """
