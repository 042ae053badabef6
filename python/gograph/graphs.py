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

TransformerEngine's extensions (``sample_kwargs``, ``_order``/``_num_layers_per_chunk``,
``_reuse_graph_input_output_buffers``, delayed weight gradients, ``capture_time_hooks``,
``pre_warmup_hook``/``post_warmup_hook``, ``retain_graph_in_backward``) are planned by the Go
core (``plan_schedule``, ``plan_buffers``; see :mod:`gograph._schedule`): steps 3-4 then follow
the core's schedule -- the default one (fwd 0..n-1, bwd n-1..0) or the expansion of ``_order``
-- and a *pass* is one forward of one callable (TransformerEngine's indexing).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union, overload

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _native, _observe, _schedule
from .engines import (
    BACKWARD,
    CAPTURE_STATE as _CAPTURE_STATE,
    FORWARD,
    WGRAD,
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
    "StaticInputMismatchError",
]

log = logging.getLogger("gograph")

_ModuleOrCallable = Union[torch.nn.Module, Callable[..., object]]
_T = TypeVar("_T", bound=_ModuleOrCallable)


class StaticInputMismatchError(ValueError, RuntimeError):
    """A graphed callable was called with a tensor whose shape, dtype or device differs from
    its sample arg's. A ValueError (a bad argument) that is also a RuntimeError (what torch
    raises for the same mismatch in eager code)."""


# ---------------------------------------------------------------------------------------------
# Capture bodies: explicit objects, not closures
# ---------------------------------------------------------------------------------------------
_LEAF_SPEC = pytree.tree_flatten(0)[1]  # the treespec of a lone leaf (a callable returning one Tensor)

# autograd's engine entry point, as torch.autograd.grad calls it (stable signature since torch 1.8:
# tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad).
_run_backward: Callable[..., tuple[Tensor | None, ...]] | None = getattr(
    getattr(torch.autograd.Variable, "_execution_engine", None), "run_backward", None)
_autograd_log = logging.getLogger("torch.autograd.graph")


def _autograd_grad(outputs: tuple[Tensor, ...], inputs: tuple[Tensor, ...], grad_outputs: tuple[Tensor, ...],
                   allow_unused: bool, retain_graph: bool = False) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, only_inputs=True, allow_unused=...,
    retain_graph=...)`` for the warmup and capture backwards, whose ``grad_outputs`` are buffers
    made like the outputs (same shape, dtype and device).

    For plain tensors (no ``__torch_function__`` override or mode active) with autograd's debug
    logging off, torch.autograd.grad only normalizes and validates its arguments before calling
    autograd's engine; that Python layer was a fifth of a small layer's warmup iteration (an A/B
    against torch's own warmup loop, CPU), so the engine is called directly. Anything else --
    tensor subclasses, torch function modes, autograd's logging -- goes through
    torch.autograd.grad. The engine raises the same errors (an unused input without
    ``allow_unused``, an output that does not require grad)."""
    if (_run_backward is not None and len(outputs) == len(grad_outputs)
            and not torch._C._has_torch_function(outputs + inputs + grad_outputs)
            and _autograd_log.getEffectiveLevel() > logging.DEBUG):
        return tuple(_run_backward(outputs, grad_outputs, retain_graph, False, inputs, allow_unused,
                                   accumulate_grad=False))
    return tuple(torch.autograd.grad(outputs=outputs, inputs=inputs, grad_outputs=grad_outputs, only_inputs=True,
                                     allow_unused=allow_unused, retain_graph=retain_graph or None))


@functools.lru_cache(maxsize=64)
def _flat_tuple_spec(n: int) -> pytree.TreeSpec:
    """The treespec of a flat tuple of ``n`` leaves (args passed as plain tensors)."""
    return pytree.tree_flatten((0,) * n)[1]


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

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        if self._module_ref is not None:
            module = self._module_ref()
            if module is None:
                raise RuntimeError(f"gograph: the graphed module {self.label} no longer exists")
            out = self._fn(module, *args, **kwargs)
        else:
            out = self._fn(*args, **kwargs)
        if isinstance(out, Tensor):  # the common case, without pytree's flattening
            self.out_spec = _LEAF_SPEC
            return (out,)
        if out is None:
            raise TypeError(
                f"gograph: a graphed callable must return at least one Tensor; {self.label} returned None. "
                "Return the tensors it computes (work that only updates state in place belongs in "
                "torch.cuda.graph)")
        leaves, spec = pytree.tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"gograph: the outputs of a graphed callable must be Tensors (in any pytree "
                    f"structure); output leaf {i} of {self.label} is a {type(leaf).__name__}")
        if not leaves:
            raise TypeError(
                f"gograph: a graphed callable must return at least one Tensor; {self.label} returned "
                f"an empty {type(out).__name__}. Return the tensors it computes (work that only updates "
                "state in place belongs in torch.cuda.graph)")
        self.out_spec = spec
        return tuple(leaves)


class _BackwardBody:
    """``torch.autograd.grad`` of the outputs that require grad with respect to the static inputs
    that require grad, with the static grad-output buffers as incoming gradients. Called with
    the forward outputs it differentiates (the capture's, or on the eager engine the latest
    forward replay's)."""

    __slots__ = ("inputs", "grad_outputs", "output_mask", "allow_unused", "retain_graph")

    def __init__(self, inputs: tuple[Tensor, ...], grad_outputs: tuple[Tensor, ...],
                 output_mask: tuple[bool, ...], allow_unused: bool, retain_graph: bool = False) -> None:
        self.inputs = inputs
        self.grad_outputs = grad_outputs
        self.output_mask = output_mask
        self.allow_unused = allow_unused
        self.retain_graph = retain_graph  # TransformerEngine's retain_graph_in_backward

    def __call__(self, outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
        outs = tuple(o for o, m in zip(outputs, self.output_mask) if m)
        return _autograd_grad(outs, self.inputs, self.grad_outputs, self.allow_unused, self.retain_graph)


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
      that tensor (same ``data_ptr``). Shapes, dtypes and devices must match ``sample_args``:
      a call that differs raises ValueError (no silent broadcast or cast), as do args of another
      pytree structure or count (TypeError), and -- for a callable with a backward graph -- an
      arg that requires grad where its sample arg did not (its grad would be silently dropped).
    * each forward call can be differentiated once: a second backward through the same outputs
      raises RuntimeError (the graph's activations are consumed, as with ``retain_graph=False``).
    * calling a graphed callable while a CUDA graph capture is underway on the calling thread
      (inside another ``make_graphed_callables`` capture or ``torch.cuda.graph``) raises
      RuntimeError: graphs cannot be replayed inside another capture.
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

    TransformerEngine's extensions:

    * captured ``sample_kwargs`` are flattened after the positional args (in key order) into the
      static input surface; every call must pass each captured kwarg by name (a missing one is a
      TypeError), kwargs that were not captured are refused;
    * ``cuda_graph_stream=`` / ``cuda_graph_event=`` (call kwargs, not forwarded): replay on that
      stream after it waits for the current one; the current stream then waits for the event
      (recorded by the graph) or, without one, for the whole stream. Ignored by the eager engine;
    * :meth:`backward_dw` replays the delayed weight-gradient graph (see
      ``make_graphed_callables``), a no-op when no submodule needed one;
    * ``buffer_reuse`` (:class:`gograph._schedule.BufferReuse`, shared by the callables of one
      call) says how ``_reuse_graph_input_output_buffers`` planned the static buffers.
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
        args_spec: pytree.TreeSpec | None = None,
        kwargs_keys: tuple[str, ...] = (),
        kwargs_spec: pytree.TreeSpec | None = None,
        wgrad: _schedule.WgradBody | None = None,
        buffer_reuse: _schedule.BufferReuse | None = None,
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
        # A callable returning one tensor (the common case) skips the pytree rebuild per call.
        self._single_output = output_spec.is_leaf()
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
        # Replay-time argument checks, precomputed so the hot path pays one tuple unpack and a
        # few attribute compares per arg: (static tensor, shape, dtype, device index) per user arg.
        self._input_sig: tuple[tuple[Tensor, torch.Size, torch.dtype, int], ...] = tuple(
            (s, s.shape, s.dtype, s.get_device()) for s in static_input_surface[:len_user_args])
        # The args' pytree structure. When the sample args are a flat tuple of tensors the call's
        # positional args are the leaves and no structure needs comparing (_flat_args).
        self._args_spec = args_spec
        self._flat_args = args_spec is not None and args_spec == _flat_tuple_spec(args_spec.num_leaves)
        # Args whose sample did not require grad: with a backward graph, a call passing one that
        # does would silently lose its grad, so that is refused.
        self._nograd_args: tuple[int, ...] = tuple(
            i for i, s in enumerate(static_input_surface[:len_user_args]) if not s.requires_grad
        ) if has_backward else ()
        # Captured kwargs (TransformerEngine's sample_kwargs): their leaves follow the positional
        # leaves in the static input surface.
        self._kwargs_keys = tuple(kwargs_keys)
        self._kwargs_spec = kwargs_spec
        self._n_pos = len_user_args - (kwargs_spec.num_leaves if kwargs_spec is not None else 0)
        self._wgrad = wgrad
        self.buffer_reuse = buffer_reuse
        self._released = False
        # The finalizer must not reference self: it gets the engine, the pass id and the pool.
        self._finalizer = weakref.finalize(self, engine.finalize_pass, pass_id, pool)
        self._finalizer.atexit = False

    #: What the ``make_graphed_callables`` call that built this callable observed (shared by the
    #: callables of that call): captures with their order, time and memory delta, warmup peak.
    build_stats: _observe.BuildStats | None = None
    #: Whether the core checks this callable's replays against the capture order (debug).
    _check_replay_order: bool = False

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
        opts: tuple[Any, Any] | None = None
        kw_leaves: Sequence[Any] = ()
        if user_kwargs or self._kwargs_keys:
            opts, kw_leaves = self._take_kwargs(user_kwargs)
        if self._flat_args:
            flat: Sequence[Any] = user_args
        elif self._args_spec is not None:
            flat, spec = pytree.tree_flatten(user_args)
            if spec != self._args_spec:
                raise TypeError(
                    f"gograph: graphed callable {self.index} ({self.label}) must be called with args in "
                    f"the pytree structure of its sample_args, {_structure(self._args_spec)}; got "
                    f"{_structure(spec)}. Pass the same nesting (tuples, lists, dict keys in the same order)")
        else:
            flat = pytree.arg_tree_leaves(*user_args)
        if len(flat) != self._n_pos:
            raise TypeError(
                f"gograph: graphed callable {self.index} ({self.label}) was captured with "
                f"{self._n_pos} tensor argument(s) and called with {len(flat)}; pass args in the "
                "structure of its sample_args")
        if kw_leaves:
            flat = (*flat, *kw_leaves)
        if _CAPTURE_STATE.depth:
            self._raise_nested_capture()
        if self._nograd_args and torch.is_grad_enabled():
            for i in self._nograd_args:
                if getattr(flat[i], "requires_grad", False):
                    raise ValueError(
                        f"gograph: argument leaf {i} of graphed callable {self.index} ({self.label}) requires "
                        "grad, but its sample arg did not, so the backward graph computes no grad for it "
                        "and the grad would be silently dropped. Graph it with a sample arg that has "
                        f"requires_grad=True at this position, or pass a detached tensor")
        if self._check_replay_order:  # debug guard: refuse before any static buffer is written
            _observe.check_replay_order(self.pass_id, FORWARD)
        if _functorch_transforms_active():
            out = _GraphedFunction.apply(self, opts, *flat, *self.module_params)
        else:
            out = _apply_graphed_function(self, opts, *flat, *self.module_params)
        if self._check_replay_order:  # the replay-order guard (debug): a forward without backward
            _observe.discard_if_no_backward(self.pass_id, out)
        if self._single_output:
            return out[0]
        return pytree.tree_unflatten(out, self.output_spec)

    def _take_kwargs(self, user_kwargs: dict[str, Any]) -> tuple[tuple[Any, Any] | None, Sequence[Any]]:
        """Splits call kwargs into the replay options (``cuda_graph_stream``,
        ``cuda_graph_event``) and the flat leaves of the captured kwargs, in key order."""
        kwargs = dict(user_kwargs)
        opts = None
        if "cuda_graph_stream" in kwargs or "cuda_graph_event" in kwargs:
            opts = (kwargs.pop("cuda_graph_stream", None), kwargs.pop("cuda_graph_event", None))
        values = []
        for key in self._kwargs_keys:
            if key not in kwargs:
                raise TypeError(
                    f"gograph: graphed callable {self.index} ({self.label}) was initialized with kwarg "
                    f"{key}, but it was not provided in graph replay (TransformerEngine: \"Graphed callable "
                    f"was initialized with kwarg {key} ,but it was not provided in graph replay\")")
            values.append(kwargs.pop(key))
        if kwargs:
            if self._kwargs_keys:
                raise TypeError(
                    f"gograph: graphed callable {self.index} ({self.label}) got keyword arguments "
                    f"{sorted(kwargs)} that were not in its sample_kwargs {list(self._kwargs_keys)}; a graph "
                    "replays only the inputs it was captured with")
            raise TypeError(
                f"gograph: graphed callable {self.index} ({self.label}) takes its arguments positionally, "
                f"in the structure of its sample_args; got keyword arguments {sorted(kwargs)}")
        if not self._kwargs_keys:
            return opts, ()
        leaves, spec = pytree.tree_flatten(values)
        if spec != self._kwargs_spec:
            raise TypeError(
                f"gograph: the keyword arguments {list(self._kwargs_keys)} of graphed callable {self.index} "
                f"({self.label}) must have the pytree structure of its sample_kwargs, "
                f"{_structure(self._kwargs_spec)}; got {_structure(spec)}")  # type: ignore[arg-type]
        return opts, leaves

    def _launch(self, kind: int, opts: tuple[Any, Any] | None) -> None:
        """Replays graph ``kind``; with ``cuda_graph_stream``/``cuda_graph_event`` on the CUDA
        engine, on that stream (TransformerEngine's replay on a side stream)."""
        stream = None if opts is None else opts[0]
        if stream is None or not isinstance(self.engine, CudaEngine):
            self.engine.replay(self.pass_id, kind)
            return
        current = torch.cuda.current_stream(self.engine.device)
        if stream == current:
            self.engine.replay(self.pass_id, kind)
            return
        event = opts[1]  # type: ignore[index]
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self.engine.replay(self.pass_id, kind)
        if event is not None:
            current.wait_event(event)
        else:
            current.wait_stream(stream)

    def _raise_nested_capture(self) -> None:
        raise RuntimeError(
            f"gograph: graphed callable {self.index} ({self.label}) was called while a graph capture is "
            "underway on this thread (inside another make_graphed_callables capture): a graph cannot be "
            "replayed inside a second capture. Graph the callables together in one "
            "make_graphed_callables call (a tuple, in the order they run), or call the original "
            "(ungraphed) module inside the outer callable")

    def _raise_input_mismatch(self, i: int, new: Any) -> None:
        static, shape, dtype, device = self._input_sig[i]
        where = f"argument leaf {i} of graphed callable {self.index} ({self.label})"
        if not isinstance(new, Tensor):
            raise TypeError(f"gograph: {where} is of type {type(new).__name__}, not a Tensor; graphed "
                            "callables take tensors in the structure of their sample_args")
        captured = f"shape {tuple(shape)}, dtype {dtype}, device {static.device}"
        got = f"shape {tuple(new.shape)}, dtype {new.dtype}, device {new.device}"
        raise StaticInputMismatchError(
            f"gograph: {where} has {got}, but the graph was captured with {captured}. A graph replays "
            "fixed shapes, dtypes and devices (it would not broadcast or cast): pass a matching tensor "
            "(e.g. .to(...)), or graph a separate callable for this shape")

    def _raise_reset(self) -> None:
        # The core's lifecycle check produces the authoritative message ("... was reset ...").
        self.engine.replay(self.pass_id, FORWARD)
        raise RuntimeError(f"gograph: graphed callable {self.index} ({self.label}) was reset")

    def _replay_forward(self, inputs: tuple[Tensor, ...], opts: tuple[Any, Any] | None = None) -> tuple[Tensor, ...]:
        # Snapshot the buffers before checking the lifecycle: a reset on another thread clears
        # them after marking the callable released, so either the check sees the reset or the
        # snapshot holds buffers that are still alive (and the core then refuses the replay).
        sig, outputs = self._input_sig, self.static_outputs
        if self._released:
            self._raise_reset()
        i = 0
        for static, shape, dtype, device in sig:
            new = inputs[i]
            if new is not static:
                try:
                    ok = new.shape == shape and new.dtype is dtype and new.get_device() == device
                except AttributeError:  # not a tensor
                    ok = False
                if not ok:
                    self._raise_input_mismatch(i, new)
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            i += 1
        if opts is None:
            self.engine.replay(self.pass_id, FORWARD)
        else:
            self._launch(FORWARD, opts)
        return tuple([o.detach() for o in outputs])

    def _replay_backward(self, grads: tuple[Tensor | None, ...],
                         opts: tuple[Any, Any] | None = None) -> tuple[Tensor | None, ...]:
        # Snapshot before the lifecycle check (see _replay_forward): a concurrent reset either
        # is seen here or leaves these buffers alive while the core refuses the replay.
        static_grad_outputs, static_grad_inputs = self.static_grad_outputs, self.static_grad_inputs
        if self._released:
            self.engine.replay(self.pass_id, BACKWARD)  # raises: "... was reset ..."
            raise RuntimeError(f"gograph: graphed callable {self.index} ({self.label}) was reset")
        if len(grads) != len(static_grad_outputs):
            raise AssertionError(
                f"len(grads)={len(grads)} != len(static_grad_outputs)={len(static_grad_outputs)}")
        for static, grad in zip(static_grad_outputs, grads):
            # don't copy if the incoming grad is already in the right place
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        if opts is None:
            self.engine.replay(self.pass_id, BACKWARD)
        else:
            self._launch(BACKWARD, opts)
        out = [None if b is None else b.detach() for b in static_grad_inputs]
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

    def backward_dw(self) -> None:
        """Replays this pass's delayed weight-gradient graph (TransformerEngine's
        ``backward_dw``): the ``backward_dw()`` work of the submodules that ran in its forward and
        reported ``need_backward_dw()``, captured after its backward (or at its ``-(c+0.5)``
        ``_order`` entry). Call it after the backward of the same forward, before that pass's next
        backward. A no-op when no submodule needed a delayed weight gradient. Then, as
        TransformerEngine does, each such submodule's
        ``_trigger_wgrad_accumulation_and_reduce_hooks()`` runs if it has one.

        After :meth:`reset` it raises RuntimeError saying the callable was reset; it never
        launches a destroyed graph."""
        wgrad = self._wgrad
        if self._released:
            self.engine.replay(self.pass_id, WGRAD)  # the core raises: "... was reset ..."
            raise RuntimeError(f"gograph: graphed callable {self.index} ({self.label}) was reset; "
                               "backward_dw() has no weight-gradient graph to replay")
        if wgrad is None:
            return
        self.engine.replay(self.pass_id, WGRAD)
        for m in wgrad.modules():
            trigger = getattr(m, "_trigger_wgrad_accumulation_and_reduce_hooks", None)
            if trigger is not None and m.need_backward_dw():
                trigger()

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
            self._input_sig = ()
            self._wgrad = None
        log.debug("gograph: reset pass %d (%s)", self.pass_id, self.label)


class _GraphedFunction(torch.autograd.Function):
    """The autograd node of a graphed callable call (torch's ``Graphed``, with the per-callable
    state passed in as the first, non-tensor, argument)."""

    @staticmethod
    def forward(ctx: Any, graphed: GraphedCallable, opts: tuple[Any, Any] | None,  # type: ignore[override]
                *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.graphed = graphed
        ctx.opts = opts  # cuda_graph_stream / cuda_graph_event, also used by the backward
        outputs = graphed._replay_forward(inputs, opts)
        if graphed._nondiff_outputs:
            ctx.mark_non_differentiable(*(outputs[i] for i in graphed._nondiff_outputs))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            # backward(create_graph=True): the graph's backward is not differentiable; torch's
            # once_differentiable makes the returned grads raise on a double backward. Without
            # create_graph autograd already runs this with grad mode off, and the wrapper's
            # no_grad context and input scan would only cost time on every replay.
            return _graphed_backward_once_differentiable(ctx, *grads)
        return _graphed_backward(ctx, *grads)


def _graphed_backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
    """The backward of :class:`_GraphedFunction`: replays the callable's backward graph."""
    graphed: GraphedCallable = ctx.graphed
    if graphed._check_replay_order:  # debug guard: refuse before the grad buffers are written
        _observe.check_replay_order(graphed.pass_id, BACKWARD)
    if getattr(ctx, "gograph_backward_done", False) and not getattr(graphed, "_retain_graph_in_backward", False):
        # The backward graph consumes its forward's activations (captured with
        # retain_graph=False, their pool memory is reused inside the backward graph), so a
        # second run would compute from overwritten memory: refuse, as eager autograd does.
        raise RuntimeError(
            f"gograph: trying to backward through graphed callable {graphed.index} ({graphed.label}) "
            "a second time for the same forward call. A graphed backward can run once per forward "
            "(retain_graph=True cannot keep graph activations unless the callable was graphed with "
            "retain_graph_in_backward=True): call the graphed callable again and backward through "
            "its new outputs")
    ctx.gograph_backward_done = True
    return (None, None, *graphed._replay_backward(grads, ctx.opts))


_graphed_backward_once_differentiable = once_differentiable(_graphed_backward)

# torch.autograd.Function.apply is a Python classmethod that, before the C++ apply, maps over
# every argument with pytree to unwrap dead functorch wrappers: more than half the host time of
# a graphed forward call of a small layer (measured: 15.6 us of Function.apply against 6.6 us
# for the C++ apply with three tensor args). Outside functorch transforms the graphed callable
# calls the C++ apply directly; under vmap/grad it takes torch's path (which refuses, as for
# torch's graphed callables).
_apply_graphed_function = super(torch.autograd.Function, _GraphedFunction).apply  # type: ignore[misc]
_functorch_transforms_active = torch._C._are_functorch_transforms_active


# ---------------------------------------------------------------------------------------------
# make_graphed_callables
# ---------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """Build-time data of one pass -- one callable, or with ``_order`` one forward of one
    callable (discarded once its GraphedCallable exists). ``index`` is the pass index
    (TransformerEngine's per-callable index), ``callable_index`` the callable it runs."""

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
    # TransformerEngine's extensions (see _schedule).
    callable_index: int = -1
    sample_kwargs: dict[str, Any] = field(default_factory=dict)
    kwargs_keys: tuple[str, ...] = ()
    flat_pos: tuple[Tensor, ...] | None = None  # leaves of sample_args (flat_args adds the kwargs')
    te_grads: bool = False  # TE's grad rules: unused params dropped from the surface
    wgrad_modules: dict[int, Any] = field(default_factory=dict)  # delayed-wgrad submodules seen
    need_dw: bool = False
    dw_rng: bool | None = None
    wgrad_body: _schedule.WgradBody | None = None
    output_meta: tuple[tuple[tuple[Any, ...], bool], ...] = ()  # per output (signature, requires_grad)
    grad_output_slots: tuple[Tensor | None, ...] = ()  # shared grad-output buffers (buffer reuse)
    args_spec: pytree.TreeSpec | None = None  # the pytree structure of sample_args
    wgrad_candidates: tuple[Any, ...] | None = None  # _schedule.wgrad_candidates of the callable
    warmup_grad_outputs: tuple[Tensor | None, ...] | None = None  # reused across warmup iterations

    def __post_init__(self) -> None:
        if self.callable_index < 0:
            self.callable_index = self.index
        if self.flat_pos is None:
            self.flat_pos = self.flat_args

    @property
    def surface(self) -> tuple[Tensor, ...]:
        return self.flat_args + self.module_params

    @property
    def capture_body(self) -> Any:
        """The forward body engines record, called with :attr:`body_args`."""
        if self.kwargs_keys:
            return _schedule.CallWithKwargs(self.body, len(self.sample_args), self.kwargs_keys)
        return self.body

    @property
    def body_args(self) -> tuple[Any, ...]:
        return (*self.sample_args, *(self.sample_kwargs[k] for k in self.kwargs_keys))

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


class _Leaf:
    __slots__ = ()

    def __repr__(self) -> str:
        return "T"


def _structure(spec: pytree.TreeSpec) -> str:
    """A one-line picture of an args structure, leaves drawn as T: ``({'a': T, 'b': T},)``."""
    try:
        return repr(pytree.tree_unflatten([_Leaf()] * spec.num_leaves, spec))
    except Exception:  # pragma: no cover - exotic node types
        return str(spec).replace("\n", "")


def _check_outputs(plan: _Plan, outputs: Sequence[Tensor], engine: Engine) -> None:
    """On the CUDA engine, refuses forward outputs off the engine's device (a graph cannot
    produce them). Runs at warmup and capture only, not on the replay path.

    Outputs that alias inputs (``lambda x: x``, views of inputs or parameters) are allowed, as
    in torch: the output then aliases the static input, which the next call's args overwrite --
    the same rule as for every output (see :class:`GraphedCallable`)."""
    if not isinstance(engine, CudaEngine):
        return
    device = engine.device
    for k, o in enumerate(outputs):
        if o.device != device:
            raise ValueError(
                f"gograph: output leaf {k} of callable {plan.index} ({plan.label}) is on {o.device}, but "
                f"graphs are captured on {device}: a CUDA graph can only produce tensors on its device. "
                "Keep outputs on the device and move them after the call")


def _refuse_nested_build() -> None:
    """make_graphed_callables cannot run inside a capture: its warmup synchronizes and its own
    captures cannot nest in another."""
    capturing = _CAPTURE_STATE.depth > 0
    if not capturing and torch.cuda.is_initialized():
        try:
            capturing = bool(torch.cuda.is_current_stream_capturing())
        except Exception:  # no usable CUDA: nothing can be capturing
            capturing = False
    if capturing:
        raise RuntimeError(
            "gograph: make_graphed_callables was called while a CUDA graph capture is underway on the "
            "current stream (inside torch.cuda.graph, or inside a callable being captured by another "
            "make_graphed_callables). Graphs cannot be built inside a capture: call "
            "make_graphed_callables before (outside) the capture, or graph all callables in one call")


def _validate_callables(callables: Any, num_warmup_iters: Any,
                        ordered: bool = False) -> tuple[_ModuleOrCallable, ...]:
    """Argument checks that need no engine. Returns the callables tuple. With ``_order``
    (``ordered``) a module may appear more than once: its forward is not replaced."""
    if len(callables) == 0:
        raise ValueError("gograph: make_graphed_callables got an empty tuple of callables; pass a module or "
                         "function, or a non-empty tuple of them (with one tuple of sample args each)")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int):
        raise TypeError(f"gograph: num_warmup_iters must be an int >= 0, got {type(num_warmup_iters).__name__}")
    if num_warmup_iters < 0:
        raise ValueError(f"gograph: num_warmup_iters must be >= 0, got {num_warmup_iters}")
    seen: dict[int, int] = {}
    modes: dict[bool, list[int]] = {True: [], False: []}
    for i, c in enumerate(callables):
        if isinstance(c, (list, tuple)):
            raise TypeError(
                f"gograph: callable {i} is a {type(c).__name__}; callables must be a module or function, or a "
                "flat tuple of them (convert a list with tuple(...), and pass sample_args as a tuple of tuples)")
        if isinstance(c, GraphedCallable):
            raise TypeError(
                f"gograph: callable {i} ({c.label}) is already a graphed callable; pass the original module "
                "or function (a graph cannot be captured inside another graph)")
        if not callable(c):
            raise TypeError(f"gograph: callable {i} (of type {type(c).__name__}) is not callable; pass "
                            "torch.nn.Modules or functions")
        if isinstance(c, torch.nn.Module):
            if id(c) in seen and not ordered:
                raise ValueError(
                    f"gograph: callable {i} is the same module as callable {seen[id(c)]} ({_label(c)}). Each "
                    "module is graphed once (its forward is replaced); to run a layer several times per "
                    "step, graph separate copies of it")
            seen[id(c)] = i
            fwd = c.__dict__.get("forward")
            if isinstance(fwd, GraphedCallable) and not fwd.is_reset:
                raise ValueError(
                    f"gograph: module {i} ({_label(c)}) is already graphed (its forward is a live "
                    "GraphedCallable). Call its reset() first to release those graphs, then graph it again")
            modes[bool(c.training)].append(i)
    if modes[True] and modes[False]:
        raise ValueError(
            "gograph: make_graphed_callables needs the modules all in training mode or all in eval mode "
            f"(modules {modes[True]} are training, {modes[False]} are in eval); call .train() or .eval() "
            "on all of them, or graph the two groups in separate calls")
    return tuple(callables)


def _check_devices(plans: Sequence[_Plan], engine: Engine) -> None:
    """On the CUDA engine every sample arg and parameter must be on the engine's device."""
    if not isinstance(engine, CudaEngine):
        return
    device = engine.device
    for plan in plans:
        for j, t in enumerate(plan.flat_args):
            if t.device != device:
                raise ValueError(
                    f"gograph: sample arg leaf {j} of callable {plan.index} ({plan.label}) is on {t.device}, "
                    f"but the CUDA engine captures on {device}; move it there (e.g. .to('{device}')): "
                    "graphs read their inputs from that device's memory")
        for k, p in enumerate(plan.module_params):
            if p.device != device:
                names = {id(q): n for n, q in plan.func.named_parameters()} if isinstance(
                    plan.func, torch.nn.Module) else {}
                raise ValueError(
                    f"gograph: parameter {names.get(id(p), k)!r} of callable {plan.index} ({plan.label}) "
                    f"is on {p.device}, but the CUDA engine captures on {device}; move the module there "
                    f"first (module.to('{device}'))")


def _check_pool(pool: Any, engine: Engine) -> None:
    if pool is None or not isinstance(engine, CudaEngine):
        return
    if not (isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool)):
        raise TypeError(
            f"gograph: pool must be a memory-pool token from gograph.graph_pool_handle() or "
            f"torch.cuda.graph_pool_handle() (a pair of ints) for the CUDA engine, got {pool!r}")


def _warmup_forward(plan: _Plan, engine: Engine, hooks: _schedule.CaptureTimeHooks, func: Any) -> tuple[Tensor, ...]:
    """One warmup forward of ``plan`` (its capture-time hooks around it, outside any capture),
    discovering the submodules with delayed weight gradients that run in it."""
    hooks.forward_pre(plan.callable_index, func, plan.sample_args, plan.sample_kwargs)
    if plan.wgrad_candidates is None:  # the module tree is fixed while graphing: look once
        plan.wgrad_candidates = _schedule.wgrad_candidates(func)
    with torch.set_grad_enabled(plan.grad_enabled), (
            _schedule.discover_wgrad_modules(func, plan.wgrad_modules, plan.wgrad_candidates)
            if plan.wgrad_candidates else contextlib.nullcontext()):
        before = engine.rng_marker()
        outputs = plan.body(*plan.sample_args, **plan.sample_kwargs)
        after = engine.rng_marker()
    plan.fwd_rng = bool(plan.fwd_rng) or before != after
    _check_outputs(plan, outputs, engine)
    plan.output_meta = tuple((_schedule.tensor_signature(o), bool(o.requires_grad)) for o in outputs)
    if plan.wgrad_modules:
        plan.te_grads = True  # its weights get their grads from backward_dw, not the backward
    if hooks.hooks is not None:
        hooks.forward(plan.callable_index, func, plan.sample_args, plan.sample_kwargs,
                      pytree.tree_unflatten(list(outputs), plan.body.out_spec))  # type: ignore[arg-type]
    return outputs


def _warmup_backward(plan: _Plan, outputs: tuple[Tensor, ...], engine: Engine,
                     hooks: _schedule.CaptureTimeHooks, func: Any, allow_unused_input: bool, it: int) -> None:
    """One warmup backward of ``plan`` in a schedule step (capture-time hooks around it), with
    TransformerEngine's grad rules when ``plan.te_grads`` (:func:`_apply_te_grad_rules`). Its
    zero grads are fresh: other passes' steps run before this plan's next iteration."""
    mask = tuple(bool(o.requires_grad) for o in outputs)
    if not any(mask):
        return
    grad_outputs = _warmup_grad_outputs(plan, outputs, mask, False)
    hooks.backward_pre(plan.callable_index, func, grad_outputs)
    inputs = plan.grad_surface
    before = engine.rng_marker()
    grads = _autograd_grad(tuple(o for o, m in zip(outputs, mask) if m), inputs,
                           tuple(g for g in grad_outputs if g is not None),
                           True if plan.te_grads else allow_unused_input)
    plan.bwd_rng = bool(plan.bwd_rng) or before != engine.rng_marker()
    hooks.backward(plan.callable_index, func, grads, grad_outputs)
    if plan.te_grads:
        _apply_te_grad_rules(plan, inputs, grads, allow_unused_input, it)


def _apply_te_grad_rules(plan: _Plan, inputs: tuple[Tensor, ...], grads: tuple[Tensor | None, ...],
                         allow_unused_input: bool, it: int) -> None:
    """TransformerEngine's rules after a warmup backward (``plan.te_grads``): a sample arg that
    got no grad is an error unless ``allow_unused_input``; parameters that got none in the first
    iteration leave the static input surface (and may not appear later)."""
    n_user = sum(1 for t in plan.flat_args if t.requires_grad)
    kept = []
    for k, g in enumerate(grads):
        if k < n_user:
            if g is None and not allow_unused_input:
                raise RuntimeError("The input tensor requires grad, but the grad is None after backward pass.")
        elif g is not None:
            kept.append(inputs[k])
    if len(kept) != len(plan.module_params):
        if it != 0:
            raise RuntimeError(
                "no-grad params should only be used as inputs in the first warmup"
                f" iteration, but found in iteration {it}")
        plan.module_params = tuple(kept)


def _warmup_grad_outputs(plan: _Plan, outputs: tuple[Tensor, ...], mask: tuple[bool, ...],
                         reuse: bool) -> tuple[Tensor | None, ...]:
    """Zero incoming grads for a warmup backward (zeros, not torch's empty_like: uninitialised
    memory can hold NaNs that anomaly detection or a hook would trip on). With ``reuse`` (the
    per-callable loop of :func:`_warmup`, which has no capture-time hooks that could write them),
    the buffers of the plan's previous warmup iteration serve again when they still match
    (autograd only reads them); the caller drops them after the plan's last iteration."""
    prev = plan.warmup_grad_outputs if reuse else None
    if prev is not None and len(prev) == len(outputs) and all(
            (p is None) == (not m) and (p is None or (p.shape == o.shape and p.dtype == o.dtype
                                                      and p.device == o.device and p.stride() == o.stride()))
            for p, o, m in zip(prev, outputs, mask)):
        return prev
    grads = tuple(torch.zeros_like(o) if m else None for o, m in zip(outputs, mask))
    if reuse:
        plan.warmup_grad_outputs = grads
    return grads


def _warmup_dw(plan: _Plan, engine: Engine, kind: str, entry: str | None, it: int) -> None:
    """Runs the delayed weight-gradient work of ``plan`` in warmup (TransformerEngine runs it
    right after each warmup backward; with an ``_order`` entry for it, at that entry) and
    checks it against the order: ``kind`` is the step ("B" for a backward without a paired
    ``-(c+0.5)`` entry, "W" for such an entry), ``entry`` names it (None without ``_order``)."""
    mods = list(plan.wgrad_modules.values())
    need = any(m.need_backward_dw() for m in mods)
    if entry is not None and kind == _schedule.WGRAD_STEP and not need:
        raise _schedule.ScheduleError(
            f"gograph: {entry}: a weight-gradient entry for pass {plan.index} ({plan.label}), but no "
            "submodule that ran in its forward needs a delayed weight gradient (none defines "
            "need_backward_dw() and backward_dw() with need_backward_dw() True). TransformerEngine: "
            "\"No module needs wgrad computation but get float in order\"")
    if entry is not None and kind == _schedule.BACKWARD_STEP and need:
        names = sorted({type(m).__name__ for m in mods if m.need_backward_dw()})
        raise _schedule.ScheduleError(
            f"gograph: {entry}: pass {plan.index} ({plan.label}) needs a delayed weight gradient "
            f"(need_backward_dw() of {', '.join(names)} is True), but no -(c+0.5) entry of its chunk pairs "
            "with this backward; every backward of a chunk that delays its weight gradient needs one "
            "(TransformerEngine: \"Number of wgrad graph doesn't match number of dgrad graphs\")")
    plan.need_dw = need
    if not need:
        return
    before = engine.rng_marker()
    for m in mods:
        if m.need_backward_dw():
            m.backward_dw()
    plan.dw_rng = bool(plan.dw_rng) or before != engine.rng_marker()


_NO_HOOKS = _schedule.CaptureTimeHooks(None)


def _warmup(plan: _Plan, engine: Engine, iters: int, allow_unused_input: bool, func: Any = None) -> None:
    """torch's warmup: ``iters`` forward+backward iterations of one callable (and its delayed
    weight-gradient work, when it has some) -- what :func:`_warmup_forward` and
    :func:`_warmup_backward` do per schedule step, as one loop: it runs ``num_warmup_iters`` times
    per callable, and for small layers its per-iteration Python was a tenth of graphing time on
    the H200. So generator offsets are read once between steps instead of around each, the output
    checks run on the first iteration (the capture checks again), the grad surface is taken once
    unless TransformerEngine's rules may shrink it, and the zero grads are reused."""
    if iters <= 0:
        plan.fwd_rng = plan.bwd_rng = plan.dw_rng = None  # unknown: captures carry RNG state to be safe
        return
    plan.fwd_rng = plan.bwd_rng = plan.dw_rng = False
    if plan.wgrad_candidates is None:  # the module tree is fixed while graphing: look once
        plan.wgrad_candidates = _schedule.wgrad_candidates(func)
    candidates = plan.wgrad_candidates
    marker = engine.rng_marker
    body, args, kwargs = plan.body, plan.sample_args, plan.sample_kwargs
    inputs = plan.grad_surface
    try:
        with (contextlib.nullcontext() if torch.is_grad_enabled() == plan.grad_enabled
              else torch.set_grad_enabled(plan.grad_enabled)):
            at = marker()
            for it in range(iters):
                if candidates:
                    with _schedule.discover_wgrad_modules(func, plan.wgrad_modules, candidates):
                        outputs = body(*args, **kwargs)
                else:
                    outputs = body(*args, **kwargs)
                after_forward = marker()
                if after_forward != at:
                    plan.fwd_rng = True
                at = after_forward
                if it == 0:
                    _check_outputs(plan, outputs, engine)
                    plan.output_meta = tuple((_schedule.tensor_signature(o), bool(o.requires_grad))
                                             for o in outputs)
                if plan.wgrad_modules:
                    plan.te_grads = True  # its weights get their grads from backward_dw, not the backward
                mask = tuple(o.requires_grad for o in outputs)
                if any(mask):
                    if plan.te_grads:
                        inputs = plan.grad_surface  # the first iteration may have dropped parameters
                    grad_outputs = _warmup_grad_outputs(plan, outputs, mask, True)
                    grads = _autograd_grad(tuple(o for o, m in zip(outputs, mask) if m), inputs,
                                           tuple(g for g in grad_outputs if g is not None),
                                           True if plan.te_grads else allow_unused_input)
                    del grad_outputs
                    at = marker()
                    if at != after_forward:
                        plan.bwd_rng = True
                    if plan.te_grads:
                        _apply_te_grad_rules(plan, inputs, grads, allow_unused_input, it)
                    del grads
                del outputs  # released before the next forward, as torch's warmup does
                if plan.wgrad_modules:
                    _warmup_dw(plan, engine, _schedule.BACKWARD_STEP, None, it)
                    at = marker()  # _warmup_dw accounts for its own generator use
    finally:
        plan.warmup_grad_outputs = None  # one plan's grad buffers alive at a time, as without reuse


def _warmup_schedule(plans: Sequence[_Plan], sched: _schedule.Schedule, engine: Engine, iters: int,
                     allow_unused_input: bool, hooks: _schedule.CaptureTimeHooks,
                     callables: Sequence[Any], track: Callable[[_Plan], None]) -> None:
    """Warmup iterations that run the schedule's steps in order (``_order``, or fwd 0..n-1 then
    bwd n-1..0 when capture-time hooks are given): each forward's outputs live until its
    backward step; weight-gradient work runs at its ``-(c+0.5)`` entry, or right after the
    backward when the order has none for it."""
    for plan in plans:
        plan.fwd_rng = plan.bwd_rng = plan.dw_rng = False if iters > 0 else None
    for it in range(iters):
        live: dict[int, tuple[Tensor, ...]] = {}
        for step in sched.steps:
            plan = plans[step.pass_index]
            track(plan)
            func = callables[plan.callable_index]
            entry = sched.entry_name(step.entry) if sched.ordered else None
            if step.kind == _schedule.FORWARD_STEP:
                live[plan.index] = _warmup_forward(plan, engine, hooks, func)
            elif step.kind == _schedule.BACKWARD_STEP:
                outputs = live.pop(plan.index, None)
                if outputs is None:
                    continue
                _warmup_backward(plan, outputs, engine, hooks, func, allow_unused_input, it)
                del outputs
                if plan.index not in sched.wgrad_step_of and plan.wgrad_modules:
                    _warmup_dw(plan, engine, step.kind, entry, it)
            else:
                _warmup_dw(plan, engine, step.kind, entry, it)
        live.clear()


def _capture_forward(plan: _Plan, engine: Engine, pool: Hashable) -> tuple[Tensor, ...]:
    with torch.set_grad_enabled(plan.grad_enabled):
        outputs = engine.capture(plan.pass_id, FORWARD, plan.capture_body, *plan.body_args,
                                 pool=pool, uses_rng=plan.fwd_rng)
    _check_outputs(plan, outputs, engine)  # type: ignore[arg-type]
    plan.output_spec = plan.body.out_spec
    return tuple(outputs)  # type: ignore[arg-type]  # a forward body returns only tensors


def _grad_output_buffer(plan: _Plan, k: int, o: Tensor, engine: Engine) -> Tensor:
    """The static buffer output ``k``'s incoming grad is copied into: its shared slot (buffer
    reuse) when the planned signature still matches, else a new tensor -- uninitialised on the
    CUDA engine, as in torch and TransformerEngine (every backward replay copies the incoming
    grad into it first, autograd materializing a missing grad as zeros, and a graph capture
    computes no values), zeros on the eager engine, whose capture does run the backward (NaNs
    from uninitialised memory would trip anomaly detection)."""
    slots = plan.grad_output_slots
    slot = slots[k] if k < len(slots) else None
    if slot is not None and _schedule.tensor_signature(slot) == _schedule.tensor_signature(o):
        return slot
    return torch.empty_like(o) if isinstance(engine, CudaEngine) else torch.zeros_like(o)


def _capture_backward(plan: _Plan, outputs: tuple[Tensor, ...], engine: Engine, pool: Hashable,
                      allow_unused_input: bool, retain_graph: bool = False,
                      hooks: _schedule.CaptureTimeHooks = _NO_HOOKS, func: Any = None) -> None:
    mask = tuple(bool(o.requires_grad) for o in outputs)
    static_grad_outputs = tuple(_grad_output_buffer(plan, k, o, engine) if rg else None
                                for k, (o, rg) in enumerate(zip(outputs, mask)))
    grad_inputs: tuple[Tensor | None, ...] | None = None
    if any(mask):
        hooks.backward_pre(plan.callable_index, func, static_grad_outputs)
        body = _BackwardBody(plan.grad_surface, tuple(g for g in static_grad_outputs if g is not None),
                             mask, allow_unused_input or plan.te_grads, retain_graph)
        grad_inputs = engine.capture(plan.pass_id, BACKWARD, body, outputs, pool=pool, uses_rng=plan.bwd_rng)
        plan.has_backward = True
        hooks.backward(plan.callable_index, func, grad_inputs, static_grad_outputs)
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


def _capture_wgrad(plan: _Plan, engine: Engine, pool: Hashable) -> None:
    """Captures ``plan``'s delayed weight-gradient graph (core kind 2, "wgrad")."""
    body = _schedule.WgradBody(list(plan.wgrad_modules.values()), plan.label)
    engine.capture(plan.pass_id, WGRAD, body, pool=pool, uses_rng=plan.dw_rng)
    plan.wgrad_body = body


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
    debug_replay_order: bool | None = None,
    progress: bool = False,
    sample_kwargs: Any = None,
    _order: Sequence[int | float] | None = None,
    _num_layers_per_chunk: int | Sequence[int] | None = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    capture_time_hooks: Sequence[dict[str, dict[Any, Any]] | None] | None = None,
    _clone_param_grads_on_return: bool | None = None,
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
    debug_replay_order: bool | None = None,
    progress: bool = False,
    sample_kwargs: Any = None,
    _order: Sequence[int | float] | None = None,
    _num_layers_per_chunk: int | Sequence[int] | None = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    capture_time_hooks: Sequence[dict[str, dict[Any, Any]] | None] | None = None,
    _clone_param_grads_on_return: bool | None = None,
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
    debug_replay_order: bool | None = None,
    progress: bool = False,
    sample_kwargs: Any = None,
    _order: Sequence[int | float] | None = None,
    _num_layers_per_chunk: int | Sequence[int] | None = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    capture_time_hooks: Sequence[dict[str, dict[Any, Any]] | None] | None = None,
    _clone_param_grads_on_return: bool | None = None,
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
        debug_replay_order: check every replay, in the Go core, against the capture order of
            the graphs that share its memory pool, and raise RuntimeError (naming both graphed
            callables) at the first replay that could overwrite memory another graphed callable
            still needs -- e.g. a forward replayed while another callable's backward, which
            reads memory this forward's capture could reuse, is still pending. Replaying in
            capture order (fwd 1..n, bwd n..1; a pipeline schedule captured with its own order;
            forward-only chains) never raises. None (default) reads the ``GOGRAPH_DEBUG``
            environment variable ("1" turns it on). Off, a replay pays one bool check. See
            docs/API.md for the rule.
        progress: show a progress bar over the captures (needs tqdm; without it, building
            proceeds without one). Each capture's time and memory delta are also logged at INFO
            on the ``gograph`` logger.

    TransformerEngine's arguments (everything but its FP8/quantization ones), with its semantics
    and indexing, planned by the Go core:

        sample_kwargs: keyword args of each forward pass: a dict for a single callable, else one
            dict (or None) per callable -- per *forward pass* with ``_order``. Their tensor leaves
            follow the positional leaves (in the dicts' key order) in the static input surface;
            each call must pass every captured kwarg by name.
        _order: the pipeline schedule of interleaved pipeline parallelism (Megatron-LM): 1-based
            chunk ids, ``c`` runs chunk c's forward for its next microbatch, ``-c`` its backward,
            ``-(c+0.5)`` the delayed weight-gradient pass paired with chunk c's latest backward.
            Each entry runs every layer of the chunk (callables are layers, grouped in chunks).
            ``sample_args`` (and ``sample_kwargs``) then hold one entry per forward pass, pass
            ``prefix[c]*num_microbatches + m*layers[c] + l`` for layer l of chunk c, microbatch
            m, where ``prefix[c]`` counts the layers of the chunks before c; the result is a
            tuple of one :class:`GraphedCallable` per pass in that order (modules keep their
            forward). Warmup and capture run the schedule's steps exactly in order. In eval mode
            the order lists forward entries only. A malformed order raises ValueError naming the
            entry and the rule.
        _num_layers_per_chunk: layers per chunk: an int for all chunks or a list (default:
            ``len(sample_args) / (chunks * microbatches)`` each). Required, with one layer per
            chunk, when ``_order`` has weight-gradient entries.
        retain_graph_in_backward: capture the backward with ``retain_graph=True``.
        _reuse_graph_input_output_buffers: share static input and grad-output buffers between
            passes whose lifetimes over the schedule do not overlap and whose tensors have the
            same shape, strides, dtype and device (slots assigned by the core; never more than
            TransformerEngine's FIFO scheme needs), and, on the CUDA engine, hand outputs, input
            grads and cloned parameter grads back to the graph pool once the schedule is past
            their last use. Needs ``_order`` and training. The plan is the ``buffer_reuse``
            attribute (:class:`gograph._schedule.BufferReuse`) of every returned callable.
            An output or input grad returned by a call is then valid only until the schedule
            reuses its memory (the next microbatch's step that TransformerEngine assumes).
        pre_warmup_hook, post_warmup_hook: called once (no arguments) before and after all
            warmup iterations, on the warmup stream; ``post_warmup_hook`` also runs when
            warmup fails after ``pre_warmup_hook`` ran.
        capture_time_hooks: one dict (or None) per callable with the keys
            ``forward_pre_hooks``, ``forward_pre_hooks_with_kwargs``, ``forward_hooks``,
            ``forward_hooks_with_kwargs``, ``backward_pre_hooks``, ``backward_hooks``, each
            mapping hook ids to hooks with the signatures of the ``torch.nn.Module`` hooks
            (the module first; ``*_with_kwargs`` hold the ids whose hook also takes kwargs).
            They run around every warmup and capture step -- outside the capture, never
            replayed -- in schedule order (forwards 0..n-1, then backwards n-1..0 without
            ``_order``), and must return None.
        _clone_param_grads_on_return: TransformerEngine's name for
            ``clone_param_grads_on_return`` (wins when given).

    Delayed weight gradients: any submodule that runs in a callable's forward and defines
    ``need_backward_dw()`` and ``backward_dw()`` (TransformerEngine's protocol, without its
    module classes) gets its ``backward_dw()`` work, when ``need_backward_dw()`` is True after a
    warmup backward, captured into a separate graph of the pass (after its backward, or at the
    ``-(c+0.5)`` entry of ``_order``); the returned callable's :meth:`GraphedCallable.backward_dw`
    replays it. Its weights, which get no grad from the backward, leave the static input
    surface. Every returned callable has ``reset()`` and ``backward_dw()``.

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
        RuntimeError: autocast with caching enabled; CUDA tensors without the CUDA core; called
            while a CUDA graph capture is underway (inside ``torch.cuda.graph`` or inside a
            callable being captured by another ``make_graphed_callables``).
        AssertionError: module hooks present, buffers requiring grad, non-Tensor sample leaves
            (torch's messages, plus which leaf of which callable).
        ValueError: an empty tuple of callables; sample_args not one tuple per callable; modules
            mixing training and eval mode; the same module twice; a module already graphed and
            not reset; sample args or parameters off the CUDA engine's device (or on several
            devices); on the CUDA engine, an output off its device (in warmup).
        TypeError: a list (not a tuple) of callables, a non-callable, a GraphedCallable passed as
            a callable, a bad ``num_warmup_iters`` or pool token; a callable that returns no
            tensor or non-tensor leaves (in warmup, or in capture without warmup).
        Exception: an exception raised by a callable during warmup or capture is raised again
            (same type, chained) naming the callable index and the phase ("warmup",
            "forward capture", "backward capture"); every pass created so far is released and
            the generator state restored.
    """
    _refuse_nested_build()
    ordered = _order is not None
    just_one_callable = not isinstance(callables, tuple)
    if just_one_callable:
        callables_t: tuple[_ModuleOrCallable, ...] = (callables,)  # type: ignore[assignment]
        args_t: tuple[tuple[Any, ...], ...] = (sample_args,)  # type: ignore[assignment]
    else:
        callables_t = callables  # type: ignore[assignment]
        args_t = sample_args  # type: ignore[assignment]
    if ordered and isinstance(args_t, list):
        args_t = tuple(args_t)  # TransformerEngine takes a list with _reuse_graph_input_output_buffers
    if not isinstance(args_t, tuple) or (not ordered and len(args_t) != len(callables_t)):
        raise ValueError(
            f"gograph: sample_args must hold one tuple of args per callable ({len(callables_t)} callables, "
            f"got {len(args_t) if isinstance(args_t, tuple) else type(args_t).__name__})")
    callables_t = _validate_callables(callables_t, num_warmup_iters, ordered=ordered)
    if _clone_param_grads_on_return is not None:
        clone_param_grads_on_return = bool(_clone_param_grads_on_return)
    if not isinstance(retain_graph_in_backward, bool):
        raise TypeError(f"gograph: retain_graph_in_backward must be a bool, got {type(retain_graph_in_backward).__name__}")
    if _reuse_graph_input_output_buffers and not ordered:
        raise ValueError("`_order` must be provided when `_reuse_graph_input_output_buffers` is True.")
    hooks = _schedule.CaptureTimeHooks(_schedule.canonicalize_capture_time_hooks(len(callables_t), capture_time_hooks))
    for name, hook in (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"gograph: {name} must be callable (called once, without arguments), got {type(hook).__name__}")
    kwargs_t = _schedule.canonicalize_sample_kwargs(sample_kwargs, len(args_t), just_one_callable, ordered,
                                                    len(callables_t))
    # TransformerEngine: with _order, all modules are in training or all in inference mode.
    training = torch.is_grad_enabled() and all(
        c.training for c in callables_t if isinstance(c, torch.nn.Module))
    if _reuse_graph_input_output_buffers and not training:
        raise RuntimeError("`_reuse_graph_input_output_buffers` is only available in training mode.")
    # The schedule (Go): _order validated and expanded, or fwd 0..n-1, bwd n-1..0.
    sched = _schedule.plan_schedule(_order, _num_layers_per_chunk, len(callables_t), len(args_t),
                                    training if ordered else True, num_warmup_iters)

    for i, c in enumerate(callables_t):
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

    # One plan per pass: per callable, or with _order per forward pass (TransformerEngine's
    # indexing: the schedule's pass -> callable map).
    plans: list[_Plan] = []
    for i, (args, kwargs) in enumerate(zip(args_t, kwargs_t)):
        ci = sched.callable_of[i]
        c = callables_t[ci]
        if not isinstance(args, tuple):
            args = (args,) if isinstance(args, Tensor) else tuple(args)
        pos_leaves, args_spec = pytree.tree_flatten(args)
        flat_pos = tuple(pos_leaves)
        keys = tuple(kwargs)
        flat_kw = tuple(pytree.tree_leaves([kwargs[k] for k in keys]))
        flat = flat_pos + flat_kw
        if not all(isinstance(arg, Tensor) for arg in flat):
            bad = next(j for j, arg in enumerate(flat) if not isinstance(arg, Tensor))
            what = "sample args" if bad < len(flat_pos) else "sample_kwargs"
            raise AssertionError(
                "In the beta API, sample_args "
                + "for each callable must contain only Tensors. Other types are not allowed."
                + f" (gograph: leaf {bad} of the {what} of {'pass' if ordered else 'callable'} {i} ({_label(c)}) "
                + f"is a {type(flat[bad]).__name__}; pass tensors only, and bind other values into the callable, "
                + "e.g. with functools.partial)"
            )
        label = _label(c)
        if ordered:
            step = sched.steps[next(k for k, st in enumerate(sched.steps) if st.pass_index == i)]
            label = f"{label}[chunk {step.chunk} layer {step.layer} microbatch {step.micro}]"
        if isinstance(c, torch.nn.Module):
            stale_dw = c.__dict__.get("backward_dw")
            if isinstance(getattr(stale_dw, "__self__", None), GraphedCallable):
                del c.__dict__["backward_dw"]  # set by an earlier (reset) graphing of this module
            fwd = c.forward
            if isinstance(fwd, GraphedCallable) and fwd._original_forward is not None:
                # Graphed before and reset since (_validate_callables refuses a live one): graph
                # the original forward again.
                fn, is_method = fwd._original_forward, fwd._original_forward_is_method
            else:
                is_method = inspect.ismethod(fwd) and fwd.__self__ is c
                fn = fwd.__func__ if is_method else fwd
            plan = _Plan(
                index=i, func=c, label=label, sample_args=args, flat_args=flat,
                module_params=tuple(c.parameters()), training=c.training,
                grad_enabled=training if ordered else torch.is_grad_enabled() and c.training,
                body=_ForwardBody(fn, c if is_method else None, label),
                original_forward=fn, original_forward_is_method=is_method,
                callable_index=ci, sample_kwargs=kwargs, kwargs_keys=keys, flat_pos=flat_pos, te_grads=ordered,
                args_spec=args_spec,
            )
        else:
            plan = _Plan(
                index=i, func=c, label=label, sample_args=args, flat_args=flat, module_params=(),
                training=None, grad_enabled=training if ordered else torch.is_grad_enabled(),
                body=_ForwardBody(c, None, label),
                callable_index=ci, sample_kwargs=kwargs, kwargs_keys=keys, flat_pos=flat_pos, te_grads=ordered,
                args_spec=args_spec,
            )
        plans.append(plan)

    eng = _resolve_engine(engine, plans)
    _check_devices(plans, eng)
    _check_pool(pool, eng)
    if _autocast_cache_active(eng):
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set `cache_enabled=False`."
        )
    mempool = eng.new_pool() if pool is None else pool

    rng_state = eng.get_rng_state()
    # Observation (gograph._observe): capture order/time/memory, warmup peak, progress bar.
    build = _observe.BuildStats.begin(
        eng, expected_captures=sum(1 + int(p.grad_enabled) for p in plans) + len(sched.wgrad_step_of),
        progress=progress,
        debug_replay_order=_observe.debug_env() if debug_replay_order is None else bool(debug_replay_order))
    created: list[int] = []
    phase = "setup"
    current: _Plan | None = None

    def track(plan: _Plan) -> None:
        nonlocal current
        current = plan

    try:
        for plan in plans:
            current = plan
            plan.pass_id = eng.new_pass(plan.index, plan.label)
            created.append(plan.pass_id)

        # Warmup: keeps lazy initialisation (cuBLAS handles, cudnn benchmarking, ...) out of
        # the captures, tells which callables consume generator state and which have delayed
        # weight gradients. With _order (or capture-time hooks) it runs the schedule's steps.
        phase = "warmup"
        build.warmup_started()
        with eng.warmup_context():
            post_pending = False
            try:
                if pre_warmup_hook is not None:
                    pre_warmup_hook()
                post_pending = post_warmup_hook is not None
                if ordered or hooks.hooks is not None:
                    _warmup_schedule(plans, sched, eng, num_warmup_iters, allow_unused_input, hooks,
                                     callables_t, track)
                else:
                    for plan in plans:
                        current = plan
                        _warmup(plan, eng, num_warmup_iters, allow_unused_input, callables_t[plan.callable_index])
            except BaseException:
                if post_pending:  # TransformerEngine runs it even when warmup fails
                    post_pending = False
                    try:
                        post_warmup_hook()  # type: ignore[misc]
                    except Exception as hook_error:  # keep the original error
                        log.warning("gograph: post_warmup_hook after a failed warmup: %s", str(hook_error))
                raise
            if post_pending:
                current = None
                post_warmup_hook()  # type: ignore[misc]
        eng.synchronize()
        build.warmup_finished()

        # Buffer reuse (Go): slots for static inputs and grad outputs, release steps for the
        # buffers the graphs allocate.
        reuse: _schedule.BufferReuse | None = None
        releases: dict[int, list[tuple[str, Any, int]]] = {}
        if _reuse_graph_input_output_buffers:
            phase, current = "buffer planning", None
            reuse, releases = _schedule.apply_buffer_reuse(
                plans, sched, clone_param_grads_on_return, release_pool_buffers=isinstance(eng, CudaEngine))

        # All captures share the pool; capture in the order they will run -- the schedule's:
        # fwd 1, ..., fwd N, then bwd N, ..., bwd 1, or _order's steps.
        captured: dict[int, tuple[Tensor, ...]] = {}
        discover = num_warmup_iters == 0 and not ordered  # no warmup found the wgrad submodules
        for si, step in enumerate(sched.steps):
            plan = plans[step.pass_index]
            current = plan
            func = callables_t[plan.callable_index]
            if step.kind == _schedule.FORWARD_STEP:
                phase = "forward capture"
                hooks.forward_pre(plan.callable_index, func, plan.sample_args, plan.sample_kwargs)
                with (_schedule.discover_wgrad_modules(func, plan.wgrad_modules) if discover
                      else contextlib.nullcontext()):
                    outputs = _capture_forward(plan, eng, mempool)
                if hooks.hooks is not None:
                    hooks.forward(plan.callable_index, func, plan.sample_args, plan.sample_kwargs,
                                  pytree.tree_unflatten(list(outputs), plan.output_spec))  # type: ignore[arg-type]
                # Keep detached aliases: the static storage, without the capture's autograd graph.
                plan.output_requires_grad = tuple(bool(o.requires_grad) for o in outputs)
                plan.static_outputs = tuple(o.detach() for o in outputs)
                if any(plan.output_requires_grad):
                    captured[plan.index] = outputs
                del outputs
            elif step.kind == _schedule.BACKWARD_STEP:
                phase = "backward capture"
                outputs = captured.pop(plan.index, plan.static_outputs)
                with torch.set_grad_enabled(plan.grad_enabled):
                    _capture_backward(plan, outputs, eng, mempool, allow_unused_input,
                                      retain_graph_in_backward, hooks, func)
                del outputs
                if not ordered and plan.has_backward and plan.wgrad_modules and (
                        plan.need_dw or (discover and _schedule.modules_needing_dw(list(plan.wgrad_modules.values())))):
                    phase = "weight-gradient capture"
                    _capture_wgrad(plan, eng, mempool)
            else:
                phase = "weight-gradient capture"
                _capture_wgrad(plan, eng, mempool)
            for role, released_plan, idx in releases.get(si, ()):
                _schedule.release_pool_buffer(role, released_plan, idx)
        captured.clear()
        for plan in plans:
            if not plan.static_grad_inputs:  # no backward step (eval): nothing differentiates it
                plan.static_grad_outputs = (None,) * len(plan.static_outputs)
                plan.static_grad_inputs = (None,) * len(plan.surface)

        phase = "seal"
        for plan in plans:
            current = plan
            eng.seal(plan.pass_id)
        eng.synchronize()  # captures complete before the first replay
        if build.debug_replay_order:
            _observe.enable_replay_order_check([plan.pass_id for plan in plans])
    except BaseException as e:
        build.close(failed=True)
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
    build.close()

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
            args_spec=plan.args_spec,
            kwargs_keys=plan.kwargs_keys,
            kwargs_spec=pytree.tree_flatten([plan.sample_kwargs[k] for k in plan.kwargs_keys])[1]
            if plan.kwargs_keys else None,
            wgrad=plan.wgrad_body,
            buffer_reuse=reuse,
        )
        graphed.build_stats = build
        graphed._check_replay_order = build.debug_replay_order
        graphed._retain_graph_in_backward = retain_graph_in_backward  # a second backward is then valid
        if module is not None and not ordered:
            module.forward = graphed  # type: ignore[method-assign]
            module.reset = graphed.reset  # type: ignore[attr-defined]
            module.backward_dw = graphed.backward_dw  # type: ignore[attr-defined]
            ret.append(module)
        else:
            # With _order a module runs in several passes: each pass is its own callable
            # (TransformerEngine returns them in pass order) and the module keeps its forward.
            ret.append(graphed)
        if log.isEnabledFor(logging.DEBUG):
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
