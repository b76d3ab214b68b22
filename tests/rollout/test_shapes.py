"""The head geometry of the larger Qwen3 shapes through the rollout engine, on CPU.

Qwen3-4B and Qwen3-8B attend with 32 query heads over 8 KV heads of 128 dims (1.7B: 16 over 8),
and 8B's LM head is not tied to its embedding (bench/common.SHAPES). Here that geometry is kept
at a reduced width, depth and vocabulary: the merged, fused student's decode loop (KV cache,
padded prompts) samples what the unmerged adapters sample, its log-probabilities are those of one
plain forward, the fixed teacher's weights are never written, and the same holds through the
project's split-KV attention kernel (Triton's CPU interpreter)."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from test_fused_projections import EOS, GREEDY, PAD, SAMPLE, assert_loop_scores_like_a_forward, sample, with_lora

from opsd.rollout import static_decode as static_decode
from opsd.rollout.kernels import attention as decode_attention
from opsd.rollout.static_decode import StaticDecoder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402

LARGER = ("qwen3-4b", "qwen3-8b")


def reduced(shape: str, dtype=torch.float32):
    """A random Qwen3 with `shape`'s attention geometry and head tying, at hidden 64, 2 layers
    and a 96-token vocabulary."""
    from transformers import Qwen3ForCausalLM

    full = common.qwen3_config(shape)
    config = dataclasses.replace(full) if dataclasses.is_dataclass(full) else full.__class__(**full.to_dict())
    config.update({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                   "max_position_embeddings": 128, "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": None})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert model.lm_head.weight is model.model.embed_tokens.weight or not full.tie_word_embeddings
    return model


def test_the_declared_shapes_are_the_published_configs():
    expected = {"qwen3-1.7b": (2048, 6144, 28, 16, True), "qwen3-4b": (2560, 9728, 36, 32, True),
                "qwen3-8b": (4096, 12288, 36, 32, False)}
    for shape, (hidden, intermediate, layers, heads, tied) in expected.items():
        config = common.qwen3_config(shape)
        assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
                config.num_key_value_heads, config.head_dim, config.tie_word_embeddings, config.vocab_size) == (
            hidden, intermediate, layers, heads, 8, 128, tied, 151936), shape


@pytest.mark.parametrize("shape", LARGER)
def test_the_decode_loop_at_the_larger_geometry(shape, monkeypatch):
    model = with_lora(reduced(shape))
    if shape == "qwen3-8b":
        assert model.get_base_model().lm_head.weight is not model.get_base_model().model.embed_tokens.weight
    teacher = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    merged = sample(model, GREEDY), sample(model, SAMPLE)
    decoder = StaticDecoder.for_model(model, merge_lora=True)
    assert decoder.merged is not None and decoder.merged.fused
    unmerged = sample(model, GREEDY, merge_lora=False), sample(model, SAMPLE, merge_lora=False)
    assert merged == unmerged
    assert any(len(ids) > 3 for samples in merged[1] for ids in samples)
    assert_loop_scores_like_a_forward(model, atol=1e-4)  # float32 throughout
    assert all(torch.equal(p.detach(), teacher[name]) for name, p in model.named_parameters() if "lora_" not in name)


@pytest.mark.parametrize("shape", LARGER)
def test_the_split_kv_kernel_at_the_larger_geometry(shape, interpreted_triton, monkeypatch):
    """Four query heads per KV head of 128 dims through the project's attention kernel: the same
    tokens as torch's attention in the same loop."""
    model = with_lora(reduced(shape))
    short_greedy, short_sample = (dataclasses.replace(s, max_new_tokens=5) for s in (GREEDY, SAMPLE))
    results, launches = {}, []
    kernel = decode_attention.split_kv
    monkeypatch.setattr(decode_attention, "split_kv", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    monkeypatch.setattr(decode_attention, "SPLIT_NEW_TOKEN", False)
    for attention in ("sdpa", "split_kv"):
        monkeypatch.setattr(static_decode, "DECODE_ATTENTION", attention)
        launches.clear()
        results[attention] = sample(model, short_greedy), sample(model, short_sample)
        StaticDecoder.for_model(model, merge_lora=True).release()
        assert bool(launches) == (attention == "split_kv")
    assert results["sdpa"] == results["split_kv"]
