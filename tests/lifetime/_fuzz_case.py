"""One lifetime-fuzz case end to end: make the callables and their eager twins, graph them (or
check that the API refuses the configuration with its documented error), run the program in both
worlds, and collect every oracle's findings.

:func:`run_case` returns the violations (an empty list: the case passed).
"""

from __future__ import annotations

import copy
import gc
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from _fuzz_config import Case, inference_build
from _fuzz_engine import ScribblingEagerEngine
from _fuzz_live import SETTLE_TRIES, TRACKER, InjectedFault, settle
from _fuzz_models import DELAYED_KINDS, FEATURES, GRAD_WRITING_KINDS, make_callable, make_layer
from _fuzz_oracles import leaves
from _fuzz_pipeline import PipelineProgram, pipeline_order
from _fuzz_program import Data, DefaultProgram, Plan
from _fuzz_refusals import expected_refusals
from _fuzz_world import World

import gograph
from gograph.engines import EagerEngine

__all__ = ["run_case"]


def _rng_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The generator states a build must restore (the CPU's, and the device's on CUDA)."""
    if device.type == "cuda":
        return (torch.get_rng_state(), torch.cuda.get_rng_state(device))
    return (torch.get_rng_state(),)


def _reserved(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    settle()  # autograd's device thread may still hold a block's last tensor
    # cuBLAS keeps a workspace per (handle, stream), 64 MiB on an H100, until cleared: a case with
    # an engine of its own (a side stream of its own) makes one that is torch's cache, not a leak
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


def _segments(device: torch.device) -> dict[int, dict[str, Any]]:
    """The caching allocator's segments by address (CUDA; none elsewhere)."""
    if device.type != "cuda":
        return {}
    return {int(seg["address"]): seg for seg in torch.cuda.memory_snapshot()}


def _new_segments(device: torch.device, before: set[int]) -> str:
    """The segments reserved since ``before`` and what keeps each (a diagnosis for the liveness
    message): pool, stream, the blocks still allocated in it."""
    parts = []
    for address, seg in _segments(device).items():
        if address in before:
            continue
        held = [b for b in seg["blocks"] if b["state"] != "inactive"]
        blocks = ", ".join(f"{b['size']} B {b['state']} at {int(b['address']):#x}" for b in held[:6])
        parts.append(
            f"{seg['total_size']} B at {address:#x} ({seg['segment_type']}, pool {seg.get('segment_pool_id')}, "
            f"stream {int(seg['stream']):#x}; {len(held)} block(s) held: {blocks})"
        )
    return "; new segments: " + "; ".join(parts) if parts else ""


@dataclass(eq=False)
class _Run:
    """The parts of a case both schedules share; subclasses make the callables, samples and
    program."""

    case: Case
    device: torch.device
    violations: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # what the case exercised (hypothesis statistics)
    pool_model: bool = False  # the eager engine models CUDA's graph pools (gograph.runtime._poolmodel)
    # static outputs kept out of memory other graphs write: CudaEngine(isolate_outputs=True) on
    # CUDA, modelled with the pool model on the CPU
    isolate: bool = False
    segments_before: set[int] = field(default_factory=set)  # CUDA: the allocator's segments before the build

    def __post_init__(self) -> None:
        self.data = Data(self.case.seed, self.device)
        self.engine: EagerEngine | gograph.CudaEngine | None = None
        if self.device.type == "cpu" and self.case.clone_param_grads:
            self.engine = ScribblingEagerEngine(pool_model=self.pool_model, isolate_outputs=self.isolate)
        elif self.device.type == "cpu" and self.pool_model:
            self.engine = EagerEngine(pool_model=True, isolate_outputs=self.isolate)
        elif self.device.type == "cuda" and self.isolate:
            self.engine = gograph.CudaEngine(self.device, isolate_outputs=True)

    # -- what subclasses provide ------------------------------------------------------------
    def make(self) -> None:
        raise NotImplementedError

    def build_args(self) -> tuple[Any, Any, dict[str, Any]]:
        raise NotImplementedError

    def graphed_list(self, result: Any) -> list[Any]:
        raise NotImplementedError

    def program(self, world: World, result: Any) -> Callable[[], None]:
        raise NotImplementedError

    def worlds(self, result: Any, graphed: list[Any]) -> tuple[World, World]:
        raise NotImplementedError

    # -- the case ---------------------------------------------------------------------------
    def callable_of_pass(self, index: int) -> int:
        """The callable a pass runs (errors name passes)."""
        return index

    def grad_slots(self, kinds: list[str]) -> dict[str, Any]:
        """The worlds' arguments for the ``weight.grad`` that ``backward_dw()`` writes: the
        modules that write it, the state the program puts it in."""
        return {
            "grad_state": self.case.grad_state,
            "dw_modules": frozenset(k for k, kind in enumerate(kinds) if kind in GRAD_WRITING_KINDS),
        }

    def options(self) -> dict[str, Any]:
        c = self.case
        hooks = None
        if c.hooks:
            hooks = [{"forward_pre_hooks": {"liveness": _pre_hook(i)}} for i in range(len(self.callables))]
        return {
            "num_warmup_iters": c.num_warmup_iters,
            "allow_unused_input": c.allow_unused_input,
            "engine": self.engine,
            "chain_buffers": c.chain_buffers,
            "_reuse_graph_input_output_buffers": c.reuse,
            "clone_param_grads_on_return": c.clone_param_grads,
            "debug_replay_order": c.debug_replay_order,
            "capture_time_hooks": hooks,
            **({"share_microbatch_graphs": True} if c.share else {}),
        }

    def run(self) -> list[str]:
        self.make()
        reserved = _reserved(self.device)
        self.segments_before = set(_segments(self.device))
        before = (gograph.live_passes(), _rng_state(self.device))
        TRACKER.start(cuda=self.device.type == "cuda", fault=self.case.fault)
        result, failure = self._build()
        if failure is not None:  # checked once the error and its traceback are gone
            self._check_failure(*failure, before, reserved)
            return self.violations
        self._run_built(result)
        self.events.append("built")
        del result
        self._check_reserved(reserved)
        return self.violations

    def _build(self) -> tuple[Any, tuple[str, str, bool] | None]:
        """The graphed callables, or (what failed, the error's message, whether it is chained to
        the injected fault) for an injected fault or a documented refusal."""
        must, may = expected_refusals(self.case, self.device.type)
        try:
            with torch.no_grad() if self.case.no_grad_build else torch.enable_grad():
                callables, samples, options = self.build_args()
                result = gograph.make_graphed_callables(callables, samples, **options)
        except InjectedFault as e:
            return None, ("injected fault", str(e), isinstance(e.__cause__, InjectedFault))
        except Exception as e:
            if not any(r.matches(e) for r in (*must, *may)):
                raise
            return None, (f"refused: {type(e).__name__}", str(e), False)
        finally:
            callables = samples = options = None  # the build's samples are its static inputs now
        if must:
            self.violations.append(
                f"refusal: the build succeeded, expected {must[0].error.__name__}: {must[0].pattern}"
            )
        return result, None

    def _run_built(self, result: Any) -> None:
        TRACKER.check_all_dead("the return of make_graphed_callables", phase="build")
        for k, m in enumerate(self.modules):
            if getattr(m, "stash", None):  # what its backwards kept for backward_dw()
                self.violations.append(
                    f"values: the build left {len(m.stash)} (input, grad) pair(s) of delayed layer {k} that no "
                    "weight-gradient graph consumed: its weight gets no grad from the graphed backward_dw()"
                )
        graphed = self.graphed_list(result)
        if isinstance(self.engine, ScribblingEagerEngine):
            self.engine.watch(graphed)
        eager, world = self.worlds(result, graphed)
        TRACKER.phase = None  # the eager reference is not watched
        self._seeded(self.program(eager, result))
        TRACKER.phase = "run"
        self._seeded(self.program(world, result))
        self._note(graphed)
        self.events += world.events
        world.finish()
        mismatch = eager.trace.mismatch(world.trace)
        self.violations += [f"eager run (oracle self-check): {v}" for v in eager.violations]
        self.violations += world.violations + TRACKER.violations
        if mismatch is not None:
            self.violations.append(mismatch)

    def _note(self, graphed: list[Any]) -> None:
        kinds = {layer.kind for layer in self.case.layers} & set(GRAD_WRITING_KINDS)
        for kind in sorted(kinds):
            self.events.append(f"backward_dw() writes weight.grad ({kind}), grad state {self.case.grad_state}")
        if any(g.lent_param_grads for g in graphed):
            self.events.append("lent parameter grads")
        if any(g.chained_inputs for g in graphed):
            self.events.append("chained inputs")
        if any(g.shared_grad_outputs for g in graphed):
            self.events.append("shared grad-output buffers")
        if any(g.released_outputs or g.released_grad_inputs for g in graphed):
            self.events.append("pool-planned hand-outs")
        if isinstance(self.engine, ScribblingEagerEngine) and self.engine.scribbled:
            self.events.append("pool overwrites emulated")
        if self.pool_model:
            self.events.append("graph pools modelled")

    def _check_failure(self, what: str, message: str, chained: bool, before: tuple[int, Any], reserved: int) -> None:
        """The build raised (an injected fault: the error, of its type and chained to it, names
        the callable and the phase; or a documented refusal) and left the process as it was:
        nothing it made alive, no pass record, the generator state and the modules' forward as
        before."""
        self.events.append(what)
        if what == "injected fault":
            i = self.case.fault[0] if self.case.fault is not None else -1
            named = re.search(r"callable (\d+) \(.*\) failed during (warmup|[\w-]+ capture)", message)
            if named is None or self.callable_of_pass(int(named.group(1))) != i or not chained:
                self.violations.append(f"fault: the build's error does not name callable {i} and its phase: {message}")
        TRACKER.check_all_dead(f"the return of a failed build ({what})")
        self.violations += TRACKER.violations
        if gograph.live_passes() > before[0]:
            gc.collect()
        if gograph.live_passes() > before[0]:
            self.violations.append(f"rollback: {gograph.live_passes() - before[0]} pass record(s) alive after {what}")
        if not all(torch.equal(a, b) for a, b in zip(_rng_state(self.device), before[1])):
            self.violations.append(f"rollback: the generator state changed ({what})")
        for k, m in enumerate(self.modules):
            if m is not None and "forward" in m.__dict__:
                self.violations.append(f"rollback: module {k}'s forward is replaced after {what}")
        self._check_reserved(reserved)

    def _seeded(self, fn: Callable[[], None]) -> None:
        torch.manual_seed(self.case.seed + 1)  # dropout: both worlds draw the same random stream
        fn()

    def _check_reserved(self, before: int) -> None:
        if self.device.type != "cuda":
            return
        for m in (*self.modules, *self.twins):
            if m is not None:
                m.zero_grad(set_to_none=True)
        self.data.cache.clear()
        after = _reserved(self.device)
        for _ in range(SETTLE_TRIES):
            if after <= before:
                return
            after = _reserved(self.device)
        if after > before:
            self.violations.append(
                f"liveness: reserved memory {after} B after every callable was reset, {before} B before the build"
                f"{_new_segments(self.device, self.segments_before)}"
            )


def _pre_hook(i: int) -> Callable[[Any], None]:
    def forward_pre_hook(module: Any) -> None:
        TRACKER.check_build(f"the capture-time forward_pre_hook of callable {i}")

    return forward_pre_hook


@dataclass(eq=False)
class _DefaultRun(_Run):
    def make(self) -> None:
        c = self.case
        self.callables = [
            _to(make_callable(layer.kind, i, 1000 * c.seed + i, layer.mode), self.device)
            for i, layer in enumerate(c.layers)
        ]
        self.modules = [m if isinstance(m, torch.nn.Module) else None for m in self.callables]
        self.twins = [copy.deepcopy(m) for m in self.modules]
        self.sample_grad = self._dry_run()

    def _dry_run(self) -> list[tuple[bool, ...]]:
        """The ``requires_grad`` of each callable's positional inputs in the program, from one
        eager forward of the twins (in the build's grad mode)."""
        flags: list[tuple[bool, ...]] = []
        prev: list[torch.Tensor] | None = None
        with torch.no_grad() if self.case.no_grad_build else torch.enable_grad():
            for i, layer in enumerate(self.case.layers):
                first = prev[0].requires_grad if layer.from_prev and prev else layer.input_grad
                flags.append((first, True) if layer.kind == "unused" else (first,))
                args = tuple(self.data.leaf(f, "dry", i, k) for k, f in enumerate(flags[-1]))
                kwargs = self._kwargs("dry", i) if layer.kind == "kwargs" else {}
                fn = self.twins[i] if self.twins[i] is not None else self.callables[i]
                prev = leaves(fn(*args, **kwargs))
        return flags

    def _kwargs(self, tag: str, i: int, scale: torch.Tensor | None = None) -> dict[str, Any]:
        """A kwargs callable's ``scale`` (needs no grad: ``scale`` when given) and ``bias``
        (requires grad)."""
        return {
            "scale": scale if scale is not None else self.data.leaf(False, tag, "scale", i),
            "bias": self.data.leaf(True, tag, "bias", i, shape=(FEATURES,)),
        }

    def build_args(self) -> tuple[Any, Any, dict[str, Any]]:
        c = self.case
        samples = [
            tuple(self.data.leaf(f, "sample", i, k) for k, f in enumerate(flags))
            for i, flags in enumerate(self.sample_grad)
        ]
        if c.shared_samples:  # README's pattern: the later layers' samples are views of the first's
            for i, layer in enumerate(c.layers):
                if i > 0 and layer.from_prev and self.sample_grad[i][0]:
                    samples[i] = (samples[0][0].detach().requires_grad_(), *samples[i][1:])
        options = self.options()
        if any(layer.kind == "kwargs" for layer in c.layers):  # with shared samples, one scale for all (a mask)
            scale = self.data.leaf(False, "sample", "scale") if c.shared_samples else None
            options["sample_kwargs"] = tuple(
                self._kwargs("sample", i, scale) if layer.kind == "kwargs" else None for i, layer in enumerate(c.layers)
            )
        return tuple(self.callables), tuple(samples), options

    def graphed_list(self, result: Any) -> list[Any]:
        return [r.forward if isinstance(r, torch.nn.Module) else r for r in result]

    def worlds(self, result: Any, graphed: list[Any]) -> tuple[World, World]:
        fns = [t if t is not None else f for t, f in zip(self.twins, self.callables)]
        self.plan = Plan(self.case, self.data, self.sample_grad, [g.chained_inputs for g in graphed])
        self.plan.schedule()
        slots = self.grad_slots([layer.kind for layer in self.case.layers])
        eager = World(fns, self.twins, None, self.case.set_to_none, **slots)
        return eager, World(
            list(result), self.modules, graphed, self.case.set_to_none, self.case.debug_replay_order, **slots
        )

    def program(self, world: World, result: Any) -> Callable[[], None]:
        return DefaultProgram(world, self.plan, self.case.no_grad_build).run


@dataclass(eq=False)
class _PipelineRun(_Run):
    def make(self) -> None:
        c, p = self.case, self.case.pipeline
        assert p is not None
        self.kinds = [layer.kind for layer in c.layers]
        self.callables = [_to(make_layer(k, i, 1000 * c.seed + i), self.device) for i, k in enumerate(self.kinds)]
        self.modules = [m if isinstance(m, torch.nn.Module) else None for m in self.callables]
        if inference_build(c):  # TransformerEngine's inference rule: eval modules, every pass forward-only
            for m in self.modules:
                if m is not None:
                    m.eval()
        self.twins = [copy.deepcopy(m) for m in self.modules]
        prefix = [sum(p.layers[:ch]) for ch in range(len(p.layers))]
        self.callable_of = [
            prefix[ch] + li for ch, n in enumerate(p.layers) for _ in range(p.microbatches) for li in range(n)
        ]
        delayed = {
            ch for ch, n in enumerate(p.layers) for li in range(n) if self.kinds[prefix[ch] + li] in DELAYED_KINDS
        }
        self.order = pipeline_order(c, delayed)

    def callable_of_pass(self, index: int) -> int:
        return self.callable_of[index] if 0 <= index < len(self.callable_of) else -1

    def _input_grad(self, layer: int) -> bool:
        """requires_grad of the layer's input: the received activation of a chunk requires grad,
        the data does as drawn, a layer's input as its previous layer's output."""
        p = self.case.pipeline
        assert p is not None
        starts = {sum(p.layers[:ch]) for ch in range(len(p.layers))}
        if layer in starts:
            return layer > 0 or self.case.layers[0].input_grad
        return self._input_grad(layer - 1) or self.kinds[layer - 1] != "fn"

    def build_args(self) -> tuple[Any, Any, dict[str, Any]]:
        p = self.case.pipeline
        assert p is not None
        samples = tuple((self.data.leaf(self._input_grad(i), "sample", q),) for q, i in enumerate(self.callable_of))
        if inference_build(self.case) and self.case.shared_samples:  # one sample tensor for every pass
            samples = tuple((samples[0][0],) for _ in samples)
        options = self.options()
        options.update(_order=self.order, _num_layers_per_chunk=list(p.layers))
        if "kwblock" in self.kinds:  # with shared samples, one scale for every pass (a mask)
            scale = self.data.leaf(False, "sample-scale")
            options["sample_kwargs"] = tuple(
                {"scale": scale if self.case.shared_samples else self.data.leaf(False, "sample-scale", q)}
                if self.kinds[i] == "kwblock"
                else None
                for q, i in enumerate(self.callable_of)
            )
        return tuple(self.callables), samples, options

    def graphed_list(self, result: Any) -> list[Any]:
        return list(result)

    def worlds(self, result: Any, graphed: list[Any]) -> tuple[World, World]:
        fns = [t if t is not None else f for t, f in zip(self.twins, self.callables)]
        slots = self.grad_slots(self.kinds)
        eager = World([fns[i] for i in self.callable_of], self.twins, None, self.case.set_to_none, **slots)
        return eager, World(
            graphed, self.modules, graphed, self.case.set_to_none, self.case.debug_replay_order, **slots
        )

    def program(self, world: World, result: Any) -> Callable[[], None]:
        return PipelineProgram(world, self.case, self.order, self.data, self.kinds).run


def _to(c: Any, device: torch.device) -> Any:
    return c.to(device) if isinstance(c, torch.nn.Module) else c


def run_case(
    case: Case, device: torch.device, events: list[str] | None = None, pool_model: bool = False, isolate: bool = False
) -> list[str]:
    """Runs ``case`` on ``device`` (the eager engine on the CPU, modelling CUDA's graph pools with
    ``pool_model``); ``isolate`` keeps static outputs out of memory other graphs write
    (``CudaEngine(isolate_outputs=True)``, and its model with ``pool_model``). Returns what the
    oracles found, and appends to ``events`` what the case exercised."""
    passes = gograph.live_passes()
    kind = _DefaultRun if case.pipeline is None else _PipelineRun
    run: _Run = kind(case, device, pool_model=pool_model, isolate=isolate)
    try:
        violations = run.run()
    finally:
        TRACKER.stop()
    if events is not None:
        events += run.events
    del run
    if gograph.live_passes() > passes:
        gc.collect()  # a pass record goes when its graphed callable is collected
    if gograph.live_passes() > passes:
        violations.append(f"leak: {gograph.live_passes() - passes} pass record(s) alive after the case")
    return violations
