"""The vocabularies the core and the executor share, one enum each (Go's typed kinds mirrored).

Every enum's values are the core's spellings (docs/CORE_API.md), so a program line's field *is*
the member's value: ``CaptureOp("F") is CaptureOp.FORWARD``. Members are ``str`` (or ``int``)
subclasses and compare -- and hash -- as those spellings (the executor's tables are keyed by
them, looked up once per op). Go's names: ``state.GraphKind``,
``schedule.StepKind``, ``lifetime.OpKind`` (warmup ops lower case, capture ops upper case),
``lifetime.SourceKind``, ``lifetime.GradPolicy``, ``lifetime.Role``, and the grad-slot policy's
``gradslot.Source``, ``State``, ``Learned``, ``Prepare``, ``Deliver``, ``Before``, ``After``.

This module imports nothing of gograph's: it is the floor every other module stands on.
"""

from __future__ import annotations

import enum

__all__ = [
    "BufferSource",
    "CaptureOp",
    "GradPolicy",
    "GradSource",
    "GraphKind",
    "Learned",
    "ReleaseRole",
    "SlotAfter",
    "SlotBefore",
    "SlotDeliver",
    "SlotPrepare",
    "SlotState",
    "StepKind",
    "WarmOp",
]


class GraphKind(enum.IntEnum):
    """What a graph of a pass computes (the core's kind numbers)."""

    __hash__ = int.__hash__

    FORWARD = 0
    BACKWARD = 1
    WGRAD = 2  # delayed weight gradient (TransformerEngine's backward_dw)

    @property
    def key(self) -> str:
        """The name reports use for it (``memory_report``'s fields, ``CaptureRecord.kind``)."""
        return ("forward", "backward", "wgrad")[self]

    @property
    def noun(self) -> str:
        """How messages call a graph of this kind."""
        return ("forward", "backward", "weight-gradient pass")[self]


class StepKind(str, enum.Enum):
    """What a schedule step computes."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    FORWARD = "F"
    BACKWARD = "B"
    WGRAD = "W"


class WarmOp(str, enum.Enum):
    """One op of the warmup program."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    FORWARD = "f"  # run the pass's forward eagerly
    BACKWARD = "b"  # its backward, on the outputs of its latest warmup forward
    WGRAD = "w"  # its delayed weight-gradient work
    DROP_OUTPUTS = "x"  # its warmup outputs die
    DROP_INFERENCE = "y"  # they die here if none requires grad (no backward: only its forward tells)
    DROP_ZERO_GRADS = "g"  # the zero incoming grads made for its warmup backwards die


class CaptureOp(str, enum.Enum):
    """One op of the capture program."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    FORWARD = "F"  # capture the pass's forward graph
    BACKWARD = "B"  # its backward graph
    WGRAD = "W"  # its weight-gradient graph
    DROP = "X"  # its capture-time outputs, with their autograd graph, die
    RELEASE = "R"  # a pool buffer of the pass goes back to the pool
    RETURN_WARMUP_POOL = "H"  # the pool reference warmup or the seed took goes back (no pass)

    @property
    def graph(self) -> GraphKind | None:
        """The kind of graph the op captures (None: it captures nothing)."""
        return _GRAPH_OF.get(self)


_GRAPH_OF = {
    CaptureOp.FORWARD: GraphKind.FORWARD,
    CaptureOp.BACKWARD: GraphKind.BACKWARD,
    CaptureOp.WGRAD: GraphKind.WGRAD,
}


class BufferSource(str, enum.Enum):
    """Where a static buffer comes from."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    OWN = "o"  # the pass's own: its sample, or a new grad-output buffer
    SLOT = "s"  # a slot shared by liveness
    CHAINED = "c"  # another pass's buffer (the producer's output, the consumer's input grad)
    NONE = "-"  # no buffer (a grad output of an output that needs no grad)
    FRESH = "n"  # a new clone of the sample (its memory is another input leaf's or a parameter's too)


class GradPolicy(str, enum.Enum):
    """How a parameter grad reaches ``.grad``."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    CLONE = "c"  # an owned clone
    LEND = "l"  # the static buffer, lent (copied out before a replay would overwrite it)
    TRANSIENT = "t"  # an owned clone, and the buffer goes back to the pool after its backward


class ReleaseRole(str, enum.Enum):
    """What a released pool buffer is to its pass."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    OUTPUT = "o"  # output I
    GRAD_INPUT = "d"  # the grad of user input leaf I
    PARAM_GRAD = "p"  # the parameter grad at static-surface index I


# ---------------------------------------------------------------------------------------------
# The grad-slot policy (``internal/gradslot``): what a parameter's .grad / .main_grad gets
# ---------------------------------------------------------------------------------------------
class GradSource(str, enum.Enum):
    """What produced the gradient a slot receives, and where it sits."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    LENDABLE = "l"  # a backward graph's static buffer that may be lent to .grad
    OWNED = "o"  # a backward graph's static buffer that is never lent (an owned copy)
    WGRAD_ADD = "a"  # a weight-gradient graph adding into the tensor the slot held at capture
    WGRAD_ASSIGN_EMPTY = "n"  # one writing its own buffer: the module assigned to an empty slot
    WGRAD_ASSIGN_TENSOR = "t"  # one writing its own buffer: the module replaced the slot's tensor


class SlotState(str, enum.Enum):
    """A slot when the gradient is handed out."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    CAPTURED = "c"  # it holds the graph's memory
    EMPTY = "e"  # None
    OTHER = "x"  # another tensor of the gradient's shape and device
    MISMATCH = "m"  # a tensor of another shape or device


class Learned(enum.IntEnum):
    """What a slot has learnt of how the caller treats .grad (lendable backward buffers)."""

    __hash__ = int.__hash__

    UNKNOWN = 0
    DROPPED = 1  # the caller drops its grads after each step: lending is safe
    KEPT = 2  # the caller keeps them: a .grad lives on at one address, in owned memory

    @property
    def letter(self) -> str:
        """The core's spelling."""
        return "udk"[self]


class SlotPrepare(str, enum.Enum):
    """What happens to a weight-gradient graph's memory before it replays."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    KEEP = "-"  # nothing: it writes as captured
    ZERO = "z"  # zeroed: the replay leaves the gradient alone in it
    SAVE_ZERO = "s"  # saved and zeroed, restored after the delivery (something else holds it)


class SlotDeliver(str, enum.Enum):
    """What reaches the slot once the graph ran."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    IN_PLACE = "i"  # nothing more: the graph added into the slot's own tensor
    ADD = "a"  # the gradient is added into the slot's tensor (a backward's: by AccumulateGrad)
    LEND = "l"  # the graph's memory becomes the slot's tensor
    COPY = "c"  # an owned copy of the gradient becomes the slot's tensor
    REFUSE = "r"  # nothing runs: the call raises


class SlotBefore(str, enum.Enum):
    """A slot before a weight-gradient capture ran the module's work."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    EMPTY = "e"
    TENSOR = "t"


class SlotAfter(str, enum.Enum):
    """What the module's weight-gradient work did to a slot."""

    __hash__ = str.__hash__  # as its value (Enum's hashes the name, in Python)

    UNTOUCHED = "u"
    WRITTEN = "w"  # the same tensor, written in place
    REPLACED = "r"  # a tensor it did not hold before
    EMPTIED = "e"  # None where a tensor was
