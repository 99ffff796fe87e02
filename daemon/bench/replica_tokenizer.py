"""A replica's tokenizer: Qwen3.5/3.6's vocabulary size, its special tokens at their real ids, and
Qwen3.6's own chat template (thinking, XML tool calls).

The regular vocabulary is a byte-level BPE like Qwen's (GPT-2's byte alphabet, Qwen2's
pre-tokenizer split, NFC), its 248,044 tokens made from merges of letters, digits and the space
marker rather than learned from text: any text encodes (bytes always do) and every id decodes.
The control tokens follow at 248,044 as in the real tokenizer (<|endoftext|> 248044,
<|im_start|> 248045, <|im_end|> 248046, <tool_call> 248058, <think> 248068, ...). The real
vocabulary ends there, below the embedding's 248,320 rows; a random model may pick any row, so
the ids between are `<|extra_N|>` tokens that only decode (nothing encodes to them).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

from moed.daemon.bench.published_models import CHAT_TEMPLATE

FIRST_CONTROL_ID = 248044
# Qwen's control tokens in id order from FIRST_CONTROL_ID, and whether each is "special" (the
# tool and think markers are not: they stay in decoded text, where parsers look for them).
CONTROL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation, newlines).
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def control_id(token: str) -> int:
    return FIRST_CONTROL_ID + [t for t, _ in CONTROL_TOKENS].index(token)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def regular_vocab(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`size` tokens: the 256 bytes, then pairs and triples of letters, digits and the space
    marker, each made by one merge of two shorter tokens."""
    alphabet = _byte_alphabet()
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    letters = [
        alphabet[b]
        for b in [*b"abcdefghijklmnopqrstuvwxyz", *b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *b"0123456789"]
    ]
    letters.append(alphabet[ord(" ")])  # "Ġ": a word's leading space
    merges: list[tuple[str, str]] = []
    pairs = [a + b for a, b in itertools.product(letters, letters)]
    for left, right in itertools.chain(
        itertools.product(letters, letters), itertools.product(pairs, letters)
    ):
        if len(vocab) >= size:
            break
        token = left + right
        if token not in vocab:
            vocab[token] = len(vocab)
            merges.append((left, right))
    if len(vocab) < size:
        raise ValueError(f"the generated vocabulary stops at {len(vocab)} tokens, below {size}")
    return vocab, merges


def write_tokenizer(dest: Path, vocab_size: int) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
    generation_config.json for a model of `vocab_size` embedding rows."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = regular_vocab(FIRST_CONTROL_ID)
    for token, _special in CONTROL_TOKENS:
        vocab[token] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<|extra_{i - FIRST_CONTROL_ID - len(CONTROL_TOKENS)}|>"] = i
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()  # it takes no options (tokenizers ignores any given)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in CONTROL_TOKENS if not s])
    tok.add_special_tokens(
        [AddedToken(t, special=s, normalized=False) for t, s in CONTROL_TOKENS if s]
    )
    tok.save(str(dest / "tokenizer.json"))

    decoder = {
        str(control_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for t, s in CONTROL_TOKENS
    }
    extra_special = [t for t, s in CONTROL_TOKENS if s and t not in (EOS_TOKEN, PAD_TOKEN)]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": extra_special,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special_map = {
        "additional_special_tokens": extra_special,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    (dest / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    shutil.copyfile(CHAT_TEMPLATE, dest / "chat_template.jinja")
    generation = {
        "bos_token_id": control_id(PAD_TOKEN),
        "eos_token_id": [control_id(EOS_TOKEN), control_id(PAD_TOKEN)],
        "pad_token_id": control_id(PAD_TOKEN),
    }
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
