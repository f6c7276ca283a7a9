"""The notebook layer: the IPython extension (``ipython``: ``%load_ext gradscope``, ``%%gradscope``,
``%gradscope oom``) and the command line (``cli``: ``python -m gradscope demo|setup``), over every
layer below. See "Layers" in docs/internals.md.
"""
