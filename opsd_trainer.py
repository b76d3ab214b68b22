"""OPSDTrainer: On-Policy Self-Distillation on top of TRL's DistillationTrainer.

One network, two roles, every optimizer step:

1. rollout  - the student (LoRA on) samples a completion from the student prompt;
2. teacher  - the same network scores [teacher prompt + that completion] under
              no_grad, with the weights chosen by `fixed_teacher` (adapter
              disabled), `use_ema_teacher` (EMA of the adapter) or neither (live);
3. student  - scores [student prompt + the same completion] with gradients;
4. loss     - the clipped divergence of `opsd.loss` between the two next-token
              distributions at every completion position.

What we take from the base class: the sampler that generates once per
gradient-accumulation window, vLLM colocate/server generation with LoRA weight
sync, metric averaging and the training loop. What we replace: prompt building
(two prompts per row, our padding geometry), the transformers rollout, and the
loss (per-entry clip, which TRL's fused divergence cannot express).

The same step runs the baselines: each arm (`ARMS`, chosen once from `loss_type`) rolls a
generation batch out into its typed batch (opsd.batches) and names the second forward. OPSD
as above (its off-policy steps, GKD's `lmbda`, take the reference solution as the completion);
SFT always the reference solution, and the teacher's forward only with `sft_teacher_diagnostics`;
GRPO samples each prompt `num_generations` times, rewards and no teacher (with `grpo_beta`, the
KL's reference: its own prompt, the adapter disabled).

This file is the trainer; its parts live in the method library: the config
(opsd.train_config), the objective (opsd.objective), the batches (opsd.batches), each role's
prompts and padding geometry (data_collator.py, on opsd.prompts and opsd.scoring), the scoring
forwards (opsd.scoring), the callbacks (opsd.callbacks), staged checkpoints (opsd.checkpoints)
and their card (opsd.model_card); the patches of TRL's vLLM code in opsd.rollout.trl_patches.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from contextlib import contextmanager, nullcontext

import torch
from accelerate.utils import is_peft_model
from transformers.trainer_callback import ProgressCallback
from trl import DistillationTrainer
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import RepeatSampler

from data_collator import OPSDCollator
from opsd import model_card, run_folder
from opsd.adapter_layers import AdapterLayers
from opsd.batches import DistillBatch, GRPOBatch, RolloutBatch
from opsd.callbacks import CollapseWatch, EMAUpdate, ProgressBarOnly, RunLog, StopOnSignal
from opsd.checkpoints import StagedCheckpoint
from opsd.ema_teacher import EMA_FILE, AdapterEMA
from opsd.grpo import group_advantages, reward_stats
from opsd.model_utils import checkpointing_is_on, peft_wrapping, set_checkpointing
from opsd.objective import EOS_STAT_KEYS, RowRewards, build_objective, objective_settings
from opsd.rewards import grader_rewards
from opsd.rollout import TransformersBackend, kv_cache_options, vllm_environment
from opsd.rollout.compiled_layers import CompiledLayers
from opsd.rollout.trl_patches import sync_merged_lora, trl_vllm_engine_options
from opsd.run_log import BACKWARD_TOKENS_KEY, FORWARD_TOKENS_KEY, SAMPLED_TOKENS_KEY
from opsd.sampling import ROLLOUT_STREAMS, SamplingSettings, on_policy_step, rollout_seed, to_completion
from opsd.scoring import (
    ScoringForwards,
    bf16_autocast,
    check_alignment,
    completion_hidden_states,
    lm_head,
    to_device,
)
from opsd.train_config import OPSDConfig, resolve_engine_defaults


def _mean_stats(names: list[str], values: torch.Tensor) -> torch.Tensor:
    """[stat] The mean over dim 0 of `values` [part, stat]: nanmean for the EOS log-probs (a part with no
    completion that ended with EOS has none: NaN), a plain mean for every other stat, so that a NaN there
    (a broken step) shows in the log instead of vanishing from the average."""
    means, nanmeans = values.mean(0), values.nanmean(0)
    return torch.stack([nanmeans[i] if name in EOS_STAT_KEYS else means[i] for i, name in enumerate(names)])


class NonFiniteLossError(RuntimeError):
    """Raised to stop the run when the loss is NaN or infinite."""


# ---------------------------------------------------------------------- arms
# Each arm of the comparison is how a generation batch is rolled out into its typed batch
# (opsd.batches) and which second, no-grad forward scores its completions besides the student.
# The trainer picks one, once, from `loss_type` (ARMS); its step never asks which arm it runs.


class Arm:
    """What an arm says; the defaults are an arm with no sampler, second forward or rewards of its own."""

    batch_type: type[RolloutBatch]
    second_role: str  # how the `[OPSD align]` line names the second forward (or says there is none)

    def __init__(self, trainer: OPSDTrainer):
        self.trainer = trainer

    def train_sampler(self, dataset):
        """The arm's own sampler, None for DistillationTrainer's (each prompt once)."""
        return None

    def rollout(self, rows: list[dict]) -> RolloutBatch:
        raise NotImplementedError

    def second_prompts(self, batch: RolloutBatch) -> list[list[int]] | None:
        """The prompts of the second, no-grad forward over the same completions; None: none."""
        return None

    def second_weights(self, unwrapped):
        """The weights of the second forward, for the duration of the block."""
        return nullcontext()

    def rewards(self, batch: RolloutBatch, device) -> RowRewards | None:
        """The rows' rewards the objective reads (GRPO's), on `device`; None for the others."""
        return None


class OPSDArm(Arm):
    """OPSD: the student samples a completion from its prompt (on the off-policy steps of GKD's
    `lmbda`, the reference solution is the completion); the teacher, the same network with the
    teacher's weights (`_teacher_weights`), scores it under the privileged prompt (with
    `reason_first`, after its own analysis of the reference)."""

    batch_type = DistillBatch
    second_role = "teacher"

    def completions(self, rows: list[dict], student_ids: list[list[int]]):
        """The completions, whether each was truncated, and the sampling's wall time (None: not sampled)."""
        t = self.trainer
        if on_policy_step(t.args.seed, t.state.global_step, t.args.lmbda):
            return t._timed_sample(student_ids)
        return *t._reference_completions(rows), None

    def rollout(self, rows: list[dict]) -> DistillBatch:
        t = self.trainer
        student_ids = t.collator.student_prompts(rows)
        completions, truncated, seconds = self.completions(rows, student_ids)
        rationales = t._teacher_rationales(rows) if t.args.reason_first else [None] * len(rows)
        batch = DistillBatch(student_ids, completions, teacher_prompt_ids=t.collator.teacher_prompts(rows, rationales))
        t._log_rollout(student_ids, completions, truncated, seconds)
        t._log_pass_tokens(batch)
        return batch

    def second_prompts(self, batch: DistillBatch) -> list[list[int]]:
        return batch.teacher_prompt_ids

    def second_weights(self, unwrapped):
        return self.trainer._teacher_weights(unwrapped)


class SFTArm(OPSDArm):
    """SFT, the supervised baseline: the reference solution is always the completion (nothing
    sampled). The teacher's forward would feed only the KL diagnostics: it runs only with
    `sft_teacher_diagnostics`."""

    def __init__(self, trainer: OPSDTrainer):
        super().__init__(trainer)
        self.diagnostics = bool(trainer.args.sft_teacher_diagnostics)
        self.second_role = "teacher (diagnostics only)" if self.diagnostics else \
            "no teacher (SFT; --sft_teacher_diagnostics runs it)"

    def completions(self, rows: list[dict], student_ids: list[list[int]]):
        return *self.trainer._reference_completions(rows), None

    def second_prompts(self, batch: DistillBatch) -> list[list[int]] | None:
        return batch.teacher_prompt_ids if self.diagnostics else None


class GRPOArm(Arm):
    """GRPO, the RL baseline: `num_generations` samples of each prompt in one generation batch
    (`train_sampler`), each rewarded by the evaluation's grader; the advantages are normalised
    over the generation batch of all processes (gathered in sampler order, as TRL does), each
    process keeping its own rows'. No teacher: with `grpo_beta` the KL's reference, the network
    with its adapter disabled, scores the student's own prompts, as GRPO's reference model does."""

    batch_type = GRPOBatch

    def __init__(self, trainer: OPSDTrainer):
        super().__init__(trainer)
        self.kl = bool(trainer.args.grpo_beta)
        self.second_role = "reference (adapter disabled, GRPO's KL)" if self.kl else "no teacher (GRPO)"

    def train_sampler(self, dataset):
        """Each prompt num_generations times in a row within one generation batch (TRL's
        GRPOTrainer sampler)."""
        t, args = self.trainer, self.trainer.args
        generation_batch = args.per_device_train_batch_size * t.accelerator.num_processes \
            * args.gradient_accumulation_steps
        return RepeatSampler(
            data_source=dataset,
            mini_repeat_count=args.num_generations,
            batch_size=generation_batch // args.num_generations,
            repeat_count=args.gradient_accumulation_steps,
            shuffle=t.shuffle_dataset,
            seed=args.seed,
        )

    def rollout(self, rows: list[dict]) -> GRPOBatch:
        t, args, accelerator = self.trainer, self.trainer.args, self.trainer.accelerator
        student_ids = t.collator.student_prompts(rows)
        completions, truncated, seconds = t._timed_sample(student_ids)
        texts = t._tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = torch.tensor(grader_rewards(texts, truncated, rows), dtype=torch.float32)
        everyone = accelerator.gather(rewards.to(accelerator.device))
        advantages = group_advantages(everyone, args.num_generations, args.scale_rewards)
        for name, value in reward_stats(everyone, args.num_generations, advantages, args.scale_rewards).items():
            t._metrics[t._mode][f"grpo/{name}"].append(value.item())
        n, rank = len(rows), accelerator.process_index
        total = t._log_rollout(student_ids, completions, truncated, seconds)
        batch = GRPOBatch(student_ids, completions, advantages=advantages[rank * n:(rank + 1) * n].cpu(),
                          # dapo's normaliser: the generation batch's completion tokens, per process and micro-batch
                          num_items=(total / (accelerator.num_processes * args.gradient_accumulation_steps)).cpu())
        t._log_pass_tokens(batch)
        return batch

    def second_prompts(self, batch: GRPOBatch) -> list[list[int]] | None:
        return batch.student_prompt_ids if self.kl else None

    def second_weights(self, unwrapped):
        return self.trainer._adapters(unwrapped).disabled()

    def rewards(self, batch: GRPOBatch, device) -> RowRewards:
        return RowRewards(batch.advantages.to(device), batch.num_items.to(device))


ARMS: dict[str, type[Arm]] = {"opsd": OPSDArm, "sft": SFTArm, "grpo": GRPOArm}  # loss_type -> arm


class OPSDTrainer(DistillationTrainer):
    # The loss is a token mean over each micro-batch (docs/SPEC.md §2), so the Trainer must
    # still divide by the number of accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, model, args: OPSDConfig, train_dataset, processing_class, peft_config=None, callbacks=None,
                 stop_request=None, base_model_name: str | None = None):
        engine_options = nullcontext()
        if args.use_vllm:
            vllm_environment(training=True)  # before TRL builds the engine
            if args.vllm_mode == "colocate":
                engine_options = trl_vllm_engine_options(**kv_cache_options(args.vllm_kv_cache_gib))
        with peft_wrapping(), engine_options:  # TRL wraps the model in peft here
            super().__init__(
                model=model,
                teacher_model=None,  # the teacher is this same network
                args=args,
                train_dataset=train_dataset,
                processing_class=processing_class,
                peft_config=peft_config,
                callbacks=callbacks,
            )
        if (args.fixed_teacher or args.use_ema_teacher) and not is_peft_model(self.model):
            raise ValueError(
                "fixed_teacher / use_ema_teacher need a LoRA (peft) student: the teacher is the base weights "
                "with the adapter disabled or swapped, never a second model copy"
            )
        sharded = self.is_deepspeed_enabled or self.is_fsdp_enabled
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        resolve_engine_defaults(args, sharded, zero_stage)  # the engine is chosen in accelerate's config
        self.collator = OPSDCollator.from_config(self._tokenizer, args)  # each role's prompts and padding
        self.objective_settings = objective_settings(args, self.eos_token_ids)
        self.objective = build_objective(self.objective_settings)
        self.arm = ARMS[args.loss_type](self)  # the one place the trainer reads the loss type
        self.sampling = SamplingSettings(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_completion_length,
        )
        if self.use_vllm and is_peft_model(self.model) and not sharded:
            sync_merged_lora(self.vllm_generation)  # sharded runs keep TRL's path (it gathers first)
        self.ema = AdapterEMA(self.model, args.ema_decay) if args.use_ema_teacher else None
        if self.ema is not None:
            self.add_callback(EMAUpdate(self.ema))
        self.collapse_warning: dict | None = None  # the evidence once CollapseWatch has warned
        # First, so that RunLog and every tracker's callback see its field in the step's logs.
        self.callback_handler.callbacks.insert(0, CollapseWatch(self, args.clip_mode))
        self.add_callback(RunLog(os.path.join(args.output_dir, run_folder.METRICS_FILE)))
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(ProgressBarOnly())
        self.stopped_by_signal: int | None = None
        if stop_request is not None:
            self.add_callback(StopOnSignal(self, stop_request))
        self.base_model_name = base_model_name
        self._alignment_checked = False
        self._staging: StagedCheckpoint | None = None  # the checkpoint being saved
        self._compiled_layers: CompiledLayers | None = None
        self._adapter_layers: AdapterLayers | None = None
        self._sampled_tokens: int | None = None  # tokens/sampled; read from the log history at the first rollout
        self._pass_tokens: list[int] | None = None  # tokens/forward, tokens/backward; as _sampled_tokens
        self._unchecked_losses: list[torch.Tensor] = []  # micro-batch losses not yet checked on the host
        self._pending_stats: dict[str, list] = {"train": [], "eval": []}  # (names, device values) not yet logged

    # ------------------------------------------------------------------ rollout

    @property
    def _mode(self) -> str:
        """The metrics' split: "train" while the model trains, else "eval"."""
        return "train" if self.model.training else "eval"

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        """The arm's rollout of this process's rows, as the dict TRL's `_prepare_inputs` buffers,
        shuffles and splits into micro-batches (which `_prepare_inputs` below types again)."""
        return self.arm.rollout(inputs).to_dict()

    def _prepare_inputs(self, generation_batch) -> RolloutBatch:
        """This micro-batch, as the arm's batch type: TRL samples once per gradient-accumulation
        window and hands out its micro-batches (in evaluation, each batch is its own rollout)."""
        return self.arm.batch_type.from_dict(super()._prepare_inputs(generation_batch))

    def _get_train_sampler(self, dataset=None):
        """The arm's sampler (GRPO's repeats each prompt), else DistillationTrainer's (each prompt once)."""
        sampler = self.arm.train_sampler(self.train_dataset if dataset is None else dataset)
        return sampler if sampler is not None else super()._get_train_sampler(dataset)

    def _timed_sample(self, prompt_ids: list[list[int]]):
        """`_sample` and its wall time (the previous step's queued GPU work excluded)."""
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)  # the previous step's queued work is not sampling
        started = time.perf_counter()
        completions, truncated = self._sample(prompt_ids)  # host lists: no GPU work left pending
        return completions, truncated, time.perf_counter() - started

    def _sample(self, prompt_ids: list[list[int]], stream: str = ROLLOUT_STREAMS[0]):
        """Student rollouts (`stream` "student": vLLM through TRL's helper, else our transformers
        backend) or reason_first's analyses (always transformers).

        This process's rows, seeded per (seed, rank, step, stream) on the transformers backend.
        vLLM seeds its own engine: by rank in colocate mode (TRL), by the server in server mode."""
        settings = self.sampling
        if stream == "reason_first":
            settings = dataclasses.replace(settings, max_new_tokens=self.args.reason_first_max_tokens)
        elif self.use_vllm:
            samples = [  # syncs the LoRA weights first
                to_completion(ids, self.eos_token_ids) for ids in self._generate_single_turn(prompt_ids, None, {})
            ]
            return [s.ids for s in samples], [s.truncated for s in samples]
        seed = rollout_seed(self.args.seed, self.accelerator.process_index, self.state.global_step, stream)
        settings = dataclasses.replace(settings, seed=seed)
        with self._unwrapped_for_generation() as unwrapped, torch.no_grad():
            backend = TransformersBackend(
                unwrapped,
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_ids=self.eos_token_ids,
                batch_size=len(prompt_ids),
                cache_implementation=self.args.rollout_cache_implementation,
                merge_lora=self.args.rollout_merge_lora,
            )
            samples = backend.generate(prompt_ids, settings, n=1)
        return [s[0].ids for s in samples], [s[0].truncated for s in samples]

    @contextmanager
    def _unwrapped_for_generation(self):
        """The model without wrappers and with activation checkpointing off (it disables the KV cache).

        TRL's `unwrap_model_for_generation` does the same through the deprecated
        `gradient_checkpointing_*` names (a FutureWarning per call); it is kept for
        ZeRO-3, which needs its parameter gathering."""
        if self.is_deepspeed_enabled:
            with unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped:
                yield unwrapped
            return
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        checkpointing = checkpointing_is_on(unwrapped)
        if checkpointing:
            set_checkpointing(unwrapped, False)
        try:
            yield unwrapped
        finally:
            if checkpointing:
                set_checkpointing(unwrapped, True, self.args.gradient_checkpointing_kwargs)

    def _reference_completions(self, rows: list[dict]):
        limit = self.args.max_completion_length
        eos = self._tokenizer.eos_token_id
        completions, truncated = [], []
        for row in rows:
            ids = self._tokenizer(row["solution"], add_special_tokens=False)["input_ids"]
            truncated.append(len(ids) >= limit)
            completions.append(ids[: limit - 1] + [eos])
        return completions, truncated

    def _teacher_rationales(self, rows: list[dict]) -> list[str]:
        """reason_first: the teacher (its own weights) first analyses the reference."""
        prompt_ids = self.collator.reason_first_prompts(rows)
        with self._teacher_weights(self.accelerator.unwrap_model(self.model)):
            ids, _ = self._sample(prompt_ids, stream="reason_first")
        return self._tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _log_rollout(self, prompt_ids: list[list[int]], completions: list[list[int]], truncated: list[bool],
                     seconds: float | None) -> torch.Tensor:
        """Log the generation batch's rollout metrics (`seconds`: the sampling's wall time, None
        when nothing was sampled); returns its completion tokens over all processes (a float
        tensor on the device)."""
        device = self.accelerator.device
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
        lengths = self.accelerator.gather(lengths.to(device)).float()
        truncated = self.accelerator.gather(torch.tensor(truncated).to(device)).float()
        prompt_tokens = self.accelerator.gather(torch.tensor([sum(map(len, prompt_ids))], device=device)).sum()
        total = lengths.sum()
        mode = self._mode
        if mode == "train":
            self.state.num_input_tokens_seen += int(prompt_tokens.item() + total.item())
            # The student's sampled completion tokens, cumulative over the run (all processes).
            if self._sampled_tokens is None:  # a resumed run continues its logged count
                logged = [r[SAMPLED_TOKENS_KEY] for r in self.state.log_history if SAMPLED_TOKENS_KEY in r]
                self._sampled_tokens = int(logged[-1]) if logged else 0
            self._sampled_tokens += int(total.item()) if seconds is not None else 0
            self._metrics[mode][SAMPLED_TOKENS_KEY] = [self._sampled_tokens]
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        self._metrics[mode]["completions/mean_length"].append(lengths.mean().item())
        self._metrics[mode]["completions/max_length"].append(lengths.max().item())
        self._metrics[mode]["completions/truncated_ratio"].append(truncated.mean().item())
        if seconds is not None:  # this process's own figure (not gathered), sampled steps only
            self._metrics[mode]["timing/rollout_s"].append(seconds)
        return total

    def _log_pass_tokens(self, batch: RolloutBatch) -> None:
        """Log the run's cumulative forward and backward tokens (all processes) after this
        generation batch: the student's forward and backward over prompt + completion of each
        row, and the arm's second forward over its prompts + the same completions (the
        teacher's for OPSD, and for SFT with `sft_teacher_diagnostics`, which reads it for its
        KL diagnostics only; GRPO's reference over the student's prompts when its KL is on,
        `grpo_beta`).
        Real tokens only: padding and the rollouts' own forwards are not counted (the rollouts
        are `tokens/sampled`)."""
        if not self.model.training:
            return
        completions = batch.completion_ids
        student = sum(len(p) + len(c) for p, c in zip(batch.student_prompt_ids, completions, strict=True))
        teacher = 0
        if (second := self.arm.second_prompts(batch)) is not None:
            teacher = sum(len(p) + len(c) for p, c in zip(second, completions, strict=True))
        counts = self.accelerator.gather(torch.tensor([[student + teacher, student]], device=self.accelerator.device))
        forward, backward = (int(v) for v in counts.sum(0).tolist())
        if self._pass_tokens is None:  # a resumed run continues its logged counts
            logged = [r for r in self.state.log_history if FORWARD_TOKENS_KEY in r and BACKWARD_TOKENS_KEY in r]
            self._pass_tokens = [int(logged[-1][FORWARD_TOKENS_KEY]), int(logged[-1][BACKWARD_TOKENS_KEY])] \
                if logged else [0, 0]
        self._pass_tokens = [self._pass_tokens[0] + forward, self._pass_tokens[1] + backward]
        self._metrics["train"][FORWARD_TOKENS_KEY] = [self._pass_tokens[0]]
        self._metrics["train"][BACKWARD_TOKENS_KEY] = [self._pass_tokens[1]]

    # ------------------------------------------------------------------ loss

    @contextmanager
    def _teacher_weights(self, unwrapped):
        """Select the teacher's weights for the duration of the block."""
        if self.ema is not None:
            with self.ema.swapped_in(unwrapped):
                yield
        elif self.args.fixed_teacher:
            with self._adapters(unwrapped).disabled():
                yield
        else:
            yield  # live weights: teacher and student differ only by their context

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss. Neither the loss nor the stats are read on the host here:
        reading a value waits for the GPU, and a wait per micro-batch leaves the GPU idle
        while the host prepares the next one. The step's losses are checked in its last
        micro-batch (`check_losses_finite`), the stats are read when the step is logged (`log`)."""
        unwrapped = self.accelerator.unwrap_model(model)
        # Through the DDP/FSDP wrapper so that its forward hooks fire before backward.
        loss, stats = self._forward_redirection(model, unwrapped, self._opsd_loss, unwrapped, inputs)
        mode = self._mode
        names = list(stats)
        gathered = self.accelerator.gather(torch.stack([stats[k].float() for k in names]).unsqueeze(0))
        values = _mean_stats(names, gathered)
        self._pending_stats[mode].append((names, values))
        self._unchecked_losses.append(loss.detach())
        # Once per optimizer step, in its last micro-batch and before that one's backward, so no
        # update follows whichever engine steps the optimizer (DeepSpeed's engine steps inside
        # the backward). In evaluation, at once.
        if mode == "eval" or self.accelerator.sync_gradients:
            self.check_losses_finite()
        return (loss, None) if return_outputs else loss

    def check_losses_finite(self) -> None:
        """Stop the run (NonFiniteLossError) if a micro-batch loss since the last check is NaN
        or infinite (called by `compute_loss` in each step's last micro-batch, so no update is
        applied from such a step); with several processes all of them stop together."""
        if not self._unchecked_losses:
            return
        losses = torch.stack(self._unchecked_losses).float()
        self._unchecked_losses = []
        bad = (~torch.isfinite(losses)).any().float()
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, "max")
        if bad.item():
            value = next((v for v in losses.tolist() if not math.isfinite(v)), "on another process")
            last = run_folder.last_checkpoint(self.args.output_dir)
            step = self.state.global_step + (1 if self.model.training else 0)  # evaluation follows its step
            raise NonFiniteLossError(
                f"non-finite loss ({value}) at step {step}; last good checkpoint: {last[1] if last else 'none'}"
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Read the micro-batches' OPSD stats (kept on the device by `compute_loss`) into
        the metrics TRL averages and logs: one wait for the GPU per logged step."""
        mode = self._mode
        pending = self._pending_stats[mode]
        if pending:
            read = iter(torch.cat([values for _, values in pending]).tolist())
            for names, _ in pending:
                for name in names:
                    self._metrics[mode][f"opsd/{name}"].append(next(read))
            pending.clear()
        super().log(logs, start_time)

    def _opsd_loss(self, unwrapped, batch: RolloutBatch):
        """The micro-batch's loss and stats: the mean over its token-mean groups (one group
        unless `token_mean_rows` splits it), each group's loss a token mean of its own."""
        head = lm_head(unwrapped)
        rewards = self.arm.rewards(batch, self.accelerator.device)  # GRPO's (one group: token_mean_rows is refused)
        results = [self.objective(s.student_hidden, s.teacher_hidden, s.student, head, rewards)
                   for s in self.grouped_scoring_forwards(unwrapped, batch)]
        if len(results) == 1:
            return results[0]
        losses, stats = zip(*results, strict=True)
        names = list(stats[0])
        return torch.stack(losses).mean(), dict(zip(names, _mean_stats(names, torch.stack(
            [torch.stack([s[k] for k in names]) for s in stats])), strict=True))

    def grouped_scoring_forwards(self, unwrapped, batch: RolloutBatch, rows: int | None = None
                                 ) -> list[ScoringForwards]:
        """The student's forward of one micro-batch and the arm's second, no-grad forward (the
        teacher's; GRPO's reference with its KL; none for GRPO without), in groups of `rows` rows
        (default `token_mean_rows`, else the whole micro-batch). Each group is padded as a
        micro-batch of its own; all groups go through one forward per role (`one_forward`)."""
        device = self.accelerator.device
        completions = batch.completion_ids
        rows = rows or self.args.token_mean_rows or len(completions)
        groups = [slice(start, start + rows) for start in range(0, len(completions), rows)]

        def batches(prompts):
            return [to_device(self.collator.scoring_batch(prompts[g], completions[g]), device) for g in groups]

        second = self.arm.second_prompts(batch)
        students = batches(batch.student_prompt_ids)
        teachers = batches(second) if second is not None else [None] * len(groups)
        if not self._alignment_checked:
            for student, teacher, g in zip(students, teachers, groups, strict=True):
                self._report_alignment(student, teacher, completions[g])

        with (bf16_autocast(self._adapters(unwrapped), enabled=bool(self.args.bf16)),
              self._scoring_layers(unwrapped)):
            # Teacher first: the EMA teacher swaps adapter values in place (and back), which
            # must not happen between the student's forward and its backward (autograd checks
            # the versions of saved tensors).
            teacher_hidden = [None] * len(groups)  # GRPO without a KL: the student alone
            if second is not None:
                with torch.no_grad(), self.arm.second_weights(unwrapped):
                    teacher_hidden = completion_hidden_states(unwrapped, teachers, self.collator.pad_id)
            student_hidden = completion_hidden_states(unwrapped, students, self.collator.pad_id)
        return [ScoringForwards(*four) for four in zip(students, teachers, student_hidden, teacher_hidden, strict=True)]

    def _adapters(self, unwrapped) -> AdapterLayers:
        """The model's adapter layers, listed at the first use with this model (peft's own
        switches walk the whole model each time: opsd/adapter_layers.py)."""
        if self._adapter_layers is None or self._adapter_layers.model is not unwrapped:
            self._adapter_layers = AdapterLayers(unwrapped)
        return self._adapter_layers

    def _scoring_layers(self, unwrapped):
        """Compiled decoder layers for the scoring forwards (`compile_layers`), else nothing."""
        if not self.args.compile_layers:
            return nullcontext()
        if self._compiled_layers is None:
            self._compiled_layers = CompiledLayers(unwrapped)
        return self._compiled_layers.active()

    def _report_alignment(self, student, teacher, completions) -> None:
        """The `[OPSD align]` self-check: both forwards (`teacher`: the arm's second one, or None)
        supervise exactly the sampled tokens."""
        student_msg = check_alignment(student, completions)
        teacher_part = self.arm.second_role  # how the line names the second forward, or its absence
        if teacher is not None:
            teacher_part += f": {check_alignment(teacher, completions)}"
            if not torch.equal(student.completion_mask, teacher.completion_mask):
                raise AssertionError("[OPSD align] student and teacher supervise different completion spans")
        if self.accelerator.is_main_process:
            print(f"[OPSD align] pad_side={student.pad_side} student: {student_msg} | {teacher_part}")
        self._alignment_checked = True

    # ------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint=None, **kwargs):
        # Nothing carried over from an earlier call that stopped between a loss and its check or log.
        self._unchecked_losses = []
        self._pending_stats = {"train": [], "eval": []}
        if self.ema is not None and isinstance(resume_from_checkpoint, str):
            path = os.path.join(resume_from_checkpoint, EMA_FILE)
            if os.path.exists(path):
                self.ema.load_state_dict(torch.load(path, map_location="cpu"))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _get_output_dir(self, trial):
        # During a save the Trainer writes checkpoint-N under the staging folder (opsd.checkpoints).
        return self._staging.root if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """Write `checkpoint-N` whole or not at all: staged, then renamed into place; a failed
        write stops the run with CheckpointWriteError (opsd.checkpoints)."""
        stage = StagedCheckpoint(super()._get_output_dir(trial), self.state.global_step)
        self._staging = stage
        try:
            with stage.writing():
                super()._save_checkpoint(model, trial)
                if self.args.should_save:
                    stage.add_run_files(self.ema.state_dict() if self.ema is not None else None)
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            stage.move_into_place(self.args.save_total_limit)
            if self.state.best_model_checkpoint == stage.staged:
                self.state.best_model_checkpoint = stage.final
            if self.base_model_name:  # the run folder's card: its newest checkpoint, until the final adapter
                model_card.write_card(self._card_data(stage.final, checkpoint=True), into=stage.run_dir)
        self.accelerator.wait_for_everyone()

    def _save(self, output_dir=None, state_dict=None):
        """The adapter and the tokenizer (transformers' save; `AutoTokenizer.from_pretrained(folder)`
        loads it), then the project's part: the base model as what loads and the project's card
        in place of peft's template (opsd.model_card.finish_adapter_folder)."""
        super()._save(output_dir, state_dict=state_dict)
        folder = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self.base_model_name:
            final = self._staging.final_folder(folder) if self._staging is not None else None
            model_card.finish_adapter_folder(folder, self._card_data(final or folder, checkpoint=final is not None))

    def _card_data(self, folder: str, checkpoint: bool) -> model_card.CardData:
        dataset = self.train_dataset
        problem = dataset[0]["problem"] if dataset is not None and len(dataset) else ""
        return model_card.card_data(folder, base_model=self.base_model_name, run_dir=self.args.output_dir,
                                    step=self.state.global_step, log_history=self.state.log_history, problem=problem,
                                    checkpoint=checkpoint)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The project's card (opsd.model_card), not TRL's template (which TRL's _save_checkpoint
        writes into the run folder): the run folder gets its card with each checkpoint
        (`_save_checkpoint`) and with the final adapter (`_save`)."""
