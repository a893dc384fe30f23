"""The start-up of a vLLM engine from ucp reads each weight straight into the parameters where vLLM's own loading code
shows it can (ucp.interop.vllm.engine: `dry_run`, `load_step`): every parameter ends bitwise as the model's own
`load_weights` leaves it given the full tensors, whichever weights are read into place, whatever the tensor-parallel
rank; a weight that loading code converts, changes after copying, or whose memory it replaces goes through
`load_weights` with its data. Needs no vLLM: the model here loads as vLLM's layers do (a share of each weight cut by
the rank, q/k/v and w1/w3 fused, experts stacked, the vocabulary padded and its padding zeroed); tests/test_vllm.py
serves every family from ucp through vLLM itself.
"""

from __future__ import annotations

import functools
import math
import random
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace

import pytest
import torch

from ucp.distributed.sharded_model import atom_path
from ucp.interop.vllm.engine import Request, _apart, _CopyRecorder, _span, load_step
from ucp.interop.vllm.source import _prefetched, open_weights

from .helpers import DRAW, random_full_state, save_in_layout, tiny_config


class LoadsLikeVllm(torch.nn.Module):
    """A Mixtral's parameters as one tensor-parallel rank of vLLM keeps them, loaded by name as vLLM's weight loaders
    do. `after_copy`, what loading code does with a parameter's data once a weight is copied into it: "scaled" (the
    layer norms doubled), "derived" (a scale computed from the final norm), "relaid" (the final norm's memory
    replaced, `param.data = ...`, as loaders that transpose or pad a weight do), or nothing. And two layouts where
    the copies of two weights meet: "overlapping" (each layer's two norms share a parameter of two rows; the first
    is broadcast into both, the second copied into its row after), "filled" (the first is broadcast into row 1, the
    second copied into row 0 and row 1 zeroed after)."""

    def __init__(self, cfg, tp: int, rank: int, *, after_copy: str | None = None):
        super().__init__()
        self.cfg, self.tp, self.rank, self.after_copy = cfg, tp, rank, after_copy
        hidden, head = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        self.q, self.kv = hidden // tp, cfg.num_key_value_heads * head // tp
        self.inter = cfg.intermediate_size // tp
        self.vocab = math.ceil(cfg.vocab_size / (16 * tp)) * 16  # (each rank's rows of the padded vocabulary)
        g = torch.Generator().manual_seed(1)
        shapes = {"embed": (self.vocab, hidden), "norm": (hidden,), "lm_head": (cfg.vocab_size, hidden)}
        for i in range(cfg.num_hidden_layers):
            shapes |= {
                f"qkv{i}": (self.q + 2 * self.kv, hidden),
                f"o{i}": (hidden, hidden // tp),
                f"w13_{i}": (cfg.num_local_experts, 2 * self.inter, hidden),
                f"w2_{i}": (cfg.num_local_experts, hidden, self.inter),
                f"gate{i}": (cfg.num_local_experts, hidden),
            }
            if after_copy in ("overlapping", "filled"):
                shapes[f"pair{i}"] = (2, hidden)
            else:
                shapes |= {f"ln1_{i}": (hidden,), f"ln2_{i}": (hidden,)}
        for name, shape in shapes.items():  # (float64 for the LM head: its weight is converted as it is copied)
            dtype = torch.float64 if name == "lm_head" else torch.float32
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype), False))
        self.register_buffer("scale", torch.zeros(()))  # ("derived": computed from the final norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, w in weights:
            loaded.add(self._load(name.split("."), w))
        return loaded

    def _share(self, w: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        return w.narrow(dim, self.rank * size, size)

    def _load(self, parts: list[str], w: torch.Tensor) -> str:
        if parts[0] == "lm_head":
            self.lm_head.data.copy_(w)
            return "lm_head"
        if parts[1] == "embed_tokens":  # (vLLM's VocabParallelEmbedding: its rows, the padding zeroed)
            start = self.rank * self.vocab
            rows = max(0, min(self.vocab, w.shape[0] - start))
            self.embed[:rows].data.copy_(w.narrow(0, start, rows))
            self.embed[rows:].data.fill_(0)
            return "embed"
        if parts[1] == "norm":
            self.norm.data.copy_(w)
            if self.after_copy == "relaid":
                self.norm.data = self.norm.data.clone()
            if self.after_copy == "derived":
                self.scale.copy_(self.norm.data.abs().max())
            return "norm"
        i, kind = int(parts[2]), parts[-2]
        if kind in ("q_proj", "k_proj", "v_proj"):
            offset, size = {"q_proj": (0, self.q), "k_proj": (self.q, self.kv), "v_proj": (self.q + self.kv, self.kv)}[
                kind
            ]
            getattr(self, f"qkv{i}").data.narrow(0, offset, size).copy_(self._share(w, 0, size))
            return f"qkv{i}"
        if kind == "o_proj":
            getattr(self, f"o{i}").data.copy_(self._share(w, 1, self.cfg.hidden_size // self.tp))
            return f"o{i}"
        if kind in ("w1", "w3"):
            expert = getattr(self, f"w13_{i}").data[int(parts[-3])]
            expert.narrow(0, 0 if kind == "w1" else self.inter, self.inter).copy_(self._share(w, 0, self.inter))
            return f"w13_{i}"
        if kind == "w2":
            getattr(self, f"w2_{i}").data[int(parts[-3])].copy_(self._share(w, 1, self.inter))
            return f"w2_{i}"
        if kind == "gate":
            getattr(self, f"gate{i}").data.copy_(w)
            return f"gate{i}"
        first = kind == "input_layernorm"
        if self.after_copy in ("overlapping", "filled"):
            pair = getattr(self, f"pair{i}").data
            if first:  # (a broadcast: not read into place)
                (pair if self.after_copy == "overlapping" else pair[1:2]).copy_(w)
            else:
                pair[1 if self.after_copy == "overlapping" else 0].copy_(w)
                if self.after_copy == "filled":
                    pair[1].fill_(0)
            return f"pair{i}"
        name = f"ln1_{i}" if first else f"ln2_{i}"
        getattr(self, name).data.copy_(w)
        if self.after_copy == "scaled":
            getattr(self, name).data.mul_(2)
        return name


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny Mixtral (vocabulary 100: padded by every tp) as a job in a drawn layout wrote it."""
    cfg = tiny_config()
    url = str(tmp_path_factory.mktemp("dry-run") / "ckpt")
    save_in_layout(random_full_state(cfg, states=()), cfg, DRAW.choice(["tp1", "tp2", "tp2ep2dp2", "tp1pp2"]), url)
    return url


def built(url: str, tp: int, rank: int, **kw) -> LoadsLikeVllm:
    return LoadsLikeVllm(tiny_config(), tp, rank, **kw)


def engine_config(url: str) -> SimpleNamespace:
    """What `load_step` reads of vLLM's model config: the HF config served, the model's name, its quantization."""
    config = open_weights(url).plan.config_json
    return SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: dict(config)), model=url, quantization=None)


def oracle(url: str, tp: int, rank: int, **kw) -> LoadsLikeVllm:
    """The model as its own `load_weights` leaves it given every full tensor."""
    model = built(url, tp, rank, **kw)
    weights = open_weights(url)
    atoms = weights.reader.read_atoms([atom_path(n, None) for n in weights.plan.names])
    with torch.no_grad():
        model.load_weights((n, atoms[atom_path(n, None)]) for n in weights.plan.names)
    return model


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_weights_read_into_place_leave_every_parameter_as_the_models_own_loading_does(checkpoint):
    tp = DRAW.choice([1, 2])
    rank = DRAW.randrange(tp)
    expected = oracle(checkpoint, tp, rank)
    reports = {}
    for into_parameters in (True, False):
        model = built(checkpoint, tp, rank)
        report = load_step(model, engine_config(checkpoint), Request(checkpoint, into_parameters=into_parameters))
        assert_same_parameters(model, expected)
        reports[into_parameters] = report
    names = open_weights(checkpoint).plan.names
    assert reports[True].in_place == len(names) - 1  # (all but the LM head, converted to float64 as it is copied)
    assert reports[False].in_place == 0
    assert reports[True].unknown_shares == reports[False].unknown_shares == []
    if tp > 1:  # (a rank reads its share only, into place or not: no more than a model that keeps every weight whole)
        whole = load_step(built(checkpoint, 1, 0), engine_config(checkpoint), Request(checkpoint))
        assert reports[True].bytes_read <= whole.bytes_read and reports[False].bytes_read <= whole.bytes_read


def test_weights_handed_over_in_many_groups_read_ahead_load_as_the_models_own_loading_does(checkpoint):
    # (every weight through load_weights, in groups of one or a few weights, several read ahead of the one consumed)
    tp = DRAW.choice([1, 2])
    rank = DRAW.randrange(tp)
    model = built(checkpoint, tp, rank)
    budget = DRAW.choice([1, 64 << 10, 1 << 20])
    load_step(model, engine_config(checkpoint), Request(checkpoint, memory_budget=budget, into_parameters=False))
    assert_same_parameters(model, oracle(checkpoint, tp, rank))


def test_groups_are_read_ahead_in_order_and_those_not_started_are_dropped_when_the_consumer_stops():
    lock = threading.Lock()
    started: list[int] = []
    running = [0, 0]  # (now, most)

    def load(i: int) -> dict[str, torch.Tensor]:
        with lock:
            started.append(i)
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.005)
        with lock:
            running[0] -= 1
        return {f"w{i}.{j}": torch.tensor(i) for j in range(i % 3)}

    n = DRAW.randint(5, 12)
    loads = [functools.partial(load, i) for i in range(n)]
    got = [name for name, _ in _prefetched(loads)]
    assert got == [f"w{i}.{j}" for i in range(n) for j in range(i % 3)] and running[1] <= 1
    started.clear()
    stream = _prefetched(loads[1:])
    assert next(stream)[0] == "w1.0"
    stream.close()  # (waits for the load running)
    assert set(started) <= {1, 2}, "no load beyond the one read ahead starts"


@pytest.mark.parametrize("after_copy", ["scaled", "derived", "relaid", "filled", "overlapping"])
def test_loading_code_that_uses_a_parameters_data_after_a_copy_or_overlaps_copies_loads_as_the_model_does(
    checkpoint, after_copy
):
    tp = DRAW.choice([1, 2])
    rank = DRAW.randrange(tp)
    expected = oracle(checkpoint, tp, rank, after_copy=after_copy)
    model = built(checkpoint, tp, rank, after_copy=after_copy)
    report = load_step(model, engine_config(checkpoint), Request(checkpoint))
    assert_same_parameters(model, expected)
    layers = tiny_config().num_hidden_layers
    names = open_weights(checkpoint).plan.names
    # (overlapping: all but the LM head and both norms of each layer, which go through load_weights in its order)
    assert report.in_place == (len(names) - 1 - 2 * layers if after_copy == "overlapping" else 0)


def test_a_copy_into_a_view_with_unit_dimensions_is_read_into_place_only_the_right_way_up():
    param = torch.zeros(1, 4)
    probe = torch.empty(4, 1, device="meta")
    for view, direct in ((probe.t(), False), (probe.view(1, 4), False)):
        recorder = _CopyRecorder({id(probe): "w"}, {param.untyped_storage().data_ptr()})
        with recorder:
            param.copy_(view) if view.shape == param.shape else param.t().copy_(view)
        (copy,) = recorder.copied["w"]
        assert (copy.target is not None) == direct
    recorder = _CopyRecorder({id(probe): "w"}, {param.untyped_storage().data_ptr()})
    with recorder:
        param.t().copy_(probe)  # (a (4, 1) view of the parameter, the probe's own shape and orientation)
    (copy,) = recorder.copied["w"]
    assert copy.box == ((0, 4), (0, 1)) and copy.target is not None and copy.target.shape == (4, 1)


def test_destinations_that_overlap_one_another_or_a_later_write_are_never_read_into_place():
    """Random destinations in a few storages against the overlap graph's truth: a weight is read into place exactly
    when no span of another weight, of another box of its own, or written later by load_weights, is connected to one of
    its own through overlapping spans (for intervals, what one sweep in order finds)."""
    rng = random.Random(DRAW.randrange(2**32))
    for _ in range(100):
        storages = [torch.empty(rng.randrange(8, 64)) for _ in range(rng.randrange(1, 4))]
        targets = {
            f"w{i}": [(((0, rng.randrange(1, 3)),), random_view(rng, storages)) for _ in range(rng.randrange(1, 3))]
            for i in range(rng.randrange(1, 9))
        }
        later = [_span(random_view(rng, storages)) for _ in range(rng.randrange(3))]
        assert set(_apart(targets, later)) == kept_by_search(targets, later)


def random_view(rng: random.Random, storages: list[torch.Tensor]) -> torch.Tensor:
    s = rng.choice(storages)
    start = rng.randrange(s.numel())
    return s[start : rng.randrange(start + 1, s.numel() + 1)]


def kept_by_search(targets: dict, later: list) -> set[str]:
    """The weights whose spans' connected components (through overlaps) hold nothing but copies of that span."""
    spans = [(_span(t), name, box) for name, places in targets.items() for box, t in places]
    spans += [(span, None, None) for span in later]

    def meet(i: int, j: int) -> bool:
        a, b = spans[i][0], spans[j][0]
        return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]

    kept = set(targets)
    for i in range(len(spans)):
        component, frontier = {i}, [i]
        while frontier:
            k = frontier.pop()
            for j in range(len(spans)):
                if j not in component and meet(k, j):
                    component.add(j)
                    frontier.append(j)
        if len({spans[j] for j in component}) > 1:
            kept.discard(spans[i][1])
    return kept
