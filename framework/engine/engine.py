"""The in-process engine: ``Engine(config).generate(...)`` and ``Engine.stream(...)``.

It drives the same Scheduler the server's scheduler process runs, from the calling thread.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig
from transformers import AutoTokenizer

from framework.config.loader import resolve_config, to_settings
from framework.config.schema import PlugserveConfig
from framework.disaggregation.factory import make_pd_side
from framework.engine.request_state import RequestState, make_sampling_params
from framework.engine.rollout_api import RolloutMethods
from framework.engine.tensor_parallel import FollowerProcesses, leader_start
from framework.errors import ConfigError
from framework.executor.model_runner import ModelRunner
from framework.models.loader import load_generation_config
from framework.multimodal.factory import build_processor
from framework.multimodal.images import load_image
from framework.multimodal.inputs import MultimodalInputs
from framework.sampling.params import SamplingParams, choice_seed
from framework.scheduler.replicated import ReplicatedScheduler
from framework.scheduler.request import Req
from framework.scheduler.scheduler import Scheduler

Prompt = str | list[int]
ImageData = Any
"""One image (``PIL.Image``, bytes, file path, ``data:`` URL or base64) or a list of them: SGLang's
``image_data``."""


def eos_token_ids(generation_defaults: dict[str, Any], tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, else the tokenizer's."""
    ids = generation_defaults.get("eos_token_id")
    if ids is None and tokenizer is not None:  # no tokenizer: model.skip_tokenizer_init
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, list | tuple) else [int(ids)]


class Engine(RolloutMethods):
    """Load a model from config and generate with it in this process (RL methods: see
    :class:`~framework.engine.rollout_api.RolloutMethods`)."""

    def __init__(
        self,
        config: PlugserveConfig | DictConfig | None = None,
        *,
        overrides: Sequence[str] = (),
        config_file: str | None = None,
        progress: bool = True,
    ) -> None:
        if config is None:
            config = resolve_config(config_file, overrides)
        self.settings = to_settings(config)
        model_cfg = self.settings.model
        if self.settings.parallel.dp_size != 1:
            raise ConfigError(f"parallel.dp_size: {self.settings.parallel.dp_size} replicas need plugserve serve (its "
                              "HTTP process balances them); the in-process Engine runs one, set parallel.dp_size=1")
        # This process is rank 0; the other ranks start first, and import while it loads the tokenizer.
        with leader_start(self.settings) as leader:
            self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path or model_cfg.path)
            comm = None if leader is None else leader.join()
            self.runner = ModelRunner(self.settings, progress=progress)
            scheduler = Scheduler(self.settings, self.runner, self.tokenizer, pd_side=make_pd_side)
        self.followers: FollowerProcesses | None = None if leader is None else leader.followers
        self.scheduler = scheduler if comm is None else ReplicatedScheduler(scheduler, comm, self.followers)
        # Images are processed here, in the caller's process, as the HTTP server does in its own.
        self.mm_processor = build_processor(self.runner.model_path, self.runner.hf_config, self.tokenizer,
                                            self.runner.architecture)
        self.generation_defaults = load_generation_config(model_cfg.path)
        self.eos_token_ids = eos_token_ids(self.generation_defaults, self.tokenizer)
        self._states: dict[str, RequestState] = {}
        self._counter = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def _tokenize(self, prompt: Prompt, image_data: ImageData = None) -> tuple[list[int], MultimodalInputs | None]:
        images = image_data if isinstance(image_data, list | tuple) else [] if image_data is None else [image_data]
        if images and self.mm_processor is None:
            raise ValueError(f"model {self.runner.architecture} does not take images (no mm_processor)")
        if self.mm_processor is not None:
            # Text-only prompts too: a placeholder without an image is refused, not embedded.
            return self.mm_processor.process(prompt, [load_image(i) for i in images])
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), None
        return list(prompt), None

    def submit(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        image_data: ImageData = None,
    ) -> str:
        """Queue one request (n == 1); returns its id. Drive it with :meth:`step`.

        ``image_data``: the prompt's images in placeholder order (see :meth:`generate`)."""
        params = make_sampling_params(sampling_params, self.generation_defaults)
        rid = rid or f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        ids, mm_inputs = self._tokenize(prompt, image_data)
        req = Req(
            rid=rid,
            input_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            return_logprob=return_logprob or top_logprobs_num > 0 or logprob_start_len >= 0,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            mm_inputs=mm_inputs,
        )
        self.scheduler.add_request(req)
        self._states[rid] = RequestState(rid, self.tokenizer, ids, params, req.return_logprob)
        return rid

    def step(self) -> dict[str, str]:
        """Run one scheduler step; return the text delta of each request that advanced."""
        if self.followers is not None:
            self.followers.check()  # a dead rank would leave the next collective waiting
        deltas: dict[str, str] = {}
        for out in self.scheduler.step():
            state = self._states.get(out.rid)
            if state is not None:
                deltas[out.rid] = deltas.get(out.rid, "") + state.apply(out)
        return deltas

    def generate(
        self,
        prompt: Prompt | list[Prompt],
        sampling_params: dict[str, Any] | SamplingParams | list[dict[str, Any]] | None = None,
        image_data: ImageData | list[ImageData] = None,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict result) or a batch (a list), SGLang's result shape.

        ``sampling_params`` may hold ``n``: each prompt then yields ``n`` results (seeded
        samples use ``seed + i``). ``image_data`` (vision-language models): for one prompt, an
        image or a list of images; for a batch, one such entry (or None) per prompt. An image is a
        ``PIL.Image``, encoded bytes, a file path, a ``data:`` URL or base64 text; the prompt holds
        one placeholder per image (the processor's ``image_placeholder``, which the chat template
        emits).
        """
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))
        )
        prompts: list[Prompt] = [prompt] if single else list(prompt)  # type: ignore[list-item]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if single or image_data is None:
            images_list = [image_data] * len(prompts)
        elif isinstance(image_data, list) and len(image_data) == len(prompts):
            images_list = list(image_data)
        else:
            raise ValueError(f"image_data for a batch of {len(prompts)} prompts must be a list with one entry each")
        rids: list[str] = []
        for p, sp, images in zip(prompts, params_list, images_list, strict=True):
            params = make_sampling_params(sp, self.generation_defaults)
            for i in range(params.n):
                sub = SamplingParams.from_dict({**params.to_dict(), "n": 1})
                if params.seed is not None:
                    sub.seed = choice_seed(params.seed, i)
                rids.append(self.submit(p, sub, image_data=images, **kwargs))
        self.run_until_done(rids)
        results = [self._states.pop(r).result() for r in rids]
        return results[0] if single and len(results) == 1 else results

    def run_until_done(self, rids: Sequence[str]) -> None:
        pending = set(rids)
        while pending:
            self.step()
            pending = {r for r in pending if not self._states[r].finished}

    def stream(
        self, prompt: Prompt, sampling_params: dict[str, Any] | SamplingParams | None = None, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        """Yield ``{"text": delta, "output_ids": new ids, "finished": bool, "meta_info": ...}``."""
        rid = self.submit(prompt, sampling_params, **kwargs)
        state = self._states[rid]
        sent_ids = 0
        try:
            while not state.finished:
                delta = self.step().get(rid)
                if delta is None and not state.finished:
                    continue
                new_ids = state.output_ids[sent_ids:]
                sent_ids = len(state.output_ids)
                yield {
                    "text": delta or "",
                    "output_ids": new_ids,
                    "finished": state.finished,
                    "meta_info": state.meta_info(),
                }
        finally:
            if not state.finished:
                self.abort(rid)
            self._states.pop(rid, None)

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    # -- introspection ---------------------------------------------------------------------

    def leak_report(self) -> dict[str, int]:
        """KV accounting; when idle, ``leaked`` must be 0 and every request row free."""
        return self.scheduler.leak_report()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def close(self) -> None:
        """Stop the scheduler (and the other tensor-parallel ranks, when there are some)."""
        self.scheduler.close()
        if self.followers is not None:
            self.followers.stop()
            self.followers = None
            from framework.distributed.state import get_tensor_parallel, set_tensor_parallel

            get_tensor_parallel().comm.close()
            set_tensor_parallel(None)
