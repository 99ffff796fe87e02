"""Train the embedded demo model: a small stock-mlx-lm `qwen3_moe` on the Python standard library.

    python -m training.train_demo                 # full run, writes daemon/model/demo_model/
    python -m training.train_demo --steps 30 --out /tmp/demo-timing --log /tmp/timing.txt

Everything is seeded (file split, tokenizer, init, batches), so a rerun on the same Python
version and MLX build reproduces the checkpoint. Training runs on the CPU in float32 and uses
one thread when launched with OMP_NUM_THREADS=1 / OPENBLAS_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.corpus import EOS, build_corpus

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "daemon" / "model" / "demo_model"
DEFAULT_LOG = REPO / "training" / "TRAINING_LOG.txt"

SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# The model only ever saw source files, so a chat is rendered as plain text to be continued.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Hyper:
    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 32
    top_k: int = 4
    expert_width: int = 64
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 1600
    warmup: int = 80
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    # Small on purpose: enough to keep experts alive, not enough to flatten the routing.
    aux_loss_coef: float = 1e-2
    eval_every: int = 200
    eval_batches: int = 4
    max_train_bytes: int = 6_000_000
    max_val_bytes: int = 300_000


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train per file: one huge string would be a single very long "sentence".
    tok.train_from_iterator(text.split(EOS), trainer=trainer)
    return tok


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([d for d in text.split(EOS) if d]):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        # Source code has meaningful spaces before punctuation; never "clean" them up.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# ---------------------------------------------------------------- model


def model_config(h: Hyper, eos_id: int) -> dict:
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": h.vocab_size,
        "hidden_size": h.hidden_size,
        "num_hidden_layers": h.num_layers,
        "num_attention_heads": h.num_heads,
        "num_key_value_heads": h.num_kv_heads,
        "head_dim": h.head_dim,
        # Every layer is sparse; intermediate_size would only size a dense MLP.
        "intermediate_size": h.expert_width * h.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": h.num_experts,
        "num_experts_per_tok": h.top_k,
        "moe_intermediate_size": h.expert_width,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


class _RouterTap:
    """Collects router logits during a forward pass for the load-balancing loss."""

    def __init__(self):
        self.logits: list[mx.array] = []


class _TappedGate(nn.Linear):
    # Same parameters as the stock router, so the saved weight names do not change.
    def __init__(self, gate: nn.Linear, tap: _RouterTap):
        out_dims, in_dims = gate.weight.shape
        super().__init__(in_dims, out_dims, bias=False)
        self.weight = gate.weight
        self._tap = tap

    def __call__(self, x):
        y = super().__call__(x)
        self._tap.logits.append(y)
        return y


def build_model(h: Hyper, config: dict) -> tuple[nn.Module, _RouterTap]:
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    tap = _RouterTap()
    for layer in model.model.layers:
        layer.mlp.gate = _TappedGate(layer.mlp.gate, tap)
    return model, tap


def balance_loss(logits: mx.array, top_k: int) -> tuple[mx.array, mx.array]:
    """Switch-Transformer load-balancing loss: E * sum_e f_e * P_e (1.0 when uniform).

    Also returns f, each expert's share of the routed slots, for the log.
    """
    num_experts = logits.shape[-1]
    probs = mx.softmax(logits.reshape(-1, num_experts), axis=-1, precise=True)
    top = mx.argpartition(probs, kth=-top_k, axis=-1)[:, -top_k:]
    hits = mx.zeros_like(probs).at[mx.arange(probs.shape[0])[:, None], top].add(1.0)
    f = mx.stop_gradient(hits.mean(axis=0)) / top_k
    p = probs.mean(axis=0)
    return num_experts * (f * p).sum(), f


def count_params(config: dict) -> tuple[int, int]:
    """Total parameters and parameters active for one token (top-k of the routed experts)."""
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    experts = sum(v.size for k, v in tree_flatten(model.parameters()) if ".switch_mlp." in k)
    active = total - experts + experts * config["num_experts_per_tok"] // config["num_experts"]
    return total, active


# ---------------------------------------------------------------- training


def batches(ids: np.ndarray, h: Hyper, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - h.seq_len - 1, size=h.batch_size)
        window = np.stack([ids[s : s + h.seq_len + 1] for s in starts])
        yield mx.array(window[:, :-1]), mx.array(window[:, 1:])


def eval_windows(ids: np.ndarray, h: Hyper, limit: int | None) -> list[tuple[mx.array, mx.array]]:
    """Non-overlapping windows over the validation stream, in order (deterministic)."""
    n = (len(ids) - 1) // h.seq_len
    rows = [ids[i * h.seq_len : i * h.seq_len + h.seq_len + 1] for i in range(n)]
    out = []
    for b in range(0, len(rows), h.batch_size):
        chunk = np.stack(rows[b : b + h.batch_size])
        out.append((mx.array(chunk[:, :-1]), mx.array(chunk[:, 1:])))
        if limit is not None and len(out) >= limit:
            break
    return out


def evaluate(model, windows, tap: _RouterTap) -> float:
    total, count = 0.0, 0
    for x, y in windows:
        tap.logits.clear()
        logits = model(x)
        loss = nn.losses.cross_entropy(logits, y, reduction="sum")
        total += loss.item()
        count += y.size
    tap.logits.clear()
    return total / count


def unigram_baseline(train_ids: np.ndarray, val_ids: np.ndarray, vocab: int) -> float:
    """Validation cross-entropy (nats/token) of the train unigram distribution, add-one smoothed."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_ids].mean())


class Log:
    def __init__(self, path: Path):
        self.f = path.open("w")

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        self.f.write(msg + "\n")
        self.f.flush()


def train(h: Hyper, out: Path, log_path: Path) -> None:
    log = Log(log_path)
    t_start = time.time()
    np.random.seed(h.seed)
    mx.random.seed(h.seed)
    mx.set_default_device(mx.cpu)

    corpus = build_corpus(max_train_bytes=h.max_train_bytes, max_val_bytes=h.max_val_bytes)
    train_text, val_text = corpus.train_text(), corpus.val_text()
    tok = train_tokenizer(train_text, h.vocab_size)
    train_ids, val_ids = encode(tok, train_text), encode(tok, val_text)
    eos_id = tok.token_to_id(EOS)
    config = model_config(h, eos_id)
    total, active = count_params(config)
    unigram = unigram_baseline(train_ids, val_ids, h.vocab_size)

    log("# moed demo model training log")
    log(f"# command: python -m training.train_demo {' '.join(sys.argv[1:])}".rstrip())
    log(
        f"# python {platform.python_version()}, mlx {mx.__version__}, {platform.machine()}, "
        f"device {mx.default_device()}"
    )
    log(f"# hyper: {json.dumps(asdict(h))}")
    log(f"# corpus: {corpus.describe()}")
    log(
        f"# tokens: train {len(train_ids)}, val {len(val_ids)} "
        f"({len(train_text.encode()) / len(train_ids):.2f} bytes/token on train)"
    )
    log(f"# params: total {total}, active per token {active}")
    log(f"# unigram baseline (val, add-one smoothed train unigram): {unigram:.4f} nats/token")
    log(f"# tokenizer + encoding took {time.time() - t_start:.1f} s")

    model, tap = build_model(h, config)
    mx.eval(model.parameters())
    warmup = min(h.warmup, h.steps // 10)  # short timing runs still get a decay phase
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-7, h.lr, warmup),
            optim.cosine_decay(h.lr, h.steps - warmup, end=h.lr * h.min_lr_ratio),
        ],
        [warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=h.weight_decay)

    def loss_fn(model, x, y):
        tap.logits.clear()
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        aux, loads = zip(*(balance_loss(g, h.top_k) for g in tap.logits))
        tap.logits.clear()
        aux = sum(aux) / len(aux)
        return ce + h.aux_loss_coef * aux, (ce, aux, mx.stack(loads))

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x, y):
        (_, (ce, aux, loads)), grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return ce, aux, loads

    step = mx.compile(step, inputs=state, outputs=state)

    val_small = eval_windows(val_ids, h, h.eval_batches)
    rng = np.random.default_rng(h.seed)
    data = batches(train_ids, h, rng)
    log(
        f"step  train_ce  aux  val_ce(first {h.eval_batches} val batches)  lr  tokens/s  "
        "elapsed_s  [per layer: experts with >=1% of the routed slots / largest share]"
    )
    t_train = time.time()
    t_last, ce_acc, aux_acc, n_acc = time.time(), 0.0, 0.0, 0
    load_acc = mx.zeros((h.num_layers, h.num_experts))
    tokens_per_step = h.batch_size * h.seq_len
    for it in range(1, h.steps + 1):
        x, y = next(data)
        ce, aux, loads = step(x, y)
        load_acc = load_acc + loads
        mx.eval(state, ce, aux, load_acc)
        ce_acc += ce.item()
        aux_acc += aux.item()
        n_acc += 1
        if it % 25 == 0 or it == h.steps or it % h.eval_every == 0:
            now = time.time()
            val = (
                evaluate(model, val_small, tap)
                if (it % h.eval_every == 0 or it == h.steps)
                else None
            )
            tps = n_acc * tokens_per_step / (now - t_last)
            share = np.array(load_acc / n_acc)
            usage = " ".join(f"{(r >= 0.01).sum()}/{r.max():.2f}" for r in share)
            log(
                f"{it:5d}  {ce_acc / n_acc:.4f}  {aux_acc / n_acc:.3f}  "
                f"{'-' if val is None else f'{val:.4f}'}  {schedule(it).item():.2e}  "
                f"{tps:.0f}  {time.time() - t_start:.0f}  [{usage}]"
            )
            t_last, ce_acc, aux_acc, n_acc = time.time(), 0.0, 0.0, 0
            load_acc = mx.zeros((h.num_layers, h.num_experts))
    load_acc = mx.zeros((h.num_layers, h.num_experts))

    train_secs = time.time() - t_train
    val_full = evaluate(model, eval_windows(val_ids, h, None), tap)
    log(
        f"# training wall time {train_secs:.0f} s ({h.steps} steps, "
        f"{h.steps * tokens_per_step} tokens)"
    )
    log(
        f"# final validation cross-entropy (full val split): {val_full:.4f} nats/token "
        f"vs unigram {unigram:.4f} (ppl {math.exp(val_full):.1f} vs {math.exp(unigram):.1f})"
    )

    # Undo the training-only router tap so the saved model is the stock module tree.
    for layer in model.model.layers:
        gate = nn.Linear(h.hidden_size, h.num_experts, bias=False)
        gate.weight = layer.mlp.gate.weight
        layer.mlp.gate = gate
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_model(out, model)
    save_config(config, out / "config.json")
    save_tokenizer(tok, out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(
        f"# saved to {out.relative_to(REPO) if out.is_relative_to(REPO) else out} "
        f"({size / 1e6:.2f} MB); total wall time {time.time() - t_start:.0f} s"
    )


def parse_args(argv=None) -> tuple[Hyper, Path, Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    defaults = Hyper()
    aliases = {"batch_size": ["--batch"], "seq_len": ["--seq"]}
    for name, value in asdict(defaults).items():
        p.add_argument(
            f"--{name.replace('_', '-')}",
            *aliases.get(name, []),
            dest=name,
            type=type(value),
            default=value,
        )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--log", type=Path, default=DEFAULT_LOG)
    args = vars(p.parse_args(argv))
    out, log = args.pop("out"), args.pop("log")
    return Hyper(**args), out, log


def main(argv=None) -> None:
    h, out, log = parse_args(argv)
    train(h, out, log)


if __name__ == "__main__":
    main()
