"""Internals of :mod:`gradscope.snapshot`: the safe unpickler and the trace replay.

Nothing here is API; :mod:`gradscope.snapshot` is.
"""
