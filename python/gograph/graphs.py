"""``make_graphed_callables``: torch's algorithm, with graphs captured by the Go core.

The algorithm is torch 2.11's ``torch.cuda.make_graphed_callables`` (same signature, checks,
messages and semantics), written against :class:`gograph.engines.Engine`:

1. checks (autocast cache, module hooks, buffers requiring grad, tensor-only sample args);
2. one core *pass* per callable; its static input surface is the flattened user args followed
   by the module's parameters;
3. warmup (on the engine's side stream) of each callable, ``num_warmup_iters`` forward and
   backward iterations, noting whether it consumed generator state;
4. forward captures in callable order, then backward captures in reverse order, all in one
   memory pool (``pool`` or a new one) -- the order in which they will run;
5. one :class:`GraphedCallable` per callable. Modules are returned themselves with ``forward``
   replaced (and ``reset`` added); functions are returned as the GraphedCallable.

Per-callable state is explicit data on the :class:`GraphedCallable` (no closures), replayed
through one module-level :class:`torch.autograd.Function`. Each GraphedCallable owns exactly one
pass: :meth:`GraphedCallable.reset` releases its graphs and pool references and nothing else; a
``weakref.finalize`` releases and forgets the pass when the object is garbage.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union, overload

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _native
from .engines import (
    BACKWARD,
    FORWARD,
    CudaEngine,
    EagerEngine,
    EagerPool,
    Engine,
    default_cuda_engine,
    default_eager_engine,
)

__all__ = [
    "GraphedCallable",
    "make_graphed_callables",
    "graph_pool_handle",
    "live_graphs",
    "live_passes",
]

log = logging.getLogger("gograph")

_ModuleOrCallable = Union[torch.nn.Module, Callable[..., object]]
_T = TypeVar("_T", bound=_ModuleOrCallable)


# ---------------------------------------------------------------------------------------------
# Capture bodies: explicit objects, not closures
# ---------------------------------------------------------------------------------------------
class _ForwardBody:
    """Runs one callable's forward on its (static) sample args and returns the flat tuple of
    output tensors; the output treespec of the latest call is kept in :attr:`out_spec`.

    For a module whose ``forward`` is a method of that module, the module is held through a
    weakref and the original forward function unbound, so that the body (recorded by engines,
    reachable from finalizers) never keeps the module alive.
    """

    __slots__ = ("_fn", "_module_ref", "out_spec", "label")

    def __init__(self, fn: Callable[..., Any], module: torch.nn.Module | None, label: str) -> None:
        self._fn = fn
        self._module_ref = weakref.ref(module) if module is not None else None
        self.out_spec: pytree.TreeSpec | None = None
        self.label = label

    def __call__(self, *args: Any) -> tuple[Tensor, ...]:
        if self._module_ref is not None:
            module = self._module_ref()
            if module is None:
                raise RuntimeError(f"gograph: the graphed module {self.label} no longer exists")
            out = self._fn(module, *args)
        else:
            out = self._fn(*args)
        leaves, spec = pytree.tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"gograph: the outputs of a graphed callable must be Tensors (in any pytree "
                    f"structure); output leaf {i} of {self.label} is a {type(leaf).__name__}")
        self.out_spec = spec
        return tuple(leaves)


class _BackwardBody:
    """``torch.autograd.grad`` of the outputs that require grad with respect to the static inputs
    that require grad, with the static grad-output buffers as incoming gradients. Called with
    the forward outputs it differentiates (the capture's, or on the eager engine the latest
    forward replay's)."""

    __slots__ = ("inputs", "grad_outputs", "output_mask", "allow_unused")

    def __init__(self, inputs: tuple[Tensor, ...], grad_outputs: tuple[Tensor, ...],
                 output_mask: tuple[bool, ...], allow_unused: bool) -> None:
        self.inputs = inputs
        self.grad_outputs = grad_outputs
        self.output_mask = output_mask
        self.allow_unused = allow_unused

    def __call__(self, outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
        outs = tuple(o for o, m in zip(outputs, self.output_mask) if m)
        return tuple(torch.autograd.grad(
            outputs=outs,
            inputs=self.inputs,
            grad_outputs=self.grad_outputs,
            only_inputs=True,
            allow_unused=self.allow_unused,
        ))


# ---------------------------------------------------------------------------------------------
# The graphed callable
# ---------------------------------------------------------------------------------------------
class GraphedCallable:
    """One graphed callable: the record of its pass and its static buffers.

    Calling it copies the user args into the static inputs (when not already there), replays
    the forward graph and returns the outputs with the callable's output structure. Under
    autograd, the backward replays the backward graph.

    Aliasing and lifetimes (as with ``torch.cuda.make_graphed_callables``):

    * ``static_input_surface`` -- the flattened sample args followed by the module's parameters.
      Graphs read these tensors: a call copies each user arg into its static input unless it *is*
      that tensor (same ``data_ptr``). Shapes, dtypes and devices must match ``sample_args``.
    * the returned outputs are detached views of ``static_outputs``: the **next forward replay
      overwrites them**. Clone what must outlive the next call.
    * input gradients are detached views of ``static_grad_inputs``, overwritten by the next
      backward replay. Parameter gradients are returned as clones by default
      (``clone_param_grads_on_return``), so ``.grad`` accumulation across micro-batches is
      correct (pytorch issue 181723).
    * ``static_grad_outputs`` receive the incoming output gradients before a backward replay
      (None for outputs that did not require grad at capture).

    ``reset()`` releases exactly this callable's graphs and pool references and drops its static
    buffers; a second call is harmless; calling the callable afterwards raises RuntimeError (the
    core's message says it was reset). When the object is garbage its finalizer releases and
    forgets the pass. The module (for a graphed module) is referenced through a weakref only.
    """

    def __init__(
        self,
        *,
        index: int,
        label: str,
        engine: Engine,
        pool: Hashable,
        pass_id: int,
        static_input_surface: tuple[Tensor, ...],
        static_outputs: tuple[Tensor, ...],
        output_requires_grad: tuple[bool, ...],
        static_grad_outputs: tuple[Tensor | None, ...],
        static_grad_inputs: tuple[Tensor | None, ...],
        output_spec: pytree.TreeSpec,
        len_user_args: int,
        module_params: tuple[torch.nn.Parameter, ...],
        has_backward: bool,
        clone_param_grads_on_return: bool,
        module: torch.nn.Module | None = None,
        training: bool | None = None,
        original_forward: Callable[..., Any] | None = None,
        original_forward_is_method: bool = False,
    ) -> None:
        self.index = index
        self.label = label
        self.engine = engine
        self.pool = pool
        self.pass_id = pass_id
        self.static_input_surface = static_input_surface
        self.static_outputs = static_outputs
        self.output_requires_grad = output_requires_grad
        self.static_grad_outputs = static_grad_outputs
        self.static_grad_inputs = static_grad_inputs
        self.output_spec = output_spec
        self.len_user_args = len_user_args
        self.module_params = module_params
        self.has_backward = has_backward
        self.clone_param_grads_on_return = clone_param_grads_on_return
        self._nondiff_outputs = tuple(i for i, rg in enumerate(output_requires_grad)
                                      if not (rg and has_backward))
        # (surface index, parameter) of the grads that may need an owned copy on return;
        # parameters marked skip_backward_post_hook (TransformerEngine/Megatron: their grads
        # are consumed by a fused wgrad path, never accumulated by autograd) are never cloned.
        self._param_grad_slots: tuple[tuple[int, torch.nn.Parameter], ...] = tuple(
            (len_user_args + k, p) for k, p in enumerate(module_params)
            if clone_param_grads_on_return and not getattr(p, "skip_backward_post_hook", False))
        self._module_ref = weakref.ref(module) if module is not None else None
        self._training = training
        self._original_forward = original_forward
        self._original_forward_is_method = original_forward_is_method
        self._released = False
        # The finalizer must not reference self: it gets the engine, the pass id and the pool.
        self._finalizer = weakref.finalize(self, engine.finalize_pass, pass_id, pool)
        self._finalizer.atexit = False

    # -- introspection ------------------------------------------------------------------------
    @property
    def is_reset(self) -> bool:
        """True once :meth:`reset` released this callable."""
        return self._released

    @property
    def state(self) -> str:
        """The core's lifecycle state of the pass: "building", "ready" or "reset"."""
        return str(_native.core.pass_state(self.pass_id))

    @property
    def module(self) -> torch.nn.Module | None:
        """The graphed module (None for functions, or when the module no longer exists)."""
        return self._module_ref() if self._module_ref is not None else None

    def __repr__(self) -> str:
        state = "reset" if self._released else "ready"
        return (f"GraphedCallable(index={self.index}, label={self.label!r}, pass_id={self.pass_id}, "
                f"engine={self.engine.name}, {state})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("gograph: a graphed callable cannot be pickled or copied (it owns device graphs)")

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("gograph: a graphed callable cannot be copied (it owns device graphs); "
                        "copy the module before graphing it")

    # -- calling ------------------------------------------------------------------------------
    def __call__(self, *user_args: Any, **user_kwargs: Any) -> Any:
        if self._module_ref is not None:
            module = self._module_ref()
            if module is not None and module.training != self._training:
                # Graphed in the other train/eval mode: run the original forward eagerly.
                fn = self._original_forward
                if fn is None:  # pragma: no cover - set for every module
                    raise RuntimeError("gograph: original forward unavailable")
                if self._original_forward_is_method:
                    return fn(module, *user_args, **user_kwargs)
                return fn(*user_args, **user_kwargs)
        if self._released:
            self._raise_reset()
        if user_kwargs:
            raise TypeError(
                f"gograph: graphed callable {self.index} ({self.label}) takes its arguments positionally, "
                f"in the structure of its sample_args; got keyword arguments {sorted(user_kwargs)}")
        flat = pytree.arg_tree_leaves(*user_args)
        if len(flat) != self.len_user_args:
            raise TypeError(
                f"gograph: graphed callable {self.index} ({self.label}) was captured with "
                f"{self.len_user_args} tensor argument(s) and called with {len(flat)}")
        out = _GraphedFunction.apply(self, *flat, *self.module_params)
        return pytree.tree_unflatten(out, self.output_spec)

    def _raise_reset(self) -> None:
        # The core's lifecycle check produces the authoritative message ("... was reset ...").
        self.engine.replay(self.pass_id, FORWARD)
        raise RuntimeError(f"gograph: graphed callable {self.index} ({self.label}) was reset")

    def _replay_forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        surface = self.static_input_surface
        for i in range(self.len_user_args):
            static, new = surface[i], inputs[i]
            if not isinstance(new, Tensor):
                raise TypeError(f"gograph: argument leaf {i} of graphed callable {self.index} "
                                f"({self.label}) is a {type(new).__name__}, not a Tensor")
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        self.engine.replay(self.pass_id, FORWARD)
        return tuple(o.detach() for o in self.static_outputs)

    def _replay_backward(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        if self._released:
            self.engine.replay(self.pass_id, BACKWARD)  # raises: "... was reset ..."
            raise RuntimeError(f"gograph: graphed callable {self.index} ({self.label}) was reset")
        if len(grads) != len(self.static_grad_outputs):
            raise AssertionError(
                f"len(grads)={len(grads)} != len(static_grad_outputs)={len(self.static_grad_outputs)}")
        for static, grad in zip(self.static_grad_outputs, grads):
            # don't copy if the incoming grad is already in the right place
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        self.engine.replay(self.pass_id, BACKWARD)
        out = [None if b is None else b.detach() for b in self.static_grad_inputs]
        # A parameter's grad must not *become* a static buffer: when .grad is None, AccumulateGrad
        # steals the incoming tensor as .grad, and the next replay would overwrite it (pytorch
        # issue 181723). When .grad exists, AccumulateGrad adds into it (in place, or out of place
        # under create_graph) and keeps nothing, so the clone -- a kernel and an allocation per
        # parameter per step -- is only paid where it is needed.
        for i, param in self._param_grad_slots:
            b = out[i]
            if b is not None and param.grad is None:
                out[i] = b.clone()
        return tuple(out)

    # -- lifecycle ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Releases this callable's graphs and pool references and drops its static buffers.

        Waits for the device first (a replay may still be running). Harmless when called again.
        Afterwards, calling the callable raises RuntimeError saying it was reset (a module whose
        train/eval mode differs from the captured one still runs its original forward).
        """
        if self._released:
            return
        try:
            self.engine.synchronize()
            self.engine.release(self.pass_id, self.pool)
        finally:
            self._released = True
            self.static_input_surface = ()
            self.static_outputs = ()
            self.static_grad_outputs = ()
            self.static_grad_inputs = ()
            self.module_params = ()
            self._param_grad_slots = ()
        log.debug("gograph: reset pass %d (%s)", self.pass_id, self.label)


class _GraphedFunction(torch.autograd.Function):
    """The autograd node of a graphed callable call (torch's ``Graphed``, with the per-callable
    state passed in as the first, non-tensor, argument)."""

    @staticmethod
    def forward(ctx: Any, graphed: GraphedCallable, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.graphed = graphed
        outputs = graphed._replay_forward(inputs)
        if graphed._nondiff_outputs:
            ctx.mark_non_differentiable(*(outputs[i] for i in graphed._nondiff_outputs))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        graphed: GraphedCallable = ctx.graphed
        return (None, *graphed._replay_backward(grads))


# ---------------------------------------------------------------------------------------------
# make_graphed_callables
# ---------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """Build-time data of one callable (discarded once its GraphedCallable exists)."""

    index: int
    func: _ModuleOrCallable
    label: str
    sample_args: tuple[Any, ...]
    flat_args: tuple[Tensor, ...]
    module_params: tuple[torch.nn.Parameter, ...]
    training: bool | None
    grad_enabled: bool
    body: _ForwardBody
    original_forward: Callable[..., Any] | None = None
    original_forward_is_method: bool = False
    pass_id: int = 0
    fwd_rng: bool | None = None
    bwd_rng: bool | None = None
    static_outputs: tuple[Tensor, ...] = ()
    output_requires_grad: tuple[bool, ...] = ()
    static_grad_outputs: tuple[Tensor | None, ...] = ()
    static_grad_inputs: tuple[Tensor | None, ...] = ()
    has_backward: bool = False
    output_spec: pytree.TreeSpec | None = None

    @property
    def surface(self) -> tuple[Tensor, ...]:
        return self.flat_args + self.module_params

    @property
    def grad_surface(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.surface if t.requires_grad)


def _label(func: _ModuleOrCallable) -> str:
    if isinstance(func, torch.nn.Module):
        return type(func).__name__
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__)


def _resolve_engine(engine: Engine | str | None, plans: Sequence[_Plan]) -> Engine:
    if isinstance(engine, Engine):
        return engine
    if engine not in (None, "eager", "cuda"):
        raise ValueError(f"gograph: engine must be None, 'eager', 'cuda' or an Engine instance, not {engine!r}")
    if engine == "eager":
        return default_eager_engine()
    cuda_tensors = [t for p in plans for t in p.surface if t.is_cuda]
    if engine == "cuda" or cuda_tensors:
        if not _native.cuda_available():
            what = "engine='cuda' was requested" if engine == "cuda" else "sample_args are CUDA tensors"
            raise RuntimeError(
                f"gograph: {what} but the CUDA core is unavailable: {_native.cuda_unavailable_reason()}. "
                "Pass CPU tensors (or engine='eager') to use the eager reference engine.")
        devices = {t.device for t in cuda_tensors}
        if len(devices) > 1:
            raise ValueError("gograph: all sample args and parameters must be on one CUDA device, "
                             f"got {sorted(map(str, devices))}")
        device = next(iter(devices)) if devices else torch.device("cuda", torch.cuda.current_device())
        return default_cuda_engine(device)
    return default_eager_engine()


def _autocast_cache_active(engine: Engine) -> bool:
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        return True
    if isinstance(engine, EagerEngine):
        return torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    return False


def _with_context(e: Exception, index: int, label: str, phase: str, engine: Engine) -> Exception | None:
    """An exception of ``e``'s type whose message names the callable index and the phase, or
    None when that type cannot be built from a message (then a note is added to ``e``)."""
    msg = f"gograph.make_graphed_callables: callable {index} ({label}) failed during {phase}: {e}"
    if isinstance(engine, CudaEngine) and phase.endswith("capture"):
        msg += (" [during CUDA graph capture, work that synchronizes with the host -- stream or device "
                "synchronize(), .item(), .cpu(), printing tensors -- or allocates outside the capture "
                "stream is not allowed]")
    try:
        new = type(e)(msg)
    except Exception:
        new = None
    if new is None or type(new) is not type(e):
        e.add_note(msg)
        return None
    return new


def _warmup(plan: _Plan, engine: Engine, iters: int, allow_unused_input: bool) -> None:
    if iters <= 0:
        plan.fwd_rng = plan.bwd_rng = None  # unknown: captures carry RNG state to be safe
        return
    fwd_rng = bwd_rng = False
    grad_inputs = plan.grad_surface
    with torch.set_grad_enabled(plan.grad_enabled):
        for _ in range(iters):
            before = engine.rng_marker()
            outputs = plan.body(*plan.sample_args)
            after = engine.rng_marker()
            fwd_rng = fwd_rng or before != after
            outputs_grad = tuple(o for o in outputs if o.requires_grad)
            if outputs_grad:
                grads = torch.autograd.grad(
                    outputs=outputs_grad,
                    inputs=grad_inputs,
                    grad_outputs=tuple(torch.zeros_like(o) for o in outputs_grad),
                    only_inputs=True,
                    allow_unused=allow_unused_input,
                )
                bwd_rng = bwd_rng or after != engine.rng_marker()
                del grads
            del outputs, outputs_grad
    plan.fwd_rng, plan.bwd_rng = fwd_rng, bwd_rng


def _capture_forward(plan: _Plan, engine: Engine, pool: Hashable) -> tuple[Tensor, ...]:
    with torch.set_grad_enabled(plan.grad_enabled):
        outputs = engine.capture(plan.pass_id, FORWARD, plan.body, *plan.sample_args,
                                 pool=pool, uses_rng=plan.fwd_rng)
    plan.output_spec = plan.body.out_spec
    return tuple(outputs)  # type: ignore[arg-type]  # a forward body returns only tensors


def _capture_backward(plan: _Plan, outputs: tuple[Tensor, ...], engine: Engine, pool: Hashable,
                      allow_unused_input: bool) -> None:
    mask = tuple(bool(o.requires_grad) for o in outputs)
    static_grad_outputs = tuple(torch.zeros_like(o) if rg else None for o, rg in zip(outputs, mask))
    grad_inputs: tuple[Tensor | None, ...] | None = None
    if any(mask):
        body = _BackwardBody(plan.grad_surface, tuple(g for g in static_grad_outputs if g is not None),
                             mask, allow_unused_input)
        grad_inputs = engine.capture(plan.pass_id, BACKWARD, body, outputs, pool=pool, uses_rng=plan.bwd_rng)
        plan.has_backward = True
    # Pad the grads of the inputs that require grad with None for the others (the layout
    # autograd.Function.backward must return).
    padded: list[Tensor | None] = []
    k = 0
    for arg in plan.surface:
        if arg.requires_grad and grad_inputs is not None:
            padded.append(grad_inputs[k])
            k += 1
        else:
            padded.append(None)
    plan.static_grad_outputs = static_grad_outputs
    plan.static_grad_inputs = tuple(padded)


@overload
def make_graphed_callables(
    callables: _T,
    sample_args: tuple[Any, ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    *,
    engine: Engine | str | None = None,
    clone_param_grads_on_return: bool = True,
) -> _T: ...


@overload
def make_graphed_callables(
    callables: tuple[_ModuleOrCallable, ...],
    sample_args: tuple[tuple[Any, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    *,
    engine: Engine | str | None = None,
    clone_param_grads_on_return: bool = True,
) -> tuple[_ModuleOrCallable, ...]: ...


def make_graphed_callables(
    callables: _ModuleOrCallable | tuple[_ModuleOrCallable, ...],
    sample_args: tuple[Any, ...] | tuple[tuple[Any, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    *,
    engine: Engine | str | None = None,
    clone_param_grads_on_return: bool = True,
) -> _ModuleOrCallable | tuple[_ModuleOrCallable, ...]:
    r"""Accepts callables (functions or :class:`torch.nn.Module`\ s) and returns graphed versions.

    A drop-in for :func:`torch.cuda.make_graphed_callables` (torch 2.9-2.11): each graphed
    callable's forward runs its source callable's forward work as one graph replay inside a
    single autograd node, whose backward runs the callable's backward work as one graph replay.
    The graphs are captured and launched by gograph's Go core.

    Arguments:
        callables: a module or function, or a tuple of them. With a tuple, all captures share
            one memory pool, and the order must be the order in which they run in the workload.
        sample_args: a tuple of args for the single callable, or a tuple of such tuples. Args may
            be any pytree (tuples, lists, dicts) whose leaves are all Tensors; a call must pass
            args of the same structure, shapes and dtypes. The ``requires_grad`` state of each
            leaf must match the real inputs'.
        num_warmup_iters: forward+backward warmup iterations before capture (default 3). With 0,
            generator use is unknown and CUDA captures always carry RNG state.
        allow_unused_input: if False, a sample arg (or parameter) that requires grad but is not
            used to compute the outputs is an error (its grad would always be None).
        pool: memory-pool token shared with other captures (``gograph.graph_pool_handle()`` or
            ``torch.cuda.graph_pool_handle()``); a new pool when None.
        engine: None picks :class:`~gograph.engines.CudaEngine` for CUDA sample tensors (the
            cuda flavor of the core must be loaded) and the eager reference engine for CPU
            tensors; ``"cuda"``, ``"eager"`` or an :class:`~gograph.engines.Engine` force one.
        clone_param_grads_on_return: never let a static grad buffer become a parameter's
            ``.grad`` (default), so ``.grad`` accumulates correctly across micro-batches. A
            parameter whose ``.grad`` is None at backward time gets an owned clone (autograd
            would otherwise adopt the buffer the next replay overwrites); one whose ``.grad``
            exists gets the buffer, which autograd only adds into. Parameters with
            ``skip_backward_post_hook=True`` are never cloned. With False the static buffer
            itself may become ``.grad`` (torch's behaviour, pytorch issue 181723).

    Returns:
        The graphed callable(s), in the structure of ``callables``. A module is returned
        itself, with ``forward`` replaced by its :class:`GraphedCallable` (which runs the
        original forward eagerly when ``module.training`` differs from its value at capture)
        and ``reset`` set to the GraphedCallable's ``reset``. A function is returned as its
        :class:`GraphedCallable`.

    Modules in eval mode (``training`` False) are captured under ``torch.no_grad()`` and get no
    backward graph. Outputs and input grads alias static buffers that the next replay
    overwrites. The generator state in effect before the call is restored after it, so graphing
    does not shift the user's random stream.

    Raises:
        RuntimeError: autocast with caching enabled; CUDA tensors without the CUDA core.
        AssertionError: module hooks present, buffers requiring grad, non-Tensor sample leaves
            (torch's messages).
        Exception: an exception raised by a callable during warmup or capture is raised again
            (same type, chained) naming the callable index and the phase ("warmup",
            "forward capture", "backward capture"); every pass created so far is released and
            the generator state restored.
    """
    just_one_callable = not isinstance(callables, tuple)
    if just_one_callable:
        callables_t: tuple[_ModuleOrCallable, ...] = (callables,)  # type: ignore[assignment]
        args_t: tuple[tuple[Any, ...], ...] = (sample_args,)  # type: ignore[assignment]
    else:
        callables_t = callables  # type: ignore[assignment]
        args_t = sample_args  # type: ignore[assignment]
    if not isinstance(args_t, tuple) or len(args_t) != len(callables_t):
        raise ValueError(
            f"gograph: sample_args must hold one tuple of args per callable ({len(callables_t)} callables, "
            f"got {len(args_t) if isinstance(args_t, tuple) else type(args_t).__name__})")

    plans: list[_Plan] = []
    for i, (c, args) in enumerate(zip(callables_t, args_t)):
        if isinstance(c, torch.nn.Module):
            if not (
                len(c._backward_hooks) == 0
                and len(c._forward_hooks) == 0
                and len(c._forward_pre_hooks) == 0
            ):
                raise AssertionError(
                    "Modules must not have hooks registered at the time they are passed. However, registering hooks "
                    + "on modules after passing them through make_graphed_callables is allowed."
                )
            if not all(b.requires_grad is False for b in c.buffers()):
                raise AssertionError(
                    "In any :class:`~torch.nn.Module` passed to "
                    + ":func:`~make_graphed_callables`, only parameters may be trainable. All buffers must have "
                    + "``requires_grad=False``."
                )
        if not isinstance(args, tuple):
            args = (args,) if isinstance(args, Tensor) else tuple(args)
        flat = tuple(pytree.arg_tree_leaves(*args))
        if not all(isinstance(arg, Tensor) for arg in flat):
            raise AssertionError(
                "In the beta API, sample_args "
                + "for each callable must contain only Tensors. Other types are not allowed."
            )
        label = _label(c)
        if isinstance(c, torch.nn.Module):
            fwd = c.forward
            is_method = inspect.ismethod(fwd) and fwd.__self__ is c
            fn = fwd.__func__ if is_method else fwd
            plan = _Plan(
                index=i, func=c, label=label, sample_args=args, flat_args=flat,
                module_params=tuple(c.parameters()), training=c.training,
                grad_enabled=torch.is_grad_enabled() and c.training,
                body=_ForwardBody(fn, c if is_method else None, label),
                original_forward=fn, original_forward_is_method=is_method,
            )
        else:
            plan = _Plan(
                index=i, func=c, label=label, sample_args=args, flat_args=flat, module_params=(),
                training=None, grad_enabled=torch.is_grad_enabled(), body=_ForwardBody(c, None, label),
            )
        plans.append(plan)

    eng = _resolve_engine(engine, plans)
    if _autocast_cache_active(eng):
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set `cache_enabled=False`."
        )
    mempool = eng.new_pool() if pool is None else pool

    rng_state = eng.get_rng_state()
    created: list[int] = []
    phase = "setup"
    current: _Plan | None = None
    try:
        for plan in plans:
            current = plan
            plan.pass_id = eng.new_pass(plan.index, plan.label)
            created.append(plan.pass_id)

        # Warmup: keeps lazy initialisation (cuBLAS handles, cudnn benchmarking, ...) out of
        # the captures, and tells which callables consume generator state.
        phase = "warmup"
        with eng.warmup_context():
            for plan in plans:
                current = plan
                _warmup(plan, eng, num_warmup_iters, allow_unused_input)
        eng.synchronize()

        # All captures share the pool; capture in the order they will run:
        # fwd 1, ..., fwd N, then bwd N, ..., bwd 1.
        phase = "forward capture"
        captured_outputs: list[tuple[Tensor, ...]] = []
        for plan in plans:
            current = plan
            captured_outputs.append(_capture_forward(plan, eng, mempool))

        phase = "backward capture"
        for plan, outputs in zip(reversed(plans), reversed(captured_outputs)):
            current = plan
            with torch.set_grad_enabled(plan.grad_enabled):
                _capture_backward(plan, outputs, eng, mempool, allow_unused_input)
        for plan, outputs in zip(plans, captured_outputs):
            # Keep detached aliases: the static storage, without the capture's autograd graph.
            plan.output_requires_grad = tuple(bool(o.requires_grad) for o in outputs)
            plan.static_outputs = tuple(o.detach() for o in outputs)
        captured_outputs.clear()

        phase = "seal"
        for plan in plans:
            current = plan
            eng.seal(plan.pass_id)
        eng.synchronize()  # uploads and captures complete before the first replay
    except BaseException as e:
        for pass_id in created:
            try:
                eng.drop(pass_id, mempool)
            except Exception as cleanup_error:  # keep the original error
                log.warning("gograph: releasing pass %d after a failed build: %s", pass_id, str(cleanup_error))
        try:
            eng.set_rng_state(rng_state)
        except Exception as rng_error:
            log.warning("gograph: restoring the generator state after a failed build: %s", str(rng_error))
        if isinstance(e, Exception) and current is not None:
            wrapped = _with_context(e, current.index, current.label, phase, eng)
            if wrapped is not None:
                raise wrapped from e
        raise
    eng.set_rng_state(rng_state)

    ret: list[_ModuleOrCallable] = []
    for plan in plans:
        module = plan.func if isinstance(plan.func, torch.nn.Module) else None
        graphed = GraphedCallable(
            index=plan.index,
            label=plan.label,
            engine=eng,
            pool=mempool,
            pass_id=plan.pass_id,
            static_input_surface=plan.surface,
            static_outputs=plan.static_outputs,
            output_requires_grad=plan.output_requires_grad,
            static_grad_outputs=plan.static_grad_outputs,
            static_grad_inputs=plan.static_grad_inputs,
            output_spec=plan.output_spec,  # type: ignore[arg-type]
            len_user_args=len(plan.flat_args),
            module_params=plan.module_params,
            has_backward=plan.has_backward,
            clone_param_grads_on_return=clone_param_grads_on_return,
            module=module,
            training=plan.training,
            original_forward=plan.original_forward,
            original_forward_is_method=plan.original_forward_is_method,
        )
        if module is not None:
            module.forward = graphed  # type: ignore[method-assign]
            module.reset = graphed.reset  # type: ignore[attr-defined]
            ret.append(module)
        else:
            ret.append(graphed)
        log.debug("gograph: graphed callable %d (%s) as pass %d on the %s engine (backward graph: %s)",
                  plan.index, plan.label, plan.pass_id, eng.name, plan.has_backward)

    if just_one_callable:
        return ret[0]
    return tuple(ret)


# ---------------------------------------------------------------------------------------------
# Small public helpers
# ---------------------------------------------------------------------------------------------
def graph_pool_handle() -> Hashable:
    """An opaque memory-pool token to share between ``make_graphed_callables`` calls.

    With the CUDA core and a CUDA device: ``torch.cuda.graph_pool_handle()``. Otherwise an
    :class:`~gograph.engines.EagerPool` token for the eager engine.
    """
    if _native.cuda_available() and torch.cuda.is_available():
        return torch.cuda.graph_pool_handle()
    return EagerPool()


def live_graphs() -> int:
    """Graphs registered in the core now (captured and not yet destroyed): a leak check."""
    return int(_native.core.live_graphs())


def live_passes() -> int:
    """Pass records the core holds now (graphed callables not yet garbage-collected)."""
    return int(_native.core.live_passes())
