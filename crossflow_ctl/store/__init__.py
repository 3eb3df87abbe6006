"""The store: one interface (:class:`~crossflow_ctl.store.base.Store`), two implementations.

``memory.MemoryStore`` is the embedded default for single-process runs and the simulator;
``redis_store.RedisStore`` is production (Lua scripts make every check-and-debit atomic). Both
pass the same contract suite (tests/store/).
"""
