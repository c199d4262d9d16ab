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
* :mod:`.multi_step`     several greedy decode steps per host step, in one replay (opt-in);
* :mod:`.graph_capture`  capture once, replay often: what every CUDA graph here is built from;
* :mod:`.piecewise`      steps with prompt chunks, replayed between attention calls;
* :mod:`.full_graphs`    steps with prompt chunks, one graph of the whole step;
* :mod:`.static`         the static-batching baseline;
* :mod:`.serve_bench`    ``gpulab serve-bench``: a generated workload, continuous vs static;
* :mod:`.timeline`       what the scheduler ran at every step and where the pages went;
* :mod:`.train`          ``gpulab train``: the model on the bundled poems, packed;
* :mod:`.speculative`    speculative decoding: drafts, exact acceptance, rollback (notebook 08);
* :mod:`.spec_graphs`    one replay drafts k tokens, one replay verifies them;
* :mod:`.server`         ``gpulab serve``: the OpenAI-compatible HTTP server (an engine
  thread, an engine process, or N API servers on one engine process).
"""
