"""The views layer: how each result is shown, registered by its type in the view registry (NOTE [ one
registry of views ] in gradscope._base.registry): text (``recording_text``, ``diagnosis_text``,
``snapshot_text``, ``job_text``), the graph's layout (``layout``, ``layered``, ``simplex``), widget
payloads (``payloads``, ``snapshot_payload``, ``job_payload``), widgets (``widget``), pages (``html``,
``job_page``); ``shown`` imports them all. It imports the analyses and the layers below them. See
"Layers" in docs/internals.md.
"""
