"""Attention-mass recall of KV-cache selections on real data.

How much of the attention a decode query would pay to the full KV cache lands on the tokens a
retrieval method keeps, at a fixed token budget. Data: real post-RoPE queries, keys and values of
SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 KV heads, head dim 64) on real text shipped
with the package (Jane Austen by default; CPython standard-library code with ``kind="code"``),
captured once per document and cached in ``~/.cache/icecache/eval/`` (``$ICECACHE_EVAL_CACHE``
overrides): queries float32 at the query positions, keys and values float16 at all positions.
All methods and the reference attention use the same (float16-rounded) keys and values.

Protocol, for one document of ``T`` tokens, one layer (default: every layer >= 2; layers 0 and 1
keep their full cache in IceCache), one KV head ``h`` and one query position ``t``:

* Query positions: ``n_queries`` (default 16) positions spread evenly over the last 5% of the
  document (:func:`query_positions`). The query at ``t`` is the prefill query of token ``t``,
  which equals the decode query of step ``t`` (causal attention).
* Context: tokens ``[0, t]``. **Sink**: tokens ``[0, sink)`` (16). **Window**: the ``window``
  (16) most recent tokens ``[M, t]`` with ``M = t - window + 1``. **Middle**: ``[sink, M)``,
  the part every method selects from (and what IceCache offloads and indexes). The boundary
  ``M`` moves with ``t`` so that every query sees the same 16-token window: with one ``M``
  shared by queries spread over the last 5% (400 tokens at T = 8000) the window would reach
  400+ tokens and exceed the 64-256 token budgets. Indexes are therefore built per query over
  exactly that query's middle (a fresh ``HeadForest`` per (document, layer, query)).
* **Budget** ``B`` counts every token that enters the softmax of one (layer, KV head, step):
  ``sink + window + page_size * pages``, where every selected page is charged all
  ``page_size`` slots even when it holds fewer tokens. Page-based methods get
  ``pages = floor((B - sink - window) / page_size)`` pages (``page_size`` = 16: 2 / 6 / 14 / 30
  pages at B = 64 / 128 / 256 / 512). Token-granular methods get ``B - sink - window`` middle
  tokens. The charge is checked to never exceed ``B`` on average over a step's KV heads
  (:attr:`RecallResult.charged`; only ``icecache_adaptive`` charges heads unequally).
* **GQA-honest**: every method selects once per KV head; the selection is shared by the
  group's ``G = H_q / H_kv`` query heads (3 for SmolLM2).

Metrics, per (layer, KV head, query), each averaged over the group's query heads ``j``:

* **Attention-mass recall**: ``sum_{i in A} p_j(i)`` where ``p_j`` is the softmax of query head
  ``j`` over the whole context (scale ``1/sqrt(d)``) and ``A`` = sink + window + selected
  tokens. Reported as the mean over all (layer, KV head, query) samples, and as the
  **worst 5%**: the (layer, KV head) pairs are ranked by their mean recall over all documents
  and queries, and the mean of the lowest ``ceil(5%)`` of pairs is reported.
* **Middle-only recall**: the share of the middle's softmax mass that the selection captures,
  ``sum_j sum_{i in sel} p_j(i) / sum_j sum_{i in middle} p_j(i)`` (over the group's heads;
  a monotone function of the recall for each sample, so the oracle also maximises it).
* **Output error**: ``||o_sel - o_full|| / ||o_full||`` with ``o_full = sum_i p_j(i) v(i)`` and
  ``o_sel`` the softmax restricted to ``A`` (renormalised) times ``V``.

Methods, all at the same budget ``B``:

* ``oracle``: the ``B - sink - window`` middle tokens with the largest summed softmax weight of
  the group's query heads (token granularity). It maximises the recall: an upper bound on
  every method here.
* ``quest``: Quest-style positional pages of ``page_size`` consecutive middle tokens (the last
  one partial), ranked by the per-page key bound ``sum_d max(q_d kmin_d, q_d kmax_d)``, max over
  the group's query heads.
* ``streamingllm``: sink + the ``B - sink`` most recent tokens (the window grows to fill the
  budget).
* ``icecache``: ``icecache.HeadForest`` (default configuration) over the middle keys,
  ``select(queries of the group, pages, scale=1/sqrt(d))``.
* ``icecache_ranked``: what the runtime attends with fresh selection (``lookahead=False``;
  look-ahead selects with the previous step's queries, whose cost ``benches/
  bench_lookahead_quality.py`` measures): ``HeadForest.select`` picks a superset of
  ``max(4 * pages, 32)`` pages per KV head, which the device ranks by their exact group
  attention mass (each query head's softmax over the superset, sink and window tokens, as on
  the device), and each head attends its ``pages`` heaviest.
* ``icecache_adaptive``: the same with ``budget_mode="adaptive"``: the ``H_kv * pages``
  pages of all KV heads together with the largest share of their head's superset mass, so the
  heads' page counts differ (the budget then
  holds per (layer, step) over the KV heads, not per head; ``charged`` is per head).
* ``reference``: the IceCache reference configuration built with our index,
  ``HeadForest(..., num_simple=1, num_composite=1, promotion=[0.01, 0.2, 0.2])``, with the
  reference code's page ranking, which ``HeadForest.select`` has no switch for and which is
  therefore emulated in Python from ``token_map``: each query head scores every page by the
  largest ``q . k`` among its tokens (computed exactly, so this is an *optimistic* version of
  the reference, whose top keys come from an approximate tree search); the heads' ranked pages
  are taken round-robin (head 0's best, head 1's best, ..., then the second best of each, ...,
  skipping duplicates) until the page budget is full.

Diagnostic methods (``diagnostics=True``; used to find where IceCache loses mass):

* ``icecache_pagemass``: IceCache's semantic pages (default forest) ranked by their *true*
  summed group attention mass: the best any ranking can do on that page layout.
* ``icecache_maxkey``: IceCache's default pages with the reference's round-robin max-key
  ranking (separates page layout from page ranking).
* ``reference_pagemass``: the reference configuration's pages ranked by true mass.
* ``quest_pagemass``: positional pages ranked by true mass: the best positional paging can do.

Entry points: :func:`evaluate_recall` (capture + evaluate + save), :func:`evaluate_qkv` (evaluate
arrays you already have, e.g. synthetic ones in tests), and the CLI ``icecache eval recall``.

Modules, one job each: :mod:`~icecache.eval.recall.capture` (the data: query positions, one
capture per document, its cache), :mod:`~icecache.eval.recall.methods` (the selection methods),
:mod:`~icecache.eval.recall.evaluate` (the metrics of every method, and the whole run),
:mod:`~icecache.eval.recall.report` (:class:`RecallResult`: summaries, table, JSON, plot).
"""

from icecache.eval.recall.capture import DocQKV, default_eval_cache_dir, load_or_capture, query_positions
from icecache.eval.recall.evaluate import DEFAULT_BUDGETS, evaluate_qkv, evaluate_recall
from icecache.eval.recall.methods import DIAGNOSTIC_METHODS, METHOD_LABELS, METHODS, REFERENCE_FOREST_KWARGS
from icecache.eval.recall.report import RecallResult, plotting_missing

__all__ = [
    "plotting_missing",
    "DEFAULT_BUDGETS",
    "METHODS",
    "DIAGNOSTIC_METHODS",
    "METHOD_LABELS",
    "REFERENCE_FOREST_KWARGS",
    "DocQKV",
    "RecallResult",
    "default_eval_cache_dir",
    "evaluate_qkv",
    "evaluate_recall",
    "load_or_capture",
    "query_positions",
]
