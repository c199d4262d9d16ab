"""A tiny serving engine on gpulab's kernels (notebook 07), one file per part:

* :mod:`.model`          the byte-level ternary transformer and the reference decoder;
* :mod:`.sequence`       a request's state and its sampling parameters;
* :mod:`.block_manager`  KV pages with reference counts, prefix caching, copy-on-write;
* :mod:`.scheduler`      continuous batching: token budget, chunked prefill, preemption;
* :mod:`.batch_attention` attention for every batch shape (decode, append, cascade);
* :mod:`.runner`         one plan per step, the model's layers over the paged cache;
* :mod:`.sampling`       greedy, temperature, top-k, top-p, seeded per request;
* :mod:`.metrics`        TTFT, TPOT, latency, throughput, pages, prefix-cache hits;
* :mod:`.engine`         the step loop: ``LLM.generate`` and ``add_request``/``step``;
* :mod:`.static`         the static-batching baseline.
"""
