"""The memory sources behind :mod:`gradscope.memory` (its public face), one module each.

- :mod:`~gradscope._capture.memory.source`: the protocol every source implements and the rows they hand over.
- :mod:`~gradscope._capture.memory.profiler`: ``cpu``, the profiler's allocation events.
- :mod:`~gradscope._capture.memory.tracker`: ``tracker``, the dispatch mode that follows storages (budgets).
- :mod:`~gradscope._capture.memory.cuda`: ``cuda``, the caching allocator's statistics and history; NVML.
- :mod:`~gradscope._capture.memory.counter`: the allocator's counter a long loop continues with.
- :mod:`~gradscope._capture.memory.make`: a kind's source, made.

What each kind of source can do, :class:`MemoryKind`, is in the base layer
(:mod:`gradscope._base.memory_kind`): the raw trace records which kind measured it, and the passes ask it.
"""
