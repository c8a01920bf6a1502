"""The device the tests run engines on: ``EPD_TEST_DEVICE`` (default ``cpu``), e.g. ``cuda`` or ``cuda:1``.

Every test that builds an engine (in-process or as a ``stage serve`` subprocess) takes its device
from here, so the same suite runs on a GPU machine unchanged (scripts/gpu-check.sh sets it).

On a GPU, batched kernels need not match batch-1 kernels bit for bit, so a batched run may part
from the same request run alone where two tokens were nearly tied. ``assert_same_or_near_tie``
accepts exactly that and nothing more; on the CPU the tests compare tokens exactly and never call it.
"""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("EPD_TEST_DEVICE", "cpu")
if not DEVICE.startswith("cuda"):
    # Triton kernels (stages/engine/paged_decode.py) then run in Triton's interpreter on the CPU. Triton
    # reads this once, when it is first imported (torch._dynamo imports it): this module is imported
    # by conftest.py, before any test module imports torch's extras.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# How close (in logits, float32 models) the alone run's token and the batched run's token must have
# been where they first differ, for the difference to count as kernel rounding. Rounding differences
# between cuBLAS/attention kernels of different batch shapes are ~1e-5 in these tiny float32 models;
# a wrong token (a bug) is typically off by whole units.
GPU_TOP2_TOLERANCE = 1e-3


def on_gpu() -> bool:
    return DEVICE.startswith("cuda")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first place two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(reference: torch.nn.Module, inputs: dict, alone: list[int], batched: list[int],
                            tolerance: float = GPU_TOP2_TOLERANCE) -> None:
    """GPU only: ``batched`` equals ``alone``, or where they first part, the reference model (HF, on
    the same device), continuing the prompt (``inputs``, from ``hf_reference.hf_inputs``) with the
    tokens both runs share, ranks the two tokens first and second, within ``tolerance`` of each other."""
    assert on_gpu(), "a near-tie is accepted on a GPU only; the CPU compares tokens exactly"
    at = first_divergence(alone, batched)
    if at is None:
        return
    assert at < min(len(alone), len(batched)), f"one run stopped early at token {at}: {alone} vs {batched}"
    logits = _logits_after(reference, inputs, alone[:at])
    top = torch.topk(logits, 2)
    gap = abs(logits[alone[at]].item() - logits[batched[at]].item())
    assert {alone[at], batched[at]} == set(top.indices.tolist()), (
        f"token {at}: alone {alone[at]}, batched {batched[at]}; the reference's top two are "
        f"{top.indices.tolist()} ({top.values.tolist()}): a real difference, not rounding")
    assert gap <= tolerance, (f"token {at}: alone {alone[at]} and batched {batched[at]} are {gap:.2e} apart in "
                              f"logits, more than {tolerance:g}: a real difference, not rounding")


def _logits_after(reference: torch.nn.Module, inputs: dict, shared: list[int]) -> torch.Tensor:
    """The reference's raw next-token logits after the prompt and ``shared``, by ``generate()`` forced
    through ``shared`` (its own cache path: generated tokens are never taken for image placeholders)."""
    prompt_len = inputs["input_ids"].shape[1]
    vocab = list(range(reference.config.get_text_config().vocab_size))

    def allowed(_batch: int, ids: torch.Tensor) -> list[int]:
        step = ids.shape[-1] - prompt_len
        return [shared[step]] if step < len(shared) else vocab

    with torch.inference_mode():
        out = reference.generate(**inputs, max_new_tokens=len(shared) + 1, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, prefix_allowed_tokens_fn=allowed)
    return out.logits[len(shared)][0].float()
