"""The prompt ids memo: a gateway's count_tokens and the generate right after it tokenize once,
and an entry is never used with another tokenizer."""

from __future__ import annotations

from mlx_lm.utils import load_tokenizer

from moed.daemon.model.chat_template import PROMPT_IDS, prompt_token_ids
from moed.daemon.model.prompt_ids_memo import PromptIdsMemo
from moed.protocol import GenerateRequest
from tests.fixtures.tokenizer import CountingTokenizer


def test_a_count_then_its_generate_tokenize_once_and_give_the_same_ids(tiny_model):
    PROMPT_IDS.clear()
    tok = CountingTokenizer(load_tokenizer(tiny_model), reach_fast=False)
    fresh = CountingTokenizer(load_tokenizer(tiny_model), reach_fast=False)
    chat = [{"role": "user", "content": "a long system prompt and a question"}]
    for fields in ({"prompt": "hello there, model", "raw": True}, {"messages": chat}):
        counted = prompt_token_ids(tok, GenerateRequest.from_checked(fields))
        generated = prompt_token_ids(tok, GenerateRequest.from_checked({**fields, "max_tokens": 9}))
        assert generated == counted
        generated.append(-1)  # the caller's list is its own
        assert prompt_token_ids(tok, GenerateRequest.from_checked(fields)) == counted
        assert prompt_token_ids(fresh, GenerateRequest.from_checked(fields)) == counted
    assert tok.encodes == 2  # once per prompt; `fresh` (another tokenizer) encoded its own
    assert fresh.encodes == 2
    other = GenerateRequest.from_checked({"messages": chat, "chat_template_kwargs": {"x": 1}})
    prompt_token_ids(tok, other)  # another template variable: other ids, encoded anew
    assert tok.encodes == 3


def test_the_memo_keeps_the_last_entries_and_never_crosses_tokenizers():
    memo = PromptIdsMemo(entries=2)
    calls = []

    class Tok:
        pass

    def encoded(tag):
        def encode():
            calls.append(tag)
            return [len(calls)]

        return encode

    a, b = Tok(), Tok()
    reqs = [GenerateRequest(prompt=f"p{i}", raw=True) for i in range(3)]
    assert memo.ids(a, reqs[0], encoded("a0")) == [1]
    assert memo.ids(a, reqs[0], encoded("a0")) == [1]
    assert memo.ids(b, reqs[0], encoded("b0")) == [2]  # same prompt, another tokenizer
    memo.ids(b, reqs[1], encoded("b1"))
    memo.ids(b, reqs[2], encoded("b2"))  # the oldest (p0) leaves
    memo.ids(b, reqs[0], encoded("b0"))
    assert calls == ["a0", "b0", "b1", "b2", "b0"]
    c = Tok()
    memo.ids(c, reqs[2], encoded("c2"))
    del c  # a tokenizer gone: its entry never matches one at a recycled address
    memo.ids(Tok(), reqs[2], encoded("new"))
    assert calls[-2:] == ["c2", "new"]
