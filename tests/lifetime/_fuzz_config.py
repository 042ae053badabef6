"""What the lifetime fuzzer draws: a build configuration and a training program.

:class:`Case` is plain data (its ``repr`` pastes into ``@example(case=...)``); :func:`cases` is
the hypothesis strategy; :func:`describe` renders a case as the call and the loop it stands for,
which the fuzzer notes for a failing example.
"""

from __future__ import annotations

from dataclasses import dataclass

from _fuzz_models import DELAYED_KINDS, GRAD_WRITING_KINDS, KINDS, MODES, PIPELINE_KINDS
from hypothesis import strategies as st

__all__ = ["GRAD_STATES", "Case", "Layer", "Pipeline", "cases", "describe", "inference_build"]

STEPS = 3
#: What the program does to the ``weight.grad`` that ``backward_dw()`` writes (the ``dw_accum`` and
#: ``dw_assign`` kinds), besides ``zero_grad(set_to_none)``: nothing; zeros assigned after graphing
#: (pre-initialised); a new tensor with its values assigned after every step (replaced: a checkpoint
#: load, a rebuilt bucket); every ``.grad`` it saw held for the rest of training (a reference kept
#: to a dropped or replaced one, which must keep its values).
GRAD_STATES = ("as_is", "preinit", "replace", "hold")


@dataclass(frozen=True)
class Layer:
    """One callable: its kind (``KINDS`` / ``PIPELINE_KINDS``), mode (``MODES``),
    whether its first input is the previous callable's first output, and whether a fresh first
    input requires grad."""

    kind: str
    mode: str = "train"
    from_prev: bool = False
    input_grad: bool = True


@dataclass(frozen=True)
class Pipeline:
    """A Megatron-LM interleaved schedule (``gograph.megatron_order``) as ``_order``, with
    ``-(c+0.5)`` weight-gradient entries after each backward of a chunk with delayed layers when
    ``wgrad_entries``, and the passes reset once training is over. ``inference``: the modules in
    eval mode and the schedule's forward entries only (TransformerEngine's inference rule: every
    pass forward-only); with shared samples every pass's input sample is one tensor."""

    pipeline_size: int
    rank: int
    microbatches: int
    layers: tuple[int, ...]
    wgrad_entries: bool = True
    reset_after: tuple[int, ...] = ()
    inference: bool = False


@dataclass(frozen=True)
class Case:
    layers: tuple[Layer, ...]
    pipeline: Pipeline | None = None
    no_grad_build: bool = False
    num_warmup_iters: int = 3
    hooks: bool = False
    chain_buffers: bool = False
    reuse: bool = False
    clone_param_grads: bool = True
    allow_unused_input: bool = True
    debug_replay_order: bool = False
    set_to_none: bool = True
    micro: int = 1
    backward_dw: str = "after"  # none / after (loss.backward()) / during (right after the callable's own backward)
    resets: tuple[tuple[int, int, int], ...] = ()  # (step, micro-batch, callable): reset before it
    evaluate: bool = False  # a forward of every callable under torch.no_grad() after each step
    shared_samples: bool = False  # samples of layers fed the previous output: views of the first sample,
    # and one scale sample (kwargs, needing no grad) for every callable or pass, one scale tensor at a time
    feed_static: bool = False  # the first callable's data is written into its static input, passed itself
    fault: tuple[int, str, int] | None = None  # (callable, "forward" / "backward", n): raises in the build
    autograd_grad: bool = False  # torch.autograd.grad of inputs and parameters instead of loss.backward()
    share: bool = False  # share_microbatch_graphs (pipeline cases)
    grad_state: str = "as_is"  # GRAD_STATES: what the program does to the weight.grad backward_dw() writes
    seed: int = 0


#: One callable as drawn: kind, mode (used by the "mixed" style), from_prev, input_grad.
_RAW_LAYER = st.tuples(st.sampled_from(KINDS), st.sampled_from(MODES), st.booleans(), st.booleans())


def _layers(raw: list[tuple[str, str, bool, bool]], style: str, chain: bool) -> tuple[Layer, ...]:
    """Callables from their draws: the loss only last, the first fed data, every later one the
    previous output with ``chain_buffers``, one mode for all unless the style is "mixed"."""
    n = len(raw)
    return tuple(
        Layer(
            kind="linear" if kind == "loss" and i < n - 1 else kind,
            mode=mode if style == "mixed" else style,
            from_prev=i > 0 and (from_prev or chain),
            input_grad=input_grad,
        )
        for i, (kind, mode, from_prev, input_grad) in enumerate(raw)
    )


@st.composite
def _default_case(draw: st.DrawFn) -> Case:
    raw = draw(st.lists(_RAW_LAYER, min_size=1, max_size=6))  # a list: shrinking deletes callables
    style = draw(st.sampled_from(("train", "train", "mixed", "eval")))
    chain = draw(st.booleans())
    layers = _layers(raw, style, chain)
    n = len(layers)
    # Every choice is drawn whatever the others say (then overridden where a documented
    # constraint ties them), so shrinking simplifies each on its own.
    clone = draw(st.sampled_from((True, True, True, False)))
    micro = draw(st.integers(1, 3))
    if not clone:
        micro = 1  # torch's aliasing (clone_param_grads_on_return=False) drifts under accumulation
    debug = draw(st.booleans())
    dw = draw(st.sampled_from(("after", "during", "none")))
    resets = draw(
        st.lists(
            st.tuples(st.integers(0, STEPS - 1), st.integers(0, micro - 1), st.integers(0, n - 1)),
            max_size=2,
            unique_by=lambda r: r[2],
        )
    )
    return Case(
        layers=layers,
        no_grad_build=draw(st.sampled_from((False, False, False, False, True))),
        num_warmup_iters=draw(st.integers(0, 3)),
        hooks=draw(st.booleans()),
        chain_buffers=chain,
        reuse=draw(st.sampled_from((False,) * 9 + (True,))),
        clone_param_grads=clone,
        allow_unused_input=draw(st.sampled_from((True, True, True, False))),
        debug_replay_order=debug,
        set_to_none=draw(st.booleans()) or not clone,  # torch's aliasing (clone False) drifts otherwise
        micro=micro,
        # After loss.backward() as most training loops do, in capture order, or never. The
        # replay-order guard needs capture order: a pass stays open until its weight gradient ran.
        backward_dw="during" if debug else dw,
        resets=tuple(sorted(resets)),
        evaluate=draw(st.booleans()),
        shared_samples=draw(st.booleans()),
        feed_static=draw(st.booleans()),
        autograd_grad=draw(st.sampled_from((False, False, True))),
        fault=draw(_fault(n)),
        grad_state=draw(_grad_state()),
        seed=draw(st.integers(0, 2**16)),
    )


def inference_build(case: Case) -> bool:
    """Whether a pipeline case builds for inference: drawn so, and at least one callable a module
    (put in eval mode; with functions alone the build trains, TransformerEngine's rule)."""
    return case.pipeline is not None and case.pipeline.inference and any(layer.kind != "fn" for layer in case.layers)


@st.composite
def _pipeline_case(draw: st.DrawFn) -> Case:
    """The schedule first (Megatron-LM's interleaved order, its layers per chunk, inference,
    shared microbatch graphs), then, in 7 of 8 cases, only the options it admits (the documented
    refusals of :mod:`_fuzz_refusals` cannot happen: so most pipeline, shared and inference cases
    build and train); in the rest, any options (each refusal is a case too). A fault is drawn on
    its own either way."""
    pp = draw(st.integers(1, 2))
    chunks = draw(st.integers(1, 2))
    per_chunk = tuple(draw(st.integers(1, 2)) for _ in range(chunks))
    n = sum(per_chunk)
    # Megatron-LM's interleaved schedule: at least pipeline_size microbatches, and the last group of
    # pipeline_size (gograph.megatron_order's rule) empty or full -- a multiple of it here.
    microbatches = draw(st.integers(1, 3)) if pp == 1 else pp * draw(st.integers(1, 2))
    passes = n * microbatches
    inference = draw(st.sampled_from((False, False, False, True)))
    share = draw(st.booleans())
    wgrad_entries = draw(st.sampled_from((True, True, True, False)))
    admitted = draw(st.sampled_from((True,) * 7 + (False,)))
    faulty = draw(st.sampled_from((False,) * 9 + (True,)))
    # a delayed weight gradient needs weight-gradient entries, and those one layer per chunk
    delayed_ok = not admitted or (wgrad_entries and max(per_chunk) == 1)
    kinds = PIPELINE_KINDS if delayed_ok else tuple(k for k in PIPELINE_KINDS if k not in DELAYED_KINDS)
    layers = [Layer(kind=draw(st.sampled_from(kinds)), input_grad=draw(st.booleans()) or i > 0) for i in range(n)]
    if admitted and inference and all(layer.kind == "fn" for layer in layers):
        layers[0] = Layer(kind="block", input_grad=layers[0].input_grad)  # functions alone build to train
    pipeline = Pipeline(
        pipeline_size=pp,
        rank=draw(st.integers(0, pp - 1)),
        microbatches=microbatches,
        layers=per_chunk,
        wgrad_entries=wgrad_entries,
        reset_after=tuple(sorted(draw(st.sets(st.integers(0, passes - 1), max_size=passes)))),
        inference=inference,
    )
    clone = draw(st.sampled_from((True, True, True, False))) or (admitted and share)
    chain = draw(st.booleans()) and not (admitted and share)
    reuse = draw(st.booleans()) and not (admitted and inference)
    return Case(
        layers=tuple(layers),
        pipeline=pipeline,
        num_warmup_iters=draw(st.integers(1 if admitted else 0, 3)),
        hooks=draw(st.booleans()),
        chain_buffers=chain,
        reuse=reuse,
        clone_param_grads=clone,
        allow_unused_input=draw(st.sampled_from((True, True, True, False))),
        debug_replay_order=draw(st.booleans()),
        set_to_none=draw(st.booleans()) or not clone,
        shared_samples=draw(st.booleans()),
        fault=draw(_some_fault(n)) if faulty else None,
        share=share,
        grad_state=draw(_grad_state()),
        seed=draw(st.integers(0, 2**16)),
    )


def _grad_state() -> st.SearchStrategy[str]:
    """Mostly a state of its own (the draw matters only with a ``dw_accum`` / ``dw_assign`` layer)."""
    return st.sampled_from(("as_is", *GRAD_STATES))


def _some_fault(n: int) -> st.SearchStrategy[tuple[int, str, int]]:
    """The n-th forward or backward of a callable in the build raises."""
    return st.tuples(st.integers(0, n - 1), st.sampled_from(("forward", "backward")), st.integers(0, 4))


def _fault(n: int) -> st.SearchStrategy[tuple[int, str, int] | None]:
    """Mostly none; else a fault (:func:`_some_fault`)."""
    return st.one_of(st.none(), st.none(), st.none(), st.none(), st.none(), _some_fault(n))


def cases() -> st.SearchStrategy[Case]:
    """Default-schedule builds (3 in 4) and pipeline (``_order``) builds."""
    return st.one_of(_default_case(), _default_case(), _default_case(), _pipeline_case())


def _layer_text(i: int, layer: Layer) -> str:
    src = "prev output" if layer.from_prev else f"x{'(requires_grad)' if layer.input_grad else ''}"
    return f"  {i}: {layer.kind}[{layer.mode}]({src})"


_DW = {"none": "not called", "after": "after loss.backward()", "during": "right after each callable's backward"}


def describe(case: Case) -> str:
    """The case as the call and the loop it stands for."""
    opts = [
        f"num_warmup_iters={case.num_warmup_iters}",
        f"allow_unused_input={case.allow_unused_input}",
        f"chain_buffers={case.chain_buffers}",
        f"_reuse_graph_input_output_buffers={case.reuse}",
        f"clone_param_grads_on_return={case.clone_param_grads}",
        f"debug_replay_order={case.debug_replay_order}",
        f"capture_time_hooks={'forward_pre_hooks liveness checks' if case.hooks else None}",
    ]
    lines = ["make_graphed_callables(("]
    lines += [_layer_text(i, layer) for i, layer in enumerate(case.layers)]
    lines.append(f"), {', '.join(opts)})" + (" under torch.no_grad()" if case.no_grad_build else ""))
    if case.fault is not None:
        i, kind, n = case.fault
        lines.append(f"  callable {i} raises in its {kind} #{n} of the build")
    lines += _program_text(case)
    return "\n".join(lines)


def _program_text(case: Case) -> list[str]:
    p = case.pipeline
    if p is not None:
        return [
            f"program: megatron_order(pipeline_size={p.pipeline_size}, rank={p.rank}, chunks={len(p.layers)}, "
            f"microbatches={p.microbatches}), _num_layers_per_chunk={list(p.layers)}, wgrad entries "
            f"{p.wgrad_entries}; {STEPS} steps, zero_grad(set_to_none={case.set_to_none}); data seed {case.seed}; "
            f"then reset passes {list(p.reset_after)} and run the others forward"
            + ("; one scale sample (kwargs) for every pass, one scale tensor per step" if case.shared_samples else "")
            + ("; inference: modules in eval(), forward entries only" if inference_build(case) else "")
            + ("; share_microbatch_graphs" if case.share else "")
            + ("; one input sample for every pass" if inference_build(case) and case.shared_samples else "")
            + _grad_state_text(case)
        ]
    grads = "torch.autograd.grad (results kept, summed into .grad)" if case.autograd_grad else "loss.backward()"
    dw = f"backward_dw() {_DW[case.backward_dw]}, " if any(layer.kind in DELAYED_KINDS for layer in case.layers) else ""
    lines = [
        f"program: {STEPS} steps x {case.micro} micro-batch(es), {grads}, {dw}SGD step, "
        f"zero_grad(set_to_none={case.set_to_none}){_grad_state_text(case)}; data seed {case.seed}"
    ]
    lines += [f"  reset callable {i} before step {s} micro-batch {m}" for s, m, i in case.resets]
    if case.evaluate:
        lines.append("  after each step, every callable forward under torch.no_grad()")
    if case.shared_samples:
        lines.append("  samples of callables fed the previous output: views of callable 0's sample")
        lines.append("  one scale sample (kwargs) for every callable, one scale tensor per micro-batch for all")
    if case.feed_static:
        lines.append("  callable 0's data copied into its static input, which is passed itself")
    return lines


_GRAD_STATE_TEXT = {
    "preinit": "zeros assigned after graphing",
    "replace": "replaced by a new tensor with its values after every step",
    "hold": "every one seen held for the rest of training",
}


def _grad_state_text(case: Case) -> str:
    if case.grad_state == "as_is" or not any(layer.kind in GRAD_WRITING_KINDS for layer in case.layers):
        return ""
    return f"; the weight.grad backward_dw() writes: {_GRAD_STATE_TEXT[case.grad_state]}"
