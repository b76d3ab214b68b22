"""The project's own decode loop: the "graph" / "graph_compiled" engines of
`opsd.rollout.TransformersBackend`, and its default on CUDA ("auto").

`StaticDecoder` samples over a preallocated KV cache: one prefill over the prompts
packed without padding (the cache left-padded to widths bucketed by `bucket_width`; its
decoder layers compiled for "graph_compiled"), then every decode step
(forward of one token per row, attention over the cache under a validity mask,
temperature -> top-k -> top-p sampling, EOS bookkeeping) runs on the device with
no host synchronisation and, on CUDA, is recorded once as a CUDA graph (after a
torch.compile for "graph_compiled") and replayed. On CPU the same step simply
runs, without recording or compiling, which is what the CPU tests check.

Why it exists: on-policy rollouts dominate a training step, and `model.generate`
is several times slower for them (BENCHMARKS.md section 2 has every engine measured
on an H200). What makes a step fast: no host synchronisation (one recorded graph
replays the whole step), compiled kernels, the student's LoRA merged into a sampling
copy (`merge_lora`, see `opsd/rollout/merged_student.py`; or run unmerged inside the step), and
attention that reads only the filled part of the KV cache (`KV_WINDOW`), through a kernel
made for one query token (`opsd/rollout/kernels/attention.py`, `DECODE_ATTENTION`); in the merged copy,
that kernel also makes the new token's query and K/V column from the q/k/v product (q/k
norms, rotary embedding, cache writes: `opsd/rollout/kernels/qkv.py`), split-K kernels run its narrow
products and one kernel its gate/up product with the SiLU gating (`opsd/rollout/kernels/matmul.py`); the
sampler's top-k on the logits' own dtype, searched only in the vocabulary blocks that can
hold it, then drawn in one kernel (`opsd/rollout/kernels/sampler.py`). Either way the frozen base weights, which are
the teacher, are only ever read.

Supported: full-attention Qwen3 / Qwen2 / Llama models (`SUPPORTED_MODEL_TYPES`);
`resolve_cache_implementation` falls back to transformers' static cache for others.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch

from opsd.model_utils import causal_lm, eval_mode, import_inductor_quietly, kv_geometry, model_device
from opsd.rollout.compiled_layers import CompiledLayers, decoder_layers
from opsd.rollout.kernels import attention as decode_attention
from opsd.rollout.kernels import matmul as decode_matmul
from opsd.rollout.kernels import qkv as decode_qkv
from opsd.rollout.kernels import sampler as decode_sampler
from opsd.rollout.merged_student import MergedStudent, MergeUnsupported, has_enabled_adapters
from opsd.sampling import CACHE_IMPLEMENTATIONS, GRAPH_LOOPS, SamplingSettings  # noqa: F401 (re-read by the backends)

# What "auto" picks on CUDA: the fastest correct engine measured on an H200
# (BENCHMARKS.md section 2); it pays a compilation (under a minute) per new shape.
AUTO_CUDA = "graph_compiled"
# Decoder families whose forward takes a prepared 4D mask, position ids and a duck-typed
# KV cache, and whose layers are all full attention.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
_ATTENTION_NAME = "opsd_static_decode"
# Decode attention reads the KV cache up to the end of the current window of this many
# new-token columns (one recorded graph per window), not the whole preallocated cache:
# on average about half of a long rollout's cache is not written yet. None: read it all.
# (split_kv's loop also stops at each row's last attended column; sdpa reads the window.)
KV_WINDOW = 128
# The kernel of the decode step's attention (`decode_attention.IMPLEMENTATIONS`; "auto" =
# the Triton split-KV kernel on CUDA, torch's sdpa elsewhere), read when a window's step is recorded.
DECODE_ATTENTION = "auto"
# The merged sampling copy stacks q/k/v and gate/up into one product each (`opsd/rollout/fused_projections.py`).
FUSE_PROJECTIONS = True
# torch.compile's mode for the "graph_compiled" step (None: the default; the loop records its
# own CUDA graphs, so only the "-no-cudagraphs" modes make sense, e.g. "max-autotune-no-cudagraphs").
DECODE_COMPILE_MODE: str | None = None
# "graph_compiled" compiles the prefill's decoder layers too (`prefill_layers`: one graph serves
# every layer and every packed length; RMSNorms, rotary embedding and gating fused instead of
# dozens of eager elementwise kernels a layer), at the price of a compilation at start-up
# (BENCHMARKS.md 2.9 measures both). False: the prefill runs eagerly.
COMPILE_PREFILL = True
# The sampler's top-k over the vocabulary in blocks of this many logits (`decode_sampler`):
# one pass reads each block's maximum and exp-sum, then only the k blocks with the largest
# maxima are searched. None: one torch.topk over the whole row and a log-sum-exp of its own.
SAMPLER_TOPK_BLOCK: int | None = 128


def resolve_cache_implementation(name: str | None, model) -> str | None:
    """The engine `name` stands for with this model: None (dynamic), static, graph, graph_compiled, paged.
    "auto" never picks "paged" (the trainer's rollouts keep the measured graph loop); the
    evaluation chooses it for itself (opsd.evaluation.evaluate.resolve_engine)."""
    if name == "dynamic":
        return None
    if name == "auto":
        if model_device(model).type != "cuda":
            return None  # CPU: generate() with the dynamic cache is the simple and fast enough path
        return AUTO_CUDA if StaticDecoder.supports(model) else "static"
    if name in GRAPH_LOOPS and not StaticDecoder.supports(model):
        config = causal_lm(model).config
        raise ValueError(f"cache_implementation={name!r} supports full-attention {', '.join(SUPPORTED_MODEL_TYPES)} "
                         f"models; this one is {getattr(config, 'model_type', '?')!r}: use 'static' or None")
    return name


def bucket_width(width: int) -> int:
    """Prompt widths are left-padded up to 64, 96, 128, 192, 256, 384, 512, 768, ...
    (at most 1.5x), so a run meets only a few shapes (one recorded graph each)."""
    bucket = 64
    while bucket < width:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


class StaticDecoder:
    """Sampling loop over a preallocated KV cache, one recorded CUDA graph per shape.

    - prefill: one forward over the prompts packed without padding, whose attention
      runs in the cache's left-padded layout (bucketed to `bucket_width`) under an
      explicit causal + padding mask (its decoder layers compiled when `compiled`, on
      CUDA; `COMPILE_PREFILL`);
    - decode: a step = forward of one token per row at its own rotary position,
      attention over the whole cache under a validity mask, sampling
      (temperature, top-k, top-p, exactly as transformers' warpers order them),
      EOS bookkeeping, all on the device with no host synchronisation. On CUDA the
      step is recorded once as a CUDA graph (after a torch.compile when `compiled`)
      and replayed; elsewhere it simply runs.

    LoRA: with `merge_lora` (the trainer's default) the student is sampled from a
    `merged_student.MergedStudent` copy (adapted weights = base + B @ A, rebuilt out
    of place before every call, made again if the model's tensors move); without
    it, or when the adapters cannot be merged, the adapters run unmerged inside the
    recorded step. Either way the frozen base weights, which are the teacher, are
    only ever read. Adapter updates made in place (optimizer steps,
    `load_state_dict`) are seen by the replays; a change of adapter state
    (enabled/disabled, active adapter) or of any parameter's storage records a new
    graph. One shape is kept per model (the last one used): its KV cache (2 x layers
    x rows x kv heads x (prompt bucket + new tokens) x head dim) stays allocated
    between calls; `release()` frees it and the merged copy.
    """

    _instances: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, model, compiled: bool, merge_lora: bool = False):
        # The transformers CausalLM (under any peft wrapper), held weakly: `_instances` maps the
        # model to this decoder, and a strong reference back would keep both alive forever.
        self._model = weakref.ref(model)
        self.compiled = compiled
        self.merge_lora = merge_lora
        self.merged: MergedStudent | None = None
        self.merged_fingerprint: int | None = None  # the model's parameter storage the copy was made from
        self.merge_error: str | None = None  # why the adapters are sampled unmerged despite merge_lora
        self.state: _DecodeState | None = None

    @property
    def model(self):
        return self._model()

    @staticmethod
    def supports(model) -> bool:
        inner = causal_lm(model)
        config = inner.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        return (getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES and layer_types == {"full_attention"}
                and _cache_argument(inner) is not None)

    @classmethod
    def for_model(cls, model, compiled: bool = False, merge_lora: bool = False) -> StaticDecoder:
        inner = causal_lm(model)
        decoder = cls._instances.get(inner)
        if decoder is None or decoder.compiled != compiled or decoder.merge_lora != merge_lora:
            if decoder is not None:
                decoder.release()
            decoder = cls._instances[inner] = cls(inner, compiled, merge_lora)
        return decoder

    def release(self) -> None:
        self.state = None
        self.merged = None

    def network(self, fingerprint: int):
        """What samples: the merged copy (refreshed) when adapters are active and can be merged, else the model.
        `fingerprint`: the model's `_storage_fingerprint` (from `_model_state`)."""
        if not self.merge_lora or self.merge_error is not None or not has_enabled_adapters(self.model):
            return self.model
        stale = self.merged is not None and (self.merged_fingerprint != fingerprint
                                             or self.merged.fused != FUSE_PROJECTIONS)
        if stale:  # the model's tensors moved (`.to()`, new storage): the copy shares stale ones; or the layout changed
            self.release()
        if self.merged is None:
            try:
                self.merged = MergedStudent(self.model, fuse=FUSE_PROJECTIONS)
                self.merged_fingerprint = fingerprint
            except MergeUnsupported as exc:
                self.merge_error = str(exc)
                warnings.warn(f"rollout: sampling through unmerged adapters ({exc})", RuntimeWarning, stacklevel=3)
                return self.model
        self.merged.refresh()
        return self.merged.network

    def generate(self, rows: list[list[int]], settings: SamplingSettings, *, pad_token_id: int,
                 eos_token_ids: Sequence[int]) -> list[list[int]]:
        """New token ids per row: max_new_tokens of them, pads after a row's EOS (the
        caller cuts after the first EOS). RNG: torch's global generator (the caller seeds it)."""
        if settings.max_new_tokens < 1:
            return [[] for _ in rows]
        adapters, fingerprint = _model_state(self.model)
        network = self.network(fingerprint)
        device = model_device(network)
        width = bucket_width(max(len(row) for row in rows))
        prompts = pack_prompts(rows, width, device)
        sampler = _Sampler(settings, network.config.vocab_size)
        key = (len(rows), width, settings.max_new_tokens, sampler.key, tuple(eos_token_ids), int(pad_token_id),
               network is self.model, adapters,
               fingerprint if network is self.model else _storage_fingerprint(network), device,
               KV_WINDOW, DECODE_ATTENTION, decode_attention.launch_settings(), decode_matmul.launch_settings(),
               decode_qkv.launch_settings(), decode_sampler.launch_settings(), DECODE_COMPILE_MODE,
               COMPILE_PREFILL)  # all baked into the graphs
        # Sampling from the model itself needs eval mode (dropout, checkpointing off); the merged
        # copy is in eval mode of its own, and switching the model walks every module twice.
        mode = eval_mode(self.model) if network is self.model else contextlib.nullcontext()
        with _static_attention(network), mode:
            if self.state is None or self.state.key != key:
                self.state = None  # free the previous shape's cache and graph first
                self.state = _DecodeState(network, key, len(rows), width, settings.max_new_tokens, sampler,
                                          list(eos_token_ids), int(pad_token_id), self.compiled)
            return self.state.run(prompts)


    def sampled_logprobs(self, rows: int) -> torch.Tensor | None:
        """[rows, max_new_tokens] log-probabilities (temperature 1, no filtering) of the tokens
        the last `generate` sampled, under the engine's own logits; 0 after a row's EOS."""
        return None if self.state is None else self.state.logprobs[:rows]


class _Sampler:
    """Next token from [B, V] logits: greedy, or temperature -> top-k -> top-p sampling
    (the order of transformers' warpers) by the Gumbel-max trick on `noise`, uniform
    [B, width] drawn outside the step. Ties at the k-th logit keep exactly k entries
    (transformers keeps all tied ones)."""

    def __init__(self, settings: SamplingSettings, vocab: int):
        self.greedy = settings.temperature <= 0
        self.temperature = float(settings.temperature)
        self.top_k = int(settings.top_k) if 0 < settings.top_k < vocab else 0
        self.top_p = float(settings.top_p)
        self.width = self.top_k or vocab
        self.key = (self.greedy, self.temperature, self.top_k, self.top_p)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits of the candidates in float32, best first; their vocabulary ids; the
        log-sum-exp of every logit of the row). The top-k runs on the logits' own dtype
        (on bf16, torch's radix select takes half the passes of a float32 copy; the k values
        convert exactly) and in blocks (`decode_sampler.top_k_and_logsumexp`; BENCHMARKS.md section 2.5)."""
        if self.top_k:
            return decode_sampler.top_k_and_logsumexp(logits, self.top_k, SAMPLER_TOPK_BLOCK)
        values, index = logits.sort(dim=-1, descending=True)
        return values.float(), index, logits.float().logsumexp(-1)

    def filter(self, values: torch.Tensor) -> torch.Tensor:
        """Candidates' logits (best first) tempered; -inf = filtered out by top-p."""
        return decode_sampler.tempered_and_filtered(values, self.temperature, self.top_p)

    def filtered(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tempered logits, vocabulary ids) of the candidates, best first; -inf = filtered out."""
        values, index, _ = self.candidates(logits)
        return self.filter(values), index

    def sample(self, logits: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B], their log-probabilities [B] under the untempered, unfiltered logits).
        With a top-k searched in blocks, on a GPU: one Triton kernel after the blocks'
        maxima (`decode_sampler.sample`, the same rule)."""
        if self.greedy:
            logits = logits.float()
            tokens = logits.argmax(-1)
            return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)
        block = SAMPLER_TOPK_BLOCK
        if self.top_k and block and decode_sampler.applies(logits, self.top_k, block):
            _, block_max, logsumexp = decode_sampler.block_maxima_and_logsumexp(logits, block)
            return decode_sampler.sample(logits, block_max, logsumexp, noise, self.top_k, block, self.temperature,
                                         self.top_p)
        values, index, logsumexp = self.candidates(logits)
        return decode_sampler.torch_draw(values, index, logsumexp, noise, self.temperature, self.top_p)

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return self.sample(logits, noise)[0]


class _KVCache:
    """Per-layer K/V buffers [B, kv_heads, L, head_dim]. `update` writes the new
    entries at columns index, index + 1, ... (`index`: a 1-element device tensor
    the loop advances) and returns the whole buffers; the mask hides what is unused."""

    is_compileable = True

    def __init__(self, layers: int, shape: tuple[int, int, int, int], dtype, device, index: torch.Tensor):
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.index = index

    def attend_new_token(self, layer_idx: int, qkv: torch.Tensor, heads: int, q_weight: torch.Tensor | None,
                         k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         mask: torch.Tensor, scale: float | None) -> torch.Tensor:
        """A decode step's attention straight from its q/k/v product [B, 1, (heads + 2 kv_heads) D]
        (`fused_projections.FusedAttention`): the q/k norms, rotary embedding and the new
        column's cache writes of `decode_qkv`, then attention over the window, through
        `decode_attention.new_token_attention` (one kernel for all of it on a GPU); no `update`.
        cos, sin: [B, 1, D]. -> [B, kv_heads, heads / kv_heads, D]."""
        batch, dim = qkv.shape[0], cos.shape[-1]
        norm = q_weight is not None
        stand_in = cos.new_empty(0)  # the op takes tensors only
        return _new_token_attention(qkv.reshape(batch, -1), heads, norm, q_weight if norm else stand_in,
                                    k_weight if norm else stand_in, float(eps), cos.reshape(batch, dim),
                                    sin.reshape(batch, dim), self.keys[layer_idx], self.values[layer_idx], self.index,
                                    mask, scale)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        columns = self.index + torch.arange(key_states.shape[-2], device=key_states.device)
        self.keys[layer_idx].index_copy_(2, columns, key_states)
        self.values[layer_idx].index_copy_(2, columns, value_states)
        return self.keys[layer_idx], self.values[layer_idx]


class _DecodeState:
    """Buffers (and, on CUDA, the recorded step) of one shape."""

    def __init__(self, model, key, batch: int, width: int, max_new_tokens: int, sampler: _Sampler,
                 eos_token_ids: list[int], pad_token_id: int, compiled: bool):
        config = model.config
        device = model_device(model)
        dtype = model.get_input_embeddings().weight.dtype
        layers, kv_heads, head_dim = kv_geometry(config)
        self._model = weakref.ref(model)  # the network that samples (see StaticDecoder: held weakly)
        self.key, self.sampler = key, sampler
        self.width, self.max_new_tokens, self.pad_token_id = width, max_new_tokens, pad_token_id
        self.length = width + max_new_tokens
        self.cache_argument = _cache_argument(model)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache column of the token being fed
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # output column of the token being sampled
        self.cache = _KVCache(layers, (batch, kv_heads, self.length, head_dim), dtype, device,
                              self.slot)
        self.valid = torch.zeros(batch, self.length, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        # log p(sampled token) under the engine's own (untempered) logits, for checks against the trainer
        self.logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
        self.noise = None if sampler.greedy else torch.zeros(batch, sampler.width, device=device)
        self.eos = torch.tensor(eos_token_ids or [-1], dtype=torch.long, device=device)
        self.step_fn = _compiled_decode_step() if compiled and device.type == "cuda" else _decode_step
        self.prefill_layers = (prefill_layers(model) if compiled and COMPILE_PREFILL and device.type == "cuda"
                               else None)
        # Decode step n feeds the token at cache column width + n - 1; each window's graph
        # attends to columns [0, limit) (KV_WINDOW: the filled part, rounded up).
        self.limits = decode_limits(width, max_new_tokens, KV_WINDOW)
        self.graphs, self.graph_error = None, None
        if device.type == "cuda" and max_new_tokens > 3:
            self._record()

    @property
    def model(self):
        return self._model()

    def prefill(self, prompts: PackedPrompts) -> torch.Tensor:
        """Write the prompts' keys and values into the cache (zeros at the padding columns);
        return the logits [B, V] of each row's last prompt token. One forward over the
        prompts packed without padding (`prefill_logits`), whose attention runs over the
        left-padded layout under a causal and padding mask in which a pad row attends to
        itself only (no all-masked rows); with `prefill_layers`, the decoder layers compiled.
        Expects `valid` to hold the prompts' columns (`run` sets it)."""
        width = self.width
        rows = torch.arange(width, device=self.valid.device)[:, None]
        cols = torch.arange(width, device=self.valid.device)[None, :]
        mask = ((cols <= rows) & self.valid[:, None, None, :width]) | (cols == rows)
        return prefill_logits(self.model, self.cache, self.cache_argument, prompts, mask, self.prefill_layers)

    def _step(self) -> None:
        self.step_fn(self.model, self.cache, self.cache_argument, self.sampler, self.tokens,
                     self.positions, self.slot, self.column, self.valid, self.finished, self.out, self.logprobs,
                     self.noise, self.eos, self.pad_token_id)

    def _record(self) -> None:
        """Warm up (compiling, when asked) on a side stream, then record one step.

        The warm-up draws noise under a forked RNG, so the caller's seeded stream is
        the same whether or not this call had to record. Should compiling fail, the
        step is recorded uncompiled; should recording fail (an operation that
        synchronises with the host, say), the loop runs the step without a graph.
        Either way it warns and says why in `graph_error`."""
        try:
            self.graphs = self._capture()
            return
        except Exception as exc:  # noqa: BLE001 - compiler and capture errors have no common base
            self.graph_error = f"{type(exc).__name__}: {exc}"
        if self.step_fn is not _decode_step:
            self.step_fn = _decode_step
            try:
                self.graphs = self._capture()
            except Exception as exc:  # noqa: BLE001
                self.graph_error += f" | uncompiled: {type(exc).__name__}: {exc}"
        warnings.warn(f"rollout: the compiled / recorded decode step failed "
                      f"({self.graph_error.splitlines()[0][:300]}); using the "
                      f"{'recorded eager step' if self.graphs is not None else 'eager step without a graph'}",
                      RuntimeWarning, stacklevel=2)

    def _capture(self) -> list:
        """One graph per attention window, sharing one memory pool (they never run at once)."""
        self.slot.fill_(self.width)
        self.column.fill_(1)
        device = self.slot.device
        graphs = []
        with torch.random.fork_rng(devices=[device.index or 0]):
            for limit in self.limits:
                with attention_limit(limit):
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(2 if not graphs else 1):  # the first warm-up compiles
                            self._draw_noise()
                            self._step()
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
                        self._step()
                graphs.append(graph)
        return graphs

    def _draw_noise(self) -> None:
        if self.noise is not None:
            self.noise.uniform_()

    def run(self, prompts: PackedPrompts) -> list[list[int]]:
        width = self.width
        self.valid.zero_()
        self.valid[prompts.rows, prompts.columns] = True
        self.finished.zero_()
        self.out.fill_(self.pad_token_id)
        self.logprobs.zero_()
        self.slot.zero_()
        self.column.zero_()
        logits = self.prefill(prompts)
        self._draw_noise()
        _emit(*self.sampler.sample(logits, self.noise), self.finished, self.eos, self.pad_token_id, self.out,
              self.logprobs, self.column, self.tokens)
        self.positions.copy_(prompts.lengths[:, None])
        self.slot.fill_(width)
        window = 0
        for step in range(1, self.max_new_tokens):
            while self.limits[window] <= width + step - 1:  # the fed token's column must be inside
                window += 1
            self._draw_noise()
            if self.graphs is not None:
                self.graphs[window].replay()
            else:
                with attention_limit(self.limits[window]):
                    self._step()
            if step % 32 == 0 and bool(self.finished.all()):
                break
        return self.out.tolist()


def decode_limits(width: int, max_new_tokens: int, window: int | None) -> list[int]:
    """Cache columns each decode window attends to: width + window, width + 2 x window, ...,
    the full length last (one entry when `window` is None)."""
    length = width + max_new_tokens
    if not window:
        return [length]
    return [min(width + end, length) for end in range(window, max_new_tokens + window, window)]


# Read by the decode attention op; set while a window's step runs or records. Per thread:
# two threads decoding step by step must not cut each other's window.
_ATTENTION_LIMIT = threading.local()


@contextlib.contextmanager
def attention_limit(columns: int):
    """Decode attention inside the block (this thread) reads cache columns [0, columns)."""
    previous = getattr(_ATTENTION_LIMIT, "columns", None)
    _ATTENTION_LIMIT.columns = columns
    try:
        yield
    finally:
        _ATTENTION_LIMIT.columns = previous


@torch.library.custom_op("opsd::decode_attention", mutates_args=())
def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """Attention of one query token (GQA heads packed as query rows) over the cache's first
    `attention_limit` columns, by the `DECODE_ATTENTION` kernel. An opaque op to
    torch.compile, so one compiled step serves every window: the limit and the kernel are
    read when a window's graph is recorded."""
    limit = getattr(_ATTENTION_LIMIT, "columns", None) or key.shape[-2]
    out = decode_attention.attention(DECODE_ATTENTION, query, key[:, :, :limit], value[:, :, :limit],
                                     mask[..., :limit], scale)
    return out.contiguous()


@_decode_attention.register_fake
def _(query, key, value, mask, scale):
    return query.new_empty(query.shape)


@torch.library.custom_op("opsd::decode_new_token_attention", mutates_args=("key", "value"))
def _new_token_attention(qkv: torch.Tensor, heads: int, norm: bool, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, cos: torch.Tensor, sin: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         slot: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """`_KVCache.attend_new_token` as an op torch.compile keeps whole: the new column written
    to `key` / `value` at `slot`, attention over their first `attention_limit` columns."""
    limit = getattr(_ATTENTION_LIMIT, "columns", None) or key.shape[-2]
    new = decode_attention.NewToken(qkv, heads, q_weight if norm else None, k_weight if norm else None, eps, cos, sin,
                                    slot)
    return decode_attention.new_token_attention(DECODE_ATTENTION, new, key[:, :, :limit], value[:, :, :limit],
                                                mask[..., :limit], scale).contiguous()


@_new_token_attention.register_fake
def _(qkv, heads, norm, q_weight, k_weight, eps, cos, sin, key, value, slot, mask, scale):
    return qkv.new_empty(qkv.shape[0], key.shape[1], heads // key.shape[1], cos.shape[-1])


def prefill_layers(model, backend: str = "inductor") -> CompiledLayers:
    """The decoder layers of the network that samples, compiled for `prefill_logits`: with
    dynamic shapes from the first call (the packed prompts' length changes with every batch),
    in a dynamo cache of their own (not the training step's compiled layers')."""
    return CompiledLayers(model, backend=backend, dynamic=True, own_cache=True)


class PackedPrompts(NamedTuple):
    """A batch of prompts for the prefill, without padding: their tokens one prompt after the
    other, and where each token sits in the cache's left-padded layout [rows, width]."""
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]: each token's position in its prompt
    rows: torch.Tensor  # [T]: the token's row of the cache
    columns: torch.Tensor  # [T]: its column (every prompt ends at column width - 1)
    lengths: torch.Tensor  # [B]
    last: torch.Tensor  # [B]: the index in T of each prompt's last token
    width: int


def pack_prompts(rows: list[list[int]], width: int, device) -> PackedPrompts:
    """`rows` (each at least one token, at most `width`) packed for `prefill_logits`."""
    lengths = torch.tensor([len(row) for row in rows])
    if not 0 < int(lengths.min()) <= int(lengths.max()) <= width:
        raise ValueError(f"prompts of 1 to {width} tokens expected, got lengths {int(lengths.min())} to "
                         f"{int(lengths.max())}")
    ends = lengths.cumsum(0)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    position = torch.arange(int(ends[-1])) - (ends - lengths)[row_of]
    input_ids = torch.tensor([token for row in rows for token in row])
    host = (input_ids[None], position[None], row_of, width - lengths[row_of] + position, lengths, ends - 1)
    return PackedPrompts(*(t.to(device) for t in host), width)


def prefill_logits(model, cache: _KVCache, cache_argument: str, prompts: PackedPrompts, mask: torch.Tensor,
                   layers: CompiledLayers | None = None) -> torch.Tensor:
    """The prefill's forward; -> the logits [B, V] of each prompt's last token. `layers`: the
    model's decoder layers compiled (`CompiledLayers`), or None to run them eagerly.

    The forward runs over the prompts packed without padding (its products and elementwise
    work cost the prompts' tokens, not rows x width; BENCHMARKS.md 2.9). Attention scatters
    them into the left-padded layout and runs under `mask` [B, 1, W, W] (`_attention`, which
    `_PrefillCache.update` hands the padded keys and values; it writes them, zeros at the
    padding, to the cache's first columns). The logits
    come from the last tokens' hidden states alone, one [B, hidden] product with the LM head."""
    decoder = model.get_decoder()
    prefill_cache = _PrefillCache(cache, prompts)
    hooks = [layer.register_forward_pre_hook(functools.partial(prefill_cache.select, index))
             for index, layer in enumerate(decoder_layers(model))]
    try:
        with layers.active() if layers is not None else contextlib.nullcontext():
            hidden = decoder(input_ids=prompts.input_ids, position_ids=prompts.positions, attention_mask=mask,
                             use_cache=True, opsd_packed=prompts, **{cache_argument: prefill_cache}).last_hidden_state
    finally:
        for hook in hooks:
            hook.remove()
    return model.get_output_embeddings()(hidden[0, prompts.last])


def _padded(packed: torch.Tensor, prompts: PackedPrompts, out: torch.Tensor | None = None) -> torch.Tensor:
    """[1, heads, T, D] packed -> [B, heads, W, D] left-padded, zeros at the padding; written
    into `out` when given (a view of the cache), else into a new tensor."""
    if out is None:
        out = packed.new_zeros(len(prompts.lengths), packed.shape[1], prompts.width, packed.shape[-1])
    else:
        out.zero_()
    out[prompts.rows, :, prompts.columns] = packed[0].transpose(0, 1)
    return out


class _PrefillCache:
    """The KV cache as the prefill's layers see it: `update` takes a layer's keys and values
    of the packed prompts, writes them left-padded (zeros at the padding) into the cache's
    first columns and returns those columns (the prompts' columns are all the prefill attends to).
    The layer is chosen by `select`, a forward pre-hook, not by the index `update` receives:
    compiled code reading that index would make it a constant of the graph, one compilation
    per layer; this way one graph serves every layer."""

    is_compileable = True

    def __init__(self, cache: _KVCache, prompts: PackedPrompts):
        self.cache, self.prompts = cache, prompts
        self.keys = self.values = None  # the selected layer's buffers

    def select(self, layer: int, *hook_args) -> None:
        self.keys, self.values = self.cache.keys[layer], self.cache.values[layer]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        width = self.prompts.width
        return (_padded(key_states, self.prompts, self.keys[:, :, :width]),
                _padded(value_states, self.prompts, self.values[:, :, :width]))


def _forward_logits(model, cache, cache_argument, input_ids, position_ids, mask) -> torch.Tensor:
    # A 4D mask passes through transformers' mask preparation as it is (masking_utils), for
    # every supported family; Llama's forward takes no {layer type: mask} dict.
    output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                   use_cache=True, logits_to_keep=1, **{cache_argument: cache})
    return output.logits[:, -1]  # in the model's dtype: the sampler reads them as they are


def _emit(next_tokens, chosen, finished, eos, pad_token_id, out, logprobs, column, tokens) -> None:
    """Record the sampled tokens (pads after a row's EOS) and their log-probabilities
    (`chosen`), and feed the tokens to the next step."""
    logprobs.index_copy_(1, column, torch.where(finished, 0.0, chosen)[:, None])
    next_tokens = torch.where(finished, pad_token_id, next_tokens)
    finished |= (next_tokens[:, None] == eos[None, :]).any(-1)
    out.index_copy_(1, column, next_tokens[:, None])
    column.add_(1)
    tokens.copy_(next_tokens[:, None])


def _decode_step(model, cache, cache_argument, sampler, tokens, positions, slot, column, valid,
                 finished, out, logprobs, noise, eos, pad_token_id) -> None:
    """One decode step, entirely on the device: every buffer is updated in place."""
    valid.index_fill_(1, slot, True)
    logits = _forward_logits(model, cache, cache_argument, tokens, positions, valid[:, None, None, :])
    _emit(*sampler.sample(logits, noise), finished, eos, pad_token_id, out, logprobs, column, tokens)
    positions.add_(1)
    slot.add_(1)


_COMPILED_STEPS: dict = {}  # torch.compile mode -> the compiled step


def _compiled_decode_step():
    if DECODE_COMPILE_MODE not in _COMPILED_STEPS:
        import torch._dynamo

        config = torch._dynamo.config  # a few shapes x adapter states per run, each its own graph
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 64))
        import_inductor_quietly()
        _COMPILED_STEPS[DECODE_COMPILE_MODE] = torch.compile(_decode_step, dynamic=False, mode=DECODE_COMPILE_MODE)
    return _COMPILED_STEPS[DECODE_COMPILE_MODE]


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, opsd_packed=None, **kwargs):
    """Attention of the decode loop. One query token (a decode step): sdpa-like over the
    preallocated cache under a boolean mask, the query heads sharing a KV head as query rows of
    that head (no repeated K/V, the cache is read once; `_decode_attention`). The prefill
    (`opsd_packed`, the PackedPrompts): the packed queries scattered into the left-padded
    layout of `key` / `value` (the prompts' columns, from `_PrefillCache`), sdpa under the
    mask with K/V repeated per query head, the outputs gathered back into the packed order."""
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if opsd_packed is None:
        if q_len != 1:
            raise ValueError(f"static_decode attention: one query token per row or a packed prefill, got {q_len}")
        packed = query.reshape(batch, key.shape[1], groups, dim)
        out = _decode_attention(packed, key, value, attention_mask, scaling)
        return out.reshape(batch, heads, 1, dim).transpose(1, 2), None
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(_padded(query, opsd_packed), key, value,
                                                           attn_mask=attention_mask, scale=scaling)
    return out[opsd_packed.rows, :, opsd_packed.columns][None], None  # [1, T, heads, D]


@contextlib.contextmanager
def _static_attention(model):
    """Route the model's attention through `_attention` for the duration of the block."""
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION_NAME, _attention)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = _ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def _cache_argument(model) -> str | None:
    """The forward argument that takes the KV cache (`cache` in transformers >= 5.2x)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def _model_state(model) -> tuple[tuple, int]:
    """(enabled / active / merged state of every peft tuner layer, `_storage_fingerprint`) in
    one walk over the modules: both are baked into a recorded step, and a peft-wrapped model
    has thousands of modules, walked before every call."""
    states, pointers = set(), []
    stack = [model]  # through `_modules` and `_parameters` directly: 2.6x faster than modules() / parameters()
    while stack:
        module = stack.pop()
        if _is_tuner_layer(type(module)):
            states.add((bool(module.disable_adapters), tuple(module.active_adapters), bool(module.merged)))
        pointers.extend(p.data_ptr() for p in module._parameters.values() if p is not None)
        stack.extend(child for child in module._modules.values() if child is not None)
    return tuple(sorted(states)), hash(tuple(pointers))


@functools.cache
def _is_tuner_layer(cls) -> bool:
    """peft's tuner layers, by their class's properties (an instance lookup of a missing
    attribute goes through nn.Module.__getattr__, slow for thousands of modules)."""
    return all(hasattr(cls, name) for name in ("active_adapters", "disable_adapters", "merged"))


def _storage_fingerprint(model) -> int:
    """Changes when any parameter gets new storage (a recorded step reads fixed addresses)."""
    return _model_state(model)[1]
