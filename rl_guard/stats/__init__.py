"""The statistics engine: token tensors and gradients -> mergeable sufficient statistics -> named step metrics.

One micro-batch flows ``batch`` (the ``TokenBatch`` contract) -> ``probe_batch`` (which fields, in which order) ->
``chunks`` (fixed-size token ranges) -> ``token_rows`` (every field of a chunk as one row of a stacked buffer,
probed together) and ``token_probes`` / ``kernels`` (clipping, lag and the rarer paths) -> ``partial`` (the
sufficient statistics, packed) -> ``accumulate`` (the step's running sum, packed for one transfer) -> ``ranks``
(cross-rank merge) -> ``summarize`` (host formulas). ``sketch`` holds the quantile histogram, ``grads`` the gradient
probe, ``keys`` every internal key and ``constants`` every numeric default.
"""
