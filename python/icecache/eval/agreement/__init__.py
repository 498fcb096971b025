"""Teacher-forced greedy agreement with the full cache, on real prompts (prose and code).

Does decoding with a KV-cache method pick the same next tokens as the full cache? Protocol, per
prompt of ``T`` tokens (real text shipped with the package, :func:`icecache.texts.documents`:
Jane Austen prose and CPython standard-library code, 4k-8k tokens):

1. One exact prefill of tokens ``[0, T - 1)`` into a full cache (prefill attention is exact
   for every method here, so one prefill serves all runs).
2. The full cache decodes ``new_tokens`` steps greedily from the last prompt token: the
   reference tokens ``g_1 .. g_N``.
3. Every method at every budget decodes the same ``N`` steps *teacher-forced*: step ``i``
   feeds the full cache's token (the last prompt token, then ``g_1 .. g_{N-1}``), so one early
   difference does not change the context of the later steps. **Agreement** is the share of
   steps whose argmax equals ``g_i``; the **first divergence** is the first step that differs.

Methods, all at the same budget ``B`` = tokens in the softmax per (layer, KV head, step), with
the same sink (16), window (32) and page size (16), serving the same layers (every
full-attention layer after IceCache's ``full_layers`` = 2 full-cache layers):

* ``icecache``: the runtime itself, :class:`icecache.IceCache` with
  ``IceCacheConfig(budget=B)`` (its defaults: look-ahead selection, semantic pages), made from
  the prefilled full cache with :meth:`~icecache.IceCache.from_prefilled`.
* ``icecache_adaptive``: the same with ``budget_mode="adaptive"`` (each step's pages shared
  among the KV heads by attention mass).
* ``quest``: Quest-style selection, emulated over the full cache: the middle tokens (after the
  sink, before the window) are cut into positional pages of 16; each step ranks them by the
  bound ``sum_d max(q_d kmin_d, q_d kmax_d)`` (max over the KV head's query heads: one
  selection per KV head, as GQA shares the keys) and attends to the best
  ``(B - 48) // 16`` pages. This follows Quest's criterion; unlike the original it has a sink
  and a window (the same as IceCache's, so that only the page choice differs) and it shares
  the choice over a GQA group.
* ``streamingllm``: sink + the ``B - 16`` most recent tokens, emulated over the full cache.

The emulations reuse the recall evaluation's selectors
(:mod:`icecache.eval.recall.methods`); their attention is an exact softmax over the kept tokens
(:mod:`~icecache.eval.agreement.methods`). Entry points: :func:`evaluate_agreement` (load the
model, cut the prompts, evaluate, save), :func:`evaluate_prompts` (any model and prompts, e.g. a
tiny one in tests) and the CLI ``icecache eval agreement``.
"""

from icecache.eval.agreement.evaluate import (
    DEFAULT_BUDGETS,
    Agreement,
    Prompt,
    agreement,
    evaluate_agreement,
    evaluate_prompts,
    served_layers,
)
from icecache.eval.agreement.methods import EMULATED, METHOD_LABELS, METHODS, Emulation, emulating, keep_mask
from icecache.eval.agreement.report import AgreementResult, PromptRun, plotting_missing

__all__ = [
    "DEFAULT_BUDGETS",
    "EMULATED",
    "METHODS",
    "METHOD_LABELS",
    "Agreement",
    "AgreementResult",
    "Emulation",
    "Prompt",
    "PromptRun",
    "agreement",
    "emulating",
    "evaluate_agreement",
    "evaluate_prompts",
    "keep_mask",
    "plotting_missing",
    "served_layers",
]
