"""The project's own decode loop: the "graph" / "graph_compiled" engines of
`rollout.TransformersBackend`, and its default on CUDA ("auto").

`StaticDecoder` samples over a preallocated KV cache: one eager prefill over the
left-padded prompts (widths bucketed by `bucket_width`), then every decode step
(forward of one token per row, attention over the cache under a validity mask,
temperature -> top-k -> top-p sampling, EOS bookkeeping) runs on the device with
no host synchronisation and, on CUDA, is recorded once as a CUDA graph (after a
torch.compile for "graph_compiled") and replayed. On CPU the same step simply
runs, without recording or compiling, which is what the CPU tests check.

Why it exists: on-policy rollouts dominate a training step, and `model.generate`
is slow for them. On an H200 (BENCHMARKS.md section 2, 32 prompts x 1024 new
tokens, LoRA r=64 on a Qwen3-1.7B shape) generate reaches 370 tok/s with the
dynamic cache and 1,477 with the static cache + transformers' torch.compile; this
loop reaches 2,571 recorded eagerly and 4,349 compiled. LoRA adapters stay
unmerged (their matmuls are part of the recorded step), so the frozen base
weights, which are the teacher, are only ever read.

Supported: full-attention Qwen3 / Qwen2 / Llama models (`SUPPORTED_MODEL_TYPES`);
`resolve_cache_implementation` falls back to transformers' static cache for others.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import warnings
import weakref
from collections.abc import Sequence
from typing import ClassVar

import torch

from model_utils import causal_lm, left_pad, model_device
from sampling import SamplingSettings

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "graph", "graph_compiled", "auto")
GRAPH_LOOPS = ("graph", "graph_compiled")
# What "auto" picks on CUDA: the fastest correct engine measured on an H200
# (BENCHMARKS.md, 32 prompts x 1024 new tokens, LoRA r=64 on a Qwen3-1.7B shape):
# graph_compiled 4,349 tok/s, graph 2,571, generate + static cache 1,477, generate +
# dynamic cache 370. graph_compiled pays about a minute of compilation per new shape.
AUTO_CUDA = "graph_compiled"
# Decoder families whose forward takes a prepared {layer type: mask} dict, position
# ids and a duck-typed KV cache, and whose layers are all full attention.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
_ATTENTION_NAME = "opsd_static_decode"


def resolve_cache_implementation(name: str | None, model) -> str | None:
    """The engine `name` stands for with this model: None (dynamic), static, graph, graph_compiled."""
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

    - prefill: one ordinary (eager) forward over the left-padded prompts, bucketed
      to `bucket_width`, with an explicit causal + padding mask;
    - decode: a step = forward of one token per row at its own rotary position,
      attention over the whole cache under a validity mask, sampling
      (temperature, top-k, top-p, exactly as transformers' warpers order them),
      EOS bookkeeping, all on the device with no host synchronisation. On CUDA the
      step is recorded once as a CUDA graph (after a torch.compile when `compiled`)
      and replayed; elsewhere it simply runs.

    LoRA adapters stay unmerged (their matmuls are part of the recorded step), so
    the frozen base weights, which are the teacher, are only ever read. Adapter
    updates made in place (optimizer steps, `load_state_dict`) are seen by the
    replays; a change of adapter state (enabled/disabled, active adapter) or of any
    parameter's storage records a new graph. One shape is kept per model (the last
    one used): its KV cache (2 x layers x rows x kv heads x (prompt bucket +
    new tokens) x head dim) stays allocated between calls; `release()` frees it.
    """

    _instances: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, model, compiled: bool):
        self.model = model  # the transformers CausalLM (under any peft wrapper)
        self.compiled = compiled
        self.state: _DecodeState | None = None

    @staticmethod
    def supports(model) -> bool:
        inner = causal_lm(model)
        config = inner.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        return (getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES and layer_types == {"full_attention"}
                and _cache_argument(inner) is not None)

    @classmethod
    def for_model(cls, model, compiled: bool = False) -> StaticDecoder:
        inner = causal_lm(model)
        decoder = cls._instances.get(inner)
        if decoder is None or decoder.compiled != compiled:
            if decoder is not None:
                decoder.release()
            decoder = cls._instances[inner] = cls(inner, compiled)
        return decoder

    def release(self) -> None:
        self.state = None

    def generate(self, rows: list[list[int]], settings: SamplingSettings, *, pad_token_id: int,
                 eos_token_ids: Sequence[int]) -> list[list[int]]:
        """New token ids per row: max_new_tokens of them, pads after a row's EOS (the
        caller cuts after the first EOS). RNG: torch's global generator (the caller seeds it)."""
        if settings.max_new_tokens < 1:
            return [[] for _ in rows]
        device = model_device(self.model)
        width = bucket_width(max(len(row) for row in rows))
        input_ids, prompt_mask = left_pad(rows, pad_token_id, device, width=width)
        sampler = _Sampler(settings, self.model.config.vocab_size)
        key = (len(rows), width, settings.max_new_tokens, sampler.key, tuple(eos_token_ids), int(pad_token_id),
               _adapter_state(self.model), _storage_fingerprint(self.model), device)
        with _static_attention(self.model):
            if self.state is None or self.state.key != key:
                self.state = None  # free the previous shape's cache and graph first
                self.state = _DecodeState(self.model, key, len(rows), width, settings.max_new_tokens, sampler,
                                          list(eos_token_ids), int(pad_token_id), self.compiled)
            return self.state.run(input_ids, prompt_mask)


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

    def filtered(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tempered logits, vocabulary ids) of the candidates, best first; -inf = filtered out."""
        logits = logits.float()
        if self.top_k:
            values, index = logits.topk(self.top_k, dim=-1)
        else:
            values, index = logits.sort(dim=-1, descending=True)
        values = values / self.temperature
        if self.top_p < 1.0:
            probs = values.softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # probability of the candidates ranked above
            values = values.masked_fill(mass_before >= self.top_p, -math.inf)  # the first one always stays
        return values, index

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(-1)
        values, index = self.filtered(logits)
        gumbel = -torch.log(-torch.log(noise))
        choice = (values + gumbel).argmax(-1, keepdim=True)
        return index.gather(-1, choice).squeeze(-1)


class _KVCache:
    """Per-layer K/V buffers [B, kv_heads, L, head_dim]. `update` writes the new
    entries at columns index, index + 1, ... (`index`: a 1-element device tensor
    the loop advances) and returns the whole buffers; the mask hides what is unused."""

    is_compileable = True

    def __init__(self, layers: int, shape: tuple[int, int, int, int], dtype, device, index: torch.Tensor):
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.index = index

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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.model, self.key, self.sampler = model, key, sampler
        self.width, self.max_new_tokens, self.pad_token_id = width, max_new_tokens, pad_token_id
        self.length = width + max_new_tokens
        self.cache_argument = _cache_argument(model)
        self.layer_types = tuple(sorted(set(getattr(config, "layer_types", None) or ["full_attention"])))
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache column of the token being fed
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # output column of the token being sampled
        self.cache = _KVCache(config.num_hidden_layers, (batch, kv_heads, self.length, head_dim), dtype, device,
                              self.slot)
        self.valid = torch.zeros(batch, self.length, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.noise = None if sampler.greedy else torch.zeros(batch, sampler.width, device=device)
        self.eos = torch.tensor(eos_token_ids or [-1], dtype=torch.long, device=device)
        self.step_fn = _compiled_decode_step() if compiled and device.type == "cuda" else _decode_step
        self.graph, self.graph_error = None, None
        if device.type == "cuda" and max_new_tokens > 3:
            self._record()

    def _forward(self, input_ids, position_ids, mask) -> torch.Tensor:
        return _forward_logits(self.model, self.cache, self.cache_argument, self.layer_types,
                               input_ids, position_ids, mask)

    def _step(self) -> None:
        self.step_fn(self.model, self.cache, self.cache_argument, self.layer_types, self.sampler, self.tokens,
                     self.positions, self.slot, self.column, self.valid, self.finished, self.out, self.noise,
                     self.eos, self.pad_token_id)

    def _record(self) -> None:
        """Warm up (compiling, when asked) on a side stream, then record one step.

        The warm-up draws noise under a forked RNG, so the caller's seeded stream is
        the same whether or not this call had to record. Should compiling fail, the
        step is recorded uncompiled; should recording fail (an operation that
        synchronises with the host, say), the loop runs the step without a graph.
        Either way it warns and says why in `graph_error`."""
        try:
            self.graph = self._capture()
            return
        except Exception as exc:  # noqa: BLE001 - compiler and capture errors have no common base
            self.graph_error = f"{type(exc).__name__}: {exc}"
        if self.step_fn is not _decode_step:
            self.step_fn = _decode_step
            try:
                self.graph = self._capture()
            except Exception as exc:  # noqa: BLE001
                self.graph_error += f" | uncompiled: {type(exc).__name__}: {exc}"
        warnings.warn(f"rollout: the compiled / recorded decode step failed "
                      f"({self.graph_error.splitlines()[0][:300]}); using the "
                      f"{'recorded eager step' if self.graph is not None else 'eager step without a graph'}",
                      RuntimeWarning, stacklevel=2)

    def _capture(self):
        self.slot.fill_(self.width)
        self.column.fill_(1)
        device = self.slot.device
        with torch.random.fork_rng(devices=[device.index or 0]):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._draw_noise()
                    self._step()
            torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        return graph

    def _draw_noise(self) -> None:
        if self.noise is not None:
            self.noise.uniform_()

    def run(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
        width = self.width
        self.valid.zero_()
        self.valid[:, :width] = prompt_mask.bool()
        self.finished.zero_()
        self.out.fill_(self.pad_token_id)
        self.slot.zero_()
        self.column.zero_()
        # Prefill: causal and padding mask; a pad row attends to itself only (no all-masked rows).
        rows = torch.arange(width, device=input_ids.device)[:, None]
        cols = torch.arange(self.length, device=input_ids.device)[None, :]
        mask = ((cols <= rows) & self.valid[:, None, None, :]) | (cols == rows)
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(input_ids, position_ids, mask)
        self._draw_noise()
        _emit(self.sampler(logits, self.noise), self.finished, self.eos, self.pad_token_id, self.out, self.column,
              self.tokens)
        self.positions.copy_(prompt_mask.sum(-1, keepdim=True))
        self.slot.fill_(width)
        for step in range(1, self.max_new_tokens):
            self._draw_noise()
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            if step % 32 == 0 and bool(self.finished.all()):
                break
        return self.out.tolist()


def _forward_logits(model, cache, cache_argument, layer_types, input_ids, position_ids, mask) -> torch.Tensor:
    output = model(input_ids=input_ids, position_ids=position_ids, attention_mask={t: mask for t in layer_types},
                   use_cache=True, logits_to_keep=1, **{cache_argument: cache})
    return output.logits[:, -1]


def _emit(next_tokens, finished, eos, pad_token_id, out, column, tokens) -> None:
    """Record the sampled tokens (pads after a row's EOS) and feed them to the next step."""
    next_tokens = torch.where(finished, pad_token_id, next_tokens)
    finished |= (next_tokens[:, None] == eos[None, :]).any(-1)
    out.index_copy_(1, column, next_tokens[:, None])
    column.add_(1)
    tokens.copy_(next_tokens[:, None])


def _decode_step(model, cache, cache_argument, layer_types, sampler, tokens, positions, slot, column, valid,
                 finished, out, noise, eos, pad_token_id) -> None:
    """One decode step, entirely on the device: every buffer is updated in place."""
    valid.index_fill_(1, slot, True)
    logits = _forward_logits(model, cache, cache_argument, layer_types, tokens, positions, valid[:, None, None, :])
    _emit(sampler(logits, noise), finished, eos, pad_token_id, out, column, tokens)
    positions.add_(1)
    slot.add_(1)


_COMPILED_STEP = None


def _compiled_decode_step():
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        import torch._dynamo

        config = torch._dynamo.config  # a few shapes x adapter states per run, each its own graph
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 64))
        _COMPILED_STEP = torch.compile(_decode_step, dynamic=False)
    return _COMPILED_STEP


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa over the preallocated cache under a boolean mask. One query token: the
    query heads sharing a KV head become query rows of that head (no repeated K/V,
    the cache is read once); several (the prefill): K/V repeated per query head."""
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if q_len == 1 and groups > 1:
        packed = query.reshape(batch, key.shape[1], groups, dim)
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                               scale=scaling)
        return out.reshape(batch, heads, 1, dim).transpose(1, 2), None
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


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


def _adapter_state(model) -> tuple:
    """Enabled / active / merged state of every peft tuner layer (baked into a recorded step)."""
    states = set()
    for module in model.modules():
        if hasattr(module, "active_adapters") and hasattr(module, "disable_adapters") and hasattr(module, "merged"):
            states.add((bool(module.disable_adapters), tuple(module.active_adapters), bool(module.merged)))
    return tuple(sorted(states))


def _storage_fingerprint(model) -> int:
    """Changes when any parameter gets new storage (a recorded step reads fixed addresses)."""
    return hash(tuple(p.data_ptr() for p in model.parameters()))
