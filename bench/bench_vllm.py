"""vLLM's sampling throughput at a model shape, as the trainer's rollouts and the evaluation use it.

    python bench/bench_vllm.py --shape qwen3-8b --json $OUT/vllm.json   # rollouts: 32 x 1024, recipe sampling
    python bench/bench_vllm.py --mode eval --json $OUT/vllm_eval.json    # the evaluation: 360 x 4096, then AIME
    python bench/bench_vllm.py --dry-run --shape qwen3-4b                # CPU: writes and checks the model folder

The model folder holds the shape's config (`common.SHAPES`, the same as the own engine's
benchmarks) and the project's Qwen3 tokenizer; vLLM draws the weights itself
(`load_format="dummy"`), so no 16 GB checkpoint is written for the 8B shape. Every row runs
to its budget (`ignore_eos`), as a random model's rows do in the own engine's benchmarks.

- `--mode rollout` (default): `bench_rollout.bench_prompts(32)` (150-300 random tokens) x
  1024 new tokens with the recipe's sampling (T 1.1, top-p 0.95, top-k 20), vLLM's share of
  the GPU as TRL's colocate mode takes it (`vllm_gpu_memory_utilization` 0.3): the figure to
  hold against the own engine's `bench_rollout.py` at the same shape.
- `--mode eval`: `bench_eval_engine.make_rows(360)` (30 prompts of 100-300 tokens x 12) x
  4096 new tokens with the frozen evaluation sampling (T 1.0, top-p 0.95), the engine as
  `dev_eval.sh`'s vLLM backend builds it (`opsd.rollout.VLLMBackend`'s GPU share). Then the same
  extrapolation to AIME avg@12 as `bench_eval_engine.py`: 360 samples of
  `--aime-mean-new-tokens` (default 12,000: an assumption, not a measurement) at the measured
  rate, a lower bound (attention grows with the context beyond what was measured, and rows
  longer than the KV cache holds at once queue).

Timed: `LLM(...)` start-up (weights, compilation, CUDA graphs), then each `generate` call after
one short warm-up call; tokens/s = sampled tokens / the call's wall time.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import common

ROLLOUT_GPU_SHARE = 0.3  # TRL's vllm_gpu_memory_utilization default (colocate)
AIME_ROWS = 360  # 30 problems x 12 samples


def write_model_folder(folder: Path, shape: str) -> Path:
    """config.json (bf16) + generation_config.json + the project's Qwen3 tokenizer: all vLLM reads
    when it draws the weights itself."""
    from opsd import tiny_default
    config = common.qwen3_config(shape)
    config.dtype = "bfloat16"  # what vLLM loads the model in
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(folder)
    tiny_default.build_qwen3_tokenizer().save_pretrained(folder)
    return folder


def mode_settings(mode: str, new_tokens: int | None) -> dict:
    """The rows, sampling and GPU share of a mode (see the module docstring)."""
    if mode == "rollout":
        from bench_rollout import bench_prompts

        return {"rows": bench_prompts(32, tiny=False), "temperature": 1.1, "top_p": 0.95, "top_k": 20,
                "new_tokens": new_tokens or 1024, "gpu_memory_utilization": ROLLOUT_GPU_SHARE, "repeats": 2}
    from bench_eval_engine import make_rows

    from opsd.rollout import VLLMBackend

    share = inspect.signature(VLLMBackend.__init__).parameters["gpu_memory_utilization"].default
    return {"rows": make_rows(AIME_ROWS, 100, 300), "temperature": 1.0, "top_p": 0.95, "top_k": 0,
            "new_tokens": new_tokens or 4096, "gpu_memory_utilization": share, "repeats": 1}


def run(folder: Path, settings: dict, log) -> dict:
    from opsd.rollout import vllm_environment

    vllm_environment()  # the sampler without flashinfer where it is missing, as the project runs vLLM
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rows = settings["rows"]
    longest = max(len(r) for r in rows) + settings["new_tokens"]
    started = time.time()
    llm = vllm.LLM(model=str(folder), tokenizer=str(folder), load_format="dummy", dtype="bfloat16", seed=0,
                   max_model_len=longest, gpu_memory_utilization=settings["gpu_memory_utilization"])
    startup_s = time.time() - started
    log(f"[vllm] engine started in {startup_s:.0f} s")

    def params(count: int, tokens: int):
        return [SamplingParams(seed=index, temperature=settings["temperature"], top_p=settings["top_p"],
                               top_k=settings["top_k"] if settings["top_k"] > 0 else -1, max_tokens=tokens,
                               ignore_eos=True) for index in range(count)]

    prompts = [TokensPrompt(prompt_token_ids=list(r)) for r in rows]
    llm.generate(prompts[:2], params(2, 16), use_tqdm=False)  # warm-up
    calls = []
    for _ in range(settings["repeats"]):
        common.sync()
        begin = time.time()
        outputs = llm.generate(prompts, params(len(prompts), settings["new_tokens"]), use_tqdm=False)
        seconds = time.time() - begin
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        calls.append({"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
        log(f"[vllm] {len(rows)} x {settings['new_tokens']}: {tokens:,} tokens in {seconds:.2f} s = "
            f"{tokens / seconds:,.0f} tok/s")
    import torch

    return {"startup_s": startup_s, "calls": calls,
            "tokens_per_s": common.median([c["tokens_per_s"] for c in calls]),
            "torch_peak_gib_this_process": torch.cuda.max_memory_allocated() / 2**30,
            "vllm": vllm.__version__}


def summarize(results: dict) -> str:
    lines = [f"## vLLM {results.get('vllm', '?')} sampling, {results['shape']}, mode {results['mode']} "
             f"({results['machine']})", "",
             f"- rows x new tokens: {results['rows']} x {results['new_tokens']}; sampling T {results['temperature']}, "
             f"top-p {results['top_p']}, top-k {results['top_k'] or 'off'}; GPU share "
             f"{results['gpu_memory_utilization']}",
             f"- engine start-up: {results['startup_s']:.0f} s",
             f"- tokens/s (median of {len(results['calls'])} call(s)): **{results['tokens_per_s']:,.0f}**; calls "
             + ", ".join(f"{c['s']:.2f} s" for c in results["calls"])]
    if "aime_estimate_s" in results:
        lines.append(f"- extrapolated (not measured) AIME avg@12: {AIME_ROWS} x {results['aime_mean_new_tokens']:,} "
                     f"tokens at that rate = {results['aime_estimate_s'] / 60:.1f} min (a lower bound)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(common.SHAPES), default="qwen3-1.7b")
    parser.add_argument("--mode", choices=("rollout", "eval"), default="rollout")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 1024 (rollout), 4096 (eval)")
    parser.add_argument("--aime-mean-new-tokens", type=int, default=12000,
                        help="eval: the mean sample length assumed for the AIME extrapolation")
    parser.add_argument("--dry-run", action="store_true", help="write the model folder and the rows, start no engine")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)

    settings = mode_settings(opts.mode, opts.new_tokens)
    results = {"shape": opts.shape, "mode": opts.mode, "machine": common.machine(), "rows": len(settings["rows"]),
               **{k: v for k, v in settings.items() if k not in ("rows", "repeats")}}
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        folder = write_model_folder(Path(tmp), opts.shape)
        if opts.dry_run:
            config = json.loads((folder / "config.json").read_text())
            print(f"[vllm] dry run: {folder} holds {sorted(p.name for p in folder.iterdir())}; "
                  f"hidden {config['hidden_size']}, {config['num_hidden_layers']} layers; {len(settings['rows'])} rows")
            return 0
        results.update(run(folder, settings, lambda msg: print(msg, flush=True)))
    if opts.mode == "eval":
        results["aime_mean_new_tokens"] = opts.aime_mean_new_tokens
        results["aime_estimate_s"] = AIME_ROWS * opts.aime_mean_new_tokens / results["tokens_per_s"]
    return common.finish(results, opts.json, summarize(results))


if __name__ == "__main__":
    sys.exit(main())
