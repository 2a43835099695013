"""The configuration schema: OmegaConf structured dataclasses.

Every number a heuristic uses is a named field here with its default documented beside it; code
never hides one in a literal. ``conf/serve.yaml`` is the default preset merged over these defaults,
then the user's ``--config FILE``, then CLI dotlist overrides (``scheduler.chunked_prefill_size=512``).

Fields named ``options`` hold a plugin's own options: they are typed ``Any`` here and validated
against the options dataclass the selected plugin registered (see ``framework.config.loader``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

# The device section lives in its own module; its names stay importable from here (the schema is one namespace).
from framework.config.device_schema import CpuLinear as CpuLinear
from framework.config.device_schema import CpuPrefillGemm as CpuPrefillGemm
from framework.config.device_schema import CpuSmallGemm as CpuSmallGemm
from framework.config.device_schema import Device as Device
from framework.config.device_schema import DeviceConfig as DeviceConfig


class DType(Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DisaggregationMode(Enum):
    prefill = "prefill"
    decode = "decode"


@dataclass
class ModelConfig:
    """Which model to serve and how to load it."""

    path: str = "${asset:tiny-shakespeare}"
    """A Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory; defaults to ``path``."""
    architecture: Optional[str] = None
    """Override the ``architectures[0]`` of config.json (a registered model name)."""
    dtype: DType = DType.auto
    """auto: the checkpoint's dtype on GPU; on CPU, bfloat16 for a bfloat16 checkpoint where the CPU has
    native bf16 dot products (AVX512-BF16 or AMX), else float32 (bf16 matmul is many times slower than
    fp32 on CPUs without them, e.g. AVX2-only ones). An explicit dtype always wins."""
    context_length: Optional[int] = None
    """Longest request (prompt + output); default: the model's max_position_embeddings."""
    served_model_name: Optional[str] = None
    """Name in /v1/models and the ``model`` field; default: the directory's name. Requests may
    also name the model by ``path`` (what SGLang's and vLLM's clients send by default)."""
    skip_tokenizer_init: bool = False
    """Serve without loading a tokenizer (the model directory needs none): requests send token ids
    (``input_ids``, or a list of ids as a completion ``prompt``) and read ``output_ids``; anything
    that needs text (text prompts, chat, stop strings, echo, token texts in logprobs, /v1/tokenize)
    is a 400 naming the field. SGLang's ``--skip-tokenizer-init``."""
    options: Any = field(default_factory=dict)
    """Options of the model plugin (validated against its options dataclass)."""


@dataclass
class AttentionConfig:
    """The attention backend plugin."""

    backend: str = "auto"
    """A registered attention backend; auto: the highest ``auto_priority`` its registration declares
    for the device among those that can run here (built-ins: flashinfer, then triton, then
    torch_native on GPU; cpu_paged, then torch_native on CPU)."""
    options: Any = field(default_factory=dict)


@dataclass
class MemoryPoolConfig:
    """The request-pool plugin (``req_to_token`` table)."""

    name: str = "auto"
    """A registered memory pool; auto: the highest ``auto_priority`` one, among those declaring
    ``preallocation`` on a PD decode server (built-ins: decode_prealloc there, else standard)."""
    options: Any = field(default_factory=dict)


@dataclass
class MemorySaverConfig:
    """The memory-saver plugin: how ``/release_memory_occupation`` frees weights and KV cache."""

    name: str = "auto"
    """A registered memory saver; auto: the highest ``auto_priority`` one that can run on the
    device (built-ins: cpu on CPU, torch_memory_saver on CUDA when the package is installed, else
    none, which refuses releases)."""
    options: Any = field(default_factory=dict)


@dataclass
class KVCacheConfig:
    """Paged KV cache sizing."""

    page_size: int = 1
    """Tokens per KV page (radix keys and transfers are page-aligned)."""
    dtype: DType = DType.auto
    """auto: the model's dtype."""
    cpu_memory_budget_gb: float = 2.0
    """KV cache size on CPU, in GiB (there is no free-memory query that means anything there)."""
    gpu_memory_fraction: float = 0.85
    """On GPU: fraction of the device memory still free after loading weights given to KV."""
    max_total_tokens: Optional[int] = None
    """Override the KV capacity in tokens (takes precedence over the budget)."""


@dataclass
class RadixCacheConfig:
    """Prefix sharing across requests."""

    enabled: bool = True


@dataclass
class SchedulerConfig:
    """Continuous batching."""

    policy: str = "fcfs"
    """Waiting-queue order: a registered schedule policy (fcfs, lpm, ...)."""
    policy_options: Any = field(default_factory=dict)
    fair_admission: bool = True
    """Admit waiting requests round-robin across the HTTP requests (batches, ``n`` choices) they
    came in, keeping the policy's order within each: one client's batch of hundreds of prompts
    cannot hold back everyone who arrived after it. false: the policy's order alone."""
    max_running_requests: Optional[int] = None
    """Cap on requests decoding together; default derived from KV capacity (see below)."""
    max_running_requests_limit: int = 256
    """Upper bound of the derived running cap."""
    expected_tokens_per_request: int = 64
    """The derived running cap is KV capacity / this (clamped to the limit above)."""
    max_prefill_tokens: Optional[int] = None
    """Token budget of one prefill batch. null (auto): 16384 on GPU (SGLang's default); on CPU 1024,
    where fp32 GEMMs slow down once the activations outgrow the caches (measured on 2 Zen 4 cores:
    ~205 GFLOP/s at 1024 rows, ~160 at 8192; a 64 x 128-token prefill took 7.8 s instead of 10.8),
    and 2048 for weights served in bf16 where oneDNN has AMX tiles (measured there only; other
    CPUs keep 1024), whose GEMMs on AMX still gain from 1024 to ~2000 rows and
    where a wave of 16 128-token prompts then prefills in one step instead of two (at 16 streams on
    Sapphire Rapids: p99 TTFT 277-321 ms instead of 366-402, the same throughput; docs/benchmarks.md).
    The CPU value is resolved by the scheduler once the served dtype is known; until then it reads
    null."""
    chunked_prefill_size: Optional[int] = 2048
    """Longest prefill chunk of one request; null disables chunking."""
    max_queued_requests: Optional[int] = None
    """Waiting-queue limit; beyond it requests are refused (HTTP 503). null: unlimited."""
    init_new_token_ratio: float = 0.7
    """Fraction of a request's remaining max_new_tokens assumed when admitting new prefills."""
    min_new_token_ratio: float = 0.1
    """The ratio decays towards this while decoding runs without retraction."""
    new_token_ratio_decay_steps: int = 600
    """Decode steps over which the ratio decays from init to min."""
    clip_max_new_tokens_estimation: int = 4096
    """Per-request cap on the max_new_tokens used in the admission estimate."""
    retract_decode_steps: int = 20
    """After a retraction, KV kept free for this many decode steps of the running batch."""
    in_batch_prefix_check_tokens: int = 32
    """A waiting request whose first this-many tokens equal those of a request already in the
    prefill batch being built (and not cached yet) waits for the next batch, where it hits the
    prefix cache instead of computing the same prefix twice. 0 disables the check."""
    overlap: bool = False
    """Schedule step N+1 while step N's forward runs (outputs are identical)."""
    mixed_chunk: Optional[bool] = None
    """Mixed steps: a prefill (chunk) and the running requests' decode rows share one forward, so
    running streams keep producing tokens while a newcomer prefills (SGLang's
    ``--enable-mixed-chunk``; vLLM's chunked-prefill scheduling). Outputs are identical. null
    (auto): on for a CPU server that can run them (no ``overlap``, no disaggregation), off on GPU
    (SGLang's default) and wherever they cannot run; true where they cannot run (with ``overlap`` or
    disaggregation) is a config error."""
    mixed_chunk_min_running: Optional[int] = None
    """Mixed steps only while at least this many requests decode; with fewer, a prefill runs alone
    before the decode steps resume (as without mixed steps), for at most
    ``mixed_chunk_max_stalled_steps`` steps in a row. null (auto): 32 on CPU, 1 on GPU. Why
    CPU waits: there a mixed step costs about the sum of its two halves (both compute-bound from a few
    dozen rows), so mixing only moves latency; with a small decode batch prefill-first gave the
    lower TTFT at the same throughput, with a large one mixed steps gave the lower TTFT (see
    docs/benchmarks.md, "Mixed steps for large decode batches")."""
    mixed_chunk_max_stalled_steps: Optional[int] = 1
    """Below ``mixed_chunk_min_running``, the running requests wait through at most this many
    prefill-only steps in a row: the next prefill step mixes their decode rows in, as a mixed step
    would from the threshold on. Without it a backlog of prompts (a wave of arrivals, a long prompt
    in chunks) stops every running stream for as many steps as the backlog takes (at 64 streams
    four 1024-token steps, ~5 s between two tokens on the AVX2 host); a single prefill still runs
    alone first, which keeps the lower TTFT that prefill-first gives small batches. 0: mix whenever
    a request decodes (as ``mixed_chunk_min_running=1``); null: no limit."""
    mixed_chunk_max_tokens: Optional[int] = None
    """Token budget of a mixed step, its decode rows included (a prefill alone keeps
    ``max_prefill_tokens``). null (auto): 1792 on CPU (at 64 decode rows, 1536 gave lower TTFT but
    higher TPOT, 2048 the opposite), ``max_prefill_tokens`` on GPU."""
    stream_interval: int = 1
    """Send streamed tokens every this many decode steps."""


@dataclass
class CudaGraphConfig:
    """CUDA graphs for decode: one graph captured per batch-size bucket at start, replayed for
    decode batches padded to the smallest bucket that holds them (GPU only)."""

    enabled: Optional[bool] = None
    """null (auto): on when the device is CUDA and the attention backend supports CUDA graphs,
    off otherwise (always off on CPU, and on a PD prefill server, which never decodes). true on a
    CPU device, or with a backend without support, is a start-up error."""
    max_batch_size: int = 160
    """Largest captured bucket; larger decode batches run eagerly. Also capped by the running
    request limit (a bucket for the cap itself is added so every runnable batch fits one)."""
    batch_sizes: Optional[list[int]] = None
    """The buckets to capture; null: 1, 2, 4, then every 8 up to ``max_batch_size``. Each bucket
    costs capture time at start and some GPU memory; a batch pads up to the next bucket."""
    num_warmup_runs: int = 2
    """Eager runs of each bucket before its capture (lazy planning, kernel compilation and
    autotuning must happen outside the graph)."""


@dataclass
class GrammarConfig:
    """Constrained decoding (JSON schema, regex, EBNF, structural tags; tool_choice required)."""

    backend: str = "auto"
    """A registered grammar backend; auto: the highest ``auto_priority`` one that can run here
    (built-ins: xgrammar, then llguidance when installed; none refuses constrained requests)."""
    options: Any = field(default_factory=dict)
    compile_threads: int = 2
    """Worker threads compiling grammars in the scheduler process (off the decode loop)."""
    cache_entries: int = 256
    """Compiled grammars kept (LRU), keyed by the constraint's exact text."""
    jump_forward: bool = False
    """Jump-forward decoding: tokens the grammar forces (JSON keys, punctuation) are appended without
    sampling and computed in one prefill (the request leaves the decode batch for it, as in SGLang).
    Requests that want logprobs never jump (forced tokens have none)."""
    queue_poll_s: float = 0.005
    """When nothing but requests waiting for their grammar is left, the scheduler waits up to this
    long for a compile before it looks at new messages again (instead of spinning)."""


EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""The values of ``server.event_loop`` (resolved by :mod:`framework.server.http_stack`)."""

HTTP_PARSERS = ("auto", "httptools", "h11")
"""The values of ``server.http_parser``."""


@dataclass
class ServerConfig:
    """The HTTP server."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    """Bearer token required on inference routes when set; null: ``$PLUGSERVE_API_KEY`` if set
    (a key in the environment or a config file does not show in ``ps`` as a CLI argument does)."""
    admin_key: Optional[str] = None
    """Bearer token required on admin routes (flush_cache, abort_request) when set; null:
    ``$PLUGSERVE_ADMIN_KEY`` if set."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body on every route (413 beyond)."""
    max_json_depth: int = 64
    """Deepest nesting of arrays and objects in a JSON body (400 beyond): bounds the recursion of
    every parser and template that walks the body afterwards."""
    max_n: int = 16
    """Largest ``n`` (choices per request)."""
    max_sequences_per_request: int = 256
    """Largest number of prompts x ``n`` in one HTTP request (400 beyond): each is one scheduler
    request, so one body cannot queue thousands of them."""
    max_connections: int = 1024
    """Open HTTP connections served at once; a connection beyond it gets a 503 and is closed."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive connection is closed after this long without a new request."""
    header_read_timeout_s: float = 20.0
    """A connection must send a request's complete headers within this long of opening (or of
    the previous response): an idle or slow-header connection is closed (408 if it sent part)."""
    body_read_timeout_s: float = 60.0
    """A request's whole body must arrive within this long of its headers (408 beyond)."""
    max_top_logprobs: int = 20
    """Largest ``top_logprobs`` / ``top_logprobs_num``."""
    log_level: str = "info"
    log_requests: bool = False
    tool_call_parser: Optional[str] = None
    """A registered tool-call parser (llama3_json, hermes / qwen25, mistral, ...) that finds tool
    calls in chat output; null: ``tool_choice`` auto is refused (required and a named function
    still work: the grammar backend enforces them)."""
    reasoning_parser: Optional[str] = None
    """A registered reasoning parser (deepseek_r1, qwen3, ...) that moves the model's thinking
    into ``reasoning_content``; null: the text is returned as it is."""
    scheduler_start_timeout_s: float = 600.0
    """How long to wait for the scheduler process to load the model."""
    health_check_timeout_s: float = 20.0
    """/health_generate gives up after this long."""
    first_token_wait_ms: float = 0.0
    """After a step that gave a request its first token, the scheduler waits up to this long for
    the HTTP process to say that token is written to the client before it starts the next step
    (only when another step is due); 0, the default, does not wait. On a machine with few cores
    the next step's threads otherwise hold every core while the token crosses the HTTP process.
    Measured on 2 cores with 5: that hop's 90th percentile 1-3.6 ms instead of 4-6, its median
    and the served TTFT at one stream unchanged, and at 64 streams ~3% more median TTFT at the same
    throughput (docs/benchmarks.md), so it is off unless a host shows the gain."""
    sglang_metric_names: bool = False
    """/metrics also exports SGLang's metric names (``sglang:num_running_reqs``, ``sglang:token_usage``,
    ``sglang:time_to_first_token_seconds``, ... labelled ``model_name``), so dashboards built for
    SGLang work unchanged. plugserve's own ``plugserve_*`` names are always exported."""
    enable_custom_logit_processor: bool = False
    """SGLang's switch for ``custom_logit_processor``. In SGLang the field is dill-serialized Python
    code that the server runs; plugserve never runs code from a request: with true, a request may
    name a registered logit processor plugin (``register_logit_processors``) and pass it
    ``custom_params``; with false the field is a 400 (see docs/api.md)."""
    shutdown_timeout_s: float = 10.0
    """On SIGTERM / Ctrl-C: how long open requests may finish (then each still open gets a 503, or
    in a stream a final chunk with finish reason abort, an error event and ``[DONE]``), then how
    long the scheduler process has to exit before it is terminated."""
    max_weight_update_bytes: int = 1 << 30
    """Body limit of ``/update_weights_from_tensor`` (base64 tensors; send big models in chunks)."""
    event_loop: str = "auto"  # one of EVENT_LOOPS
    """The HTTP process's asyncio event loop: ``uvloop`` (libuv, what ``uvicorn[standard]`` and
    vLLM's and SGLang's servers run), ``asyncio`` (the standard library's), or ``auto``: uvloop when
    it is installed. On the 2-core test host the standard loop with h11 cost 0.4-2.9 ms of median
    TTFT at one stream and 12-29% more of the HTTP process's CPU (docs/benchmarks.md)."""
    http_parser: str = "auto"  # one of HTTP_PARSERS
    """The HTTP/1.1 protocol: ``httptools`` (llhttp, in C), ``h11`` (pure Python), or ``auto``:
    httptools when it is installed. Both get the same limits and error shapes
    (:mod:`framework.server.connection`)."""
    rollout_timeout_s: float = 600.0
    """How long an RL call (``/release_memory_occupation``, ``/update_weights_*``, ...) may wait for
    the scheduler: for running requests to finish, weights to load, a trainer to join a group."""
    # Image inputs (multimodal models; docs/models.md). Bodies carry base64 images, so raise
    # max_body_bytes with these: a data URL is 4/3 of the image's bytes.
    max_images_per_request: int = 8
    """Images in one HTTP request, over all its prompts and messages (400 beyond)."""
    max_image_pixels: int = 4096 * 4096
    """Width x height of one image, checked from its header before it is decoded (400 beyond):
    bounds the memory a small compressed file can expand to."""
    max_image_bytes: int = 10 * 1024 * 1024
    """Encoded bytes of one image (after base64 decoding, or as fetched) (400 beyond)."""
    max_image_bytes_per_request: int = 32 * 1024 * 1024
    """Encoded bytes of all the images of one request together (400 beyond)."""
    image_formats: list[str] = field(default_factory=lambda: ["PNG", "JPEG", "WEBP"])
    """Pillow format names the server decodes; any other format is a 400 (only these decoders
    ever see client bytes)."""
    allow_remote_images: bool = False
    """Fetch http(s) image URLs. Off by default: a URL makes the server open a connection of the
    client's choosing (SSRF); with it off such URLs are a 400."""
    remote_image_timeout_s: float = 10.0
    """A remote image must arrive completely within this long (400 beyond)."""
    allow_image_paths: bool = False
    """Read images from local file paths (``/generate`` ``image_data``, ``file://`` URLs). Off by
    default: anyone with the API key could read any image file the server can."""


class LoadBalanceMethod(Enum):
    round_robin = "round_robin"
    shortest_queue = "shortest_queue"


@dataclass
class ParallelConfig:
    """Tensor and data parallelism (SGLang's ``--tp-size``, ``--dp-size``, ``--dist-init-addr``,
    ``--nnodes``, ``--node-rank``)."""

    tp_size: int = 1
    """Tensor-parallel ranks per engine replica: each holds 1/tp of the attention heads, MLP columns
    and vocabulary, and its own KV heads; one scheduler process per rank (gloo on CPU, NCCL on GPU)."""
    dp_size: int = 1
    """Engine replicas behind one HTTP server (each a tp_size group), load-balanced per request."""
    load_balance_method: LoadBalanceMethod = LoadBalanceMethod.round_robin
    """How the HTTP process picks a data-parallel replica: round_robin, or shortest_queue (the one
    with the fewest running + waiting requests it knows of)."""
    dist_init_addr: Optional[str] = None
    """host:port of the tensor-parallel rendezvous (rank 0's node); null: 127.0.0.1 and a free port
    (one host). Needed when nnodes > 1."""
    nnodes: int = 1
    """Hosts the tensor-parallel ranks span (tp_size must be a multiple)."""
    node_rank: int = 0
    """This host's index among nnodes (0 runs the HTTP server and rank 0)."""
    communicator: str = "auto"
    """A registered communicator (all-reduce / all-gather for the parallel layers); auto: the
    highest ``auto_priority`` one for the device (built-in: torch_distributed)."""
    communicator_options: Any = field(default_factory=dict)
    """Options of the communicator plugin (validated against its options dataclass)."""
    dist_timeout_s: float = 600.0
    """How long a collective may wait for a peer rank before the ranks give up (a dead rank)."""


@dataclass
class DisaggregationConfig:
    """Prefill/decode disaggregation."""

    mode: Optional[DisaggregationMode] = None
    """null (unified), prefill or decode."""
    transfer_backend: str = "mooncake"
    """A registered KV transfer backend: mooncake, nixl, nccl."""
    transfer_options: Any = field(default_factory=dict)
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    """Port of the prefill server's bootstrap service."""
    bootstrap_timeout_s: float = 30.0
    """A request fails if the peer has not registered within this time."""
    transfer_timeout_s: float = 60.0
    """A request fails if its KV transfer has not completed within this time."""
    decode_reserved_tokens_per_request: int = 64
    """Decode side: KV kept back per running request so pre-allocation cannot starve decodes."""


@dataclass
class PlugserveConfig:
    """The whole configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    memory_pool: MemoryPoolConfig = field(default_factory=MemoryPoolConfig)
    memory_saver: MemorySaverConfig = field(default_factory=MemorySaverConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    radix_cache: RadixCacheConfig = field(default_factory=RadixCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
