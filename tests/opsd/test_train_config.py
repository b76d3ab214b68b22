"""opsd.train_config: OPSDConfig's defaults, spellings and checks, and the defaults the
engine resolves (resolve_engine_defaults): no model is loaded here."""
import pytest
import torch

from opsd import train_config
from opsd.config import SWITCH_VALUES, Switches
from opsd.train_config import SCORING_PAD_MULTIPLE, OPSDConfig, resolve_engine_defaults


def test_the_switch_fields_are_the_declared_switches(tmp_path):
    """Each switch of opsd.config.Switches that is a config field takes its default and its
    values from that one declaration: a value outside it is refused, naming the field."""
    fields = {name for name in SWITCH_VALUES if hasattr(OPSDConfig, name)}
    assert fields == {"clip_mode", "pad_side", "teacher_context", "student_prompt"}
    config = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    for name in fields:
        assert getattr(config, name) == getattr(Switches(), name) == SWITCH_VALUES[name][0]
        with pytest.raises(ValueError, match=f"{name}='nope': expected one of {', '.join(SWITCH_VALUES[name])}"):
            OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, **{name: "nope"})


@pytest.mark.parametrize(
    "extra, layers",
    [({}, True), ({"torch_compile": True}, False), ({"torch_compile_mode": "default"}, False), ({"fsdp": True}, False)],
    ids=["plain", "torch_compile", "torch_compile_mode", "fsdp"],
)
def test_gpu_defaults_with_cuda(tmp_path, monkeypatch, extra, layers):
    """What None resolves to on a CUDA machine (simulated): all on, except layer compilation
    next to parameter sharding or a whole-model torch_compile, never tried together."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, **extra)
    assert config.compile_loss is True
    assert (config.compile_layers, config.loss_implementation) == (None, "auto")  # the engine decides
    resolve_engine_defaults(config, sharded=False, zero_stage=None)
    assert config.compile_layers is layers
    assert config.pad_to_multiple_of == SCORING_PAD_MULTIPLE
    explicit = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, compile_layers=False,
                          compile_loss=False, pad_to_multiple_of=0)
    resolve_engine_defaults(explicit, sharded=False, zero_stage=None)
    assert (explicit.compile_layers, explicit.compile_loss, explicit.pad_to_multiple_of) == (False, False, None)


@pytest.mark.parametrize("sharded, zero_stage, expected", [
    (False, None, (True, "auto", "chunked")),     # DDP / one process: the GPU defaults
    (True, None, (False, "dynamic", "chunked")),  # FSDP
    (True, 2, (False, "dynamic", "chunked")),
    (True, 3, (False, "dynamic", "logits")),
], ids=["ddp", "fsdp", "zero2", "zero3"])
def test_engine_defaults(tmp_path, monkeypatch, sharded, zero_stage, expected):
    """What the trainer makes of its defaults once it sees the engine accelerate's config chose
    (on a simulated CUDA machine); explicit choices are kept, an impossible one is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def config(**explicit):
        args = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, **explicit)
        resolve_engine_defaults(args, sharded, zero_stage)
        return args.compile_layers, args.rollout_cache_implementation, args.loss_implementation

    assert config() == expected
    if sharded and zero_stage is None:  # FSDP: the decode loop would bypass its gathers (tests/test_ddp.py)
        for loop in ("graph", "graph_compiled"):
            with pytest.raises(ValueError, match=f"rollout_cache_implementation={loop} cannot run under FSDP"):
                config(rollout_cache_implementation=loop)
        assert config(compile_layers=True, rollout_cache_implementation="static", loss_implementation="logits") == (
            True, "static", "logits")
    else:
        assert config(compile_layers=True, rollout_cache_implementation="graph", loss_implementation="logits") == (
            True, "graph", "logits")
    if zero_stage == 3:
        with pytest.raises(ValueError, match="loss_implementation=chunked cannot run under DeepSpeed ZeRO-3"):
            config(loss_implementation="chunked")
    else:
        assert config(loss_implementation="chunked")[2] == "chunked"
    ema = {"fixed_teacher": False, "use_ema_teacher": True}
    if sharded and zero_stage != 2:  # parameters sharded: FSDP, ZeRO-3
        with pytest.raises(ValueError, match="use_ema_teacher is not supported with sharded parameters"):
            config(**ema)
    else:
        assert config(**ema) == expected


@pytest.mark.parametrize("value, expected", [("auto", 16), (None, 16), ("none", None), (0, None), ("32", 32), (8, 8)])
def test_pad_to_multiple_of_spellings(tmp_path, monkeypatch, value, expected):
    """TRL's spellings of the field keep working; "auto" is the OPSD default (16 with CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, pad_to_multiple_of=value)
    assert config.pad_to_multiple_of == expected


def test_negative_pad_to_multiple_of_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="pad_to_multiple_of must be >= 0"):
        OPSDConfig(output_dir=str(tmp_path), bf16=False, pad_to_multiple_of=-8)


def test_old_transformers_read_the_checkpointing_setting_under_its_old_name(tmp_path, monkeypatch):
    monkeypatch.setattr(train_config, "TRAINER_READS_ACTIVATION_CHECKPOINTING", False)
    for value in (True, False):
        config = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, activation_checkpointing=value)
        assert config.gradient_checkpointing is value


def test_token_mean_rows_must_divide_the_micro_batch(tmp_path):
    with pytest.raises(ValueError,
                       match="token_mean_rows=3: must be a positive divisor of per_device_train_batch_size=4"):
        OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, per_device_train_batch_size=4,
                   token_mean_rows=3)
