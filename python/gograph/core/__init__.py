"""The bridge to the Go core.

``_native`` loads the core's flavor (CUDA or CPU), ``_core`` is its typed facade (stub:
``_core.pyi``), ``_wire`` the records the core's programs and plans are read into, ``_kinds``
the vocabularies both sides share, ``_plan`` the schedule planner's facade.

Imports only downward: support.
"""
