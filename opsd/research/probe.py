"""Probe on frozen rollouts: score one fixed set of student rollouts under several
configurations, without training (OPSD_EXPERIMENTS.md, "Probe on frozen rollouts").

    python -m opsd.research.probe --preset tiny --rows 8 \\
        --variant clip_mode=token --variant teacher_context=shuffled,beta=0 \\
        [--checkpoint RUN/checkpoint-N] [--save-rollouts R.jsonl | --rollouts R.jsonl] \\
        [--out probe.json] [--attribution A.jsonl]

1. The baseline configuration is resolved exactly as for training (`opsd_train.parse`: the
   tiny preset, `--recipe`, the OPSD_* switches, the flags given here).
2. The student samples one completion for each of the first `--rows` training rows, once,
   with the trainer's own rollout code seeded by `--seed`; or the rollouts are read back
   from a file written by `--save-rollouts`.
3. The baseline and every `--variant` (a comma list of KEY=VALUE over VARIANT_KEYS) score
   the same rollouts: the trainer's scoring forwards (`OPSDTrainer.grouped_scoring_forwards`,
   both roles, the variant's padding geometry, in micro-batches of `--batch-size`) and the loss's own
   per-token function (`opsd.loss.rows_divergence`). Nothing is trained; the student is
   the model with a fresh LoRA adapter, i.e. the trainer's state at its first step, or
   with a run's adapter (`--checkpoint DIR`: checkpoint-N of a run, the trainer's state
   after N steps; its LoRA shape must match, checked before the model loads).

Per variant: the token means over all rollouts of the clipped divergence (`loss`) and of
every diagnostic the trainer logs, under the same names, plus `lp_shift_student` /
`lp_shift_teacher`: the mean |log p(sampled token)| difference between the batched forward
and the same row scored alone (no pads at all), i.e. what the padding geometry moves. One
markdown row per variant goes to stdout, then the per-token attribution summary of the
baseline (`opsd.research.attribution`); `--out` writes every number as JSON and `--attribution` a
sample of per-position records as JSON lines.

Bad input (an unknown variant key or value, a missing or malformed rollouts file, data or
settings the trainer would refuse) is one `error: ...` line on stderr with exit status 2,
before any model loads and before anything is written.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, field

from opsd.answers import reference_answer
from opsd.config import SWITCH_VALUES, ConfigError, parse_recipe_value, parse_switch_value
from opsd.data import DataError, load_train_dataset
from opsd.jsonl import parse_json, read_jsonl, read_text
from opsd.research.attribution import format_summary, pre_box, summarize, token_groups
from opsd.run_folder import write_text_atomic
from opsd.run_log import KL_LINE_FIELDS

# Settings that change how fixed rollouts are scored: the prompts each role sees, the scoring
# geometry and the objective. Sampling settings cannot change frozen rollouts, and
# `temperature` here tempers the loss only (the rollouts keep the baseline's).
VARIANT_KEYS = (
    "teacher_context", "student_prompt", "teacher_thinking", "pad_side",
    "clip_mode", "jsd_token_clip", "beta", "top_k_loss", "temperature",
)
# (table label, JSON key): the trainer's `[OPSD kl]` labels for the divergence diagnostics.
STAT_COLUMNS = tuple((label, key.removeprefix("opsd/")) for label, key in KL_LINE_FIELDS if label != "nll")
SHIFT_KEYS = ("lp_shift_student", "lp_shift_teacher")
DEFAULT_ROWS = 8


def scoring_forwards(trainer, model, inputs, pad_side: str | None = None):
    """The trainer's forwards of both roles for one micro-batch as one group, as its loss sees
    them; under `pad_side`'s geometry when given, the run's otherwise: the probe scores one set of
    rollouts under several, so it lends the trainer a collator of that geometry for the call."""
    collator = trainer.collator
    if pad_side is not None:
        trainer.collator = dataclasses.replace(collator, pad_side=pad_side)
    try:
        return trainer.grouped_scoring_forwards(model, inputs, rows=len(inputs))[0]
    finally:
        trainer.collator = collator


class ProbeError(ValueError):
    """Bad probe input; the message is one line."""


# --------------------------------------------------------------------------
# Input: variants, rollout files
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str
    changes: dict = field(default_factory=dict)


def parse_variant(spec: str) -> Variant:
    """`key=value[,key=value...]` over VARIANT_KEYS, each value parsed and checked as the
    switch variable or recipe line of that name would be."""
    changes, shown = {}, []
    for part in spec.split(","):
        key, sep, raw = (text.strip() for text in part.partition("="))
        if not sep or not key or not raw:
            raise ProbeError(f"--variant {spec!r}: expected KEY=VALUE[,KEY=VALUE...]")
        if key not in VARIANT_KEYS:
            raise ProbeError(f"--variant {spec!r}: unknown key {key!r}; allowed: {', '.join(VARIANT_KEYS)}")
        if key in changes:
            raise ProbeError(f"--variant {spec!r}: {key} is given twice")
        try:
            changes[key] = parse_switch_value(key, raw) if key in SWITCH_VALUES else parse_recipe_value(key, raw)
        except ConfigError as e:
            raise ProbeError(f"--variant {spec!r}: {e}") from None
        shown.append(f"{key}={raw}")
    return Variant(",".join(shown), changes)


@dataclass
class Rollout:
    index: int  # row of the (selected) training data
    problem: str
    completion_ids: list[int]
    truncated: bool = False


def read_rollouts(path: str) -> list[Rollout]:
    """Rollouts of a `--save-rollouts` file: one JSON object per line with `index`,
    `problem`, `completion_ids` (and `truncated`, `completion`, which are optional)."""
    rollouts = []
    for number, record in read_jsonl(path, ProbeError):
        where = f"{path}:{number}"
        for key in ("index", "problem", "completion_ids"):
            if key not in record:
                raise ProbeError(f"{where}: missing {key!r}")
        index, problem, ids = record["index"], record["problem"], record["completion_ids"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ProbeError(f"{where}: 'index' must be a row number >= 0")
        if not isinstance(problem, str):
            raise ProbeError(f"{where}: 'problem' must be text")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                            for i in ids):
            raise ProbeError(f"{where}: 'completion_ids' must be a non-empty list of token ids")
        rollouts.append(Rollout(index, problem, ids, bool(record.get("truncated", False))))
    if not rollouts:
        raise ProbeError(f"{path}: no rollouts in it")
    return rollouts


def _check_rollouts_match(rollouts: list[Rollout], dataset, path: str, vocab_size: int) -> None:
    for number, rollout in enumerate(rollouts, start=1):
        if rollout.index >= len(dataset):
            raise ProbeError(f"{path}: rollout {number} is for row {rollout.index}; the data has {len(dataset)} rows")
        if dataset[rollout.index]["problem"] != rollout.problem:
            raise ProbeError(f"{path}: rollout {number} was sampled for another problem than row {rollout.index} "
                             "of this data (same --data, selection and order needed)")
        if max(rollout.completion_ids) >= vocab_size:
            raise ProbeError(f"{path}: rollout {number} has a token id >= the model's vocabulary size {vocab_size}")


def _check_output(flag: str, path: str | None) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ProbeError(f"{flag} {path}: not a file that can be written (its folder must exist and be writable)")


# --------------------------------------------------------------------------
# Command line and validation (no model)
# --------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other input error
        raise ProbeError(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser(prog: str = "python -m opsd.research.probe") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Score frozen student rollouts under several OPSD "
                "configurations, without training. The baseline is resolved as opsd_train.py resolves a run "
                "(preset < --recipe < OPSD_* switches < flags).")
    p.add_argument("--preset", choices=["tiny"], help="the embedded model and data (as opsd_train.py --preset tiny)")
    p.add_argument("--model", help="model: hub id, local folder, `tiny` (default: the trainer's)")
    p.add_argument("--data", help="training data (default: the trainer's); rows are taken in order")
    p.add_argument("--recipe", help="a recipe file (docs/SPEC.md §6) for the baseline")
    p.add_argument("--seed", type=int, help="training seed: samples the rollouts, draws the shuffled pairing "
                   "(default: the trainer's)")
    p.add_argument("--max-completion-length", type=_positive, help="rollout length limit (default: the config's)")
    p.add_argument("--rows", type=_positive,
                   help=f"rollouts to sample, one for each of the first ROWS rows (default {DEFAULT_ROWS})")
    p.add_argument("--batch-size", type=_positive, default=4,
                   help="scoring micro-batch (the pad gap of right padding depends on it; default 4, the capped "
                   "recipe's per-device batch)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help=f"a configuration to score next to the baseline; keys: {', '.join(VARIANT_KEYS)}")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a run's LoRA checkpoint (checkpoint-N): the student is the model with this adapter "
                        "(it samples the rollouts, unless --rollouts, and is scored); the fixed teacher stays the "
                        "base weights. Its LoRA shape must be the probe's (pass the run's --recipe)")
    p.add_argument("--rollouts", metavar="FILE", help="score the rollouts of this file instead of sampling")
    p.add_argument("--save-rollouts", metavar="FILE", help="write the sampled rollouts here (JSON lines)")
    p.add_argument("--out", metavar="FILE", help="every number as JSON")
    p.add_argument("--attribution", metavar="FILE", help="per-position records of the baseline (JSON lines)")
    p.add_argument("--attribution-positions", type=int, default=200, metavar="K",
                   help="positions in --attribution, a seeded sample (0: all; default 200); the printed "
                   "summary always uses every position")
    p.add_argument("--top", type=_positive, default=5, help="top entries of each distribution per record (default 5)")
    return p


@dataclass
class Plan:
    """Everything resolved and checked before a model loads."""

    args: argparse.Namespace
    script_args: object
    config: object
    variants: list[Variant]
    datasets: dict  # teacher_context -> the training rows prepared for it
    rollouts: list[Rollout] | None  # None: sample them
    indices: list[int]


def prepare(argv: list[str], workdir: str, env=os.environ) -> Plan:
    import opsd_train

    args = build_parser().parse_args(argv)
    if args.rollouts and (args.rows or args.save_rollouts):
        raise ProbeError("--rollouts reads fixed rollouts; --rows and --save-rollouts are for sampling them")
    if args.attribution_positions < 0:
        raise ProbeError("--attribution-positions must be >= 0")
    variants = [Variant("baseline")] + [parse_variant(spec) for spec in args.variant]
    if args.rollouts and not os.path.isfile(args.rollouts):
        raise ProbeError(f"--rollouts {args.rollouts}: no such file")
    outputs = {"--out": args.out, "--save-rollouts": args.save_rollouts, "--attribution": args.attribution}
    for flag, path in outputs.items():
        _check_output(flag, path)
    given = [os.path.abspath(p) for p in outputs.values() if p]
    if len(set(given)) < len(given):
        raise ProbeError("--out, --save-rollouts and --attribution must be different files")

    train_argv = ["--output_dir", workdir, "--report_to", "none", "--use_vllm", "false",
                  "--per_device_train_batch_size", str(args.batch_size)]
    for flag, value in (("--preset", args.preset), ("--model_name_or_path", args.model),
                        ("--dataset_name", args.data), ("--recipe", args.recipe), ("--seed", args.seed),
                        ("--max_completion_length", args.max_completion_length)):
        if value is not None:
            train_argv += [flag, str(value)]
    script_args, config, dataset = opsd_train.parse(train_argv, env=env)
    unsupported = [name for name, on in (("loss_type=sft", config.loss_type != "opsd"),
                                          ("use_tinker_loss", config.use_tinker_loss),
                                          ("reason_first", config.reason_first)) if on]
    if unsupported:
        raise ProbeError(f"the probe scores the divergence objective on fixed prompts; {unsupported[0]} is not "
                         "supported")

    if args.checkpoint:
        check_checkpoint(args.checkpoint, script_args, config)

    datasets = {config.teacher_context: dataset}
    for variant in variants:
        context = variant.changes.get("teacher_context", config.teacher_context)
        if context not in datasets:
            datasets[context] = load_train_dataset(script_args.dataset_name, select=script_args.data_select,
                                                   teacher_context=context, seed=config.seed)
    rollouts = None
    if args.rollouts:
        rollouts = read_rollouts(args.rollouts)
        _check_rollouts_match(rollouts, dataset, args.rollouts, _vocab_size(script_args.model_name_or_path))
        indices = [r.index for r in rollouts]
    else:
        rows = args.rows or DEFAULT_ROWS  # None when not given: --rollouts refuses an explicit --rows
        if rows > len(dataset):
            raise ProbeError(f"--rows {rows}: the data has only {len(dataset)} rows")
        indices = list(range(rows))
    return Plan(args, script_args, config, variants, datasets, rollouts, indices)


ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def check_checkpoint(path: str, script_args, config) -> None:
    """A LoRA checkpoint folder whose adapter has the probe's shape (rank, alpha, target
    modules), else a ProbeError naming what differs; checked before any model loads."""
    from opsd_train import LORA_TARGETS

    where = f"--checkpoint {path}"
    if not os.path.isdir(path):
        raise ProbeError(f"{where}: no such folder")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, name)):
            raise ProbeError(f"{where}: no {name} (a LoRA checkpoint holds both {ADAPTER_CONFIG} and "
                             f"{ADAPTER_WEIGHTS})")
    if config.use_ema_teacher:
        raise ProbeError(f"{where}: the EMA teacher's state is not restored from a checkpoint; "
                         "probe it with fixed_teacher (the default)")
    config_file = f"{where}/{ADAPTER_CONFIG}"
    saved = parse_json(read_text(os.path.join(path, ADAPTER_CONFIG), ProbeError, config_file), ProbeError, config_file)
    expected = {"r": script_args.lora_r, "lora_alpha": script_args.lora_alpha,
                "target_modules": sorted(LORA_TARGETS)}
    found = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
             "target_modules": sorted(saved.get("target_modules") or [])}
    for key, value in expected.items():
        if found[key] != value:
            raise ProbeError(f"{config_file}: {key} is {found[key]}, the probe's LoRA has {value} "
                             "(pass the run's --recipe)")


def load_adapter(model, path: str) -> None:
    """Put the checkpoint's adapter weights into the probe's peft model (same shape, checked)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(os.path.join(path, ADAPTER_WEIGHTS)))
    missing = [key for key in result.missing_keys if "lora_" in key]
    if result.unexpected_keys or missing:
        raise ProbeError(f"--checkpoint {path}/{ADAPTER_WEIGHTS}: does not fit the probe's adapter "
                         f"({(result.unexpected_keys or missing)[0]} "
                         f"{'unexpected' if result.unexpected_keys else 'missing'})")


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig

    from opsd.tiny_default import resolve_model

    return AutoConfig.from_pretrained(resolve_model(model)).vocab_size


# --------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------

def variant_config(config, variant: Variant):
    """The baseline config with the variant's changes (each already parsed and range-checked)."""
    changed = copy.copy(config)
    for key, value in variant.changes.items():
        setattr(changed, key, value)
    return changed


@dataclass
class RowScores:
    """Per completion token of one rollout (all lists of floats, one entry per token)."""

    loss: list
    stats: dict
    lp_student: list  # tempered log-prob of the sampled token, batched forward
    lp_teacher: list
    lp_shift_student: list
    lp_shift_teacher: list
    teacher_top: list  # [(token id, prob), ...] per token
    student_top: list
    p_teacher_answer: list
    p_student_answer: list


def head_logits(hidden, head, dtype):
    """hidden [n, H] -> logits [n, V] in `dtype` (float32 or float64, as the loss computes them)."""
    logits = hidden.to(dtype) @ head.weight.to(dtype).T
    return logits if head.bias is None else logits + head.bias.to(dtype)


def token_scores(student_hidden, teacher_hidden, head, divergence, targets, answer_id: int | None, top: int,
                 chunk_size: int) -> dict:
    """Per-token values of one rollout from both roles' hidden states [n, H]: the clipped
    divergence D_n and diagnostics of `opsd.loss.rows_divergence` (the loss's own function),
    the sampled token's tempered log-prob, top entries and the answer token's probability."""
    import torch

    from opsd.loss import compute_dtype, rows_divergence, tempered_log_probs

    out = {k: [] for k in ("loss", "stats", "lp_student", "lp_teacher", "teacher_top", "student_top",
                           "p_teacher_answer", "p_student_answer")}
    dtype = compute_dtype(student_hidden, teacher_hidden, head.weight)
    for start in range(0, student_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = [head_logits(h[rows], head, dtype) for h in (student_hidden, teacher_hidden)]
        divergence_n, stats = rows_divergence(logits[0], logits[1], divergence)
        student_lp, teacher_lp = (tempered_log_probs(x, divergence.temperature, dtype) for x in logits)
        index = targets[rows].unsqueeze(-1)
        out["loss"].append(divergence_n)
        out["stats"].append(stats)
        out["lp_student"].append(student_lp.gather(-1, index).squeeze(-1))
        out["lp_teacher"].append(teacher_lp.gather(-1, index).squeeze(-1))
        for role, lp in (("teacher", teacher_lp), ("student", student_lp)):
            best = lp.topk(min(top, lp.shape[-1]), dim=-1)
            out[f"{role}_top"] += [list(zip(ids, probs, strict=False)) for ids, probs in
                                   zip(best.indices.tolist(), best.values.exp().tolist(), strict=False)]
            answer = lp[:, answer_id].exp() if answer_id is not None else torch.full_like(lp[:, 0], math.nan)
            out[f"p_{role}_answer"].append(answer)
    tops = ("teacher_top", "student_top")
    result = {k: torch.cat(v).tolist() for k, v in out.items() if k not in ("stats", *tops)}
    result["stats"] = {k: torch.cat([s[k] for s in out["stats"]]).tolist() for k in out["stats"][0]}
    result.update({k: out[k] for k in tops})
    return result


class Scorer:
    """Scores the frozen rollouts under one configuration after another with one model.
    Forwards depend only on the prompts and the padding, so they are computed once and
    shared by variants that change only the objective."""

    def __init__(self, trainer, rows_by_context: dict, completions: list[list[int]], batch_size: int, top: int):
        self.trainer, self.rows_by_context = trainer, rows_by_context
        self.completions, self.batch_size, self.top = completions, batch_size, top
        self.tokenizer = trainer._tokenizer
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        self._forwards: dict = {}
        self._alone: dict = {}

    def _forward(self, key, inputs, pad_side):
        import torch

        if key not in self._forwards:
            with torch.no_grad():
                self._forwards[key] = scoring_forwards(self.trainer, self.model, inputs, pad_side)
        return self._forwards[key]

    def score(self, config) -> tuple[list[RowScores], dict]:
        import torch

        from data_collator import OPSDCollator
        from opsd.batches import DistillBatch
        from opsd.objective import objective_settings
        from opsd.scoring import lm_head

        collator = OPSDCollator.from_config(self.tokenizer, config)  # this configuration's prompts
        rows = self.rows_by_context[config.teacher_context]
        student_ids = collator.student_prompts(rows)
        teacher_ids = collator.teacher_prompts(rows)
        divergence = objective_settings(config).divergence
        head = lm_head(self.model)
        answers = [_first_token(self.tokenizer, reference_answer(row)) for row in rows]
        results, gaps = [], {"student": [], "teacher": []}
        for start in range(0, len(rows), self.batch_size):
            part = range(start, min(start + self.batch_size, len(rows)))
            inputs = DistillBatch([student_ids[i] for i in part], [self.completions[i] for i in part],
                                  teacher_prompt_ids=[teacher_ids[i] for i in part])
            key = (config.pad_side, start, tuple(map(tuple, inputs.student_prompt_ids)),
                   tuple(map(tuple, inputs.teacher_prompt_ids)))
            batched = self._forward(key, inputs, config.pad_side)
            gaps["student"] += batched.student.pad_gap.tolist()
            gaps["teacher"] += batched.teacher.pad_gap.tolist()
            for b, i in enumerate(part):
                n = len(self.completions[i])
                targets = torch.tensor(self.completions[i], device=batched.student_hidden.device)
                with torch.no_grad():
                    scores = token_scores(batched.student_hidden[b, :n], batched.teacher_hidden[b, :n], head,
                                          divergence, targets, answers[i], self.top,
                                          config.loss_chunk_size)
                    alone = self._alone_log_probs(i, student_ids[i], teacher_ids[i], head, divergence, targets)
                results.append(RowScores(
                    **scores,
                    lp_shift_student=[abs(a - b) for a, b in zip(scores["lp_student"], alone[0], strict=False)],
                    lp_shift_teacher=[abs(a - b) for a, b in zip(scores["lp_teacher"], alone[1], strict=False)],
                ))
        return results, gaps

    def _alone_log_probs(self, i, student_prompt, teacher_prompt, head, divergence, targets):
        """The sampled tokens' tempered log-probs with row i scored alone: a batch of one has no
        pads under either geometry, so this is where the padding's effect is measured from."""
        from opsd.batches import DistillBatch
        from opsd.loss import compute_dtype, tempered_log_probs

        key = (i, tuple(student_prompt), tuple(teacher_prompt), divergence.temperature)
        if key not in self._alone:
            inputs = DistillBatch([student_prompt], [self.completions[i]], teacher_prompt_ids=[teacher_prompt])
            alone, n = scoring_forwards(self.trainer, self.model, inputs), len(self.completions[i])
            self._alone[key] = []
            for hidden in (alone.student_hidden[0, :n], alone.teacher_hidden[0, :n]):
                dtype = compute_dtype(hidden, head.weight)
                lp = tempered_log_probs(head_logits(hidden, head, dtype), divergence.temperature, dtype)
                self._alone[key].append(lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
        return self._alone[key]


def _first_token(tokenizer, answer: str | None) -> int | None:
    ids = tokenizer.encode(answer, add_special_tokens=False) if answer else []
    return ids[0] if ids else None


def summarize_variant(variant: Variant, config, scores: list[RowScores], gaps: dict) -> dict:
    def mean(values):
        return math.fsum(values) / len(values) if values else 0.0

    def flat(get):
        return [value for row in scores for value in get(row)]

    row = {"name": variant.name, "changes": dict(variant.changes),
           "settings": {k: getattr(config, k) for k in VARIANT_KEYS},
           "tokens": sum(len(r.loss) for r in scores), "loss": mean(flat(lambda r: r.loss))}
    for _, key in STAT_COLUMNS:
        row[key] = mean(flat(lambda r, key=key: r.stats[key]))
    row["lp_shift_student"] = mean(flat(lambda r: r.lp_shift_student))
    row["lp_shift_teacher"] = mean(flat(lambda r: r.lp_shift_teacher))
    row["pad_gap_student_mean"] = mean(gaps["student"])
    row["pad_gap_teacher_mean"] = mean(gaps["teacher"])
    return row


# --------------------------------------------------------------------------
# Attribution records
# --------------------------------------------------------------------------

def attribution_records(tokenizer, rollouts: list[Rollout], rows: list, scores: list[RowScores]) -> list[dict]:
    """One record per completion token of the baseline scoring (opsd.research.attribution's input)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    records = []
    for r, (rollout, row, s) in enumerate(zip(rollouts, rows, scores, strict=False)):
        pieces = [text(t) for t in rollout.completion_ids]
        groups, before_box = token_groups(pieces), pre_box(pieces)
        answer_id = _first_token(tokenizer, reference_answer(row))
        for j, token_id in enumerate(rollout.completion_ids):
            records.append({
                "rollout": r, "row": rollout.index, "position": j, "token_id": token_id, "token": pieces[j],
                "group": groups[j], "true_kl": s.stats["true_kl"][j], "loss": s.loss[j],
                "loss_unclipped": s.stats["loss_unclipped"][j],
                "clipped_teacher_mass": s.stats["clipped_teacher_mass"][j],
                "teacher_top": [[text(i), p] for i, p in s.teacher_top[j]],
                "student_top": [[text(i), p] for i, p in s.student_top[j]],
                "pre_box": before_box[j],
                "answer_token": None if answer_id is None else text(answer_id),
                "sampled_is_answer_token": token_id == answer_id,
                "p_teacher_answer": None if answer_id is None else s.p_teacher_answer[j],
                "p_student_answer": None if answer_id is None else s.p_student_answer[j],
            })
    return records


def sample_positions(count: int, keep: int, seed: int) -> list[int]:
    """`keep` of `count` record indices, seeded and in order (all of them when keep is 0 or >= count)."""
    if keep == 0 or keep >= count:
        return list(range(count))
    return sorted(random.Random(seed).sample(range(count), keep))


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def format_table(rows: list[dict]) -> str:
    columns = [("loss", "loss"), *STAT_COLUMNS, *((key, key) for key in SHIFT_KEYS)]
    lines = ["| variant | tokens | " + " | ".join(label for label, _ in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for row in rows:
        lines.append(f"| {row['name']} | {row['tokens']} | " + " | ".join(f"{row[key]:.4g}" for _, key in columns)
                     + " |")
    return "\n".join(lines)


def run(plan: Plan) -> tuple[str, dict, list[dict]]:
    """Load the model, sample or read the rollouts, score every variant; returns the printed
    text, the JSON report and the attribution records."""
    import torch

    import opsd_train
    from opsd_trainer import OPSDTrainer

    args, config = plan.args, plan.config
    started = time.time()
    model, tokenizer = opsd_train.build_model_and_tokenizer(plan.script_args)
    trainer = OPSDTrainer(model=model, args=config, train_dataset=plan.datasets[config.teacher_context],
                          processing_class=tokenizer, peft_config=opsd_train.lora_config(plan.script_args))
    if args.checkpoint:
        load_adapter(trainer.model, args.checkpoint)
    rows_by_context = {ctx: [data[i] for i in plan.indices] for ctx, data in plan.datasets.items()}
    baseline_rows = rows_by_context[config.teacher_context]
    if plan.rollouts is None:
        prompts = trainer.collator.student_prompts(baseline_rows)
        trainer.sampling = dataclasses.replace(trainer.sampling, seed=config.seed)
        with torch.no_grad():
            completions, truncated = trainer._sample(prompts)  # the trainer's own rollout code, seeded
        rollouts = [Rollout(i, row["problem"], ids, cut)
                    for i, row, ids, cut in zip(plan.indices, baseline_rows, completions, truncated, strict=False)]
        print(f"[probe] sampled {len(rollouts)} rollouts in {time.time() - started:.1f} s", file=sys.stderr)
        if args.save_rollouts:
            write_text_atomic(args.save_rollouts, "".join(json.dumps({
                "index": r.index, "problem": r.problem, "completion_ids": r.completion_ids,
                "truncated": r.truncated, "completion": tokenizer.decode(r.completion_ids)}) + "\n" for r in rollouts))
    else:
        rollouts = plan.rollouts
    scorer = Scorer(trainer, rows_by_context, [r.completion_ids for r in rollouts], args.batch_size, args.top)
    table_rows, baseline_scores = [], None
    for variant in plan.variants:
        variant_started = time.time()
        variant_cfg = variant_config(config, variant)
        scores, gaps = scorer.score(variant_cfg)
        baseline_scores = baseline_scores or scores
        table_rows.append(summarize_variant(variant, variant_cfg, scores, gaps))
        print(f"[probe] scored {variant.name} in {time.time() - variant_started:.1f} s", file=sys.stderr)
    records = attribution_records(tokenizer, rollouts, baseline_rows, baseline_scores)
    summary = summarize(records)
    lengths = [len(r.completion_ids) for r in rollouts]
    report = {
        "model": plan.script_args.model_name_or_path, "checkpoint": args.checkpoint,
        "data": plan.script_args.dataset_name,
        "data_select": plan.script_args.data_select, "seed": config.seed, "batch_size": args.batch_size,
        "rollouts": {"source": args.rollouts or "sampled", "count": len(rollouts), "tokens": sum(lengths),
                     "mean_length": sum(lengths) / len(lengths), "max_length": max(lengths),
                     "truncated": sum(r.truncated for r in rollouts)},
        "variants": table_rows,
        "attribution": summary,
    }
    text = f"{format_table(table_rows)}\n\n{format_summary(summary)}"
    return text, report, records


def main(argv: list[str] | None = None, prog: str = "python -m opsd.research.probe") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser(prog).print_help()
        return 0
    with tempfile.TemporaryDirectory(prefix="opsd-probe-") as workdir:
        try:
            plan = prepare(argv, workdir)
        except (ConfigError, DataError, ValueError) as e:  # ProbeError, recipe and data errors among them
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        with redirect_stdout(sys.stderr):  # stdout carries the table and the summary only
            text, report, records = run(plan)
    print(text)
    args = plan.args
    if args.out:
        write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    if args.attribution:
        keep = sample_positions(len(records), args.attribution_positions, plan.config.seed)
        write_text_atomic(args.attribution, "".join(json.dumps(records[i]) + "\n" for i in keep))
    return 0


if __name__ == "__main__":
    from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly

    sys.exit(exit_status(main))
