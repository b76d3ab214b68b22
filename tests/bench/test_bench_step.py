"""bench/bench_step.py's stand-in for the trainer: it scores a micro-batch through
OPSDTrainer's own loss methods (bound to a namespace), so a change to the trainer's
methods must keep it working. Checked here on the tiny shape: the stand-in's loss
and gradient equal the released-style naive loss's (the benchmark's same-numbers check)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_step  # noqa: E402
import common  # noqa: E402


def test_trainer_stand_in_scores_like_the_naive_step():
    model = common.build_lora_model("tiny")
    model.train()
    stepper = bench_step.Stepper(model, bench_step.trainer_defaults(), common.device())
    inputs = bench_step.make_inputs(2, common.TINY, seed=0)
    naive_loss, naive_grad, _ = stepper.loss_and_grad(bench_step.VARIANTS["naive"], inputs)
    for name in ("project", "project_eager"):
        loss, grad, stats = stepper.loss_and_grad(bench_step.VARIANTS[name], inputs)
        assert abs(loss - naive_loss) <= 1e-4 * abs(naive_loss) and "true_kl" in stats
        assert torch.nn.functional.cosine_similarity(grad, naive_grad, dim=0) > 0.9999
