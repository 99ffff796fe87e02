"""Tokenizing only a prompt's new part: every turn of a conversation gets the ids of a whole
encoding (edited history, a shared start ending inside a special token, non-ASCII text), reuse
really skips the old part, and a tokenizer whose pieces would not add up is encoded whole."""

from __future__ import annotations

import logging

from mlx_lm.utils import load_tokenizer

from moed.daemon.model.demo import demo_model_path
from moed.daemon.model.prefix_encode import CHECKED_REUSES, PrefixEncoder
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


def test_a_template_without_special_tokens_is_encoded_whole():
    tok = load_tokenizer(demo_model_path())
    encoder = PrefixEncoder()
    for text in conversation(tok, 4):
        assert encoder.encode(tok, text) == whole(tok, text)
