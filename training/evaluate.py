"""Validation loss of a checkpoint against the unigram baseline, on the training run's split.

    python -m training.evaluate                     # the embedded demo model
    python -m training.evaluate --model PATH

Both numbers are cross-entropies in nats per token of the checkpoint's own tokenizer, over the
held-out files (split by file, see training/corpus.py). The baseline predicts every token with
its add-one smoothed frequency in the training split.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import mlx.nn as nn
from tokenizers import Tokenizer

from training.corpus import build_corpus
from training.train_demo import Hyper, encode, eval_windows, unigram_baseline


def validation_loss(model, windows) -> float:
    total, count = 0.0, 0
    for x, y in windows:
        total += nn.losses.cross_entropy(model(x), y, reduction="sum").item()
        count += y.size
    return total / count


def main(argv=None) -> None:
    from mlx_lm import load

    from moed.daemon.model.demo import demo_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="default: the embedded demo model")
    args = p.parse_args(argv)
    path = args.model or demo_model_path()
    h = Hyper()
    model, _ = load(str(path))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    corpus = build_corpus(max_train_bytes=h.max_train_bytes, max_val_bytes=h.max_val_bytes)
    train_ids, val_ids = encode(tok, corpus.train_text()), encode(tok, corpus.val_text())
    val = validation_loss(model, eval_windows(val_ids, h, None))
    uni = unigram_baseline(train_ids, val_ids, tok.get_vocab_size())
    print(corpus.describe())
    print(f"validation tokens: {len(val_ids)}")
    print(f"model   cross-entropy: {val:.4f} nats/token (perplexity {math.exp(val):.1f})")
    print(f"unigram cross-entropy: {uni:.4f} nats/token (perplexity {math.exp(uni):.1f})")


if __name__ == "__main__":
    main()
