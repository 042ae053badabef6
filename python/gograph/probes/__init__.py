"""Probes of a build: hooks that watch a build run and read what it allocated.

``_probe`` traces the caching allocator over a build (the pool seed, the planners' facts),
``_recarve`` records the captures for debug replays, ``_static_bytes`` measures what each
capture keeps. A probe is a build hook (:class:`gograph.build._exec.Hooks`): it may import the
build and everything below it; the build never imports a probe.

Imports only downward: build, replay, request, runtime, core, support.
"""
