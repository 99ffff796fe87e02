"""One test per mlx-lm internal that moed relies on (daemon/model/mlx_compat.py lists them): each
fails, saying what changed, when an mlx-lm upgrade changes the name, signature or behaviour."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import qwen3_moe, switch_layers
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.models.pipeline import PipelineMixin
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load_tokenizer

from moed.client.hub import mlx_lm_knows
from moed.daemon.distributed.cache_ops import CacheHandle, OpLog
from moed.daemon.engine.decode_mask import UnpaddedBatchKVCache
from moed.daemon.model import mlx_compat
from moed.daemon.model.mlx_compat import (
    BATCH_CACHE_CALLS,
    generation_batch,
    hf_tokenizer,
    model_class_for,
    next_tokens,
    pipeline_layers,
    pipelined_architectures,
    prompt_batch,
    recast,
    set_prefill_step,
    supports_pipeline,
    unloaded_model,
    unpadded,
    wrap_pipeline_norm,
)
from tests.fixtures.checkpoints import make_config

VOCAB = 64
PROMPT = [3, 9, 12, 5, 7, 30, 2, 41, 8, 16, 22]


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    config = make_config("qwen3_moe", vocab=VOCAB)
    m = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    mx.eval(m.parameters())
    return m


def _generator(model, chunk: int = 4) -> BatchGenerator:
    return BatchGenerator(
        model,
        max_tokens=3,
        sampler=greedy_sampler,
        prefill_step_size=chunk,
        completion_batch_size=4,
        prefill_batch_size=4,
    )


def test_stages_of_the_batch_generator(model):
    """Use 1: the rows reading their prompt and the decoding rows, with their layer caches."""
    gen = _generator(model)
    (uid,) = gen.insert([PROMPT])
    gen.next()
    rows = prompt_batch(gen)
    for name in ("uids", "prompt_cache", "extract_cache"):
        assert hasattr(rows, name), (
            f"mlx-lm's BatchGenerator._prompt_batch has no `{name}` any more: engine/batch.py's "
            "prefix-cache capture reads it (mlx_compat.prompt_batch)"
        )
    assert list(rows.uids) == [uid], "BatchGenerator._prompt_batch no longer holds prompting rows"
    assert len(rows.prompt_cache) == len(model.layers), "_prompt_batch.prompt_cache: not per layer"
    assert len(rows.extract_cache(0)) == len(model.layers), "extract_cache(idx) changed"
    while not generation_batch(gen).uids:
        gen.next()
    decoding = generation_batch(gen)
    assert list(decoding.uids) == [uid], (
        "mlx-lm's BatchGenerator._generation_batch no longer holds the decoding rows (`uids`): "
        "engine/batch.py fits the decode masks to them (mlx_compat.generation_batch)"
    )
    assert len(decoding.prompt_cache) == len(model.layers), (
        "_generation_batch.prompt_cache is not the decoding rows' per-layer caches"
    )
    gen.close()


def test_next_tokens_are_the_ones_the_next_step_hands_out(model):
    """Use 9: right after the step that moves a row to decoding, its next token (and the
    distribution it was sampled from) is the one the generator hands out at its next step."""
    gen = _generator(model)
    (uid,) = gen.insert([PROMPT], max_tokens=[3])
    while not generation_batch(gen).uids:
        gen.next()
    (first,) = next_tokens(gen, [uid])
    assert next_tokens(gen, [uid + 1]) == [], "next_tokens returned a row it was not asked for"
    mx.eval(first.token)
    assert first.uid == uid and first.max_tokens == 3, (
        "GenerationBatch.max_tokens no longer holds the rows' limits (mlx_compat.next_tokens)"
    )
    _, (handed,) = gen.next()
    assert handed.uid == uid and handed.token == int(first.token.item()), (
        "GenerationBatch._next_tokens[i] is not the token its next step hands out: engine/batch.py "
        "sends a row's first token from it (mlx_compat.next_tokens)"
    )
    assert mx.array_equal(handed.logprobs, first.logprobs), (
        "GenerationBatch._next_logprobs[i] is not the distribution the next step hands out"
    )
    gen.close()


def test_a_whole_split_moves_the_rows_as_the_generators_split_leaves_them(model):
    """Use 10: mlx-lm's split of every prompting row and moed's move leave the same batch (its
    attributes, rows and cache states) and an empty one behind; the move copies no cache."""
    stepped = []
    for _ in range(2):
        gen = _generator(model)
        gen.insert([PROMPT, PROMPT[:7]])
        gen.next()  # the rows' first chunks are in the prompt batch's caches
        stepped.append(gen)
    theirs_gen, ours_gen = stepped
    theirs_batch = prompt_batch(theirs_gen)
    theirs = theirs_batch.split([0, 1])
    mlx_compat.move_whole_splits(ours_gen)
    ours_batch = prompt_batch(ours_gen)
    before = list(ours_batch.prompt_cache)
    ours = ours_batch.split([1, 0])
    assert set(vars(ours)) == set(vars(theirs)), (
        "PromptProcessingBatch's attributes changed: mlx_compat._split must move them all"
    )
    for name in mlx_compat._ROW_LISTS:
        mine, split = getattr(ours, name), getattr(theirs, name)
        if name in ("uids", "tokens", "max_tokens"):
            assert mine == split, f"split's `{name}` differs"
        assert [type(v) for v in mine] == [type(v) for v in split], f"split's `{name}` differs"
        assert getattr(ours_batch, name) == getattr(theirs_batch, name) == [], (
            f"split no longer empties the batch's `{name}` when every row leaves"
        )
    assert ours_batch.prompt_cache == theirs_batch.prompt_cache == []
    assert all(a is b for a, b in zip(ours.prompt_cache, before)), "the move copied a cache"
    for a, b in zip(ours.prompt_cache, theirs.prompt_cache):
        for x, y in zip(a.state, b.state):
            assert mx.array_equal(x, y), "split's filter changed a cache's values"
    for gen in stepped:
        gen.close()


def test_the_prompt_end_scope_holds_exactly_the_steps_reading_last_prompt_tokens(
    model, monkeypatch
):
    """Use 11: the split batch's `generate` runs the one step that reads each moving row's last
    prompt token (a call of one position a row, over those rows only), and no other call; with a
    whole split (use 10) or the generator's own (a row staying behind) alike."""
    calls: list[tuple[bool, tuple[int, int]]] = []  # (inside the scope, inputs' shape)
    inside = [False]

    @contextmanager
    def scope():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    call = type(model).__call__

    def recorded(self, inputs, *args, **kwargs):
        calls.append((inside[0], tuple(inputs.shape)))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", recorded)
    gen = _generator(model, chunk=4)
    mlx_compat.move_whole_splits(gen)
    mlx_compat.scope_prompt_ends(gen, scope)
    gen.insert([PROMPT])  # 11 tokens: chunks of 4, 4 and 2, then its last token
    for _ in range(6):
        gen.next()
    gen.insert([PROMPT[:4], PROMPT])  # two rows, ending at different steps
    for _ in range(6):
        gen.next()
    gen.close()
    scoped = [shape for was, shape in calls if was]
    assert scoped == [(1, 1), (1, 1), (1, 1)], (
        f"calls inside the prompt-end scope: {scoped}; mlx-lm's split no longer reads each "
        "prompt's last token in the moving batch's `generate` alone (mlx_compat.scope_prompt_ends)"
    )


def test_prefill_step_is_read_at_every_step(model, monkeypatch):
    """Use 2: the chunk sizer changes the prompt chunk between two steps of one prompt, and each
    chunk is one forward pass of its size (not passes of the size the generator started with)."""
    gen = _generator(model, chunk=2)
    gen.insert([PROMPT])
    call = type(model).__call__
    positions: list[int] = []

    def counted(self, inputs, *args, **kwargs):
        positions.append(int(inputs.shape[1]))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", counted)
    done = []
    for chunk in (3, 5):
        set_prefill_step(gen, chunk)
        prompts, _ = gen.next()
        done.append(prompts[0].progress[0])
    assert done == [3, 8], (
        f"prompt progress {done} after chunks of 3 then 5 tokens: mlx-lm's BatchGenerator no "
        "longer reads prefill_step_size at every next() (engine/batch.py's ChunkSizer sets it)"
    )
    assert positions == [3, 5], (
        f"forward passes over {positions} positions for chunks of 3 then 5: the prompt batch no "
        "longer takes its pass size from `_prompt_batch.prefill_step_size` (set_prefill_step)"
    )
    gen.close()


def test_prompt_chunk_outputs_are_never_read(model, monkeypatch):
    """Use 8: BatchGenerator keeps only the caches of a prompt chunk (a call over several
    positions); its output is dropped, so a streaming model skips its last layer's experts."""

    def tokens() -> list[list[int]]:
        gen = _generator(model, chunk=4)
        uids = gen.insert([PROMPT, PROMPT[3:] + PROMPT[:5]])
        out: dict[int, list[int]] = {u: [] for u in uids}
        while any(len(t) < 3 for t in out.values()):
            for r in gen.next()[1]:
                out[r.uid].append(int(r.token))
        gen.close()
        return [out[u] for u in uids]

    plain = tokens()
    call = type(model).__call__
    wrong = next(t for t in range(VOCAB) if all(t not in row for row in plain))

    def poisoned(self, inputs, cache=None, **kwargs):
        out = call(self, inputs, cache=cache, **kwargs)
        if inputs.shape[1] == 1:
            return out
        return mx.where(mx.arange(out.shape[-1]) == wrong, 1e9, -1e9).astype(out.dtype) + 0 * out

    monkeypatch.setattr(type(model), "__call__", poisoned)
    assert tokens() == plain, (
        "mlx-lm's BatchGenerator now reads the model's output of a prompt chunk: the streaming "
        "layer's last-layer skip (experts/unused_output.py, engine/batch.py) is no longer exact"
    )


def test_batch_kv_cache_padding():
    """Use 3: a batch cache says whether a row is padded, left (`left_padding`) or right
    (`_right_padding`, until finalize)."""
    assert hasattr(BatchKVCache([0]), "_right_padding"), (
        "mlx-lm's BatchKVCache has no `_right_padding` any more: mlx_compat.unpadded reads it"
    )
    assert unpadded(BatchKVCache([0, 0]))
    assert not unpadded(BatchKVCache([0, 2])), "left_padding no longer marks a padded row"
    right = BatchKVCache([0, 0])
    right.prepare(right_padding=[1, 0])
    assert not unpadded(right), "prepare(right_padding=) no longer sets _right_padding"


def test_unpadded_decode_step_needs_no_mask():
    """Use 3: make_mask's signature as UnpaddedBatchKVCache overrides it, the class swap
    decode_mask.fit_masks does, and the premise that an unpadded one-token step's mask is all
    true (the same attention as none)."""
    params = inspect.signature(BatchKVCache.make_mask).parameters
    assert list(params)[:3] == ["self", "N", "return_array"] and any(
        p.kind is p.VAR_KEYWORD for p in params.values()
    ), f"BatchKVCache.make_mask's signature changed to {list(params)}: decode_mask.py overrides it"
    cache = BatchKVCache([0, 0])
    kv = mx.ones((2, 1, 5, 4))
    cache.update_and_fetch(kv, kv)
    mask = cache.make_mask(1)
    assert mask is None or bool(mx.all(mask)), (
        "an unpadded BatchKVCache's one-token mask is not all true: UnpaddedBatchKVCache's "
        "unmasked decode step would change the attention"
    )
    recast(cache, UnpaddedBatchKVCache)
    assert cache.make_mask(1) is None and cache.make_mask(2) is not None


def test_recast_keeps_the_object_and_its_state(model):
    """Use 13: a live BatchKVCache and a decoder layer take a moed subclass in place (the batch
    and the model keep holding them) with every array they held; a class over another mlx-lm
    class is refused."""
    cache = BatchKVCache([0, 0])
    kv = mx.arange(40, dtype=mx.float32).reshape(2, 1, 5, 4)
    cache.update_and_fetch(kv, kv)
    before = [np.array(a) for a in cache.state]
    recast(cache, UnpaddedBatchKVCache)
    assert type(cache) is UnpaddedBatchKVCache
    assert all(np.array_equal(a, b) for a, b in zip(before, [np.array(a) for a in cache.state]))
    recast(cache, BatchKVCache)
    assert type(cache) is BatchKVCache

    layer = model.layers[0]
    base = type(layer)
    x = mx.ones((1, 3, model.args.hidden_size))
    want = np.array(layer(x, mask="causal"))

    class Watched(base):  # what layer_progress.py makes: behaviour, no state
        pass

    Watched.__module__ = "moed.daemon.model.layer_progress"
    recast(layer, Watched)
    try:
        assert model.layers[0] is layer and type(layer) is Watched
        assert np.array_equal(np.array(layer(x, mask="causal")), want), (
            "a recast decoder layer computes something else: its class carries state"
        )
        with pytest.raises(TypeError):
            recast(layer, UnpaddedBatchKVCache)
    finally:
        recast(layer, base)


def test_hf_tokenizer_is_the_one_the_wrapper_wraps(tiny_model):
    """Use 12: TokenizerWrapper keeps the Hugging Face tokenizer in `_tokenizer`, whose backend
    gives character offsets (prefix_encode.py) and whose vocabulary llguidance reads
    (grammar.py); an object without `_tokenizer` is its own."""
    wrapper = load_tokenizer(tiny_model)
    hf = hf_tokenizer(wrapper)
    assert hf is not wrapper, "TokenizerWrapper no longer keeps its tokenizer in `_tokenizer`"
    assert hasattr(hf, "backend_tokenizer") and isinstance(hf.added_tokens_decoder, dict), (
        f"TokenizerWrapper's `_tokenizer` is a {type(hf).__name__}, not a fast tokenizer"
    )
    assert hf.encode("hello world") == wrapper.encode("hello world")
    bare = load_tokenizer(tiny_model).encode  # no `_tokenizer` of its own
    assert hf_tokenizer(bare) is bare


class _WithHandle:
    """The pipeline leader's shape: a model whose cache lists end with a CacheHandle."""

    def __init__(self, model):
        self.model = model
        self.log = OpLog()
        self.calls: list[str] = []

    def make_cache(self) -> list:
        return [*make_prompt_cache(self.model), _Recording(self.log.new_handle(), self.calls)]

    def __call__(self, inputs, cache=None, **kwargs):
        return self.model(inputs, cache=cache[:-1])

    def __getattr__(self, name):
        return getattr(self.model, name)


class _Recording(CacheHandle):
    """A CacheHandle that records the names mlx-lm reaches for on it (and on its merges and
    copies)."""

    def __init__(self, handle: CacheHandle, calls: list[str]):
        super().__init__(handle.handle, handle._log)
        self._keep, self._calls = handle, calls  # the handle's twin lives as long as this

    def __getattribute__(self, name):
        if not name.startswith("_") or name == "__deepcopy__":
            object.__getattribute__(self, "_calls").append(name)
        return object.__getattribute__(self, name)

    @classmethod
    def merge(cls, handles):
        return cls(CacheHandle.merge(handles), handles[0]._calls)

    def __deepcopy__(self, memo):
        return _Recording(CacheHandle.__deepcopy__(self, memo), self._calls)


def test_batch_cache_calls_reach_the_handle(model):
    """Use 4: whatever BatchGenerator does to a batch's caches, it does through the calls that
    CacheHandle answers (rows of different lengths join, one leaves, a finished row's cache is
    extracted)."""
    for name in BATCH_CACHE_CALLS:
        assert hasattr(BatchKVCache, name) and hasattr(CacheHandle, name), name
    assert inspect.ismethod(BatchKVCache.merge), "BatchKVCache.merge is no classmethod any more"
    prepare = inspect.signature(BatchKVCache.prepare).parameters
    assert set(prepare) == {"self", "left_padding", "lengths", "right_padding"}, (
        f"BatchKVCache.prepare takes {list(prepare)}: CacheHandle.prepare mirrors it to the ranks"
    )
    stand_in = _WithHandle(model)
    gen = BatchGenerator(stand_in, max_tokens=4, sampler=greedy_sampler, prefill_step_size=4)
    try:
        gen.insert([PROMPT])
        gen.next()
        joining = gen.insert([PROMPT[:3], PROMPT])  # chunks of 2 and 4: right-padded
        gen.next()
        gen.next()
        gen.remove(joining[:1], return_prompt_caches=True)
        while any(gen.next()):
            pass
    except AttributeError as exc:
        pytest.fail(f"mlx-lm's BatchGenerator makes a cache call CacheHandle lacks: {exc}")
    finally:
        gen.close()
    known = {*BATCH_CACHE_CALLS, "__deepcopy__", "state", "nbytes", "empty", "size", "handle"}
    unknown = sorted(set(stand_in.calls) - known)
    assert not unknown, (
        f"BatchGenerator now calls {unknown} on a cache list's elements: CacheHandle must mirror "
        "them to the other ranks (distributed/cache_ops.py), and BATCH_CACHE_CALLS name them"
    )
    assert {"merge", "filter", "extract", "prepare", "finalize"} <= set(stand_in.calls), (
        f"rows joining (padded), leaving and ending made only {sorted(set(stand_in.calls))} "
        "calls on the cache list: the pipeline's followers would not follow the batch"
    )


def test_model_class_for_a_config():
    """Use 5: mlx_lm.utils._get_classes(config) gives the model class, then its args class."""
    assert hasattr(mlx_compat, "_get_classes"), "mlx_lm.utils._get_classes is gone"
    cls = model_class_for(make_config("qwen3_moe", vocab=VOCAB))
    assert cls is qwen3_moe.Model, (
        f"mlx_lm.utils._get_classes no longer returns (Model, ModelArgs) first: got {cls!r} "
        "(distributed/rank0.py's check_supported)"
    )


def test_unloaded_model_has_shapes_and_no_memory():
    """Use 5: the args class `_get_classes` gives builds the model from a config.json; its
    parameters stay lazy, so a published model's shapes cost no memory (bench/replica_layout)."""
    config = make_config("qwen3_moe", vocab=VOCAB)
    model = unloaded_model(config)
    assert isinstance(model, qwen3_moe.Model)
    experts = model.model.layers[0].mlp.switch_mlp.gate_proj.weight
    assert experts.shape[0] == config["num_experts"]
    before = mx.get_active_memory()
    deep = unloaded_model({**config, "num_hidden_layers": 64})
    would_be = sum(v.nbytes for _, v in tree_flatten(deep.parameters()))  # from shapes alone
    # Nothing evaluated (other tests' arrays may be freed meanwhile: the count can fall).
    assert mx.get_active_memory() - before < would_be // 100


def test_pipeline_support_found_in_the_sources_and_the_classes():
    """Use 5: the architectures whose sources name PipelineMixin are those whose class
    hierarchy's modules define a PipelineMixin module, and the reference ones are among them."""
    named = pipelined_architectures()
    assert {"qwen3_moe", "deepseek_v3", "qwen3_5"} <= set(named), (  # qwen3_5_moe's is qwen3_5
        f"mlx-lm's models/*.py name PipelineMixin only in {named}: the pipeline refuses the "
        "reference architectures now"
    )
    for arch in ("qwen3_moe", "deepseek_v3", "qwen3_5_moe"):
        assert supports_pipeline(make_config(arch, vocab=VOCAB)), (
            f"{arch}'s model class hierarchy no longer reaches a PipelineMixin module"
        )
    assert not supports_pipeline(make_config("mixtral", vocab=VOCAB))
    assert "mixtral" not in named


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_pipeline_module_and_its_final_norm(arch):
    """Use 6: the PipelineMixin module splits its layers and calls its final `norm` once per
    forward, on the last hidden state."""
    mx.random.seed(1)
    module = __import__(f"mlx_lm.models.{arch}", fromlist=["Model"])
    m = module.Model(module.ModelArgs.from_dict(make_config(arch, num_layers=3, vocab=VOCAB)))
    mx.eval(m.parameters())
    inner = m.model
    assert isinstance(inner, PipelineMixin)
    tokens = mx.array([PROMPT])
    expected = m(tokens)
    inner.pipeline(mx.distributed.init(), [3])
    assert pipeline_layers(inner) == (0, 3), "PipelineMixin's start_idx/end_idx changed meaning"
    seen = []

    class Counting(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def __call__(self, h):
            seen.append(h.shape)
            return self.norm(h)

    norm = wrap_pipeline_norm(inner, Counting)
    assert isinstance(norm, nn.RMSNorm), f"the pipeline module's `norm` is a {type(norm)}"
    out = m(tokens)
    assert seen == [(1, len(PROMPT), inner.norm.norm.weight.shape[0])], (
        f"the pipeline module called its final norm {len(seen)} times: distributed/leader.py "
        "fences the activations there, once per forward"
    )
    np.testing.assert_array_equal(np.array(out), np.array(expected))


def test_mlx_lm_utils_sets_the_open_file_limit_at_import():
    """Use 7: runtime/open_files.py keeps moed's limit through mlx_lm/utils.py's import-time
    setrlimit; without that call the guard is dead code and should go."""
    import mlx_lm.utils

    assert "resource.setrlimit(resource.RLIMIT_NOFILE" in inspect.getsource(mlx_lm.utils), (
        "mlx_lm/utils.py no longer sets RLIMIT_NOFILE at import: runtime/open_files.py's "
        "_KeepLimitThroughImport guards nothing now"
    )


def test_switch_layers_contract():
    """The streaming twin's contract (experts/discover.py, streaming_switch.py): the switch
    modules' projections and activation, the quantized linear's parameters, and the sorted path
    taken from 64 routings on."""
    glu = switch_layers.SwitchGLU(16, 8, 4)
    mlp = switch_layers.SwitchMLP(16, 8, 4)
    for module, names in ((glu, ("gate_proj", "up_proj", "down_proj")), (mlp, ("fc1", "fc2"))):
        for name in (*names, "activation"):
            assert hasattr(module, name), f"mlx-lm's {type(module).__name__} has no `{name}`"
        for name in names:
            assert isinstance(getattr(module, name), switch_layers.SwitchLinear)
    q = switch_layers.QuantizedSwitchLinear(64, 32, 4, group_size=32, bits=4)
    for name in ("weight", "scales", "biases", "group_size", "bits", "mode"):
        assert hasattr(q, name), f"mlx-lm's QuantizedSwitchLinear has no `{name}`"
    for name in ("_gather_sort", "_scatter_unsort"):
        assert hasattr(switch_layers, name), f"mlx-lm's switch_layers.{name} is gone"


@pytest.mark.parametrize("routings, sorted_path", [(63, False), (64, True)])
def test_switch_sorts_from_64_routings(monkeypatch, routings, sorted_path):
    calls = []
    real = switch_layers._gather_sort
    monkeypatch.setattr(
        switch_layers, "_gather_sort", lambda *a: calls.append(1) or real(*a), raising=True
    )
    glu = switch_layers.SwitchGLU(16, 8, 4)
    x = mx.random.normal((routings, 16))
    indices = mx.zeros((routings, 1), dtype=mx.uint32)
    mx.eval(glu(x, indices))
    assert bool(calls) is sorted_path, (
        f"mlx-lm's SwitchGLU {'did not sort' if sorted_path else 'sorted'} {routings} routings: "
        "streaming_switch.py sorts from 64 on (`do_sort`), as it did"
    )


def test_architectures_are_files_under_mlx_lm_models():
    """client/hub.py's mlx_lm_knows finds an architecture as mlx_lm/models/<model_type>.py,
    without importing mlx-lm (the client imports no mlx)."""
    for arch in ("qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3"):
        assert mlx_lm_knows(arch), f"mlx-lm's {arch} is no longer mlx_lm/models/{arch}.py"
    assert not mlx_lm_knows("no_such_architecture")
