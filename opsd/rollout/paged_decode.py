"""The "paged" engine of `opsd.rollout.TransformersBackend`: transformers' continuous
batching over a paged KV cache of bounded size, for long evaluations without vLLM.

Why it exists: the other transformers engines give every row of a batch a KV cache
for its whole budget (the static cache and the graph loop preallocate
prompt + max_new_tokens per row; the dynamic cache grows to it), so at the frozen
evaluation settings (up to 38,912 new tokens; about 112 KiB of KV per token for
Qwen3-1.7B in bf16, 4.5 GB per row) one H200 holds about 30 rows at most, and a batch
runs until its longest row ends. Here the KV cache is one pool of fixed-size pages
(PAGE_SIZE tokens of every layer): a row holds only the pages its tokens fill, a
finished row's pages go to the next waiting row at once, and the pool's size, not
the number of rows, bounds the memory.

How a call runs (`paged_generate`): every row (prompt x sample) is one request of
transformers' `ContinuousBatchingManager` (the engine behind `model.generate_batch`),
all queued before its generation thread starts. Its FIFO scheduler builds each
forward pass from the decoding rows first, then prefills waiting rows (prompt chunks
of up to `max_batch_tokens` tokens) while the pool keeps 15% free; at most `max_rows`
rows go into one forward, and since decoding rows come first, that is also about the
number of rows in flight. When the pool is full, a row's cache is dropped and the row
re-queued with its sampled tokens as prompt (recomputed later; nothing is lost).

Sampling: transformers' own warpers in generate()'s order, temperature -> top-k ->
top-p (the same rules as `generate`), then `torch.multinomial`; greedy is argmax. The
manager builds its warpers from the generation config and takes no custom logits
processor, so top-p is transformers' full-vocabulary sort, not the other engines'
`opsd.rollout.NucleusFilter` (the same kept set, faster on CPU). Rows stop at the first of
the EOS ids or at max_new_tokens; `to_completion` cuts and flags them as the other
engines do (the manager reports no truncation flag: no EOS means the budget ran out).

Seeding and reproducibility: torch's global RNG is seeded from (seed, 0) just before
the generation thread starts, inside `torch.random.fork_rng` (the caller's RNG is left
as it was; a seedless call draws its seed from it). Since every request is queued
before the thread starts, the scheduler sees the same requests in the same order each
time, and with the same pool (`cache_gib`, by default fixed from the device's total
memory, never from what happens to be free) and `max_rows` it builds the same batches:
the same seed gives the same samples (checked on CPU, tests/rollout/test_rollout.py; on CUDA
as far as the kernels are deterministic for equal shapes, not checked here). Another
pool size or `max_rows` regroups rows into other forward passes and draws, so gives
other samples (from the same distribution); so does another engine.

Attention: the manager needs sdpa, eager ("paged|eager") or flash attention; it
switches the model to flash attention by itself when the flash-attn package is
installed (and back after). It runs on CPU with sdpa (what the tests use). Without
flash attention every forward gathers the cached keys and values of all its rows into
one packed sequence under a block-diagonal mask, so its attention work grows with
rows x total cached tokens: `max_rows` then trades per-forward overhead against that
waste (BENCHMARKS.md, "Evaluation engine"). With flash attention decoding reads each
row's pages directly, and CUDA graphs are recorded.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from opsd.model_utils import causal_lm, kv_geometry, model_device
from opsd.sampling import SamplingSettings, derive_seed

PAGED = "paged"
# The default KV pool: this share of the device's total memory (RAM on CPU), capped at
# what the call's rows could ever fill. From the total, not the free memory, so that the
# pool, hence the schedule and the seeded samples, depend only on the device type.
CACHE_FRACTION = {"cuda": 0.5, "cpu": 0.25}
PAGE_SIZE = 256  # tokens per page (transformers' default)
# Rows per forward pass where the caller sets none (the evaluation's --batch-size): the
# faster of the two settings measured on an H200 (BENCHMARKS.md section 5). Without flash
# attention a forward's attention work grows with rows x their cached tokens.
DEFAULT_MAX_ROWS = 256
MAX_BATCH_TOKENS = 8192  # tokens per forward pass (prompt chunks + one per decoding row; transformers' default)
# The library refuses to start (MemoryError, before any work) when the pool plus the
# buffers that scale with it and with max_batch_tokens exceed this share of free memory.
MAX_MEMORY_SHARE = 0.9


@dataclass
class PagedRun:
    """What `paged_generate` sampled: per row (in input order) the new token ids, EOS
    included when sampled, and whether the row completed (False only for rows cut off
    by a deadline); plus how the engine was set up."""
    tokens: list[list[int]]
    finished: list[bool]
    info: dict = field(default_factory=dict)


def kv_bytes_per_token(model) -> int:
    """KV cache bytes of one token across all layers (keys and values)."""
    layers, kv_heads, head_dim = kv_geometry(causal_lm(model).config.get_text_config())
    return 2 * layers * kv_heads * head_dim * next(model.parameters()).dtype.itemsize


def default_cache_gib(device: torch.device) -> float:
    """The default pool size: CACHE_FRACTION of the device's total memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        import psutil  # a dependency of accelerate; transformers' memory check on CPU needs it too

        total = psutil.virtual_memory().total
    return CACHE_FRACTION.get(device.type, CACHE_FRACTION["cpu"]) * total / 2**30


def cache_blocks(model, row_lengths: list[int], cache_gib: float | None) -> int:
    """Pages in the pool: what `cache_gib` (default `default_cache_gib`) holds, at most
    what the rows could fill at their full lengths. Raises ValueError when the pool
    cannot hold the longest row: that row could never finish."""
    page_bytes = PAGE_SIZE * kv_bytes_per_token(model)
    gib = default_cache_gib(model_device(model)) if cache_gib is None else cache_gib
    budget = int(gib * 2**30 // page_bytes)
    # +1 page per row: a row's last page may be partly used by the prompt's tail
    needed = sum(math.ceil(n / PAGE_SIZE) + 1 for n in row_lengths)
    longest = math.ceil(max(row_lengths) / PAGE_SIZE) + 1
    if budget < longest:
        raise ValueError(f"the paged KV cache of {gib:.3g} GiB holds {budget * PAGE_SIZE} tokens, fewer than one row "
                         f"needs ({max(row_lengths)} = prompt + max_new_tokens); raise cache_gib")
    return min(budget, needed)


def paged_generate(model, rows: list[list[int]], settings: SamplingSettings, generation_config, *,
                   max_rows: int, cache_gib: float | None = None, deadline: float | None = None,
                   progress=None) -> PagedRun:
    """Sample one completion per row with transformers' continuous batching.

    `generation_config` carries the sampling knobs, EOS ids and max_new_tokens (as
    `TransformersBackend.generation_config(settings, processors_passed=False)` builds it); `max_rows`: rows per forward
    pass; `cache_gib`: the KV pool (see `cache_blocks`). `deadline` (time.monotonic()):
    stop there, returning what each row has so far, marked unfinished (benchmarks).
    `progress`: a tqdm-like bar, advanced per finished row. Raises RuntimeError when the
    engine fails (out of memory, ...), after stopping it.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    inner = causal_lm(model)
    device = model_device(model)
    if not rows:
        return PagedRun([], [])
    num_blocks = cache_blocks(model, [len(r) + settings.max_new_tokens for r in rows], cache_gib)
    # transformers 5.17 (vLLM's environments) names the page `block_size`; 5.2x `page_size`.
    page_field = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{page_field: PAGE_SIZE},
        num_blocks=num_blocks,
        max_batch_tokens=min(MAX_BATCH_TOKENS, max(sum(len(r) for r in rows) + len(rows), PAGE_SIZE)),
        max_requests_per_batch=max_rows,
        max_memory_percent=MAX_MEMORY_SHARE,
    )
    # A seedless call draws its seed from the caller's RNG (advancing it, as sampling does).
    seed = (derive_seed(settings.seed, 0) if settings.seed is not None
            else int(torch.randint(0, 2**62, (), dtype=torch.int64).item()))
    cb_config.seed = seed
    eos_token_ids = generation_config.eos_token_id
    eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    attn_implementation = inner.config._attn_implementation
    with torch.random.fork_rng(devices=cuda_devices):
        # The manager may switch the model's attention (to flash attention, or eager to
        # "paged|eager"); stop() switches it back.
        # The hints size flash attention's decode block tables for the longest row (as generate_batch does).
        hints = WorkloadHints(max_prompt_length=max(len(r) for r in rows),
                              max_generated_length=settings.max_new_tokens, num_requests=len(rows))
        manager = inner.init_continuous_batching(generation_config=generation_config,
                                                 continuous_batching_config=cb_config, workload_hints=hints)
        try:
            info = {"attn_implementation": inner.config._attn_implementation, "num_blocks": num_blocks,
                    "page_size": PAGE_SIZE, "cache_tokens": num_blocks * PAGE_SIZE,
                    "cache_gib": num_blocks * PAGE_SIZE * kv_bytes_per_token(model) / 2**30,
                    "max_rows": max_rows, "max_batch_tokens": cb_config.max_batch_tokens}
            try:
                manager.warmup()  # creates the cache; records CUDA graphs where they are used (may draw random numbers)
            except MemoryError as exc:
                raise MemoryError(f"the paged KV pool of {info['cache_gib']:.3g} GiB and its buffers do not fit in "
                                  f"{MAX_MEMORY_SHARE:.0%} of the free memory ({exc}); lower paged_cache_gib") from exc
            torch.manual_seed(seed)  # sampling starts from the seed, whatever the warmup drew
            ids = [f"row{i}" for i in range(len(rows))]
            for request_id, row in zip(ids, rows, strict=False):
                manager.add_request(list(row), request_id=request_id, max_new_tokens=settings.max_new_tokens,
                                    eos_token_id=eos_token_ids)
            manager.start()  # every request is queued: the first batch sees them all
            outputs, stopped = _collect(manager, set(ids), deadline, progress)
        finally:
            if manager.is_running():
                manager.stop(block=True, hard_stop=True)  # ends the thread at once (nothing is left when done)
            manager.destroy()
            if inner.config._attn_implementation != attn_implementation:  # where stop() did not switch it back
                inner.set_attn_implementation(attn_implementation)
    failed = [o.error for o in outputs.values() if o.error is not None and not o.error.startswith(_STOPPED)]
    if failed or (len(outputs) < len(rows) and not stopped):
        raise RuntimeError(f"the paged engine failed: {failed[0] if failed else 'rows are missing from its output'}")
    # At a deadline, rows the engine had not taken in yet come back empty.
    tokens = [list(outputs[i].generated_tokens) if i in outputs else [] for i in ids]
    finished = [i in outputs and outputs[i].error is None for i in ids]
    return PagedRun(tokens, finished, info)


# The error transformers gives rows that a stop cut off (the deadline).
_STOPPED = "Generation loop finished before this request completed"


def _collect(manager, pending: set[str], deadline: float | None, progress) -> tuple[dict, bool]:
    """Wait for every request's final output; at the deadline stop the engine, which
    hands back what the unfinished rows have sampled so far. Returns the outputs by
    request id and whether the deadline stopped the engine."""
    outputs = {}
    while pending:
        if deadline is not None and time.monotonic() > deadline:
            manager.stop(block=True, hard_stop=True)
            while (output := manager.get_result(timeout=0)) is not None:
                if output.is_finished() and output.request_id in pending:
                    outputs[output.request_id] = output
                    pending.discard(output.request_id)
            return outputs, True
        output = manager.get_result(timeout=0.5)
        if output is None:
            status = manager.background_thread_status
            if status.fatal_error is not None or not manager.is_running():
                while (output := manager.get_result(timeout=0)) is not None:  # drain failed rows
                    outputs[output.request_id] = output
                error = status.fatal_error or RuntimeError("the generation thread stopped")
                raise RuntimeError(f"the paged engine failed: {type(error).__name__}: {error}") from error
            continue
        if output.is_finished() and output.request_id in pending:
            outputs[output.request_id] = output
            pending.discard(output.request_id)
            if progress is not None:
                progress.update(1)
    return outputs, False
