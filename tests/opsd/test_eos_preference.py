"""OPSD's EOS diagnostics (opsd.objective.eos_log_probs, docs/OUTPUTS.md "The teacher's length
preference"): each role's log-probability of the EOS the student sampled, at the completion's end,
against a hand computation in plain Python on a tiny batch."""
import math

import pytest
import torch

from opsd.loss import DivergenceConfig
from opsd.objective import EOS_STAT_KEYS, ObjectiveSettings, build_objective, eos_log_probs
from opsd.scoring import build_scoring_batch

H, V, T = 3, 6, 1.3
EOS = (4, 5)
# Rows: ends with EOS 4; truncated (no EOS at the end, an EOS id inside); ends with EOS 5 after one token.
COMPLETIONS = [[1, 2, 4], [4, 3, 3, 3], [0, 5]]


def hand_logp(hidden_row, weight, bias, token):
    logits = [(sum(w * h for w, h in zip(weight[v], hidden_row, strict=True)) + bias[v]) / T for v in range(V)]
    top = max(logits)
    return logits[token] - top - math.log(sum(math.exp(x - top) for x in logits))


def make(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(COMPLETIONS), 4, H, generator=gen, dtype=torch.float64)


def test_eos_log_probs_match_a_hand_computation():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(V, H, generator=gen, dtype=torch.float64), torch.randn(V, generator=gen,
                                                                                      dtype=torch.float64)
    student, teacher = make(1), make(2)
    ids = torch.tensor([c + [0] * (4 - len(c)) for c in COMPLETIONS])
    mask = torch.tensor([[1] * len(c) + [0] * (4 - len(c)) for c in COMPLETIONS])
    got = eos_log_probs(student, teacher, ids, mask, lambda h: h @ weight.T + bias, EOS, T)
    w, b = weight.tolist(), bias.tolist()
    for key, hidden in (("student_eos_logp", student), ("teacher_eos_logp", teacher)):
        ended = [(row, len(c) - 1, c[-1]) for row, c in enumerate(COMPLETIONS) if c[-1] in EOS]  # rows 0 and 2
        expected = sum(hand_logp(hidden[r, pos].tolist(), w, b, tok) for r, pos, tok in ended) / len(ended)
        assert got[key].item() == pytest.approx(expected, rel=1e-12)
    assert set(got) == set(EOS_STAT_KEYS)


def test_no_row_ended_with_eos_gives_nan_not_zero():
    ids, mask = torch.tensor([[1, 2], [3, 0]]), torch.tensor([[1, 1], [1, 0]])
    hidden = torch.randn(2, 2, H)
    got = eos_log_probs(hidden, hidden, ids, mask, torch.nn.Linear(H, V), EOS, 1.0)
    assert all(math.isnan(v.item()) for v in got.values())


def test_a_row_that_did_not_end_cannot_spoil_the_mean():
    """A truncated row's last token may have log-prob -inf (a masked logit): it is left out, not
    multiplied by 0 (which gives NaN)."""
    ids, mask = torch.tensor([[1, 4], [2, 3]]), torch.tensor([[1, 1], [1, 1]])  # row 0 ends with EOS 4, row 1 not

    def project(h):
        logits = torch.zeros(h.shape[0], V, dtype=torch.float64)
        logits[:, 3] = float("-inf")  # row 1's last token
        return logits

    got = eos_log_probs(torch.zeros(2, 2, H), torch.zeros(2, 2, H), ids, mask, project, EOS, 1.0)
    assert got["student_eos_logp"].item() == pytest.approx(-math.log(V - 1))


@pytest.mark.parametrize("implementation", ["chunked", "logits"])
def test_the_opsd_objective_adds_them_and_the_others_do_not(implementation):
    """Built with the tokenizer's EOS ids, the OPSD objectives (divergence, tinker) return the EOS
    stats beside their own, equal to eos_log_probs; SFT and GRPO stay as they are."""
    head = torch.nn.Linear(H, V).double()
    batch = build_scoring_batch([[7, 7], [7]], [[1, 2, 4], [3, 5]], pad_id=0, pad_side="right")
    student, teacher = make(3)[:2, :3], make(4)[:2, :3]
    for objective in ("divergence", "tinker", "sft"):
        settings = ObjectiveSettings(objective=objective, implementation=implementation,
                                     divergence=DivergenceConfig(temperature=T), chunk_size=4, compile=False,
                                     eos_token_ids=EOS)
        _, stats = build_objective(settings)(student, teacher, batch, head)
        if objective == "sft":
            assert not set(stats) & set(EOS_STAT_KEYS)
            continue
        expected = eos_log_probs(student, teacher, batch.completion_ids, batch.completion_mask, head, EOS, T)
        for key in EOS_STAT_KEYS:
            assert stats[key].item() == pytest.approx(expected[key].item(), rel=1e-10)
