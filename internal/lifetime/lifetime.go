// Package lifetime decides when every buffer of a make_graphed_callables
// build dies, and which buffers are one buffer. It is the build's planner:
// over a schedule of warmup and capture steps (internal/schedule) it emits
// the program the executor (Python) runs, step by step, with every release
// point in it.
//
// Two programs are planned:
//
//   - Warmup (before anything is known about tensors): the warmup steps in
//     order, each forward's outputs dying once its backward consumed them
//     (inference outputs at once), either per callable (torch's warmup:
//     iterations of one callable's forward and backward, then the next) or
//     following the schedule (TransformerEngine's, with _order or
//     capture-time hooks).
//   - Capture (after warmup, from what it learned per pass, Facts): the
//     capture steps, each forward's capture-time outputs (the autograd graph
//     its backward capture differentiates) dying once that backward is
//     captured, or at once when none will be; the static buffers each pass
//     uses (its own, a slot shared by liveness, or another pass's buffer);
//     and the pool buffers handed back to the graph pool once no later step
//     reads them.
//
// # Buffers
//
// Slot buffers are allocated or taken from the sample args by Python:
// static inputs (written by the forward's copy-in, read by the forward, the
// backward and the weight-gradient pass) and static grad outputs (written by
// the backward's copy-in, read by the backward and the weight-gradient
// pass). With Options.Reuse, buffers of one signature whose lifetimes do not
// overlap share a slot, assigned greedily in order of first use (optimal
// for intervals: a signature needs as many slots as it has buffers live at
// once). Without it, grad outputs are still shared that way where only
// their own backward reads them (internalGradOutput): that is gograph's
// business alone, and a slot one buffer would have to itself stays its own.
//
// Pool buffers are allocated by the graphs in their memory pool: outputs,
// grads of user inputs and parameter grads. With Options.Release each gets
// a release step once dead, after which dropping Python's owning reference
// lets later captures of the pool reuse its memory (the graphs keep writing
// the same addresses at replay, which is safe because replays follow the
// capture order).
//
// # Chains
//
// With Options.Chain, a pass that consumes the previous layer's output (the
// next callable of the default schedule, or the next layer of the same chunk
// entry of an _order) reads that output buffer in place instead of a copy,
// and its input grad is the previous layer's grad-output buffer: a chain of
// layers holds one buffer per edge instead of four per layer. The planner
// checks what makes that safe: the producer's forward is captured before the
// consumer's, the consumer's backward before the producer's, signatures and
// requires_grad agree, and a chained output is released (with Reuse) only
// after the consumer's backward, its last reader.
//
// # TransformerEngine's scheme
//
// TransformerEngine's _reuse_graph_input_output_buffers shares whole sample
// tuples first-in first-out per tuple signature, frees them at the backward,
// and keeps one grad-output tuple per output signature. The planner computes
// that count for the same buffers (SigStats.TEFifo): its own assignment
// never needs more slots for a signature when each weight-gradient step
// follows its backward directly, and fewer where tuples differ but tensors
// match, or where input and grad-output lifetimes leave room for one
// another. Where a forward runs between a backward and its weight-gradient
// pass, inputs and grad outputs stay live until the weight-gradient pass
// reads them (TransformerEngine would already reuse them there, which is
// only safe if the weight gradient reads neither).
package lifetime

import "fmt"

// Role is what a buffer is to its pass.
type Role byte

// Buffer roles.
const (
	Input      Role = 'i' // static input (slot)
	GradOutput Role = 'g' // static grad output (slot)
	Output     Role = 'o' // output the forward graph writes (pool)
	GradInput  Role = 'd' // grad of a user input the backward graph writes (pool)
	ParamGrad  Role = 'p' // parameter grad the backward writes (pool)
)

// Slotted reports whether buffers of role r are assigned slots (the others
// get release steps).
func (r Role) Slotted() bool { return r == Input || r == GradOutput }

func (r Role) String() string {
	switch r {
	case Input:
		return "input"
	case GradOutput:
		return "grad output"
	case Output:
		return "output"
	case GradInput:
		return "input grad"
	case ParamGrad:
		return "parameter grad"
	}
	return fmt.Sprintf("Role(%q)", byte(r))
}

// Keys are the signatures TransformerEngine's scheme keys a pass by: its
// whole sample tuple (Input) and its whole grad-output tuple (Grad); -1 when
// the pass has none. Only the TEFifo comparison uses them.
type Keys struct {
	Input, Grad int
}

// SigStats is the slot outcome for one signature.
type SigStats struct {
	Buffers int // slot buffers of this signature (what no reuse keeps)
	Slots   int // slots this plan needs
	TEFifo  int // what TransformerEngine's FIFO scheme keeps (0 without keys)
}

// OutputLeaf is one output of a pass: its signature (shape, strides, dtype and
// device; only equal signatures share or chain) and whether it requires
// grad.
type OutputLeaf struct {
	Sig          int
	RequiresGrad bool
}

// InputLeaf is one user input leaf of a pass (positional leaves first, then
// the leaves of the captured kwargs).
type InputLeaf struct {
	Sig          int
	RequiresGrad bool
	// Unique: the sample tensor appears once in the whole build and is not a
	// parameter, so the pass may read another buffer in its place.
	Unique bool
	// Slottable: Unique, and a dense leaf that is its whole storage, so it
	// can back a shared slot.
	Slottable bool
	// Region numbers (from 1) the memory the sample shares with other input
	// leaves of the build (0: none, or not described). Graphs reading one region
	// would read each other's copy-ins, so only the first of them keeps the
	// sample; the others get a buffer of their own (Fresh).
	Region int
	// Param: the sample's memory overlaps a parameter, which a copy-in must
	// never write, so the leaf always gets a buffer of its own.
	Param bool
}

// ParamLeaf is a parameter grad the backward graph writes into the pool and
// returns to autograd as the parameter's grad.
type ParamLeaf struct {
	Index int // position in the pass's static input surface (after the user inputs)
	Param int // which parameter (equal across the passes of one layer)
	Sig   int // its signature
}

// Facts is what warmup learned about one pass, and which graphs it gets.
type Facts struct {
	Inputs     []InputLeaf
	NPos       int // how many of Inputs are positional (only those chain)
	Outputs    []OutputLeaf
	ParamGrads []ParamLeaf // grads returned to autograd as owned tensors (clone_param_grads_on_return)
	Backward   bool        // a backward graph is captured (training, and some output requires grad)
	WGrad      bool        // a delayed weight-gradient graph is captured
	Keys       Keys
}

// Options says which memory plans the build asked for.
type Options struct {
	Reuse   bool // share slot buffers by liveness (_reuse_graph_input_output_buffers)
	Chain   bool // chain consecutive layers' buffers (chain_buffers)
	Release bool // the engine has a device pool: dead pool buffers go back to it
	// Share: the microbatches of one layer that are never in flight
	// together replay one set of graphs (an _order without Reuse or Chain).
	Share bool
}

// GradPolicy is how a parameter grad reaches .grad.
type GradPolicy byte

// Parameter-grad policies.
const (
	GradClone     GradPolicy = 'c' // owned clone when .grad is None; the static buffer lives as long as the graph
	GradLend      GradPolicy = 'l' // the static buffer becomes .grad; copied out before a replay would overwrite it
	GradTransient GradPolicy = 't' // like GradClone, and the buffer goes back to the pool after its backward
)
