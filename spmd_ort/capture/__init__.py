"""Capture: the user's train step as one stateless FX graph.

The call's inputs checked and named (``inputs``), the state lifted into graph inputs
(``state``, ``optim``, ``amp``), the trace itself (``trace``, with ``opaque`` for parts
that run eagerly and ``diagnose`` for why a trace failed), which sizes are symbolic
(``dynamic``, ``shapes``), whether a call can reuse a compiled variant (``transition``)
and what is prepared on the module before a trace and undone if it fails (``prepare``).
"""
