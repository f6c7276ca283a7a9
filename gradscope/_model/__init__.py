"""The data model layer: a :class:`~gradscope._model.recording.Recording` and what its numbers mean,
behind the faces :mod:`gradscope.recording` and :mod:`gradscope.figures`.

- ``recording``: the Recording, its rows' types, ``load``; its parts: the rows of a recording's tables
  (``rows``), the table that holds them as columns (``table``) and the recording's file (``files``);
- ``figures``: one definition per figure; ``held_at_peak``: what held memory at the peak or the failure;
- ``names``: a node's and a module's names; ``lines``: source lines; ``growth``: what grows across a loop's
  iterations; ``job``: a job of many ranks and its files.

It imports only the base layer. See "Layers" in docs/internals.md.
"""
