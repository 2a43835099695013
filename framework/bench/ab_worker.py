"""One side of ``plugserve bench ab``: an engine that runs one timed sample per request on stdin.

The driver (:mod:`framework.bench.ab`) starts this file as a script with ``PYTHONPATH`` set to the
side's source tree, so ``framework`` and the plugins are imported from *that* tree (an older
revision, or a working tree with uncommitted changes). Only long-lived API is used here
(``engine_from_args``, ``greedy_params``, ``_warm_up``, ``random_dataset``,
``Engine.submit/step/run_until_done/flush_cache``), so an older tree without this file runs it.

Protocol, one JSON object per line on the original stdout (everything else the process prints goes
to stderr):

- after setup: ``{"ready": true, "model": <ModelRunner.describe()>, "samples": n, "framework": <the
  imported package's directory>}``;
- for each ``sample`` line on stdin: ``{"t": seconds}``;
- for ``finish``: ``{"outputs": [[token ids], ...]}``, then the process exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, Python puts this file's directory first on sys.path, where ``datasets.py`` and
# ``serving.py`` would shadow the libraries of those names: drop it before importing anything else.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any, TextIO  # noqa: E402


class DecodeWorkload:
    """``rows`` requests decoding together; one sample is one engine step (a decode step of
    ``rows`` rows). Both sides step in lockstep, so paired samples see the same context lengths."""

    def __init__(self, engine: Any, rows: int, input_len: int, samples: int, warm_steps: int) -> None:
        from framework.bench.datasets import random_dataset
        from framework.bench.offline import greedy_params

        self.engine = engine
        # Every request outlives the run: the decode batch keeps ``rows`` rows for every sample.
        reqs = random_dataset(rows, input_len, warm_steps + samples + 2, engine.runner.vocab_size, seed=1)
        self.rids = [engine.submit(r.input_ids, greedy_params(r.output_len)) for r in reqs]
        sched = engine.scheduler
        while sched.waiting or sched.chunked:  # the prompts' prefill is not timed
            engine.step()
        for _ in range(warm_steps):
            engine.step()

    def sample(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def outputs(self) -> list[list[int]]:
        return [list(self.engine._states[rid].output_ids) for rid in self.rids]


class PrefillWorkload:
    """One sample prefills ``rows`` new prompts of ``input_len`` tokens and samples their first
    token. Sample ``i`` uses the same prompts on both sides and different ones from sample ``i-1``;
    the prefix cache is flushed after each, so no sample hits a cached prefix."""

    def __init__(self, engine: Any, rows: int, input_len: int, samples: int, warm_steps: int) -> None:
        self.engine, self.rows, self.input_len = engine, rows, input_len
        self.index = 0
        self.first_tokens: list[list[int]] = []
        for _ in range(warm_steps):
            self._run()
        self.first_tokens.clear()

    def _run(self) -> float:
        from framework.bench.datasets import random_dataset
        from framework.bench.offline import greedy_params

        reqs = random_dataset(self.rows, self.input_len, 1, self.engine.runner.vocab_size, seed=1000 + self.index)
        self.index += 1
        start = time.perf_counter()
        rids = [self.engine.submit(r.input_ids, greedy_params(1)) for r in reqs]
        self.engine.run_until_done(rids)
        elapsed = time.perf_counter() - start
        self.first_tokens.append([self.engine._states.pop(rid).output_ids[0] for rid in rids])
        self.engine.flush_cache()
        return elapsed

    def sample(self) -> float:
        return self._run()

    def outputs(self) -> list[list[int]]:
        return self.first_tokens


WORKLOADS = {"decode": DecodeWorkload, "prefill": PrefillWorkload}


def _send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--model-path")
    p.add_argument("--random-model")
    p.add_argument("--config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    # The protocol keeps the real stdout; anything else printed (by Python or C code) goes to stderr.
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import framework
    from framework.bench.offline import _warm_up, engine_from_args

    engine, _ = engine_from_args(args)
    _warm_up(engine)  # lazy initialisation stays out of the timing
    workload = WORKLOADS[args.workload](engine, args.rows, args.input_len, args.samples, args.warm_steps)
    _send(channel, {"ready": True, "model": engine.runner.describe(), "samples": args.samples,
                    "framework": str(Path(framework.__file__).resolve().parent)})
    for line in sys.stdin:
        command = line.strip()
        if command == "sample":
            _send(channel, {"t": workload.sample()})
        elif command == "finish":
            _send(channel, {"outputs": workload.outputs()})
            break
        else:
            _send(channel, {"error": f"unknown command {command!r}"})
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
