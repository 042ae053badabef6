// Package lifetime decides, over a schedule of warmup/capture steps, how long
// each static buffer of each graphed pass is needed, which buffers can share
// one memory slot, and after which capture step a buffer the graphs produce
// can be handed back to the memory pool.
//
// Replays of graphs captured for a pipeline schedule run in the schedule's
// order, so a buffer's lifetime at replay is the span of steps between its
// first and last use. Two kinds of buffers are planned:
//
//   - slot buffers, which Python allocates or takes from the sample args:
//     static inputs (written by the forward's copy-in, read by the forward,
//     the backward and the weight-gradient pass) and static grad outputs
//     (written by the backward's copy-in, read by the backward and by the
//     weight-gradient pass). Buffers of one signature whose lifetimes do not
//     overlap share a slot. Slots are assigned greedily in order of first
//     use, which for intervals is optimal: a signature needs exactly as many
//     slots as it has buffers live at once.
//   - pool buffers, which the graphs themselves allocate in their memory
//     pool: outputs (read by the next layer's forward and by the pass's own
//     backward), grads of user inputs (read by the consumer that receives
//     them: the backward of the previous layer of the chunk, or, for a
//     chunk's first layer, the pipeline send that TransformerEngine assumes
//     done by the next chunk's first-layer backward) and parameter grads
//     that are cloned on return. Each gets a release step: once that step is
//     captured the buffer is dead for the rest of the schedule, so dropping
//     Python's reference lets later captures of the pool reuse its memory.
//
// TransformerEngine's _reuse_graph_input_output_buffers shares whole sample
// tuples first-in first-out per tuple signature, frees them at the
// backward, and keeps one grad-output tuple per output signature.
// Compare computes that count for the same buffers. This package's
// assignment never needs more slots for a signature when each
// weight-gradient step follows its backward directly, and fewer where
// tuples differ but tensors match, or where input and grad-output lifetimes
// leave room for one another. Where a forward runs between a backward and
// its weight-gradient pass, inputs and grad outputs stay live until the
// weight-gradient pass reads them (TransformerEngine would already reuse
// them there, which is only safe if the weight gradient reads neither).
package lifetime

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/gograph/gograph/internal/schedule"
)

// Role is what a buffer is to its pass.
type Role byte

// Buffer roles.
const (
	Input      Role = 'i' // static input (slot)
	GradOutput Role = 'g' // static grad output (slot)
	Output     Role = 'o' // output the forward graph writes (pool)
	GradInput  Role = 'd' // grad of a user input the backward graph writes (pool)
	ParamGrad  Role = 'p' // parameter grad the backward writes, cloned on return (pool)
)

func (r Role) valid() bool {
	switch r {
	case Input, GradOutput, Output, GradInput, ParamGrad:
		return true
	}
	return false
}

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

// Buffer is one static buffer of one pass. Sig identifies its tensor
// signature (shape, strides, dtype, device): only equal signatures share.
type Buffer struct {
	Role Role
	Pass int
	Sig  int
}

// Keys are the signatures TransformerEngine's scheme keys a pass by: its
// whole sample tuple (Input) and its whole grad-output tuple (Grad); -1 when
// the pass has none. Only Compare uses them.
type Keys struct {
	Input, Grad int
}

// SigStats is the outcome for one signature.
type SigStats struct {
	Buffers int // slot buffers of this signature (what no reuse keeps)
	Slots   int // slots this plan needs
	TEFifo  int // what TransformerEngine's FIFO scheme keeps (0 without Keys)
}

// Result is a buffer plan.
type Result struct {
	First, Last []int // per buffer: its first and last use (step indices)
	Slot        []int // per buffer: its slot (slot buffers) or -1
	Release     []int // per buffer: the step after which it is dead (pool buffers), -1 never
	Slots       int   // slots in all
	Sigs        map[int]*SigStats
}

// uses returns the steps at which b is used, in step order.
func uses(p *schedule.Plan, at [][3]int, b Buffer) ([]int, error) {
	f, bw, w := at[b.Pass][0], at[b.Pass][1], at[b.Pass][2]
	var out []int
	add := func(steps ...int) {
		for _, s := range steps {
			if s >= 0 {
				out = append(out, s)
			}
		}
	}
	switch b.Role {
	case Input:
		add(f, bw, w)
	case GradOutput:
		if bw < 0 {
			return nil, fmt.Errorf("%s buffer of pass %d: the pass has no backward step", b.Role, b.Pass)
		}
		add(bw, w)
	case Output:
		add(f, bw)
	case GradInput:
		if bw < 0 {
			return nil, fmt.Errorf("%s buffer of pass %d: the pass has no backward step", b.Role, b.Pass)
		}
		add(bw, consumer(p, bw))
	case ParamGrad:
		if bw < 0 {
			return nil, fmt.Errorf("%s buffer of pass %d: the pass has no backward step", b.Role, b.Pass)
		}
		add(bw)
	}
	return out, nil
}

// consumer is the step that reads the input grads the backward step bw
// produces: the backward of the previous layer of the same entry, or, for
// a chunk's first layer, the next first-layer backward (the pipeline send of
// the grad is assumed done by then, as TransformerEngine assumes). -1 when
// nothing follows.
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

// Assign plans bufs over p. keys (one per pass, or nil) feed the
// TransformerEngine comparison.
func Assign(p *schedule.Plan, bufs []Buffer, keys []Keys) (*Result, error) {
	at := make([][3]int, p.Passes)
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
	r := &Result{
		First:   make([]int, len(bufs)),
		Last:    make([]int, len(bufs)),
		Slot:    make([]int, len(bufs)),
		Release: make([]int, len(bufs)),
		Sigs:    make(map[int]*SigStats),
	}
	var slotted []int
	for i, b := range bufs {
		if !b.Role.valid() {
			return nil, fmt.Errorf("buffer %d: unknown role %q", i, byte(b.Role))
		}
		if b.Pass < 0 || b.Pass >= p.Passes || at[b.Pass][0] < 0 {
			return nil, fmt.Errorf("buffer %d: pass %d is not in the schedule (%d passes)", i, b.Pass, p.Passes)
		}
		if b.Sig < 0 {
			return nil, fmt.Errorf("buffer %d: negative signature %d", i, b.Sig)
		}
		u, err := uses(p, at, b)
		if err != nil {
			return nil, fmt.Errorf("buffer %d: %w", i, err)
		}
		r.First[i], r.Last[i] = u[0], u[0]
		for _, s := range u {
			r.First[i], r.Last[i] = min(r.First[i], s), max(r.Last[i], s)
		}
		r.Slot[i], r.Release[i] = -1, -1
		if b.Role.Slotted() {
			slotted = append(slotted, i)
			st := r.sig(b.Sig)
			st.Buffers++
			continue
		}
		// A pool buffer dies after its last use, unless the schedule never
		// reaches its consumer: then it must stay (the user may still read it).
		complete := true
		switch b.Role {
		case Output:
			complete = at[b.Pass][1] >= 0
		case GradInput:
			complete = consumer(p, at[b.Pass][1]) >= 0
		}
		if complete {
			r.Release[i] = r.Last[i]
		}
	}
	r.assignSlots(bufs, slotted)
	if keys != nil {
		if err := r.compare(p, bufs, keys); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func (r *Result) sig(s int) *SigStats {
	st := r.Sigs[s]
	if st == nil {
		st = &SigStats{}
		r.Sigs[s] = st
	}
	return st
}

// assignSlots colours the slot buffers' intervals greedily in order of first
// use, taking the lowest free slot of the signature.
func (r *Result) assignSlots(bufs []Buffer, idx []int) {
	sort.SliceStable(idx, func(a, b int) bool { return r.First[idx[a]] < r.First[idx[b]] })
	type busy struct{ last, slot, sig int }
	var active []busy
	free := map[int][]int{} // sig -> free slots, ascending
	perSig := map[int]int{}
	for _, i := range idx {
		start := r.First[i]
		kept := active[:0]
		for _, a := range active {
			if a.last < start {
				free[a.sig] = insertSorted(free[a.sig], a.slot)
			} else {
				kept = append(kept, a)
			}
		}
		active = kept
		sig := bufs[i].Sig
		var slot int
		if f := free[sig]; len(f) > 0 {
			slot, free[sig] = f[0], f[1:]
		} else {
			slot = r.Slots
			r.Slots++
			perSig[sig]++
		}
		r.Slot[i] = slot
		active = append(active, busy{r.Last[i], slot, sig})
	}
	for sig, n := range perSig {
		r.sig(sig).Slots = n
	}
}

func insertSorted(xs []int, x int) []int {
	i := sort.SearchInts(xs, x)
	xs = append(xs, 0)
	copy(xs[i+1:], xs[i:])
	xs[i] = x
	return xs
}

// compare computes, per signature, the buffers TransformerEngine's scheme
// keeps for the same slot buffers: sample tuples are reused first-in
// first-out among tuples of equal key once their chunk's backward entry ran
// (weight-gradient steps are ignored, as TransformerEngine ignores them),
// and one grad-output tuple is kept per grad key.
func (r *Result) compare(p *schedule.Plan, bufs []Buffer, keys []Keys) error {
	if len(keys) != p.Passes {
		return fmt.Errorf("keys for %d passes, but the schedule has %d", len(keys), p.Passes)
	}
	inputs := make([][]int, p.Passes) // pass -> sigs of its input slot buffers
	grads := make([][]int, p.Passes)
	for _, b := range bufs {
		switch b.Role {
		case Input:
			inputs[b.Pass] = append(inputs[b.Pass], b.Sig)
		case GradOutput:
			grads[b.Pass] = append(grads[b.Pass], b.Sig)
		}
	}
	consumed := map[int]int{} // input key -> tuples free for reuse
	gradSeen := map[int]bool{}
	for _, s := range p.Steps {
		k := keys[s.Pass]
		switch s.Kind {
		case schedule.Forward:
			if k.Input >= 0 && consumed[k.Input] > 0 {
				consumed[k.Input]--
				continue
			}
			for _, sig := range inputs[s.Pass] {
				r.sig(sig).TEFifo++
			}
		case schedule.Backward:
			if k.Input >= 0 {
				consumed[k.Input]++
			}
			if k.Grad >= 0 && !gradSeen[k.Grad] {
				gradSeen[k.Grad] = true
				for _, sig := range grads[s.Pass] {
					r.sig(sig).TEFifo++
				}
			} else if k.Grad < 0 {
				for _, sig := range grads[s.Pass] {
					r.sig(sig).TEFifo++
				}
			}
		}
	}
	return nil
}

// ParseBuffers parses the buffer list as Python sends it: one line per item,
// either "R pass sig" for a buffer (R one of i, g, o, d, p) or
// "k pass inputKey gradKey" for a pass's TransformerEngine keys. Buffers are
// numbered in the order given; keys default to -1.
func ParseBuffers(s string, passes int) ([]Buffer, []Keys, error) {
	var bufs []Buffer
	var keys []Keys
	for n, line := range strings.Split(strings.TrimSpace(s), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if want := map[bool]int{true: 4, false: 3}[f[0] == "k"]; len(f) != want {
			return nil, nil, fmt.Errorf("buffer line %d (%q): want \"R pass sig\" or \"k pass inputKey gradKey\"", n, line)
		}
		var v [3]int
		for j := 1; j < len(f); j++ {
			x, err := strconv.Atoi(f[j])
			if err != nil || x < -1 || x > 1<<30 {
				return nil, nil, fmt.Errorf("buffer line %d (%q): field %d is not a small integer", n, line, j)
			}
			v[j-1] = x
		}
		if v[0] < 0 || v[0] >= passes {
			return nil, nil, fmt.Errorf("buffer line %d (%q): pass %d out of range [0, %d)", n, line, v[0], passes)
		}
		if f[0] == "k" {
			if keys == nil {
				keys = make([]Keys, passes)
				for i := range keys {
					keys[i] = Keys{-1, -1}
				}
			}
			keys[v[0]] = Keys{Input: v[1], Grad: v[2]}
			continue
		}
		if len(f[0]) != 1 || !Role(f[0][0]).valid() {
			return nil, nil, fmt.Errorf("buffer line %d (%q): unknown role %q", n, line, f[0])
		}
		bufs = append(bufs, Buffer{Role: Role(f[0][0]), Pass: v[0], Sig: v[1]})
	}
	return bufs, keys, nil
}

// Encode renders r for Python: "assign" with one value per buffer (its slot,
// or its release step), "sig S buffers slots tefifo" per signature, and
// "slots N".
func (r *Result) Encode(bufs []Buffer) string {
	var b strings.Builder
	b.WriteString("assign")
	for i, buf := range bufs {
		v := r.Release[i]
		if buf.Role.Slotted() {
			v = r.Slot[i]
		}
		fmt.Fprintf(&b, " %d", v)
	}
	b.WriteByte('\n')
	sigs := make([]int, 0, len(r.Sigs))
	for s := range r.Sigs {
		sigs = append(sigs, s)
	}
	sort.Ints(sigs)
	for _, s := range sigs {
		st := r.Sigs[s]
		fmt.Fprintf(&b, "sig %d %d %d %d\n", s, st.Buffers, st.Slots, st.TEFifo)
	}
	fmt.Fprintf(&b, "slots %d\n", r.Slots)
	return b.String()
}
