"""The statistics engine: token tensors and gradients -> mergeable sufficient statistics -> named step metrics.

One micro-batch: ``batch`` (the ``TokenBatch`` contract) -> an engine object of ``engines`` (``stats_engine: auto |
eager | compiled``; each guard holds its own, with its own fallback; ``probe_batch`` picks one by name) -> a packed
``partial`` (the sufficient statistics) -> ``accumulate`` (the step's running sum, packed for one transfer) ->
``ranks`` (cross-rank merge) -> ``summarize`` (host formulas). The engines' paths:

- eager: ``eager`` walks ``chunks`` (fixed-size token ranges) and runs ``token_rows`` (every field of a chunk
  as one row of a stacked buffer in ``scratch``'s reused buffers), ``token_probes`` (clipping, lag) and ``kernels``
  (the allocating probes of the rarer paths: GSPO's second pass, per-sequence fields, the loss);
- compiled: ``fused`` (one chunk's statistics as one pure function with named outputs, under ``torch.compile``);
- host: ``host_engine`` (small CPU micro-batches computed in place by numpy, packed in the eager layout).

``sketch`` holds the quantile histogram, ``grads`` and ``update`` the gradient and update probes (each choosing its
own host or device path), ``culprits`` the per-sequence extremes, ``keys`` every internal key and ``constants``
every numeric default.
"""
