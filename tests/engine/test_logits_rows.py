"""The Llama family returns only the rows whose logits are needed (``forward_batch.logits_indices``)
and runs its last layer's output projection and MLP on those rows alone. The reference is
transformers' logits of the whole prompts at the same positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.engine.test_models_vs_hf import load_ours, make_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.PreTrainedModel, Path]:
    hf = make_hf_model("llama_gqa", seed=2)
    path = tmp_path_factory.mktemp("llama-rows")
    hf.save_pretrained(path)
    return hf, path


@torch.inference_mode()
def hf_logits(hf: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0]


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def logits_and_mlp_rows(model: torch.nn.Module, runner, fb) -> tuple[torch.Tensor, list[int]]:
    """The runner's logits for ``fb`` and the rows each layer's MLP received, in call order."""
    seen: list[int] = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
             for layer in model.model.layers]
    try:
        return runner.logits(fb), seen
    finally:
        for h in hooks:
            h.remove()


def test_selected_rows_equal_transformers_and_the_last_layer_skips_the_others(checkpoint) -> None:
    hf, path = checkpoint
    model, runner = load_ours(path)
    assert model.selects_logits_rows
    ps = random_prompts((9, 1, 17), seed=4)
    fb = runner.extend_batch([runner.new_request() for _ in ps], ps)
    # Prompt-logprob rows of request 0, then each request's last row, as the batch builder orders
    # them (request 0 holds rows 0-8, request 1 row 9, request 2 rows 10-26).
    rows = [0, 3, 7, 8, 9, 26]
    fb.logits_indices = torch.tensor(rows)
    got, seen = logits_and_mlp_rows(model, runner, fb)
    expected = torch.cat([hf_logits(hf, p) for p in ps])[rows]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert seen == [27, len(rows)]  # layer 0 takes every row; the last layer only the selected ones


def test_a_chunk_that_needs_no_logits_still_fills_the_cache(checkpoint) -> None:
    """A prefill chunk that does not end its prompt selects no rows: the last layer stops after
    its attention (K and V cached), and the next chunk's last row is transformers' last logits."""
    hf, path = checkpoint
    model, runner = load_ours(path)
    (prompt,) = random_prompts((21,), seed=5)
    row = runner.new_request()
    first = runner.extend_batch([row], [prompt[:13]])
    first.logits_indices = torch.empty(0, dtype=torch.int64)
    none, seen = logits_and_mlp_rows(model, runner, first)
    assert none.shape == (0, 256) and seen == [13]
    got = runner.logits(runner.extend_batch([row], [prompt[13:]]))
    torch.testing.assert_close(got[0], hf_logits(hf, prompt)[-1], rtol=0, atol=1e-4)


def test_every_row_when_no_rows_are_named(checkpoint) -> None:
    hf, path = checkpoint
    _, runner = load_ours(path)
    (prompt,) = random_prompts((6,), seed=6)
    got = runner.logits(runner.extend_batch([runner.new_request()], [prompt]), all_tokens=True)
    torch.testing.assert_close(got, hf_logits(hf, prompt), rtol=0, atol=1e-4)
