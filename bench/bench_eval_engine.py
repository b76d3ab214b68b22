"""Evaluation without vLLM: throughput and memory of the paged engine, against
generate() with the dynamic cache, and what they imply for AIME at the frozen settings.

    python bench/bench_eval_engine.py --json OUT.json   # GPU: Qwen3-1.7B shape, 360 rows x 4096 new tokens
    python bench/bench_eval_engine.py --tiny            # CPU smoke run of the same code (about a minute)

The model is a random-init Qwen3-1.7B-shaped model (bf16, sdpa; `common.build_base_model`).
Rows are the evaluation's: `--rows` (default 360 = 30 problems x 12 samples) made of
prompts of random tokens (lengths 100-300), each repeated 12 times, sampled with the
frozen evaluation settings (temperature 1.0, top_p 0.95, no top-k) through
`opsd.rollout.TransformersBackend`'s engines. EOS is made impossible (its id is the
vocabulary size, which no sample can draw), so every row runs to its budget.

- paged: every row at once through `paged_decode.paged_generate` (what
  `TransformersBackend(cache_implementation="paged")` runs), `--paged-rows` rows per
  forward pass (default 64 and 256, one run each), a KV pool of `--paged-cache-gib`
  (default: the engine's, half the GPU's memory). Stopped at the time budget if it has
  not finished: then tokens/s is over the window it ran (all rows' tokens so far,
  partial rows included), labelled "partial". The wall time includes the engine's
  set-up (pool allocation; CUDA graph capture where flash attention is installed).
- dynamic: generate() with the dynamic cache, one batch of `--dynamic-rows` rows
  (default: as many as the paged pool's memory holds at the frozen budget of 38,912 new
  tokens, 4.5 GB of KV per row for Qwen3-1.7B), timed on `--dynamic-new-tokens` only.

On CPU the paged engine's top-p is transformers' full-vocabulary sort (slower than the
other engines' `NucleusFilter`): the smoke run checks the code, not the speeds.

Extrapolation to AIME (clearly an estimate, not a measurement): 360 samples of
`--aime-mean-new-tokens` (default 12,000, an assumption for Qwen3-1.7B in thinking mode)
each. Paged: those tokens at the measured rate. Dynamic: ceil(360 / rows that fit)
batches, each running until its longest row ends, at the measured time per step (a
batch of a dozen samples almost surely holds one that runs to the 38,912 cap; the mean
is an unreachable lower bound). Both are lower bounds: per-token attention work grows
with the context, which the measurement does not reach.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import common
import torch
from bench_rollout import agreement

from opsd.rollout import TransformersBackend
from opsd.rollout import paged_decode as paged_decode
from opsd.sampling import SamplingSettings

PAD_ID = 151643
SAMPLES_PER_PROMPT = 12  # the frozen settings' n_samples
FROZEN_MAX_NEW_TOKENS = 38912  # the frozen settings' budget
AIME_ROWS = 360  # 30 problems x 12 samples


def make_rows(rows: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    """ceil(rows / 12) prompts of random tokens, each repeated 12 times (prompt-major), cut to `rows`."""
    gen = torch.Generator().manual_seed(seed)
    count = math.ceil(rows / SAMPLES_PER_PROMPT)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    prompts = [torch.randint(0, PAD_ID, (n,), generator=gen).tolist() for n in lengths]
    return [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)][:rows]


def run_paged(model, rows, settings, max_rows: int, cache_gib, deadline: float, log) -> dict:
    backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=[model.config.vocab_size],
                                  batch_size=max_rows, cache_implementation="paged", paged_cache_gib=cache_gib)
    result = {"engine": "paged", "rows": len(rows), "max_new_tokens": settings.max_new_tokens, "max_rows": max_rows}
    common.free_memory()
    try:
        with torch.no_grad():
            seconds, run = common.timed(lambda: paged_decode.paged_generate(
                model, rows, settings, backend.generation_config(settings, processors_passed=False), max_rows=max_rows,
                cache_gib=cache_gib, deadline=deadline))
        tokens = sum(len(t) for t in run.tokens)
        finished = sum(run.finished)
        result.update(status="ok" if finished == len(rows) else "partial (time budget)", s=seconds, tokens=tokens,
                      rows_finished=finished, tokens_per_s=tokens / seconds, peak_gib=common.peak_gib(), **run.info)
        log(f"[paged] rows/forward={max_rows} {result['status']}: {tokens:,} tokens in {seconds:.1f}s = "
            f"{result['tokens_per_s']:,.0f} tok/s, {finished}/{len(rows)} rows done, "
            f"peak {result['peak_gib']:.1f} GiB, pool {run.info['cache_tokens']:,} tokens "
            f"({run.info['cache_gib']:.1f} GiB), attention {run.info['attn_implementation']}")
    except Exception as exc:  # noqa: BLE001 - report and go on
        result["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        log(f"[paged] rows/forward={max_rows} FAILED {result['status']}")
    finally:
        common.free_memory()
    return result


def run_dynamic(model, rows, settings, log) -> dict:
    backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=[model.config.vocab_size],
                                  batch_size=len(rows), cache_implementation="dynamic")
    result = {"engine": "dynamic", "rows": len(rows), "max_new_tokens": settings.max_new_tokens}
    common.free_memory()
    try:
        seconds, samples = common.timed(lambda: backend.generate(rows, settings))
        tokens = sum(len(s[0].ids) for s in samples)
        result.update(status="ok", s=seconds, tokens=tokens, tokens_per_s=tokens / seconds,
                      s_per_step=seconds / settings.max_new_tokens, peak_gib=common.peak_gib())
        log(f"[dynamic] {len(rows)} rows x {settings.max_new_tokens}: {tokens:,} tokens in {seconds:.1f}s = "
            f"{result['tokens_per_s']:,.0f} tok/s, {1000 * result['s_per_step']:.1f} ms/step, "
            f"peak {result['peak_gib']:.1f} GiB")
    except Exception as exc:  # noqa: BLE001
        result["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        log(f"[dynamic] FAILED {result['status']}")
    finally:
        common.free_memory()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model on CPU, small sizes")
    parser.add_argument("--rows", type=int, default=None, help=f"rows = prompts x 12 samples (default {AIME_ROWS}; "
                                                               "tiny: 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="paged: new tokens per row (default 4096; "
                                                                     "tiny: 32)")
    parser.add_argument("--paged-rows", default=None,
                        help="paged: rows per forward pass, comma-separated to compare several, each run gets an "
                             f"equal share of the time left (default {paged_decode.DEFAULT_MAX_ROWS},256; tiny: 8)")
    parser.add_argument("--paged-cache-gib", type=float, default=None,
                        help="paged: KV pool in GiB (default: the engine's, half the GPU's total memory)")
    parser.add_argument("--dynamic-rows", type=int, default=None,
                        help="dynamic: rows of its one batch (default: what the paged pool's memory holds at "
                             f"{FROZEN_MAX_NEW_TOKENS} new tokens; tiny: 8)")
    parser.add_argument("--dynamic-new-tokens", type=int, default=None, help="dynamic: new tokens timed "
                                                                             "(default 256; tiny: 16)")
    parser.add_argument("--engines", default="dynamic,paged", help="comma-separated: dynamic, paged")
    parser.add_argument("--aime-mean-new-tokens", type=int, default=12000,
                        help="the mean sample length assumed for the AIME extrapolation")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds after the model is built: the paged run is stopped there "
                             "(default 300; tiny: 120)")
    parser.add_argument("--skip-checks", action="store_true", help="no greedy paged-vs-dynamic check first")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    tiny = opts.tiny or not torch.cuda.is_available()
    shape = "tiny" if tiny else "qwen3-1.7b"
    rows_count = opts.rows or (24 if tiny else AIME_ROWS)
    new_tokens = opts.new_tokens or (32 if tiny else 4096)
    paged_rows = opts.paged_rows or ("8" if tiny else f"{paged_decode.DEFAULT_MAX_ROWS},256")
    paged_rows = [int(r) for r in paged_rows.split(",")]
    dynamic_tokens = opts.dynamic_new_tokens or (16 if tiny else 256)
    budget_s = opts.budget_s or (120.0 if tiny else 300.0)
    engines = opts.engines.split(",")
    if set(engines) - {"dynamic", "paged"}:
        parser.error(f"unknown engine(s) in --engines {opts.engines!r}: dynamic, paged")

    def log(msg):
        print(msg, flush=True)

    log(f"[bench_eval_engine] shape={shape} machine: {common.machine()}")
    built = time.time()
    model = common.build_base_model(shape).eval()
    start = time.monotonic()
    log(f"[bench_eval_engine] model built in {time.time() - built:.0f}s")
    rows = make_rows(rows_count, 8 if tiny else 100, 24 if tiny else 300)
    settings = SamplingSettings(temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=new_tokens, seed=20260610)
    kv_bytes = paged_decode.kv_bytes_per_token(model)
    pool_gib = opts.paged_cache_gib or paged_decode.default_cache_gib(common.device())
    longest = max(len(r) for r in rows) + FROZEN_MAX_NEW_TOKENS
    fit = max(1, int(pool_gib * 2**30 // (longest * kv_bytes)))
    dynamic_rows = opts.dynamic_rows or (8 if tiny else fit)
    results = {"shape": shape, "machine": common.machine(), "rows": rows_count, "new_tokens": new_tokens,
               "prompt_lengths": sorted({len(r) for r in rows}), "sampling": settings.__dict__,
               "kv_bytes_per_token": kv_bytes, "pool_gib": pool_gib, "rows_fit_at_frozen_budget": fit,
               "aime_mean_new_tokens": opts.aime_mean_new_tokens, "budget_s": budget_s,
               "flash_attn_installed": _flash_attn_installed(), "runs": []}

    if not opts.skip_checks:  # a short greedy run of both engines on the device (bf16: near-ties may differ)
        check_rows = rows[::SAMPLES_PER_PROMPT][:8]
        greedy = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=32, seed=None)
        outs = {}
        for engine in ("dynamic", "paged"):
            backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=[model.config.vocab_size],
                                          batch_size=len(check_rows), cache_implementation=engine)
            outs[engine] = [s[0].ids for s in backend.generate(check_rows, greedy)]
        results["check_greedy_paged_vs_dynamic"] = agreement(outs["paged"], outs["dynamic"])
        log(f"[check] greedy paged vs dynamic generate: {results['check_greedy_paged_vs_dynamic']}")
        common.write_json(opts.json, results)

    if "dynamic" in engines:  # first: short and of known length, the paged run takes what is left
        dynamic_settings = SamplingSettings(**{**settings.__dict__, "max_new_tokens": dynamic_tokens})
        results["runs"].append(run_dynamic(model, rows[:dynamic_rows], dynamic_settings, log))
        common.write_json(opts.json, results)
    if "paged" in engines:
        for i, max_rows in enumerate(paged_rows):
            left = budget_s - (time.monotonic() - start)
            deadline = time.monotonic() + left / (len(paged_rows) - i)  # an equal share of what is left
            results["runs"].append(run_paged(model, rows, settings, max_rows, opts.paged_cache_gib, deadline, log))
            common.write_json(opts.json, results)
    results["extrapolation"] = extrapolate(results)
    results["elapsed_s"] = time.monotonic() - start
    return common.finish(results, opts.json, summarize(results))


def _flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def extrapolate(results) -> list[dict]:
    """Seconds for AIME_ROWS samples of the assumed mean length (see the module docstring)."""
    mean, out = results["aime_mean_new_tokens"], []
    for run in results["runs"]:
        if "tokens_per_s" not in run:
            continue
        if run["engine"] == "paged":
            out.append({"engine": f"paged ({run['max_rows']} rows/forward)",
                        "estimate_s": AIME_ROWS * mean / run["tokens_per_s"],
                        "how": f"{AIME_ROWS} x {mean:,} tokens at {run['tokens_per_s']:,.0f} tok/s"})
        else:
            batches = math.ceil(AIME_ROWS / results["rows_fit_at_frozen_budget"])
            out.append({"engine": f"dynamic ({results['rows_fit_at_frozen_budget']} rows/batch)",
                        "estimate_s": batches * FROZEN_MAX_NEW_TOKENS * run["s_per_step"],
                        "lower_bound_s": batches * mean * run["s_per_step"],
                        "how": f"{batches} batches x {FROZEN_MAX_NEW_TOKENS:,} steps (a row of each batch runs to "
                               f"the cap; {mean:,} steps if none did) at {1000 * run['s_per_step']:.1f} ms/step, "
                               f"measured with {run['rows']} rows"})
    return out


def summarize(results) -> str:
    table = []
    for run in results["runs"]:
        name = run["engine"] + (f", {run['max_rows']} rows/forward" if "max_rows" in run else "")
        shape = f"{run['rows']} x {run['max_new_tokens']}"
        if "tokens_per_s" in run:
            done = f"{run['rows_finished']}/{run['rows']}" if "rows_finished" in run else f"{run['rows']}/{run['rows']}"
            pool = f"{run['cache_tokens']:,} tokens, {run['cache_gib']:.1f} GiB" if "cache_tokens" in run else ""
            table.append([name, shape, run["status"], done, f"{run['s']:.1f}", f"{run['tokens']:,}",
                          f"{run['tokens_per_s']:,.0f}", f"{run['peak_gib']:.1f}", pool,
                          run.get("attn_implementation", "sdpa")])
        else:
            table.append([name, shape, run["status"], "", "", "", "", "", "", ""])
    lines = [f"## Evaluation engines without vLLM, {results['shape']} ({results['machine']})", "",
             common.markdown_table(["engine", "rows x new tokens", "status", "rows done", "wall s", "tokens",
                                    "tokens/s", "peak GiB", "KV pool", "attention"], table), "",
             f"EOS impossible (every row runs to its budget); sampling T 1.0 / top_p 0.95; prompts of "
             f"{min(results['prompt_lengths'])}-{max(results['prompt_lengths'])} random tokens, 12 rows each; "
             f"flash-attn installed: {results['flash_attn_installed']}. A partial run was stopped at the time "
             f"budget: its tokens/s is over the window it ran. KV per token {results['kv_bytes_per_token']:,} bytes; "
             f"at the frozen budget ({FROZEN_MAX_NEW_TOKENS:,} new tokens) the paged pool's memory "
             f"({results['pool_gib']:.1f} GiB) holds {results['rows_fit_at_frozen_budget']} whole rows: the dynamic "
             f"cache's batch.", ""]
    if results["extrapolation"]:
        lines += [f"Extrapolated (not measured) to AIME at the frozen settings: {AIME_ROWS} samples, mean "
                  f"{results['aime_mean_new_tokens']:,} new tokens assumed; lower bounds (attention grows with "
                  f"context beyond what was measured):", ""]
        lines += [f"- {e['engine']}: {e['estimate_s'] / 3600:.2f} h ({e['how']})" for e in results["extrapolation"]]
    if "check_greedy_paged_vs_dynamic" in results:
        lines += ["", f"check greedy paged vs dynamic generate: {results['check_greedy_paged_vs_dynamic']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
