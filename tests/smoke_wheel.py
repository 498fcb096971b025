"""Run by `make test-wheel` inside a clean venv holding only the built wheel and its
dependencies: the abi3 wheel must import and answer with nothing but NumPy installed."""

import importlib.metadata as md

import icecache
import numpy as np

installed = sorted(d.metadata["Name"].lower() for d in md.distributions())
assert set(installed) <= {"icecache", "numpy", "pip", "setuptools"}, installed
assert icecache.__file__ and "site-packages" in icecache.__file__, icecache.__file__

idx = icecache.DCIIndex(8, seed=0)
idx.add(np.eye(8, dtype=np.float32))
ids, scores = idx.query(np.eye(8, dtype=np.float32), 1)
assert (ids[:, 0] == np.arange(8)).all(), ids
assert np.allclose(scores[:, 0], 1.0), scores
print("wheel ok; installed:", ", ".join(installed))
