"""Save files under stress: concurrent saves to one path, failed and killed saves, and files
that pass their checksum but were written by a buggy or hostile producer (a CRC-valid file
must be rejected or usable, never a panic or an abort later)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import icecache
import numpy as np
import pytest
from icecache import DCIIndex
from isolated import isolated

# --------------------------------------------------------------------------------------------


def leftovers(directory, keep):
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


def test_concurrent_saves_to_one_path_all_succeed_and_the_file_is_whole(tmp_path):
    rng = np.random.default_rng(0)
    sizes = [200 + 37 * i for i in range(6)]
    indexes = []
    for n in sizes:
        idx = DCIIndex(16, seed=n)
        idx.add(rng.standard_normal((n, 16), dtype=np.float32))
        indexes.append(idx)
    path = tmp_path / "shared.icecache"
    errors = []

    def saver(idx):
        try:
            for _ in range(15):
                idx.save(path)
        except Exception as e:  # recorded: the test fails on any
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(i,)) for i in indexes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(DCIIndex.load(path)) in sizes
    assert leftovers(tmp_path, {"shared.icecache"}) == []


def test_failed_save_leaves_no_temporary_file(tmp_path):
    idx = DCIIndex(4, seed=0)
    idx.add(np.ones((10, 4), np.float32))
    target = tmp_path / "a-directory"
    target.mkdir()
    (target / "x").write_bytes(b"")
    with pytest.raises(OSError):
        idx.save(target)  # rename onto a non-empty directory fails
    assert leftovers(tmp_path, {"a-directory"}) == []


def test_killed_save_leaves_the_target_whole_and_the_next_save_cleans_up(tmp_path):
    path = tmp_path / "big.icecache"
    code = f"""
        import numpy as np, icecache, sys
        idx = icecache.DCIIndex(32, seed=1)
        idx.add(np.random.default_rng(0).standard_normal((60_000, 32), dtype=np.float32))
        idx.save({str(path)!r})
        print("saved", flush=True)
        while True:
            idx.save({str(path)!r})
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        time.sleep(0.7)
    finally:
        proc.kill()
        proc.wait()
    assert len(DCIIndex.load(path)) == 60_000
    small = DCIIndex(4, seed=0)
    small.add(np.ones((3, 4), np.float32))
    small.save(path)
    assert leftovers(tmp_path, {"big.icecache"}) == []
    assert len(DCIIndex.load(path)) == 3


def _payload_with_crc(data: bytes, payload: bytes) -> bytes:
    """A save file around ``payload``: the header of ``data`` with a fixed-up length and CRC."""
    import zlib

    head = data[:12] + len(payload).to_bytes(8, "little") + zlib.crc32(payload).to_bytes(4, "little")
    return head + payload


def test_nan_key_in_a_crc_valid_file_is_rejected(tmp_path):
    marker = np.float32(1234.5678)
    keys = np.random.default_rng(1).standard_normal((50, 8), dtype=np.float32)
    keys[17, 3] = marker
    idx = DCIIndex(8, seed=0)
    idx.add(keys)
    p = tmp_path / "k.icecache"
    idx.save(p)
    data = p.read_bytes()
    payload = bytearray(data[24:])
    at = payload.find(marker.tobytes())
    assert at > 0
    payload[at : at + 4] = np.float32(np.nan).tobytes()
    p.write_bytes(_payload_with_crc(data, bytes(payload)))
    with pytest.raises(icecache.IndexFileError, match="(?i)nan|finite"):
        DCIIndex.load(p)


def test_crc_valid_corrupted_files_load_cleanly_or_are_rejected(tmp_path):
    """Random byte edits with a recomputed CRC (a buggy or hostile writer): loading either
    raises IndexFileError, or gives an index that answers, grows, shrinks and saves without any
    error that is not an Exception. (The Rust proptest in tests/persist_props.rs goes further.)"""
    out = isolated(
        f"""
        import zlib, pathlib
        rng = np.random.default_rng(7)
        for metric in ("ip", "l2"):
            idx = DCIIndex(8, metric, seed=3)
            idx.add(rng.standard_normal((400, 8), dtype=np.float32))
            idx.add(rng.standard_normal((40, 8), dtype=np.float32))
            idx.remove(np.arange(0, 440, 9))
            p = pathlib.Path({str(tmp_path)!r}) / f"{{metric}}.icecache"
            idx.save(p)
            data = p.read_bytes()
            loaded = rejected = 0
            for case in range(250):
                payload = bytearray(data[24:])
                for _ in range(rng.integers(1, 4)):
                    at = rng.integers(0, len(payload))
                    flip = payload[at] ^ (1 << rng.integers(0, 8))
                    payload[at] = rng.integers(0, 256) if rng.random() < 0.5 else flip
                head = data[:12] + len(payload).to_bytes(8, "little") + zlib.crc32(payload).to_bytes(4, "little")
                p.write_bytes(head + payload)
                try:
                    bad = DCIIndex.load(p)
                except icecache.IndexFileError:
                    rejected += 1
                    continue
                except BaseException as e:
                    print("BASE load", type(e).__name__, e)
                    continue
                loaded += 1
                q = rng.standard_normal((3, 8), dtype=np.float32)
                for f in (
                    lambda: bad.query(q, 1),
                    lambda: bad.query(q, len(bad)),
                    lambda: bad.query(q, 5, exact=True),
                    lambda: bad.stats(),
                    lambda: bad.add(rng.standard_normal((5, 8), dtype=np.float32)),
                    lambda: bad.remove(bad.query(q[:1], 3, exact=True)[0][0]),
                    lambda: bad.query(q, 2),
                    lambda: bad.save(p),
                ):
                    try:
                        f()
                    except Exception:
                        pass
                    except BaseException as e:
                        print("BASE use", type(e).__name__, e)
            print(metric, loaded, rejected)
        """
    )
    assert not [o for o in out if o.startswith("BASE")], out
    assert len(out) == 2, out
