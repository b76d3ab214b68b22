"""Does vLLM sample from the student the trainer holds? (GPU machine with vLLM)

    python -m checks.vllm_sync_check --json $OUT/sync.json                 # must pass (exit 0)
    python -m checks.vllm_sync_check --skip-sync --json $OUT/stale.json    # must fail (exit 1): the check's own test

Runs `OPSDTrainer` with vLLM colocate (TRL's `VLLMGeneration`, with the project's out-of-place
LoRA merge, `opsd/rollout/vllm_weights.py`) on the learned tiny default at the arm that learns there
(`OPSD_CLIP_MODE=token`, `OPSD_PAD_SIDE=left`, lr 2e-4, batch 32) for `--steps` optimizer steps.
At every rollout, after k optimizer steps (k = 0 .. steps-1), it compares two distributions over
the tokens vLLM sampled:

- vLLM's: the engine runs in TRL's `processed_logprobs` mode, so each sampled token's reported
  log-probability is under the distribution vLLM draws from: logits / temperature, top-k, then
  top-p, renormalised (the recipe's 1.1 / 20 / 0.95);
- the trainer's: one plain forward of the trainer's peft student (bf16, LoRA on) over prompt +
  completion, logits in float32, the same temperature / top-k / top-p, log-softmax.

It also scores the tokens with the initial student (the adapter disabled: LoRA's B starts at
zero, so that is the student at step 0) and records whether the fixed teacher's base weights are
bit-identical to their values before training, after every sync.

Pass, at every rollout: mean |vLLM - trainer| <= --tol-mean, p99 <= --tol-p99, at most
--tol-outside of the sampled tokens outside the trainer's top-k/top-p set, the teacher
bit-identical; and for k >= 1, vLLM closer to the current student than to the initial one
(`agreement`'s capped distance to the trainer below the one to the initial student).
`--skip-sync` lets only the first weight sync through (vLLM keeps sampling from step 0): the last
criterion must then fail from k = 1 on.
"""
from __future__ import annotations  # noqa: I001 (bench.common must load before torch)

import argparse
import os
import sys
import tempfile
import time

from bench import common  # first: it sets the offline environment before torch loads
import torch

ARM_ENV = {"OPSD_CLIP_MODE": "token", "OPSD_PAD_SIDE": "left"}


def processed_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_k: int,
                       top_p: float) -> torch.Tensor:
    """log p(token) under vLLM's processed distribution: logits / T, the top-k kept, then the
    smallest top set holding top_p of the mass (a candidate stays while the mass ranked above it
    is below top_p), renormalised. -inf for a token outside the kept set. logits [N, V] float32."""
    values = logits / temperature
    if 0 < top_k < values.shape[-1]:
        kth = values.topk(top_k, dim=-1).values[:, -1:]
        values = values.masked_fill(values < kth, -float("inf"))
    if top_p < 1.0:
        ordered, order = values.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        values = values.scatter(-1, order, ordered.masked_fill(drop, -float("inf")))
    return values.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def student_logprobs(model, prompts, completions, settings, pad_id: int, chunk: int = 8) -> list[torch.Tensor]:
    """Per row, `processed_logprobs` of the completion's tokens from one forward of `model` over
    prompt + completion (left-padded, positions counted from each row's first token)."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(prompts), chunk):
        rows = list(zip(prompts[start:start + chunk], completions[start:start + chunk], strict=False))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, c) in enumerate(rows):
            ids[j, width - len(p) - len(c):] = torch.tensor(list(p) + list(c))
            mask[j, width - len(p) - len(c):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        for j, (_p, c) in enumerate(rows):
            if not c:
                out.append(torch.empty(0, device=device))
                continue
            scores = logits[j, width - len(c) - 1:width - 1].float()
            out.append(processed_logprobs(scores, torch.tensor(list(c), device=device), *settings))
    return out


DISTANCE_CAP = 5.0  # nats: a token one side excludes (-inf) counts as this far in `distance`


def agreement(engine: torch.Tensor, reference: torch.Tensor) -> dict:
    """|engine - reference| over the tokens both give a finite log-probability (mean, p99, max),
    the rest counted (`outside`); `distance`: the mean over all tokens of |difference| capped at
    DISTANCE_CAP, an excluded token counting the cap (what "closer to" compares)."""
    finite = torch.isfinite(reference) & torch.isfinite(engine)
    diff = (engine[finite] - reference[finite]).abs()
    capped = torch.full_like(engine, DISTANCE_CAP)
    capped[finite] = diff.clamp(max=DISTANCE_CAP)
    return {"tokens": int(engine.numel()), "outside": int((~finite).sum()),
            "distance": float(capped.mean()) if engine.numel() else float("nan"),
            "outside_frac": float((~finite).float().mean()) if engine.numel() else 0.0,
            "mean_abs": float(diff.mean()) if diff.numel() else float("nan"),
            "p99_abs": float(diff.quantile(0.99)) if diff.numel() else float("nan"),
            "max_abs": float(diff.max()) if diff.numel() else float("nan")}


class SyncCheck:
    """Wraps the trainer's `VLLMGeneration`: every generate() call is checked as described above."""

    def __init__(self, trainer, skip_sync: bool):
        self.trainer = trainer
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        args = trainer.args
        self.settings = (args.temperature, args.top_k or 0, args.top_p)
        self.pad_id = trainer.processing_class.pad_token_id
        self.teacher = {n: p.detach().clone() for n, p in self.model.named_parameters() if "lora_" not in n}
        self.records: list[dict] = []
        self.syncs = {"asked": 0, "done": 0}
        vg = trainer.vllm_generation
        vg.logprobs = 0  # the sampled token's log-probability (TRL's distillation path asks for none)
        self._generate, self._sync = vg.generate, vg.sync_weights
        vg.generate, vg.sync_weights = self.generate, self.sync_weights
        self.skip_sync = skip_sync

    def sync_weights(self):
        self.syncs["asked"] += 1
        if self.skip_sync and self.syncs["done"] >= 1:
            return  # the deliberate fault: vLLM keeps the weights of its first sync
        self._sync()
        self.syncs["done"] += 1

    def generate(self, *args, **kwargs):
        out = self._generate(*args, **kwargs)
        prompt_ids, completion_ids, logprobs, _ = out
        started = time.perf_counter()
        engine = [torch.tensor([t[0] if t and t[0] is not None else float("nan") for t in row], dtype=torch.float32)
                  for row in logprobs]
        was_training = self.model.training
        self.model.eval()
        try:
            current = student_logprobs(self.model, prompt_ids, completion_ids, self.settings, self.pad_id)
            with self.model.disable_adapter():
                initial = student_logprobs(self.model, prompt_ids, completion_ids, self.settings, self.pad_id)
        finally:
            self.model.train(was_training)
        engine_all = torch.cat(engine)
        current_all, initial_all = torch.cat(current).cpu(), torch.cat(initial).cpu()
        teacher_identical = all(torch.equal(p.detach(), self.teacher[n])
                                for n, p in self.model.named_parameters() if "lora_" not in n)
        record = {"step": self.trainer.state.global_step, "rows": len(completion_ids),
                  "syncs_asked": self.syncs["asked"], "syncs_done": self.syncs["done"],
                  "vs_trainer": agreement(engine_all, current_all), "vs_initial": agreement(engine_all, initial_all),
                  "trainer_vs_initial": agreement(current_all, initial_all),
                  "teacher_identical": teacher_identical, "check_s": time.perf_counter() - started}
        self.records.append(record)
        v, i, m = record["vs_trainer"], record["vs_initial"], record["trainer_vs_initial"]
        print(f"[sync] k={record['step']} tokens={v['tokens']} vLLM-trainer mean={v['mean_abs']:.4f} "
              f"p99={v['p99_abs']:.4f} max={v['max_abs']:.4f} outside={v['outside']} distance={v['distance']:.4f} | "
              f"vLLM-initial distance={i['distance']:.4f} | trainer-initial distance={m['distance']:.4f} | "
              f"teacher identical={teacher_identical} | syncs {self.syncs['done']}/{self.syncs['asked']}", flush=True)
        return out


def verdicts(records: list[dict], tol_mean: float, tol_p99: float, tol_outside: float) -> list[dict]:
    rows = []
    for r in records:
        v, i = r["vs_trainer"], r["vs_initial"]
        failures = []
        if not v["mean_abs"] <= tol_mean:
            failures.append(f"mean {v['mean_abs']:.4f} > {tol_mean}")
        if not v["p99_abs"] <= tol_p99:
            failures.append(f"p99 {v['p99_abs']:.4f} > {tol_p99}")
        if not v["outside_frac"] <= tol_outside:
            failures.append(f"{v['outside_frac']:.2%} outside the trainer's top-k/top-p set")
        if r["step"] >= 1 and not v["distance"] < i["distance"]:
            failures.append(f"closer to the initial student (distance {i['distance']:.4f}) than to the current "
                            f"one ({v['distance']:.4f})")
        if not r["teacher_identical"]:
            failures.append("teacher weights changed")
        rows.append({**r, "pass": not failures, "failures": failures})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (rollouts after k = 0 .. steps-1)")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="vLLM's KV cache (--vllm_kv_cache_gib): a fixed size, so other processes on the GPU "
                        "cannot upset its start")
    parser.add_argument("--skip-sync", action="store_true", help="let only the first weight sync through")
    parser.add_argument("--tol-mean", type=float, default=0.02)
    parser.add_argument("--tol-p99", type=float, default=0.2)
    parser.add_argument("--tol-outside", type=float, default=0.01)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import opsd_train
    from opsd_trainer import OPSDTrainer

    out = tempfile.mkdtemp(prefix="vllm_sync_")
    flags = ["--preset", "tiny", "--output_dir", out, "--max_steps", str(args.steps), "--seed", str(args.seed),
             "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1",
             "--learning_rate", str(args.learning_rate), "--save_strategy", "no", "--logging_steps", "1",
             "--report_to", "none", "--use_vllm", "true", "--vllm_mode", "colocate",
             "--vllm_kv_cache_gib", str(args.kv_cache_gib)]
    script_args, config, dataset = opsd_train.parse(flags, env={**os.environ, **ARM_ENV}, quiet=True)
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=opsd_train.lora_config(script_args),
                          base_model_name=script_args.model_name_or_path)
    check = SyncCheck(trainer, args.skip_sync)
    engine_dtype = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
    trainer.train()
    rows = verdicts(check.records, args.tol_mean, args.tol_p99, args.tol_outside)
    passed = bool(rows) and all(r["pass"] for r in rows)
    table = common.markdown_table(
        ["k", "tokens", "vLLM-trainer mean / p99 / max", "outside", "distance to trainer / initial",
         "trainer-initial distance", "teacher identical", "pass"],
        [[r["step"], r["vs_trainer"]["tokens"],
          f"{r['vs_trainer']['mean_abs']:.4f} / {r['vs_trainer']['p99_abs']:.4f} / {r['vs_trainer']['max_abs']:.4f}",
          r["vs_trainer"]["outside"], f"{r['vs_trainer']['distance']:.4f} / {r['vs_initial']['distance']:.4f}",
          f"{r['trainer_vs_initial']['distance']:.4f}", r["teacher_identical"],
          "yes" if r["pass"] else "NO: " + "; ".join(r["failures"])] for r in rows])
    verdict = ("PASS: vLLM samples from the trainer's current student at every step"
               if passed else "FAIL: vLLM's samples do not follow the trainer's student")
    report = (f"vLLM sync check ({'sync skipped after the first' if args.skip_sync else 'normal sync'}); "
              f"{common.machine()}; vLLM weights {engine_dtype}, trainer bf16; recipe sampling "
              f"T={config.temperature} top_k={config.top_k} top_p={config.top_p}\n\n{table}\n\n{verdict}")
    common.finish({"skip_sync": args.skip_sync, "engine_dtype": engine_dtype, "records": rows, "pass": passed,
                   "tolerances": {"mean": args.tol_mean, "p99": args.tol_p99, "outside": args.tol_outside}},
                  args.json, report)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
