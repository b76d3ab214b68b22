"""The embedded default's task: procedural multi-step integer arithmetic.

Five families, each tagged with a `source` of the released training set, each
solved in two or three worked steps whose every number is computed here:

    math            Compute $a \\times b + c$.            a*b = P, P + c = R
    olympiads       Compute $(a + b) \\times c$.          a + b = S, S*c = R
    amc_aime        Compute $a \\times b + c \\times d$.  a*b = P, c*d = Q, P + Q = R
    aops_forum      Solve for $x$: $ax + b = c$.         c - b = D, D / a = x
    number_theory   sum of the digits of a*b            a*b = P, digit sum of P

Answers are integers in 0..999 (AIME's range). Qwen's tokenizer writes every digit
as its own token, so a wrong answer is a wrong digit inside a worked step: the
place where a teacher that reads the reference solution holds the correction.

Train / eval split by construction: a problem belongs to the eval split when a
hash of its text falls in one bucket out of `EVAL_BUCKETS`. Training rows (the
`tiny` train set and the stream the learned model was trained on) only ever come
from the train split, eval rows (`tiny`, `tiny:SEED`) only from the eval split,
so no eval problem can be seen in training, whatever the seeds.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

EVAL_BUCKETS = 10  # one bucket in ten is the eval split


@dataclass(frozen=True)
class Problem:
    """One generated problem with its worked solution and a longer trace."""
    family: str      # the `source` tag
    problem: str
    answer: int
    steps: tuple[tuple[str, str], ...]  # (left side, value) of each worked step, in order
    solution: str    # concise worked solution ending in \boxed{answer}
    trace: str       # longer verified reasoning (COT_Reason)


def _mul(x: int, y: int) -> str:
    return f"{x} \\times {y}"


def _solution(steps: list[tuple[str, str]], answer: int, tail: str = "") -> str:
    words = ["First", "Next", "Then"] if len(steps) == 3 else ["First", "Then"]
    parts = [f"{word}, ${lhs} = {value}${tail if i == len(steps) - 1 else ''}."
             for i, (word, (lhs, value)) in enumerate(zip(words, steps, strict=False))]
    return " ".join(parts) + f" The answer is \\boxed{{{answer}}}."


def _trace(rng: random.Random, opener: str, lines: list[str], checks: list[str], answer: int) -> str:
    """R1-style trace: opener, the steps in words, a verification half of the
    time (so trace lengths vary and the `hard` selection means something)."""
    parts = [opener, *lines]
    if rng.random() < 0.5:
        parts += checks
    parts.append(f"So the answer is {answer}.\n\n**Final Answer**\n\\boxed{{{answer}}}")
    return "\n\n".join(parts)


def _split_product(x: int, y: int) -> str:
    """x * y through tens and ones of x: the multi-digit step in words."""
    tens, ones = x - x % 10, x % 10
    return f"{x} * {y}: {tens} * {y} = {tens * y} and {ones} * {y} = {ones * y}, so {x} * {y} = {x * y}."


def _multiply_add(rng: random.Random) -> Problem:
    a, b, c = rng.randint(12, 99), rng.randint(3, 9), rng.randint(10, 99)
    p, r = a * b, a * b + c
    steps = [(_mul(a, b), str(p)), (f"{p} + {c}", str(r))]
    return Problem("math", f"Compute ${_mul(a, b)} + {c}$.", r, tuple(steps), _solution(steps, r),
                   _trace(rng, f"Okay, I need to compute {a} times {b} plus {c}. Multiplication comes first.",
                          [_split_product(a, b), f"Then {p} + {c} = {r}."],
                          [f"Let me check: {r} - {c} = {p}, and {p} / {b} = {a}. Correct."], r))


def _add_multiply(rng: random.Random) -> Problem:
    a, b, c = rng.randint(10, 50), rng.randint(10, 50), rng.randint(3, 9)
    s, r = a + b, (a + b) * c
    steps = [(f"{a} + {b}", str(s)), (_mul(s, c), str(r))]
    return Problem("olympiads", f"Compute $({a} + {b}) \\times {c}$.", r, tuple(steps), _solution(steps, r),
                   _trace(rng, f"Alright, the parentheses come first: {a} + {b}, then times {c}.",
                          [f"{a} + {b} = {s}.", _split_product(s, c)],
                          [f"Check by distributing: {a} * {c} + {b} * {c} = {a * c} + {b * c} = {r}. Same."], r))


def _two_products(rng: random.Random) -> Problem:
    a, b, c, d = rng.randint(11, 49), rng.randint(2, 9), rng.randint(11, 49), rng.randint(2, 9)
    p, q = a * b, c * d
    r = p + q
    steps = [(_mul(a, b), str(p)), (_mul(c, d), str(q)), (f"{p} + {q}", str(r))]
    return Problem("amc_aime", f"Compute ${_mul(a, b)} + {_mul(c, d)}$.", r, tuple(steps), _solution(steps, r),
                   _trace(rng, f"Let me think. There are two products to add: {a} * {b} and {c} * {d}.",
                          [_split_product(a, b), _split_product(c, d), f"Adding them: {p} + {q} = {r}."],
                          [f"Check: {r} - {q} = {p}, which is {a} * {b}. Correct."], r))


def _linear(rng: random.Random) -> Problem:
    a, x, b = rng.randint(2, 9), rng.randint(2, 30), rng.randint(1, 60)
    c = a * x + b
    d = c - b
    steps = [(f"{c} - {b}", str(d)), (f"{d} \\div {a}", str(x))]
    return Problem("aops_forum", f"Solve for $x$: ${a}x + {b} = {c}$.", x, tuple(steps),
                   _solution(steps, x, tail=f", so $x = {x}$"),
                   _trace(rng, f"Hmm, a linear equation. I isolate x in {a}x + {b} = {c}.",
                          [f"Subtract {b} from both sides: {a}x = {c} - {b} = {d}.",
                           f"Divide by {a}: x = {d} / {a} = {x}, since {a} * {x} = {d}."],
                          [f"Substitute back: {a} * {x} + {b} = {d} + {b} = {c}. Correct."], x))


def _digit_sum(rng: random.Random) -> Problem:
    a, b = rng.randint(12, 99), rng.randint(3, 9)
    p = a * b
    r = sum(map(int, str(p)))
    steps = [(_mul(a, b), str(p)), (" + ".join(str(p)), str(r))]
    return Problem("number_theory", f"What is the sum of the digits of ${_mul(a, b)}$?", r, tuple(steps),
                   _solution(steps, r),
                   _trace(rng, f"I need the product {a} * {b} first, then its digit sum.",
                          [_split_product(a, b), f"The digits of {p} add up to {' + '.join(str(p))} = {r}."],
                          [f"Check mod 9: {a} * {b} mod 9 = {p % 9} and {r} mod 9 = {r % 9}. They agree."], r))


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "math": _multiply_add, "olympiads": _add_multiply, "amc_aime": _two_products,
    "aops_forum": _linear, "number_theory": _digit_sum}
SOURCES = tuple(FAMILIES)
# Repeats weight the draw: most rows are `math`, as in the released set.
_DRAW = ("math", *SOURCES)
_MAX_MISSES = 100_000  # draws without a new problem before a stream counts as exhausted


def split_of(problem_text: str) -> str:
    """'eval' or 'train', from a hash of the problem text (stable across runs)."""
    digest = hashlib.sha256(problem_text.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "little") % EVAL_BUCKETS == 0 else "train"


def problems(seed: int, split: str, family: str | None = None) -> Iterator[Problem]:
    """An endless stream of distinct problems of one split, from a seed: every family
    (weighted as `_DRAW`), or only `family`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(SOURCES)}, got {family!r}")
    rng, seen, misses = random.Random(seed), set(), 0
    while True:
        # The mixed stream draws its family first; a one-family stream does not (its own stream).
        item = FAMILIES[family](rng) if family else FAMILIES[rng.choice(_DRAW)](rng)
        if item.problem not in seen and split_of(item.problem) == split:
            seen.add(item.problem)
            misses = 0
            yield item
        else:
            misses += 1
            if misses > _MAX_MISSES:  # a family's finite space is used up (digit sums: ~600 problems)
                raise ValueError(f"no new {split} problem of {family or 'the mixed task'} in {_MAX_MISSES:,} "
                                 f"draws after {len(seen)} distinct ones: ask for fewer rows")


def draw(seed: int, split: str, count: int, family: str | None = None) -> list[Problem]:
    stream = problems(seed, split, family)
    return [next(stream) for _ in range(count)]


def train_row(item: Problem) -> dict:
    """A row in the released training schema."""
    return {"problem": item.problem, "solution": item.solution, "COT_Reason": item.trace,
            "source": item.family, "Answer": str(item.answer)}


def eval_row(item: Problem) -> dict:
    """A row in the AIME schema."""
    return {"problem": item.problem, "answer": str(item.answer)}
