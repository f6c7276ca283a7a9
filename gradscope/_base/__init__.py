"""The base layer: what every other layer may import, and which imports no other gradscope layer.

Sizes read and written (``units``), the errors (``error``, ``errors``), what a memory source can do
(``memory_kind``), the view registry (``registry``), every private PyTorch touchpoint (``compat``),
the raw trace (``trace``), the user's frames and source (``frames``, ``source``), downsampled series
(``series``), the page skeleton (``page``), stderr and garbage-collection helpers (``stderr``,
``gc``). See "Layers" in docs/internals.md.
"""
