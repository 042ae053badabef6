"""The build: the interpreter of the core's programs.

``_build`` runs one ``make_graphed_callables`` call: the warmup program (``_warmup``) and the
capture program (``_captures``) the core planned, step by step through ``_exec``; ``_state``
keeps each pass's record while it is built, ``_reuse`` executes the core's buffer plan.

Imports only downward: replay, request, runtime, core, support.
"""
