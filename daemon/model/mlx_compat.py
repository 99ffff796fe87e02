"""The one module that reaches past mlx-lm's documented API (mlx-lm 0.32; pyproject.toml pins the
minor version). Each use has a test in tests/model/test_mlx_compat.py that fails, saying what
changed, when an mlx-lm upgrade changes the thing relied on.

Reached into here, each with the upstream mlx-lm change that would retire it:
1. BatchGenerator's two stages, `_prompt_batch` (the rows reading their prompt: `uids`,
   `prompt_cache`, `extract_cache(idx)`) and `_generation_batch` (the decoding rows: `uids`,
   `prompt_cache`): the prefix cache keeps a row's state at a segment's end, the decode masks
   follow the decoding rows (engine/batch.py). Retired by: BatchGenerator naming its stages
   (public `prompt_batch` / `generation_batch`), or a callback with a prompting row's caches at a
   prompt offset the caller asks for, which any batched server with a prefix cache wants.
2. BatchGenerator's `prefill_step_size`, read again at every `next()`, and its `_prompt_batch`'s
   own, the size of each forward pass over a chunk: the chunk sizer steers both step by step
   (engine/batch.py). Retired by: a public setter (or a `next(prefill_step_size=)` argument) that
   reaches the prompt batch already made.
3. BatchKVCache's `_right_padding` (None unless `prepare` right-padded rows) beside its public
   `left_padding`, and `make_mask(N, return_array=..., window_size=...)`, which
   engine/decode_mask.py's UnpaddedBatchKVCache overrides (set by use 13). Retired by: a public
   "no row padded" answer on BatchKVCache, and its own `make_mask` returning None for a one-token
   step with no row padded (as the single-stream KVCache does), which retires the override too.
4. The list-wide cache calls BatchGenerator makes on every element of a row's cache list
   (`merge` as a classmethod taking the list, `extend`, `filter`, `prepare(left_padding=,
   lengths=, right_padding=)`, `finalize`, `extract`, `copy.deepcopy`, `state`, `nbytes`,
   `empty`, `size`): distributed/cache_ops.py's CacheHandle answers them to mirror a pipeline
   batch's cache changes on the other ranks. BATCH_CACHE_CALLS names them. Public methods, no
   private name; retired (as an undocumented contract) by a documented batch-cache protocol in
   mlx_lm.models.cache.
5. `mlx_lm.utils._get_classes(config)`: the model class a config.json names (and its args class:
   the unloaded model bench/replica_layout.py lists the tensors of), and the modules of
   its class hierarchy, one of which defines a PipelineMixin module when the architecture can
   pipeline (qwen3_5_moe's text model is one module down); and the sources under
   mlx_lm/models/, whose text names PipelineMixin where it is used: an architecture without it
   is refused before any rank starts (distributed/rank0.py, rank_model.py). Retired by: a public
   `get_model_classes(config)` in mlx_lm.utils, and a class attribute saying a model pipelines.
6. PipelineMixin's module (`pipeline(group, split)`, `start_idx`, `end_idx`, `layers`) and its
   final `norm`, called once after the last layer's all_gather: the leader wraps it to evaluate
   there (distributed/leader.py). Retired by: a hook PipelineMixin calls after the last
   all_gather (or `pipeline()` returning its layer range).
7. mlx_lm/utils.py lowers RLIMIT_NOFILE when imported: runtime/open_files.py keeps moed's
   raised limit through that import. Retired by: mlx-lm raising the limit only, never lowering
   it, and only in its own entry points rather than at import.
8. BatchGenerator's `next()` calls the model over several positions only for prompt chunks and
   reads only their caches, never the output: inside it a streaming model's last layer skips
   its experts for such calls (experts/unused_output.py, engine/batch.py). Retired by: the
   generator telling the model a call's output is unused (an argument or a context), which
   saves the last layer's work in any model.
9. GenerationBatch's `_next_tokens` and `_next_logprobs` (row i's next token and its
   distribution, submitted by the step that made them and handed out by the one after) and its
   `max_tokens`: a row's first token goes out as soon as it is computed (engine/batch.py).
   Retired by: a public read of the tokens a step submitted (or `next()` handing a row's first
   token out at the step that computes it).
10. PromptProcessingBatch's `split(indices)` (a `_copy()` with deep-copied caches, then `filter`
   of both) and its per-row lists: when every row moves on to decoding at once, the rows move,
   caches and all, instead (engine/batch.py, `move_whole_splits`; the batch's `split` rebound
   with `types.MethodType`). Retired by: upstream `split` moving the caches when the indices are
   every row and no row is padded, instead of a deep copy and two filters.
11. The split batch's `generate(last_inputs)`, which makes the GenerationBatch whose first step
   (in its constructor) reads each moving row's last prompt token, and nothing else: the engine's
   scope around it lets a streaming model read ahead for that step (experts/prompt_end.py; the
   batch's `split` and the moving batch's `generate` replaced on the instances). Retired by: a
   BatchGenerator hook (a context manager) around the step that reads prompts' last tokens.
12. TokenizerWrapper's `_tokenizer`, the Hugging Face tokenizer it wraps (its `__getattr__`
   forwards names, but not the object): llguidance builds its token table from it
   (engine/grammar.py) and the prefix encoder reads its backend's offsets
   (model/prefix_encode.py). `hf_tokenizer` reads it. Retired by: a public
   `TokenizerWrapper.tokenizer` property.
13. `__class__` assignment on live mlx-lm objects (`recast`): a BatchKVCache becomes
   UnpaddedBatchKVCache and back as the decoding rows change (engine/decode_mask.py, use 3), and
   each decoder layer becomes a subclass whose `__call__` reports its progress
   (model/layer_progress.py). Safe while the subclass adds behaviour and no state; the object
   stays where the batch and the model hold it. Retired by: use 3's upstream mask, and a
   per-layer callback in mlx-lm's forward (or BatchGenerator's prompt progress per layer).

In MLX itself (not mlx-lm): distributed/ring_handoff.py relies on how the ring backend's init
makes and then uses its sockets (one per hostfile address, nothing sent during init, used by
file descriptor afterwards), to swap them for links proved with the group's secret; the module
says what, and the pipeline tests fail if it changes.

Outside daemon/ (which alone may import mlx-lm): client/hub.py's `mlx_lm_knows` takes an
architecture as known when mlx_lm/models/<model_type>.py exists, found without importing mlx-lm.

Relied on elsewhere as a deliberate contract, not reached into: experts/ computes SwitchGLU's and
SwitchMLP's function with its own streaming twin (discover.py, streaming_switch.py): the
`mlx_lm.models.switch_layers` classes SwitchGLU, SwitchMLP, SwitchLinear and
QuantizedSwitchLinear (attributes `gate_proj`/`up_proj`/`down_proj` or `fc1`/`fc2`,
`activation`, and each linear's `weight`, `scales`, `biases`, `bias`, `group_size`, `bits`,
`mode`), the sorted path from 64 routings on and the row order of
`switch_layers._gather_sort` / `_scatter_unsort`, which streaming_switch.py reproduces
(tests/model/test_mlx_compat.py and tests/experts/test_switch_sort.py check them); the
prefetcher's router is the switch's sibling module whose `weight` is (experts, hidden), called
on the layer's input (a plain Linear, or DeepSeek's MoEGate returning (indices, scores)).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache
from mlx_lm.models.pipeline import PipelineMixin
from mlx_lm.utils import _get_classes

# The calls BatchGenerator makes on each layer cache of a row or a batch (use 4): a stand-in
# for a layer cache (distributed/cache_ops.CacheHandle) answers every one.
BATCH_CACHE_CALLS = ("merge", "extend", "filter", "prepare", "finalize", "extract")


def prompt_batch(gen: BatchGenerator) -> PromptProcessingBatch:
    """The rows reading their prompt (use 1)."""
    batch: PromptProcessingBatch = gen._prompt_batch  # unannotated in mlx-lm
    return batch


def generation_batch(gen: BatchGenerator) -> GenerationBatch:
    """The decoding rows (use 1)."""
    batch: GenerationBatch = gen._generation_batch  # unannotated in mlx-lm
    return batch


@dataclass(frozen=True)
class NextToken:
    """A decoding row's token that the generator hands out at its next step (use 9)."""

    uid: int
    token: mx.array  # a 0-d slice of the batch's tokens, evaluated by the caller
    logprobs: mx.array
    max_tokens: int


def next_tokens(gen: BatchGenerator, uids: Iterable[int]) -> list[NextToken]:
    """The next token of each decoding row among `uids` (use 9)."""
    batch = generation_batch(gen)
    wanted = set(uids)
    return [
        NextToken(uid, batch._next_tokens[i], batch._next_logprobs[i], int(batch.max_tokens[i]))
        for i, uid in enumerate(batch.uids)
        if uid in wanted
    ]


# PromptProcessingBatch's per-row lists, which `split` divides between the two batches (use 10).
_ROW_LISTS = ("uids", "tokens", "samplers", "logits_processors", "stop_sequences", "max_tokens")


def move_whole_splits(gen: BatchGenerator) -> None:
    """Use 10. When every prompting row moves on to decoding in one step (a request read alone,
    the usual case), the generator's split gathers every row of a copy of the caches
    (`filter`): a whole second KV cache at each prompt's end, built on the way to the first
    token. Then the rows move instead, as that filter would leave them: unpadded BatchKVCache
    rows and ArraysCache rows, in their order, are already what it returns. Any other split (some
    rows stay, padded rows, a pipeline's cache handles) is the generator's own."""
    batch = prompt_batch(gen)
    batch.split = types.MethodType(_split, batch)  # type: ignore[method-assign]  # use 10's rebinding


def scope_prompt_ends(
    gen: BatchGenerator, scope: Callable[[], AbstractContextManager[None]]
) -> None:
    """Use 11. `scope()` is entered around each step that reads prompts' last tokens: the split
    batch's `generate`, whose GenerationBatch runs that step as it is made, and only it."""
    batch = prompt_batch(gen)
    split = batch.split  # the class's, or use 10's

    # mlx-lm leaves `split` and `generate` without a return annotation: named here.
    def scoped_split(indices: list[int]) -> PromptProcessingBatch:
        moving: PromptProcessingBatch = split(indices)
        generate = moving.generate

        def scoped_generate(tokens: list[list[int]]) -> GenerationBatch:
            with scope():
                made: GenerationBatch = generate(tokens)
                return made

        moving.generate = scoped_generate  # type: ignore[method-assign]
        return moving

    batch.split = scoped_split  # type: ignore[method-assign]


def _split(batch: PromptProcessingBatch, indices: list[int]) -> PromptProcessingBatch:
    whole = sorted(indices) == list(range(len(batch.uids)))
    if not whole or not all(_as_filtered(c) for c in batch.prompt_cache):
        split: PromptProcessingBatch = PromptProcessingBatch.split(batch, indices)
        return split
    moved = PromptProcessingBatch.__new__(PromptProcessingBatch)
    moved.__dict__.update({k: v for k, v in batch.__dict__.items() if k != "split"})
    for name in _ROW_LISTS:
        setattr(batch, name, [])
    batch.prompt_cache = []
    return moved


def _as_filtered(cache: Any) -> bool:
    """`cache.filter(all rows, in order)` would return its rows as they are (same values)."""
    if isinstance(cache, BatchKVCache):
        return unpadded(cache)  # no padding to cut back
    return isinstance(cache, ArraysCache)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer an mlx-lm TokenizerWrapper wraps (use 12); an object without
    `_tokenizer` is its own."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _mlx_lm_class(cls: type) -> type:
    """The nearest class in `cls`'s hierarchy that moed did not define."""
    return next(c for c in cls.__mro__ if not c.__module__.startswith("moed."))


def recast(obj: object, cls: type) -> None:
    """Use 13: `obj` (a live mlx-lm object) takes `cls`, a class over the same mlx-lm class that
    adds behaviour and no state; whoever holds `obj` sees the new class."""
    if _mlx_lm_class(cls) is not _mlx_lm_class(type(obj)):
        raise TypeError(f"{cls.__qualname__} is not a moed class over {type(obj).__qualname__}")
    obj.__class__ = cls


def set_prefill_step(gen: BatchGenerator, tokens: int) -> None:
    """The prompt chunk of the generator's next step (use 2): the generator's, which cuts the
    chunk, and its prompt batch's, which runs the model over it in pieces of its own size (kept
    from when the batch was made: without it a large chunk ran as many small forward passes)."""
    gen.prefill_step_size = tokens
    gen._prompt_batch.prefill_step_size = tokens


def unpadded(cache: BatchKVCache) -> bool:
    """No row of this batch cache is padded, left or right (use 3). Reads the padding to the
    host."""
    left = cast(Callable[[], list[int]], cache.left_padding.tolist)  # 1-d: a list of ints
    return cache._right_padding is None and not any(left())


def model_class_for(config: Mapping[str, Any]) -> type[nn.Module]:
    """The mlx-lm model class a config.json names (use 5)."""
    cls: type[nn.Module] = _get_classes(dict(config))[0]  # unannotated in mlx-lm
    return cls


def unloaded_model(config: Mapping[str, Any]) -> nn.Module:
    """The mlx-lm model a config.json describes, its parameters lazy and never evaluated (use 5):
    its parameter names and shapes without the memory (bench/replica_layout.py)."""
    cls, args = _get_classes(dict(config))
    model: nn.Module = cls(args.from_dict(dict(config)))  # unannotated in mlx-lm
    return model


def supports_pipeline(config: Mapping[str, Any]) -> bool:
    """The architecture's modules define a PipelineMixin module (use 5)."""
    cls = model_class_for(config)
    modules = {cls.__module__} | {base.__module__ for base in cls.__mro__}
    return any(
        isinstance(obj, type) and issubclass(obj, PipelineMixin) and obj is not PipelineMixin
        for name in modules
        for obj in vars(sys.modules[name]).values()
    )


def pipelined_architectures() -> list[str]:
    """Model types whose mlx-lm module uses PipelineMixin, read from the installed sources
    (use 5)."""
    root = Path(mlx_lm.models.__file__).parent
    return sorted(
        p.stem
        for p in root.glob("*.py")
        if "PipelineMixin" in p.read_text() and p.stem != "pipeline"
    )


def wrap_pipeline_norm(pipeline: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Replace the pipeline module's final norm with `wrap(norm)`; returns the norm (use 6)."""
    norm: nn.Module = pipeline.norm  # a Module's attribute reads as Any
    pipeline.norm = wrap(norm)
    return norm


def pipeline_layers(pipeline: nn.Module) -> tuple[int, int]:
    """The decoder layers this rank runs after `pipeline(group, split)`: [start, end) (use 6)."""
    return int(pipeline.start_idx), int(pipeline.end_idx)
