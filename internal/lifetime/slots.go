package lifetime

import (
	"sort"

	"github.com/gograph/gograph/internal/schedule"
)

// buffer is one planned buffer: a slot buffer (static input or grad output
// that is the pass's own) or a pool buffer, with its first and last use.
type buffer struct {
	role        Role
	pass, index int
	sig         int
	first, last int // step indices of its first and last use
	slot        int // its slot (slot buffers), -1 otherwise
	release     int // the step after which it is dead (pool buffers), -1 never
}

// steps maps each pass to the index of its forward, backward and
// weight-gradient step (-1 when it has none).
type steps [][3]int

func stepsOf(p *schedule.Plan) steps {
	at := make(steps, p.Passes)
	for i := range at {
		at[i] = [3]int{-1, -1, -1}
	}
	for i, s := range p.Steps {
		switch s.Kind {
		case schedule.Forward:
			at[s.Pass][0] = i
		case schedule.Backward:
			at[s.Pass][1] = i
		case schedule.WGrad:
			at[s.Pass][2] = i
		}
	}
	return at
}

// readSteps is stepsOf with, for the default schedule (which has no
// weight-gradient steps), a pass's delayed weight-gradient graph placed
// after every step: the caller runs backward_dw() whenever it likes, after
// any replay of the step (TransformerEngine calls it after loss.backward()),
// so what that graph reads -- the pass's saved inputs and incoming grads --
// must outlive every other graph's captures.
func readSteps(p *schedule.Plan, facts []Facts) steps {
	at := stepsOf(p)
	if p.Ordered {
		return at
	}
	for pass, f := range facts {
		if f.WGrad && f.Backward {
			at[pass][2] = len(p.Steps)
		}
	}
	return at
}

func (at steps) fwd(pass int) int   { return at[pass][0] }
func (at steps) bwd(pass int) int   { return at[pass][1] }
func (at steps) wgrad(pass int) int { return at[pass][2] }

// span sets b's first and last use to the extremes of the given steps
// (negative entries, steps that do not exist, are skipped).
func (b *buffer) span(uses ...int) {
	b.first, b.last = -1, -1
	for _, s := range uses {
		if s < 0 {
			continue
		}
		if b.first < 0 || s < b.first {
			b.first = s
		}
		b.last = max(b.last, s)
	}
}

// consumer is the step that reads the input grads the backward step bw
// produces, in an _order schedule: the backward of the previous layer of
// the same entry, or, for a chunk's first layer, the next first-layer
// backward (the pipeline send of the grad is assumed done by then, as
// TransformerEngine assumes). -1 when nothing follows.
func consumer(p *schedule.Plan, bw int) int {
	s := p.Steps[bw]
	for i := bw + 1; i < len(p.Steps); i++ {
		t := p.Steps[i]
		if t.Kind != schedule.Backward {
			continue
		}
		if s.Layer > 0 && t.Entry == s.Entry && t.Layer == s.Layer-1 {
			return i
		}
		if s.Layer == 0 && t.Layer == 0 {
			return i
		}
	}
	return -1
}

// assignSlots colours the slot buffers' intervals greedily in order of first
// use, taking the lowest free slot of the signature, and returns the slot
// count; per-signature counts go to sigs.
func assignSlots(bufs []*buffer, sigs map[int]*SigStats) int {
	var idx []*buffer
	for _, b := range bufs {
		if b.role.Slotted() {
			idx = append(idx, b)
			sigOf(sigs, b.sig).Buffers++
		}
	}
	sort.SliceStable(idx, func(a, b int) bool { return idx[a].first < idx[b].first })
	type busy struct{ last, slot, sig int }
	var active []busy
	free := map[int][]int{} // sig -> free slots, ascending
	perSig := map[int]int{}
	slots := 0
	for _, b := range idx {
		kept := active[:0]
		for _, a := range active {
			if a.last < b.first {
				free[a.sig] = insertSorted(free[a.sig], a.slot)
			} else {
				kept = append(kept, a)
			}
		}
		active = kept
		if f := free[b.sig]; len(f) > 0 {
			b.slot, free[b.sig] = f[0], f[1:]
		} else {
			b.slot = slots
			slots++
			perSig[b.sig]++
		}
		active = append(active, busy{b.last, b.slot, b.sig})
	}
	for sig, n := range perSig {
		sigOf(sigs, sig).Slots = n
	}
	return slots
}

// keepShared undoes the slots that only one buffer took (without Reuse a
// buffer is shared only where that saves one: the rest stay the pass's own),
// numbers the others from 0 in order and recounts sigs; it returns the slot
// count. Greedy colouring leaves the slots it keeps exactly as many, per
// signature, as the most buffers of it live at once among those sharing.
func keepShared(bufs []*buffer, sigs map[int]*SigStats) int {
	users := map[int]int{}
	for _, b := range bufs {
		if b.role.Slotted() {
			users[b.slot]++
		}
	}
	renumber := map[int]int{}
	perSig := map[int]map[int]bool{}
	for _, b := range bufs {
		if !b.role.Slotted() {
			continue
		}
		if users[b.slot] < 2 {
			b.slot = -1
			continue
		}
		n, ok := renumber[b.slot]
		if !ok {
			n = len(renumber)
			renumber[b.slot] = n
		}
		b.slot = n
		if perSig[b.sig] == nil {
			perSig[b.sig] = map[int]bool{}
		}
		perSig[b.sig][n] = true
	}
	clear(sigs)
	for _, b := range bufs {
		if b.role.Slotted() && b.slot >= 0 {
			st := sigOf(sigs, b.sig)
			st.Buffers++
			st.Slots = len(perSig[b.sig])
		}
	}
	return len(renumber)
}

func sigOf(sigs map[int]*SigStats, s int) *SigStats {
	st := sigs[s]
	if st == nil {
		st = &SigStats{}
		sigs[s] = st
	}
	return st
}

func insertSorted(xs []int, x int) []int {
	i := sort.SearchInts(xs, x)
	xs = append(xs, 0)
	copy(xs[i+1:], xs[i:])
	xs[i] = x
	return xs
}

// sharedSamples counts, with Reuse, the input leaves that read a sample
// passes share by the schedule (their lifetimes do not overlap:
// TransformerEngine's reorganised entries, Megatron-LM's shared samples):
// each is a buffer without reuse, and each shared sample (a region) one
// buffer the plan keeps, so Buffers and Slots count them as slot buffers.
// It returns each pass's signatures of such leaves, and the number of
// shared samples.
func sharedSamples(facts []Facts, prog *Program) ([][]int, int) {
	out := make([][]int, len(facts))
	regions := map[[2]int]bool{} // (signature, region): a sample read through views of two signatures is two buffers

	for pass, f := range facts {
		if prog.Share[pass] != pass {
			continue
		}
		for j, in := range f.Inputs {
			if in.Region == 0 || in.Param || prog.Inputs[pass][j].Kind != Own {
				continue
			}
			out[pass] = append(out[pass], in.Sig)
			st := sigOf(prog.Sigs, in.Sig)
			st.Buffers++
			if key := [2]int{in.Sig, in.Region}; !regions[key] {
				regions[key] = true
				st.Slots++
			}
		}
	}
	return out, len(regions)
}

// compareTE computes, per signature, the buffers TransformerEngine's scheme
// keeps for the same slot buffers: sample tuples are reused first-in
// first-out among tuples of equal key once their chunk's backward entry ran
// (weight-gradient steps are ignored, as TransformerEngine ignores them),
// and one grad-output tuple is kept per grad key.
func compareTE(p *schedule.Plan, bufs []*buffer, shared [][]int, facts []Facts, sigs map[int]*SigStats) {
	inputs := make([][]int, p.Passes) // pass -> sigs of its input slot buffers and shared samples
	for pass, s := range shared {
		inputs[pass] = append(inputs[pass], s...)
	}
	grads := make([][]int, p.Passes)
	for _, b := range bufs {
		switch b.role {
		case Input:
			inputs[b.pass] = append(inputs[b.pass], b.sig)
		case GradOutput:
			grads[b.pass] = append(grads[b.pass], b.sig)
		}
	}
	consumed := map[int]int{} // input key -> tuples free for reuse
	gradSeen := map[int]bool{}
	for _, s := range p.Steps {
		k := facts[s.Pass].Keys
		switch s.Kind {
		case schedule.Forward:
			if k.Input >= 0 && consumed[k.Input] > 0 {
				consumed[k.Input]--
				continue
			}
			for _, sig := range inputs[s.Pass] {
				sigOf(sigs, sig).TEFifo++
			}
		case schedule.Backward:
			if k.Input >= 0 {
				consumed[k.Input]++
			}
			if k.Grad < 0 || !gradSeen[k.Grad] {
				gradSeen[k.Grad] = k.Grad >= 0
				for _, sig := range grads[s.Pass] {
					sigOf(sigs, sig).TEFifo++
				}
			}
		}
	}
}
