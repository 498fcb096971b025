"""Quality evaluations of IceCache on real data.

:mod:`icecache.eval.recall`: attention-mass recall of page selections (IceCache, Quest,
StreamingLLM, an oracle) on real post-RoPE queries, keys and values of SmolLM2-135M.
Run it from the command line with ``icecache eval recall``.

:mod:`icecache.eval.agreement`: teacher-forced greedy agreement with the full cache (IceCache,
Quest, StreamingLLM) on real prose and code prompts; ``icecache eval agreement``.
"""

from icecache.eval.recall import (
    DEFAULT_BUDGETS,
    DIAGNOSTIC_METHODS,
    METHODS,
    DocQKV,
    RecallResult,
    evaluate_qkv,
    evaluate_recall,
    load_or_capture,
    query_positions,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "DIAGNOSTIC_METHODS",
    "METHODS",
    "DocQKV",
    "RecallResult",
    "evaluate_qkv",
    "evaluate_recall",
    "load_or_capture",
    "query_positions",
]
