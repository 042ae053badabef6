// Package gradslot is the grad-slot policy: what happens to a parameter's
// gradient slot -- its .grad, or an accumulation buffer such as
// Megatron-LM's .main_grad -- when a graph hands it a gradient.
//
// Two kinds of graph hand gradients out. A backward graph returns each
// parameter grad from a static buffer; autograd's AccumulateGrad then takes
// the returned tensor as .grad when there is none and adds it into .grad
// otherwise. A weight-gradient graph (TransformerEngine's backward_dw())
// writes the memory its capture wrote: the tensor the slot held at capture
// when the module added into it, or a buffer of its own when the module
// assigned a new tensor. Either way the caller must see what eager training
// gives, whatever it did to the slot since the capture:
//
//   - an empty slot (None: zero_grad(set_to_none=True)) gets a tensor the
//     caller owns, as eager's fresh gradient: one no later replay overwrites
//     while the caller holds it;
//   - a slot holding a tensor gets the gradient added into that tensor in
//     place (eager's accumulation), or replaced by a new one where the
//     module's capture replaced it (eager assigns again);
//   - a tensor anything but gograph still holds is never changed behind its
//     holder's back.
//
// One decision table serves both kinds (HandOut), with the rule that learns
// how a caller treats lendable backward buffers (Sweep) and the one that
// reads what a weight-gradient capture did to each slot (Capture). Python
// reads the whole table once (Encode) and executes it; nothing here touches
// a tensor.
package gradslot

import (
	"fmt"
	"strings"
)

// Source is what produced the gradient a slot receives, and where it sits.
type Source uint8

const (
	// BackwardLendable is a backward graph's static parameter-grad buffer
	// that may be lent to .grad (the default schedule's lending policy).
	BackwardLendable Source = iota
	// BackwardOwned is a backward graph's static buffer that is never lent:
	// the caller gets an owned copy (clone and transient policies, a
	// create_graph backward).
	BackwardOwned
	// WGradAdd is a weight-gradient graph that adds into the tensor the slot
	// held at capture (the module accumulated in place); gograph holds that
	// memory for the graph's lifetime.
	WGradAdd
	// WGradAssignEmpty is a weight-gradient graph that writes a buffer of
	// its own: at capture the slot was empty and the module assigned a new
	// tensor (what it does to an existing one was not seen: accumulate, as
	// AccumulateGrad does).
	WGradAssignEmpty
	// WGradAssignTensor is a weight-gradient graph that writes a buffer of
	// its own: at capture the slot held a tensor and the module replaced it
	// (it assigns whatever the slot holds).
	WGradAssignTensor
	numSources
)

// State is the slot when the gradient is handed out.
type State uint8

const (
	// Captured: the slot's tensor is the graph's memory (a weight-gradient
	// graph's target or buffer, at the address it was captured with).
	Captured State = iota
	// Empty: the slot holds nothing (.grad is None).
	Empty
	// Other: the slot holds another tensor of the gradient's shape and
	// device (assigned, replaced or pre-initialised after graphing).
	Other
	// Mismatch: the slot holds a tensor of another shape or device, which no
	// gradient of this graph can be added into (eager's add_ fails too).
	Mismatch
	numStates
)

// Learned is what a slot has learnt of how the caller treats .grad (only
// lendable backward buffers learn; the others keep what they have).
type Learned uint8

const (
	// Unknown: no replay that could overwrite a lent buffer has come yet.
	Unknown Learned = iota
	// Dropped: the caller had no .grad left when such a replay came
	// (step, then zero_grad(set_to_none=True)): lending is safe.
	Dropped
	// Kept: the caller keeps its grads (set_to_none=False, accumulation):
	// a .grad lives on at one address and gets owned memory.
	Kept
	numLearned
)

// Prepare is what happens to the graph's memory before the graph runs.
type Prepare uint8

const (
	// Keep: nothing; the graph writes as captured.
	Keep Prepare = iota
	// Zero: zeroed, so that the graph's result is the gradient alone.
	Zero
	// SaveZero: saved, then zeroed; restored once the gradient was
	// delivered, because something besides gograph holds that memory.
	SaveZero
	numPrepares
)

// Deliver is what reaches the slot once the graph ran.
type Deliver uint8

const (
	// InPlace: nothing more: the graph added into the slot's own tensor.
	InPlace Deliver = iota
	// Add: the gradient is added into the slot's tensor in place (for a
	// backward buffer, by autograd's AccumulateGrad).
	Add
	// Lend: the graph's memory itself becomes the slot's tensor.
	Lend
	// Copy: an owned copy of the gradient becomes the slot's tensor.
	Copy
	// Refuse: nothing runs; the call raises (Python says why, by state).
	Refuse
	numDelivers
)

// Before is a slot before a weight-gradient capture ran the module's work.
type Before uint8

const (
	// WasEmpty: the slot held nothing.
	WasEmpty Before = iota
	// WasTensor: the slot held a tensor.
	WasTensor
	numBefores
)

// After is what the module's weight-gradient work did to a slot.
type After uint8

const (
	// Untouched: the slot holds what it held, unwritten.
	Untouched After = iota
	// Written: the slot holds the tensor it held, written in place.
	Written
	// Replaced: the slot holds a tensor it did not hold before.
	Replaced
	// Emptied: the slot held a tensor and holds nothing now.
	Emptied
	numAfters
)

// Decision is the policy's answer for one slot: what happens to the graph's
// memory before it runs, what reaches the slot after, whether the hand-out
// is watched until the next replay that may overwrite a lent buffer, and
// what the slot has learnt.
type Decision struct {
	Prepare Prepare
	Deliver Deliver
	Watch   bool
	Learned Learned
}

// HandOut decides what a slot gets from src in state st: held says whether
// anything besides gograph (and the slot itself) holds the graph's memory,
// learned what the slot has learnt so far.
func HandOut(src Source, st State, held bool, learned Learned) Decision {
	switch src {
	case BackwardLendable, BackwardOwned:
		return backward(src == BackwardLendable, st, learned)
	case WGradAdd:
		return addTarget(st, held, learned)
	default:
		return assignTarget(src, st, learned)
	}
}

// backward: a backward graph returns the buffer to autograd. Where .grad
// exists, AccumulateGrad adds the buffer into it in place (the caller keeps
// its grads). Where it is None, AccumulateGrad would take the returned
// tensor itself as .grad: a lendable buffer is returned as it is once the
// caller was seen dropping its grads (watched: copied out if .grad still
// holds it when a replay could overwrite it), an owned copy otherwise
// (watched while nothing is known yet, to learn).
func backward(lendable bool, st State, l Learned) Decision {
	switch {
	case st == Mismatch: // torch refuses such a .grad at assignment: never reached
		return Decision{Deliver: Refuse, Learned: l}
	case st != Empty:
		return Decision{Deliver: Add, Learned: Kept}
	case lendable && l == Dropped:
		return Decision{Deliver: Lend, Watch: true, Learned: Dropped}
	case lendable && l == Unknown:
		return Decision{Deliver: Copy, Watch: true, Learned: Unknown}
	default:
		return Decision{Deliver: Copy, Learned: l}
	}
}

// addTarget: the graph adds into its target, the tensor the slot held at
// capture. Still there, the replay is all (eager adds into a kept .grad).
// Otherwise the target is zeroed first, so that the replay leaves the
// gradient alone in it: an empty slot is lent the target (eager's fresh
// gradient, which the next replay adds into while the caller keeps it), and
// another tensor gets the gradient added into it. Where anything else holds
// the target (a reference to the dropped .grad, a bucket it is a view of),
// its contents are saved and restored around the replay, and an empty slot
// gets a copy instead.
func addTarget(st State, held bool, l Learned) Decision {
	switch {
	case st == Captured:
		return Decision{Deliver: InPlace, Learned: l}
	case st == Mismatch:
		return Decision{Deliver: Refuse, Learned: l}
	case st == Empty && !held:
		return Decision{Prepare: Zero, Deliver: Lend, Learned: l}
	case st == Empty:
		return Decision{Prepare: SaveZero, Deliver: Copy, Learned: l}
	case !held:
		return Decision{Prepare: Zero, Deliver: Add, Learned: l}
	default:
		return Decision{Prepare: SaveZero, Deliver: Add, Learned: l}
	}
}

// assignTarget: the graph writes a buffer of its own (pool memory other
// graphs may write too: it is read right after the replay and never handed
// out). A module seen replacing a tensor assigns whatever the slot holds:
// the slot gets a copy. One seen assigning to an empty slot gets a copy
// there, and accumulates into a tensor (AccumulateGrad's rule). A slot that
// holds the graph's own buffer cannot be added into (the replay overwrites
// it); nor can one of another shape or device.
func assignTarget(src Source, st State, l Learned) Decision {
	switch {
	case src == WGradAssignTensor || st == Empty:
		return Decision{Deliver: Copy, Learned: l}
	case st == Other:
		return Decision{Deliver: Add, Learned: l}
	default:
		return Decision{Deliver: Refuse, Learned: l}
	}
}

// Sweep decides, before a replay that may overwrite lent buffers, for one
// watched hand-out of a lendable backward: a lent buffer (lent) that
// anything but gograph still holds (present) is copied out, and the slot
// learns that the caller keeps its grads; a watched owned copy teaches the
// slot whether the caller still had a .grad then (present: Kept, for good)
// or had dropped it (Dropped, unless it was seen keeping one before).
func Sweep(lent, present bool, learned Learned) (copyOut bool, next Learned) {
	if lent {
		if present {
			return true, Kept
		}
		return false, learned
	}
	if present || learned == Kept {
		return false, Kept
	}
	return false, Dropped
}

// Capture reads what a weight-gradient capture did to a slot: a tensor
// written in place is the graph's target (WGradAdd); a tensor the module
// put in the slot is the graph's own buffer, assigned to an empty slot
// (WGradAssignEmpty) or in place of a tensor (WGradAssignTensor). A slot
// left alone, or emptied, is no target (ok false): the graph writes nothing
// the slot must receive.
func Capture(before Before, after After) (src Source, ok bool) {
	switch {
	case before == WasTensor && after == Written:
		return WGradAdd, true
	case after == Replaced && before == WasEmpty:
		return WGradAssignEmpty, true
	case after == Replaced:
		return WGradAssignTensor, true
	default:
		return 0, false
	}
}

// The letters each value is written with in the table (its index).
const (
	sourceLetters  = "loant"
	stateLetters   = "cexm"
	learnedLetters = "udk"
	prepareLetters = "-zs"
	deliverLetters = "ialcr"
	beforeLetters  = "et"
	afterLetters   = "uwre"
)

// Encode writes the whole policy, every combination of every rule, one
// line each (Python reads it once and indexes it):
//
//	handout SRC STATE HELD LEARNED PREPARE DELIVER WATCH LEARNED'
//	sweep LENT PRESENT LEARNED COPYOUT LEARNED'
//	capture BEFORE AFTER SRC        (SRC "-": no target)
//
// Booleans are 0 or 1; the other fields are the letters above: sources
// l(endable) o(wned) a(dd) n (assign to empty) t (assign over a tensor);
// states c(aptured) e(mpty) x (other) m(ismatch); learned u(nknown)
// d(ropped) k(ept); prepare - (keep) z(ero) s(ave and zero); deliver
// i(n place) a(dd) l(end) c(opy) r(efuse); before e(mpty) t(ensor); after
// u(ntouched) w(ritten) r(eplaced) e(mptied).
func Encode() string {
	var b strings.Builder
	for src := range numSources {
		for st := range numStates {
			for _, held := range []bool{false, true} {
				for l := range numLearned {
					d := HandOut(src, st, held, l)
					fmt.Fprintf(&b, "handout %c %c %d %c %c %c %d %c\n", sourceLetters[src], stateLetters[st], b2i(held),
						learnedLetters[l], prepareLetters[d.Prepare], deliverLetters[d.Deliver], b2i(d.Watch), learnedLetters[d.Learned])
				}
			}
		}
	}
	for _, lent := range []bool{false, true} {
		for _, present := range []bool{false, true} {
			for l := range numLearned {
				out, next := Sweep(lent, present, l)
				fmt.Fprintf(&b, "sweep %d %d %c %d %c\n", b2i(lent), b2i(present), learnedLetters[l], b2i(out), learnedLetters[next])
			}
		}
	}
	for before := range numBefores {
		for after := range numAfters {
			src, ok := Capture(before, after)
			letter := byte('-')
			if ok {
				letter = sourceLetters[src]
			}
			fmt.Fprintf(&b, "capture %c %c %c\n", beforeLetters[before], afterLetters[after], letter)
		}
	}
	return b.String()
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
