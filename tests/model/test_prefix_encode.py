"""Tokenizing only a prompt's new part: every turn of a conversation gets the ids of a whole
encoding (edited history, a shared start ending inside a special token, non-ASCII text, raw text
cut after its newlines), reuse really skips the old part, and a tokenizer whose pieces would not
add up is encoded whole."""

from __future__ import annotations

import logging
import random

import pytest
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from moed.daemon.model.demo import demo_model_path
from moed.daemon.model.prefix_encode import (
    CHECKED_REUSES,
    PrefixEncoder,
    _newline_cuts_exact,
)
from tests.fixtures.tokenizer import CountingTokenizer


def whole(tok, text):
    return list(tok.encode(text, add_special_tokens=False))


def conversation(tok, turns: int, system: str = "Sé útil — 日本語 ok. " * 60):
    messages = [{"role": "system", "content": system}]
    texts = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: ünïcödé {'x' * turn}"})
        texts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        messages.append({"role": "assistant", "content": f"answer {turn} " * 5})
    return texts


def test_every_turn_gets_the_whole_encodings_ids_and_later_turns_reuse(tiny_model):
    reference = load_tokenizer(tiny_model)
    tok = CountingTokenizer(load_tokenizer(tiny_model))
    encoder = PrefixEncoder()
    texts = conversation(reference, CHECKED_REUSES + 4)
    for text in texts:
        assert encoder.encode(tok, text) == whole(reference, text)
    # The first text's check and the checked reuses encoded whole; the later turns did not.
    assert tok.encodes == 1 + CHECKED_REUSES


def test_edited_history_and_a_shared_start_inside_a_special_token(tiny_model):
    tok = load_tokenizer(tiny_model)
    encoder = PrefixEncoder()
    texts = conversation(tok, 4)
    for text in texts:
        encoder.encode(tok, text)
    last = texts[-1]
    edited = last.replace("question 1", "question one, rewritten")
    assert edited != last and encoder.encode(tok, edited) == whole(tok, edited)
    end = last.rindex("<|im_end|>")
    for cut in range(end, end + len("<|im_end|>") + 1):  # the shared start ends inside the token
        text = last[:cut] + "m_end|> and then some other text"
        assert encoder.encode(tok, text) == whole(tok, text)
    assert encoder.encode(tok, last + last) == whole(tok, last + last)


class _TamperedBackend:
    """A backend whose encode of anything but a whole prompt is off by one token."""

    def __init__(self, inner, starts):
        self._inner = inner
        self._starts = starts

    def encode(self, text, **kwargs):
        enc = self._inner.encode(text, **kwargs)
        return enc if text.startswith(self._starts) else self._inner.encode(text + " x", **kwargs)


class _TamperedHF:
    def __init__(self, hf, starts):
        self._hf = hf
        self.backend_tokenizer = _TamperedBackend(hf.backend_tokenizer, starts)

    def __getattr__(self, name):
        return getattr(self._hf, name)


class _Tampered:
    def __init__(self, tok, starts):
        self._inner = tok
        self._tokenizer = _TamperedHF(tok._tokenizer, starts)

    def encode(self, *args, **kwargs):
        return self._inner.encode(*args, **kwargs)


def test_a_reuse_that_changes_the_ids_turns_reuse_off_for_that_tokenizer(tiny_model, caplog):
    tok = load_tokenizer(tiny_model)
    texts = conversation(tok, 4)
    tampered = _Tampered(tok, texts[0][:20])
    encoder = PrefixEncoder()
    with caplog.at_level(logging.WARNING, logger="moed.tokenize"):
        for text in texts:
            assert encoder.encode(tampered, text) == whole(tok, text)
    assert [r.message for r in caplog.records if "whole prompts" in r.message] != []
    assert len(caplog.records) == 1  # once: later prompts are encoded whole without asking


def test_a_template_without_special_tokens_or_newlines_is_encoded_whole():
    tok = load_tokenizer(demo_model_path())
    encoder = PrefixEncoder()
    for text in conversation(tok, 4):
        assert encoder.encode(tok, text) == whole(tok, text)


def raw_conversation(turns: int) -> list[str]:
    """An agent's raw completion prompts: each turn the whole history again, then new text."""
    history = "You are a careful assistant.\nRules: be brief. " * 12
    texts = []
    for turn in range(turns):
        history += f"\nUser: question {turn}, with ünïcödé and 'quotes'.\nAssistant:"
        texts.append(history)
        history += f" answer {turn}." * 4
    return texts


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_raw_prompts_reuse_at_newline_cuts_with_the_whole_encodings_ids(tiny_model, which):
    reference = load_tokenizer(tiny_model if which == "tiny" else demo_model_path())
    tok = CountingTokenizer(reference)
    encoder = PrefixEncoder()
    texts = raw_conversation(CHECKED_REUSES + 4)
    for text in texts:
        assert encoder.encode(tok, text, add_special_tokens=True) == list(
            reference.encode(text, add_special_tokens=True)
        )
    assert tok.encodes == 1 + CHECKED_REUSES  # the later turns encoded only their new part


# Characters that make the regexes' pieces interesting around a newline cut.
ALPHABET = ["\n", "\n\n", "\r\n", " ", "  ", "a", "B", "z", ".", "'", "'s", "1", "22", "é",
            "\u0301", "日", "-", "\t", "x\n", "<|im_end|>", "<|im_start|>"]  # fmt: skip


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_random_texts_sharing_a_start_get_the_whole_encodings_ids(tiny_model, which, caplog):
    """Texts cut and continued at random (the shared start ending anywhere: inside newline runs,
    before marks, inside special tokens): every reuse, checked or not, equals a whole encoding."""
    tok = load_tokenizer(tiny_model if which == "tiny" else demo_model_path())
    rng = random.Random(5)
    encoder = PrefixEncoder()

    def text(n: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(n))

    base = text(400)
    with caplog.at_level(logging.WARNING, logger="moed.tokenize"):
        for _ in range(150):
            a = base[: rng.randrange(300, len(base))] + text(rng.randrange(0, 40))
            b = a[: rng.randrange(260, len(a) + 1)] + text(rng.randrange(0, 60))
            for t in (a, b):
                assert encoder.encode(tok, t) == whole(tok, t), repr(t[-80:])
    assert not [r for r in caplog.records if "whole prompts" in r.message]


def _tokenizer_with(pre_tokenizer, normalizer=None, post=None) -> Tokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    if post is not None:
        tok.post_processor = post
    return tok


def test_only_known_byte_level_pre_tokenizers_get_newline_cuts(tiny_model):
    assert _newline_cuts_exact(load_tokenizer(tiny_model)._tokenizer.backend_tokenizer)
    assert _newline_cuts_exact(load_tokenizer(demo_model_path())._tokenizer.backend_tokenizer)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert _newline_cuts_exact(_tokenizer_with(byte_level))
    refused = [
        _tokenizer_with(pre_tokenizers.ByteLevel(add_prefix_space=True)),  # a space at the start
        _tokenizer_with(pre_tokenizers.Whitespace()),
        _tokenizer_with(pre_tokenizers.Metaspace()),  # SentencePiece's: a marker at the start
        _tokenizer_with(byte_level, normalizers.Lowercase()),
        _tokenizer_with(
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(r"\p{L}+|\n+[A-Z]", "isolated"),  # an unknown regex
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        ),
    ]
    assert not any(_newline_cuts_exact(t) for t in refused)


def test_a_tokenizer_adding_a_bos_encodes_raw_prompts_whole(tiny_model):
    reference = load_tokenizer(tiny_model)
    bos = reference._tokenizer.backend_tokenizer
    bos.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok = CountingTokenizer(reference)
    encoder = PrefixEncoder()
    texts = raw_conversation(CHECKED_REUSES + 3)
    for text in texts:
        ids = encoder.encode(tok, text, add_special_tokens=True)
        assert ids == list(reference.encode(text, add_special_tokens=True)) and ids[0] == 0
    assert tok.encodes == len(texts)  # every one whole: the BOS is the tokenizer's to add
