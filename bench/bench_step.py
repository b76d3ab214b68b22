"""One OPSD training step, naive vs the project's, side by side in one process.

    python bench/bench_step.py                  # GPU: Qwen3-1.7B shape, bf16, sdpa
    python bench/bench_step.py --shape tiny     # CPU smoke run of the same code (about a minute)

(a) naive, released-style: full logits of both roles over the full sequences
    (PeftModel forward, adapter disabled + no_grad for the teacher),
    `opsd_loss.divergence_loss` (full-vocabulary entry-clipped forward KL, fp32),
    backward, gradient clipping, AdamW; activation checkpointing on, as in the
    DEVICE.md baseline.
(b) the project's step exactly as the trainer runs it: `OPSDTrainer._opsd_loss`
    itself (build_scoring_batch -> completion_hidden_states for the student with
    grad and for the teacher under no_grad with the adapter disabled ->
    chunked_divergence_loss on the masked hidden states), called on a stand-in for
    the trainer that carries the OPSDConfig defaults; then the same backward,
    clipping and AdamW. With activation checkpointing every layer (the trainer's
    default), every 2nd layer, and off.

Checks (a) against (b) on one batch (loss relative error, cosine of the LoRA
gradients), then times every variant for each micro-batch (median of >= 3 steps
after a warm-up), records peak memory, and prints a table last. FLOPs: see
`common.step_flops`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import torch

import opsd_chunked_loss
import opsd_trainer
from data_collator import build_scoring_batch, gather_completion_positions
from opsd_chunked_loss import chunked_divergence_loss
from opsd_loss import divergence_loss
from opsd_trainer import OPSDConfig, OPSDTrainer

PAD_ID = 151643
MEMORY_LIMIT_GIB = 80.0  # "fits" for the throughput target (an 80 GB card)


def trainer_defaults(**overrides) -> types.SimpleNamespace:
    """OPSDConfig's own field defaults (the released recipe), without building a TrainingArguments."""
    values = {f.name: f.default for f in dataclasses.fields(OPSDConfig) if f.default is not dataclasses.MISSING}
    # bf16 is resolved in __post_init__ (None -> bf16 on CUDA, fp32 on CPU); do the same here,
    # since the step's mixed precision (opsd_trainer.bf16_autocast) follows it.
    values["bf16"] = torch.cuda.is_available() if values.get("bf16") is None else values["bf16"]
    values.update(overrides)
    return types.SimpleNamespace(**values)


def trainer_stand_in(args, dev) -> types.SimpleNamespace:
    """What `OPSDTrainer._opsd_loss` reads from `self`; its own methods are bound to it."""
    shim = types.SimpleNamespace(
        args=args,
        accelerator=types.SimpleNamespace(device=dev, is_main_process=True),
        _tokenizer=types.SimpleNamespace(pad_token_id=PAD_ID),
        ema=None,
        _alignment_checked=False,
    )
    shim._teacher_weights = types.MethodType(OPSDTrainer._teacher_weights, shim)
    shim._report_alignment = types.MethodType(OPSDTrainer._report_alignment, shim)
    return shim


def make_inputs(batch: int, geo: common.Geometry, seed: int) -> dict:
    """Trainer-format rows: prompt / teacher prompt / completion token lists (full length)."""
    gen = torch.Generator().manual_seed(seed)

    def rows(length):
        return torch.randint(0, PAD_ID, (batch, length), generator=gen).tolist()

    return {
        "student_prompt_ids": rows(geo.prompt),
        "teacher_prompt_ids": rows(geo.teacher_prompt),
        "completion_ids": rows(geo.completion),
    }


def naive_loss(model, args, inputs, dev):
    """Released-style: full logits [B, S, V] for both roles, reference loss in fp32."""
    def batch(prompts):
        b = build_scoring_batch(prompts, inputs["completion_ids"], pad_id=PAD_ID, pad_side=args.pad_side)
        return dataclasses.replace(b, **{f.name: getattr(b, f.name).to(dev) for f in dataclasses.fields(b)
                                         if isinstance(getattr(b, f.name), torch.Tensor)})

    student, teacher = batch(inputs["student_prompt_ids"]), batch(inputs["teacher_prompt_ids"])
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
    """loss -> backward -> clip -> AdamW, for either loss function."""

    def __init__(self, model, args, dev):
        self.model, self.args, self.dev = model, args, dev
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.learning_rate)
        self.shim = trainer_stand_in(args, dev)

    def loss(self, kind: str, inputs):
        if kind == "naive":
            return naive_loss(self.model, self.args, inputs, self.dev)
        return OPSDTrainer._opsd_loss(self.shim, self.model, inputs)

    def step(self, kind: str, inputs) -> float:
        loss, _ = self.loss(kind, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def loss_and_grad(self, kind: str, inputs):
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self.loss(kind, inputs)
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
    tf32: bool = False
    note: str = ""
    autocast: bool = False  # proposal: bf16 autocast around completion_hidden_states (LoRA matmuls in bf16)
    compiled_loss: bool = False  # proposal: torch.compile the chunked loss's per-chunk math


_COMPILED = {}


@contextlib.contextmanager
def proposal_patches(variant: Variant):
    """Measure proposed one-line changes to the trainer's step without editing it:
    (1) autocast: `completion_hidden_states` runs under torch.autocast(bf16) with
        peft's fp32 input casting off, so the fp32 LoRA adapters are applied with
        bf16 matmuls (fp32 master weights and gradients stay);
    (2) compiled_loss: the per-chunk functions of opsd_chunked_loss
        (rows_divergence, forward_kl_logit_grad) go through torch.compile.
    Both patch module globals that `_opsd_loss` / `_ChunkedLoss` look up at call time."""
    saved = {}
    try:
        if variant.autocast:
            from peft.helpers import disable_input_dtype_casting

            original = opsd_trainer.completion_hidden_states
            saved[(opsd_trainer, "completion_hidden_states")] = original

            def autocast_hidden_states(model, batch):
                with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16), \
                        disable_input_dtype_casting(model):
                    return original(model, batch)

            opsd_trainer.completion_hidden_states = autocast_hidden_states
        if variant.compiled_loss:
            for name in ("rows_divergence", "forward_kl_logit_grad"):
                saved[(opsd_chunked_loss, name)] = getattr(opsd_chunked_loss, name)
                if name not in _COMPILED:
                    _COMPILED[name] = torch.compile(getattr(opsd_chunked_loss, name), dynamic=False)
                setattr(opsd_chunked_loss, name, _COMPILED[name])
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


VARIANTS = {
    "naive": Variant("naive", "naive", 1, note="released-style, full logits, ckpt every layer"),
    "project": Variant("project", "project", 1, note="trainer default: chunked loss, ckpt every layer"),
    "project_ckpt2": Variant("project_ckpt2", "project", 2, note="chunked loss, ckpt every 2nd layer"),
    "project_nockpt": Variant("project_nockpt", "project", 0, note="chunked loss, no activation checkpointing"),
    "project_tf32": Variant("project_tf32", "project", 1, True, note="trainer default + TF32 for the fp32 LoRA matmuls"),
    "project_autocast": Variant("project_autocast", "project", 1, autocast=True,
                                note="proposal: bf16 autocast for the hidden-state forwards"),
    "project_autocast_nockpt": Variant("project_autocast_nockpt", "project", 0, autocast=True,
                                       note="proposal: autocast, no activation checkpointing"),
    "project_fast": Variant("project_fast", "project", 1, autocast=True, compiled_loss=True,
                            note="proposal: autocast + compiled chunk math, ckpt every layer"),
    "project_fast_nockpt": Variant("project_fast_nockpt", "project", 0, autocast=True, compiled_loss=True,
                                   note="proposal: autocast + compiled chunk math, no activation checkpointing"),
}


def set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled


def check_equivalence(model, stepper, batch, geo, log, variants=("project", "project_nockpt")) -> dict:
    """(a) vs (b) on one batch and one parameter state: loss and LoRA gradients."""
    inputs = make_inputs(batch, geo, seed=1234)
    common.set_checkpointing(model, 1)
    naive, naive_grad, naive_stats = stepper.loss_and_grad("naive", inputs)
    result = {"micro_batch": batch, "naive_loss": naive, "naive_true_kl": naive_stats["true_kl"]}
    for name in variants:
        variant = VARIANTS[name]
        common.set_checkpointing(model, variant.checkpoint_every)
        with proposal_patches(variant):
            loss, grad, stats = stepper.loss_and_grad("project", inputs)
        tag = {"project": "ckpt", "project_nockpt": "nockpt"}.get(name, name)
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
    set_tf32(variant.tf32)
    common.free_memory()
    inputs = make_inputs(batch, geo, seed=batch)
    row = {"variant": variant.name, "micro_batch": batch}
    patches = proposal_patches(variant)
    patches.__enter__()
    try:
        warm, loss = common.timed(lambda: stepper.step(variant.kind, inputs))
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        times = []
        for _ in range(steps):
            t, loss = common.timed(lambda: stepper.step(variant.kind, inputs))
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
            f"peak={row['peak_gib']:.1f}GiB TFLOP/s={row['tflops']:.0f} loss={loss:.5g} times={[f'{t:.3f}' for t in times]}")
    except torch.OutOfMemoryError:
        row.update(status="OOM")
        log(f"[step] {variant.name:15s} mb={batch:3d} OOM")
    finally:
        patches.__exit__(None, None, None)
        set_tf32(False)
        stepper.optimizer.zero_grad(set_to_none=True)
        common.free_memory()
    return row


def profile_step(stepper, model, variant: Variant, batch, geo, out_dir, log) -> None:
    """One step under torch.profiler: the top CUDA kernels by total time, to a file and the log."""
    from torch.profiler import ProfilerActivity, profile

    common.set_checkpointing(model, variant.checkpoint_every)
    inputs = make_inputs(batch, geo, seed=batch)
    with proposal_patches(variant):
        stepper.step(variant.kind, inputs)  # warm
        common.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            stepper.step(variant.kind, inputs)
            common.sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    if out_dir:
        Path(out_dir, f"profile_{variant.name}_mb{batch}.txt").write_text(table)
    log(f"[profile] {variant.name} mb={batch}\n" + "\n".join(table.splitlines()[:22]))
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
                                              clip_mode=args.clip_mode, chunk_size=chunk)
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
    parser.add_argument("--shape", choices=["qwen3-1.7b", "tiny"], default=None,
                        help="default: qwen3-1.7b on CUDA, tiny otherwise")
    parser.add_argument("--tiny", action="store_true", help="same as --shape tiny")
    parser.add_argument("--micro-batches", default="2,4,8,16,32,64")
    parser.add_argument("--variants", default="naive,project,project_nockpt,project_ckpt2,project_tf32")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after 1 warm-up)")
    parser.add_argument("--check-mb", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=300, help="start no new measurement after this")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--check-variants", default="project,project_nockpt")
    parser.add_argument("--skip-chunk-sweep", action="store_true")
    parser.add_argument("--profile", default="", help="variants to profile for one step, e.g. project_nockpt")
    parser.add_argument("--profile-mb", type=int, default=8)
    opts = parser.parse_args(argv)
    shape = "tiny" if opts.tiny else (opts.shape or ("qwen3-1.7b" if torch.cuda.is_available() else "tiny"))
    geo = common.TINY if shape == "tiny" else common.FULL
    start = time.time()
    lines: list[str] = []

    def log(msg):
        lines.append(msg)
        print(msg, flush=True)

    log(f"[bench_step] shape={shape} geometry={geo} machine: {common.machine()}")
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
        if variant.tf32 and not torch.cuda.is_available():
            continue
        batches = micro_batches
        if name == "project_tf32":  # only where it matters most: the throughput end
            batches = [b for b in micro_batches if b in (8, 32)] or micro_batches[-1:]
        if name == "project_ckpt2":
            batches = [b for b in micro_batches if b in (8, 16, 32)] or micro_batches[-1:]
        if variant.autocast or variant.compiled_loss:
            batches = [b for b in micro_batches if b in (4, 8, 16, 32)] or micro_batches[-1:]
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
