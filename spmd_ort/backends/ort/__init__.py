"""The ONNX Runtime backend: partition -> export -> sessions -> first-run check -> execute.

``coverage`` and ``translations`` (what translates to ONNX, one table), ``partition``
(the operator-support predicate and the grouping into segments), ``export`` (a segment
to ONNX, and the on-disk cache), ``session`` (an ORT session with IO binding standing
in for a segment), ``sizes`` (dynamic-shape segments), ``verify`` (the first run
compared with the fx graph), ``choice`` (which executor runs each segment) and
``executor`` (the :class:`OrtExecutor` that ties them together).  Importing it imports
onnxruntime.
"""
