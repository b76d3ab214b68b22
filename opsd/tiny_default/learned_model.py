"""The learned embedded default: a small Qwen3 that has learned the generated task.

Architecture: `Qwen3ForCausalLM`, the full Qwen3 vocabulary (151,936 rows, tied
embeddings), hidden 256, 4 layers, 4 query / 2 KV heads, MLP 512.

Weights are committed in a compact file (`weights/learned.safetensors`, fp16,
about 5 MB) that `opsd/research/train_tiny_default.py` reproduces. Only the embedding rows of the
tokens the task uses are stored; every other row is zero. Those rows were zero,
and held there, during training too (the training loss counts their logit 0 in
the softmax normaliser), so the model has learned to push them down: the full
model built here gives exactly the distributions it was trained with.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from opsd.tiny_default.cache import cache_dir, cached_folder, save_model_folder
from opsd.tiny_default.tokenizer import EOS_ID, PAD_ID, tokenizer_folder

WEIGHTS_FILE = Path(__file__).resolve().parent / "weights" / "learned.safetensors"
VOCAB_SIZE = 151936
ARCHITECTURE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
EMBED = "model.embed_tokens.weight"
USED_IDS = "used_token_ids"
MAX_POSITIONS = 4096


def learned_config(vocab_size: int = VOCAB_SIZE):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, **ARCHITECTURE, tie_word_embeddings=True,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype="float32",
    )


def generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=PAD_ID, eos_token_id=[EOS_ID, PAD_ID], pad_token_id=PAD_ID,
                            do_sample=True, temperature=1.0, top_p=0.95, top_k=0)


def save_compact(compact_model, used_ids: list[int], path: Path, metadata: dict) -> None:
    """Write a model trained over the compact vocabulary `used_ids` (row i of its
    embedding is token used_ids[i]) as the committed fp16 file."""
    import torch
    from safetensors.torch import save_file

    tensors = {name: p.detach().to("cpu", torch.float16).contiguous()
               for name, p in compact_model.state_dict().items() if name != "lm_head.weight"}
    tensors[USED_IDS] = torch.tensor(used_ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"opsd": json.dumps(metadata, sort_keys=True)})


def read_metadata(path: Path = WEIGHTS_FILE) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["opsd"])


def build_learned_model(path: Path = WEIGHTS_FILE):
    """The full-vocabulary fp32 model from the compact file."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    tensors = load_file(str(path))
    used = tensors.pop(USED_IDS).long()
    rows = tensors.pop(EMBED).float()
    with torch.random.fork_rng(devices=[]):  # the constructor's init draws from the global RNG
        model = Qwen3ForCausalLM(learned_config()).float()
    embed = torch.zeros(VOCAB_SIZE, rows.shape[1])
    embed[used] = rows
    state = {name: t.float() for name, t in tensors.items()}
    state[EMBED] = embed
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{path}: does not match the architecture (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = generation_config()
    return model.eval()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def learned_model_dir(path: Path = WEIGHTS_FILE) -> Path:
    """An HF-format folder (fp32 weights, config, tokenizer with chat template)
    built from the compact file once; the folder name carries the file's digest,
    so new weights never meet a stale cache."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the learned tiny default is missing "
                                "(python -m opsd.research.train_tiny_default)")

    def build(folder: Path) -> None:
        save_model_folder(build_learned_model(path), folder)
        for file in tokenizer_folder().iterdir():  # the cached files, not a re-saved tokenizer
            shutil.copyfile(file, folder / file.name)

    return cached_folder(cache_dir() / f"tiny-qwen3-learned-{_file_digest(path)}", build)
