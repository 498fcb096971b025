"""Run by `make test-wheel` inside a clean venv holding only the built wheel and its
dependencies: the abi3 wheel must import and answer with nothing but NumPy installed."""

import importlib.metadata as md
from pathlib import Path

import icecache
import numpy as np
from icecache import texts

installed = sorted(d.metadata["Name"].lower() for d in md.distributions())
assert set(installed) <= {"icecache", "numpy", "pip", "setuptools"}, installed
assert icecache.__file__ and "site-packages" in icecache.__file__, icecache.__file__

idx = icecache.DCIIndex(8, seed=0)
idx.add(np.eye(8, dtype=np.float32))
ids, scores = idx.query(np.eye(8, dtype=np.float32), 1)
assert (ids[:, 0] == np.arange(8)).all(), ids
assert np.allclose(scores[:, 0], 1.0), scores
# The shipped texts are package data: prose, code and the code's PSF licence must be in the wheel.
assert texts.available_texts("prose") == ["northanger_abbey", "persuasion", "pride_and_prejudice"]
assert texts.available_texts("code") == ["configparser", "difflib", "statistics", "tarfile"]
assert "class SequenceMatcher:" in texts.load_text("difflib")
assert (Path(texts.__file__).parent / "_texts" / "CPYTHON_LICENSE.txt").is_file()
print("wheel ok; installed:", ", ".join(installed))
