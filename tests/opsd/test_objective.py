"""opsd.objective: the table from (objective, implementation) to a builder, and each
objective's loss against the library function it wraps."""
import pytest
import torch

from opsd import objective as objectives
from opsd.objective import BUILDERS, IMPLEMENTATIONS, build_objective, objective_settings
from opsd.scoring import build_scoring_batch
from opsd.train_config import OPSDConfig, resolve_engine_defaults


def _config(tmp_path, **values):
    config = OPSDConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, **values)
    resolve_engine_defaults(config, sharded=False, zero_stage=None)
    return config


def test_chunked_loss_takes_an_fsdp2_sharded_lm_head(tmp_path):
    """Under FSDP2 the LM head's weight can be a DTensor; the chunked loss gathers it and gives
    the loss and gradients of an ordinary head (a one-rank gloo group stands in for the GPUs)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    objective = build_objective(objective_settings(_config(tmp_path)))
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 8, 40
    plain = torch.nn.Linear(hidden, vocab, bias=False).double()
    student = torch.randn(2, 4, hidden, dtype=torch.float64, generator=gen, requires_grad=True)
    teacher = torch.randn(2, 4, hidden, dtype=torch.float64, generator=gen)
    ids = torch.randint(vocab, (7,), generator=gen).tolist()
    batch = build_scoring_batch([[1], [2]], [ids[:4], ids[4:]], pad_id=0, pad_side="right")  # 4 + 3 tokens
    results = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        sharded = torch.nn.Linear(hidden, vocab, bias=False)
        sharded.weight = torch.nn.Parameter(
            distribute_tensor(plain.weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]), requires_grad=False)
        assert isinstance(sharded.weight, DTensor)
        for head in (plain, sharded):
            student.grad = None
            loss, _ = objective(student, teacher, batch, head)
            loss.backward()
            results.append((loss.detach(), student.grad.clone()))
    finally:
        dist.destroy_process_group()
    (loss_plain, grad_plain), (loss_sharded, grad_sharded) = results
    torch.testing.assert_close(loss_sharded, loss_plain, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_sharded, grad_plain, rtol=1e-12, atol=0)


def test_the_table_has_a_builder_for_every_objective_and_implementation():
    assert set(BUILDERS) == {(o, i) for o in ("divergence", "tinker", "sft", "grpo") for i in IMPLEMENTATIONS}


@pytest.mark.parametrize("values, name", [
    ({}, "divergence"), ({"use_tinker_loss": True}, "tinker"), ({"loss_type": "sft"}, "sft"),
    ({"loss_type": "sft", "use_tinker_loss": True}, "sft"),  # sft trains on the reference whatever the estimator
])
def test_the_config_picks_the_objective_and_both_implementations_agree(tmp_path, values, name):
    """The config picks BUILDERS[(objective, implementation)] (objective_settings, build_objective);
    the chunked and the full-logit objective give the same loss and gradient (float64, random head)."""
    settings = objectives.objective_settings(_config(tmp_path, **values))
    assert (settings.objective, settings.implementation) == (name, "chunked")
    gen = torch.Generator().manual_seed(3)
    hidden, vocab = 6, 30
    head = torch.nn.Linear(hidden, vocab).double()
    ids = torch.randint(vocab, (7,), generator=gen).tolist()
    batch = build_scoring_batch([[1], [2, 3]], [ids[:4], ids[4:]], pad_id=0, pad_side="left")
    teacher = torch.randn(2, 4, hidden, dtype=torch.float64, generator=gen)
    start = torch.randn(2, 4, hidden, dtype=torch.float64, generator=gen)
    results = []
    for implementation in IMPLEMENTATIONS:
        student = start.clone().requires_grad_(True)
        config = _config(tmp_path, loss_implementation=implementation, **values)
        loss, stats = build_objective(objective_settings(config))(student, teacher, batch, head)
        loss.backward()
        results.append((loss.detach(), student.grad[batch.completion_mask.bool()], stats))
    (chunked, chunked_grad, chunked_stats), (full, full_grad, full_stats) = results
    torch.testing.assert_close(chunked, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked_grad, full_grad, rtol=1e-8, atol=1e-12)
    assert chunked_stats.keys() == full_stats.keys() and loss.item() != 0


def test_the_divergence_is_built_once_from_the_switch_and_recipe_values(tmp_path):
    """The clip mode, clip, beta, temperature and top-k reach the loss as one DivergenceConfig."""
    config = _config(tmp_path, clip_mode="token", jsd_token_clip=0.2, beta=0.5, temperature=0.7, top_k_loss=5)
    divergence = objectives.objective_settings(config).divergence
    assert (divergence.clip_mode, divergence.clip, divergence.beta, divergence.temperature, divergence.top_k) == (
        "token", 0.2, 0.5, 0.7, 5)


@pytest.mark.parametrize("grpo_loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_grpo_objective_is_the_same_chunked_and_on_full_logits_and_needs_no_teacher(tmp_path, grpo_loss_type):
    settings = objectives.objective_settings(_config(tmp_path, loss_type="grpo", grpo_loss_type=grpo_loss_type))
    assert settings.objective == "grpo" and not settings.uses_teacher
    gen = torch.Generator().manual_seed(5)
    hidden, vocab = 6, 30
    head = torch.nn.Linear(hidden, vocab).double()
    ids = torch.randint(vocab, (7,), generator=gen).tolist()
    batch = build_scoring_batch([[1], [2, 3]], [ids[:4], ids[4:]], pad_id=0, pad_side="right")
    rewards = objectives.RowRewards(advantages=torch.tensor([0.7, -0.7], dtype=torch.float64),
                                    num_items=torch.tensor(9.0, dtype=torch.float64))
    start = torch.randn(2, 4, hidden, dtype=torch.float64, generator=gen)
    results = []
    for implementation in IMPLEMENTATIONS:
        student = start.clone().requires_grad_(True)
        config = _config(tmp_path, loss_type="grpo", grpo_loss_type=grpo_loss_type,
                         loss_implementation=implementation)
        loss, stats = build_objective(objective_settings(config))(student, None, batch, head, rewards)
        loss.backward()
        results.append((loss.detach(), student.grad[batch.completion_mask.bool()], stats))
    (chunked, chunked_grad, chunked_stats), (full, full_grad, full_stats) = results
    torch.testing.assert_close(chunked, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked_grad, full_grad, rtol=1e-8, atol=1e-12)
    assert chunked_grad.abs().sum() > 0 and chunked_stats.keys() == full_stats.keys()
