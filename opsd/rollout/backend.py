"""What the sampling backends share: the error a backend that cannot run here raises, and the
EOS ids a sample stops at. A leaf of the package (the backends import it; it imports none of them)."""
from __future__ import annotations

from collections.abc import Sequence


class BackendUnavailable(RuntimeError):
    """A requested sampling engine cannot be used here (one-line message)."""


def eos_token_ids_of(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends a sample: the tokenizer's EOS plus the checkpoint's
    generation_config list (Qwen3: <|im_end|> and <|endoftext|>)."""
    ids = as_id_list(getattr(tokenizer, "eos_token_id", None))
    if generation_config is not None:
        ids += as_id_list(generation_config.eos_token_id)
    return list(dict.fromkeys(ids))


def as_id_list(ids: Sequence[int] | int | None) -> list[int]:
    """Token ids as a list of ints: from one id, a sequence of them, or None (none)."""
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]
