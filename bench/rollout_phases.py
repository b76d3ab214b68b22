"""Where one rollout call's time goes: the merged copy's refresh, the prefill, the decode loop.

    python bench/rollout_phases.py                 # GPU: Qwen3-1.7B shape, 32 prompts x 1024 and x 4 new tokens
    python bench/rollout_phases.py --shape tiny    # CPU smoke run of the same code

The model, prompts and sampling are bench_rollout.py's (the trainer's LoRA model, the
trainer's engine on CUDA, `graph_compiled` with the merged copy (on a CPU the same loop
runs uncompiled), recipe sampling). Each phase is timed with the
device synchronised before and after it, so the phases add up to the call:
- `refresh`: `StaticDecoder.network` (the merged copy rebuilt from base + LoRA);
- `prefill`: the one forward over the prompts (packed without padding);
- `decode`: the rest of `_DecodeState.run` (the decode loop, EOS checks, the copy to the host);
- `call`: `TransformersBackend.generate` as the trainer calls it.
The first call of each length (compilation, graph recording) is not reported.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import common
import torch
from bench_rollout import EOS_IDS, PAD_ID, bench_prompts, recipe_sampling, trainer_model

from opsd.model_utils import causal_lm
from opsd.rollout import TransformersBackend
from opsd.rollout import static_decode as static_decode

PHASES = (("refresh", static_decode.StaticDecoder, "network"), ("prefill", static_decode._DecodeState, "prefill"),
          ("run", static_decode._DecodeState, "run"), ("call", TransformersBackend, "generate"))


def timed_phases(totals: dict):
    """Wrap the PHASES' methods so that each call adds its synchronised wall time to `totals`;
    returns a function that puts the originals back."""
    originals = []
    for phase, owner, name in PHASES:
        method = owner.__dict__[name]

        def wrapper(*args, _method=method, _phase=phase, **kwargs):
            common.sync()
            begin = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                common.sync()
                totals[_phase] += time.perf_counter() - begin

        originals.append((owner, name, method))
        setattr(owner, name, wrapper)

    def restore():
        for owner, name, method in originals:
            setattr(owner, name, method)

    return restore


def host_profile(backend, rows, settings, top: int) -> str:
    """One call under cProfile (the device synchronised at its end): its `top` functions by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    backend.generate(rows, settings)
    common.sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="qwen3-1.7b (default on a GPU) or tiny (default on a CPU)")
    parser.add_argument("--new-tokens", default=None, help="comma-separated lengths (default 1024,4; tiny: 16,4)")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per length, after the first")
    parser.add_argument("--eager-prefill", action="store_true",
                        help="the prefill's decoder layers not compiled (static_decode.COMPILE_PREFILL off)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="one more call per length under cProfile (device synchronised after it): print its N "
                        "functions of most own time")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    static_decode.COMPILE_PREFILL = not opts.eager_prefill
    shape = opts.shape or ("qwen3-1.7b" if torch.cuda.is_available() else "tiny")
    tiny = shape == "tiny"
    lengths = [int(x) for x in (opts.new_tokens or ("16,4" if tiny else "1024,4")).split(",")]
    model = trainer_model(shape)
    rows = bench_prompts(32, tiny)
    results = {"shape": shape, "machine": common.machine(), "prompts": len(rows), "calls": [],
               "compiled_prefill": static_decode.COMPILE_PREFILL and torch.cuda.is_available()}
    totals: dict = collections.defaultdict(float)
    restore = timed_phases(totals)
    try:
        for new_tokens in lengths:
            settings = recipe_sampling(new_tokens)
            backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=EOS_IDS, batch_size=len(rows),
                                          cache_implementation="graph_compiled", merge_lora=True)
            backend.generate(rows, settings)  # compiles and records
            for _ in range(opts.calls):
                totals.clear()
                backend.generate(rows, settings)
                ms = {phase: round(totals[phase] * 1000, 1) for phase, _, _ in PHASES}
                row = {"new_tokens": new_tokens, "refresh_ms": ms["refresh"], "prefill_ms": ms["prefill"],
                       "decode_ms": round(ms["run"] - ms["prefill"], 1), "call_ms": ms["call"]}
                results["calls"].append(row)
                print("[phases] " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            if opts.cprofile:
                print(f"[cprofile] {new_tokens} new tokens:\n" + host_profile(backend, rows, settings, opts.cprofile),
                      flush=True)
            decoder = static_decode.StaticDecoder._instances.get(causal_lm(model))
            if decoder is not None:
                decoder.release()
            common.free_memory()
    finally:
        restore()
    table = [[r["new_tokens"], r["refresh_ms"], r["prefill_ms"], r["decode_ms"], r["call_ms"]]
             for r in results["calls"]]
    prefill = "compiled" if results["compiled_prefill"] else "eager"
    report = (f"## One rollout call's phases, {shape}, {len(rows)} prompts, {prefill} prefill "
              f"({results['machine']})\n\n"
              + common.markdown_table(["new tokens", "refresh (ms)", "prefill (ms)", "decode (ms)", "call (ms)"],
                                      table))
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    sys.exit(main())
