"""Train the learned embedded default (`tiny`), write its compact weights, measure it.

    python -m opsd.research.train_tiny_default                  # train + measure (a GPU; CPU works, slowly)
    python -m opsd.research.train_tiny_default --measure-only   # re-measure the committed weights

Training data: an endless stream of train-split problems (`tasks`), each rendered
by this repository's own prompt code in one of the formats the model meets:

    student  `Problem: ...` prompt, thinking off (OPSD_STUDENT_PROMPT=paper) -> solution
    eval     the evaluation prompt, thinking on -> empty think block + solution
    teacher  problem + reference (solution, COT_Reason or both) -> solution

The loss is next-token cross-entropy on the response tokens only. The model is
trained over the compact vocabulary of the tokens these texts use; every other
token's embedding row is zero, i.e. its logit is exactly 0, and the loss's
softmax normaliser counts those (151,936 - used) zero logits, so the full
model later built from the compact file has the distributions trained here.

Copying from a reference in context is learnt long before solving: the teacher
format is near-perfect early, while the student's accuracy climbs slowly. Training
stops once the student (evaluation prompt, evaluation sampling) solves
`--target` of a dev set, leaving it in a middle band with room to improve, its
errors being wrong numbers inside worked steps (measured at the end).

The dev set is drawn from the eval split with `DEV_SEED`; evaluation sets of
this repository (`tiny`, `tiny:SEED`) use other seeds, and the default `tiny`
training set, like this stream, only holds train-split problems.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opsd.tiny_default import tasks
from opsd.tiny_default.learned_model import VOCAB_SIZE, WEIGHTS_FILE, learned_config, save_compact
from opsd.tiny_default.tokenizer import EOS_ID, PAD_ID, build_qwen3_tokenizer

DEV_SEED = 777
MEASURE_SEED = 4242  # the held-out set of the final measurement: tiny:4242:N
STREAM_SEED = 1
EMPTY_THINK = "<think>\n\n</think>\n\n"
# The released padding geometry (OPSD_PAD_SIDE=right) puts pads between prompt and
# completion: the completion's rotary positions jump by the pad gap. Pretrained LLMs
# tolerate such a jump (a small log-prob shift); a model trained on contiguous text
# only does not (measured on a first version of this model: teacher NLL of the reference
# 1.89 nats/token with right padding vs 0.03 with left). So half the examples put a
# random gap of up to MAX_POSITION_GAP positions between prompt and response.
GAP_SHARE, MAX_POSITION_GAP = 0.5, 160
# Share of each format in a batch.
FORMATS = {"student": 0.3, "eval": 0.3, "teacher": 0.25, "teacher_cot": 0.1, "teacher_both": 0.05}


# --------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------

class Renderer:
    """Prompt + response token ids of a problem in one format, built with the
    project's own prompt builder, so prompts are byte-identical to training and eval."""

    def __init__(self, tokenizer):
        from opsd.prompts import PromptBuilder

        self.tokenizer = tokenizer
        self.builders = {ctx: PromptBuilder(tokenizer, teacher_context=ctx) for ctx in ("solution", "cot", "both")}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, item: tasks.Problem, fmt: str) -> list[int]:
        row = tasks.train_row(item)
        if fmt == "student":
            return self.builders["solution"].student_prompt_ids(row)
        if fmt == "eval":
            return self.builders["solution"].eval_prompt_ids(item.problem)
        context = {"teacher": "solution", "teacher_cot": "cot", "teacher_both": "both"}[fmt]
        return self.builders[context].teacher_prompt_ids(row)

    def response(self, item: tasks.Problem, fmt: str) -> list[int]:
        text = (EMPTY_THINK if fmt == "eval" else "") + item.solution
        return self.encode(text) + [EOS_ID]


def used_token_ids(renderer: Renderer, seed: int, count: int = 1000) -> list[int]:
    """Every token id in prompts and responses of `count` problems of both splits
    in every format, plus the digits and the special tokens around a response."""
    used = {EOS_ID, PAD_ID, *renderer.encode(EMPTY_THINK)}
    for digit in range(10):
        used.update(renderer.encode(str(digit)))
    for split in ("train", "eval"):
        for item in tasks.draw(seed, split, count):
            for fmt in FORMATS:
                used.update(renderer.prompt(item, fmt))
                used.update(renderer.response(item, fmt))
    return sorted(used)


@dataclass
class Batch:
    input_ids: torch.Tensor       # [B, T] compact ids
    attention_mask: torch.Tensor  # [B, T]
    position_ids: torch.Tensor    # [B, T] contiguous, or with a jump before the response
    labels: torch.Tensor          # [B, T] compact id of the next token, -100 where not trained


class ExampleStream:
    """Batches of (prompt + response) in compact ids, formats drawn by FORMATS."""

    def __init__(self, renderer: Renderer, to_compact: dict[int, int], seed: int):
        self.renderer, self.to_compact = renderer, to_compact
        self.problems = tasks.problems(seed, "train")
        self.rng = random.Random(seed)
        self.formats, self.weights = list(FORMATS), list(FORMATS.values())

    def example(self) -> tuple[list[int], list[int], list[int]]:
        item = next(self.problems)
        fmt = self.rng.choices(self.formats, self.weights)[0]
        prompt, response = self.renderer.prompt(item, fmt), self.renderer.response(item, fmt)
        ids = [self.to_compact[t] for t in prompt + response]
        labels = [-100] * (len(prompt) - 1) + ids[len(prompt):] + [-100]
        gap = self.rng.randint(1, MAX_POSITION_GAP) if self.rng.random() < GAP_SHARE else 0
        positions = [*range(len(prompt)), *range(len(prompt) + gap, len(ids) + gap)]
        return ids, labels, positions

    def batch(self, size: int) -> tuple[torch.Tensor, ...]:
        rows = [self.example() for _ in range(size)]
        width = max(len(ids) for ids, _, _ in rows)
        pad = self.to_compact[PAD_ID]
        return (torch.tensor([ids + [pad] * (width - len(ids)) for ids, _, _ in rows]),
                torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _, _ in rows]),
                torch.tensor([pos + [pos[-1]] * (width - len(pos)) for _, _, pos in rows]),
                torch.tensor([labels + [-100] * (width - len(labels)) for _, labels, _ in rows]))


class BatchSource(torch.utils.data.IterableDataset):
    """Endless batches; with DataLoader workers (rendering is the bottleneck on a
    GPU), worker w draws the problem stream seeded (seed, w)."""

    def __init__(self, used: list[int], seed: int, batch_size: int):
        self.used, self.seed, self.batch_size = used, seed, batch_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        renderer = Renderer(build_qwen3_tokenizer())
        stream = ExampleStream(renderer, {t: i for i, t in enumerate(self.used)}, self.seed * 1000 + worker)
        while True:
            yield stream.batch(self.batch_size)


# --------------------------------------------------------------------------
# Compact-vocabulary model: loss and sampling with the zero rows counted
# --------------------------------------------------------------------------

def full_vocab_log_normalizer(logits: torch.Tensor, n_zero_rows: int) -> torch.Tensor:
    """log sum_v exp(logit_v) over the full vocabulary, where the n_zero_rows
    tokens outside the compact vocabulary all have logit exactly 0."""
    return torch.logaddexp(torch.logsumexp(logits, dim=-1), torch.tensor(math.log(n_zero_rows), device=logits.device))


def compact_loss(model, batch: Batch, n_zero_rows: int) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits.float()
    mask = batch.labels >= 0
    picked = logits[mask]
    target = picked.gather(-1, batch.labels[mask].unsqueeze(-1)).squeeze(-1)
    return (full_vocab_log_normalizer(picked, n_zero_rows) - target).mean()


@torch.no_grad()
def sample_compact(model, prompts: list[list[int]], n_zero_rows: int, temperature: float, top_p: float,
                   max_new_tokens: int, eos: int, pad: int, gen: torch.Generator) -> list[list[int] | None]:
    """Nucleus sampling from the compact model, the zero-logit rows folded into one
    extra outcome; a row that draws it (a token the task never uses) is None."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    starts = torch.tensor([width - len(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device) >= starts[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, done = out.past_key_values, torch.zeros(len(prompts), dtype=torch.bool, device=device)
    failed = torch.zeros_like(done)
    tokens, logits = [], out.logits[:, -1].float()
    rest = torch.full((len(prompts), 1), math.log(n_zero_rows), device=device)
    for _ in range(max_new_tokens):
        scores = torch.cat([logits / temperature, rest], dim=-1)  # tempered zero logits stay 0
        probs = scores.softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        choice = order.gather(-1, torch.multinomial(sorted_p, 1, generator=gen)).squeeze(-1)
        failed |= (choice == logits.shape[-1]) & ~done
        choice = torch.where(done | failed, torch.full_like(choice, pad), choice.clamp(max=logits.shape[-1] - 1))
        tokens.append(choice)
        done |= (choice == eos) | failed
        if done.all():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=choice[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
    rows = torch.stack(tokens, dim=1).tolist()
    result = []
    for row, bad in zip(rows, failed.tolist(), strict=False):
        result.append(None if bad else (row[: row.index(eos) + 1] if eos in row else row))
    return result


def dev_accuracy(model, renderer, to_compact, from_compact, items, fmt, n_zero_rows, gen, temperature=1.0) -> float:
    from opsd.grading import is_correct

    prompts = [[to_compact[t] for t in renderer.prompt(item, fmt)] for item in items]
    longest = max(len(renderer.response(item, fmt)) for item in items)
    samples = sample_compact(model, prompts, n_zero_rows, temperature, 0.95, longest + 16,
                             to_compact[EOS_ID], to_compact[PAD_ID], gen)
    correct = 0
    for item, sample in zip(items, samples, strict=False):
        if sample is not None:
            text = renderer.tokenizer.decode([from_compact[t] for t in sample], skip_special_tokens=True)
            correct += is_correct(text, str(item.answer))
    return correct / len(items)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def train(args) -> dict:
    from transformers import Qwen3ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    tokenizer = build_qwen3_tokenizer()
    renderer = Renderer(tokenizer)
    used = used_token_ids(renderer, args.seed)
    to_compact = {t: i for i, t in enumerate(used)}
    n_zero_rows = VOCAB_SIZE - len(used)
    print(f"[train] compact vocabulary: {len(used)} tokens used by the task, {n_zero_rows} zero rows", flush=True)

    config = learned_config(vocab_size=len(used))
    config.pad_token_id = to_compact[PAD_ID]  # its row stays zero (logit 0), like the rows outside
    model = Qwen3ForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    batches = iter(torch.utils.data.DataLoader(BatchSource(used, args.seed + STREAM_SEED, args.batch_size),
                                               batch_size=None, num_workers=args.workers,
                                               prefetch_factor=4 if args.workers else None,
                                               pin_memory=device.type == "cuda"))
    dev = tasks.draw(DEV_SEED, "eval", args.dev_problems)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    history, start, step = [], time.time(), 0
    for step in range(1, args.max_steps + 1):
        batch = Batch(*(t.to(device, non_blocking=True) for t in next(batches)))
        model.train()
        with autocast:
            loss = compact_loss(model, batch, n_zero_rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 and step >= args.min_steps:
            model.eval()
            with autocast:
                student = dev_accuracy(model, renderer, to_compact, used, dev, "eval", n_zero_rows, gen)
                teacher = dev_accuracy(model, renderer, to_compact, used, dev[:128], "teacher", n_zero_rows, gen)
            history.append({"step": step, "loss": loss.item(), "student_eval_prompt": student, "teacher": teacher,
                            "seconds": round(time.time() - start, 1)})
            print(f"[train] step {step} loss {loss.item():.4f} dev: student {student:.1%} teacher {teacher:.1%} "
                  f"({time.time() - start:.0f} s)", flush=True)
            if student >= args.target:
                break
    metadata = {"architecture": "Qwen3ForCausalLM", "steps": step, "batch_size": args.batch_size, "lr": args.lr,
                "seed": args.seed, "target": args.target, "dev_seed": DEV_SEED,
                "position_gap": {"share": GAP_SHARE, "max": MAX_POSITION_GAP}, "n_used_tokens": len(used),
                "history": history, "train_seconds": round(time.time() - start, 1)}
    save_compact(model, used, Path(args.output), metadata)
    print(f"[train] wrote {args.output} ({Path(args.output).stat().st_size / 2**20:.2f} MiB) after {step} steps",
          flush=True)
    return metadata


# --------------------------------------------------------------------------
# Measurement of the full model, through the project's own rollout and grading
# --------------------------------------------------------------------------

ROLES = {  # role -> (prompt format, sampling) ; eval sampling and the recipe's rollout sampling
    "student (eval prompt, eval sampling)": ("eval", (1.0, 0.95, 0)),
    "student (paper prompt, rollout sampling)": ("student", (1.1, 0.95, 20)),
    "teacher (reference solution, rollout sampling)": ("teacher", (1.1, 0.95, 20)),
}


def first_wrong_step(text: str, item: tasks.Problem) -> int | None:
    """Index of the first worked step whose value is missing or wrong in `text`
    (None when every step's `lhs = value` is present)."""
    for i, (lhs, value) in enumerate(item.steps):
        if f"{lhs} = {value}" not in text:
            return i
    return None


def measure(model_path: str, problems: int, samples: int, seed: int = MEASURE_SEED, batch_size: int = 256) -> dict:
    """Accuracy of each role on the held-out set tiny:SEED:PROBLEMS, and where the
    student's wrong samples go wrong."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.answers import extract_boxed
    from opsd.grading import is_correct
    from opsd.rollout import TransformersBackend
    from opsd.sampling import SamplingSettings

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    renderer = Renderer(tokenizer)
    items = tasks.draw(seed, "eval", problems)
    backend = TransformersBackend(model, pad_token_id=PAD_ID, eos_token_ids=[EOS_ID, PAD_ID], batch_size=batch_size)
    report = {"eval_set": f"tiny:{seed}:{problems}", "samples_per_problem": samples, "roles": {}}
    for role, (fmt, (temperature, top_p, top_k)) in ROLES.items():
        settings = SamplingSettings(temperature, top_p, top_k, max_new_tokens=128, seed=seed)
        out = backend.generate([renderer.prompt(item, fmt) for item in items], settings, n=samples)
        correct, no_box, wrong_step = 0, 0, [0] * 3
        for item, completions in zip(items, out, strict=False):
            for c in completions:
                text = tokenizer.decode(c.ids, skip_special_tokens=True)
                if is_correct(text, str(item.answer)):
                    correct += 1
                elif extract_boxed(text) is None:
                    no_box += 1
                else:
                    step = first_wrong_step(text, item)
                    wrong_step[min(step if step is not None else 2, 2)] += 1
        total = len(items) * samples
        report["roles"][role] = {"accuracy": correct / total, "wrong_without_box": no_box / total,
                                 "wrong_first_bad_step": wrong_step}
        print(f"[measure] {role}: {correct / total:.1%} ({correct}/{total}); wrong with no \\boxed: {no_box}; "
              f"boxed but wrong, first wrong step 1/2/3+: {wrong_step}", flush=True)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsd.research.train_tiny_default",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(WEIGHTS_FILE), help="compact weights file to write")
    parser.add_argument("--measure-only", action="store_true", help="skip training; measure --output")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--min-steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--workers", type=int, default=min(8, max(0, (os.cpu_count() or 1) - 2)),
                        help="DataLoader processes rendering batches (0 = in the main process)")
    parser.add_argument("--dev-problems", type=int, default=512)
    parser.add_argument("--target", type=float, default=0.35,
                        help="stop once the student solves this share of the dev set")
    parser.add_argument("--measure-problems", type=int, default=200)
    parser.add_argument("--measure-samples", type=int, default=4)
    parser.add_argument("--report", help="write the training + measurement report (JSON) here")
    args = parser.parse_args(argv)

    report = {} if args.measure_only else {"training": train(args)}
    from opsd.tiny_default.learned_model import learned_model_dir

    report["measurement"] = measure(str(learned_model_dir(Path(args.output))), args.measure_problems,
                                    args.measure_samples)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
