"""What to sample and from which random stream: the settings every sampling engine
takes (transformers, the static decoder, vLLM), the completion they return, and the
seeds of training rollouts and evaluation chunks.

A leaf module (standard library only), imported by the engines and their callers.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The engines of opsd.rollout.TransformersBackend (None = "dynamic"; "paged" is opsd/rollout/paged_decode.py),
# declared here so that the trainer's config can check them without importing the engine.
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "graph", "graph_compiled", "paged", "auto")
GRAPH_LOOPS = ("graph", "graph_compiled")  # the CUDA-graph decode loops (opsd.rollout.static_decode)


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample. temperature == 0 means greedy; top_k <= 0 disables top-k;
    seed None draws from the process-global RNG (not reproducible)."""
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int | None = None


@dataclass
class Completion:
    """One sampled completion. `ids` end with the EOS token if one was sampled and
    hold nothing after it (no pads). `truncated`: the sample hit max_new_tokens
    without sampling EOS."""
    ids: list[int]
    truncated: bool


def derive_seed(seed: int, *keys: int | str) -> int:
    """A well-mixed 63-bit seed for a sub-stream (a batch, a prompt) of `seed`.
    Hashing rather than `seed + key` keeps sub-streams of nearby seeds apart."""
    text = ":".join(str(part) for part in (seed, *keys))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


# What a training process samples (rollout_seed's `stream`).
ROLLOUT_STREAMS = ("student", "reason_first")


def rollout_seed(seed: int, rank: int, step: int, stream: str = ROLLOUT_STREAMS[0]) -> int:
    """The seed of what training process `rank` samples at optimizer step `step`.

    Each rank samples its own rows, on its own random stream: rank-distinct (`seed + rank`
    would give seed 1's rank 0 the stream of seed 0's rank 1, paired seeds of a grid),
    reproducible (no RNG state to restore on resume) and apart from the evaluation's
    (seed, index) streams, which hash fewer keys."""
    return derive_seed(seed, rank, step, ROLLOUT_STREAMS.index(stream))


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` trains on student rollouts (else on the reference
    solutions: GKD's lmbda, the share of on-policy steps). A function of (seed, step)
    alone, like `rollout_seed`: every rank makes the same choice and a resumed run makes
    the choices of the uninterrupted one, with no RNG state to save."""
    if lmbda >= 1.0:
        return True
    draw = derive_seed(seed, step, "on-policy") / 2**63  # uniform in [0, 1)
    return draw < lmbda


def to_completion(ids: Iterable[int], eos_token_ids: Sequence[int]) -> Completion:
    """Cut `ids` right after the first EOS; what follows it is padding. A sample
    without EOS can only have stopped by running out of tokens: truncated."""
    ids = list(ids)
    eos = set(eos_token_ids)
    for position, token in enumerate(ids):
        if token in eos:
            return Completion(ids=ids[: position + 1], truncated=False)
    return Completion(ids=ids, truncated=True)
