"""The look-ahead worker's calls for several layers at once (``LookAheadLayer.start_all`` and
``wait_all``, which a step graph makes once per step or segment): the same jobs as one call per
layer, and bad input that starts nothing."""

import numpy as np
import pytest
from conftest import lookahead_parts
from icecache import HeadForest, ResidentPages, _core

H_KV, GROUP, N, D, PS, M = 2, 2, 2000, 16, 16, 4


def _layer(worker, seed):
    """A leading layer of one sequence over its own forest; its queries and flag to write."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((H_KV, N, D)).astype(np.float32)
    values = rng.standard_normal((H_KV, N, D)).astype(np.float32)
    forest = HeadForest(keys, seed=seed, threads=1)
    parts = lookahead_parts(forest, keys, values, query_heads=H_KV * GROUP, page_size=PS, max_pages=M)
    layer = _core.LookAheadLayer(worker, *parts.lent, kv_heads=H_KV, page_size=PS, max_pages=M, scale=0.25)
    layer.set_lane(0, parts.k_store, parts.v_store, forest=forest, resident=ResidentPages(H_KV, 2 * M))
    return layer, forest, parts.queries, parts.flag


def test_start_all_and_wait_all_run_the_jobs_of_separate_calls():
    worker = _core.LookAhead(2)
    made = [_layer(worker, seed) for seed in (1, 2, 3)]
    rng = np.random.default_rng(9)
    for step in range(1, 5):
        for _, _, queries, flag in made:
            queries[0] = 2 * rng.standard_normal((H_KV * GROUP, D))
            flag[0] = step  # as the device writes it behind the step's queries
        layers = [layer for layer, *_ in made]
        _core.LookAheadLayer.start_all(layers, [[0]] * 3, steps=[step] * 3, history_lens=[None] * 3)
        outcomes = _core.LookAheadLayer.wait_all(layers)
        assert len(outcomes) == 3
        for (layer, forest, queries, _), outcome in zip(made, outcomes):
            own, _ = forest.select(queries[0], M, scale=0.25)
            np.testing.assert_array_equal(layer.selected()[0], own)
            single = layer.wait()
            assert (outcome.loads, outcome.clears, outcome.end) == (single.loads, single.clears, single.end)
            assert outcome.selected == single.selected > 0
    for layer, *_ in made:
        layer.clear()


def test_start_all_checks_every_layer_before_it_starts_any():
    worker = _core.LookAhead(1)
    (a, *_), (b, *_) = _layer(worker, 4), _layer(worker, 5)
    bad = (
        dict(flushed=[[0], [0]], steps=[1], history_lens=[None, None]),  # one step for two layers
        dict(flushed=[[0]], steps=[1, 1], history_lens=[None, None]),
        dict(flushed=[[0], [0, 0]], steps=[1, 1], history_lens=[None, None]),  # b has one sequence
        dict(flushed=[[0], [PS + 1]], steps=[1, 1], history_lens=[None, None]),  # more than a page
    )
    for kwargs in bad:
        with pytest.raises(ValueError):
            _core.LookAheadLayer.start_all([a, b], kwargs.pop("flushed"), **kwargs)
        for layer in (a, b):  # nothing started, the first layer's job included
            assert layer.done()
            with pytest.raises(RuntimeError, match="no job was started"):
                layer.wait()
    with pytest.raises(TypeError):
        _core.LookAheadLayer.start_all([a, "b"], [[0], [0]], steps=[1, 1], history_lens=[None, None])
    with pytest.raises(RuntimeError, match="no job was started"):
        _core.LookAheadLayer.wait_all([a, b])
    assert _core.LookAheadLayer.wait_all([]) == []
