"""bench/bench_vllm.py on CPU: the model folder it hands vLLM (the shape's config and the project's
tokenizer), each mode's rows and sampling, and the timing loop against a fake vLLM that records
what it was asked for and returns rows of the asked length."""
import inspect
import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_vllm  # noqa: E402
import common  # noqa: E402


@pytest.mark.parametrize("shape", tuple(common.SHAPES))
def test_the_model_folder_is_the_shape_in_bf16_with_the_tokenizer(shape, tmp_path):
    folder = bench_vllm.write_model_folder(tmp_path, shape)
    config = json.loads((folder / "config.json").read_text())
    hidden, intermediate, layers, heads, tied = common.SHAPES[shape]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["tie_word_embeddings"], config["vocab_size"]) == (hidden, intermediate, layers, heads, 8, 128,
                                                                    tied, 151936)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer("1 + 1 = 2")["input_ids"]) == "1 + 1 = 2"
    assert not any(p.suffix == ".safetensors" for p in folder.iterdir())  # vLLM draws the weights


def test_the_modes_are_the_recipes_rollouts_and_the_frozen_evaluation():
    from opsd.rollout import VLLMBackend

    rollout = bench_vllm.mode_settings("rollout", None)
    assert len(rollout["rows"]) == 32 and rollout["new_tokens"] == 1024
    assert (rollout["temperature"], rollout["top_p"], rollout["top_k"]) == (1.1, 0.95, 20)
    assert rollout["gpu_memory_utilization"] == 0.3
    evaluation = bench_vllm.mode_settings("eval", 512)
    assert len(evaluation["rows"]) == bench_vllm.AIME_ROWS == 360 and evaluation["new_tokens"] == 512
    assert (evaluation["temperature"], evaluation["top_p"], evaluation["top_k"]) == (1.0, 0.95, 0)
    assert all(100 <= len(row) <= 300 for row in evaluation["rows"])
    # the share dev_eval.sh's vLLM backend takes, read from it
    share = inspect.signature(VLLMBackend.__init__).parameters["gpu_memory_utilization"].default
    assert evaluation["gpu_memory_utilization"] == share and 0 < share < 1


def fake_vllm(calls: list):
    """A module with LLM / SamplingParams / TokensPrompt: generate returns, per row,
    max_tokens token ids."""
    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("LLM", kwargs))

        def generate(self, prompts, params, use_tqdm=True):
            calls.append(("generate", len(prompts), params))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * p.max_tokens)])
                    for p in params]

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = LLM, SamplingParams, "0.0-fake"
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    module.inputs = inputs
    return module, inputs


def test_the_timing_loop_asks_vllm_for_the_modes_sampling(monkeypatch, tmp_path, capsys):
    calls = []
    module, inputs = fake_vllm(calls)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    from opsd import rollout
    monkeypatch.setattr(rollout, "vllm_environment", lambda: {})
    monkeypatch.setattr(bench_vllm, "write_model_folder", lambda folder, shape: folder)
    out = tmp_path / "vllm.json"
    assert bench_vllm.main(["--mode", "eval", "--new-tokens", "64", "--aime-mean-new-tokens", "1000",
                            "--json", str(out)]) == 0
    engine = calls[0][1]
    assert engine["load_format"] == "dummy" and engine["dtype"] == "bfloat16"
    assert engine["max_model_len"] == max(map(len, bench_vllm.mode_settings("eval", 64)["rows"])) + 64
    warmup, timed = calls[1], calls[2]
    assert warmup[1] == 2 and timed[1] == 360 and len(calls) == 3  # eval: one timed call
    params = timed[2]
    assert {p.max_tokens for p in params} == {64} and all(p.ignore_eos for p in params)
    assert {(p.temperature, p.top_p, p.top_k) for p in params} == {(1.0, 0.95, -1)}  # top-k off
    assert len({p.seed for p in params}) == 360  # one seed a row: the 12 samples of a prompt differ
    results = json.loads(out.read_text())
    call = results["calls"][0]
    assert call["tokens"] == 360 * 64 and results["tokens_per_s"] == pytest.approx(call["tokens"] / call["s"])
    assert results["aime_estimate_s"] == pytest.approx(360 * 1000 / results["tokens_per_s"])
    assert "extrapolated (not measured)" in capsys.readouterr().out


def test_the_dry_run_starts_no_engine(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would fail
    assert bench_vllm.main(["--dry-run", "--shape", "qwen3-8b"]) == 0
    assert "hidden 4096, 36 layers; 32 rows" in capsys.readouterr().out
