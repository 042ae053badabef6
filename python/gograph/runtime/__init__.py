"""The engines and what they run.

``engines`` holds :class:`CudaEngine` (captures through the core's CUDA driver calls) and
:class:`EagerEngine` (the CPU reference: replays re-run the callable); ``_bodies`` the capture
bodies, ``_rng`` the RNG companion graphs, ``_capture_state`` the framework state an eager
replay restores, ``_dry_run`` the eager engine's check of what a CUDA capture cannot contain,
``_pool`` and ``_poolmodel`` the pool tokens and the CPU model of CUDA's graph pools,
``_isolation`` static outputs kept out of memory other graphs write, ``_grad_slots`` the
grad-slot policy's execution, ``_observe`` what a build observed.

Imports only downward: core, support.
"""
