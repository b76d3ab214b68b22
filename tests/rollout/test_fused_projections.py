"""The merged sampling copy's stacked projections (opsd/rollout/fused_projections.py): one product for
q, k, v and one for gate, up compute what the separate projections compute, for every
supported family (Qwen3's q/k norms, Qwen2's biases, Llama), through the decode loop too."""
import warnings

import pytest
import torch
from lora_helpers import acting_lora

from opsd.rollout import TransformersBackend
from opsd.rollout import static_decode as static_decode
from opsd.rollout.fused_projections import FusedAttention, FusedMLP, fusable_projections, fuse
from opsd.rollout.merged_student import MergedStudent
from opsd.rollout.static_decode import StaticDecoder
from opsd.sampling import SamplingSettings

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=None)
SAMPLE = SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=10, seed=3)
PAD, EOS = 0, 1


def random_model(family: str, dtype=torch.float64, head_dim: int = 8):
    """A small random model of `family`, with biases wherever the family allows them
    (`head_dim`: Qwen3 and Llama; Qwen2's is hidden size / heads, 8)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    shape = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
             "pad_token_id": PAD, "eos_token_id": EOS}
    torch.manual_seed(0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, attention_bias=True, **shape))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))  # q, k, v always have biases
    else:
        model = LlamaForCausalLM(LlamaConfig(head_dim=head_dim, attention_bias=True, mlp_bias=True, **shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts biases at zero; make them count
                param.normal_(0, 0.5)
    return model.to(dtype).eval()


def with_lora(model, targets=ALL_PROJECTIONS, seed=0):
    return acting_lora(model, targets, r=4, seed=seed)


def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (5, 9, 3)]


def sample(model, settings, merge_lora=True):
    backend = TransformersBackend(model, pad_token_id=PAD, eos_token_ids=[EOS], cache_implementation="graph",
                                  merge_lora=merge_lora)
    return [[c.ids for c in samples] for samples in backend.generate(prompts(), settings)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_stacked_projections_compute_the_separate_ones(family):
    """float64: the fused copy's logits equal the unfused copy's and the peft model's to
    rounding; every attention and MLP is fused; the base weights stay bit-identical."""
    model = with_lora(random_model(family))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    fused, separate = MergedStudent(model), MergedStudent(model, fuse=False)
    fused.refresh()
    separate.refresh()
    layers = fused.network.model.layers
    assert all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP) for layer in layers)
    assert not any(isinstance(m, (FusedAttention, FusedMLP)) for m in separate.network.modules())
    if family != "llama":  # q/k/v biases (Qwen3 with attention_bias, Qwen2) are stacked and filled too
        assert layers[0].self_attn.qkv_proj.bias is not None
    ids = torch.tensor(prompts()[1])[None]
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        got = fused.network(input_ids=ids, position_ids=positions).logits
        unfused = separate.network(input_ids=ids, position_ids=positions).logits
        expected = model(input_ids=ids, position_ids=positions).logits
        with model.disable_adapter():
            teacher = model(input_ids=ids, position_ids=positions).logits
    scale = expected.abs().max()
    assert (got - unfused).abs().max() <= 1e-12 * scale
    assert (got - expected).abs().max() <= 1e-10 * scale
    assert (teacher - expected).abs().max() > 0.05 * scale  # the adapters matter, so the check has teeth
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_decode_loop_samples_the_same_tokens_fused_or_not(family, monkeypatch):
    """Greedy and seeded sampling through the decode loop (KV cache, prompt padding): the
    fused copy, the unfused copy and the unmerged adapters give the same tokens, and the
    loop's log-probabilities are those of one plain forward over prompt + completion."""
    model = with_lora(random_model(family))
    results = {}
    for fuse_projections in (True, False):
        monkeypatch.setattr(static_decode, "FUSE_PROJECTIONS", fuse_projections)
        results[fuse_projections] = sample(model, GREEDY), sample(model, SAMPLE)
        assert StaticDecoder.for_model(model, merge_lora=True).merged.fused == fuse_projections
    unmerged = sample(model, GREEDY, merge_lora=False), sample(model, SAMPLE, merge_lora=False)
    assert results[True] == results[False] == unmerged
    assert any(len(ids) > 3 for samples in results[True][1] for ids in samples)
    # the last call sampled unmerged; once more fused, then score every sampled token
    monkeypatch.setattr(static_decode, "FUSE_PROJECTIONS", True)
    assert_loop_scores_like_a_forward(model, atol=1e-5)  # float32 log-softmax against float64


def assert_loop_scores_like_a_forward(model, atol: float) -> None:
    """One seeded call through the merged decode loop; each sampled token's log-probability, as
    the loop reports it, against one plain forward of the model over prompt + completion."""
    sampled = sample(model, SAMPLE)
    engine = StaticDecoder.for_model(model, merge_lora=True).sampled_logprobs(len(sampled))
    for row, (prompt, samples) in enumerate(zip(prompts(), sampled, strict=False)):
        ids = samples[0]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert torch.allclose(engine[row, :len(ids)].double(), expected.double(), atol=atol)


def test_refresh_fills_the_stacked_weights_after_updates():
    """An optimizer step on the adapters and a changed base bias both reach the stacked
    product at the next refresh (the views write into it)."""
    model = with_lora(random_model("qwen2"))
    fused = MergedStudent(model)
    fused.refresh()
    ids = torch.tensor(prompts()[0])[None]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.mul_(-0.5)
        model.get_base_model().model.layers[1].self_attn.k_proj.base_layer.bias.add_(1.0)
        fused.refresh()
        assert torch.allclose(fused.network(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-10)


def test_groups_with_an_unadapted_projection_stay_separate():
    """LoRA on q and v only: k has no merged weight of its own, so the attention keeps its
    three products (and the MLP, without adapters, is the shared original); still exact."""
    model = with_lora(random_model("qwen3"), targets=["q_proj", "v_proj"])
    merged = MergedStudent(model)
    merged.refresh()
    assert not any(isinstance(m, (FusedAttention, FusedMLP)) for m in merged.network.modules())
    ids = torch.tensor(prompts()[1])[None]
    with torch.no_grad():
        assert torch.allclose(merged.network(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-10)


def test_only_the_written_out_classes_fuse():
    """transformers' own classes only: not another class, not a remote-code class that
    merely shares a name, not projections that are not plain nn.Linear layers."""
    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(4, 4) for _ in range(3))

    class Qwen2Attention(Other):  # a remote-code look-alike
        pass

    for module in (Other(), Qwen2Attention()):
        assert fusable_projections(module) == ()
        with pytest.raises(ValueError, match="not fusable"):
            fuse(module)
    attention = random_model("llama").model.layers[0].self_attn
    assert fusable_projections(attention) == ("q_proj", "k_proj", "v_proj")
    fuse(attention)  # plain projections: fine
    adapted = with_lora(random_model("llama")).get_base_model().model.layers[0].self_attn
    assert fusable_projections(adapted) == ("q_proj", "k_proj", "v_proj")  # by class
    with pytest.raises(ValueError, match="plain nn.Linear"):
        fuse(adapted)  # peft's wrappers are not stacked directly


def test_stacked_projections_get_no_separate_weight_and_the_base_is_never_written(monkeypatch):
    """A projection to be stacked is never given a weight of its own (only o and down are:
    building the copy does not hold q/k/v/gate/up twice), and refreshing leaves every base
    weight bit-identical."""
    model = with_lora(random_model("qwen3"))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    allocated = []
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: allocated.append(t.shape) or empty_like(t, **kw))
    merged = MergedStudent(model)
    monkeypatch.undo()
    layers = model.get_base_model().model.layers
    assert sorted(allocated) == sorted([layer.self_attn.o_proj.base_layer.weight.shape for layer in layers]
                                       + [layer.mlp.down_proj.base_layer.weight.shape for layer in layers])
    merged.refresh()
    merged.refresh()
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_fused_attention_takes_the_cache_under_either_name(name):
    """Decoder layers of transformers 5.2x pass the KV cache as `cache`, those of 5.17 (the
    version vLLM environments pin) as `past_key_values`: under either name the fused attention
    fills the cache and computes what the separate projections compute with it."""
    from transformers import DynamicCache

    model = with_lora(random_model("qwen3"))
    fused, separate = MergedStudent(model), MergedStudent(model, fuse=False)
    fused.refresh()
    separate.refresh()
    hidden = torch.randn(1, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(6)[None]
    outputs, lengths = [], []
    for network in (fused.network, separate.network):
        attention = network.model.layers[0].self_attn
        embeddings = network.model.rotary_emb(hidden, positions)
        cache = DynamicCache(config=network.config)
        with torch.no_grad(), warnings.catch_warnings():
            # transformers 5.2x's own attention (the reference) still takes the 5.17 name, deprecated:
            # that name is what this case is about
            warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
            out = attention(hidden, position_embeddings=embeddings, attention_mask=None, **{name: cache})[0]
        outputs.append(out)
        lengths.append(cache.get_seq_length(0))
    assert isinstance(fused.network.model.layers[0].self_attn, FusedAttention)
    assert lengths[0] == 6  # the fused attention wrote its keys and values into the cache
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-12 * outputs[1].abs().max()
