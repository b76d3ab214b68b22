"""One OPSD training step, naive vs the project's, side by side in one process.

    python bench/bench_step.py                  # GPU: Qwen3-1.7B shape, bf16, sdpa
    python bench/bench_step.py --shape tiny     # CPU smoke run of the same code (about a minute)

(a) naive, released-style: full logits of both roles over the full sequences
    (PeftModel forward, adapter disabled + no_grad for the teacher),
    `opsd.loss.divergence_loss` (full-vocabulary entry-clipped forward KL, fp32),
    backward, gradient clipping, AdamW; activation checkpointing on, as in the
    reference naive measurement of BENCHMARKS.md section 1.
(b) the project's step exactly as the trainer runs it: `OPSDTrainer._opsd_loss`
    itself (build_scoring_batch -> completion_hidden_states for the student with
    grad and for the teacher under no_grad with the adapter disabled ->
    chunked_divergence_loss on the masked hidden states), called on a stand-in for
    the trainer that carries the OPSDConfig defaults (on CUDA: bf16 autocast, decoder
    layers compiled for the two forwards, compiled chunk math); then the same
    backward, clipping and AdamW. With activation checkpointing every layer (the
    trainer's default), every 2nd layer, and off; `_eager` variants switch both
    compilations off (`--compile_loss false --compile_layers false`), `_loss_only`
    keeps only the compiled chunk math.

Checks (a) against (b) on one batch (loss relative error, cosine of the LoRA
gradients), then times every variant for each micro-batch (median of >= 3 steps
after a warm-up), records peak memory, and prints a table last. FLOPs: see
`common.step_flops`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import types
from pathlib import Path

import common
import torch

from data_collator import OPSDCollator
from opsd.batches import DistillBatch
from opsd.chunked_loss import chunked_divergence_loss
from opsd.loss import divergence_loss
from opsd.objective import build_objective, objective_settings
from opsd.rollout.compiled_layers import CompiledLayers
from opsd.scoring import build_scoring_batch, gather_completion_positions
from opsd.train_config import OPSDConfig, default_scoring_pad_multiple, resolve_engine_defaults
from opsd_trainer import OPSDArm, OPSDTrainer

PAD_ID = 151643
MEMORY_LIMIT_GIB = 80.0  # "fits" for the throughput target (an 80 GB card)


def trainer_defaults(**overrides) -> types.SimpleNamespace:
    """OPSDConfig's own field defaults (the released recipe), without building a TrainingArguments."""
    values = {f.name: f.default for f in dataclasses.fields(OPSDConfig) if f.default is not dataclasses.MISSING}
    # bf16 is resolved in __post_init__ (None -> bf16 on CUDA, fp32 on CPU); do the same here,
    # since the step's mixed precision (opsd.scoring.bf16_autocast) follows it.
    # The same for the loss's compilation (None -> on with CUDA) and the scoring pad multiple;
    # the engine-dependent ones as the trainer resolves them on one process, after the overrides.
    for name in ("bf16", "compile_loss"):
        if values.get(name) is None:
            values[name] = torch.cuda.is_available()
    if values.get("pad_to_multiple_of") is None:
        values["pad_to_multiple_of"] = default_scoring_pad_multiple()
    values.update(overrides)
    args = types.SimpleNamespace(**values)
    resolve_engine_defaults(args, sharded=False, zero_stage=None)
    return args


def trainer_stand_in(args, dev, compiled_layers=None) -> types.SimpleNamespace:
    """What `OPSDTrainer._opsd_loss` reads from `self`; its own methods are bound to it.

    `compiled_layers` lets stand-ins for several variants share one set of compiled
    layer forwards (one compilation per process, as in a training run)."""
    shim = types.SimpleNamespace(
        args=args,
        accelerator=types.SimpleNamespace(device=dev, is_main_process=True),
        _tokenizer=types.SimpleNamespace(pad_token_id=PAD_ID),
        # the scoring geometry only (the stand-in's rows come tokenized: no prompt builder)
        collator=OPSDCollator(None, pad_id=PAD_ID, pad_side=args.pad_side,
                              pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None)),
        ema=None,
        _alignment_checked=False,
        _compiled_layers=compiled_layers,
        _adapter_layers=None,
        objective_settings=(settings := objective_settings(args)),
        objective=build_objective(settings),
    )
    for method in ("grouped_scoring_forwards", "_teacher_weights", "_report_alignment",
                   "_scoring_layers", "_adapters"):
        setattr(shim, method, types.MethodType(getattr(OPSDTrainer, method), shim))
    shim.arm = OPSDArm(shim)  # the teacher's prompts and weights
    return shim


def make_inputs(batch: int, geo: common.Geometry, seed: int) -> DistillBatch:
    """Trainer-format rows: prompt / teacher prompt / completion token lists (full length)."""
    gen = torch.Generator().manual_seed(seed)

    def rows(length):
        return torch.randint(0, PAD_ID, (batch, length), generator=gen).tolist()

    student, teacher = rows(geo.prompt), rows(geo.teacher_prompt)
    return DistillBatch(student, rows(geo.completion), teacher_prompt_ids=teacher)


def naive_loss(model, args, inputs, dev):
    """Released-style: full logits [B, S, V] for both roles, reference loss in fp32."""
    def batch(prompts):
        b = build_scoring_batch(prompts, inputs.completion_ids, pad_id=PAD_ID, pad_side=args.pad_side)
        return dataclasses.replace(b, **{f.name: getattr(b, f.name).to(dev) for f in dataclasses.fields(b)
                                         if isinstance(getattr(b, f.name), torch.Tensor)})

    student, teacher = batch(inputs.student_prompt_ids), batch(inputs.teacher_prompt_ids)
    with torch.no_grad(), model.disable_adapter():
        teacher_logits = model(input_ids=teacher.input_ids, attention_mask=teacher.attention_mask,
                               position_ids=teacher.position_ids, use_cache=False).logits
    student_logits = model(input_ids=student.input_ids, attention_mask=student.attention_mask,
                           position_ids=student.position_ids, use_cache=False).logits
    return divergence_loss(
        gather_completion_positions(student_logits, student),
        gather_completion_positions(teacher_logits, teacher),
        student.completion_mask.bool(),
        beta=args.beta, temperature=args.temperature, clip=args.jsd_token_clip, clip_mode=args.clip_mode,
        top_k=args.top_k_loss,
    )


class Stepper:
    """loss -> backward -> clip -> AdamW, for either loss function, per variant's config."""

    def __init__(self, model, args, dev):
        self.model, self.args, self.dev = model, args, dev
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.learning_rate)
        self.compiled_layers = CompiledLayers(model)
        self.shims = {}

    def shim(self, variant: Variant):
        if variant.name not in self.shims:
            self.shims[variant.name] = trainer_stand_in(variant.args(), self.dev, self.compiled_layers)
        return self.shims[variant.name]

    def loss(self, variant: Variant, inputs):
        if variant.kind == "naive":
            return naive_loss(self.model, self.args, inputs, self.dev)
        return OPSDTrainer._opsd_loss(self.shim(variant), self.model, inputs)

    def step(self, variant: Variant, inputs) -> float:
        loss, _ = self.loss(variant, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def loss_and_grad(self, variant: Variant, inputs):
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self.loss(variant, inputs)
        loss.backward()
        grad = torch.cat([p.grad.float().flatten() for p in self.params])
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), grad, {k: float(v) for k, v in stats.items()}


# ------------------------------------------------------------------ variants

@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # naive | project
    checkpoint_every: int  # 0 = activation checkpointing off
    note: str = ""
    overrides: tuple = ()  # OPSDConfig fields that differ from the trainer's defaults

    def args(self) -> types.SimpleNamespace:
        return trainer_defaults(**dict(self.overrides))


EAGER = (("compile_loss", False), ("compile_layers", False))
VARIANTS = {
    "naive": Variant("naive", "naive", 1, note="released-style, full logits, ckpt every layer"),
    "project": Variant("project", "project", 1, note="trainer default (CUDA: compiled layers + loss), ckpt all"),
    "project_ckpt2": Variant("project_ckpt2", "project", 2, note="trainer default, ckpt every 2nd layer"),
    "project_nockpt": Variant("project_nockpt", "project", 0, note="trainer default, no activation checkpointing"),
    "project_eager": Variant("project_eager", "project", 1, note="--compile_loss false --compile_layers false",
                             overrides=EAGER),
    "project_eager_nockpt": Variant("project_eager_nockpt", "project", 0, note="eager, no checkpointing",
                                    overrides=EAGER),
    "project_loss_only": Variant("project_loss_only", "project", 1, note="--compile_layers false",
                                 overrides=(("compile_layers", False),)),
    "project_loss_only_nockpt": Variant("project_loss_only_nockpt", "project", 0,
                                        note="--compile_layers false, no checkpointing",
                                        overrides=(("compile_layers", False),)),
}


def check_equivalence(model, stepper, batch, geo, log, variants=("project", "project_nockpt")) -> dict:
    """(a) vs (b) on one batch and one parameter state: loss and LoRA gradients."""
    inputs = make_inputs(batch, geo, seed=1234)
    common.set_checkpointing(model, 1)
    naive, naive_grad, naive_stats = stepper.loss_and_grad(VARIANTS["naive"], inputs)
    result = {"micro_batch": batch, "naive_loss": naive, "naive_true_kl": naive_stats["true_kl"]}
    for name in variants:
        variant = VARIANTS[name]
        common.set_checkpointing(model, variant.checkpoint_every)
        loss, grad, stats = stepper.loss_and_grad(variant, inputs)
        tag = name
        rel = abs(loss - naive) / max(abs(naive), 1e-12)
        cos = float(torch.nn.functional.cosine_similarity(grad, naive_grad, dim=0))
        norm_ratio = float(grad.norm() / naive_grad.norm())
        result[tag] = {"loss": loss, "loss_rel_err": rel, "grad_cosine": cos, "grad_norm_ratio": norm_ratio,
                       "true_kl": stats["true_kl"], "pass": rel <= 1e-2 and cos >= 0.999}
        log(f"[check] mb={batch} project({tag}) loss={loss:.6g} naive={naive:.6g} rel_err={rel:.2e} "
            f"grad_cos={cos:.6f} norm_ratio={norm_ratio:.4f} -> {'PASS' if result[tag]['pass'] else 'FAIL'}")
    common.free_memory()
    return result


def measure(stepper, model, variant: Variant, batch, geo, params, steps, log) -> dict:
    common.set_checkpointing(model, variant.checkpoint_every)
    common.free_memory()
    inputs = make_inputs(batch, geo, seed=batch)
    row = {"variant": variant.name, "micro_batch": batch}
    try:
        warm, loss = common.timed(lambda: stepper.step(variant, inputs))
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        times = []
        for _ in range(steps):
            t, loss = common.timed(lambda: stepper.step(variant, inputs))
            times.append(t)
        step_time = common.median(times)
        flops = common.step_flops(params, batch, geo)
        row.update(
            status="ok", warmup_s=warm, step_times=times, step_s=step_time,
            tokens_per_s=batch * geo.completion / step_time, peak_gib=common.peak_gib(), loss=loss,
            tflops=flops / step_time / 1e12,
        )
        row["mfu"] = row["tflops"] / common.BF16_PEAK_TFLOPS
        log(f"[step] {variant.name:15s} mb={batch:3d} step={step_time:.3f}s tok/s={row['tokens_per_s']:8.0f} "
            f"peak={row['peak_gib']:.1f}GiB TFLOP/s={row['tflops']:.0f} loss={loss:.5g} "
            f"times={[f'{t:.3f}' for t in times]}")
    except torch.OutOfMemoryError:
        row.update(status="OOM")
        log(f"[step] {variant.name:15s} mb={batch:3d} OOM")
    finally:
        stepper.optimizer.zero_grad(set_to_none=True)
        common.free_memory()
    return row


def profile_step(stepper, model, variant: Variant, batch, geo, out_dir, log) -> None:
    """One step under torch.profiler: the top CUDA kernels by total time, to a file and the log."""
    from torch.profiler import ProfilerActivity, profile

    common.set_checkpointing(model, variant.checkpoint_every)
    inputs = make_inputs(batch, geo, seed=batch)
    stepper.step(variant, inputs)  # warm
    common.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        stepper.step(variant, inputs)
        common.sync()
        wall_ms = (time.perf_counter() - started) * 1000
    averages = prof.key_averages()
    # Kernel time against wall time: far below 100% means the step waits on the host
    # (launches, synchronisations), not on the GPU's arithmetic or memory.
    kernels = [e for e in averages if e.device_type.name == "CUDA"]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1000
    table = averages.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    # The host's side: what the Python process spends its time on (launches, guards, copies).
    host_table = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    waits = sum(e.count for e in averages if e.key == "cudaStreamSynchronize")  # the host waiting for the GPU
    summary = f"wall {wall_ms:.1f} ms under the profiler, " + (
        f"kernels {busy_ms:.1f} ms ({busy_ms / wall_ms:.0%} of it), {sum(e.count for e in kernels)} kernel launches, "
        f"{waits} host waits (cudaStreamSynchronize)" if torch.cuda.is_available() else "no GPU")
    if out_dir:
        Path(out_dir, f"profile_{variant.name}_mb{batch}.txt").write_text(
            summary + "\n" + table + "\n\nBy the host's own time:\n" + host_table)
    log(f"[profile] {variant.name} mb={batch}: {summary}\n" + "\n".join(table.splitlines()[:22])
        + "\n[profile] by the host's own time:\n" + "\n".join(host_table.splitlines()[:18]))
    stepper.optimizer.zero_grad(set_to_none=True)
    common.free_memory()


def loss_chunk_sweep(model, geo, batch, chunk_sizes, log, repeats=3) -> list[dict]:
    """The chunked loss alone (forward + backward) on random hidden states, per chunk size."""
    dev = common.device()
    head = model.get_base_model().get_output_embeddings()
    hidden = head.weight.shape[1]
    n = batch * geo.completion
    gen = torch.Generator(device=dev).manual_seed(0)
    dtype = head.weight.dtype
    student = torch.randn(n, hidden, device=dev, dtype=dtype, generator=gen).requires_grad_(True)
    teacher = (student.detach() + 0.3 * torch.randn(n, hidden, device=dev, dtype=dtype, generator=gen))
    args = trainer_defaults()
    rows = []
    for chunk in chunk_sizes:
        common.free_memory()
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0

        def run(chunk=chunk):
            loss, _ = chunked_divergence_loss(student, teacher, head.weight, beta=args.beta,
                                              temperature=args.temperature, clip=args.jsd_token_clip,
                                              clip_mode=args.clip_mode, chunk_size=chunk,
                                              compile=args.compile_loss)
            loss.backward()
            student.grad = None

        common.timed(run)
        times = [common.timed(run)[0] for _ in range(repeats)]
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if torch.cuda.is_available() else float("nan")
        rows.append({"chunk_size": chunk, "tokens": n, "loss_s": common.median(times), "extra_peak_gib": extra})
        log(f"[chunk] tokens={n} chunk={chunk:5d} fwd+bwd={rows[-1]['loss_s'] * 1e3:.1f} ms extra peak={extra:.2f} GiB")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=common.SHAPE_CHOICES, default=None,
                        help="default: qwen3-1.7b on CUDA, tiny otherwise")
    parser.add_argument("--tiny", action="store_true", help="same as --shape tiny")
    parser.add_argument("--micro-batches", default="2,4,8,16,32,64")
    parser.add_argument("--variants", default="naive,project,project_nockpt,project_ckpt2,project_eager")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after 1 warm-up)")
    parser.add_argument("--check-mb", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=300, help="start no new measurement after this")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--check-variants", default="project,project_nockpt")
    parser.add_argument("--skip-chunk-sweep", action="store_true")
    parser.add_argument("--profile", default="", help="variants to profile for one step, e.g. project_nockpt")
    parser.add_argument("--profile-mb", type=int, default=8)
    common.add_inductor_argument(parser, "for the whole process")
    opts = parser.parse_args(argv)
    for key, value in common.inductor_settings(opts.inductor).items():
        setattr(torch._inductor.config, key, value)
    shape = "tiny" if opts.tiny else common.default_shape(opts.shape)
    geo = common.TINY if shape == "tiny" else common.FULL
    start = time.time()
    lines: list[str] = []

    def log(msg):
        lines.append(msg)
        print(msg, flush=True)

    log(f"[bench_step] shape={shape} geometry={geo} machine: {common.machine()}"
        + (f" inductor: {', '.join(opts.inductor)}" if opts.inductor else ""))
    dev = common.device()
    model = common.build_lora_model(shape)
    model.train()
    params = common.count_params(model)
    log(f"[bench_step] params: {params}  FLOPs/step at mb 8: {common.step_flops(params, 8, geo) / 1e12:.1f} TFLOP")
    args = trainer_defaults()
    log(f"[bench_step] trainer defaults: beta={args.beta} T={args.temperature} clip={args.jsd_token_clip} "
        f"clip_mode={args.clip_mode} pad_side={args.pad_side} loss={args.loss_implementation} "
        f"chunk={args.loss_chunk_size} lr={args.learning_rate} max_grad_norm={args.max_grad_norm}")
    stepper = Stepper(model, args, dev)

    results = {"shape": shape, "geometry": dataclasses.asdict(geo), "machine": common.machine(), "params": params,
               "flop_formula": common.step_flops.__doc__}
    common.write_json(opts.json, results)
    results["check"] = check_equivalence(model, stepper, min(opts.check_mb, 2) if shape == "tiny" else opts.check_mb,
                                         geo, log, variants=tuple(opts.check_variants.split(",")))

    micro_batches = [int(x) for x in opts.micro_batches.split(",")]
    if shape == "tiny" and opts.micro_batches == parser.get_default("micro_batches"):
        micro_batches = [1, 2]  # a CPU smoke run
    rows = []
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 1e9
    for name in opts.variants.split(","):
        variant = VARIANTS[name]
        batches = micro_batches
        if name == "project_ckpt2":
            batches = [b for b in micro_batches if b in (8, 16, 32)] or micro_batches[-1:]
        if shape == "tiny":
            opts.steps = min(opts.steps, 3)
        last_peak = None
        for batch in batches:
            if time.time() - start > opts.budget_s:
                log(f"[bench_step] budget reached, skipping {name} mb={batch}")
                continue
            if last_peak is not None and last_peak * 2.1 > total_gib * 0.95:
                log(f"[bench_step] {name} mb={batch}: predicted {last_peak * 2.1:.0f} GiB > device, skipped")
                rows.append({"variant": name, "micro_batch": batch, "status": "skipped (would not fit)"})
                continue
            row = measure(stepper, model, variant, batch, geo, params, opts.steps, log)
            rows.append(row)
            results["rows"] = rows
            common.write_json(opts.json, results)
            if row["status"] != "ok":
                break
            last_peak = row["peak_gib"]
    results["rows"] = rows
    out_dir = str(Path(opts.json).parent) if opts.json else None
    for name in filter(None, opts.profile.split(",")):
        if time.time() - start < opts.budget_s + 60:
            try:
                profile_step(stepper, model, VARIANTS[name], opts.profile_mb if shape != "tiny" else 1, geo, out_dir,
                             log)
            except Exception as exc:  # noqa: BLE001 - a profile is a bonus
                log(f"[profile] {name} failed: {type(exc).__name__}: {exc}")
    if "project" in opts.variants.split(",") and not opts.skip_chunk_sweep:
        results["chunk_sweep"] = loss_chunk_sweep(model, geo, 8 if shape != "tiny" else 2,
                                                  [512, 1024, 2048, 4096] if shape != "tiny" else [16, 64], log)
    results["elapsed_s"] = time.time() - start
    return common.finish(results, opts.json, summarize(results))


def summarize(results) -> str:
    rows = [r for r in results["rows"] if r.get("status") == "ok"]
    by = {(r["variant"], r["micro_batch"]): r for r in rows}

    def best(variant, limit=MEMORY_LIMIT_GIB):
        fits = [r for r in rows if r["variant"] == variant and r["peak_gib"] <= limit or
                (r["variant"] == variant and math.isnan(r["peak_gib"]))]
        return max(fits, key=lambda r: r["tokens_per_s"]) if fits else None

    table = common.markdown_table(
        ["variant", "micro-batch", "step time (s)", "completion tok/s", "peak GiB", "TFLOP/s", "% of 786"],
        [[r["variant"], r["micro_batch"], f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['peak_gib']:.1f}",
          f"{r['tflops']:.0f}", f"{100 * r['mfu']:.1f}"] for r in rows]
        + [[r["variant"], r["micro_batch"], r["status"], "", "", "", ""] for r in results["rows"]
           if r.get("status") != "ok"],
    )
    out = [f"## OPSD step, {results['shape']} ({results['machine']})", "", table, ""]
    check = results["check"]
    for tag in [k for k, v in check.items() if isinstance(v, dict)]:
        c = check[tag]
        out.append(f"check mb={check['micro_batch']} project({tag}) vs naive: loss {c['loss']:.6g} vs "
                   f"{check['naive_loss']:.6g} (rel err {c['loss_rel_err']:.2e}), LoRA grad cosine "
                   f"{c['grad_cosine']:.6f}, norm ratio {c['grad_norm_ratio']:.4f}: {'PASS' if c['pass'] else 'FAIL'}")
    naive8, proj8 = by.get(("naive", 8)), by.get(("project", 8))
    if naive8 and proj8:
        out.append(f"memory at mb 8: project {proj8['peak_gib']:.1f} GiB vs naive {naive8['peak_gib']:.1f} GiB = "
                   f"{proj8['peak_gib'] / naive8['peak_gib']:.3f}x (target <= 0.35x)")
    nb = best("naive")
    if nb:
        for variant in VARIANTS:
            if variant == "naive":
                continue
            pb = best(variant)
            if pb:
                out.append(f"throughput (best mb <= {MEMORY_LIMIT_GIB:.0f} GiB): {variant} {pb['tokens_per_s']:,.0f} "
                           f"tok/s at mb {pb['micro_batch']} vs naive {nb['tokens_per_s']:,.0f} at mb "
                           f"{nb['micro_batch']} = {pb['tokens_per_s'] / nb['tokens_per_s']:.2f}x (target >= 2.0x)")
    if results.get("chunk_sweep"):
        out.append("chunked loss alone (fwd+bwd): " + ", ".join(
            f"chunk {r['chunk_size']}: {r['loss_s'] * 1e3:.0f} ms / +{r['extra_peak_gib']:.1f} GiB"
            for r in results["chunk_sweep"]))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
