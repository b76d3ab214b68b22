"""Scoring batches: prompts + sampled completions -> each role's forward inputs, whose
completion positions line up for both roles (docs/SPEC.md §3), and the forwards that
score them (final hidden states at the completion positions; the loss forms the logits).

Scoring geometry (P = longest prompt, C = longest completion, T = P + C):
- right (released): [prompt_i, pads up to P, completion_i, pads up to C];
  no position_ids, so the pads between prompt and completion consume rotary
  positions, as in the released code;
- left: [pads up to P, prompt_i, completion_i, pads up to C]; position_ids =
  cumsum(attention_mask) - 1 (clamped at 0), so every real token sits at the
  position it had when it was sampled by a left-padded generate.
In both, completion token j of every row sits at column P + j, and the logits
at column P + j - 1 predict it. With `pad_to_multiple_of`, masked pads follow
the last completion column up to a multiple of it (nothing before them sees them).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from opsd.adapter_layers import AdapterLayers
from opsd.config import PAD_SIDES
from opsd.model_utils import causal_lm, model_device


class AlignmentError(AssertionError):
    """The `[OPSD align]` self-check failed; the message is one line."""


@dataclass
class ScoringBatch:
    """One role's forward-pass inputs plus the completion geometry (see the
    module docstring). B rows, P = longest prompt, C = longest completion."""

    input_ids: torch.Tensor  # [B, P + C (+ tail)]; see build_scoring_batch's pad_to_multiple_of
    attention_mask: torch.Tensor  # same shape, 0 on pads
    position_ids: torch.Tensor | None  # same shape for left; None for right
    completion_ids: torch.Tensor  # [B, C], right-padded with the pad id
    completion_mask: torch.Tensor  # [B, C], 1 on real completion tokens
    # [N]: where the real completion tokens are in [B, C] flattened (row x C + column), row by row.
    # Built on the host, so selecting the tokens never asks the GPU how many there are.
    completion_index: torch.Tensor
    prompt_lengths: torch.Tensor  # [B], real prompt lengths
    pad_gap: torch.Tensor  # [B], pads between prompt and completion (0 for left)
    pad_side: str
    prompt_width: int  # P: every row's first completion token is at this column (a host int, never synced)

    @property
    def completion_start(self) -> torch.Tensor:
        """[B] (on the CPU): the column of each row's first completion token, P for every row."""
        return torch.full((self.input_ids.shape[0],), self.prompt_width, dtype=torch.long)


def build_scoring_batch(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    pad_side: str,
    pad_to_multiple_of: int | None = None,
) -> ScoringBatch:
    """One role's batch: prompts padded to the longest (right: pad gap before the
    completion; left: pads first), completions after them, pads after those.

    pad_to_multiple_of: append masked pad columns after the last completion column
    so that the sequence width is a multiple of it. No position before them can
    attend to them (causal), so every value the loss reads is unchanged; compiled
    layers then see few distinct, well-aligned shapes (BENCHMARKS.md).
    """
    if pad_side not in PAD_SIDES:
        raise ValueError(f"pad_side={pad_side!r} is not allowed; expected one of: {', '.join(PAD_SIDES)}")
    if len(prompt_ids) != len(completion_ids) or not prompt_ids:
        raise ValueError(f"need one completion per prompt; got {len(prompt_ids)} prompts, "
                         f"{len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token: its last position predicts the first completion token")
    rows = len(prompt_ids)
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids])
    width_p = int(prompt_lengths.max())
    width_c = max(len(c) for c in completion_ids)
    width = width_p + width_c
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of

    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completions = torch.full((rows, width_c), pad_id, dtype=torch.long)
    completion_mask = torch.zeros_like(completions)
    for b, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        first = 0 if pad_side == "right" else width_p - len(prompt)
        input_ids[b, first:first + len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[b, first:first + len(prompt)] = 1
        end = width_p + len(completion)
        input_ids[b, width_p:end] = torch.tensor(completion, dtype=torch.long)
        attention_mask[b, width_p:end] = 1
        completions[b, :len(completion)] = torch.tensor(completion, dtype=torch.long)
        completion_mask[b, :len(completion)] = 1

    left = pad_side == "left"
    return ScoringBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0) if left else None,
        completion_ids=completions,
        completion_mask=completion_mask,
        completion_index=torch.cat([torch.arange(len(c)) + b * width_c for b, c in enumerate(completion_ids)]),
        prompt_lengths=prompt_lengths,
        pad_gap=torch.zeros(rows, dtype=torch.long) if left else width_p - prompt_lengths,
        pad_side=pad_side,
        prompt_width=width_p,
    )


@dataclass
class ForwardInputs:
    """One forward pass's inputs: [B, T] each (position_ids None: the model's 0..T-1)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None


def one_forward(batches: Sequence[ScoringBatch], pad_id: int) -> ForwardInputs:
    """Several scoring batches (`token_mean_rows` groups of one micro-batch) as one forward's
    inputs, rows in order. Each batch keeps its own geometry: it is only extended after its
    last column with masked pads up to the widest. No position before them attends to them
    (causal), so the hidden states at each batch's own columns are the ones its own forward
    gives, up to kernel rounding; `width` of each batch slices them back out."""
    if len({b.pad_side for b in batches}) != 1:
        raise ValueError("one forward needs one pad side")
    if len(batches) == 1:
        b = batches[0]
        return ForwardInputs(b.input_ids, b.attention_mask, b.position_ids)
    width = max(b.input_ids.shape[1] for b in batches)

    def extend(tensors, value):
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])

    left = batches[0].pad_side == "left"
    return ForwardInputs(
        input_ids=extend([b.input_ids for b in batches], pad_id),
        attention_mask=extend([b.attention_mask for b in batches], 0),
        # Right: None, as for one batch (positions 0..T-1 agree on every batch's own columns).
        position_ids=extend([b.position_ids for b in batches], 0) if left else None,
    )


def gather_completion_positions(values: torch.Tensor, batch: ScoringBatch) -> torch.Tensor:
    """[B, C, ...]: the entries of `values` ([B, P + C, ...], e.g. hidden states
    or logits) at the columns that predict each completion token. A view, no copy; it reads
    no device tensor, so the host does not wait for the forward that made `values`."""
    start = batch.prompt_width
    if values.shape[1] != batch.input_ids.shape[1]:
        raise ValueError(f"expected {batch.input_ids.shape[1]} positions, got {values.shape[1]}")
    width_c = batch.completion_ids.shape[1]
    return values[:, start - 1:start - 1 + width_c]


def select_completion_tokens(values: torch.Tensor, batch: ScoringBatch) -> torch.Tensor:
    """[N, ...]: the real completion tokens' entries of `values` ([B, C, ...], e.g. from
    `gather_completion_positions`), row by row: `values[batch.completion_mask.bool()]`,
    without the boolean mask's wait for the GPU (forward and backward) to count them."""
    return values.flatten(0, 1).index_select(0, batch.completion_index)


# --------------------------------------------------------------------------
# The [OPSD align] self-check
# --------------------------------------------------------------------------

def check_alignment(batch: ScoringBatch, completion_ids: Sequence[Sequence[int]]) -> str:
    """Assert that the supervised span of every row is exactly its sampled
    completion; return a one-line summary (with pad gap stats for right)."""
    if len(completion_ids) != batch.input_ids.shape[0]:
        raise AlignmentError(f"[OPSD align] {len(completion_ids)} completions for {batch.input_ids.shape[0]} rows")
    for b, completion in enumerate(completion_ids):
        _check_row(batch, b, list(completion))
    # The loss picks the tokens by completion_index: it must name exactly the masked ones.
    if not torch.equal(batch.completion_index.cpu(), batch.completion_mask.flatten().nonzero().flatten().cpu()):
        raise AlignmentError("[OPSD align] completion_index does not name the masked completion tokens")
    tokens = int(batch.completion_mask.sum())
    summary = f"ok: {len(completion_ids)} rows, {tokens} completion tokens"
    if batch.pad_side == "left":
        return f"{summary}; left padding, no pad gap"
    gap = batch.pad_gap.float()
    return (f"{summary}; pad gap between prompt and completion: "
            f"min {int(gap.min())} / mean {gap.mean():.1f} / max {int(gap.max())} tokens")


def _check_row(batch: ScoringBatch, b: int, completion: list[int]) -> None:
    start, n = batch.prompt_width, len(completion)

    def fail(message: str) -> None:
        raise AlignmentError(f"[OPSD align] row {b}: {message}")

    span = batch.input_ids[b, start:start + n].tolist()
    if span != completion:
        j = next((j for j, (x, y) in enumerate(zip(span, completion, strict=False)) if x != y), min(len(span), n))
        fail(f"input_ids[{start}:{start + n}] differ from the sampled completion at token {j}")
    if batch.completion_ids[b, :n].tolist() != completion:
        fail("completion_ids differ from the sampled completion")
    mask = batch.completion_mask[b]
    if int(mask.sum()) != n or not bool(mask[:n].all()):
        fail(f"completion_mask covers {int(mask.sum())} tokens, the completion has {n}")
    attention = batch.attention_mask[b]
    if not bool(attention[start:start + n].all()) or bool(attention[start + n:].any()):
        fail("attention_mask does not cover exactly the completion after the prompt")
    if int(attention[:start].sum()) != int(batch.prompt_lengths[b]):
        fail(f"attention_mask covers {int(attention[:start].sum())} prompt tokens, "
             f"expected {int(batch.prompt_lengths[b])}")
    if batch.position_ids is not None:
        expected = torch.arange(n) + int(batch.prompt_lengths[b])
        if not torch.equal(batch.position_ids[b, start:start + n].cpu(), expected):
            fail("completion position_ids do not continue the prompt's positions")


# --------------------------------------------------------------------------
# The scoring forwards
# --------------------------------------------------------------------------

class ScoringForwards(NamedTuple):
    """One micro-batch scored by both roles: each role's ScoringBatch and its final hidden
    states [B, C, H] at the positions that predict the completion tokens. The second role is
    the trainer's arm's no-grad forward: the teacher's (OPSD, SFT), GRPO's KL reference (the
    student's prompt, the adapter disabled), or None (GRPO without a KL)."""

    student: ScoringBatch
    teacher: ScoringBatch | None
    student_hidden: torch.Tensor
    teacher_hidden: torch.Tensor | None


@contextmanager
def bf16_autocast(adapters: AdapterLayers, enabled: bool):
    """Mixed precision for the two backbone forwards of `adapters.model` (its adapter layers).

    The loss calls the decoder directly, past the wrapper through which the Trainer
    applies its autocast; without this, peft runs its float32 adapters in float32
    (input casts plus fp32 matmuls: 1.24x slower on an H200, BENCHMARKS.md). The
    adapters' master weights and gradients stay float32.
    """
    if not enabled:
        yield
        return
    device_type = model_device(adapters.model).type
    with torch.autocast(device_type, dtype=torch.bfloat16), adapters.input_casting_disabled():
        yield


def completion_hidden_states(model, batches: list[ScoringBatch], pad_id: int) -> list[torch.Tensor]:
    """Final hidden states at the positions that predict each completion token, [B, C, H] per
    batch, from one forward over all of them (`one_forward`).

    Only the backbone runs; logits are formed by the loss, never for prompt positions.
    """
    decoder = causal_lm(model).get_decoder()
    inputs = one_forward(batches, pad_id)
    hidden = decoder(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,  # None for `right`: pads consume rotary positions (released)
        use_cache=False,
    ).last_hidden_state
    out, start = [], 0
    for batch in batches:
        rows, width = batch.input_ids.shape
        out.append(gather_completion_positions(hidden[start:start + rows, :width], batch))
        start += rows
    return out


def lm_head(model) -> torch.nn.Module:
    """The output projection (LM head) that turns the hidden states into logits."""
    return causal_lm(model).get_output_embeddings()


def to_device(batch, device):
    """The batch's tensors on `device`. To a GPU they go from pinned memory without blocking:
    a blocking copy would first wait for every kernel already queued (the previous micro-batch's
    backward), once per tensor."""
    cuda = torch.device(device).type == "cuda"

    def move(tensor):
        return tensor.pin_memory().to(device, non_blocking=True) if cuda else tensor.to(device)

    moved = {
        f.name: (move(v) if isinstance(v := getattr(batch, f.name), torch.Tensor) else v)
        for f in dataclasses.fields(batch)
    }
    return dataclasses.replace(batch, **moved)
