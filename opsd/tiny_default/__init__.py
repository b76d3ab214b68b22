"""The embedded default: everything an offline run needs, rebuilt from package data.

Real runs load hub models (`Qwen/Qwen3-1.7B`) and hub datasets; nothing here can
reach a hub, so offline runs (tests, CI, quickstart) pass these names instead:

    model `tiny`          a small Qwen3 that has learned the generated task
                          (`learned_model`, weights committed compactly)
    model `tiny-random`   a sharp random-init tiny Qwen3 (`random_model`), for
                          tests that need large divergences, not knowledge
    data  `tiny`          the default training set (released schema) and the
                          default 30-problem eval set (AIME schema)
    data  `tiny:SEED`     as an eval set: a fresh held-out set of 30 problems
                          from SEED; as a training set: 4,096 fresh training
                          rows from SEED. `tiny:SEED:N` has N rows,
                          `tiny:SEED:N:FAMILY` N rows of one family (a `source`
                          tag of `tasks`, e.g. aops_forum).

Both models use the real Qwen3 tokenizer (`tokenizer`); the task is in `tasks`.
Everything is built once into `cache_dir()`; torch and transformers are imported
inside the builders, so data-only callers stay light.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from opsd.tiny_default import tasks
from opsd.tiny_default.cache import BUILD_VERSION, cache_dir, cached_file
from opsd.tiny_default.learned_model import build_learned_model, learned_model_dir
from opsd.tiny_default.random_model import build_tiny_model, random_model_dir
from opsd.tiny_default.tokenizer import ADDED_TOKENS, EOS_ID, PAD_ID, build_qwen3_tokenizer

TINY = "tiny"
TINY_RANDOM = "tiny-random"

N_TRAIN_ROWS = 4096
N_EVAL_ROWS = 30
TRAIN_SEED = 20260610
EVAL_SEED = 20240101
_NAME = re.compile(r"tiny:(\d+)(?::(\d+)(?::(\w+))?)?")
NAME_FORMS = "tiny, tiny:SEED, tiny:SEED:N or tiny:SEED:N:FAMILY"

__all__ = [
    "ADDED_TOKENS", "EOS_ID", "PAD_ID", "BUILD_VERSION", "N_EVAL_ROWS", "N_TRAIN_ROWS", "NAME_FORMS", "TINY",
    "TINY_RANDOM",
    "build_learned_model", "build_qwen3_tokenizer", "build_tiny_model", "cache_dir", "eval_set_name", "is_tiny_name",
    "learned_model_dir", "random_model_dir", "resolve_model", "tasks", "tiny_eval_path", "tiny_train_path",
]


def resolve_model(name_or_path: str) -> str:
    """`tiny` / `tiny-random` -> the materialised model folder; anything else unchanged."""
    if name_or_path == TINY:
        return str(learned_model_dir())
    if name_or_path == TINY_RANDOM:
        return str(random_model_dir())
    return name_or_path


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def is_tiny_name(name: str) -> bool:
    """`tiny`, `tiny:SEED`, `tiny:SEED:N` or `tiny:SEED:N:FAMILY` (SEED >= 0, N >= 1, FAMILY
    one of `tasks.SOURCES`)."""
    if name == TINY:
        return True
    match = _NAME.fullmatch(name)
    return (bool(match) and (match.group(2) is None or int(match.group(2)) >= 1)
            and (match.group(3) is None or match.group(3) in tasks.SOURCES))


def _parse(name: str, default_seed: int, default_count: int) -> tuple[int, int, str | None]:
    """(seed, rows, family or None) of a tiny data name."""
    if not is_tiny_name(name):
        raise ValueError(f"not a tiny dataset name: {name!r} (expected {NAME_FORMS}; "
                         f"FAMILY one of {', '.join(tasks.SOURCES)})")
    if name == TINY:
        return default_seed, default_count, None
    match = _NAME.fullmatch(name)
    return int(match.group(1)), int(match.group(2) or default_count), match.group(3)


def _family_suffix(family: str | None) -> str:
    return f"-{family}" if family else ""


def train_rows(name: str) -> int:
    """How many training rows (unique problems) a tiny data name draws: N of `tiny:SEED:N`, the
    4,096 of `tiny` and `tiny:SEED`."""
    return _parse(name, TRAIN_SEED, N_TRAIN_ROWS)[1]


def eval_set_name(name: str) -> str:
    """An eval set's name with its seed and size spelled out, `tiny:SEED:N` (`tiny` is
    `tiny:20240101:30`): what reports call the set, so that two reports of one set say the same
    and a report says which set it was. Any other name is returned unchanged."""
    if not is_tiny_name(name):
        return name
    seed, count, family = _parse(name, EVAL_SEED, N_EVAL_ROWS)
    return f"{TINY}:{seed}:{count}" + (f":{family}" if family else "")


def tiny_train_path(name: str = TINY) -> Path:
    """Training rows of the train split (.jsonl, columns of siyanzhao/Openthoughts_math_30k_opsd)."""
    seed, count, family = _parse(name, TRAIN_SEED, N_TRAIN_ROWS)

    def build() -> bytes:
        return _jsonl_bytes([tasks.train_row(p) for p in tasks.draw(seed, "train", count, family)])

    file = f"tiny-train-{BUILD_VERSION}-seed{seed}-n{count}{_family_suffix(family)}.jsonl"
    return cached_file(cache_dir() / file, build)


def tiny_eval_path(name: str = TINY) -> Path:
    """Problems of the eval split (.jsonl, AIME24 columns problem and answer)."""
    seed, count, family = _parse(name, EVAL_SEED, N_EVAL_ROWS)

    def build() -> bytes:
        return _jsonl_bytes([tasks.eval_row(p) for p in tasks.draw(seed, "eval", count, family)])

    file = f"tiny-eval-{BUILD_VERSION}-seed{seed}-n{count}{_family_suffix(family)}.jsonl"
    return cached_file(cache_dir() / file, build)
