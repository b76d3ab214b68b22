"""Rollout throughput of the transformers backend configurations, LoRA (peft) model.

    python bench/bench_rollout.py                 # GPU: Qwen3-1.7B shape, 32 prompts x 1024 new tokens
    python bench/bench_rollout.py --shape tiny    # CPU smoke run of the same code

The model is the trainer's: a peft LoRA (r=64, alpha=128, all projections) on the
random-init base, sampled exactly as `OPSDTrainer._sample` does it
(`opsd.rollout.TransformersBackend`, eval mode, no_grad, the recipe's temperature 1.1 /
top_p 0.95 / top_k 20, one batch of all prompts). Prompt lengths vary (left
padding is exercised). Per configuration: the first call (compile / graph
recording included) and the median of the timed calls, in generated tokens per
second (tokens up to and including EOS; a random model rarely samples it).

Checks: greedy completions of the graph loop against transformers' static-cache
generate (same numerics family) and the dynamic cache; the base weights (the fixed
teacher) bit-identical after all rollouts; a rollout with the adapter disabled.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time

import common
import torch

from opsd.model_utils import causal_lm
from opsd.rollout import TransformersBackend
from opsd.rollout import static_decode as static_decode
from opsd.rollout.kernels import attention as decode_attention
from opsd.rollout.kernels import matmul as decode_matmul
from opsd.rollout.kernels import qkv as decode_qkv
from opsd.rollout.kernels import sampler as decode_sampler
from opsd.rollout.static_decode import DECODE_ATTENTION, StaticDecoder
from opsd.sampling import SamplingSettings

# configuration suffixes besides attn=NAME, qkv=NAME, topk=N
FLAGS = ("merged", "fullkv", "unfused", "autotune", "torchmm", "torchgate", "nospan", "separateqkv", "eagerprefill")

PAD_ID, EOS_IDS = 151643, [151645, 151643]


def prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, PAD_ID, (n,), generator=gen).tolist() for n in lengths]


def bench_prompts(count: int, tiny: bool) -> list[list[int]]:
    """The benchmark's prompts: 150-300 tokens (tiny: 8-24), so left padding is exercised."""
    return prompts(count, 8 if tiny else 150, 24 if tiny else 300)


def recipe_sampling(max_new_tokens: int, seed: int = 7) -> SamplingSettings:
    """The recipe's sampling (temperature 1.1, top-p 0.95, top-k 20), seeded."""
    return SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=max_new_tokens, seed=seed)


def trainer_model(shape: str):
    """The LoRA model as the trainer holds it between rollouts: train mode (the engine
    switches it to eval and back when it samples from it rather than from the merged copy),
    activation checkpointing on (but on the tiny shape)."""
    model = common.build_lora_model(shape)
    model.train()
    if shape != "tiny":
        common.set_checkpointing(model, 1)
    return model


def base_fingerprint(model) -> str:
    """sha256 over every non-adapter parameter's bytes: the teacher's weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if "lora_" not in name:
            digest.update(name.encode())
            digest.update(param.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
                          if param.dtype != torch.bfloat16
                          else param.detach().contiguous().view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def run_config(model, name: str, impl, rows, settings, repeats: int, log, merge_lora: bool = False,
               profile_steps: int = 0) -> dict:
    backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=EOS_IDS, batch_size=len(rows),
                                  cache_implementation=impl, merge_lora=merge_lora)
    common.free_memory()
    result = {"config": name, "cache_implementation": impl, "prompts": len(rows),
              "max_new_tokens": settings.max_new_tokens}
    try:
        first, samples = common.timed(lambda: backend.generate(rows, settings))
        times, tokens = [], []
        for _i in range(repeats):
            t, samples = common.timed(lambda: backend.generate(rows, settings))
            times.append(t)
            tokens.append(sum(len(s[0].ids) for s in samples))
        med = common.median(times)
        result.update(status="ok", first_call_s=first, times=times, s=med,
                      tokens=tokens[times.index(min(times, key=lambda x: abs(x - med)))],
                      peak_gib=common.peak_gib())
        result["tokens_per_s"] = result["tokens"] / med
        state = decoder_state(model) if impl in ("graph", "graph_compiled") else None
        completions = [s[0].ids for s in samples]
        if state is not None:
            decoder = StaticDecoder._instances[causal_lm(model)]
            result.update(graph_recorded=state.graphs is not None, graph_error=state.graph_error,
                          merged=decoder.merged is not None, merge_error=decoder.merge_error)
            engine_logprobs = decoder.sampled_logprobs(len(rows))
            result["logprob_vs_trainer_forward"] = logprob_agreement(model, rows, completions, engine_logprobs)
            # configurations that must not change the arithmetic can be checked bit for bit
            result["samples_sha256"] = hashlib.sha256(repr(completions).encode()).hexdigest()[:16]
            result["engine_logprobs_sha256"] = hashlib.sha256(
                engine_logprobs.cpu().numpy().tobytes()).hexdigest()[:16]
            if profile_steps:
                result["decode_step_profile"] = profile_decode_step(state, profile_steps, log)
        result["sampled_in_reference_top20"] = reference_consistency(model, rows, completions, k=20)
        log(f"[rollout] {name:22s} first={first:.1f}s timed={[f'{t:.2f}' for t in times]} "
            f"tokens={result['tokens']} tok/s={result['tokens_per_s']:,.0f} peak={result['peak_gib']:.1f}GiB "
            f"graph={result.get('graph_recorded')} top20={result['sampled_in_reference_top20']['in_top_k']:.4f} "
            f"samples={result.get('samples_sha256')} logprobs={result.get('engine_logprobs_sha256')}")
    except Exception as exc:  # noqa: BLE001 - report and go on with the next configuration
        result.update(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        log(f"[rollout] {name:22s} FAILED {result['status']}")
        import traceback

        traceback.print_exc()
    finally:
        decoder = StaticDecoder._instances.get(causal_lm(model))
        if decoder is not None:
            decoder.release()
        common.free_memory()
    return result


@torch.no_grad()
def logprob_agreement(model, rows, completions, engine_logprobs, chunk: int = 8) -> dict:
    """|log p_engine - log p_trainer| over the sampled tokens: the engine's own log-probability
    of each token it sampled (KV cache, merged or unmerged adapters) against one plain full
    forward of the peft student over prompt + completion, as the trainer scores it (bf16)."""
    was_training = model.training
    model.eval()
    diffs = []
    dev = next(model.parameters()).device
    try:
        for start in range(0, len(rows), chunk):
            pairs = [(i, rows[i], completions[i]) for i in range(start, min(start + chunk, len(rows)))
                     if completions[i]]
            width = max(len(p) + len(c) for _, p, c in pairs)
            ids = torch.full((len(pairs), width), PAD_ID, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (_, p, c) in enumerate(pairs):
                ids[j, width - len(p) - len(c):] = torch.tensor(p + c)
                mask[j, width - len(p) - len(c):] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            for j, (i, _p, c) in enumerate(pairs):
                pred = logits[j, width - len(c) - 1:width - 1].float().log_softmax(-1)
                trainer = pred.gather(-1, torch.tensor(c, device=dev)[:, None]).squeeze(-1)
                diffs.append((engine_logprobs[i, :len(c)].float() - trainer).abs())
    finally:
        model.train(was_training)
    d = torch.cat(diffs)
    return {"tokens": d.numel(), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "p99_abs": float(d.float().quantile(0.99)) if d.numel() < 2 ** 24 else None}


def profile_decode_step(state, steps: int, log) -> dict:
    """CUDA time per kernel class for `steps` decode steps run without the recorded graph
    (the same step function the graph replays; compiled when the engine compiles), in the
    middle KV window of the rollout, as its recorded graph reads the cache."""
    from torch.profiler import ProfilerActivity, profile

    from opsd.rollout.static_decode import _static_attention, attention_limit

    middle = len(state.limits) // 2
    limit = state.limits[middle]
    first = state.limits[middle - 1] if middle else state.width

    def rewind():
        """To the window's first step, its columns from the fed token's on not written yet."""
        state.slot.fill_(first)
        state.column.fill_(first - state.width + 1)
        state.valid[:, first:] = False

    rewind()
    network, was_training = state.model, state.model.training
    network.eval()  # as inside a rollout: no grad, eval mode, the decode attention routed
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with (torch.random.fork_rng(devices=[0] if cuda else []), torch.no_grad(), _static_attention(network),
          attention_limit(limit)):
        for _ in range(2):
            state._draw_noise()
            state._step()
        sync()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                state._draw_noise()
                state._step()
            sync()
        replay_ms = None
        if cuda and state.graphs is not None:  # the recorded step's wall time, gaps between kernels included
            rewind()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            replays = min(32, limit - first - 1)
            begin.record()
            for _ in range(replays):
                state._draw_noise()
                state.graphs[middle].replay()
            end.record()
            sync()
            replay_ms = begin.elapsed_time(end) / replays
    network.train(was_training)
    kind = "CUDA" if cuda else "CPU"

    def self_us(e):
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    events = [e for e in prof.key_averages() if e.device_type.name == kind and self_us(e) > 0]
    total_us = sum(self_us(e) for e in events)
    top = sorted(events, key=lambda e: -self_us(e))[:25]
    table = [{"kernel": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": self_us(e) / steps,
              "share": self_us(e) / max(total_us, 1)} for e in top]
    log(f"[profile] device time per decode step {total_us / steps / 1000:.3f} ms, kernels per step "
        f"{sum(e.count for e in events) / steps:.0f}, attention over cache columns [0, {limit}); recorded "
        f"step replayed: {replay_ms if replay_ms is None else round(replay_ms, 3)} ms wall")
    for row in table:
        log(f"[profile]   {row['us_per_step']:8.1f} us {row['share']:6.1%} x{row['calls_per_step']:.0f} "
            f"{row['kernel']}")
    # The kernels of the first profiled step in launch order: which small kernels a layer runs
    # between its matrix products (the start covers the embedding and the first two layers).
    # (CUDA only: on a CPU the profiler's operator events nest, so they are no kernel sequence.)
    sequence = []
    if cuda:
        ordered = sorted((e for e in prof.events() if e.device_type.name == kind), key=lambda e: e.time_range.start)
        per_step = round(sum(e.count for e in events) / steps)
        sequence = [(e.name[:90], e.time_range.elapsed_us()) for e in ordered[:per_step]]
        shown = sequence if len(sequence) <= 54 else sequence[:40] + [("...", 0.0)] + sequence[-14:]
        for name, us in shown:
            log(f"[profile]   seq {us:7.1f} us {name}")
    return {"device_ms_per_step": total_us / steps / 1000, "replay_ms_per_step": replay_ms,
            "attention_columns": limit,
            "kernels_per_step": sum(e.count for e in events) / steps, "top": table, "sequence": sequence}


def decoder_state(model):
    from opsd.model_utils import causal_lm

    decoder = StaticDecoder._instances.get(causal_lm(model))
    return None if decoder is None else decoder.state


@torch.no_grad()
def reference_consistency(model, rows, completions, k: int, chunk: int = 8) -> dict:
    """Re-score prompt + completion with one plain full forward (no cache, sdpa, adapter
    as currently set) and count the sampled tokens that lie in that forward's top-k
    at their position (k=1: greedy argmax agreement; also the largest logit gap).
    Wrong cache slots, masks or rotary positions would put ~0% there."""
    was_training = model.training
    model.eval()
    inside, total, worst_gap = 0, 0, 0.0
    dev = next(model.parameters()).device
    try:
        for start in range(0, len(rows), chunk):
            pairs = [(p, c) for p, c in zip(rows[start:start + chunk], completions[start:start + chunk], strict=True)
                     if c]
            if not pairs:
                continue
            width = max(len(p) + len(c) for p, c in pairs)
            ids = torch.full((len(pairs), width), PAD_ID, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, c) in enumerate(pairs):  # left padding, contiguous prompt -> completion
                seq = p + c
                ids[i, width - len(seq):] = torch.tensor(seq)
                mask[i, width - len(seq):] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            for i, (_p, c) in enumerate(pairs):
                n = len(c)
                pred = logits[i, width - n - 1:width - 1].float()  # positions predicting each completion token
                target = torch.tensor(c, device=dev)
                chosen = pred.gather(-1, target[:, None]).squeeze(-1)
                kth = pred.topk(k, dim=-1).values[:, -1]
                inside += int((chosen >= kth).sum())
                total += n
                worst_gap = max(worst_gap, float((pred.max(-1).values - chosen).max()) if k == 1 else 0.0)
    finally:
        model.train(was_training)
    result = {"k": k, "tokens": total, "in_top_k": inside / max(total, 1)}
    if k == 1:
        result["max_logit_gap"] = worst_gap
    return result


def agreement(a, b) -> dict:
    """Share of rows identical, and mean length of the common prefix."""
    same = sum(x == y for x, y in zip(a, b, strict=False))
    prefix = []
    for x, y in zip(a, b, strict=False):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"identical_rows": same, "rows": len(a), "mean_common_prefix": sum(prefix) / len(prefix)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=common.SHAPE_CHOICES, default=None,
                        help="default: qwen3-1.7b on CUDA, tiny otherwise")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 1024 (tiny: 32)")
    parser.add_argument("--dynamic-new-tokens", type=int, default=None,
                        help="the slow dynamic-cache baseline is timed on fewer new tokens (default 256; tiny: 32)")
    parser.add_argument("--configs", default="graph,dynamic,static,graph_compiled",
                        help="comma-separated engines; suffixes: '+merged' samples from the merged LoRA copy, "
                        "'+fullkv' attends over the whole preallocated cache (no KV windows), '+unfused' keeps the "
                        "merged copy's q/k/v and gate/up products separate, '+autotune' compiles the step with "
                        "max-autotune-no-cudagraphs, '+torchmm' runs the merged copy's products through torch "
                        "(cuBLAS) instead of decode_matmul's split-K and gated kernels, '+torchgate' the gate/up "
                        "product through torch and then its SiLU gating (decode_matmul.GATED_IMPLEMENTATION torch), "
                        "'+qkv=NAME' the q/k norms, rotary and cache writes (decode_qkv.IMPLEMENTATIONS), "
                        "'+topk=N' searches the sampler's top-k in blocks of N logits ('+topk=torch': one torch.topk), "
                        "'+attn=NAME' picks the decode attention kernel "
                        "(decode_attention.IMPLEMENTATIONS), '+nospan' makes split_kv loop over every block of the "
                        "window (SPLIT_SPAN off), '+separateqkv' runs decode_qkv's kernel before split_kv instead of "
                        "inside it (SPLIT_NEW_TOKEN off), '+eagerprefill' runs graph_compiled's prefill without "
                        "compiling its decoder layers (COMPILE_PREFILL off), '+sampler=NAME' draws the "
                        "top-k sample with decode_sampler's NAME (decode_sampler.IMPLEMENTATIONS)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many decode steps (CUDA time per kernel) of each graph engine")
    parser.add_argument("--split-config", default="",
                        help="BLOCK,WARPS,STAGES[,CHUNKS] of the split_kv kernel (decode_attention.SPLIT_*)")
    parser.add_argument("--gated-config", default="",
                        help="BLOCK_N,BLOCK_K,WARPS,STAGES of decode_matmul's gated kernel (GATED_CONFIG)")
    parser.add_argument("--sampler-config", default="",
                        help="DIGIT_BITS,WARPS of decode_sampler's kernel")
    parser.add_argument("--skip-checks", action="store_true", help="no greedy correctness checks first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    shape = "tiny" if opts.tiny else common.default_shape(opts.shape)
    tiny = shape == "tiny"
    new_tokens = opts.new_tokens or (32 if tiny else 1024)
    dynamic_tokens = opts.dynamic_new_tokens or (32 if tiny else 256)
    start = time.time()

    def log(msg):
        print(msg, flush=True)

    log(f"[bench_rollout] shape={shape} machine: {common.machine()}")
    model = trainer_model(shape)
    rows = bench_prompts(opts.prompts, tiny)
    results = {"shape": shape, "machine": common.machine(), "prompts": opts.prompts,
               "prompt_lengths": [len(r) for r in rows], "new_tokens": new_tokens}
    teacher_before = base_fingerprint(model)

    # Correctness on the device first (short greedy runs, no compilation).
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=64 if not tiny else 16, seed=None)
    checks, outs = {}, {}
    for impl in () if opts.skip_checks else ("graph", None):
        backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=EOS_IDS, batch_size=len(rows),
                                      cache_implementation=impl)
        try:
            outs[impl] = [s[0].ids for s in backend.generate(rows, greedy)]
            checks[f"greedy_{impl or 'dynamic'}_argmax_of_plain_forward"] = reference_consistency(
                model, rows, outs[impl], k=1)
        except Exception as exc:  # noqa: BLE001
            checks[f"greedy_{impl or 'dynamic'}"] = f"FAILED {type(exc).__name__}: {exc}"
        state = decoder_state(model)
        if impl == "graph" and state is not None:
            checks["graph_recorded"] = state.graphs is not None
            checks["graph_error"] = state.graph_error
        StaticDecoder.for_model(model).release()
    if "graph" in outs and None in outs:
        checks["greedy_graph_vs_dynamic_generate"] = agreement(outs["graph"], outs[None])
    if not opts.skip_checks:
        with model.disable_adapter():  # reason_first samples with the teacher's weights: a second recorded graph
            backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=EOS_IDS, batch_size=len(rows),
                                          cache_implementation="graph")
            base_graph = [s[0].ids for s in backend.generate(rows, greedy)]
            checks["greedy_graph_adapter_disabled_argmax_of_plain_forward"] = reference_consistency(
                model, rows, base_graph, k=1)
        StaticDecoder.for_model(model).release()
        checks["adapter_changes_samples"] = base_graph != outs.get("graph")
    for key, value in checks.items():
        log(f"[check] {key}: {value}")
    results["checks"] = checks
    common.write_json(opts.json, results)

    if opts.split_config:
        block, warps, stages, *chunks = (int(x) for x in opts.split_config.split(","))
        decode_attention.SPLIT_BLOCK, decode_attention.SPLIT_WARPS, decode_attention.SPLIT_STAGES = block, warps, stages
        decode_attention.SPLIT_CHUNKS = chunks[0] if chunks else None
        results["split_config"] = opts.split_config
    if opts.gated_config:
        block_n, block_k, warps, stages = (int(x) for x in opts.gated_config.split(","))
        decode_matmul.GATED_CONFIG = decode_matmul.GatedConfig(block_n, block_k, warps, stages)
        results["gated_config"] = opts.gated_config
    if opts.sampler_config:
        decode_sampler.DIGIT_BITS, decode_sampler.WARPS = (int(x) for x in opts.sampler_config.split(","))
        results["sampler_config"] = opts.sampler_config
    configs = []
    for name in opts.configs.split(","):
        engine, *options = name.split("+")
        attn = [o.split("=", 1)[1] for o in options if o.startswith("attn=")]
        qkv = [o.split("=", 1)[1] for o in options if o.startswith("qkv=")]
        topk = [o.split("=", 1)[1] for o in options if o.startswith("topk=")]
        sampler = [o.split("=", 1)[1] for o in options if o.startswith("sampler=")]
        unknown = {o for o in options if not o.startswith(("attn=", "qkv=", "topk=", "sampler="))} - set(FLAGS)
        if (unknown or any(a not in decode_attention.IMPLEMENTATIONS for a in attn)
                or any(q not in decode_qkv.IMPLEMENTATIONS for q in qkv)
                or any(n not in decode_sampler.IMPLEMENTATIONS for n in sampler)
                or any(t != "torch" and not (t.isdigit() and int(t) > 0) for t in topk)):
            parser.error(f"unknown configuration option(s) in {name!r} ({', '.join(FLAGS)}, attn=NAME with NAME in "
                         f"{', '.join(decode_attention.IMPLEMENTATIONS)}, qkv=NAME with NAME in "
                         f"{', '.join(decode_qkv.IMPLEMENTATIONS)}, topk=N or topk=torch, sampler=NAME with NAME in "
                         f"{', '.join(decode_sampler.IMPLEMENTATIONS)})")
        impl = None if engine == "dynamic" else engine
        tokens = dynamic_tokens if engine == "dynamic" else new_tokens
        configs.append((name if tokens == new_tokens else f"{name} ({tokens} new)", impl, tokens,
                        "merged" in options, set(options), attn[-1] if attn else DECODE_ATTENTION))
    timings = []
    for name, impl, tokens, merge_lora, flags, attn in configs:
        if time.time() - start > opts.budget_s:
            log(f"[bench_rollout] budget reached, skipping {name}")
            timings.append({"config": name, "status": "skipped (time budget)"})
            continue
        settings = recipe_sampling(tokens)
        repeats = 1 if impl in (None, "static") else opts.repeats
        # (module, setting) -> this configuration's value; every one is put back afterwards
        overrides = {(static_decode, "DECODE_ATTENTION"): attn}
        if "fullkv" in flags:
            overrides[static_decode, "KV_WINDOW"] = None  # attend over the whole cache
        if "unfused" in flags:
            overrides[static_decode, "FUSE_PROJECTIONS"] = False
        if "autotune" in flags:
            overrides[static_decode, "DECODE_COMPILE_MODE"] = "max-autotune-no-cudagraphs"
        for option in (o for o in flags if o.startswith("topk=")):
            block = option.split("=", 1)[1]
            overrides[static_decode, "SAMPLER_TOPK_BLOCK"] = None if block == "torch" else int(block)
        if "torchmm" in flags:
            overrides[decode_matmul, "IMPLEMENTATION"] = "torch"
            overrides[decode_matmul, "GATED_IMPLEMENTATION"] = "torch"
        if "torchgate" in flags:
            overrides[decode_matmul, "GATED_IMPLEMENTATION"] = "torch"
        for option in (o for o in flags if o.startswith("qkv=")):
            overrides[decode_qkv, "IMPLEMENTATION"] = option.split("=", 1)[1]
        if "nospan" in flags:
            overrides[decode_attention, "SPLIT_SPAN"] = False
        if "separateqkv" in flags:
            overrides[decode_attention, "SPLIT_NEW_TOKEN"] = False
        if "eagerprefill" in flags:
            overrides[static_decode, "COMPILE_PREFILL"] = False
        for option in (o for o in flags if o.startswith("sampler=")):
            overrides[decode_sampler, "IMPLEMENTATION"] = option.split("=", 1)[1]
        saved = {(module, setting): getattr(module, setting) for module, setting in overrides}
        try:
            for (module, setting), value in overrides.items():
                setattr(module, setting, value)
            timings.append(run_config(model, name, impl, rows, settings, repeats, log, merge_lora,
                                      opts.profile_steps))
        finally:
            for (module, setting), value in saved.items():
                setattr(module, setting, value)
        results["timings"] = timings
        common.write_json(opts.json, results)
    results["timings"] = timings
    results["teacher_weights_unchanged"] = base_fingerprint(model) == teacher_before
    log(f"[check] base (teacher) weights bit-identical after all rollouts: {results['teacher_weights_unchanged']}")
    results["elapsed_s"] = time.time() - start
    return common.finish(results, opts.json, summarize(results))


def summarize(results) -> str:
    rows = []
    for t in results["timings"]:
        if t.get("status") == "ok":
            rows.append([t["config"], f"{t['prompts']} x {t['max_new_tokens']}", f"{t['first_call_s']:.1f}",
                         f"{t['s']:.2f}", f"{t['tokens']:,}", f"{t['tokens_per_s']:,.0f}", f"{t['peak_gib']:.1f}",
                         f"{t['sampled_in_reference_top20']['in_top_k']:.4f}"])
        else:
            rows.append([t["config"], "", "", "", "", t.get("status", "?"), "", ""])
    table = common.markdown_table(["configuration", "prompts x new tokens", "first call (s)", "timed call (s)",
                                   "tokens", "tokens/s", "peak GiB", "sampled in top-20 of a plain forward"], rows)
    lines = [f"## Rollouts, {results['shape']}, LoRA r=64 peft model ({results['machine']})", "", table, ""]
    for t in results["timings"]:
        if "logprob_vs_trainer_forward" in t:
            lines.append(f"check {t['config']}: log p of sampled tokens, engine vs trainer's forward: "
                         f"{t['logprob_vs_trainer_forward']}")
        if "decode_step_profile" in t:
            prof = t["decode_step_profile"]
            lines.append(f"profile {t['config']}: {prof['device_ms_per_step']:.3f} ms device time per decode step "
                         f"(recorded step replayed: {prof.get('replay_ms_per_step')} ms wall), "
                         f"{prof['kernels_per_step']:.0f} kernels; top: " + "; ".join(
                             f"{r['kernel'][:40]} {r['share']:.0%}" for r in prof["top"][:5]))
    for key, value in results["checks"].items():
        lines.append(f"check {key}: {value}")
    lines.append("check teacher (base) weights bit-identical after all rollouts: "
                 f"{results['teacher_weights_unchanged']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
