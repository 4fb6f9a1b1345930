"""Drop-in layers for engines written against another scheduler's API (docs/atom.md).

* :mod:`atom_sched.compat.atom`: AMD ATOM's ``Scheduler``, ``ScheduledBatch``,
  ``ScheduledBatchOutput``, ``SpecStats`` and ``CacheStats``, backed by the C++ core.
"""
