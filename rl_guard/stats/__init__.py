"""The statistics engine: token tensors and gradients -> mergeable sufficient statistics -> named step metrics.

One micro-batch: ``batch`` (the ``TokenBatch`` contract) -> an engine object of ``engines`` (``stats_engine: auto |
eager | compiled``; each guard holds its own, with its own fallback) -> ``eager`` (the one path every engine runs)
-> a packed ``partial`` (the sufficient statistics, named by ``chunks.ChunkStats``) -> ``accumulate`` (the step's
running sum, packed for one transfer) -> ``ranks`` (cross-rank merge) -> ``summarize`` (host formulas).

The one definition: ``families`` (every token family's per-chunk statistics, one pure function with named outputs)
and ``sequences`` (the per-sequence families: KL per sequence, the sequence ratio, lengths, rewards, the loss), both
written against ``xp`` (the few array operations torch and numpy spell differently). ``eager`` walks ``chunks``
(fixed-size token ranges and the accumulator of their statistics) and runs them eagerly in torch, compiled, or, for
small CPU micro-batches, on numpy views of the tensors; ``token_rows`` says which rows a batch has and their names,
``lags`` maps policy-lag slots to buckets.

``sketch`` holds the quantile histogram, ``grads`` and ``update`` the gradient and update probes (multi-tensor torch
operations on every device), ``culprits`` the per-sequence extremes, ``keys`` every internal key and ``constants``
every numeric default.
"""
