"""One matrix product for q, k and v, and one for gate and up: the layout of the merged sampling copy.

Why: at 32 rows a decode step's projections are latency-bound. BENCHMARKS.md section
2.3 has Qwen3-1.7B's 4 MB k and v projections at 0.8 TB/s, the 8 MB q projection at 1.4.
One product over the stacked weight reads the same bytes in one larger kernel, and
saves three kernel launches per layer. vLLM lays its models out the same way.

`fuse_attention` and `fuse_mlp` build a replacement for one module of the sampling copy.
The caller (`merged_student.MergedStudent`) fills the stacked weight through the returned
views, one per original projection, as it fills every merged weight. The replacement's
forward is the original's, written out for the classes in `FUSABLE`: transformers'
Qwen3, Qwen2 and Llama attention and MLP, which differ only in q/k norms (Qwen3), biases
(Qwen2) and the sliding-window argument (both Qwen). Other classes are left as they are.
In float64 the fused forward equals the original's to rounding (tested); in bf16 the
fused product may sum in another order, within bf16 rounding.

In a decode step over `static_decode`'s cache (one token per row, on CUDA) the attention
goes from the q/k/v product to its output through the cache (`attend_new_token`: the q/k
norms, rotary embedding, cache writes and attention in one kernel, see `opsd/rollout/kernels/qkv.py` and
`opsd/rollout/kernels/attention.py`), plain projections go through `decode_matmul.linear` (a split-K
kernel where it measured faster), and a SiLU MLP's gate/up product and gating through
`decode_matmul.silu_gated` (one kernel); elsewhere (prefill, CPU, other caches) the original
operations run.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from opsd.rollout.kernels import matmul as decode_matmul
from opsd.rollout.kernels import qkv as decode_qkv

# Class name (transformers' own classes only) -> the projections stacked into one product, in order.
FUSABLE = {
    "Qwen3Attention": ("q_proj", "k_proj", "v_proj"),
    "Qwen2Attention": ("q_proj", "k_proj", "v_proj"),
    "LlamaAttention": ("q_proj", "k_proj", "v_proj"),
    "Qwen3MLP": ("gate_proj", "up_proj"),
    "Qwen2MLP": ("gate_proj", "up_proj"),
    "LlamaMLP": ("gate_proj", "up_proj"),
}


def fusable_projections(module: nn.Module) -> tuple[str, ...]:
    """The projections of `module` that `fuse` would stack, by its class (empty: not fusable).
    Only transformers' own classes: a remote-code class of the same name may differ."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return ()
    return FUSABLE.get(cls.__name__, ())


def fuse(module: nn.Module, projections: list[nn.Linear] | None = None
         ) -> tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """(replacement, {projection: (weight view, bias view or None)}) for a fusable module.
    The stack takes its shapes, dtype, device and biases from `projections`, plain
    `nn.Linear` layers in `fusable_projections` order (default: the module's own); it is
    allocated, not filled: the caller writes every view."""
    names = fusable_projections(module)
    parts = projections if projections is not None else [getattr(module, name, None) for name in names]
    if not names or len(parts) != len(names) or not all(type(part) is nn.Linear for part in parts):
        raise ValueError(f"{type(module).__name__} is not fusable: expected transformers' "
                         f"{', '.join(FUSABLE)} with plain nn.Linear projections")
    stacked, views = _stacked_linear(parts)
    sizes = [part.out_features for part in parts]
    replacement = FusedAttention(module, stacked, sizes) if names[0] == "q_proj" else FusedMLP(module, stacked, sizes)
    return replacement, dict(zip(names, views, strict=False))


def _stacked_linear(parts: list[nn.Linear]) -> tuple[nn.Linear, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    first = parts[0].weight
    sizes = [part.out_features for part in parts]
    stacked = nn.Linear(first.shape[1], sum(sizes), bias=False, device="meta")
    stacked.weight = nn.Parameter(torch.empty(sum(sizes), first.shape[1], dtype=first.dtype, device=first.device),
                                  requires_grad=False)
    has_bias = any(part.bias is not None for part in parts)
    if has_bias:
        # A projection without a bias stacked beside ones with (never so in the supported
        # families) gets zeros that nothing overwrites.
        stacked.bias = nn.Parameter(torch.zeros(sum(sizes), dtype=first.dtype, device=first.device),
                                    requires_grad=False)
    weights = stacked.weight.split(sizes)
    biases = stacked.bias.split(sizes) if has_bias else [None] * len(parts)
    views = [(w, b if part.bias is not None else None) for w, b, part in zip(weights, biases, parts, strict=False)]
    return stacked, views


class FusedAttention(nn.Module):
    """The attention of Qwen3 / Qwen2 / Llama with q, k and v from one product (`qkv_proj`)."""

    def __init__(self, attention: nn.Module, qkv_proj: nn.Linear, sizes: list[int]):
        super().__init__()
        self.qkv_proj, self.sizes = qkv_proj, sizes  # q, k, v widths
        self.o_proj = attention.o_proj
        self.q_norm = getattr(attention, "q_norm", None)  # Qwen3 only
        self.k_norm = getattr(attention, "k_norm", None)
        # What the attention functions and the forward read from the module
        for name in ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling", "attention_dropout",
                     "is_causal"):
            setattr(self, name, getattr(attention, name))
        self.passes_sliding_window = hasattr(attention, "sliding_window")  # the Qwen forwards pass it on
        self.sliding_window = getattr(attention, "sliding_window", None)
        self.training = attention.training
        modeling = sys.modules[type(attention).__module__]
        self._rotary = modeling.apply_rotary_pos_emb
        self._eager_attention = modeling.eager_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self._attention_functions = ALL_ATTENTION_FUNCTIONS

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
                **kwargs):
        # transformers 5.2x's signature and cache API (requirements.txt pins the version); the decoder layers of
        # earlier 5.x (5.17, vLLM's environments) pass the cache as `past_key_values`: without it here the cache
        # was never updated and static_decode's prefill attended over the packed keys (a shape error)
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        qkv = project(self.qkv_proj, hidden_states)
        if self._attends_new_token(qkv, cache):
            norms = self.q_norm is not None
            out = cache.attend_new_token(self.layer_idx, qkv, self.sizes[0] // self.head_dim,
                                         self.q_norm.weight if norms else None, self.k_norm.weight if norms else None,
                                         self.q_norm.variance_epsilon if norms else 0.0, *position_embeddings,
                                         attention_mask, self.scaling)
            return project(self.o_proj, out.reshape(*input_shape, -1)), None
        heads = (*input_shape, -1, self.head_dim)
        query, key, value = (t.view(heads) for t in qkv.split(self.sizes, dim=-1))
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = position_embeddings
        query, key = self._rotary(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention = self._attention_functions.get_interface(self.config._attn_implementation, self._eager_attention)
        extra = {"sliding_window": self.sliding_window} if self.passes_sliding_window else {}
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **extra, **kwargs)
        return project(self.o_proj, out.reshape(*input_shape, -1).contiguous()), weights

    def _attends_new_token(self, qkv: torch.Tensor, cache) -> bool:
        """Whether this forward is a decode step (one token per row) over static_decode's
        cache that `decode_qkv`'s kernel can take (q and k norms of one eps)."""
        if not hasattr(cache, "attend_new_token") or qkv.shape[1] != 1 or not decode_qkv.applies(qkv, self.head_dim):
            return False
        return self.q_norm is None or self.q_norm.variance_epsilon == self.k_norm.variance_epsilon


class FusedMLP(nn.Module):
    """The gated MLP of Qwen3 / Qwen2 / Llama with gate and up from one product (`gate_up_proj`)."""

    def __init__(self, mlp: nn.Module, gate_up_proj: nn.Linear, sizes: list[int]):
        super().__init__()
        self.gate_up_proj, self.sizes = gate_up_proj, sizes  # gate, up widths
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        # SiLU gating of equal halves without a bias: `decode_matmul.silu_gated` can do product and gating at once
        self._gates_in_kernel = (type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation") and sizes[0] == sizes[1]
                                 and gate_up_proj.bias is None)

    def forward(self, x):
        if self._gates_in_kernel and decode_matmul.gated_applies(x, self.gate_up_proj.weight):
            return project(self.down_proj, decode_matmul.silu_gated(x, self.gate_up_proj.weight))
        gate, up = project(self.gate_up_proj, x).split(self.sizes, dim=-1)
        return project(self.down_proj, self.act_fn(gate) * up)


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`; a plain `nn.Linear` through `decode_matmul.linear` (its split-K kernel
    for a decode step's few rows on a GPU, `F.linear` otherwise)."""
    if type(layer) is nn.Linear:
        return decode_matmul.linear(x, layer.weight, layer.bias)
    return layer(x)
