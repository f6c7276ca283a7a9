"""The analyses layer: what is computed from recordings, traces and snapshots, one package or module
each: ``diagnose`` (why a block ran out of memory, and measured fixes), ``predict`` (a step's memory on
a device, before it runs there), ``compare`` (strategies side by side), ``snapshot`` (CUDA memory
snapshots read offline), ``jobs`` (a job's ranks side by side), ``strategies`` (ways to compute the
same derivatives), ``graph`` (an autograd graph as it stands) and ``distributed`` (a job's recordings
gathered). It imports the layers below it (capture, passes, data model, base), never a view: a result
finds its views through the registry. See "Layers" in docs/internals.md.
"""
