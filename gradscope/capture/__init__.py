"""The recorder's parts: :class:`gradscope.record.record` is a small facade over them.

- ``patches``: the process-wide engine patches shared by every thread's block, the active block;
- ``state``: the hooks' state (one definition with the compiled hooks) and the parts' base;
- ``saves``: the saved-tensor hooks (pack, unpack, frees, other pairs);
- ``modules``: module and optimizer tracking (the global module hooks);
- ``engine``: the engine's entry point intercepted, a backward pass's start and end;
- ``discover``: graph discovery (the walk, saves named, nodes hooked, learnt tables);
- ``held``: the graphs the program still holds at the block's end.
"""
