package lifetime

import (
	"fmt"
	"sort"

	"github.com/gograph/gograph/internal/schedule"
)

// Capture plans the captures of p from what warmup learned about each pass
// (facts, one per pass): the ops in order with every release point, where
// each static buffer comes from, and how each parameter grad reaches .grad.
//
// The program ends with ReturnWarmupPool, and says for every captured graph
// which lent parameter grads its replay may overwrite (lentOverwrites).
//
// Release points on every schedule:
//
//   - a forward's capture-time outputs die once its backward is captured,
//     or right after the forward when it gets no backward graph;
//   - with Options.Release, a pool buffer dies after its last reader is
//     captured: an output (Options.Reuse only: outputs otherwise stay valid
//     until their pass's next forward, as torch's are) after its pass's
//     backward and any chained consumer's backward; a user input's grad
//     after the backward that consumes it (the chained producer's, or, in
//     an _order with Reuse, the pass TransformerEngine assumes); a
//     transient parameter grad after the graph that writes it (its
//     weight-gradient graph where it has one). What a delayed weight-gradient
//     graph reads (its pass's inputs, incoming grads) lives until its step in
//     an _order, and is never released in the default schedule, where
//     backward_dw() runs whenever the caller says.
func Capture(p *schedule.Plan, facts []Facts, opt Options) (*Program, error) {
	if err := checkFacts(p, facts); err != nil {
		return nil, err
	}
	at := readSteps(p, facts)
	prog := newProgram(facts)
	prog.Share = shareGraphs(p, facts, at, opt)
	if opt.Chain {
		chain(p, facts, prog)
	}
	separate(facts, prog, at)
	bufs := planBuffers(p, facts, prog, at, opt)
	prog.Slots = assignSlots(bufs, prog.Sigs)
	if !opt.Reuse {
		prog.Slots = keepShared(bufs, prog.Sigs)
	}
	for _, b := range bufs {
		if b.role.Slotted() && b.slot >= 0 {
			slotSource(prog, b)
		}
	}
	if opt.Reuse {
		shared, n := sharedSamples(facts, prog)
		prog.Slots += n
		compareTE(p, bufs, shared, facts, prog.Sigs)
	}
	gradPolicies(p, facts, prog, at, opt)
	for pass, r := range prog.Share { // a sharing pass has nothing of its own
		if r != pass {
			prog.Inputs[pass], prog.GradOutputs[pass], prog.GradPolicy[pass] = nil, nil, nil
		}
	}
	if err := captureOps(p, facts, prog, bufs, at); err != nil {
		return nil, err
	}
	// Warmup's (or the seed's) reference on the pool goes back once every
	// capture holds its own: after the last op, as no capture follows.
	prog.Ops = append(prog.Ops, Op{Kind: ReturnWarmupPool, Pass: NoPass})
	lentOverwrites(facts, prog)
	return prog, nil
}

func checkFacts(p *schedule.Plan, facts []Facts) error {
	if len(facts) != p.Passes {
		return fmt.Errorf("facts for %d passes, but the schedule has %d", len(facts), p.Passes)
	}
	at := stepsOf(p)
	for i, f := range facts {
		if f.NPos < 0 || f.NPos > len(f.Inputs) {
			return fmt.Errorf("pass %d: %d positional inputs of %d", i, f.NPos, len(f.Inputs))
		}
		if f.Backward && at.bwd(i) < 0 {
			return fmt.Errorf("pass %d has a backward graph but no backward step in the schedule", i)
		}
		if f.WGrad && !f.Backward {
			return fmt.Errorf("pass %d has a weight-gradient graph but no backward graph", i)
		}
		for _, in := range f.Inputs {
			if in.Sig < 0 || (in.Slottable && !in.Unique) {
				return fmt.Errorf("pass %d: input signature %d (slottable %v, unique %v) is invalid", i, in.Sig, in.Slottable, in.Unique)
			}
			if in.Unique && (in.Region != 0 || in.Param) {
				return fmt.Errorf("pass %d: a unique input cannot share memory (region %d, parameter %v)", i, in.Region, in.Param)
			}
			if in.Region < 0 || (in.Param && in.Region == 0) {
				return fmt.Errorf("pass %d: input region %d (parameter %v) is invalid: regions number from 1, and a leaf overlapping a parameter has one", i, in.Region, in.Param)
			}
		}
		for _, o := range f.Outputs {
			if o.Sig < 0 {
				return fmt.Errorf("pass %d: negative output signature %d", i, o.Sig)
			}
		}
		index, param := map[int]bool{}, map[int]bool{}
		for _, g := range f.ParamGrads {
			if g.Index < len(f.Inputs) || g.Sig < 0 || g.Param < 0 {
				return fmt.Errorf("pass %d: parameter grad %+v is invalid (its index must follow the %d user inputs)", i, g, len(f.Inputs))
			}
			// One grad per index and per parameter: a second would get a
			// second policy for the same returned tensor.
			if index[g.Index] || param[g.Param] {
				return fmt.Errorf("pass %d: parameter grad %+v repeats an index or a parameter of an earlier one", i, g)
			}
			index[g.Index], param[g.Param] = true, true
		}
	}
	return nil
}

func newProgram(facts []Facts) *Program {
	prog := &Program{
		Inputs:      make([][]Source, len(facts)),
		GradOutputs: make([][]Source, len(facts)),
		GradPolicy:  make([][]GradPolicy, len(facts)),
		Sigs:        make(map[int]*SigStats),
	}
	for i, f := range facts {
		prog.Inputs[i] = make([]Source, len(f.Inputs))
		for j := range f.Inputs {
			prog.Inputs[i][j] = Source{Kind: Own}
		}
		prog.GradOutputs[i] = make([]Source, len(f.Outputs))
		for k, o := range f.Outputs {
			prog.GradOutputs[i][k] = Source{Kind: Own}
			if !o.RequiresGrad || !f.Backward {
				prog.GradOutputs[i][k] = Source{Kind: None}
			}
		}
		prog.GradPolicy[i] = make([]GradPolicy, len(f.ParamGrads))
	}
	return prog
}

// chain links each pass to the layer that feeds it: output k of the
// producer becomes the pass's positional input leaf k when their signatures
// and requires_grad agree; when the input requires grad and both have a
// backward, the pass's input grad becomes the producer's grad output k.
func chain(p *schedule.Plan, facts []Facts, prog *Program) {
	for pass, q := range producers(p) {
		if q < 0 {
			continue
		}
		fp, fq := facts[pass], facts[q]
		for k := 0; k < min(fp.NPos, len(fq.Outputs)); k++ {
			in, out := fp.Inputs[k], fq.Outputs[k]
			if in.Sig != out.Sig || in.RequiresGrad != out.RequiresGrad {
				continue
			}
			prog.Inputs[pass][k] = Source{Kind: Chained, Pass: q, Index: k}
			if in.RequiresGrad && fp.Backward && fq.Backward {
				prog.GradOutputs[q][k] = Source{Kind: Chained, Pass: pass, Index: k}
			}
		}
	}
}

// separate gives a buffer of their own to the input leaves whose samples
// share memory with a leaf that is still read: one buffer read by two
// graphs whose lifetimes overlap (from the forward's copy-in to the last
// backward or weight-gradient read) would carry the second's copy-in into
// the first's pending backward (torch's graphs share it silently). That is
// decided for leaves that require grad (activations, which differ from
// layer to layer) and, within one pass, for every leaf (f(a, b) with one
// sample for both); a leaf that does not require grad (a mask, rotary
// embeddings: the same for every layer of a step) keeps sharing, as in torch
// and TransformerEngine, so passing the same tensor to every layer copies
// nothing. Leaves whose lifetimes do not overlap keep sharing (Megatron-LM
// shares samples between microbatches by the schedule). A sample overlapping
// a parameter is never kept: a copy-in would write the weights. A chained
// leaf reads its producer's output, not its sample, and claims nothing.
func separate(facts []Facts, prog *Program, at steps) {
	type reader struct {
		pass int
		life [2]int
	}
	readers := map[int][]reader{} // region -> the leaves reading their samples
	lives := colourLifetimes(facts, at, prog.Share)
	for pass, f := range facts {
		if prog.Share[pass] != pass {
			continue // reads its representative's buffers
		}
		life := lives[pass]
		for j, in := range f.Inputs {
			if in.Region == 0 || prog.Inputs[pass][j].Kind != Own {
				continue
			}
			clash := false
			for _, r := range readers[in.Region] {
				clash = clash || r.pass == pass || (in.RequiresGrad && overlaps(r.life, life))
			}
			if in.Param || clash {
				prog.Inputs[pass][j] = Source{Kind: Fresh}
				continue
			}
			readers[in.Region] = append(readers[in.Region], reader{pass, life})
		}
	}
}

// inputLifetime is the steps from a pass's forward (the copy-in) to the
// last step that reads its inputs: its backward or weight-gradient step.
func inputLifetime(f Facts, at steps, pass int) [2]int {
	var b buffer
	if f.Backward {
		b.span(at.fwd(pass), at.bwd(pass), at.wgrad(pass))
	} else {
		b.span(at.fwd(pass))
	}
	return [2]int{b.first, b.last}
}

func overlaps(a, b [2]int) bool { return a[0] <= b[1] && b[0] <= a[1] }

// producers gives, per pass, the pass whose outputs it consumes when layers
// are chained (-1 for none): the previous callable of the default schedule,
// or the previous layer of the same chunk and microbatch of an _order. The
// producer's forward is always captured before the consumer's, and the
// consumer's backward before the producer's.
func producers(p *schedule.Plan) []int {
	out := make([]int, p.Passes)
	for i := range out {
		out[i] = -1
	}
	if !p.Ordered {
		for i := 1; i < p.Passes; i++ {
			out[i] = i - 1
		}
		return out
	}
	for _, s := range p.Steps {
		if s.Kind == schedule.Forward && s.Layer > 0 {
			out[s.Pass] = p.PassIndex(s.Chunk, s.Micro, s.Layer-1)
		}
	}
	return out
}

// planBuffers lists the buffers whose lifetimes matter: slot candidates
// (with Reuse) and pool buffers, with their uses and release steps.
func planBuffers(p *schedule.Plan, facts []Facts, prog *Program, at steps, opt Options) []*buffer {
	var bufs []*buffer
	readers := chainedReaders(prog)
	lives, members := colourLifetimes(facts, at, prog.Share), colourSizes(prog.Share)
	for pass, f := range facts {
		if prog.Share[pass] != pass {
			continue // its representative's buffers serve it
		}
		fw, bw, w := at.fwd(pass), at.bwd(pass), at.wgrad(pass)
		if !f.Backward {
			bw, w = -1, -1
		}
		shared := members[pass] > 1 // every member's lifetime is the buffers'
		for j, in := range f.Inputs {
			if opt.Reuse && in.Slottable && prog.Inputs[pass][j].Kind == Own {
				b := &buffer{role: Input, pass: pass, index: j, sig: in.Sig, slot: -1, release: -1}
				b.span(fw, bw, w)
				if shared {
					b.span(fw, bw, w, lives[pass][0], lives[pass][1])
				}
				bufs = append(bufs, b)
			}
		}
		for k, o := range f.Outputs {
			if (opt.Reuse || internalGradOutput(f)) && prog.GradOutputs[pass][k].Kind == Own {
				b := &buffer{role: GradOutput, pass: pass, index: k, sig: o.Sig, slot: -1, release: -1}
				b.span(bw, w)
				// A shared colour's incoming-grad buffer is written at each member's backward (and
				// read by its weight gradient): its slot is the colour's over every member's
				// lifetime, unless only grad-output buffers share slots (without Reuse), which
				// each member's backward step alone holds.
				if shared && (opt.Reuse || !internalGradOutput(f)) {
					b.span(bw, w, lives[pass][0], lives[pass][1])
				}
				bufs = append(bufs, b)
			}
		}
		if !opt.Release || shared {
			continue // a shared colour's pool takes no capture after its own
		}
		bufs = append(bufs, outputBuffers(facts, pass, fw, bw, readers[pass], at, opt)...)
		bufs = append(bufs, gradInputBuffers(p, f, prog, pass, bw, at, opt)...)
	}
	return bufs
}

// internalGradOutput reports whether a pass's own grad-output buffers are
// read by nothing but its backward replay, so that passes whose backward
// steps differ share them (one slot per signature and backward step)
// without Reuse: every backward replay copies its incoming grad in first and
// its graph reads nothing else there, the buffers are gograph's alone (torch
// and TransformerEngine never hand them out), and replays on one stream or
// ordered by the core (Python orders the stream before the copy-in) cannot
// overlap. A delayed weight-gradient graph also reads them, whenever the
// caller runs backward_dw(), so those keep their own.
func internalGradOutput(f Facts) bool { return f.Backward && !f.WGrad }

// chainedReaders gives, per producer pass and output, the consumer passes
// that read it in place.
func chainedReaders(prog *Program) []map[int][]int {
	out := make([]map[int][]int, len(prog.Inputs))
	for pass, row := range prog.Inputs {
		for _, s := range row {
			if s.Kind == Chained {
				if out[s.Pass] == nil {
					out[s.Pass] = map[int][]int{}
				}
				out[s.Pass][s.Index] = append(out[s.Pass][s.Index], pass)
			}
		}
	}
	return out
}

// outputBuffers are a pass's outputs with release steps: only with Reuse
// (TransformerEngine's semantics: a returned output is valid until the
// schedule reuses its memory) and only for a pass whose backward exists
// (without one the user may still read it).
func outputBuffers(facts []Facts, pass, fw, bw int, readers map[int][]int, at steps, opt Options) []*buffer {
	if !opt.Reuse || bw < 0 {
		return nil
	}
	var bufs []*buffer
	for k, o := range facts[pass].Outputs {
		b := &buffer{role: Output, pass: pass, index: k, sig: o.Sig, slot: -1}
		uses := []int{fw, bw}
		for _, r := range readers[k] { // a chained consumer reads it in its forward and may in its backward
			uses = append(uses, at.fwd(r))
			if facts[r].Backward { // its weight-gradient graph reads the saved input too
				uses = append(uses, at.bwd(r), at.wgrad(r))
			}
		}
		b.span(uses...)
		b.release = b.last
		bufs = append(bufs, b)
	}
	return bufs
}

// gradInputBuffers are the grads of a pass's user inputs that require grad,
// released after the backward that consumes them: the chained producer's
// (its grad output is this buffer), or with Reuse in an _order the
// consumer TransformerEngine assumes. Unchained input grads of the default
// schedule go to a consumer the planner does not know and stay.
func gradInputBuffers(p *schedule.Plan, f Facts, prog *Program, pass, bw int, at steps, opt Options) []*buffer {
	if bw < 0 {
		return nil
	}
	consumers := map[int]int{} // input leaf -> the last step of its consumer that reads it
	for q, row := range prog.GradOutputs {
		for _, s := range row {
			if s.Kind == Chained && s.Pass == pass { // a weight-gradient graph reads its incoming grads
				consumers[s.Index] = max(at.bwd(q), at.wgrad(q))
			}
		}
	}
	var bufs []*buffer
	for j, in := range f.Inputs {
		if !in.RequiresGrad {
			continue
		}
		c, chained := consumers[j]
		if !chained {
			if !opt.Reuse || !p.Ordered {
				continue
			}
			c = consumer(p, bw)
		}
		if c < 0 {
			continue
		}
		b := &buffer{role: GradInput, pass: pass, index: j, sig: in.Sig, slot: -1}
		b.span(bw, c)
		if c < len(p.Steps) { // read by a backward_dw() that runs whenever the caller says: kept
			b.release = b.last
		} else {
			b.release = -1
		}
		bufs = append(bufs, b)
	}
	return bufs
}

// slotSource records a slot buffer's slot in the program.
func slotSource(prog *Program, b *buffer) {
	src := Source{Kind: Slot, Slot: b.slot}
	if b.role == Input {
		prog.Inputs[b.pass][b.index] = src
	} else {
		prog.GradOutputs[b.pass][b.index] = src
	}
}

// gradPolicies decides how each parameter grad reaches .grad. A build of
// the default schedule lends the static buffer to its first backward's
// .grad (no clone: it is copied out only if .grad still holds it when a
// graph that may overwrite it replays). Chained, the buffer sits in pool
// memory the next forward's activations reuse, as eager training's fresh
// .grad does; unchained it is owned and only its own backward overwrites
// it, so lending saves the clone's time and its memory while .grad lives.
// With TransformerEngine's slot reuse and no chain the buffers go back to
// the pool after the backward instead (transient clones). In an _order every
// microbatch's pass of a layer has its own buffer and the first one's
// backward is captured after the schedule's warmup forwards, so a lent
// buffer would be one more copy of the parameter grads beside an owned
// .grad that outlives the step (measured: +3.8 % of the pipeline's peak
// with zero_grad(set_to_none=False)); there, and without Chain, owned
// clones are returned and, whenever the build releases pool buffers (a
// device pool), the buffers go back to the pool after the backward: a
// clone is made before any other replay (the backward's own return), and
// where .grad exists autograd's AccumulateGrad, which the engine runs
// before any other node that became ready with it, adds the buffer in
// right away. Kept for the graph's lifetime, an _order's buffers were one
// copy of the layer's parameter grads per microbatch pass.
func gradPolicies(p *schedule.Plan, facts []Facts, prog *Program, at steps, opt Options) {
	first := map[int]int{} // param -> pass of its first backward
	for _, s := range p.Steps {
		if s.Kind != schedule.Backward || !facts[s.Pass].Backward {
			continue
		}
		for _, g := range facts[s.Pass].ParamGrads {
			if _, ok := first[g.Param]; !ok {
				first[g.Param] = s.Pass
			}
		}
	}
	for pass, f := range facts {
		for i, g := range f.ParamGrads {
			switch {
			case !p.Ordered && first[g.Param] == pass && (opt.Chain || !opt.Reuse):
				prog.GradPolicy[pass][i] = GradLend
			case opt.Release && (opt.Reuse || opt.Chain || p.Ordered) && f.Backward:
				prog.GradPolicy[pass][i] = GradTransient
			default:
				prog.GradPolicy[pass][i] = GradClone
			}
		}
	}
}

// captureOps emits the capture ops in schedule order, each step followed by
// the releases that fall after it.
func captureOps(p *schedule.Plan, facts []Facts, prog *Program, bufs []*buffer, at steps) error {
	releases := map[int][]Op{}
	for _, b := range bufs {
		if !b.role.Slotted() && b.release >= 0 {
			releases[b.release] = append(releases[b.release], Op{Kind: Release, Pass: b.pass, Role: b.role, Index: b.index})
		}
	}
	for pass, f := range facts {
		if prog.Share[pass] != pass {
			continue
		}
		for i, g := range f.ParamGrads {
			if prog.GradPolicy[pass][i] == GradTransient {
				// the graph that writes them: the weight-gradient graph where there is one
				s := max(at.bwd(pass), at.wgrad(pass))
				releases[s] = append(releases[s], Op{Kind: Release, Pass: pass, Role: ParamGrad, Index: g.Index})
			}
		}
	}
	for i, s := range p.Steps {
		f := facts[s.Pass]
		if prog.Share[s.Pass] != s.Pass {
			s.Kind = 0 // replays its representative's graphs: nothing to capture
		}
		switch s.Kind {
		case schedule.Forward:
			prog.Ops = append(prog.Ops, Op{Kind: CaptureForward, Pass: s.Pass})
			if !f.Backward {
				prog.Ops = append(prog.Ops, Op{Kind: DropCapture, Pass: s.Pass})
			}
		case schedule.Backward:
			if !f.Backward {
				continue
			}
			prog.Ops = append(prog.Ops, Op{Kind: CaptureBackward, Pass: s.Pass}, Op{Kind: DropCapture, Pass: s.Pass})
			if !p.Ordered && f.WGrad {
				prog.Ops = append(prog.Ops, Op{Kind: CaptureWGrad, Pass: s.Pass})
			}
		case schedule.WGrad:
			if !f.WGrad {
				return fmt.Errorf("step %d: a weight-gradient step for pass %d, which has no weight-gradient graph", i, s.Pass)
			}
			prog.Ops = append(prog.Ops, Op{Kind: CaptureWGrad, Pass: s.Pass})
		}
		rs := releases[i]
		sort.Slice(rs, func(a, b int) bool {
			if rs[a].Pass != rs[b].Pass {
				return rs[a].Pass < rs[b].Pass
			}
			if rs[a].Role != rs[b].Role {
				return rs[a].Role < rs[b].Role
			}
			return rs[a].Index < rs[b].Index
		})
		prog.Ops = append(prog.Ops, rs...)
	}
	return nil
}
