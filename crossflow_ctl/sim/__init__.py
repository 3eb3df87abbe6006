"""Trace-driven simulator of a P/D cluster running the real admission policy, store and leases.

Usage: ``crossflowctl sim --trace FILE [--synthetic] --load 1,4,16`` writes ``report.md`` and PNG
plots under ``./reports/``; ``crossflowctl plan`` sizes pools (``crossflow_ctl.domain.sizing``).
Library: ``load_trace`` / ``generate_agentic`` -> ``Trace``; ``simulate(trace, SimConfig)`` ->
``RunRecord``; ``summarize``; ``plan_runs`` + ``run_sweep``; ``write_report``.

What is real and what is modelled:

* Real code, imported, never re-implemented: step times (``domain.capacity.step_time_s``), the
  agent's lease rules and pool-load report (``domain.leasing.decide`` / ``pool_load`` on an
  ``EngineSnapshot``), the broker's admission (``service.Broker``: ``plan_admission``,
  ``debit_for``, fail-closed answers, up to three debit tries) and the store (``MemoryStore``;
  ``RedisStore`` with ``--redis URL``), moved by a ``ManualClock``; the router is the client
  library's ``AdmissionQueue`` (late binding) over the broker in-process (``sim/control.py``).
* Modelled (see servers.py for the exact rules): prefill servers run one prompt at a time in
  chunks; decode servers batch continuously and advance several identical steps as one event
  (timed at the mid-point context); a borrowed prefill chunk (``borrow_chunk_tokens``) rides on
  one decode step and slows it as the roofline says; KV is reserved for prompt + output when a
  request joins a decode server (no preemption, FIFO wait); KV transfer is bytes / the node's
  network bandwidth with no contention; the router knows each request's true output length
  (the lease debit uses it); cached prefixes live in the prefill pool, so a borrowed request
  pulls its cached prefix over the network first. The first token counts when the request joins
  a decode batch. Agents see exact state (no scrape noise), sampled every ``agent_period_ms``;
  an agent at a fixed point (idle node) sleeps and catches up before any store read, with the
  same result as ticking (``fast_forward_agents``).
* Prefix cache (Mooncake ``hash_ids``): a bounded LRU of 512-token blocks, cluster-wide by
  default (``--cache-scope node`` gives one per prefill server with prefix-aware routing).
* Not modelled: preemption and recompute, network contention, engine scheduling noise,
  heterogeneous servers, failures (the store never errs here).
"""
