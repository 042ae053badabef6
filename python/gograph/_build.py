"""The build: executes one ``make_graphed_callables`` plan, phase by phase.

1. passes: one core record per graphed pass;
2. warmup: the core's warmup program (:mod:`gograph._warmup`) on the engine's side stream, or,
   for a ``chain_buffers`` build that makes the whole training step (a probe forward of the last
   callable finds its loss), the step's order inside the build's own graph pool;
3. planning: what warmup learned goes to the core, which returns the capture program -- every
   capture in replay order, every release point, where each static buffer comes from and how each
   parameter grad reaches ``.grad``;
4. captures: the program's ops (:mod:`gograph._captures`);
5. seal: the passes become replayable (and guarded, in debug mode);
6. assemble: one :class:`gograph.graphed.GraphedCallable` per pass.

A failure anywhere rolls back in one place (:meth:`Build.rollback`): every pass created is
dropped (its graphs destroyed, its pool references released, as the core counts them), the
generator state restored, and the error raised again naming the callable and the phase.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from . import _args, _core, _observe, _plan, _probe, _recarve, _reuse, _torch
from ._args import PassSpec, Request
from ._captures import apply_separated, apply_slots, run_captures
from ._shared_inputs import SharedInput, shared_inputs
from ._state import PassState
from ._warmup import WarmupObserver, decide_wgrad_without_warmup, module_buffers_restored, run_warmup, warm_forward
from .engines import CudaEngine, Engine, resolve_engine
from .graphed import GraphedCallable, PassResult, Shared, lent_grads

__all__ = ["Build", "prepared"]

log = logging.getLogger("gograph")


@contextlib.contextmanager
def prepared(req: Request) -> Iterator[Build]:
    """The executor of ``req``: the schedule the core plans for it (held by handle, freed on
    exit), one spec per pass, the engine its tensors resolve to (checked against the request).
    ``make_graphed_callables`` runs it; ``plan_memory`` probes it."""
    schedule = _plan.plan_schedule(
        req.order,
        req.layers,
        len(req.callables),
        len(req.sample_args),
        _args.schedule_training(req),
        req.num_warmup_iters,
    )
    try:
        specs = _args.pass_specs(req, schedule)
        engine = resolve_engine(req.engine, [t for s in specs for t in (*s.flat_args, *s.params)])
        _args.check_for_engine(req, specs, engine)
        yield Build(req, schedule, specs, engine)
    finally:
        schedule.free()


class Build:
    """One build's executor. ``run()`` returns the graphed callables, one per pass."""

    def __init__(self, req: Request, schedule: _plan.Schedule, specs: Sequence[PassSpec], engine: Engine) -> None:
        self.req, self.schedule, self.specs, self.engine = req, schedule, specs, engine
        self.pool: Hashable = req.pool if req.pool is not None else engine.new_pool()
        self.device: torch.device | None = engine.device if isinstance(engine, CudaEngine) else None
        self.states: list[PassState] = []
        self.phase = "setup"
        self.current: PassState | PassSpec | None = None
        self.reuse: _reuse.BufferReuse | None = None
        self.stats: _observe.BuildStats | None = None
        self.warm_pool: Hashable | None = None  # the pool warmup (or the seed) allocated in, while referenced
        self.trace: str | None = None  # what warmup allocated, as the core's trace (CUDA, own pool)
        self.seed = 0  # bytes carved in the pool before the first capture (the core's choice)

    def run(self) -> list[GraphedCallable]:
        rng = self.engine.get_rng_state()
        debug = _observe.debug_env() if self.req.debug_replay_order is None else self.req.debug_replay_order
        self.stats = _observe.BuildStats.begin(
            self.engine,
            expected_captures=self._expected_captures(),
            progress=self.req.progress,
            debug_replay_order=debug,
        )
        try:
            self._create_passes()
            self._warmup()
            program, slots = self._plan_captures()
            self._carve_seed()
            with _recarve.recording(self.engine, debug) as recorder:
                run_captures(self, program, slots, recorder)
            self._end_warmup_in_pool()  # the captures hold the pool now
            self._seal(debug)
            if recorder is not None:  # debug on CUDA: replays checked against what each graph touches
                _recarve.send(_recarve.specs(recorder, program.ops, self.states))
        except BaseException as e:
            self.rollback(rng)
            wrapped = self._with_context(e) if isinstance(e, Exception) else None
            if wrapped is not None:
                raise wrapped from e
            raise
        self.engine.set_rng_state(rng)
        self.stats.close()
        return self._assemble(program, debug)

    def _expected_captures(self) -> int:
        return sum(1 + int(s.grad_enabled) for s in self.specs) + len(self.schedule.wgrad_passes)

    def _create_passes(self) -> None:
        for spec in self.specs:
            self.current = spec  # names the callable in an error
            pass_id = self.engine.new_pass(spec.index, spec.label)
            self.states.append(PassState(spec, pass_id))

    def _warmup(self, observer: WarmupObserver | None = None) -> None:
        self.phase, self.current = "warmup", None  # a hook's or the engine's error is not a callable's
        req = self.req
        hooks = req.hooks.hooks is not None
        assert self.stats is not None
        self.stats.warmup_started()
        with self.engine.warmup_context():
            if req.pre_warmup_hook is not None:
                req.pre_warmup_hook()
            # plan_memory (an observer) models torch's per-callable warmup: no probe there.
            whole = observer is None and self._post_hook_on_error(self._whole_step, hooks)
            self.current = None  # the probe's callable is done
        program = _plan.warmup_program(self.schedule, req.num_warmup_iters, hooks, whole, req.pool is None)
        pool = self.pool if program.in_pool else None
        if pool is not None:
            self.engine.release_cached()  # what the probe cached must not stay beside the pool
        with self.engine.warmup_context(pool):
            self.warm_pool = pool  # one pool reference, returned once the captures hold theirs
            with self._allocation_trace(observer is None and pool is None, program.ops) as trace:
                self._post_hook_on_error(run_warmup, self, program.ops, observer or trace)
            if req.post_warmup_hook is not None:
                self.current = None  # a hook's error is not a callable's
                req.post_warmup_hook()
        self.engine.synchronize()
        for st in self.states:  # warmup is over: what it kept alive goes
            st.warm_outputs = st.warm_grads = None
        decide_wgrad_without_warmup(self.states, req.callables)
        self.stats.warmup_finished()

    def _post_hook_on_error(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; if it raises, ``post_warmup_hook`` runs first (TransformerEngine runs it
        even when warmup fails), its own error logged so the original one is raised."""
        try:
            return fn(*args)
        except BaseException:
            if self.req.post_warmup_hook is not None:
                try:
                    self.req.post_warmup_hook()
                except Exception as hook_error:
                    log.warning("post_warmup_hook after a failed warmup: %s", str(hook_error))
            raise

    def _whole_step(self, hooks: bool) -> bool:
        """Whether the callables make the whole training step: the last pass of the default
        schedule returns only 0-dim outputs, one of them requiring grad (the loss). Found out by
        one forward of that callable before warmup (a probe: its module buffers are restored
        after it and what it allocated goes back before warmup starts), only in gograph's memory
        mode (``chain_buffers``: torch's drop-in call keeps torch's warmup exactly) and where the
        core says the answer would change its warmup plan."""
        req = self.req
        st = self.states[-1]
        if not req.chain or req.num_warmup_iters < 1 or not st.spec.grad_enabled:
            return False
        if not _plan.warmup_program(self.schedule, 0, hooks, True, req.pool is None).in_pool:
            return False  # a pool passed in, capture-time hooks, an _order: the plan stays
        self.current = st
        func = req.callables[st.spec.callable_index]
        with module_buffers_restored([func]):
            warm_forward(st, func, req.hooks, self.device)
        outputs, st.warm_outputs = st.warm_outputs or (), None
        return bool(outputs) and all(o.dim() == 0 for o in outputs) and any(o.requires_grad for o in outputs)

    @contextlib.contextmanager
    def _allocation_trace(self, wanted: bool, ops: Sequence[_plan.Op]) -> Iterator[_probe.AllocationTrace | None]:
        """Records what a warmup outside the pool allocates, as the core's trace (``self.trace``),
        on the CUDA engine with the build's own pool, unless the process records allocator
        history already (its buffer and settings are the caller's) or every sample and parameter
        is a small-pool request (``_probe.seed_may_matter``): the ops up to the last first one
        (the captures replay what each op allocated the first time)."""
        device = self.device
        if (
            not wanted
            or device is None
            or self.req.pool is not None
            or _torch.allocator_history_enabled()
            or not _probe.seed_may_matter(self.states)
        ):
            yield None
            return
        with _probe.CountedTrace(device, ops) as rec:
            yield rec
        if rec.complete:
            self.trace = rec.text(ops[: rec.until])
        else:
            log.debug("a free deferred past a warmup op; planning without the pool seed")

    def _carve_seed(self) -> None:
        """The seed segment the core chose goes into the build's own pool before the captures
        (its reference is returned with the warmup's, once the captures hold theirs)."""
        if self.seed > 0 and self.warm_pool is None and self.req.pool is None:
            self.phase, self.current = "seed", None
            if self.engine.carve_seed(self.pool, self.seed):
                self.warm_pool = self.pool

    def _end_warmup_in_pool(self) -> None:
        pool, self.warm_pool = self.warm_pool, None
        if pool is not None:
            self.engine.end_warmup_in_pool(pool)

    def _plan_captures(self) -> tuple[_plan.CaptureProgram, dict[int, Any]]:
        """What warmup learned goes to the core; the capture program comes back."""
        self.phase, self.current = "buffer planning", None
        req, sigs = self.req, _reuse.Signatures()
        release = isinstance(self.engine, CudaEngine)
        facts = _reuse.facts_text(self.states, sigs, req.clone_param_grads)
        program = _plan.capture_program(self.schedule, facts, reuse=req.reuse, chain=req.chain, release=release)
        if self.trace is not None:  # the core models the captures over what warmup allocated
            prediction = _core.plan_memory(self.schedule.handle, facts, req.reuse, req.chain, release, self.trace)
            self.seed = _plan.prediction_seed(str(prediction))
        if req.reuse or req.chain:
            self.reuse = _reuse.BufferReuse.of(program, sigs)
            if not release:
                self.reuse.released = 0
        apply_separated(self.states, program)
        return program, apply_slots(self.states, program)

    def _seal(self, debug: bool) -> None:
        self.phase = "seal"
        for st in self.states:
            self.current = st
            self.engine.seal(st.pass_id)
        self.engine.synchronize()  # captures complete before the first replay
        if debug:
            for st in self.states:
                _core.set_replay_order_check(st.pass_id, True)

    def rollback(self, rng: Any) -> None:
        """Every pass created so far is dropped and the generator state restored."""
        if self.stats is not None:
            self.stats.close(failed=True)
        for st in self.states:
            try:
                self.engine.drop(st.pass_id, self.pool)
            except Exception as cleanup_error:  # keep the original error
                log.warning("releasing pass %d after a failed build: %s", st.pass_id, str(cleanup_error))
        try:
            self._end_warmup_in_pool()
        except Exception as pool_error:
            log.warning("releasing the pool warmup allocated in after a failed build: %s", str(pool_error))
        try:
            self.engine.set_rng_state(rng)
        except Exception as rng_error:
            log.warning("restoring the generator state after a failed build: %s", str(rng_error))

    def _with_context(self, e: Exception) -> Exception | None:
        """An exception of ``e``'s type whose message names the callable and the phase, or None
        when that type cannot be built from a message (then the context is added as a note)."""
        cur = self.current
        if cur is None:
            return None
        spec = cur if isinstance(cur, PassSpec) else cur.spec
        msg = f"gograph.make_graphed_callables: callable {spec.index} ({spec.label}) failed during {self.phase}: {e}"
        if isinstance(self.engine, CudaEngine) and self.phase.endswith("capture"):
            msg += (
                " [during CUDA graph capture, work that synchronizes with the host -- stream or device "
                "synchronize(), .item(), .cpu(), printing tensors -- or allocates outside the capture "
                "stream is not allowed]"
            )
        try:
            new = type(e)(msg)
        except Exception:
            new = None
        if new is not None and type(new) is type(e):
            return new
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(msg)
        else:  # Python 3.10: the same attribute, which tracebacks there do not print
            e.__notes__ = [*getattr(e, "__notes__", []), msg]  # type: ignore[attr-defined]
            log.error("%s", msg)
        return None

    def _assemble(self, program: _plan.CaptureProgram, debug: bool) -> list[GraphedCallable]:
        shared = Shared(
            engine=self.engine,
            pool=self.pool,
            build_stats=self.stats,
            check_replay_order=debug,
            retain_graph_in_backward=self.req.retain_graph,
            buffer_reuse=self.reuse,
            lent=lent_grads(self.engine.pool_key(self.pool)),
            lend_param_grads=self.req.lend_param_grads,
        )
        guards = shared_inputs(
            [st.flat_args for st in self.states],
            [st.pass_id for st in self.states],
            [f"graphed callable {st.index} ({st.spec.label})" for st in self.states],
            [_plain_copies(st) for st in self.states],
        )
        out = []
        for st, shared_leaves in zip(self.states, guards):
            out.append(GraphedCallable(st.spec, _result(st, program, shared_leaves), st.pass_id, shared))
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "graphed callable %d (%s) as pass %d on the %s engine (backward graph: %s)",
                    st.index,
                    st.spec.label,
                    st.pass_id,
                    self.engine.name,
                    st.has_backward,
                )
        return out


def _plain_copies(st: PassState) -> frozenset[int]:
    """The leaves the shared-input guard leaves alone: chained ones (never copied into) and those
    the forward writes in place (a replay changes their buffer without a version bump), every
    leaf when no forward ran to tell (a pass without warmup learns it at its capture)."""
    if not (st.warmed or st.inputs_seen):
        return frozenset(range(len(st.flat_args)))
    return frozenset(st.chained_inputs) | st.mutated_inputs


def _result(st: PassState, program: _plan.CaptureProgram, shared_leaves: dict[int, SharedInput]) -> PassResult:
    n = len(st.flat_args)
    policy: dict[int, str] = {}
    if st.has_backward:
        entries = [
            (n + k)
            for k, p in enumerate(st.params)
            if p.requires_grad and not getattr(p, "skip_backward_post_hook", False)
        ]
        for e, idx in enumerate(entries):
            pol = program.grad_policy.get((st.index, e))
            if pol is not None:
                policy[idx] = pol
    grad_outputs = st.static_grad_outputs or (None,) * len(st.static_outputs)
    grad_inputs = st.static_grad_inputs or (None,) * len(st.surface)
    assert st.output_spec is not None
    return PassResult(
        static_inputs=st.flat_args,
        params=st.params,
        static_outputs=st.static_outputs,
        output_requires_grad=st.output_requires_grad,
        output_spec=st.output_spec,
        static_grad_outputs=grad_outputs,
        static_grad_inputs=grad_inputs,
        has_backward=st.has_backward,
        wgrad=st.wgrad_body,
        chained_inputs=frozenset(st.chained_inputs),
        chained_grad_outputs=frozenset(st.chained_grad_outputs),
        separated_inputs=frozenset(st.separated_inputs),
        released_outputs=frozenset(i for r, i in st.released if r == "o"),
        released_grad_inputs=frozenset(i for r, i in st.released if r != "o"),
        grad_policy=policy,
        seq=(st.seq[0], st.seq[1], st.seq[2]),
        shared_inputs=shared_leaves,
        shared_grad_outputs=frozenset(
            k for (q, k), src in program.grad_outputs.items() if q == st.index and src.kind == _plan.SLOT
        ),
    )
