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
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import rotate_checkpoints
from trl import DistillationConfig, DistillationTrainer
from trl.models.utils import unwrap_model_for_generation

from data_collator import (
    OPSDCollator,
    ScoringBatch,
    build_scoring_batch,
    check_alignment,
    gather_completion_positions,
    one_forward,
    select_completion_tokens,
)
from opsd import model_card, run_log
from opsd import run_folder as run_folder
from opsd.adapter_layers import AdapterLayers
from opsd.chunked_loss import chunked_divergence_loss, chunked_nll_loss, chunked_tinker_loss
from opsd.config import (
    CLIP_MODES,
    PAD_SIDES,
    REPORT_TO_VALUES,
    STUDENT_PROMPTS,
    TEACHER_CONTEXT_HELP,
    TEACHER_CONTEXTS,
    VLLM_TEMPERATURE_RANGE,
    Recipe,
    recipe_field,
    recipe_value_problem,
)
from opsd.ema_teacher import AdapterEMA
from opsd.loss import divergence_loss, nll_loss, tinker_loss
from opsd.model_utils import causal_lm, checkpointing_is_on, model_device, peft_wrapping, set_checkpointing
from opsd.run_log import append_metrics, kl_line
from opsd.sampling import ROLLOUT_STREAMS, SamplingSettings, on_policy_step, rollout_seed, to_completion
from rollout import BackendUnavailable, TransformersBackend, kv_cache_options, vllm_environment
from rollout.compiled_layers import CompiledLayers
from rollout.static_decode import GRAPH_LOOPS
from rollout.vllm_weights import merged_named_parameters
from tiny_default import TINY, TINY_RANDOM, resolve_model

EMA_FILE = "ema_adapter.pt"
STAGING_DIR = run_folder.STAGING_DIR  # checkpoints are written here, then renamed into place
# Fault injection for the tests: seconds to sleep inside each checkpoint save, after the
# staged files are written and before the rename, so a test can kill -9 the run there.
SAVE_PAUSE_VARIABLE = "OPSD_TEST_PAUSE_IN_SAVE"
RECIPE_KEYS = tuple(f.name for f in dataclasses.fields(Recipe))
LOSS_TYPES = ("opsd", "sft")
# Without it, sequence lengths that are not a multiple of 8 made the compiled layers
# recompile (about 10 s each) in the first steps of a run on the H200 (BENCHMARKS.md).
SCORING_PAD_MULTIPLE = 16


@dataclass
class OPSDConfig(DistillationConfig):
    """DistillationConfig plus the OPSD knobs (docs/SPEC.md §2, §3, §6).

    `temperature`, `top_p`, `top_k`, `beta` and `max_completion_length` are the
    base class's fields: one temperature serves sampling and the loss, as in the
    released recipe. Defaults are the released recipe's (docs/SPEC.md §6), so a run without
    a recipe file is the released configuration.
    """

    # Recipe keys (docs/SPEC.md §6): default, help and range are declared once, in opsd.config.Recipe.
    # Some are base-class fields whose defaults differ in the released recipe.
    learning_rate: float = recipe_field("learning_rate")
    lr_scheduler_type: str = recipe_field("lr_scheduler_type")
    max_grad_norm: float = recipe_field("max_grad_norm")
    beta: float = recipe_field("beta")
    temperature: float = recipe_field("temperature")
    top_p: float = recipe_field("top_p")
    top_k: int = recipe_field("top_k")
    max_completion_length: int | None = recipe_field("max_completion_length")
    jsd_token_clip: float | None = recipe_field("jsd_token_clip")
    teacher_thinking: bool = recipe_field("teacher_thinking")
    fixed_teacher: bool = recipe_field("fixed_teacher")
    use_ema_teacher: bool = recipe_field("use_ema_teacher")
    ema_decay: float = recipe_field("ema_decay")
    reason_first: bool = recipe_field("reason_first")
    top_k_loss: int = recipe_field("top_k_loss")
    use_tinker_loss: bool = recipe_field("use_tinker_loss")
    lmbda: float = recipe_field("lmbda")

    logging_steps: float = field(default=1)
    # Declared here (opsd.config.REPORT_TO_VALUES) so that no tracker starts unless asked for,
    # whatever transformers' own default is; OPSD_REPORT_TO or --report_to choose one.
    report_to: None | str | list[str] = field(
        default=REPORT_TO_VALUES[0],
        metadata={"help": f"Where the logs also go, OPSD diagnostics included: {', '.join(REPORT_TO_VALUES)} "
                          "(OPSD_REPORT_TO), or another transformers integration."},
    )
    # TRL checkpoints activations by default; say it under transformers' new name (the old one
    # warns there). transformers 5.17 (vLLM's range) reads only the old name: __post_init__ maps it.
    gradient_checkpointing: bool | None = field(default=None)
    activation_checkpointing: bool | None = field(default=True)

    clip_mode: str = field(  # the values: opsd.config.CLIP_MODES; each one's clip: opsd.loss.CLIPS
        default=CLIP_MODES[0],
        metadata={"help": f"The clip of the divergence (OPSD_CLIP_MODE): {', '.join(CLIP_MODES)}; "
                          f"{CLIP_MODES[0]} is the released one."}
    )
    pad_side: str = field(default=PAD_SIDES[0], metadata={"help": "right (released, pad gap) or left (contiguous)."})
    student_prompt: str = field(default=STUDENT_PROMPTS[0], metadata={"help": "paper or eval."})
    teacher_context: str = field(
        default=TEACHER_CONTEXTS[0],
        metadata={"help": "The teacher's privileged context: " + "; ".join(
            f"{value}: {what}" for value, what in TEACHER_CONTEXT_HELP.items()) + "."},
    )
    reason_first_max_tokens: int = field(default=512, metadata={"help": "Length limit of the reason_first analysis."})
    loss_type: str = field(
        default=LOSS_TYPES[0],
        metadata={
            "help": "opsd (the distillation loss) or sft: the baseline OPSD is compared with, cross-entropy on "
            "the reference solutions with the same prompts, budget and LoRA (no rollouts; lmbda is ignored)."
        },
    )
    max_prompt_length: int | None = field(default=None, metadata={"help": "Student prompt limit (warns only)."})
    max_teacher_prompt_length: int | None = field(
        default=None, metadata={"help": "Teacher prompt limit; the privileged context is truncated to fit."}
    )
    loss_implementation: str = field(
        default="auto",
        metadata={
            "help": "chunked (hidden states, low memory), logits (full logits) or auto: chunked, except under "
            "DeepSpeed ZeRO-3, which leaves the LM head's weight partitioned where the chunked loss reads it."
        },
    )
    loss_chunk_size: int = field(default=1024, metadata={"help": "Tokens per chunk of the chunked loss."})
    token_mean_rows: int | None = field(
        default=None,
        metadata={
            "help": "Rows that share one token mean and one padding geometry (docs/SPEC.md §2). None: the "
            "micro-batch (per_device_train_batch_size), as released. A divisor of the micro-batch scores its "
            "groups in one forward: --per_device_train_batch_size 16 --gradient_accumulation_steps 2 "
            "--token_mean_rows 4 is the 4 x 8 recipe's loss and gradient (up to kernel rounding) in fewer, "
            "larger forwards: faster on a GPU, more memory (BENCHMARKS.md)."
        },
    )
    pad_to_multiple_of: int | str | None = field(
        default=None,
        metadata={
            "help": "Scoring sequences get masked pads after the completion up to a multiple of this (the loss "
            f"is unchanged; compiled layers see few, aligned shapes). None / auto: {SCORING_PAD_MULTIPLE} when "
            "CUDA is available, else off; 0 / none = off."
        },
    )
    compile_loss: bool | None = field(
        default=None,
        metadata={"help": "torch.compile the chunked loss's per-chunk math (None: on when CUDA is available)."},
    )
    compile_layers: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile the decoder layers for the two scoring forwards of each step (None: on when "
            "CUDA is available, unless fsdp, deepspeed or torch_compile is set). The first steps compile."
        },
    )
    rollout_cache_implementation: str | None = field(
        default="auto",
        metadata={
            "help": "transformers rollouts (when vLLM is off): auto (CUDA: graph_compiled, the compiled and "
            "recorded static-cache decode loop, measured fastest in BENCHMARKS.md; CPU: the dynamic cache), "
            "graph_compiled, graph, static (generate + static cache), paged (transformers' continuous batching over "
            "a bounded paged KV cache, rollout/paged_decode.py; meant for long evaluations) or dynamic / None "
            "(generate + dynamic cache)."
        },
    )
    rollout_merge_lora: bool = field(
        default=True,
        metadata={
            "help": "graph / graph_compiled rollouts sample the student from a copy of the adapted weights with the "
            "LoRA delta merged in (rebuilt out of place before every rollout; the base weights, i.e. the "
            "teacher, are only read): one matmul per projection instead of three. Costs one copy of the adapted "
            "weights in memory; False samples through the unmerged adapters."
        },
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={
            "help": "DDP's find_unused_parameters. False: the student's forward uses every LoRA parameter at every "
            "step, whatever the loss (tested), so DDP need not walk the autograd graph each step to find unused "
            "ones (transformers would turn it on for a peft model)."
        },
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Dropout off: both roles see one network."})
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={"help": "transformers' filter of non-finite micro-batch losses in the logged loss. Off: a "
                          "non-finite loss stops an OPSD run before its optimizer step, so there is nothing to "
                          "filter, and the filter would make the host wait for the GPU at every micro-batch."},
    )
    remove_unused_columns: bool | None = field(default=False, metadata={"help": "Rows keep their privileged columns."})
    vllm_kv_cache_gib: float | None = field(
        default=None,
        metadata={"help": "vLLM colocate: a KV cache of this many GiB instead of vllm_gpu_memory_utilization's "
                          "profiled share of the GPU (vLLM's kv_cache_memory_bytes). vLLM measures the device's free "
                          "memory while it profiles at start, so other processes allocating or exiting meanwhile "
                          "shrink its cache or fail its start: use this when several runs share one GPU."},
    )

    def __post_init__(self):
        if self.bf16 is None and not torch.cuda.is_available():
            self.bf16 = False  # the base default (bf16) fails on CPU-only machines
        if not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # nothing to pin to; torch warns at every epoch otherwise
        if self.pad_to_multiple_of is None or str(self.pad_to_multiple_of).strip().lower() == "auto":
            self.pad_to_multiple_of = default_scoring_pad_multiple()
        # Compilation pays off on the GPU (BENCHMARKS.md); on CPU it only costs compile time.
        if self.compile_loss is None:
            self.compile_loss = torch.cuda.is_available()
        # compile_layers is resolved below; OPSDTrainer, which also sees sharding chosen in
        # accelerate's config, may switch a default (never an explicit) True off.
        self.compile_layers_is_default = self.compile_layers is None
        # Likewise, OPSDTrainer may turn an automatic chunked loss into the full-logit one (ZeRO-3).
        self.loss_implementation_is_default = self.loss_implementation == "auto"
        if self.loss_implementation_is_default:
            self.loss_implementation = "chunked"
        low, high = VLLM_TEMPERATURE_RANGE
        if self.use_vllm and not low <= self.temperature <= high:  # else vLLM fails at the first rollout
            raise ValueError(f"temperature={self.temperature}: vLLM rollouts need a temperature in [{low}, {high}]")
        if self.vllm_kv_cache_gib is not None and not (self.use_vllm and self.vllm_mode == "colocate"
                                                       and self.vllm_kv_cache_gib > 0):
            raise ValueError(f"vllm_kv_cache_gib={self.vllm_kv_cache_gib}: a size > 0 for vLLM colocate rollouts "
                             "(--use_vllm true --vllm_mode colocate)")
        if not TRAINER_READS_ACTIVATION_CHECKPOINTING and self.gradient_checkpointing is None:
            # Without this, transformers 5.17 would read gradient_checkpointing=None: silently off.
            self.gradient_checkpointing = bool(self.activation_checkpointing)
        super().__post_init__()  # TRL turns the CLI's "none" / "32" into None / 32
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 0:
            raise ValueError(f"pad_to_multiple_of must be >= 0, got {self.pad_to_multiple_of}")
        self.pad_to_multiple_of = self.pad_to_multiple_of or None  # 0 = off
        if self.compile_layers is None:
            # Never tried with sharded parameters or with the Trainer compiling the whole model: off there.
            plain = not (self.fsdp or self.deepspeed or self.torch_compile)
            self.compile_layers = torch.cuda.is_available() and plain
        choices = {
            "clip_mode": CLIP_MODES,
            "pad_side": PAD_SIDES,
            "student_prompt": STUDENT_PROMPTS,
            "teacher_context": TEACHER_CONTEXTS,
            "loss_implementation": ("chunked", "logits"),
            "loss_type": LOSS_TYPES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        self.check_combinations()
        for name in RECIPE_KEYS:  # the ranges a recipe file is held to hold for flags too
            if name == "temperature" and not self.use_vllm:
                continue  # the recipe's range is vLLM's (checked above); transformers samples any > 0
            problem = recipe_value_problem(name, getattr(self, name, None))
            if problem:
                raise ValueError(problem)
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} is out of range; must be > 0")


    def check_combinations(self) -> None:
        """Settings that exclude each other. Run again once the OPSD_* switches are applied
        to a parsed config (opsd_train.apply_switches sets them after __post_init__)."""
        if self.fixed_teacher and self.use_ema_teacher:
            raise ValueError("fixed_teacher and use_ema_teacher are mutually exclusive")
        if self.reason_first and self.teacher_context == "none":
            raise ValueError("reason_first needs a reference to analyse; teacher_context=none has none")
        rows = self.token_mean_rows
        if rows is not None and (rows < 1 or self.per_device_train_batch_size % rows):
            raise ValueError(f"token_mean_rows={rows}: must be a positive divisor of per_device_train_batch_size="
                             f"{self.per_device_train_batch_size}")


# Newer transformers (5.24) declare and read `activation_checkpointing`; 5.17's Trainer reads
# only `gradient_checkpointing`, and OPSDConfig's field of the new name is ours alone there.
TRAINER_READS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {
    f.name for f in dataclasses.fields(TrainingArguments)}


def default_scoring_pad_multiple() -> int | None:
    """What `pad_to_multiple_of` None / "auto" means: SCORING_PAD_MULTIPLE with CUDA, off on CPU."""
    return SCORING_PAD_MULTIPLE if torch.cuda.is_available() else None


class ScoringForwards(NamedTuple):
    """One micro-batch scored by both roles: each role's ScoringBatch and its final hidden
    states [B, C, H] at the positions that predict the completion tokens."""

    student: ScoringBatch
    teacher: ScoringBatch
    student_hidden: torch.Tensor
    teacher_hidden: torch.Tensor


class NonFiniteLossError(RuntimeError):
    """Raised to stop the run when the loss is NaN or infinite."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, folder not writable); earlier ones are intact."""


class _EMAUpdate(TrainerCallback):
    def __init__(self, ema: AdapterEMA):
        self.ema = ema

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ema.update(model)


class _RunLog(TrainerCallback):
    """`[OPSD kl]` line and metrics.jsonl from the very dict that goes to report_to.

    The end-of-training summary (train_runtime, ...) is left out of metrics.jsonl,
    which holds one record per step; the console gets its own summary line."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        line = kl_line(state.global_step, logs)
        if line:
            run_log.print_line(line)  # on its own line, above or below the progress bar
        append_metrics(self.path, state.global_step, logs)


class _CollapseWatch(TrainerCallback):
    """The collapse warning (opsd.run_log.CollapseSignature): once per run, the first step whose
    logged metrics match the signature prints one `[OPSD warn]` line and gets
    `opsd/collapse_warning: 1` in its metrics (metrics.jsonl, the trackers, trainer_state.json's
    log history); `trainer.collapse_warning` holds the evidence. Training goes on. First in the
    callback list, so every logger sees the field. A resumed run replays its log history, so the
    early level is the run's own and a run that already warned does not warn again."""

    def __init__(self, trainer: OPSDTrainer, clip_mode: str):
        self.trainer, self.clip_mode = trainer, clip_mode
        self.detector = None

    def on_train_begin(self, args, state, control, **kwargs):
        share_key = run_log.COLLAPSE_SHARE_KEYS[self.clip_mode]
        self.detector = run_log.CollapseDetector(share_key, run_log.COLLAPSE_SIGNATURE)
        for record in state.log_history:
            if "step" in record and record["step"] <= state.global_step and run_log.KL_KEY in record:
                self.detector.update(record["step"], record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs or self.detector is None:
            return
        evidence = self.detector.update(state.global_step, logs)
        if evidence is None:
            return
        self.trainer.collapse_warning = evidence
        logs[run_log.COLLAPSE_FIELD] = 1
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1][run_log.COLLAPSE_FIELD] = 1  # Trainer.log stored a copy already
        run_log.print_line(run_log.collapse_line(evidence))


class _ProgressBarOnly(ProgressCallback):
    """The progress bar without its printed copy of every log dict (the `[OPSD kl]` line is the one line)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class _StopOnSignal(TrainerCallback):
    """Ends training at a step boundary with a checkpoint once a signal was received
    (opsd_train._StopRequest records it). With several processes the request is
    shared, so every rank stops at the same step."""

    def __init__(self, trainer: OPSDTrainer, request):
        self.trainer, self.request = trainer, request

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.request.signum or 0
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            signum = int(accelerator.reduce(torch.tensor([signum], device=accelerator.device), "max").item())
        if signum:
            self.trainer.stopped_by_signal = signum
            control.should_save = True
            control.should_training_stop = True


@contextmanager
def trl_vllm_engine_options(**options):
    """Extra keyword arguments for the `vllm.LLM` that TRL's colocate mode builds (TRL 1.16's
    VLLMGeneration passes a fixed set and has no hook): inside the block its module's `LLM` is
    `LLM` with `options` bound. Nothing happens without options."""
    if not options:
        yield
        return
    import functools

    from trl.generation import vllm_generation

    original = getattr(vllm_generation, "LLM", None)
    if original is None:
        raise BackendUnavailable("TRL's vLLM colocate mode is not available (vLLM missing?)")
    vllm_generation.LLM = functools.partial(original, **options)
    try:
        yield
    finally:
        vllm_generation.LLM = original


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
        apply_engine_defaults(args, sharded, zero_stage)  # the engine is chosen in accelerate's config
        self.collator = make_collator(self._tokenizer, args)
        self.objective = make_objective(args)
        self.sampling = SamplingSettings(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_completion_length,
        )
        if self.use_vllm and is_peft_model(self.model) and not sharded:
            # Merge LoRA out of place for vLLM: TRL's in-place merge/unmerge would perturb the bf16
            # base weights, i.e. the fixed teacher, a little at every sync. Sharded runs keep TRL's
            # path (it gathers the parameters first), and with it that drift (README).
            self.vllm_generation._iter_named_params = lambda: merged_named_parameters(self.vllm_generation.model)
        self.ema = AdapterEMA(self.model, args.ema_decay) if args.use_ema_teacher else None
        if self.ema is not None:
            self.add_callback(_EMAUpdate(self.ema))
        self.collapse_warning: dict | None = None  # the evidence once _CollapseWatch has warned
        # First, so that _RunLog and every tracker's callback see its field in the step's logs.
        self.callback_handler.callbacks.insert(0, _CollapseWatch(self, args.clip_mode))
        self.add_callback(_RunLog(os.path.join(args.output_dir, run_folder.METRICS_FILE)))
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(_ProgressBarOnly())
        self.stopped_by_signal: int | None = None
        if stop_request is not None:
            self.add_callback(_StopOnSignal(self, stop_request))
        self.base_model_name = base_model_name
        self._alignment_checked = False
        self._staging_root: str | None = None
        self._compiled_layers: CompiledLayers | None = None
        self._adapter_layers: AdapterLayers | None = None
        self._unchecked_losses: list[torch.Tensor] = []  # micro-batch losses not yet checked on the host
        self._pending_stats: dict[str, list] = {"train": [], "eval": []}  # (names, device values) not yet logged

    # ------------------------------------------------------------------ rollout

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        """Build both prompts for every row and sample the student's completions.

        Returns per-row token lists; padding happens per micro-batch in
        `_opsd_loss`, so each micro-batch is padded only to its own maximum.
        """
        rows = inputs
        student_ids = [self.collator.student_prompt_ids(row) for row in rows]
        seconds = None  # wall time of the student's sampling, on steps that sample
        if self.args.loss_type == "sft":  # supervised baseline: always the reference solution
            completions, truncated = self._reference_completions(rows)
        elif on_policy_step(self.args.seed, self.state.global_step, self.args.lmbda):
            if self.accelerator.device.type == "cuda":
                torch.cuda.synchronize(self.accelerator.device)  # the previous step's queued work is not sampling
            started = time.perf_counter()
            completions, truncated = self._sample(student_ids)  # host lists: no GPU work left pending
            seconds = time.perf_counter() - started
        else:  # off-policy batch (GKD's lmbda): the reference solution is the completion
            completions, truncated = self._reference_completions(rows)
        rationales = self._teacher_rationales(rows) if self.args.reason_first else [None] * len(rows)
        teacher_ids = [self.collator.teacher_prompt_ids(row, rationale=r) for row, r in zip(rows, rationales)]
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
        self._log_rollout(student_ids, lengths, torch.tensor(truncated), seconds)
        # The first value must be a tensor: TRL's split_tensor_dict reads its shape.
        return {
            "completion_lengths": lengths,
            "student_prompt_ids": student_ids,
            "teacher_prompt_ids": teacher_ids,
            "completion_ids": completions,
        }

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
        prompt_ids = [self.collator.reason_first_prompt_ids(row) for row in rows]
        with self._teacher_weights(self.accelerator.unwrap_model(self.model)):
            ids, _ = self._sample(prompt_ids, stream="reason_first")
        return self._tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _log_rollout(self, prompt_ids, lengths: torch.Tensor, truncated: torch.Tensor,
                     seconds: float | None) -> None:
        device = self.accelerator.device
        lengths = self.accelerator.gather(lengths.to(device)).float()
        truncated = self.accelerator.gather(truncated.to(device)).float()
        prompt_tokens = self.accelerator.gather(torch.tensor([sum(map(len, prompt_ids))], device=device)).sum()
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self.state.num_input_tokens_seen += int(prompt_tokens.item() + lengths.sum().item())
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        self._metrics[mode]["completions/mean_length"].append(lengths.mean().item())
        self._metrics[mode]["completions/max_length"].append(lengths.max().item())
        self._metrics[mode]["completions/truncated_ratio"].append(truncated.mean().item())
        if seconds is not None:  # this process's own figure (not gathered), sampled steps only
            self._metrics[mode]["timing/rollout_s"].append(seconds)

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
        mode = "train" if self.model.training else "eval"
        names = list(stats)
        values = self.accelerator.gather(torch.stack([stats[k].float() for k in names]).unsqueeze(0)).mean(0)
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
        mode = "train" if self.model.training else "eval"
        pending = self._pending_stats[mode]
        if pending:
            read = iter(torch.cat([values for _, values in pending]).tolist())
            for names, _ in pending:
                for name in names:
                    self._metrics[mode][f"opsd/{name}"].append(next(read))
            pending.clear()
        super().log(logs, start_time)

    def _opsd_loss(self, unwrapped, inputs):
        """The micro-batch's loss and stats: the mean over its token-mean groups (one group
        unless `token_mean_rows` splits it), each group's loss a token mean of its own."""
        head = lm_head(unwrapped)
        results = [self.objective(s.student_hidden, s.teacher_hidden, s.student, head)
                   for s in self.grouped_scoring_forwards(unwrapped, inputs)]
        if len(results) == 1:
            return results[0]
        losses, stats = zip(*results)
        return torch.stack(losses).mean(), {k: torch.stack([s[k] for s in stats]).mean() for k in stats[0]}

    def scoring_forwards(self, unwrapped, inputs, pad_side: str | None = None) -> ScoringForwards:
        """Both roles' forwards of one micro-batch (per-row prompt and completion token lists),
        as the loss sees them, as one group. `pad_side` overrides the run's geometry (the probe
        scores one set of rollouts under several; research/probe.py)."""
        rows = len(inputs["completion_ids"])
        return self.grouped_scoring_forwards(unwrapped, inputs, pad_side=pad_side, rows=rows)[0]

    def grouped_scoring_forwards(self, unwrapped, inputs, pad_side: str | None = None,
                                 rows: int | None = None) -> list[ScoringForwards]:
        """Both roles' forwards of one micro-batch, in groups of `rows` rows (default
        `token_mean_rows`, else the whole micro-batch). Each group is padded as a micro-batch of
        its own; all groups go through one forward per role (`one_forward`)."""
        device = self.accelerator.device
        completions = inputs["completion_ids"]
        rows = rows or self.args.token_mean_rows or len(completions)
        groups = [slice(start, start + rows) for start in range(0, len(completions), rows)]
        geometry = {
            "pad_id": self._tokenizer.pad_token_id,
            "pad_side": pad_side or self.args.pad_side,
            "pad_to_multiple_of": self.args.pad_to_multiple_of,
        }

        def batches(role):
            return [_to_device(build_scoring_batch(inputs[f"{role}_prompt_ids"][g], completions[g], **geometry), device)
                    for g in groups]

        students, teachers = batches("student"), batches("teacher")
        if not self._alignment_checked:
            for student, teacher, g in zip(students, teachers, groups):
                self._report_alignment(student, teacher, completions[g])

        with (bf16_autocast(self._adapters(unwrapped), enabled=bool(self.args.bf16)),
              self._scoring_layers(unwrapped)):
            # Teacher first: the EMA teacher swaps adapter values in place (and back), which
            # must not happen between the student's forward and its backward (autograd checks
            # the versions of saved tensors).
            with torch.no_grad(), self._teacher_weights(unwrapped):
                teacher_hidden = completion_hidden_states(unwrapped, teachers, geometry["pad_id"])
            student_hidden = completion_hidden_states(unwrapped, students, geometry["pad_id"])
        return [ScoringForwards(*four) for four in zip(students, teachers, student_hidden, teacher_hidden)]

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
        """The `[OPSD align]` self-check: both roles supervise exactly the sampled tokens."""
        student_msg = check_alignment(student, completions)
        teacher_msg = check_alignment(teacher, completions)
        if not torch.equal(student.completion_mask, teacher.completion_mask):
            raise AssertionError("[OPSD align] student and teacher supervise different completion spans")
        if self.accelerator.is_main_process:
            print(f"[OPSD align] pad_side={student.pad_side} student: {student_msg} | teacher: {teacher_msg}")
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
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """Write `checkpoint-N` under a staging folder, then rename it into place.

        A run killed mid-save leaves only the staging folder, which resume ignores
        (and the next run removes), so the newest `checkpoint-N` is always complete.
        A failed write (disk full, not writable) removes its partial copy and stops
        the run with CheckpointWriteError; earlier checkpoints are untouched.
        """
        run_dir = super()._get_output_dir(trial)
        self._staging_root = os.path.join(run_dir, STAGING_DIR)
        name = f"checkpoint-{self.state.global_step}"
        staged, final = os.path.join(self._staging_root, name), os.path.join(run_dir, name)
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                if self.ema is not None:
                    torch.save(self.ema.state_dict(), os.path.join(staged, EMA_FILE))
                config = os.path.join(run_dir, run_folder.CONFIG_FILE)
                if os.path.isfile(config):  # the run's identity travels with each checkpoint
                    shutil.copy2(config, os.path.join(staged, run_folder.CONFIG_FILE))
                _test_pause_in_save(name)
        except OSError as e:
            shutil.rmtree(staged, ignore_errors=True)
            _remove_if_empty(self._staging_root)
            last = run_folder.last_checkpoint(run_dir)
            reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise CheckpointWriteError(
                f"cannot write {name} in {run_dir} ({reason}); earlier checkpoints are intact "
                f"(last: {last[1] if last else 'none'})"
            ) from None
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staged, final)
            _remove_if_empty(os.path.join(run_dir, STAGING_DIR))
            if self.state.best_model_checkpoint == staged:
                self.state.best_model_checkpoint = final
            rotate_checkpoints(run_dir, save_total_limit=self.args.save_total_limit, use_mtime=False)
            if self.base_model_name:  # the run folder's card: its newest checkpoint, until the final adapter
                model_card.write_card(self.card_data(final, checkpoint=True), into=run_dir)
        self.accelerator.wait_for_everyone()

    def _save(self, output_dir=None, state_dict=None):
        """The adapter and the tokenizer (transformers' save; `AutoTokenizer.from_pretrained(folder)`
        loads it), then the adapter config's base model set to what loads (`adapter_base`) and
        the project's card (opsd.model_card) in place of peft's template."""
        super()._save(output_dir, state_dict=state_dict)
        folder = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self.base_model_name:
            name_adapter_base_model(folder, self.adapter_base)
            root = self._staging_root
            staged = root is not None and os.path.dirname(os.path.abspath(folder)) == os.path.abspath(root)
            final = os.path.join(os.path.dirname(root), os.path.basename(folder)) if staged else folder
            model_card.write_card(self.card_data(final, checkpoint=staged), into=folder)

    @property
    def adapter_base(self) -> str:
        """The base model as adapter_config.json names it: what `from_pretrained` loads from
        anywhere (`tiny` / `tiny-random`: their folder in the cache, absolute)."""
        if self.base_model_name in EMBEDDED_MODELS:
            return os.path.abspath(resolve_model(self.base_model_name))
        return self.base_model_name

    def card_data(self, folder: str, checkpoint: bool) -> model_card.CardData:
        config = run_folder.read_config(self.args.output_dir) or {}
        problem = self.train_dataset[0]["problem"] if self.train_dataset is not None and len(self.train_dataset) else ""
        return model_card.CardData(
            folder=os.path.abspath(folder), base_model=self.base_model_name, adapter_base=self.adapter_base,
            run_config=config, step=self.state.global_step, metrics=model_card.last_metrics(self.state.log_history),
            problem=problem, checkpoint=checkpoint)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The project's card (opsd.model_card), not TRL's template (which TRL's _save_checkpoint
        writes into the run folder): the run folder gets its card with each checkpoint
        (`_save_checkpoint`) and with the final adapter (`_save`)."""


EMBEDDED_MODELS = (TINY, TINY_RANDOM)  # tiny_default's models: a folder in its cache (resolve_model)


def name_adapter_base_model(folder: str, base_model: str) -> None:
    """`base_model_name_or_path` of the adapter in `folder` set to `base_model` (peft records
    the folder the weights were loaded from, relative when they were given so)."""
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("base_model_name_or_path") != base_model:
        config["base_model_name_or_path"] = base_model
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True))  # as peft writes it


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # absent, or still holds another rank's or another save's files


def _test_pause_in_save(name: str) -> None:
    seconds = float(os.environ.get(SAVE_PAUSE_VARIABLE) or 0)
    if seconds > 0:
        print(f"[OPSD test] pausing {seconds:g} s inside the save of {name}", flush=True)
        sys.stdout.flush()
        time.sleep(seconds)


def apply_engine_defaults(args: OPSDConfig, sharded: bool, zero_stage: int | None) -> None:
    """Adapt the defaults that assume whole parameters in every process (never an explicit
    choice) to the engine of the run: `sharded` under FSDP or DeepSpeed, `zero_stage` DeepSpeed's
    stage (None without it). OPSDTrainer calls it once, before the loss is chosen.

    - compile_layers off: compiled decoder layers were never tried with an engine that wraps
      the layers' parameters (FSDP gathers them in hooks around each layer, DeepSpeed owns the
      forward and backward);
    - transformers rollouts (vLLM off) on `generate` with the dynamic cache: the CUDA-graph
      decode loop would record the hooks' gathers of sharded parameters into its graph. Under
      FSDP an explicit graph loop is refused (both failed on two FSDP2 CPU ranks): its merged
      sampling copy deep-copies the model, which FSDP2 forbids, and unmerged it calls the layers
      past the root module's hooks (sharded and whole tensors meet). `generate` keeps every rank
      decoding until all are done (synced_gpus, as FSDP2 marks the modules), so that each
      layer's all-gather has a partner on every rank; the loop's early stop does not;
    - ZeRO-3, the full-logit loss: the chunked loss reads the LM head's weight outside the
      head's forward, where ZeRO-3 leaves it partitioned to nothing; calling the head gathers it
      (at the cost of the micro-batch's [B, C, V] logits). An explicit chunked loss is refused.

    The EMA teacher is refused where parameters are sharded (FSDP, ZeRO-3): it keeps whole
    copies of the adapter tensors, which the engine replaces by shards when it wraps the model.
    """
    if sharded and zero_stage in (None, 3) and args.use_ema_teacher:
        raise ValueError("use_ema_teacher is not supported with sharded parameters (FSDP, DeepSpeed ZeRO-3): its "
                         "whole copies of the adapter do not match the shards; use DDP or ZeRO-2")
    if sharded and args.compile_layers and getattr(args, "compile_layers_is_default", False):
        args.compile_layers = False
    if sharded and args.rollout_cache_implementation == "auto":
        args.rollout_cache_implementation = "dynamic"
    if sharded and zero_stage is None and args.rollout_cache_implementation in GRAPH_LOOPS:
        raise ValueError(f"rollout_cache_implementation={args.rollout_cache_implementation} cannot run under FSDP: "
                         "the decode loop bypasses FSDP's parameter gathering; use dynamic (generate, FSDP's default)")
    if zero_stage == 3 and args.loss_implementation == "chunked":
        if not getattr(args, "loss_implementation_is_default", False):
            raise ValueError("loss_implementation=chunked cannot run under DeepSpeed ZeRO-3, which partitions the "
                             "LM head's weight the chunked loss reads; use logits (or auto)")
        args.loss_implementation = "logits"


def make_objective(args: OPSDConfig):
    """The run's loss, chosen once from the config when the trainer starts (docs/SPEC.md §2).

    Returns objective(student_hidden, teacher_hidden, batch, head) -> (loss, stats), where
    the hidden states are [B, C, H] at the completion positions, `batch` is the student's
    `ScoringBatch` (which completion tokens are real, their ids) and `head` is the LM head;
    the per-step code calls it without looking at the config again.
    """
    divergence = divergence_settings(args)
    temperature, chunk_size, compile_math = args.temperature, args.loss_chunk_size, args.compile_loss
    if args.loss_implementation == "chunked":  # logits formed chunk by chunk, never [B, C, V] at once

        def tokens(*values, batch):  # each [B, C, ...] -> [N, ...]: the real completion tokens only
            return [select_completion_tokens(v, batch) for v in values]

        def chunked_sft(student, teacher, batch, head):  # cross-entropy on the reference solution
            student, teacher, ids = tokens(student, teacher, batch.completion_ids, batch=batch)
            return chunked_nll_loss(student, teacher, _whole(head.weight), ids, chunk_size=chunk_size,
                                    lm_head_bias=_whole(head.bias))

        def chunked_tinker(student, teacher, batch, head):
            student, teacher, ids = tokens(student, teacher, batch.completion_ids, batch=batch)
            return chunked_tinker_loss(student, teacher, _whole(head.weight), ids, temperature=temperature,
                                       chunk_size=chunk_size, lm_head_bias=_whole(head.bias))

        def chunked_divergence(student, teacher, batch, head):
            student, teacher = tokens(student, teacher, batch=batch)
            return chunked_divergence_loss(student, teacher, _whole(head.weight), **divergence,
                                           chunk_size=chunk_size, lm_head_bias=_whole(head.bias), compile=compile_math)

        if args.loss_type == "sft":
            return chunked_sft
        return chunked_tinker if args.use_tinker_loss else chunked_divergence

    # "logits": full [B, C, V] logits for both roles (the released-style path).
    def full_sft(student, teacher, batch, head):
        return nll_loss(head(student), head(teacher), batch.completion_ids, batch.completion_mask.bool())

    def full_tinker(student, teacher, batch, head):
        return tinker_loss(head(student), head(teacher), batch.completion_ids, batch.completion_mask.bool(),
                           temperature=temperature)

    def full_divergence(student, teacher, batch, head):
        return divergence_loss(head(student), head(teacher), batch.completion_mask.bool(), **divergence)

    if args.loss_type == "sft":
        return full_sft
    return full_tinker if args.use_tinker_loss else full_divergence


def divergence_settings(args: OPSDConfig) -> dict:
    """The divergence objective's options (opsd.loss.DivergenceConfig fields) from the config."""
    return {
        "beta": args.beta, "temperature": args.temperature, "clip": args.jsd_token_clip,
        "clip_mode": args.clip_mode, "top_k": args.top_k_loss,
    }  # fmt: skip


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The LM head's weight or bias as one ordinary tensor. Under FSDP2 it may be a DTensor (a
    shard per GPU), which the chunked loss's matmuls cannot take: gathered here once per
    micro-batch, not once per chunk. Frozen under LoRA; were it trained, the gather's backward
    would hand each GPU its shard's gradient."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def make_collator(tokenizer, args: OPSDConfig) -> OPSDCollator:
    """The prompt builder for both roles, as configured by the switches."""
    return OPSDCollator(
        tokenizer,
        student_prompt=args.student_prompt,
        teacher_context=args.teacher_context,
        teacher_thinking=args.teacher_thinking,
        pad_side=args.pad_side,
        max_prompt_length=args.max_prompt_length,
        max_teacher_prompt_length=args.max_teacher_prompt_length,
    )


@contextmanager
def bf16_autocast(adapters: AdapterLayers, enabled: bool):
    """Mixed precision for the two backbone forwards of `adapters.model` (its adapter layers).

    The loss calls the decoder directly, past the wrapper through which the Trainer
    applies its autocast; without this, peft runs its float32 adapters in float32
    (input casts plus fp32 matmuls: 1.24x slower on an H200, BENCHMARKS.md). The
    adapters' master weights and gradients stay float32.
    """
    if not enabled:
        yield
        return
    device_type = model_device(adapters.model).type
    with torch.autocast(device_type, dtype=torch.bfloat16), adapters.input_casting_disabled():
        yield


def completion_hidden_states(model, batches: list[ScoringBatch], pad_id: int) -> list[torch.Tensor]:
    """Final hidden states at the positions that predict each completion token, [B, C, H] per
    batch, from one forward over all of them (`one_forward`).

    Only the backbone runs; logits are formed by the loss, never for prompt positions.
    """
    decoder = causal_lm(model).get_decoder()
    inputs = one_forward(batches, pad_id)
    hidden = decoder(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,  # None for `right`: pads consume rotary positions (released)
        use_cache=False,
    ).last_hidden_state
    out, start = [], 0
    for batch in batches:
        rows, width = batch.input_ids.shape
        out.append(gather_completion_positions(hidden[start:start + rows, :width], batch))
        start += rows
    return out


def lm_head(model) -> torch.nn.Module:
    """The output projection (LM head) that turns the hidden states into logits."""
    return causal_lm(model).get_output_embeddings()


def _to_device(batch, device):
    """The batch's tensors on `device`. To a GPU they go from pinned memory without blocking:
    a blocking copy would first wait for every kernel already queued (the previous micro-batch's
    backward), once per tensor."""
    cuda = torch.device(device).type == "cuda"

    def move(tensor):
        return tensor.pin_memory().to(device, non_blocking=True) if cuda else tensor.to(device)

    moved = {
        f.name: (move(v) if isinstance(v := getattr(batch, f.name), torch.Tensor) else v)
        for f in dataclasses.fields(batch)
    }
    return dataclasses.replace(batch, **moved)
