"""One job, many ranks, by layer: :mod:`gradscope._model.job` (the job, its files; data model),
:mod:`gradscope.jobs.analysis` (what its views show, its diagnosis; analyses), and its views
(:mod:`gradscope.jobs.text`, :mod:`gradscope.jobs.payload`, :mod:`gradscope.jobs.page`), which the
job finds through the view registry (NOTE [ one registry of views ] in ``gradscope._base.registry``). :mod:`gradscope.job` gathers the public names in one place.

This package's own module imports nothing, so that the data model can be loaded without the layers
above it.
"""
