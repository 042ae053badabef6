package lifetime

// Lent parameter grads: which replays may overwrite them.
//
// A lending backward (a pass with a GradLend policy) hands its static
// parameter-grad buffer to .grad: pool memory allocated while that backward
// was captured and held from then on. A graph captured before it may have
// been handed the same blocks at its own capture (the caching allocator
// reuses what was free then), so its replay may overwrite a lent .grad; a
// graph captured after it could not get them (they were allocated), and the
// lending backward's own replay writes them anew. The same holds across
// builds sharing a pool: every graph of an earlier build was captured
// before a later build's lending backwards.
//
// The executor copies a lent buffer out (or learns that the caller drops its
// grads) before any replay this rule names; it keeps only the check of
// whether anything but gograph still holds the buffer.

// lentOverwrites sets prog.LentFrom: for each capture op, the first op from
// which a lending backward's lent grads are memory its graph may overwrite
// (the first lending backward captured at or after it; len(prog.Ops) when
// none of this build is: then only later builds' lent grads are).
func lentOverwrites(facts []Facts, prog *Program) {
	lends := make([]bool, len(facts))
	for pass, pol := range prog.GradPolicy {
		for _, g := range pol {
			if g == GradLend && facts[pass].Backward {
				lends[pass] = true
			}
		}
	}
	prog.LentFrom = make([]int, len(prog.Ops))
	next := len(prog.Ops) // the first lending backward at or after op i
	for i := len(prog.Ops) - 1; i >= 0; i-- {
		op := prog.Ops[i]
		if op.Kind == CaptureBackward && lends[op.Pass] {
			next = i
		}
		prog.LentFrom[i] = -1
		if op.Kind.Captures() {
			prog.LentFrom[i] = next
		}
	}
}

// Captures reports whether k captures a graph (F, B or W).
func (k OpKind) Captures() bool {
	return k == CaptureForward || k == CaptureBackward || k == CaptureWGrad
}
