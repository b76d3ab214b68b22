"""opsd.prompts.PromptBuilder and opsd.scoring: exact prompt text and ids on the real Qwen3
tokenizer, the prompt length policy, both padding geometries and the [OPSD align] self-check."""
import warnings

import pytest
import torch

from opsd import prompts, tiny_default
from opsd.prompts import PromptBuilder, PromptLengthWarning
from opsd.scoring import (
    AlignmentError,
    build_scoring_batch,
    check_alignment,
    gather_completion_positions,
    one_forward,
    select_completion_tokens,
)

INSTR = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_OFF = "<think>\n\n</think>\n\n"
THINK_OFF_IDS = [151667, 271, 151668, 271]
TRANSITION = ("The reference above is correct. Make sure you understand why each of its steps holds, "
              "then solve the problem yourself: reason in your own words and arrive at the same final answer.")
ROW = {"problem": "What is 2+3?", "solution": "2+3=5, so the answer is \\boxed{5}.",
       "COT_Reason": "Two plus three: count up from two. Three, four, five. So 5."}


@pytest.fixture(scope="module")
def tok():
    return tiny_default.build_qwen3_tokenizer()


def chat(user: str, think_off: bool) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n" + (THINK_OFF if think_off else "")


def teacher_user(context: str) -> str:
    return (f"Problem: What is 2+3?\n\n=== Reference solution (verified) ===\n{context}\n"
            f"=== End of reference ===\n\n{TRANSITION}\n\n{INSTR}")


# -- prompts: exact text and ids ---------------------------------------------------------

def test_instruction_constant():
    assert prompts.INSTRUCTION == INSTR


def test_paper_student_prompt(tok):
    ids = PromptBuilder(tok).student_prompt_ids(ROW)
    assert tok.decode(ids) == (
        "<|im_start|>user\nProblem: What is 2+3?\n\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert ids[:3] == [151644, 872, 198]  # <|im_start|> user \n
    assert ids[-6:] == [77091, 198, *THINK_OFF_IDS]  # assistant \n, empty think block


def test_eval_student_prompt_is_the_eval_prompt(tok):
    builder = PromptBuilder(tok, student_prompt="eval")
    ids = builder.student_prompt_ids(ROW)
    assert tok.decode(ids) == chat(f"What is 2+3?\n\n{INSTR}", think_off=False)
    assert ids == builder.eval_prompt_ids(ROW["problem"]) == PromptBuilder(tok).eval_prompt_ids(ROW["problem"])
    assert ids[-3:] == [151644, 77091, 198] and 151667 not in ids  # thinking on: no pre-filled block


def test_prompt_ids_match_the_tokenizing_chat_template(tok):
    rendered = tok.apply_chat_template(prompts.student_messages(ROW["problem"], "paper"), tokenize=True,
                                       add_generation_prompt=True, enable_thinking=False)
    assert PromptBuilder(tok).student_prompt_ids(ROW) == rendered["input_ids"]


@pytest.mark.parametrize("mode, context", [
    ("solution", "2+3=5, so the answer is \\boxed{5}."),
    ("cot", "Two plus three: count up from two. Three, four, five. So 5."),
    ("both", "Solution:\n2+3=5, so the answer is \\boxed{5}.\n\n"
             "Detailed reasoning:\nTwo plus three: count up from two. Three, four, five. So 5."),
])
@pytest.mark.parametrize("thinking", [False, True])
def test_teacher_prompt(tok, mode, context, thinking):
    ids = PromptBuilder(tok, teacher_context=mode, teacher_thinking=thinking).teacher_prompt_ids(ROW)
    assert tok.decode(ids) == chat(teacher_user(context), think_off=not thinking)
    assert (ids[-4:] == THINK_OFF_IDS) is (not thinking)


def test_shuffled_teacher_prompt_shows_the_foreign_solution(tok):
    foreign = "First, $6 \\times 7 = 42$. The answer is \\boxed{42}."
    row = dict(ROW, shuffled_solution=foreign)
    ids = PromptBuilder(tok, teacher_context="shuffled").teacher_prompt_ids(row)
    assert tok.decode(ids) == chat(teacher_user(foreign), think_off=True)
    assert ids == PromptBuilder(tok).teacher_prompt_ids(dict(ROW, solution=foreign))  # same template
    with pytest.raises(ValueError, match="shuffled_solution"):  # rows must come through the data loader
        PromptBuilder(tok, teacher_context="shuffled").teacher_prompt_ids(ROW)


@pytest.mark.parametrize("answer, shown", [("5", "5"), (5.0, "5"), (None, "5"), ("", "5"), (" 17 ", "17")])
def test_answer_teacher_prompt_shows_only_the_final_answer(tok, answer, shown):
    row = dict(ROW, Answer=answer)  # an empty Answer falls back to the solution's last box
    ids = PromptBuilder(tok, teacher_context="answer").teacher_prompt_ids(row)
    assert tok.decode(ids) == chat(teacher_user(f"Final answer: {shown}"), think_off=True)
    assert "2+3=5" not in tok.decode(ids)  # none of the worked solution


@pytest.mark.parametrize("style", ["paper", "eval"])
@pytest.mark.parametrize("thinking", [False, True])
def test_none_teacher_prompt_is_the_student_prompt_token_for_token(tok, style, thinking):
    builder = PromptBuilder(tok, teacher_context="none", student_prompt=style, teacher_thinking=thinking,
                            max_teacher_prompt_length=5)  # a teacher-only limit: not applied
    assert builder.teacher_prompt_ids(ROW) == builder.student_prompt_ids(ROW)
    assert builder.teacher_prompt_ids(ROW) == PromptBuilder(tok, student_prompt=style).student_prompt_ids(ROW)
    with pytest.raises(ValueError, match="no privileged context"):
        builder.reason_first_prompt_ids(ROW)


def test_teacher_prompt_with_rationale(tok):
    rationale = "<think>\nscratch work\n</think>\n\nThe key idea is counting on."
    ids = PromptBuilder(tok).teacher_prompt_ids(ROW, rationale=rationale)
    context = f"{ROW['solution']}\n\nAnalysis of the reference:\nThe key idea is counting on."
    assert tok.decode(ids) == chat(teacher_user(context), think_off=True)


def test_reason_first_prompt(tok):
    text = tok.decode(PromptBuilder(tok).reason_first_prompt_ids(ROW))
    assert text == chat(
        f"Problem: What is 2+3?\n\n=== Reference solution (verified) ===\n{ROW['solution']}\n"
        f"=== End of reference ===\n\n{prompts.REASON_FIRST_REQUEST}",
        think_off=True,
    )


def test_bad_settings_are_rejected(tok):
    for kwargs in ({"student_prompt": "chat"}, {"teacher_context": "hint"}):
        with pytest.raises(ValueError, match="is not allowed"):
            PromptBuilder(tok, **kwargs)
    with pytest.raises(ValueError, match="pad_side='middle' is not allowed"):
        build_scoring_batch([[1]], [[2]], pad_id=0, pad_side="middle")


# -- prompt length policy ----------------------------------------------------------------

LONG_TRACE = " ".join(f"Step {i}: add {i} to the running total." for i in range(300))


def test_teacher_context_truncated_to_fit(tok):
    row = dict(ROW, COT_Reason=LONG_TRACE)
    full = PromptBuilder(tok, teacher_context="cot").teacher_prompt_ids(row)
    limit = len(PromptBuilder(tok).teacher_prompt_ids(ROW)) + 60
    builder = PromptBuilder(tok, teacher_context="cot", max_teacher_prompt_length=limit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fitting cut is silent
        ids = builder.teacher_prompt_ids(row)
    assert len(full) > limit >= len(ids) >= limit - 8  # fits, and not cut much more than needed
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nProblem: What is 2+3?\n\n=== Reference solution (verified) ===\n"
                           "Step 0: add 0 to the running total. Step 1:")
    assert "Step 299" not in text
    kept_end = text.index("\n[... reference truncated ...]\n=== End of reference ===\n\n")
    assert LONG_TRACE.startswith(text[text.index("Step 0"):kept_end])
    assert text.endswith(f"{TRANSITION}\n\n{INSTR}<|im_end|>\n<|im_start|>assistant\n{THINK_OFF}")
    assert builder.truncated_contexts == 1


def test_prompt_within_limit_is_untouched(tok):
    ids = PromptBuilder(tok).teacher_prompt_ids(ROW)
    assert PromptBuilder(tok, max_teacher_prompt_length=len(ids)).teacher_prompt_ids(ROW) == ids


def test_truncation_never_splits_a_character(tok):
    row = dict(ROW, solution="𝔸𝔹ℂ𝔻" * 200)
    limit = len(PromptBuilder(tok).teacher_prompt_ids(ROW)) + 41
    for extra in range(6):  # several cut points, some inside a multi-token character
        ids = PromptBuilder(tok, max_teacher_prompt_length=limit + extra).teacher_prompt_ids(row)
        assert len(ids) <= limit + extra and "\ufffd" not in tok.decode(ids)


def test_problem_is_never_truncated(tok):
    problem = "Find x. " * 100
    row = dict(ROW, problem=problem)
    builder = PromptBuilder(tok, max_teacher_prompt_length=50, max_prompt_length=50)
    with pytest.warns(PromptLengthWarning, match="max_teacher_prompt_length=50") as caught:
        ids = builder.teacher_prompt_ids(row)
        builder.teacher_prompt_ids(row)  # warned once only
    assert len(caught) == 1
    assert tok.decode(ids) == chat(f"Problem: {problem}\n\n=== Reference solution (verified) ===\n\n"
                                   f"=== End of reference ===\n\n{TRANSITION}\n\n{INSTR}", think_off=True)
    with pytest.warns(PromptLengthWarning, match="max_prompt_length=50") as caught:
        student = builder.student_prompt_ids(row)
        builder.student_prompt_ids(row)
    assert len(caught) == 1
    assert student == PromptBuilder(tok).student_prompt_ids(row)


# -- scoring geometry ----------------------------------------------------------------------

PROMPTS = [[11, 12, 13], [21], [31, 32]]
COMPLETIONS = [[14, 15], [22, 23, 24], [33]]
PAD = 0


def test_right_geometry():
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="right")
    assert b.input_ids.tolist() == [[11, 12, 13, 14, 15, 0],
                                    [21, 0, 0, 22, 23, 24],
                                    [31, 32, 0, 33, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0],
                                         [1, 0, 0, 1, 1, 1],
                                         [1, 1, 0, 1, 0, 0]]
    assert b.position_ids is None  # released: the pad gap consumes rotary positions
    assert b.completion_ids.tolist() == [[14, 15, 0], [22, 23, 24], [33, 0, 0]]
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert b.completion_start.tolist() == [3, 3, 3]
    assert b.prompt_lengths.tolist() == [3, 1, 2]
    assert b.pad_gap.tolist() == [0, 2, 1]


def test_left_geometry():
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="left")
    assert b.input_ids.tolist() == [[11, 12, 13, 14, 15, 0],
                                    [0, 0, 21, 22, 23, 24],
                                    [0, 31, 32, 33, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0],
                                         [0, 0, 1, 1, 1, 1],
                                         [0, 1, 1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4],
                                       [0, 0, 0, 1, 2, 3],
                                       [0, 0, 1, 2, 2, 2]]
    assert b.completion_ids.tolist() == [[14, 15, 0], [22, 23, 24], [33, 0, 0]]
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert b.completion_start.tolist() == [3, 3, 3]
    assert b.prompt_lengths.tolist() == [3, 1, 2]
    assert b.pad_gap.tolist() == [0, 0, 0]


def test_left_positions_are_unpadded_positions():
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="left")
    for row, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS, strict=False)):
        real = b.attention_mask[row].bool()
        assert b.position_ids[row][real].tolist() == list(range(len(prompt) + len(completion)))


@pytest.mark.parametrize("side", ["right", "left"])
def test_gathered_positions_predict_the_completion(side):
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side)
    next_token = torch.roll(b.input_ids, shifts=-1, dims=1)  # column t holds the token that t predicts
    gathered = gather_completion_positions(next_token, b)
    assert gathered.shape == b.completion_ids.shape
    mask = b.completion_mask.bool()
    assert torch.equal(gathered[mask], b.completion_ids[mask])
    hidden = torch.randn(3, b.input_ids.shape[1], 5)
    assert gather_completion_positions(hidden, b).shape == (3, 3, 5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_selected_tokens_are_the_masked_ones_forward_and_backward(side):
    """select_completion_tokens (an index built on the host) = boolean-mask selection, values
    and gradients, rows of different lengths in row order."""
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side)
    mask = b.completion_mask.bool()
    assert b.completion_index.tolist() == mask.flatten().nonzero().flatten().tolist() == [0, 1, 3, 4, 5, 6]
    assert select_completion_tokens(b.completion_ids, b).tolist() == [14, 15, 22, 23, 24, 33]
    # As the loss uses it: on the strided [B, C, H] view of the hidden states at the completion positions.
    hidden = torch.randn(3, b.input_ids.shape[1], 5, dtype=torch.float64, requires_grad=True)
    values = gather_completion_positions(hidden, b)
    weights = torch.randn(6, 5, dtype=torch.float64)
    picked = select_completion_tokens(values, b)
    torch.testing.assert_close(picked, values[mask], rtol=0, atol=0)
    (grad,) = torch.autograd.grad((picked * weights).sum(), hidden)
    (expected,) = torch.autograd.grad((values[mask] * weights).sum(), hidden)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_an_empty_completion_selects_nothing_from_its_row():
    b = build_scoring_batch([[11], [21, 22]], [[12, 13], []], pad_id=PAD, pad_side="left")
    assert b.completion_index.tolist() == [0, 1]
    assert select_completion_tokens(b.completion_ids, b).tolist() == [12, 13]


@pytest.mark.parametrize("side", ["right", "left"])
def test_alignment_check_passes(side):
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side)
    summary = check_alignment(b, COMPLETIONS)
    assert summary.startswith("ok: 3 rows, 6 completion tokens")
    if side == "right":
        assert summary.endswith("pad gap between prompt and completion: min 0 / mean 1.0 / max 2 tokens")


@pytest.mark.parametrize("side", ["right", "left"])
def test_alignment_check_catches_a_shift(side):
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side)
    b.input_ids[1] = torch.roll(b.input_ids[1], shifts=1)  # row 1 off by one position
    with pytest.raises(AlignmentError,
                       match=r"^\[OPSD align\] row 1: input_ids\[3:6\] differ from the sampled completion at token 0$"):
        check_alignment(b, COMPLETIONS)


def test_alignment_check_catches_a_wrong_mask():
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="right")
    b.completion_mask[2, 1] = 1  # supervises a pad
    with pytest.raises(AlignmentError, match="row 2: completion_mask covers 2 tokens, the completion has 1"):
        check_alignment(b, COMPLETIONS)


def test_alignment_check_catches_a_wrong_completion_index():
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="right")
    b.completion_index[-1] = 7  # the loss would read a pad instead of row 2's token
    with pytest.raises(AlignmentError, match="completion_index does not name the masked completion tokens"):
        check_alignment(b, COMPLETIONS)


def test_alignment_check_catches_wrong_positions():
    b = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="left")
    b.position_ids[0, 3:] += 1
    with pytest.raises(AlignmentError, match="row 0: completion position_ids"):
        check_alignment(b, COMPLETIONS)


def test_batch_input_errors():
    with pytest.raises(ValueError, match="one completion per prompt"):
        build_scoring_batch([[1]], [[2], [3]], pad_id=PAD, pad_side="right")
    with pytest.raises(ValueError, match="at least one token"):
        build_scoring_batch([[]], [[2]], pad_id=PAD, pad_side="right")


def test_left_padding_scores_tokens_where_they_were_sampled():
    """A real Qwen3 forward: left geometry reproduces each row's unpadded logits;
    right geometry does so only for the row without a pad gap."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(config).eval()

    def completion_logits(batch):
        with torch.no_grad():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids)
        return gather_completion_positions(out.logits, batch)

    def alone(row):
        single = build_scoring_batch([PROMPTS[row]], [COMPLETIONS[row]], pad_id=PAD, pad_side="left")
        return completion_logits(single)[0, :len(COMPLETIONS[row])]

    left = completion_logits(build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="left"))
    right = completion_logits(build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side="right"))
    for row, completion in enumerate(COMPLETIONS):
        torch.testing.assert_close(left[row, :len(completion)], alone(row), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right[0, :2], alone(0), atol=1e-5, rtol=1e-5)  # pad gap 0
    assert not torch.allclose(right[1, :3], alone(1), atol=1e-3)  # pad gap 2 shifts rotary positions


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_to_multiple_of_appends_a_masked_tail(side):
    plain = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side)
    padded = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side, pad_to_multiple_of=8)
    assert plain.input_ids.shape[1] == 6 and padded.input_ids.shape[1] == 8
    assert torch.equal(padded.input_ids[:, :6], plain.input_ids)
    assert torch.equal(padded.attention_mask[:, :6], plain.attention_mask)
    assert padded.input_ids[:, 6:].eq(PAD).all() and padded.attention_mask[:, 6:].eq(0).all()
    if side == "left":
        assert torch.equal(padded.position_ids[:, :6], plain.position_ids)
    for name in ("completion_ids", "completion_mask", "completion_start", "prompt_lengths", "pad_gap"):
        assert torch.equal(getattr(padded, name), getattr(plain, name)), name
    assert check_alignment(padded, COMPLETIONS) == check_alignment(plain, COMPLETIONS)
    already = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side, pad_to_multiple_of=3)
    assert torch.equal(already.input_ids, plain.input_ids)


@pytest.mark.parametrize("side", ["right", "left"])
def test_tail_padding_leaves_completion_logits_unchanged(side):
    """A real Qwen3 forward: the masked tail is after every scored position (causal)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(config).eval()

    def completion_logits(multiple):
        batch = build_scoring_batch(PROMPTS, COMPLETIONS, pad_id=PAD, pad_side=side, pad_to_multiple_of=multiple)
        with torch.no_grad():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids)
        return gather_completion_positions(out.logits, batch), batch.completion_mask.bool()

    (plain, mask), (padded, _) = completion_logits(None), completion_logits(16)
    torch.testing.assert_close(padded[mask], plain[mask], atol=1e-5, rtol=1e-5)


# -- several token-mean groups in one forward (token_mean_rows) ----------------------------

# Two groups whose own geometries differ: another longest prompt (right: another pad gap) and
# another longest completion, so one shared geometry would move their tokens.
GROUPS = [([[5, 6, 7, 8, 9], [11]], [[21, 22], [23]]), ([[12, 13], [14, 15, 16]], [[24, 25, 26, 27], [28]])]


@pytest.mark.parametrize("side", ["right", "left"])
def test_one_forward_extends_each_group_after_its_last_column(side):
    groups = [build_scoring_batch(p, c, pad_id=PAD, pad_side=side) for p, c in GROUPS]
    widths = [g.input_ids.shape[1] for g in groups]
    assert widths == [7, 7] and [g.prompt_width for g in groups] == [5, 3]
    groups[1] = build_scoring_batch(*GROUPS[1], pad_id=PAD, pad_side=side, pad_to_multiple_of=8)  # widths 7, 8
    one = one_forward(groups, PAD)
    assert one.input_ids.shape == (4, 8)
    for k, g in enumerate(groups):
        rows, w = slice(2 * k, 2 * k + 2), g.input_ids.shape[1]
        assert torch.equal(one.input_ids[rows, :w], g.input_ids)
        assert torch.equal(one.attention_mask[rows, :w], g.attention_mask)
        assert one.input_ids[rows, w:].eq(PAD).all() and one.attention_mask[rows, w:].eq(0).all()
        if side == "left":
            assert torch.equal(one.position_ids[rows, :w], g.position_ids)
    assert (one.position_ids is None) == (side == "right")
    single = one_forward(groups[:1], PAD)  # one group: its own tensors, untouched
    assert single.input_ids is groups[0].input_ids and single.attention_mask is groups[0].attention_mask
    other = "left" if side == "right" else "right"
    with pytest.raises(ValueError, match="one pad side"):
        one_forward([groups[0], build_scoring_batch(*GROUPS[1], pad_id=PAD, pad_side=other)], PAD)


@pytest.mark.parametrize("side", ["right", "left"])
def test_one_forward_gives_each_group_its_own_forward(side):
    """A real Qwen3 forward over both groups (float64): every scored logit equals the one of
    the group's own forward. Under right padding one geometry for all rows would not: the
    second group's pad gap would grow (checked, so the comparison has teeth)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(config).double().eval()

    def scored(batch, rows=slice(None), inputs=None):
        inputs = inputs or batch
        with torch.no_grad():
            logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                           position_ids=inputs.position_ids).logits
        logits = logits[rows, :batch.input_ids.shape[1]]
        return gather_completion_positions(logits, batch)[batch.completion_mask.bool()]

    groups = [build_scoring_batch(p, c, pad_id=PAD, pad_side=side) for p, c in GROUPS]
    one = one_forward(groups, PAD)
    for k, g in enumerate(groups):
        torch.testing.assert_close(scored(g, slice(2 * k, 2 * k + 2), one), scored(g), rtol=1e-12, atol=1e-12)
    if side == "right":
        rows = [r for p, c in GROUPS for r in zip(p, c, strict=False)]
        merged = build_scoring_batch([p for p, _ in rows], [c for _, c in rows], pad_id=PAD, pad_side=side)
        second = build_scoring_batch(*GROUPS[1], pad_id=PAD, pad_side=side)
        merged_second = scored(merged)[-int(second.completion_mask.sum()):]
        assert (merged_second - scored(second)).abs().max() > 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
def test_tiny_rows_align_for_both_roles(tok, side):
    from opsd.data import load_train_dataset

    rows = load_train_dataset("tiny", teacher_context="both").select(range(8)).to_list()
    builder = PromptBuilder(tok, teacher_context="both")
    completions = [tok.encode(row["solution"], add_special_tokens=False) + [tok.eos_token_id] for row in rows]
    geometry = {"pad_id": tok.pad_token_id, "pad_side": side}
    student = build_scoring_batch([builder.student_prompt_ids(r) for r in rows], completions, **geometry)
    teacher = build_scoring_batch([builder.teacher_prompt_ids(r) for r in rows], completions, **geometry)
    assert check_alignment(student, completions).startswith("ok: 8 rows")
    assert check_alignment(teacher, completions).startswith("ok: 8 rows")
    assert torch.equal(student.completion_ids, teacher.completion_ids)
    assert torch.equal(student.completion_mask, teacher.completion_mask)
    assert student.input_ids.shape[1] < teacher.input_ids.shape[1]  # the teacher also reads the reference
