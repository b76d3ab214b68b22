"""bench/decode_floor.py counts the bytes a decode step must read and times the step's kernels
at the rollout's KV windows: its count is checked here against a Qwen3 model's own weights
(built on the meta device, every shape) and its windows against the decode loop's."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402
import decode_floor  # noqa: E402

from opsd.rollout.static_decode import decode_limits  # noqa: E402


@pytest.mark.parametrize("shape", sorted(common.SHAPES))
def test_step_bytes_are_the_models_product_weights_and_kv(shape):
    from transformers import Qwen3ForCausalLM

    config = common.qwen3_config(shape)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    layer_weights = sum(m.weight.numel() for name, m in model.model.layers.named_modules() if isinstance(m, nn.Linear))
    counted = decode_floor.step_bytes(shape, rows=32, attended=700)
    assert counted["weights"] == layer_weights * 2
    assert counted["lm_head"] == model.lm_head.weight.numel() * 2
    kv_per_column = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    assert counted["kv"] == config.num_hidden_layers * 32 * 700 * kv_per_column
    # the stacked products hold exactly the model's projections
    stacked = {name: n * k for name, (n, k) in decode_floor.products(shape).items()}
    attention = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    assert stacked["qkv"] == sum(p.weight.numel() for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert stacked["gate_up"] == mlp.gate_proj.weight.numel() + mlp.up_proj.weight.numel()
    assert stacked["o"] == attention.o_proj.weight.numel() and stacked["down"] == mlp.down_proj.weight.numel()


def test_windows_are_the_decode_loops():
    assert decode_floor.windows() == decode_limits(192, 1024, 128)
    assert decode_floor.windows()[0] == 192 + 128 and decode_floor.windows()[-1] == 192 + 1024
    assert len(decode_floor.windows()) * decode_floor.WINDOW == decode_floor.NEW_TOKENS


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert decode_floor.main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_the_plain_read_reads_exactly_the_steps_bytes(interpreted_triton, monkeypatch):
    """Every weight whole and each row's first `attended` K/V columns, nothing else (Triton's
    CPU interpreter; a small block so that several programs share a tensor)."""
    monkeypatch.setattr(decode_floor, "READ_BLOCK", 16)
    gen = torch.Generator().manual_seed(0)
    sizes = {"qkv": (24, 8), "o": (8, 8), "gate_up": (32, 8), "down": (8, 16)}
    layer = [{**{name: torch.randn(*size, generator=gen) for name, size in sizes.items()},
              "key": torch.randn(2, 3, 10, 4, generator=gen), "value": torch.randn(2, 3, 10, 4, generator=gen)}
             for _ in range(2)]
    lm_head = torch.randn(40, 8, generator=gen)
    calls = decode_floor.read_calls(layer, lm_head, attended=6)
    for call in calls:
        call()
    expected = [w[name][:, :, :6].sum() if name in ("key", "value") else w[name].sum()
                for w in layer for name in ("qkv", "o", "gate_up", "down", "key", "value")] + [lm_head.sum()]
    assert len(calls) == len(expected)
    for call, want in zip(calls, expected, strict=False):
        torch.testing.assert_close(call.out.sum(), want, rtol=1e-5, atol=1e-4)
    weights = sum(w[name].numel() for w in layer for name in sizes) + lm_head.numel()
    assert sum(call.bytes for call in calls) == 4 * (weights + 2 * 2 * 2 * 3 * 6 * 4)


@pytest.mark.parametrize("shape", sorted(common.SHAPES))
def test_the_plain_reads_launch_within_cudas_grid_limits(shape):
    """CUDA allows 2**31 - 1 programs on a grid's first axis and 65,535 on the others: every
    read of the shape's step (tensors on the meta device) stays inside them."""
    hidden, _, layers, _, _ = common.SHAPES[shape]
    length = decode_floor.windows()[-1]
    layer = [{**{name: torch.empty(n, k, device="meta", dtype=torch.bfloat16)
                 for name, (n, k) in decode_floor.products(shape).items()},
              **{name: torch.empty(32, 8, length, 128, device="meta", dtype=torch.bfloat16)
                 for name in ("key", "value")}}]
    lm_head = torch.empty(decode_floor.VOCAB, hidden, device="meta", dtype=torch.bfloat16)
    grids = [call.grid for call in decode_floor.read_calls(layer, lm_head, attended=length)]
    assert max(first for first, _ in grids) < 2**31 and max(second for _, second in grids) <= 65_535
    assert max(first for first, _ in grids) > 65_535 or shape != "qwen3-8b"  # the LM head's chunks, on axis 0
