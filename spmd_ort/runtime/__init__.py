"""Runtime: what runs a compiled variant step after step.

``program`` (a compiled variant: gather inputs, run, write state back), ``executor``
(the protocol every backend implements and the table of backends), ``fx_executor``
(PyTorch op by op), ``context`` (the :class:`StepRuntime` host ops read while a graph
runs), the ``spmd_ort::`` ops (``ops``) and their bodies (``collectives``, ``kernels``,
``opaque``, ``native``), activation ``taps`` (debug subscribers' statistics, per step),
and ``memory`` accounting.  The ONNX Runtime backend is
:mod:`spmd_ort.backends.ort`.
"""
