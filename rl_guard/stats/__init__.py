"""The statistics engine: token tensors and gradients -> mergeable sufficient statistics -> named step metrics.

One micro-batch: ``batch`` (the ``TokenBatch`` contract) -> an engine object of ``engines`` (``stats_engine: auto |
eager | compiled``; each guard holds its own, with its own fallback; ``probe_batch`` picks one by name) -> a packed
``partial`` (the sufficient statistics) -> ``accumulate`` (the step's running sum, packed for one transfer) ->
``ranks`` (cross-rank merge) -> ``summarize`` (host formulas). The engines' paths:

- eager and compiled: ``eager`` walks ``chunks`` (fixed-size token ranges) and runs ``families`` (every token
  family's per-chunk sufficient statistics, one pure function with named outputs: the one definition) on each,
  as it is or under ``torch.compile``; ``token_rows`` (which rows a batch has, their names), ``token_probes`` (lag
  buckets) and ``kernels`` (per-sequence fields, the sequence ratio, the loss) finish a micro-batch;
- host: ``host_engine`` (small CPU micro-batches computed in place by numpy, packed in the eager layout: a
  transcription of ``families`` held to it bit for bit by the tests).

``sketch`` holds the quantile histogram, ``grads`` and ``update`` the gradient and update probes (each choosing its
own host or device path), ``culprits`` the per-sequence extremes, ``keys`` every internal key and ``constants``
every numeric default.
"""
