"""Shared pieces of the benchmarks: the model shapes, the LoRA model as the trainer
builds it, the FLOP count, timing and memory helpers, and a report writer.

Shapes (`SHAPES`, `--shape` of the scripts that take one):
- `qwen3-1.7b`, `qwen3-4b`, `qwen3-8b`: random-init models of the published Qwen3 configs
  (vocab 151936, head_dim 128, 8 KV heads, rope_theta 1e6; 1.7B: hidden 2048, intermediate
  6144, 28 layers, 16 heads, tied embeddings; 4B: 2560 / 9728 / 36 / 32, tied; 8B:
  4096 / 12288 / 36 / 32, untied), bf16, sdpa; for the GPU machine.
- `tiny`: the embedded tiny default (`opsd.tiny_default.build_tiny_model()`, fp32), so
  the whole benchmark runs end to end on a CPU in about a minute.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OPSD_CACHE", str(ROOT / ".cache" / "opsd"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# After the environment above: torch and transformers read it when they load.
import torch  # noqa: E402

from opsd import model_utils  # noqa: E402

BF16_PEAK_TFLOPS = 786.0  # dense bf16 matmul ceiling measured on the H200 with one large matmul
LORA_R, LORA_ALPHA = 64, 128


@dataclass(frozen=True)
class Geometry:
    prompt: int  # student prompt tokens
    teacher_prompt: int  # teacher prompt tokens
    completion: int  # completion tokens


FULL = Geometry(prompt=200, teacher_prompt=700, completion=1024)
TINY = Geometry(prompt=12, teacher_prompt=30, completion=32)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The published Qwen3 configurations: (hidden, intermediate, layers, attention heads, tied embeddings).
SHAPES = {
    "qwen3-1.7b": (2048, 6144, 28, 16, True),
    "qwen3-4b": (2560, 9728, 36, 32, True),
    "qwen3-8b": (4096, 12288, 36, 32, False),
}
SHAPE_CHOICES = (*SHAPES, "tiny")


def qwen3_config(shape: str = "qwen3-1.7b"):
    """The Qwen3Config of a `SHAPES` entry (8 KV heads, head_dim 128 at every size)."""
    from transformers import Qwen3Config

    hidden, intermediate, layers, heads, tied = SHAPES[shape]
    return Qwen3Config(
        vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
    )


def default_shape(requested: str | None) -> str:
    """`requested`, else qwen3-1.7b on CUDA and tiny elsewhere."""
    return requested or ("qwen3-1.7b" if torch.cuda.is_available() else "tiny")


def build_base_model(shape: str, seed: int = 0):
    """The base CausalLM for `shape`, on the benchmark device, in its benchmark dtype."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if shape == "tiny":
        from opsd import tiny_default
        model = tiny_default.build_tiny_model(seed).to(device())
        model.config._attn_implementation = "sdpa"
        return model
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.bfloat16, attn_implementation="sdpa")
    return model


def build_lora_model(shape: str, seed: int = 0, b_std: float = 0.01):
    """The base model wrapped with the trainer's LoRA config (r=64, alpha=128, all projections,
    no dropout), adapters in peft's default dtype (float32), as `opsd_train` + TRL build it.

    lora_B is drawn N(0, b_std) instead of peft's zeros, so the student differs from the
    teacher and every adapter matrix gets a gradient (a zero B gives A no gradient)."""
    from peft import get_peft_model

    import opsd_train
    from opsd.model_utils import peft_wrapping

    args = opsd_train.ScriptArguments(lora_r=LORA_R, lora_alpha=LORA_ALPHA)
    with peft_wrapping():
        model = get_peft_model(build_base_model(shape, seed), opsd_train.lora_config(args))
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std)
    return model


def set_checkpointing(model, every_n_layers: int) -> None:
    """Activation checkpointing as the Trainer applies it (0 = off)."""
    on = every_n_layers > 0
    model_utils.set_checkpointing(model, on, {"use_reentrant": False}, every_n_layers=max(every_n_layers, 1))
    if on:
        model.enable_input_require_grads()


def count_params(model) -> dict[str, int]:
    """Matmul parameter counts of the decoder (base projections), the LM head and LoRA."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = inner.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return {
        "linear": per_layer * cfg.num_hidden_layers,
        "head": cfg.vocab_size * h,
        "lora": lora,
        "layers": cfg.num_hidden_layers,
        "attn_width": q,
    }


def step_flops(params: dict[str, int], batch: int, geo: Geometry) -> float:
    """Model FLOPs of one OPSD micro-batch step: the work both implementations must do.

    F = teacher forward + student forward & backward + LM head on completion positions:
      teacher fwd   2 * P_lin * T_t                + 2 * L * A * S_t^2 * B
      student fwd   2 * (P_lin + P_lora) * T_s     + 2 * L * A * S_s^2 * B
      student bwd   2 * (P_lin + P_lora) * T_s  (input grads; base frozen)
                    + 2 * P_lora * T_s          (LoRA weight grads)
                    + 4 * L * A * S_s^2 * B     (attention backward)
      head          2 * 2 * P_head * N_c (both roles' logits) + 2 * P_head * N_c (d hidden)
    with S = prompt + completion per sequence, T = B * S tokens, N_c = B * completion,
    A = heads * head_dim, L = layers; causal attention counted as half of S^2.
    Re-computation (activation checkpointing, the chunked loss's second logits pass)
    and the naive step's prompt-position logits are not counted: equal FLOPs for both
    steps, so the TFLOP/s ratio is the speed ratio.
    """
    p_lin, p_head, p_lora, layers, width = (params[k] for k in ("linear", "head", "lora", "layers", "attn_width"))
    s_t, s_s, n_c = geo.teacher_prompt + geo.completion, geo.prompt + geo.completion, batch * geo.completion
    t_t, t_s = batch * s_t, batch * s_s
    teacher = 2 * p_lin * t_t + 2 * layers * width * s_t**2 * batch
    student_fwd = 2 * (p_lin + p_lora) * t_s + 2 * layers * width * s_s**2 * batch
    student_bwd = 2 * (p_lin + p_lora) * t_s + 2 * p_lora * t_s + 4 * layers * width * s_s**2 * batch
    head = 6 * p_head * n_c
    return float(teacher + student_fwd + student_bwd + head)


def graph_time_us(calls, repeats: int = 20) -> float:
    """Microseconds per call of `calls` (closures), recorded once in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats / len(calls)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def timed(fn) -> tuple[float, object]:
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> str:
    import transformers

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"transformers {transformers.__version__}"]
    try:
        import peft

        parts.append(f"peft {peft.__version__}")
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        parts.insert(0, f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
    else:
        parts.insert(0, f"CPU ({os.cpu_count()} cores)")
    return ", ".join(parts)


def add_inductor_argument(parser, where: str) -> None:
    """`--inductor KEY=VALUE` (repeatable): torch._inductor.config settings; `inductor_settings` parses them."""
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help=f"set torch._inductor.config KEY (a Python literal) {where}, e.g. combo_kernels=True; "
                        "repeatable")


def inductor_settings(items: list[str]) -> dict:
    """{KEY: value} from `--inductor KEY=VALUE` items (values are Python literals)."""
    import ast

    pairs = (item.partition("=") for item in items)
    return {key: ast.literal_eval(value) for key, _, value in pairs}


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1, default=str))


def finish(results: dict, json_path: str | None, report: str) -> int:
    """Store the report with the numbers, write the JSON, print the report last."""
    results["report"] = report
    write_json(json_path, results)
    print("\n" + report, flush=True)
    return 0
