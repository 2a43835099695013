"""Constrained requests in the scheduler: the grammar queue, matchers, bitmasks, acceptance.

A request with a constraint (``json_schema``, ``regex``, ``ebnf``, ``structural_tag``) does not
enter the waiting queue until its grammar is compiled: the compile runs on the
:class:`~framework.grammar.manager.GrammarManager`'s threads and the request waits here meanwhile,
so a slow compile never stalls the batch (SGLang's grammar queue). Once running, each step fills
its row of the token bitmask from its matcher before sampling, and every sampled token is fed
back to the matcher; a matcher that terminates ends the request with finish reason ``stop``.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from framework.config.schema import PlugserveConfig
from framework.grammar.base import GrammarError, spec_of
from framework.grammar.manager import GrammarManager
from framework.plugins import get_plugins
from framework.sampling.grammar_mask import full_bitmask
from framework.scheduler.request import FinishReason, Req


class GrammarAdmissionError(ValueError):
    """A constrained request that cannot run here (no tokenizer, PD mode, a bad grammar)."""


class GrammarQueue:
    """The scheduler's constrained-decoding state; the backend is built on first use."""

    def __init__(self, settings: PlugserveConfig, tokenizer: Any, vocab_size: int) -> None:
        self.cfg = settings.grammar
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pending: list[Req] = []
        self.jumped_tokens = 0
        """Tokens appended by jump-forward decoding (not sampled)."""
        self._manager: GrammarManager | None = None

    @property
    def manager(self) -> GrammarManager:
        if self._manager is None:
            comp = get_plugins().registry.get("grammar_backend", self.cfg.backend, key="grammar.backend")
            backend = comp.factory(self.tokenizer, self.vocab_size, comp.make_options(self.cfg.options))
            self._manager = GrammarManager(backend, self.cfg.compile_threads, self.cfg.cache_entries)
        return self._manager

    def admit(self, req: Req, pd: bool = False) -> bool:
        """Start the request's compile; True if it must wait here for it (False: no grammar, or a
        cached one, already attached). Raises GrammarAdmissionError when it cannot run."""
        spec = spec_of(req.sampling_params)
        if spec is None:
            return False
        if pd:
            raise GrammarAdmissionError(f"{spec.kind}: constrained decoding is not supported with "
                                        "prefill/decode disaggregation")
        if self.tokenizer is None:
            raise GrammarAdmissionError(f"{spec.kind}: constrained decoding needs the model's tokenizer")
        req.grammar_future = self.manager.compile(spec)
        if not req.grammar_future.done():
            self.pending.append(req)
            return True
        error = self._attach(req)
        if error is not None:
            raise GrammarAdmissionError(error)
        return False

    def _attach(self, req: Req) -> str | None:
        """The matcher of a request whose compile is done, or the compile's error message."""
        try:
            compiled = req.grammar_future.result()
            req.grammar = self.manager.matcher(compiled, req.eos_token_ids)
        except GrammarError as exc:
            return str(exc)
        except Exception as exc:  # a backend bug fails its own request only
            return f"grammar compilation failed: {type(exc).__name__}: {exc}"
        finally:
            req.grammar_future = None
        return None

    def poll(self) -> list[tuple[Req, str | None]]:
        """Requests whose compile finished, with the error message of those that failed."""
        done = [r for r in self.pending if r.grammar_future is not None and r.grammar_future.done()]
        if not done:
            return []
        self.pending = [r for r in self.pending if r not in done]
        return [(r, self._attach(r)) for r in done]

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes or ``timeout`` passes (nothing else to do)."""
        futures = [r.grammar_future for r in self.pending if r.grammar_future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def remove(self, req: Req) -> None:
        if req in self.pending:
            self.pending.remove(req)

    def bitmask(self, reqs: list[Req]) -> torch.Tensor | None:
        """This step's token bitmask of ``reqs`` (all ones for unconstrained rows); None if none is."""
        if all(r.grammar is None for r in reqs):
            return None
        mask = full_bitmask(len(reqs), self.vocab_size)
        for row, r in enumerate(reqs):
            if r.grammar is not None and not r.finished:
                r.grammar.fill_bitmask(mask, row)
        return mask

    @staticmethod
    def advance(req: Req, token_id: int) -> FinishReason | None:
        """Feed the sampled token to the request's matcher; a reason to stop, or None."""
        if req.grammar is None:
            return None
        if not req.grammar.accept_token(token_id):
            # The sampler only draws allowed tokens; reaching this is a backend bug.
            return FinishReason("abort", message=f"the grammar refused the sampled token {token_id}")
        if req.grammar.is_terminated():
            # Terminated by a stop token (xgrammar), or complete with nothing but EOS left (llguidance).
            return FinishReason("stop", matched=token_id if token_id in req.eos_token_ids else None)
        return None

    def jump_forward(self, req: Req) -> list[int]:
        """Tokens the grammar forces next (jump-forward decoding), accepted by the matcher, at most
        what the request's token budget leaves; [] when off, none are forced, or the request
        wants logprobs (forced tokens have none)."""
        if not self.cfg.jump_forward or req.grammar is None or req.finished or req.return_logprob:
            return []
        budget = req.sampling_params.max_new_tokens - len(req.output_ids)
        taken: list[int] = []
        for token in req.grammar.jump_forward_tokens()[:max(budget, 0)]:
            if not req.grammar.accept_token(token):
                break  # the backend's own forced token refused: keep what was accepted
            taken.append(token)
        self.jumped_tokens += len(taken)
        return taken

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
