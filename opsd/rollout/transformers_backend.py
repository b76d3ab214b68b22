"""The transformers backend: batched sampling from an in-memory (optionally peft-wrapped) model,
through `model.generate` or the project's own decode loops (`static_decode`, `paged_decode`). It
runs anywhere, CPU tests included, and is what the trainer uses for on-policy rollouts. Also here:
the logits processors that do its filtering and draw (`sampling_processors`: `NucleusFilter`,
`CandidateDraw`) and its per-batch seeding.

Reproducibility contract: the same seed, prompts, settings, `n` and batch size give identical
completions, independently of whatever ran before in the process. Changing the batch size may
change the samples.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

from opsd.model_utils import eval_mode, left_pad, model_device
from opsd.rollout.backend import as_id_list
from opsd.rollout.paged_decode import PAGED, paged_generate
from opsd.rollout.static_decode import (
    CACHE_IMPLEMENTATIONS,
    GRAPH_LOOPS,
    StaticDecoder,
    resolve_cache_implementation,
)
from opsd.sampling import Completion, SamplingSettings, derive_seed, to_completion


class TransformersBackend:
    """Batched sampling from an in-memory (optionally peft-wrapped) model on left-padded prompts.

    Rows are the prompts repeated n times (prompt-major) and are sampled in
    batches of `batch_size`. Each batch re-seeds torch's RNG from
    (seed, batch index) inside `torch.random.fork_rng`, so results depend only on
    the call's arguments and the caller's RNG state is left untouched. The "paged"
    engine instead takes all rows of a call at once (below).

    `cache_implementation` picks the decoding engine (see CACHE_IMPLEMENTATIONS):

    - None / "dynamic": `model.generate` with the dynamic KV cache (the simple
      path; the default on CPU);
    - "static": `model.generate` with a static KV cache; on CUDA transformers then
      torch.compiles the forward pass on its own;
    - "graph": the project's own decode loop (`static_decode.StaticDecoder`): a
      preallocated KV cache, every decode step (forward + sampling + EOS
      bookkeeping) recorded once as a CUDA graph and replayed; with `merge_lora`
      active LoRA adapters are sampled from a merged copy of the adapted weights
      (`opsd/rollout/merged_student.py`), else unmerged; the base weights, i.e. the fixed
      teacher, are never written;
    - "graph_compiled": the same loop with the step compiled by torch.compile
      before it is recorded (fewer, fused kernels; pays a compile per shape);
    - "paged": transformers' continuous batching over a paged KV cache of bounded
      size (`opsd/rollout/paged_decode.py`): every row of the call is one request, rows join
      and leave the running batch as they start and finish, at most `batch_size`
      rows per forward pass; the KV pool (`paged_cache_gib`, default a share of the
      device's memory), not the number of rows, bounds the memory. For long
      evaluations without vLLM; seeded once per call from (seed, 0);
    - "auto": the fastest measured (BENCHMARKS.md): AUTO_CUDA ("graph_compiled")
      on CUDA for the supported decoder families, "static" for others, the
      dynamic path on CPU.

    On CPU "graph" / "graph_compiled" run the same loop step by step, without
    recording (and without compiling), which is what the CPU tests check.
    """

    def __init__(self, model, *, pad_token_id: int, eos_token_ids: Sequence[int] | int,
                 batch_size: int = 16, cache_implementation: str | None = None, merge_lora: bool = False,
                 paged_cache_gib: float | None = None):
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, "
                             f"got {cache_implementation!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = as_id_list(eos_token_ids)
        self.batch_size = batch_size
        self.cache_implementation = resolve_cache_implementation(cache_implementation, model)
        self.merge_lora = merge_lora  # graph loops only: generate() runs the model as it is
        self.paged_cache_gib = paged_cache_gib  # paged only: the KV pool in GiB (None: paged_decode's default)

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings, n: int = 1,
                 progress=False) -> list[list[Completion]]:
        """n completions for each prompt: result[prompt][sample]. `progress`: True for a bar of
        this call's samples, or the caller's bar (anything with update(), advanced per sample:
        one bar over many calls)."""
        rows = [list(prompt) for prompt in prompt_ids for _ in range(n)]
        if self.cache_implementation == PAGED:
            completions = self._generate_paged(rows, settings, progress)
            return [completions[i * n:(i + 1) * n] for i in range(len(prompt_ids))]
        completions: list[Completion] = []
        shape_rows = min(self.batch_size, len(rows))  # every batch of this call is run with this many rows
        # The graph loops switch the model to eval mode themselves, only when they sample from it
        # rather than from the merged copy (`StaticDecoder.generate`).
        mode = contextlib.nullcontext() if self.cache_implementation in GRAPH_LOOPS else eval_mode(self.model)
        with _progress_bar(len(rows), progress) as bar, mode, torch.no_grad():
            for batch_index, start in enumerate(range(0, len(rows), self.batch_size)):
                batch = rows[start:start + self.batch_size]
                completions += self._generate_batch(batch, settings, batch_index, shape_rows)
                bar.update(len(batch))
        return [completions[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

    def _generate_paged(self, rows: list[list[int]], settings: SamplingSettings, progress) -> list[Completion]:
        """All rows at once through transformers' continuous batching (opsd/rollout/paged_decode.py)."""
        with _progress_bar(len(rows), progress) as bar, eval_mode(self.model), torch.no_grad():
            config = self.generation_config(settings, processors_passed=False)
            run = paged_generate(self.model, rows, settings, config, max_rows=self.batch_size,
                                 cache_gib=self.paged_cache_gib, progress=bar)
        return [to_completion(tokens, self.eos_token_ids) for tokens in run.tokens]

    def _generate_batch(self, batch: list[list[int]], settings: SamplingSettings,
                        batch_index: int, shape_rows: int | None = None) -> list[Completion]:
        device = model_device(self.model)
        if self.cache_implementation in GRAPH_LOOPS:
            # A short last batch is filled up with copies of its first row, so every
            # batch of a call has one shape (one recorded graph); the copies are dropped.
            rows = len(batch)
            full = batch + [batch[0]] * max((shape_rows or rows) - rows, 0)
            decoder = StaticDecoder.for_model(self.model, compiled=self.cache_implementation == "graph_compiled",
                                              merge_lora=self.merge_lora)
            with _seeded_rng(settings.seed, batch_index, device):
                new_tokens = decoder.generate(full, settings, pad_token_id=self.pad_token_id,
                                              eos_token_ids=self.eos_token_ids)
            return [to_completion(row, self.eos_token_ids) for row in new_tokens[:rows]]
        input_ids, attention_mask = left_pad(batch, self.pad_token_id, device)
        # position_ids are derived by generate() from the attention mask, so
        # left padding does not shift the prompt's rotary positions.
        with _seeded_rng(settings.seed, batch_index, device):
            output = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=self.generation_config(settings, processors_passed=True),
                logits_processor=sampling_processors(settings),
            )
        new_tokens = output[:, input_ids.shape[1]:].tolist()
        return [to_completion(row, self.eos_token_ids) for row in new_tokens]

    def generation_config(self, settings: SamplingSettings, *, processors_passed: bool):
        """The GenerationConfig for `settings`. `processors_passed`: the caller also passes
        `sampling_processors(settings)` to generate(), which then do the filtering and the
        draw, and the config is greedy; False (the paged engine, which takes no processors):
        the config keeps every knob. No default: either wrong choice samples another
        distribution (or none)."""
        from transformers import GenerationConfig

        # Every sampling knob is set explicitly: generate() fills unset (None)
        # fields from the checkpoint's generation_config.json (Qwen3 ships
        # temperature 0.6 / top_k 20) and then from library defaults (top_k 50).
        # Greedy: the sampling knobs are inert; these values merely stop the
        # checkpoint's sampling defaults from triggering "flag ignored" warnings.
        sampling = {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 50}
        if settings.temperature > 0 and not processors_passed:
            sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p,
                        "top_k": max(settings.top_k, 0)}  # 0 = no top-k filter
        # With the processors passed, they filter and draw (ending in CandidateDraw), and
        # generate() runs greedily: its argmax picks the one token they leave.
        return GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            min_new_tokens=0,
            repetition_penalty=1.0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            cache_implementation="static" if self.cache_implementation == "static" else None,
            **sampling,
        )


class NucleusFilter:
    """Top-p filtering with transformers' rule (keep a token when the probability
    mass ranked strictly above it is below top_p; at least one), computed on the
    `candidates` most likely tokens when they already hold top_p of the mass, which
    then provably contains the nucleus. transformers' own filter sorts all 151,936
    entries at every step, most of a CPU rollout's time; rows the candidates do not
    cover fall back to the full sort. Must run after temperature and top-k, which
    `sampling_processors` sees to."""

    def __init__(self, top_p: float, candidates: int = 512):
        self.top_p, self.candidates = top_p, candidates

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.float().softmax(-1)
        k = min(self.candidates, scores.shape[-1])
        top, index = probs.topk(k, dim=-1)
        if bool((top.sum(-1) >= self.top_p).all()):
            above = top.cumsum(-1) - top  # mass ranked strictly above each candidate
            keep_sorted = above < self.top_p
            keep_sorted[..., 0] = True
        else:
            # transformers' own arithmetic (ascending float32 cumsum), so that the
            # fallback keeps exactly its set, rounding at the boundary included.
            ascending, index = probs.sort(dim=-1)
            keep_sorted = ascending.cumsum(-1) > 1 - self.top_p
            keep_sorted[..., -1] = True
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, keep_sorted)
        return scores.masked_fill(~keep, -float("inf"))


class CandidateDraw:
    """The draw, as generate()'s last logits processor (generate() itself then runs greedily
    and picks the one token it leaves finite): samples each row's next token from
    softmax(scores), over the scores the filters before it left finite.

    On a CPU it draws among the kept tokens only, where generate's own draw,
    torch.multinomial over all 151,936 probabilities, makes an exponential draw per entry
    (about 5 ms a row on one thread, as long as the embedded model's forward) although
    top-k and top-p usually keep a few dozen; when some row keeps more than `limit`
    tokens, every row draws over the whole row. Elsewhere (and at `limit` 0) it draws
    exactly as generate() would, torch.multinomial over the whole row from the same random
    stream, so GPU runs sample what they sampled before this processor existed (the tiny
    preset's published GPU results)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = int(torch.isfinite(scores).sum(-1).max()) if scores.device.type == "cpu" else None
        if kept is not None and kept <= self.limit:
            values, index = scores.topk(max(kept, 1), dim=-1)
            tokens = index.gather(-1, torch.multinomial(values.float().softmax(-1), 1))
        else:
            tokens = torch.multinomial(scores.float().softmax(-1), 1)
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


def sampling_processors(settings: SamplingSettings) -> list | None:
    """generate()'s `logits_processor` for `settings`: None when greedy, else temperature ->
    top-k (if on) -> NucleusFilter (if top-p is on), the order of transformers' warpers, then
    CandidateDraw, with generate() itself greedy (`generation_config`). The filters are
    passed rather than left to generate's warpers because generate() runs the processors it
    is given *before* the warpers it builds (transformers 5.x `_get_logits_processor`): a
    NucleusFilter given alone would cut the untempered, untruncated distribution, which is
    another distribution; and the draw must come after all of them."""
    if settings.temperature <= 0:
        return None
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    processors = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_k > 0:
        processors.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        processors.append(NucleusFilter(settings.top_p))
    return processors + [CandidateDraw()]


@contextlib.contextmanager
def _seeded_rng(seed: int | None, batch_index: int, device: torch.device):
    """Seed torch's RNG for one batch and restore the caller's RNG state after."""
    if seed is None:
        yield
        return
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(derive_seed(seed, batch_index))
        yield


def _progress_bar(total: int, progress):
    """The bar a generate() call advances: the caller's (`progress` has update()), a new one over
    `total` samples (`progress` True), or a disabled one."""
    if hasattr(progress, "update"):
        return contextlib.nullcontext(progress)
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not progress, desc="sampling", unit="sample", dynamic_ncols=True)
