"""Sampling backends (opsd/rollout/transformers_backend.py, opsd/rollout/vllm_backend.py, chosen by
opsd/rollout/choice.py) on the embedded tiny Qwen3 model.

The EOS cases are made exact with a hook on lm_head that sets the EOS token's
probability to a chosen value: 1 (every sample is just EOS), 0 (every sample
runs out of tokens) or in between (a mix, to check the cutting invariants)."""
import copy
import math
import os
import sys
import types

import pytest
import torch
from lora_helpers import acting_lora

from opsd import rollout
from opsd.rollout import BackendUnavailable, TransformersBackend, resolve_backend_name, vllm_lora_rank
from opsd.rollout import vllm_backend as vllm_backend
from opsd.rollout.static_decode import StaticDecoder, bucket_width, resolve_cache_implementation
from opsd.sampling import ROLLOUT_STREAMS, Completion, SamplingSettings, derive_seed, rollout_seed, to_completion

SAMPLE = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=123)
GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=None)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd import tiny_default
    folder = tiny_default.random_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    problems = ["What is 1 + 1?", "Find the sum of all positive divisors of 36, and explain why.", "x?"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True) for p in problems]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def backend_for(tiny, model=None, **kwargs):
    base, tokenizer = tiny
    return TransformersBackend(model or base, pad_token_id=tokenizer.pad_token_id,
                               eos_token_ids=[tokenizer.eos_token_id], **kwargs)


def all_ids(result):
    return [[c.ids for c in samples] for samples in result]


class eos_probability:
    """Context: the model's next-token distribution gives EOS exactly probability p
    (at temperature 1, no top-p/top-k), the other tokens sharing the rest."""

    def __init__(self, model, eos_id, p):
        self.model, self.eos_id, self.p = model, eos_id, p

    def _hook(self, module, inputs, logits):
        logits = logits.clone()
        if self.p == 1:
            logits.fill_(-math.inf)
            logits[..., self.eos_id] = 0.0
        else:
            logits[..., self.eos_id] = -math.inf
            if self.p > 0:
                logits[..., self.eos_id] = logits.logsumexp(-1) + math.log(self.p / (1 - self.p))
        return logits

    def __enter__(self):
        self.handle = self.model.get_output_embeddings().register_forward_hook(self._hook)

    def __exit__(self, *exc):
        self.handle.remove()


# ---------------------------------------------------------------- pure helpers

def test_to_completion_cuts_after_first_eos():
    assert to_completion([5, 6, 2, 9, 2], eos_token_ids=[2]) == Completion([5, 6, 2], truncated=False)
    assert to_completion([2, 0, 0], eos_token_ids=[2, 0]) == Completion([2], truncated=False)
    assert to_completion([5, 6, 7], eos_token_ids=[2]) == Completion([5, 6, 7], truncated=True)


def test_derive_seed_is_stable_and_separates_streams():
    assert derive_seed(20260610, 0) == derive_seed(20260610, 0)
    seeds = {derive_seed(s, k) for s in range(5) for k in range(5)}
    assert len(seeds) == 25 and all(0 <= s < 2**63 for s in seeds)


def test_rollout_seeds_differ_by_rank_step_and_stream_and_are_stable():
    """Each training process samples on its own stream, the same one in every run."""
    keys = [(rank, step, stream) for rank in range(8) for step in range(50) for stream in ROLLOUT_STREAMS]
    seeds = {rollout_seed(0, *key) for key in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 2**63 for s in seeds)
    # Paired seeds of a grid do not share streams across ranks, as `seed + rank` would.
    assert rollout_seed(1, 0, 0) != rollout_seed(0, 1, 0)
    # Apart from the evaluation's (seed, index) streams.
    assert not seeds & {derive_seed(0, index) for index in range(1000)}
    # A hash of the keys, not Python's salted hash(): fixed across processes and versions.
    assert rollout_seed(0, 1, 2) == 525640092475644386


def test_on_policy_steps_depend_on_seed_and_step_only():
    """GKD's lmbda: the share of on-policy steps, chosen per (seed, step) with no RNG state,
    so a resumed run (or another rank) makes the uninterrupted run's choices."""
    import random

    from opsd.sampling import on_policy_step

    choices = [on_policy_step(3, step, 0.3) for step in range(2000)]
    random.seed(99)
    torch.manual_seed(99)
    assert [on_policy_step(3, step, 0.3) for step in range(1000, 2000)] == choices[1000:]
    assert abs(sum(choices) / len(choices) - 0.3) < 0.04  # binomial sd 0.01
    assert choices != [on_policy_step(4, step, 0.3) for step in range(2000)]
    assert all(on_policy_step(3, step, 1.0) for step in range(50))
    assert not any(on_policy_step(3, step, 0.0) for step in range(50))


def test_lora_rank_rounds_up_to_what_vllm_accepts(tmp_path):
    import json

    for r, expected in [(4, 8), (8, 8), (64, 64), (100, 128)]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({"r": r}))
        assert vllm_lora_rank(tmp_path) == expected
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 32}}))
    assert vllm_lora_rank(tmp_path) == 32


# ---------------------------------------------------------------- EOS and truncation

def test_certain_eos_gives_single_token_completions(tiny, prompts):
    model, tokenizer = tiny
    with eos_probability(model, tokenizer.eos_token_id, 1.0):
        result = backend_for(tiny).generate(prompts, SAMPLE, n=2)
    assert all(c == Completion([tokenizer.eos_token_id], truncated=False) for s in result for c in s)


def test_impossible_eos_truncates_every_completion(tiny, prompts):
    model, tokenizer = tiny
    with eos_probability(model, tokenizer.eos_token_id, 0.0):
        result = backend_for(tiny).generate(prompts, SAMPLE, n=2)
    for completion in (c for s in result for c in s):
        assert completion.truncated and len(completion.ids) == SAMPLE.max_new_tokens
        assert tokenizer.eos_token_id not in completion.ids


def assert_cut_after_first_eos(completions, eos):
    """Nothing after the first EOS; truncated exactly when the budget ran out without EOS."""
    for c in completions:
        assert eos not in c.ids[:-1]
        if c.truncated:
            assert len(c.ids) == SAMPLE.max_new_tokens and c.ids[-1] != eos
        else:
            assert c.ids[-1] == eos and len(c.ids) <= SAMPLE.max_new_tokens


def test_mixed_batches_are_cut_after_eos_with_no_padding(tiny, prompts):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    with eos_probability(model, eos, 0.2):
        result = backend_for(tiny, batch_size=4).generate(prompts, SAMPLE, n=4)
    completions = [c for s in result for c in s]
    assert_cut_after_first_eos(completions, eos)
    # the seed is fixed, so this mix is deterministic: both kinds, several lengths
    assert {c.truncated for c in completions} == {True, False}
    assert len({len(c.ids) for c in completions if not c.truncated}) > 1


# ---------------------------------------------------------------- shapes and seeds

def test_n_samples_per_prompt(tiny, prompts):
    result = backend_for(tiny).generate(prompts, SAMPLE, n=3)
    assert len(result) == len(prompts) and all(len(samples) == 3 for samples in result)
    assert all(len({tuple(c.ids) for c in samples}) > 1 for samples in result)


def test_same_seed_same_samples_whatever_ran_before(tiny, prompts):
    backend = backend_for(tiny, batch_size=2)
    first = backend.generate(prompts, SAMPLE, n=2)
    torch.manual_seed(999)
    torch.rand(1000)  # disturb the global RNG: it must not matter
    assert all_ids(backend.generate(prompts, SAMPLE, n=2)) == all_ids(first)


def test_different_seed_different_samples(tiny, prompts):
    backend = backend_for(tiny)
    other = SamplingSettings(**{**SAMPLE.__dict__, "seed": SAMPLE.seed + 1})
    assert all_ids(backend.generate(prompts, other, n=2)) != all_ids(backend.generate(prompts, SAMPLE, n=2))


def test_caller_rng_state_is_left_untouched(tiny, prompts):
    state = torch.get_rng_state()
    backend_for(tiny).generate(prompts, SAMPLE)
    assert torch.equal(torch.get_rng_state(), state)


def test_left_padding_keeps_each_prompt_greedy_completion(tiny, prompts):
    """A short prompt padded next to a long one decodes exactly as it does alone:
    pads are masked and rotary positions come from the attention mask."""
    backend = backend_for(tiny)
    batched = backend.generate(prompts, GREEDY)
    alone = [backend.generate([p], GREEDY)[0] for p in prompts]
    assert all_ids(batched) == all_ids(alone)


def test_static_cache_matches_dynamic_cache(tiny, prompts):
    dynamic = backend_for(tiny).generate(prompts, GREEDY)
    static = backend_for(tiny, cache_implementation="static").generate(prompts, GREEDY)
    assert all_ids(static) == all_ids(dynamic)
    with pytest.raises(ValueError, match="cache_implementation"):
        backend_for(tiny, cache_implementation="offloaded")


def test_peft_model_samples_with_its_adapter_and_keeps_its_mode(tiny, prompts):
    import copy

    from peft import LoraConfig, get_peft_model

    from opsd.model_utils import peft_wrapping

    model, _ = tiny
    with peft_wrapping():
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                                     target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.5)  # a freshly initialised adapter is a no-op; make it act
    peft_model.train()
    adapted = backend_for(tiny, model=peft_model).generate(prompts, GREEDY)
    assert peft_model.training, "generate must restore the caller's train/eval mode"
    assert all_ids(adapted) != all_ids(backend_for(tiny).generate(prompts, GREEDY))


# ---------------------------------------------------------------- the static-cache decode loop ("graph")
# On CPU the loop runs its step eagerly (nothing is recorded or compiled); the
# same step function is what CUDA records, so these check its cache, mask,
# position and sampling logic.

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(tiny, dtype=torch.float32, seed=0):
    return acting_lora(tiny[0], ALL_PROJECTIONS, r=8, dtype=dtype, seed=seed)


def test_graph_loop_matches_dynamic_cache_greedy(tiny, prompts):
    dynamic = backend_for(tiny).generate(prompts, GREEDY)
    graph = backend_for(tiny, cache_implementation="graph")
    assert all_ids(graph.generate(prompts, GREEDY)) == all_ids(dynamic)
    # left padding up to the width bucket changes nothing: each prompt alone decodes the same
    assert [graph.generate([p], GREEDY)[0] for p in prompts] == graph.generate(prompts, GREEDY)


@pytest.mark.parametrize("compiled_layers", [False, True])
def test_prefill_writes_the_cache_and_gives_each_prompts_last_logits(tiny, compiled_layers):
    """float64: the prefill over packed prompts of many lengths gives each row the logits
    of its prompt alone, unpadded, through the model's own forward, and writes its keys and
    values at the prompt's columns of the cache (the attention of each prompt alone, again).
    Compiled (torch.compile's "eager" backend: dynamo's capture, no code generation), the
    decoder layers make one graph between them (the cache's layer is chosen outside it) for
    every packed length, kept apart from the cache of the layers' own forward."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from opsd.rollout import static_decode as static_decode

    model, tokenizer = tiny
    model = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in (3, 40, 7, 22, 1, 35)]
    decoder = static_decode.StaticDecoder(model, compiled=False)
    settings = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=2)
    decoder.generate(rows, settings, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[-5])
    state = decoder.state
    prompts = static_decode.pack_prompts(rows, state.width, torch.device("cpu"))
    state.valid.zero_()
    state.valid[prompts.rows, prompts.columns] = True  # as `run` leaves it for its prefill
    for buffer in (*state.cache.keys, *state.cache.values):
        buffer.fill_(math.nan)  # nothing of the decode above survives into the checks
    if compiled_layers:
        assert len(state.cache.keys) >= 2
        state.prefill_layers = static_decode.prefill_layers(model, backend="eager")
        torch._dynamo.reset()
        counters.clear()
    with static_decode._static_attention(model), torch.no_grad():
        logits = state.prefill(prompts)
    if compiled_layers:
        assert counters["stats"]["unique_graphs"] == 1
        assert all("forward" not in layer.__dict__ for layer in state.prefill_layers.layers)  # put back
    with torch.no_grad():
        alone = [model(torch.tensor([row]), use_cache=True) for row in rows]
    assert torch.allclose(logits, torch.stack([out.logits[0, -1] for out in alone]), rtol=0, atol=1e-9)
    for i, (row, out) in enumerate(zip(rows, alone, strict=False)):
        columns = slice(state.width - len(row), state.width)
        for layer in range(len(state.cache.keys)):
            key, value = out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values
            assert torch.allclose(state.cache.keys[layer][i, :, columns], key[0], rtol=0, atol=1e-9)
            assert torch.allclose(state.cache.values[layer][i, :, columns], value[0], rtol=0, atol=1e-9)
            padding = slice(0, state.width - len(row))  # zeros: finite, whatever reads them under the mask
            assert not state.cache.keys[layer][i, :, padding].any()
            assert not state.cache.values[layer][i, :, padding].any()
    if compiled_layers:  # other prompt lengths reuse the graph (dynamic shapes); the layers' own forward has none
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        shorter = static_decode.pack_prompts([row[:5] for row in rows], state.width, torch.device("cpu"))
        with static_decode._static_attention(model), torch.no_grad():
            state.prefill(shorter)
        assert counters["stats"]["unique_graphs"] == 1
        layer = state.prefill_layers.layers[0]
        assert _debug_get_cache_entry_list(type(layer).forward.__code__) == []


def test_graph_loop_short_last_batch_and_n(tiny, prompts):
    """Batches of 2 over 3 prompts x 2 samples: the short last batch is filled up and cut back."""
    reference = all_ids(backend_for(tiny).generate(prompts, GREEDY, n=2))
    assert all_ids(backend_for(tiny, batch_size=4, cache_implementation="graph").generate(prompts, GREEDY, n=2)) \
        == reference
    assert all_ids(backend_for(tiny, batch_size=2, cache_implementation="graph").generate(prompts[:1], GREEDY, n=3)) \
        == [reference[0] + reference[0][:1]]


@pytest.mark.parametrize("p", [1.0, 0.0, 0.2])
def test_graph_loop_eos_cases(tiny, prompts, p):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    with eos_probability(model, eos, p):
        completions = [c for s in backend_for(tiny, batch_size=4, cache_implementation="graph")
                       .generate(prompts, SAMPLE, n=4) for c in s]
    assert_cut_after_first_eos(completions, eos)
    if p == 1.0:
        assert all(c == Completion([eos], truncated=False) for c in completions)
    if p == 0.0:
        assert all(c.truncated for c in completions)
    if p == 0.2:
        assert {c.truncated for c in completions} == {True, False}


def test_graph_loop_sampling_is_seeded_and_leaves_the_rng_alone(tiny, prompts):
    backend = backend_for(tiny, batch_size=2, cache_implementation="graph")
    state = torch.get_rng_state()
    first = all_ids(backend.generate(prompts, SAMPLE, n=2))
    assert torch.equal(torch.get_rng_state(), state)
    torch.rand(1000)
    assert all_ids(backend.generate(prompts, SAMPLE, n=2)) == first
    other = SamplingSettings(**{**SAMPLE.__dict__, "seed": SAMPLE.seed + 1})
    assert all_ids(backend.generate(prompts, other, n=2)) != first
    assert all(len({tuple(c) for c in samples}) > 1 for samples in first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_loop_lora_unmerged_and_teacher_weights_untouched(tiny, prompts, dtype):
    """Adapter on, adapter disabled (the teacher), adapter on again: each as transformers'
    own generate samples it; the base weights (the teacher) stay bit-identical."""
    model = lora_model(tiny, dtype)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    model.train()
    # float32: the dynamic cache decodes identically; bf16: padded static attention rounds
    # differently from the dynamic cache, so the reference is transformers' static cache.
    reference_impl = None if dtype == torch.float32 else "static"
    graph = backend_for(tiny, model=model, cache_implementation="graph")
    reference = backend_for(tiny, model=model, cache_implementation=reference_impl)
    adapted = all_ids(graph.generate(prompts, GREEDY))
    assert adapted == all_ids(reference.generate(prompts, GREEDY))
    with model.disable_adapter():
        teacher = all_ids(graph.generate(prompts, GREEDY))
        assert teacher == all_ids(reference.generate(prompts, GREEDY))
    assert teacher != adapted
    assert all_ids(graph.generate(prompts, GREEDY)) == adapted
    assert model.training and model.config._attn_implementation == "sdpa"
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_graph_loop_sees_in_place_adapter_updates(tiny, prompts):
    model = lora_model(tiny)
    graph = backend_for(tiny, model=model, cache_implementation="graph")
    first = all_ids(graph.generate(prompts, GREEDY))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.0)  # an optimizer step writes in place, like this
    assert all_ids(graph.generate(prompts, GREEDY)) == all_ids(backend_for(tiny, model=model).generate(prompts, GREEDY))
    assert all_ids(graph.generate(prompts, GREEDY)) != first



@pytest.mark.parametrize("merge_lora", [False, True])
def test_graph_loop_samples_in_eval_mode_and_switches_the_model_only_when_it_samples(tiny, prompts, merge_lora):
    """LoRA dropout is live in train mode: the graph loop samples as in eval mode either way
    and leaves the caller's mode as it was. Unmerged it samples from the model, so it switches
    the model to eval and back; from the merged copy (eval mode of its own) it does not switch
    the model at all (a walk over every module, twice, per call)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from opsd.model_utils import peft_wrapping

    with peft_wrapping():
        peft_model = get_peft_model(copy.deepcopy(tiny[0]), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                                        target_modules=ALL_PROJECTIONS))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(3))
    graph = backend_for(tiny, model=peft_model, cache_implementation="graph", merge_lora=merge_lora)
    peft_model.eval()
    in_eval = all_ids(graph.generate(prompts, GREEDY))
    peft_model.train()
    switches = []
    inner = type(peft_model.get_base_model())  # the decoder runs the CausalLM under the peft wrapper
    original_train = inner.train
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inner, "train", lambda self, mode=True: switches.append(mode) or original_train(self, mode))
        assert all_ids(graph.generate(prompts, GREEDY)) == in_eval
    assert peft_model.training and peft_model.get_base_model().training
    assert switches == ([] if merge_lora else [False, True])

@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_merged_student_samples_what_the_adapters_sample(tiny, prompts, dtype):
    """The merged sampling copy: the same network as base + unmerged adapters (float64:
    logits to rounding, greedy token for token; bf16: within bf16 rounding), the teacher
    (adapter disabled) sampled from the untouched base, the base weights bit-identical."""
    from opsd.rollout.merged_student import MergedStudent

    model = lora_model(tiny, dtype)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    merged = MergedStudent(model)
    merged.refresh()
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits.double()
        got = merged.network(input_ids=ids).logits.double()
        with model.disable_adapter():
            teacher = model(input_ids=ids).logits.double()
    error, adapter_effect = (got - expected).abs().max(), (teacher - expected).abs().max()
    assert error <= (1e-10 if dtype == torch.float64 else 0.02) * expected.abs().max()
    assert adapter_effect > 20 * error
    unmerged = all_ids(backend_for(tiny, model=model, cache_implementation="graph").generate(prompts, GREEDY))
    merging = backend_for(tiny, model=model, cache_implementation="graph", merge_lora=True)
    student = all_ids(merging.generate(prompts, GREEDY))
    decoder = StaticDecoder.for_model(model, merge_lora=True)
    assert decoder.merged is not None and decoder.merge_error is None
    if dtype == torch.float64:
        assert student == unmerged
    # bf16: the padded static attention rounds differently from the dynamic cache (on some CPUs
    # enough to flip a greedy token), so the reference is transformers' static cache.
    reference = backend_for(tiny, model=model, cache_implementation=None if dtype == torch.float64 else "static")
    with model.disable_adapter():
        assert all_ids(merging.generate(prompts, GREEDY)) == all_ids(reference.generate(prompts, GREEDY))
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[name], after[name]) for name in before)
    shared = {t.data_ptr() for t in model.parameters()}
    copies = [p for n, p in merged.network.named_parameters() if p.data_ptr() not in shared]
    assert copies and all(n.endswith("proj.weight") for n, p in merged.network.named_parameters()
                          if p.data_ptr() not in shared)


def test_merged_student_follows_every_optimizer_step(tiny, prompts):
    """After each optimizer step the merged copy samples what the updated adapters sample:
    with fused AdamW (transformers' default optimizer), which updates the parameters in
    place without bumping their version counters, so nothing short of rebuilding can tell."""
    model = lora_model(tiny)
    graph = backend_for(tiny, model=model, cache_implementation="graph", merge_lora=True)
    seen = [all_ids(graph.generate(prompts, GREEDY))]
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(lora, lr=0.05, fused=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        versions = [p._version for p in lora]
        for param in lora:
            param.grad = torch.randn(param.shape, generator=gen)
        optimizer.step()
        assert [p._version for p in lora] == versions  # why the copy cannot skip a rebuild by version
        reference = all_ids(backend_for(tiny, model=model).generate(prompts, GREEDY))
        seen.append(all_ids(graph.generate(prompts, GREEDY)))
        assert seen[-1] == reference
    assert seen[1] != seen[0] and seen[2] != seen[1]


@pytest.mark.parametrize("merge_lora", [False, True])
def test_engine_logprobs_match_the_trainers_forward(tiny, prompts, merge_lora):
    """The decode loop's log-probabilities of the tokens it sampled (KV cache, left-padded
    prompt bucket, merged or unmerged adapters) equal those of one plain forward of the
    student over prompt + completion, as the trainer scores it (float64: to rounding)."""
    model = lora_model(tiny, torch.float64)
    graph = backend_for(tiny, model=model, cache_implementation="graph", merge_lora=merge_lora)
    sampled = graph.generate(prompts, SAMPLE)
    engine = StaticDecoder.for_model(model, merge_lora=merge_lora).sampled_logprobs(len(prompts))
    model.eval()
    for row, (prompt, samples) in enumerate(zip(prompts, sampled, strict=False)):
        ids = samples[0].ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert torch.allclose(engine[row, :len(ids)].double(), expected, atol=1e-5)  # float32 log-softmax
        assert bool((engine[row, len(ids):] == 0).all())


def test_kv_windows_cover_every_decode_column():
    from opsd.rollout.static_decode import decode_limits

    assert decode_limits(64, 300, 128) == [192, 320, 364]
    assert decode_limits(64, 256, 128) == [192, 320]
    assert decode_limits(96, 5, None) == [101]
    for width, new, window in [(64, 300, 128), (64, 1, 128), (96, 129, 64)]:
        limits = decode_limits(width, new, window)
        assert limits == sorted(limits) and limits[-1] == width + new
        # the token fed at decode step n sits at column width + n - 1: some window holds it
        assert all(any(width + n - 1 < limit for limit in limits) for n in range(1, new))


def test_kv_windows_sample_what_the_whole_cache_samples(tiny, prompts, monkeypatch):
    """Attending to the filled windows only (KV_WINDOW) changes nothing: the mask hid the rest."""
    from opsd.rollout import static_decode as static_decode

    settings = SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=40, seed=5)
    monkeypatch.setattr(static_decode, "KV_WINDOW", 16)
    windowed = all_ids(backend_for(tiny, cache_implementation="graph").generate(prompts, settings))
    monkeypatch.setattr(static_decode, "KV_WINDOW", None)
    StaticDecoder.for_model(tiny[0]).release()
    whole = all_ids(backend_for(tiny, cache_implementation="graph").generate(prompts, settings))
    assert windowed == whole and any(len(ids) > 16 for samples in whole for ids in samples)


@pytest.mark.parametrize("merge_lora", [False, True])
def test_a_decoder_does_not_keep_its_model_alive(tiny, prompts, merge_lora):
    """The decode loop's per-model state (KV cache, merged copy, graphs) goes with the model."""
    import gc
    import weakref

    model = lora_model(tiny)
    backend_for(tiny, model=model, cache_implementation="graph", merge_lora=merge_lora).generate(prompts, GREEDY)
    inner = weakref.ref(model.get_base_model())
    assert inner() in StaticDecoder._instances
    del model
    gc.collect()
    assert inner() is None


def test_pack_prompts_places_each_token_and_rejects_empty_prompts():
    from opsd.rollout import static_decode as static_decode

    packed = static_decode.pack_prompts([[5, 6, 7], [8]], 4, torch.device("cpu"))
    assert packed.input_ids.tolist() == [[5, 6, 7, 8]] and packed.positions.tolist() == [[0, 1, 2, 0]]
    assert packed.rows.tolist() == [0, 0, 0, 1] and packed.columns.tolist() == [1, 2, 3, 3]
    assert packed.lengths.tolist() == [3, 1] and packed.last.tolist() == [2, 3] and packed.width == 4
    with pytest.raises(ValueError, match="prompts of 1 to 4 tokens expected, got lengths 0 to 3"):
        static_decode.pack_prompts([[5, 6, 7], []], 4, torch.device("cpu"))


def test_model_state_walk_sees_every_tuner_layer_and_parameter(tiny):
    """`_model_state` walks the module tree by hand: it must see what modules() / parameters() see."""
    from opsd.rollout.static_decode import _is_tuner_layer, _model_state

    model = lora_model(tiny)
    states, fingerprint = _model_state(model)
    expected = {(bool(m.disable_adapters), tuple(m.active_adapters), bool(m.merged))
                for m in model.modules() if _is_tuner_layer(type(m))}
    assert states == tuple(sorted(expected)) and len(expected) == 1
    assert _model_state(model)[1] == fingerprint  # the same storage: the same fingerprint
    with model.disable_adapter():
        assert _model_state(model)[0] != states
    model.base_model.model.model.layers[-1].mlp.down_proj.lora_B["default"].weight.data = torch.zeros(1)
    assert _model_state(model)[1] != fingerprint  # one tensor deep in the tree moved


def test_merged_copy_is_remade_when_the_model_moves(tiny, prompts):
    """`.to()` gives the model new tensors; the copy, which shares them, is made again."""
    model = lora_model(tiny)
    graph = backend_for(tiny, model=model, cache_implementation="graph", merge_lora=True)
    graph.generate(prompts, GREEDY)
    first = StaticDecoder.for_model(model, merge_lora=True).merged
    model.to(torch.float64)
    assert all_ids(graph.generate(prompts, GREEDY)) == all_ids(backend_for(tiny, model=model).generate(prompts, GREEDY))
    again = StaticDecoder.for_model(model, merge_lora=True).merged
    assert again is not first and next(again.network.parameters()).dtype == torch.float64


def test_adapters_that_cannot_merge_are_sampled_unmerged(tiny, prompts):
    import copy

    from peft import LoraConfig, get_peft_model

    from opsd.model_utils import peft_wrapping
    from opsd.rollout.merged_student import MergedStudent, MergeUnsupported

    model, _ = tiny
    with peft_wrapping():
        dora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                                               target_modules=["q_proj", "v_proj"]))
    with pytest.raises(MergeUnsupported, match="DoRA"):
        MergedStudent(dora)
    with pytest.warns(RuntimeWarning, match="unmerged adapters"):
        sampled = backend_for(tiny, model=dora, cache_implementation="graph", merge_lora=True).generate(
            prompts, GREEDY)
    assert all_ids(sampled) == all_ids(backend_for(tiny, model=dora).generate(prompts, GREEDY))


def test_sampler_keeps_what_transformers_warpers_keep():
    """Temperature -> top-k -> top-p: the same candidates with the same probabilities."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from opsd.rollout.static_decode import _Sampler

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 3
    for temperature, top_k, top_p in [(1.1, 20, 0.95), (0.7, 0, 0.9), (1.0, 50, 1.0), (1.3, 5, 0.5)]:
        settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1)
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        expected = scores.softmax(-1)
        values, index = _Sampler(settings, logits.shape[-1]).filtered(logits)
        ours = torch.zeros_like(expected).scatter_(-1, index, values.softmax(-1))
        assert torch.equal(ours > 0, expected > 0)
        assert torch.allclose(ours, expected, atol=1e-6)


@pytest.mark.parametrize("top_k", [20, 0])
def test_sampler_reads_bf16_logits_as_their_float32_copy(top_k):
    """The decode step hands the sampler the model's bf16 logits: the candidates, their ids,
    the log-sum-exp and the sampled tokens' log-probabilities are those of the float32 copy."""
    from opsd.rollout.static_decode import _Sampler

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 3000, generator=gen) * 3).bfloat16()
    full = logits.double().log_softmax(-1)
    sampler = _Sampler(SamplingSettings(temperature=1.1, top_p=0.95, top_k=top_k, max_new_tokens=1), 3000)
    values, index, logsumexp = sampler.candidates(logits)
    assert values.dtype == torch.float32 and values.shape == (4, top_k or 3000)
    assert torch.equal(values, logits.float().topk(top_k or 3000).values)  # best first, exact
    assert torch.equal(logits.float().gather(-1, index), values)  # the ids point at those values
    assert torch.allclose(logsumexp.double(), logits.double().logsumexp(-1), atol=1e-5)
    tokens, logprobs = sampler.sample(logits, torch.rand(4, sampler.width, generator=gen))
    assert torch.allclose(logprobs.double(), full.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5)


@pytest.mark.parametrize("vocab, block, dtype", [(151936, 128, torch.bfloat16), (3001, 64, torch.bfloat16),
                                                 (1000, 16, torch.float32), (300, 16, torch.float32)])
def test_top_k_in_blocks_is_exact(vocab, block, dtype):
    """The top-k searched in the k blocks with the largest maxima gives exactly the k
    largest values (float64 sort here), ids that point at them (distinct, even where most
    logits tie), and the log-sum-exp of the whole row (-inf, not NaN, for a row of -inf);
    300 logits in blocks of 16 are fewer than k blocks (one torch.topk instead)."""
    from opsd.rollout.kernels.sampler import top_k_and_logsumexp

    gen = torch.Generator().manual_seed(vocab)
    k = 20
    rows = [torch.randn(vocab, generator=gen) * 3,                    # distinct values
            torch.randint(-3, 3, (vocab,), generator=gen).double(),    # ties everywhere
            torch.randn(vocab, generator=gen) * 3 - 200]               # all far below 0
    masked = torch.randn(vocab, generator=gen) * 3
    masked[: vocab // 2] = -math.inf                                  # whole blocks of -inf
    logits = torch.stack(rows + [masked]).to(dtype)
    values, index, logsumexp = top_k_and_logsumexp(logits, k, block)
    exact = logits.double()
    assert values.dtype == logsumexp.dtype == torch.float32 and index.shape == (4, k)
    assert torch.equal(values.double(), exact.sort(-1, descending=True).values[:, :k])
    assert torch.equal(exact.gather(-1, index), values.double())
    assert all(len(set(row)) == k for row in index.tolist())
    reference = exact.max(-1).values + (exact - exact.max(-1, keepdim=True).values).exp().sum(-1).log()
    assert torch.allclose(logsumexp.double(), reference, rtol=0, atol=2e-5)
    empty = torch.full((2, vocab), -math.inf, dtype=dtype)
    assert torch.equal(top_k_and_logsumexp(empty, k, block)[2], torch.full((2,), -math.inf))


def test_sampler_draws_from_the_filtered_distribution():
    from opsd.rollout.static_decode import _Sampler

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    sampler = _Sampler(SamplingSettings(temperature=1.0, top_p=0.9, top_k=3, max_new_tokens=1), 4)
    draws = sampler(logits, torch.rand(20000, 3, generator=torch.Generator().manual_seed(1)))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.015)
    assert freq[3] == 0


def test_bucket_widths_and_engine_choice(tiny):
    assert [bucket_width(n) for n in (1, 64, 65, 97, 129, 200, 300, 700, 1000)] == \
        [64, 64, 96, 128, 192, 256, 384, 768, 1024]
    model, _ = tiny
    assert resolve_cache_implementation("auto", model) is None  # CPU: the dynamic cache
    assert resolve_cache_implementation("dynamic", model) is None
    assert resolve_cache_implementation("paged", model) == "paged"
    assert StaticDecoder.supports(model)
    with pytest.raises(ValueError, match="cache_implementation"):
        backend_for(tiny, cache_implementation="graphs")


# ---------------------------------------------------------------- the paged engine ("paged")
# transformers' continuous batching over a paged KV cache (opsd/rollout/paged_decode.py), on CPU
# with sdpa: every row of a call is one request of one running batch.

def paged(tiny, **kwargs):
    return backend_for(tiny, cache_implementation="paged", **kwargs)


def test_paged_greedy_matches_dynamic_cache_and_gives_n_per_prompt(tiny, prompts):
    dynamic = backend_for(tiny).generate(prompts, GREEDY, n=2)
    result = paged(tiny, batch_size=4).generate(prompts, GREEDY, n=2)
    assert len(result) == len(prompts) and all(len(samples) == 2 for samples in result)
    assert all_ids(result) == all_ids(dynamic)
    assert all(c.truncated and len(c.ids) == GREEDY.max_new_tokens for s in result for c in s)


@pytest.mark.parametrize("p", [1.0, 0.0, 0.2])
def test_paged_eos_cases(tiny, prompts, p):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    with eos_probability(model, eos, p):
        completions = [c for s in paged(tiny, batch_size=3).generate(prompts, SAMPLE, n=4) for c in s]
    assert_cut_after_first_eos(completions, eos)
    if p == 1.0:
        assert all(c == Completion([eos], truncated=False) for c in completions)
    elif p == 0.0:
        assert all(c.truncated and len(c.ids) == SAMPLE.max_new_tokens for c in completions)
    else:
        assert {c.truncated for c in completions} == {True, False}


def test_paged_applies_top_k_and_top_p(tiny, prompts):
    """Sampling through transformers' warpers: top-k 1, or a nucleus of one token, is greedy."""
    greedy = all_ids(backend_for(tiny).generate(prompts, GREEDY))
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        settings = SamplingSettings(temperature=1.3, top_p=top_p, top_k=top_k, max_new_tokens=8, seed=3)
        assert all_ids(paged(tiny).generate(prompts, settings)) == greedy


def test_paged_same_seed_same_samples_and_the_caller_rng_untouched(tiny, prompts):
    backend = paged(tiny, batch_size=4)
    state = torch.get_rng_state()
    first = all_ids(backend.generate(prompts, SAMPLE, n=3))
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    torch.rand(1000)  # disturb the global RNG: it must not matter
    assert all_ids(backend.generate(prompts, SAMPLE, n=3)) == first
    other = SamplingSettings(**{**SAMPLE.__dict__, "seed": SAMPLE.seed + 1})
    assert all_ids(backend.generate(prompts, other, n=3)) != first


def test_paged_memory_is_bounded_by_its_pool(tiny, prompts):
    """A pool of 2 pages (one row each) still samples every row, rows waiting for pages
    (greedy: the same ids); a pool smaller than one row is refused."""
    from opsd.rollout.paged_decode import PAGE_SIZE, cache_blocks, kv_bytes_per_token

    model, _ = tiny
    page_gib = PAGE_SIZE * kv_bytes_per_token(model) / 2**30
    lengths = [len(p) + GREEDY.max_new_tokens for p in prompts for _ in range(4)]
    assert cache_blocks(model, lengths, cache_gib=2 * page_gib) == 2
    assert cache_blocks(model, lengths, cache_gib=None) == 2 * len(lengths)  # at most what the rows can fill
    small = paged(tiny, batch_size=8, paged_cache_gib=2 * page_gib).generate(prompts, GREEDY, n=4)
    assert all_ids(small) == all_ids(backend_for(tiny).generate(prompts, GREEDY, n=4))
    with pytest.raises(ValueError, match="fewer than one row"):
        paged(tiny, paged_cache_gib=page_gib).generate(prompts, GREEDY)


def test_paged_deadline_hands_back_partial_rows(tiny, prompts):
    """The benchmark's time limit: the engine stops at once, every row comes back with
    what it has sampled, marked unfinished; the next call runs normally."""
    import time

    from opsd.rollout.paged_decode import paged_generate

    model, tokenizer = tiny
    backend = paged(tiny, batch_size=2)
    rows = [p for p in prompts for _ in range(4)]
    run = paged_generate(model, rows, SAMPLE, backend.generation_config(SAMPLE, processors_passed=False), max_rows=2,
                         deadline=time.monotonic())
    assert len(run.tokens) == len(rows) and not all(run.finished)
    assert all(len(t) <= SAMPLE.max_new_tokens for t in run.tokens)
    assert all(len(t) == SAMPLE.max_new_tokens or t[-1:] == [tokenizer.eos_token_id]
               for t, done in zip(run.tokens, run.finished, strict=False) if done)
    assert model.config._attn_implementation == "sdpa"
    assert all_ids(backend.generate(prompts, GREEDY)) == all_ids(backend_for(tiny).generate(prompts, GREEDY))


def test_paged_peft_model_samples_with_its_adapter_and_keeps_its_mode(tiny, prompts):
    peft_model = lora_model(tiny)
    peft_model.train()
    sampled = paged(tiny, model=peft_model).generate(prompts, GREEDY)
    assert peft_model.training and peft_model.base_model.model.config._attn_implementation == "sdpa"
    assert all_ids(sampled) == all_ids(backend_for(tiny, model=peft_model).generate(prompts, GREEDY))
    assert all_ids(sampled) != all_ids(backend_for(tiny).generate(prompts, GREEDY))


# ---------------------------------------------------------------- choosing a backend, vLLM

@pytest.fixture(autouse=True)
def vllm_environment(monkeypatch):
    """Importing vLLM sets its environment defaults; they are undone after each test."""
    for name in (*rollout.VLLM_ENV_DEFAULTS, *rollout.VLLM_NO_FLASHINFER):
        monkeypatch.setenv(name, "restored after the test")
        monkeypatch.delenv(name)


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)  # where resolve_backend_name reads it


def test_missing_vllm_is_a_clear_one_line_error(no_vllm):
    for build in (lambda: rollout.VLLMBackend("some/model"), lambda: resolve_backend_name("vllm")):
        with pytest.raises(BackendUnavailable, match="vLLM") as error:
            build()
        assert "\n" not in str(error.value) and "--backend transformers" in str(error.value)


def test_auto_falls_back_to_transformers(no_vllm):
    assert resolve_backend_name("auto") == "transformers"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend_name("sglang")


def fake_vllm(calls, eos_id):
    """A stand-in for the parts of vLLM that VLLMBackend touches; it records the calls."""
    def sample(ids, reason):
        return types.SimpleNamespace(token_ids=ids, finish_reason=reason, stop_reason=None)

    class LLM:
        def __init__(self, **kwargs):
            calls["engine"] = kwargs

        def generate(self, prompts, params, use_tqdm, lora_request):
            calls.update(prompts=prompts, params=params, lora_request=lora_request)
            outputs = [sample([7, 8, eos_id], "stop"), sample([7, 8], "stop"), sample([7, 8, 9], "length")]
            return [types.SimpleNamespace(outputs=outputs[:p.n]) for p in params]

    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, lora_id, path: (name, lora_id, path)
    return {"vllm": vllm, "vllm.inputs": inputs, "vllm.lora": lora, "vllm.lora.request": request}


def test_vllm_backend_requests_and_completions(monkeypatch, tmp_path, tiny):
    import json

    from opsd import tiny_default
    _, tokenizer = tiny
    eos = tokenizer.eos_token_id
    calls = {}
    for name, module in fake_vllm(calls, eos).items():
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16}))

    backend = rollout.VLLMBackend(str(tiny_default.random_model_dir()), lora_path=str(tmp_path),
                                  max_model_len=512, seed=5)
    assert calls["engine"]["enable_lora"] and calls["engine"]["max_lora_rank"] == 16
    result = backend.generate([[1, 2], [3]], SAMPLE, n=3)

    assert [p["prompt_token_ids"] for p in calls["prompts"]] == [[1, 2], [3]]
    first, second = calls["params"]
    assert (first.n, first.max_tokens, first.top_k, first.top_p) == (3, 8, -1, 1.0)
    assert first.seed == derive_seed(SAMPLE.seed, 0) != second.seed == derive_seed(SAMPLE.seed, 1)
    assert calls["lora_request"][2] == str(tmp_path)
    # EOS kept, EOS restored when the engine dropped it, truncation from running out of tokens
    assert result[0] == [Completion([7, 8, eos], False), Completion([7, 8, eos], False),
                         Completion([7, 8, 9], True)]


def test_vllm_backend_close_shuts_the_engine_down_once(monkeypatch, tiny):
    from opsd import tiny_default
    calls, shutdowns = {}, []
    for name, module in fake_vllm(calls, tiny[1].eos_token_id).items():
        monkeypatch.setitem(sys.modules, name, module)
    with rollout.VLLMBackend(str(tiny_default.random_model_dir()), seed=0) as backend:
        backend.llm.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(
            shutdown=lambda: shutdowns.append(1)))
    assert shutdowns == [1] and backend.llm is None
    backend.close()  # idempotent
    assert shutdowns == [1]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"


@pytest.mark.parametrize("top_k", [0, 20])
def test_nucleus_filter_matches_transformers_top_p(top_k):
    """Same kept set as transformers' TopPLogitsWarper (after top-k), also when the
    candidates do not hold top_p of the mass (flat rows: the full-sort fallback)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    sharp = torch.randn(6, 151936, generator=gen) * 4
    flat = torch.randn(2, 151936, generator=gen) * 0.1
    for scores in (sharp, flat):
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        for top_p in (0.5, 0.95):
            ours = rollout.NucleusFilter(top_p, candidates=256)(None, scores)
            theirs = TopPLogitsWarper(top_p)(None, scores)
            assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
            assert torch.equal(ours[~torch.isinf(ours)], scores[~torch.isinf(ours)])


@pytest.mark.parametrize("limit", [4096, 2])
def test_candidate_draw_leaves_one_kept_token_with_the_kept_probabilities(limit):
    """CandidateDraw (generate's last processor, generate itself greedy) leaves exactly one
    finite score per row, at a token the filters kept, drawn with probability softmax over
    the kept scores; drawing among the candidates (limit 4096) or over the whole row (a row
    keeps more than limit 2) gives that distribution, and the same draws from the same seed."""
    probs = torch.tensor([0.6, 0.3, 0.1])
    scores = torch.full((4000, 50), -math.inf)
    kept = torch.tensor([7, 21, 40])
    scores[:, kept] = probs.log() + 3.0  # a shift: the draw normalises over the kept scores
    scores[::2, kept[2]] = -math.inf  # even rows keep two tokens: 0.6 / 0.9 and 0.3 / 0.9
    draw = rollout.CandidateDraw(limit=limit)
    torch.manual_seed(0)
    out = draw(None, scores)
    torch.manual_seed(0)
    assert torch.equal(draw(None, scores), out)
    assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(4000, dtype=torch.long))
    tokens = out.argmax(-1)
    assert bool(torch.isfinite(scores.gather(-1, tokens[:, None])).all())  # only kept tokens
    for rows, expected in ((slice(1, None, 2), probs), (slice(0, None, 2), torch.tensor([2 / 3, 1 / 3, 0.0]))):
        freq = torch.stack([(tokens[rows] == t).float().mean() for t in kept])
        assert torch.allclose(freq, expected, atol=0.04), (freq, expected)


def test_generate_is_greedy_when_the_processors_draw():
    """With the processors passed, generate's config samples nothing itself (they end in
    the draw); without them (the paged engine) it keeps every sampling knob."""
    backend = rollout.TransformersBackend(torch.nn.Linear(1, 1), pad_token_id=0, eos_token_ids=[1])
    recipe = SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=8)
    for settings in (recipe, SamplingSettings(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=8)):
        assert isinstance(rollout.sampling_processors(settings)[-1], rollout.CandidateDraw)
        passed = backend.generation_config(settings, processors_passed=True)
        assert (passed.do_sample, passed.temperature, passed.top_p) == (False, 1.0, 1.0)
    alone = backend.generation_config(recipe, processors_passed=False)
    assert (alone.do_sample, alone.temperature, alone.top_p, alone.top_k) == (True, 1.1, 0.95, 20)
    assert rollout.sampling_processors(SamplingSettings(0.0, 1.0, 0, 8)) is None


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_the_whole_row_draw_samples_what_generate_drew(tiny, prompts, top_p):
    """CandidateDraw over the whole row (its path off a CPU; limit 0 forces it here) gives
    the very tokens generate() drew itself before the processor existed: the config and
    processors of that code (generate's warpers, or the filters as processors when top-p
    was on), then generate's multinomial, from the same seed."""
    from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper

    from opsd.model_utils import left_pad

    model, tokenizer = tiny
    settings = SamplingSettings(temperature=1.1, top_p=top_p, top_k=20, max_new_tokens=12)
    backend = backend_for(tiny)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id, torch.device("cpu"))
    common = {"max_new_tokens": 12, "min_new_tokens": 0, "repetition_penalty": 1.0,
              "eos_token_id": [tokenizer.eos_token_id], "pad_token_id": tokenizer.pad_token_id, "do_sample": True}
    if top_p < 1:
        before_config = GenerationConfig(**common, temperature=1.0, top_p=1.0, top_k=0)
        before_processors = [TemperatureLogitsWarper(1.1), TopKLogitsWarper(20), rollout.NucleusFilter(top_p)]
    else:
        before_config, before_processors = GenerationConfig(**common, temperature=1.1, top_p=1.0, top_k=20), None
    now_processors = rollout.sampling_processors(settings)[:-1] + [rollout.CandidateDraw(limit=0)]
    outputs = []
    for config, processors in ((before_config, before_processors),
                               (backend.generation_config(settings, processors_passed=True), now_processors)):
        torch.manual_seed(7)
        with torch.no_grad():
            outputs.append(model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                          logits_processor=processors))
    assert torch.equal(outputs[0], outputs[1])
    assert outputs[0].shape[1] > ids.shape[1] + 1  # something was sampled


def test_vllm_environment_fills_only_what_the_user_left_unset(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")  # the user's choice stays
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)  # no flashinfer here
    applied = rollout.vllm_environment()
    assert applied == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stdout"
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_vllm_environment_for_training_only_turns_flashinfer_off_when_missing(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1234")  # a launcher's port stays
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)
    assert rollout.vllm_environment(training=True) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # TRL's colocate layout is left alone
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: object())  # flashinfer installed
    assert rollout.vllm_environment(training=True) == {}
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ


@pytest.mark.parametrize("version,ok", [("0.22.0", True), ("0.26.0", True), ("0.31.0", True),
                                        ("0.21.9", False), ("0.32.0", False), ("1.0.0", False)])
def test_vllm_versions_outside_the_supported_range_are_one_line_errors(version, ok):
    if ok:
        assert rollout.check_vllm_version(version) == version
        return
    with pytest.raises(BackendUnavailable) as error:
        rollout.check_vllm_version(version)
    message = str(error.value)
    assert "\n" not in message and version in message and "0.22.0-0.31.0" in message and "0.26.0" in message


def test_a_missing_vllm_has_no_version(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(BackendUnavailable, match="not installed"):
        rollout.check_vllm_version()


def test_kv_cache_options():
    assert rollout.kv_cache_options(None) == {}
    options = rollout.kv_cache_options(1.5)
    assert options["kv_cache_memory_bytes"] == 3 * 2**29 and options["gpu_memory_utilization"] < 0.05


def test_trl_engine_options_bind_arguments_of_trls_llm_and_restore_it(monkeypatch):
    from trl.generation import vllm_generation

    from opsd.rollout.trl_patches import trl_vllm_engine_options

    built = []

    def llm(**kwargs):
        built.append(kwargs)

    monkeypatch.setattr(vllm_generation, "LLM", llm, raising=False)
    with trl_vllm_engine_options(kv_cache_memory_bytes=5):
        vllm_generation.LLM(model="m", gpu_memory_utilization=0.3)
    vllm_generation.LLM(model="m")
    assert built == [{"model": "m", "gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 5}, {"model": "m"}]
    assert vllm_generation.LLM is llm
    with trl_vllm_engine_options():  # no options: nothing patched, even without vLLM
        assert vllm_generation.LLM is llm


def test_vllm_backend_passes_a_fixed_kv_cache(monkeypatch, tiny):
    from opsd import tiny_default
    calls = {}
    for name, module in fake_vllm(calls, tiny[1].eos_token_id).items():
        monkeypatch.setitem(sys.modules, name, module)
    rollout.VLLMBackend(str(tiny_default.random_model_dir()), seed=0, kv_cache_gib=2)
    assert calls["engine"]["kv_cache_memory_bytes"] == 2 * 2**30
    assert calls["engine"]["gpu_memory_utilization"] == rollout.kv_cache_options(2)["gpu_memory_utilization"]


def test_a_training_process_without_a_launcher_gets_its_own_rendezvous_port(monkeypatch):
    """Colocated vLLM opens a process group; TRL would take 29500 whenever it looks free, so runs
    started together all took it (device run: four of six failed with EADDRINUSE)."""
    import socket

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ports = []
    for _ in range(2):
        monkeypatch.delenv("MASTER_PORT", raising=False)
        applied = rollout.vllm_environment(training=True)
        ports.append(int(applied["MASTER_PORT"]))
        assert os.environ["MASTER_PORT"] == applied["MASTER_PORT"]
    assert 29500 not in ports and all(p > 0 for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", ports[-1]))  # free when handed out
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched: the launcher's rendezvous is left alone
    monkeypatch.delenv("MASTER_PORT")
    assert "MASTER_PORT" not in rollout.vllm_environment(training=True)
