"""The build: one typed interpreter of the core's programs.

:meth:`Build.run` is a straight line of phases:

1. passes: one core record per graphed pass;
2. warmup: the core's warmup program on the engine's side stream, or, for a ``chain_buffers``
   build that makes the whole training step (a probe forward of the last callable finds its
   loss), the step's order inside the build's own graph pool;
3. planning: what warmup learned goes to the core, which returns the capture program -- every
   capture in replay order, every release point, where each static buffer comes from, how each
   parameter grad reaches ``.grad`` and which lent grads each graph may overwrite
   (``run(until=Phase.PLANNED)`` stops here: ``plan_memory`` reads the program and rolls back);
4. captures: the capture program;
5. seal: the passes become replayable (and guarded, in debug mode).

Both programs run through one loop, :meth:`Build.execute`: per op it enters the op's context
(the phase of its kind and its pass, for error messages), calls the hooks that observe ops,
then the op's handler (``_warmup.HANDLERS``, ``_captures.HANDLERS``). Observers -- the seed's
allocation trace, the debug recorder, ``plan_memory``'s sizes, the build's own stats -- are
:class:`gograph.build._exec.BuildHooks` injected by the caller. :meth:`Build.graphed` then gives one
:class:`gograph.replay.graphed.GraphedCallable` per pass.

A failure anywhere rolls back in one place (:meth:`Build.rollback`): every pass created is
dropped (its graphs destroyed, its pool references released, as the core counts them), the
generator state restored, and the error raised again naming the callable and the phase.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..core import _core, _plan
from ..core._kinds import BufferSource, CaptureOp, GradPolicy, WarmOp
from ..core._wire import CaptureProgram, Op
from ..replay._buffer_reuse import BufferReuse
from ..replay._shared_inputs import SharedInput, shared_inputs
from ..replay._sharers import Sharers
from ..replay.graphed import GraphedCallable, PassResult, Shared, lent_grads
from ..request._args import PassSpec, Request
from ..request._planned import planned
from ..runtime import _observe
from ..runtime.engines import CudaEngine, Engine
from . import _captures, _reuse, _warmup
from ._exec import BuildHooks, Executor, HookList, Hooks, Phase, ProgramKind
from ._state import PassState

__all__ = ["PHASE_OF", "Build", "prepared"]

log = logging.getLogger("gograph")

#: The phase an op runs in (what an error during it is said to have failed during).
PHASE_OF: dict[WarmOp | CaptureOp, str] = {
    **{k: "warmup" for k in WarmOp},
    CaptureOp.FORWARD: "forward capture",
    CaptureOp.BACKWARD: "backward capture",
    CaptureOp.WGRAD: "weight-gradient capture",
    CaptureOp.DROP: "captures",
    CaptureOp.RELEASE: "captures",
    CaptureOp.RETURN_WARMUP_POOL: "captures",
}

Handlers = Mapping[Any, Callable[[Executor, int, Op], None]]


@contextlib.contextmanager
def prepared(req: Request) -> Iterator[Build]:
    """The executor of ``req`` once planned (:func:`gograph.request._planned.planned`: the
    schedule, the specs, the engine). ``make_graphed_callables`` runs it to the end;
    ``plan_memory`` until it is planned."""
    with planned(req) as p:
        del req  # the planned request replaces it (a buffer-reuse build's samples are reorganised)
        yield Build(p.req, p.schedule, p.specs, p.engine)


class Build:
    """One build's executor (an :class:`gograph.build._exec.Executor`). ``phase`` and ``current`` say
    where it is, for error messages (:meth:`_enter` sets them)."""

    phase: str
    current: PassState | PassSpec | None

    def __init__(self, req: Request, schedule: _plan.Schedule, specs: Sequence[PassSpec], engine: Engine) -> None:
        self.req, self.schedule, self.specs, self.engine = req, schedule, specs, engine
        self.pool: Hashable = req.pool if req.pool is not None else engine.new_pool()
        self.device: torch.device | None = engine.device if isinstance(engine, CudaEngine) else None
        self.debug = _observe.debug_env() if req.debug_replay_order is None else req.debug_replay_order
        self.states: list[PassState] = []
        self._enter("setup")
        self.program: CaptureProgram | None = None
        self.slots: dict[int, torch.Tensor] = {}
        self.reuse: BufferReuse | None = None
        self.stats: _observe.BuildStats | None = None
        self.hooks = HookList(())
        self.rng_at: Hashable = None
        self.warm_pool: Hashable | None = None  # the pool warmup (or the seed) allocated in, while referenced
        self.seed = 0  # bytes carved in the pool before the first capture (the core's choice)
        self.colour_pools: dict[int, Hashable] = {}  # a shared colour's representative -> its own pool
        self.wgrad_reserve: Any = None  # (_captures.capture_wgrad) released once the captures end
        self._rng: Any = None
        self._rolled_back = False

    def run(self, until: Phase = Phase.SEALED, hooks: Sequence[BuildHooks] = ()) -> CaptureProgram:
        """Runs the phases up to ``until`` with ``hooks`` observing, and returns the capture
        program. At :attr:`Phase.SEALED` the passes are replayable (:meth:`graphed`); at
        :attr:`Phase.PLANNED` nothing is captured and the caller must :meth:`rollback`. A
        failure rolls back and raises (see the module docstring)."""
        self._rng = self.engine.get_rng_state()
        self.stats = _observe.BuildStats.begin(
            self.engine,
            expected_captures=self._expected_captures(),
            progress=self.req.progress and until is Phase.SEALED,
            debug_replay_order=self.debug,
        )
        self.hooks = HookList((_StatsHooks(self.stats), _warmup.DelayedGradsRestored(), *hooks))
        try:
            self._create_passes()
            self._warmup(probe=until is Phase.SEALED)
            program = self._plan_captures()
            if until is Phase.PLANNED:
                return program
            self._capture(program)
            self._seal()
            self.hooks.finished(self, failed=False)
        except BaseException as e:
            self.rollback()
            wrapped = self._with_context(e) if isinstance(e, Exception) else None
            if wrapped is not None:
                raise wrapped from e
            raise
        self.engine.set_rng_state(self._rng)
        return program

    def execute(self, kind: ProgramKind, ops: Sequence[Op], handlers: Handlers) -> None:
        """Runs one of the core's programs: per op, its context, the hooks, its handler."""
        states, hooks, enter = self.states, self.hooks, self._enter
        table = {k: (handlers[k], PHASE_OF[k]) for k in {op.kind for op in ops}}
        with hooks.program(self, kind, ops):
            per_op = hooks.per_op  # the hooks that watch this program's ops
            for i, op in enumerate(ops):
                handler, phase = table[op.kind]
                enter(phase, states[op.pass_index] if op.pass_index >= 0 else None)
                if per_op:
                    hooks.op(i)
                handler(self, i, op)
            if per_op:
                hooks.op(len(ops))

    def _enter(self, phase: str, current: PassState | PassSpec | None = None) -> None:
        """What an error now is said to have failed during, and in which callable (None: not a
        callable's, such as a hook's or the engine's)."""
        self.phase = phase
        self.current = current

    def _expected_captures(self) -> int:
        return sum(1 + int(s.grad_enabled) for s in self.specs) + len(self.schedule.wgrad_passes)

    def _create_passes(self) -> None:
        for spec in self.specs:
            self._enter("setup", spec)
            self.states.append(PassState(spec, self.engine.new_pass(spec.index, spec.label)))

    def _warmup(self, probe: bool) -> None:
        """The warmup program, after ``pre_warmup_hook`` and (``probe``) the whole-step probe."""
        self._enter("warmup")
        req, has_hooks = self.req, self.req.hooks.hooks is not None
        with self.engine.warmup_context():
            if req.pre_warmup_hook is not None:
                req.pre_warmup_hook()
            whole = probe and self._post_hook_on_error(self._whole_step, has_hooks)
        own_pool = req.pool is None and not req.share  # shared colours capture in pools of their own
        program = _plan.warmup_program(self.schedule, req.num_warmup_iters, has_hooks, whole, own_pool)
        pool = self.pool if program.in_pool else None
        if pool is not None:
            self.engine.release_cached()  # what the probe cached must not stay beside the pool
        with self.engine.warmup_context(pool):
            self.warm_pool = pool  # one pool reference, returned once the captures hold theirs
            self.rng_at = self.engine.rng_marker()
            self._post_hook_on_error(self.execute, ProgramKind.WARMUP, program.ops, _warmup.HANDLERS)
            if req.post_warmup_hook is not None:
                self._enter("warmup")  # a hook's error is not a callable's
                req.post_warmup_hook()
        self.engine.synchronize()
        for st in self.states:  # warmup is over: what it kept alive goes
            st.warm_outputs = st.warm_grads = None
        _warmup.decide_wgrad_without_warmup(self.states, req.callables)

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
        self._enter("warmup", st)
        func = req.callables[st.spec.callable_index]
        with _warmup.module_buffers_restored([func]):
            _warmup.warm_forward(st, func, req.hooks, self.device)
        outputs, st.warm_outputs = st.warm_outputs or (), None
        self._enter("warmup")  # the probe's callable is done
        return bool(outputs) and all(o.dim() == 0 for o in outputs) and any(o.requires_grad for o in outputs)

    def _plan_captures(self) -> CaptureProgram:
        """What warmup learned goes to the core; the capture program comes back (the core keeps it
        with the schedule, for the seed's prediction); the hooks see it."""
        self._enter("buffer planning")
        req, sigs = self.req, _reuse.Signatures()
        facts = _reuse.facts(self.states, sigs, req.clone_param_grads)
        # every engine gets the same program: the eager engine keeps what is released (host
        # memory), and records it where it models the pool
        self.program = program = _plan.capture_program(self.schedule, facts, req.reuse, req.chain, True, req.share)
        if req.reuse or req.chain:
            self.reuse = _reuse.buffer_reuse(program, sigs)
        self.hooks.planned(self, program)
        return program

    def pool_of(self, st: PassState) -> Hashable:
        """The pool the pass's graphs are captured in. A colour of passes that replay one set of
        graphs (``share_microbatch_graphs``) has a pool of its own: its graphs replay whenever
        a member's turn comes, out of the capture order that makes one pool's reuse safe."""
        rep = self.program.share.get(st.index, st.index) if self.program is not None else st.index
        return self.colour_pools.get(rep, self.pool)

    def _capture(self, program: CaptureProgram) -> None:
        """The capture program, after the buffers it names were put in place and the seed carved."""
        for rep in sorted(set(program.share.values())):
            self.colour_pools[rep] = self.engine.new_pool()
        _captures.apply_separated(self.states, program)
        self.slots = _captures.apply_slots(self.states, program)
        if self.seed > 0 and self.warm_pool is None and self.req.pool is None:
            self._enter("seed")  # into the build's own pool: its reference goes back with warmup's
            if self.engine.carve_seed(self.pool, self.seed):
                self.warm_pool = self.pool
        try:
            self.execute(ProgramKind.CAPTURE, program.ops, _captures.HANDLERS)
        finally:
            reserve, self.wgrad_reserve = self.wgrad_reserve, None
            self.engine.release_hold(reserve)
        _captures.lent_thresholds(self.states, program)

    def return_warm_pool(self) -> None:
        """Returns the pool reference warmup (or the seed) took, if it holds one."""
        pool, self.warm_pool = self.warm_pool, None
        if pool is not None:
            self.engine.end_warmup_in_pool(pool)

    def _seal(self) -> None:
        share = self.program.share if self.program is not None else {}
        for st in self.states:
            if st.index not in share:
                self._enter("seal", st)
                self.engine.seal(st.pass_id)
        for st in self.states:
            if st.index in share:  # replays its representative's graphs: its own record goes
                self._enter("seal", st)
                self.engine.drop(st.pass_id, self.pool_of(st))
                st.pass_id = self.states[share[st.index]].pass_id
        self.engine.synchronize()  # captures complete before the first replay
        if self.debug:
            for st in self.states:
                if st.index not in share:
                    _core.set_replay_order_check(st.pass_id, True)

    def rollback(self) -> None:
        """Every pass created so far is dropped, the pool reference warmup holds returned, the
        generator state restored and the hooks told (once: a second call does nothing)."""
        if self._rolled_back:
            return
        self._rolled_back = True
        for st in self.states:
            try:
                self.engine.drop(st.pass_id, self.pool_of(st))
            except Exception as cleanup_error:  # keep the original error
                log.warning("releasing pass %d after a failed build: %s", st.pass_id, str(cleanup_error))
        try:
            self.return_warm_pool()
        except Exception as pool_error:
            log.warning("releasing the pool warmup allocated in after a failed build: %s", str(pool_error))
        try:
            self.engine.set_rng_state(self._rng)
        except Exception as rng_error:
            log.warning("restoring the generator state after a failed build: %s", str(rng_error))
        try:
            self.hooks.finished(self, failed=True)
        except Exception as hook_error:
            log.warning("a build hook after a failed build: %s", str(hook_error))

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

    def graphed(self) -> list[GraphedCallable]:
        """One graphed callable per pass, once :meth:`run` sealed them."""
        program = self.program
        assert program is not None and self.stats is not None
        shared = Shared(
            engine=self.engine,
            pool=self.pool,
            build_stats=self.stats,
            check_replay_order=self.debug,
            retain_graph_in_backward=self.req.retain_graph,
            buffer_reuse=self.reuse,
            lent=lent_grads(self.engine.pool_key(self.pool)),
            lend_param_grads=self.req.lend_param_grads,
        )
        rep = [self.states[program.share.get(st.index, st.index)] for st in self.states]  # whose graphs it replays
        guards = shared_inputs(
            [r.flat_args for r in rep],
            [st.index for st in self.states],
            [f"graphed callable {st.index} ({st.spec.label})" for st in self.states],
            [_plain_copies(r) for r in rep],
            [r.index in program.backwards for r in rep],
        )
        sharers = _sharers(self.states, program)
        out = []
        for st, r, shared_leaves in zip(self.states, rep, guards):
            result = _result(r, program, shared_leaves, sharers.get(r.index), self.pool_of(r))
            out.append(GraphedCallable(st.spec, result, r.pass_id, shared))
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


class _StatsHooks(Hooks):
    """The build's own observation record (:class:`gograph.runtime._observe.BuildStats`, which every
    graphed callable it returns shares) as hooks: warmup's time and peak, the end."""

    def __init__(self, stats: _observe.BuildStats) -> None:
        self.stats = stats

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        if kind is not ProgramKind.WARMUP:
            yield
            return
        self.stats.warmup_started()
        try:
            yield
        finally:
            self.stats.warmup_finished()

    def finished(self, build: Executor, failed: bool) -> None:
        self.stats.close(failed=failed)


def _plain_copies(st: PassState) -> frozenset[int]:
    """The leaves the shared-input guard leaves alone: chained ones (never copied into) and those
    the forward writes in place (a replay changes their buffer without a version bump), every
    leaf when no forward ran to tell (a pass without warmup learns it at its capture)."""
    if not (st.warmed or st.inputs_seen):
        return frozenset(range(len(st.flat_args)))
    return frozenset(st.chained_inputs) | st.mutated_inputs


def _sharers(states: Sequence[PassState], program: CaptureProgram) -> dict[int, Sharers]:
    """Per representative pass that others replay the graphs of (``share_microbatch_graphs``),
    the guard its colour shares: every member's index and label."""
    colours: dict[int, dict[int, str]] = {}
    for p, q in program.share.items():
        colours.setdefault(q, {q: _label(states[q])})[p] = _label(states[p])
    return {q: Sharers(members) for q, members in colours.items()}


def _label(st: PassState) -> str:
    return f"graphed callable {st.index} ({st.spec.label})"


def _result(
    st: PassState,
    program: CaptureProgram,
    shared_leaves: dict[int, SharedInput],
    sharers: Sharers | None = None,
    pool: Hashable | None = None,
) -> PassResult:
    n = len(st.flat_args)
    policy: dict[int, GradPolicy] = {}
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
        lent_from=(st.lent_from[0], st.lent_from[1], st.lent_from[2]),
        shared_inputs=shared_leaves,
        shared_grad_outputs=frozenset(
            k for (q, k), src in program.grad_outputs.items() if q == st.index and src.kind is BufferSource.SLOT
        ),
        sharers=sharers,
        pool=pool,
    )
