"""The predictor (``predictor``: ``predict``, ``Prediction``) and its parts, behind their face
:mod:`gradscope.predict`: a model of the CUDA caching allocator (``allocator``), the kernels a device
would choose (``kernels``), a step run on meta as on the device (``on_meta``) and the step's objects
copied to meta (``copies``)."""
