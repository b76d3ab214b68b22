"""OPSDConfig: TRL's DistillationConfig plus the OPSD settings, and the resolution of the
defaults that depend on the machine (CUDA) or on the engine accelerate chose (sharding).

Where each setting is declared: recipe keys in opsd.config.Recipe (`recipe_field`), OPSD_*
switches in opsd.config.Switches (`switch_field`), the rest here. The command line, a YAML
`--config`, the recipe, the switches and OPSD_REPORT_TO all arrive as values of these fields
before `__post_init__`, which validates them once (opsd_train.layered_defaults).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments
from trl import DistillationConfig

from opsd.config import (
    REPORT_TO_VALUES,
    SWITCH_VALUES,
    VLLM_TEMPERATURE_RANGE,
    Recipe,
    recipe_field,
    recipe_value_problem,
    switch_field,
)
from opsd.grpo import GRPO_EPSILON, GRPO_LOSS_TYPES, REWARD_SCALES
from opsd.objective import IMPLEMENTATIONS, LOSS_TYPES
from opsd.sampling import GRAPH_LOOPS

RECIPE_KEYS = tuple(f.name for f in dataclasses.fields(Recipe))
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
    num_generations: int = recipe_field("num_generations")

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

    clip_mode: str = switch_field("clip_mode")  # each value's clip: opsd.loss.CLIPS
    pad_side: str = switch_field("pad_side")
    student_prompt: str = switch_field("student_prompt")
    teacher_context: str = switch_field("teacher_context")
    reason_first_max_tokens: int = field(default=512, metadata={"help": "Length limit of the reason_first analysis."})
    loss_type: str = field(
        default=LOSS_TYPES[0],
        metadata={
            "help": "opsd (the distillation loss); sft: the supervised baseline, cross-entropy on the reference "
            "solutions with the same prompts, budget and LoRA (no rollouts; lmbda is ignored); grpo: the RL "
            "baseline, num_generations rollouts per prompt rewarded by the evaluation's grader (1 correct, 0 "
            "not), group-normalised advantages and TRL's clipped GRPO loss (grpo_loss_type). With grpo the batch "
            "counts completions, as in TRL: a step of B rows trains on B / num_generations prompts."
        },
    )
    grpo_loss_type: str = field(
        default="dapo",
        metadata={"help": f"GRPO's normalisation, TRL's loss_type: {', '.join(GRPO_LOSS_TYPES)} (dapo, TRL "
                          "1.16's default: a token mean over the generation batch)."},
    )
    scale_rewards: str = field(
        default=REWARD_SCALES[0],
        metadata={"help": f"GRPO's advantage scaling, TRL's scale_rewards: {', '.join(REWARD_SCALES)} (the reward "
                          "std of the group, of the batch, or none)."},
    )
    grpo_beta: float = field(
        default=0.0,
        metadata={"help": "GRPO's KL coefficient (TRL's GRPOConfig.beta, default 0): adds beta x the k3 estimate "
                          "exp(ref - logp) - (ref - logp) - 1 per token (times the importance ratio: "
                          "grpo_use_bias_correction_kl), ref the log-prob under the reference, the base weights with "
                          "the adapter disabled (one more no-grad forward a micro-batch). --beta is the OPSD "
                          "divergence's weight, not this."})
    grpo_use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "GRPO's KL term times the importance ratio exp(logp - logp_old) (TRL 1.16's "
                          "use_bias_correction_kl, default true): on policy its value stays k3's and its gradient per "
                          "token becomes (logp - ref) d logp, the unbiased reverse-KL gradient; false: k3's own "
                          "gradient (1 - exp(ref - logp)) d logp. Acts only with grpo_beta > 0."})
    # TRL's names, kept so that a TRL command line is refused in one line, not silently ignored.
    epsilon: float = field(
        default=GRPO_EPSILON,
        metadata={"help": f"GRPO's clip range of the importance ratio (TRL's); only {GRPO_EPSILON}: with one update "
                          "per generation batch the ratio is 1 and the clip cannot act, so other values are refused."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "GRPO's upper clip bound (TRL's, DAPO's clip-higher); refused, as epsilon."})
    # TRL GRPOConfig's knobs for several updates per generation batch and its variants, at TRL's
    # defaults: the trainer makes one optimizer step per generation batch, so other values are refused.
    num_iterations: int = field(
        default=1, metadata={"help": "TRL's updates per generation batch; only 1 (one optimizer step per batch)."})
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "TRL's micro-batches per generation batch; only unset or gradient_accumulation_steps (one "
                          "generation batch per optimizer step)."})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "TRL's importance ratio per token or per sequence (GSPO); only token."})
    delta: float | None = field(
        default=None, metadata={"help": "TRL's two-sided clip of the importance ratio; only unset (the ratio is 1)."})
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "TRL: leave truncated completions out of the loss; only false (they are trained on, rewarded "
                          "as the evaluation grades them)."})
    sft_teacher_diagnostics: bool = field(
        default=False,
        metadata={"help": "loss_type sft: also run the teacher's no-grad forward each micro-batch, for the true-KL "
                          "and teacher-entropy diagnostics (opsd/true_kl, opsd/teacher_entropy); off, SFT runs the "
                          "student alone and its tokens/forward count only the student's forward."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "Student prompt limit (warns only)."})
    max_teacher_prompt_length: int | None = field(
        default=None, metadata={"help": "Teacher prompt limit; the privileged context is truncated to fit."}
    )
    loss_implementation: str = field(
        default="auto",
        metadata={
            "help": "chunked (hidden states, low memory), logits (full logits) or auto: chunked, except under "
            "DeepSpeed ZeRO-3, which leaves the LM head's weight partitioned where the chunked loss reads it "
            "(resolved when the trainer sees the engine)."
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
            "a bounded paged KV cache, opsd/rollout/paged_decode.py; meant for long evaluations) or dynamic / None "
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
        # The switches' values are declared once, in opsd.config.Switches; `auto` / None of the
        # engine-dependent fields stay until the trainer sees the engine (resolve_engine_defaults).
        choices = {name: SWITCH_VALUES[name] for name in SWITCH_VALUES if hasattr(self, name)}
        choices.update(loss_implementation=("auto", *IMPLEMENTATIONS), loss_type=LOSS_TYPES,
                       grpo_loss_type=GRPO_LOSS_TYPES, scale_rewards=REWARD_SCALES)
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
        """Settings that exclude each other (checked once, by __post_init__: flags, recipe
        values and OPSD_* switches all arrive before it runs)."""
        if self.fixed_teacher and self.use_ema_teacher:
            raise ValueError("fixed_teacher and use_ema_teacher are mutually exclusive")
        if self.reason_first and self.teacher_context == "none":
            raise ValueError("reason_first needs a reference to analyse; teacher_context=none has none")
        check_honoured(self)
        if self.loss_type == "grpo":
            self.check_grpo()
        rows = self.token_mean_rows
        if rows is not None and (rows < 1 or self.per_device_train_batch_size % rows):
            raise ValueError(f"token_mean_rows={rows}: must be a positive divisor of per_device_train_batch_size="
                             f"{self.per_device_train_batch_size}")


    def check_grpo(self) -> None:
        """GRPO's groups: each prompt's num_generations completions sit in one process's
        generation batch (per_device_train_batch_size x gradient_accumulation_steps rows)."""
        rows = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if rows % self.num_generations:
            raise ValueError(f"num_generations={self.num_generations} does not divide the generation batch of "
                             f"{rows} completions (per_device_train_batch_size {self.per_device_train_batch_size} x "
                             f"gradient_accumulation_steps {self.gradient_accumulation_steps})")
        if self.token_mean_rows is not None:
            raise ValueError("token_mean_rows groups the OPSD loss's token means; GRPO normalises by "
                             "grpo_loss_type: leave token_mean_rows unset")
        if self.lmbda != 1:
            raise ValueError(f"lmbda={self.lmbda}: GRPO trains on its own samples only (lmbda 1)")
        # Knobs TRL has that would do nothing here: refused rather than silently ignored.
        if self.beta != 0:
            raise ValueError(f"beta={self.beta}: beta is the OPSD divergence's JSD weight and does nothing in GRPO; "
                             "GRPO's KL coefficient (TRL's beta) is grpo_beta")
        if not (self.grpo_beta >= 0 and math.isfinite(self.grpo_beta)):
            raise ValueError(f"grpo_beta={self.grpo_beta}: a KL coefficient >= 0")
        if self.grpo_beta and (self.use_ema_teacher or not self.fixed_teacher):
            raise ValueError(f"grpo_beta={self.grpo_beta}: the KL's reference is the base weights (the adapter "
                             "disabled, fixed_teacher true); use_ema_teacher / fixed_teacher false would change it")
        if self.epsilon != GRPO_EPSILON or self.epsilon_high is not None:
            raise ValueError(f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}: the clip cannot act with one "
                             "update per generation batch (TRL's num_iterations 1: the importance ratio is 1); leave "
                             f"epsilon {GRPO_EPSILON} and epsilon_high unset")
        if self.use_vllm:
            raise ValueError("loss_type=grpo with use_vllm: TRL's vllm_importance_sampling_correction (on by default "
                             "in TRL 1.16: vLLM's sampling log-probs differ from the trainer's) is not implemented; "
                             "sample GRPO with the own engine (use_vllm false)")


def _sampled_by_own_engine(args) -> str | None:
    """Which rollouts the project's own engine samples (None: none): the student's without vLLM,
    reason_first's analyses always."""
    if not args.use_vllm:
        return "the rollouts (use_vllm false)"
    return "reason_first's analyses" if args.reason_first else None


# Inherited sampling settings the project's own rollout engine (opsd.rollout.TransformersBackend) does
# not implement: name -> the values that leave sampling as it is. TRL passes each to vLLM.
OWN_ENGINE_IGNORES = {
    "min_p": (None, 0.0),
    "repetition_penalty": (1.0,),
    "generation_kwargs": (None, {}),
    "vllm_structured_outputs_regex": (None,),
}
# Settings the trainer never reads, whatever the engine (only their default is accepted): name -> why.
NEVER_HONOURED = {
    "cache_implementation": "TRL's cache of transformers generate() in TRL's own rollout, which this trainer "
                            "replaces; the own engine's is rollout_cache_implementation",
    "num_iterations": "one optimizer step per generation batch (TRL's default 1); several updates per batch are "
                      "not implemented",
    "importance_sampling_level": "only token is implemented; with one update per generation batch the ratio is 1 "
                                 "and GSPO's sequence level gives the token level's loss and gradient",
    "delta": "TRL's two-sided clip of the importance ratio, which is 1 with one update per generation batch; not "
             "implemented",
    "mask_truncated_completions": "truncated completions are trained on (rewarded as the evaluation grades them); "
                                  "masking them out of the loss is not implemented",
}
# GRPO's own settings, which the other loss types do not read (only their default is accepted there).
GRPO_ONLY = ("grpo_loss_type", "scale_rewards", "grpo_beta", "grpo_use_bias_correction_kl", "epsilon", "epsilon_high")


def check_honoured(args) -> None:
    """Refuse (ValueError, one line naming the setting) every setting at a value that the run's
    engines would silently ignore (docs/RESEARCH.md, "Settings that are refused")."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name, why in NEVER_HONOURED.items():
        if getattr(args, name) != defaults[name]:
            raise ValueError(f"{name}={getattr(args, name)!r}: {why}")
    steps = args.steps_per_generation
    if steps not in (None, args.gradient_accumulation_steps):
        raise ValueError(f"steps_per_generation={steps}: a generation batch is one optimizer step's "
                         f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) micro-batches; other "
                         "values are not implemented (leave it unset)")
    sampled = _sampled_by_own_engine(args)
    for name, neutral in OWN_ENGINE_IGNORES.items():
        if sampled and getattr(args, name) not in neutral:
            raise ValueError(f"{name}={getattr(args, name)!r}: {sampled} are sampled by the project's own rollout "
                             f"engine, which does not implement {name} (vLLM does: --use_vllm true without "
                             "reason_first, not for loss_type grpo)")
    if args.sft_teacher_diagnostics and args.loss_type != "sft":
        raise ValueError(f"sft_teacher_diagnostics: an SFT setting, which loss_type {args.loss_type} does not read")
    if args.loss_type == "sft" and args.reason_first and not args.sft_teacher_diagnostics:
        raise ValueError("reason_first with loss_type sft: the teacher's analyses feed only the teacher's forward, "
                         "which SFT runs only with sft_teacher_diagnostics")
    if args.loss_type != "grpo":
        for name in GRPO_ONLY:
            if getattr(args, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(args, name)!r}: a GRPO setting, which loss_type {args.loss_type} "
                                 f"does not read (leave it at {defaults[name]!r})")


# A shim for transformers 5.17 (vLLM 0.26's range): newer transformers (5.24) declare and read
# `activation_checkpointing`; 5.17's Trainer reads only `gradient_checkpointing`, and
# OPSDConfig's field of the new name is ours alone there (__post_init__ maps it).
TRAINER_READS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {
    f.name for f in dataclasses.fields(TrainingArguments)}


def default_scoring_pad_multiple() -> int | None:
    """What `pad_to_multiple_of` None / "auto" means: SCORING_PAD_MULTIPLE with CUDA, off on CPU."""
    return SCORING_PAD_MULTIPLE if torch.cuda.is_available() else None


def resolve_engine_defaults(args: OPSDConfig, sharded: bool, zero_stage: int | None) -> None:
    """Resolve the defaults that depend on the engine of the run (left None / `auto` by
    __post_init__; an explicit choice is kept or refused): `sharded` under FSDP or DeepSpeed,
    `zero_stage` DeepSpeed's stage (None without it). OPSDTrainer calls it once, when
    accelerate has chosen the engine, before the loss is chosen; code that builds an objective
    without a trainer calls it with (False, None).

    - compile_layers (None): on with CUDA, off on CPU, off next to a whole-model torch_compile
      and off with sharded parameters: compiled decoder layers were never tried with a compiled
      model or with an engine that wraps the layers' parameters (FSDP gathers them in hooks
      around each layer, DeepSpeed owns the forward and backward);
    - transformers rollouts (vLLM off) on `generate` with the dynamic cache: the CUDA-graph
      decode loop would record the hooks' gathers of sharded parameters into its graph. Under
      FSDP an explicit graph loop is refused (both failed on two FSDP2 CPU ranks): its merged
      sampling copy deep-copies the model, which FSDP2 forbids, and unmerged it calls the layers
      past the root module's hooks (sharded and whole tensors meet). `generate` keeps every rank
      decoding until all are done (synced_gpus, as FSDP2 marks the modules), so that each
      layer's all-gather has a partner on every rank; the loop's early stop does not;
    - loss_implementation (auto): chunked; under ZeRO-3 the full-logit loss: the chunked loss
      reads the LM head's weight outside the head's forward, where ZeRO-3 leaves it partitioned
      to nothing; calling the head gathers it (at the cost of the micro-batch's [B, C, V]
      logits). An explicit chunked loss is refused.

    The EMA teacher is refused where parameters are sharded (FSDP, ZeRO-3): it keeps whole
    copies of the adapter tensors, which the engine replaces by shards when it wraps the model.
    """
    if sharded and zero_stage in (None, 3) and args.use_ema_teacher:
        raise ValueError("use_ema_teacher is not supported with sharded parameters (FSDP, DeepSpeed ZeRO-3): its "
                         "whole copies of the adapter do not match the shards; use DDP or ZeRO-2")
    if args.compile_layers is None:
        args.compile_layers = torch.cuda.is_available() and not (sharded or args.fsdp or args.deepspeed
                                                                 or args.torch_compile)
    if sharded and args.rollout_cache_implementation == "auto":
        args.rollout_cache_implementation = "dynamic"
    if sharded and zero_stage is None and args.rollout_cache_implementation in GRAPH_LOOPS:
        raise ValueError(f"rollout_cache_implementation={args.rollout_cache_implementation} cannot run under FSDP: "
                         "the decode loop bypasses FSDP's parameter gathering; use dynamic (generate, FSDP's default)")
    if zero_stage == 3 and args.loss_implementation == "chunked":
        raise ValueError("loss_implementation=chunked cannot run under DeepSpeed ZeRO-3, which partitions the "
                         "LM head's weight the chunked loss reads; use logits (or auto)")
    if args.loss_implementation == "auto":
        args.loss_implementation = "logits" if zero_stage == 3 else "chunked"
