"""The capture layer: hooks, memory sources and the recorder, which runs the passes to make a
Recording. It imports the layers below it (passes, data model, base) and no analysis or view.

The recorder (``record``, the face :mod:`gradscope.record`) is a small facade over its parts,
listed below; beside them: the compiled hooks (``native``), the one graph walker (``walk``), the
memory sources (``memory``, the face :mod:`gradscope.memory`) and torch.compile regions (``compiled``).

Each block makes one :class:`~gradscope._capture.state.Block` (what the parts share: the trace,
the hooks' state, the options, the memory source, the handles to remove) and one object of each
part, made with the Block and the parts it calls (saves <- discover <- engine, held), each
keeping only its own state. Nothing kept after the block refers back to the recorder (NOTE [ no
cycles through the recorder ] in ``saves``).

- ``patches``: the process-wide engine patches shared by every thread's block, the active block;
- ``state``: the hooks' state (one definition with the compiled hooks) and the :class:`Block`;
- ``saves``: the saved-tensor hooks (pack, unpack, frees, other pairs);
- ``modules``: module and optimizer tracking (the global module hooks);
- ``engine``: the engine's entry point intercepted, a backward pass's start and end;
- ``discover``: graph discovery (the walk, saves named, nodes hooked, learnt tables);
- ``held_graphs``: the graphs the program still holds at the block's end;
- ``loop``: a loop's iterations, where its capture is cut into pieces and which pieces are kept
  (a piece is a Block and parts of its own, put in place of the last one's at a cut: see NOTE
  [ iterations ] in ``gradscope._passes.iterations``).
"""
