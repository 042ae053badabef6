package lifetime

import "github.com/gograph/gograph/internal/schedule"

// Warmup plans iters warmup iterations over p.
//
// perCallable is torch's warmup (the default schedule without capture-time
// hooks): each pass, in forward order, runs all its iterations before the
// next pass starts, so only one callable's activations are ever alive.
// Otherwise every iteration runs the schedule's steps in order
// (TransformerEngine's warmup, which _order and capture-time hooks need: a
// pipeline's forwards and backwards interleave as they will at replay).
//
// Either way a forward's outputs die right after the backward that consumes
// them, and at once when the schedule has no backward for the pass
// (inference). Delayed weight-gradient work of the default schedule, which
// has no weight-gradient steps, is the executor's to run after the backward
// (whether a pass has any is only learnt while warming up).
func Warmup(p *schedule.Plan, iters int, perCallable bool) []Op {
	hasBackward := make([]bool, p.Passes)
	for _, s := range p.Steps {
		if s.Kind == schedule.Backward {
			hasBackward[s.Pass] = true
		}
	}
	var ops []Op
	if perCallable {
		for _, s := range p.Steps {
			if s.Kind != schedule.Forward {
				continue
			}
			for it := 0; it < iters; it++ {
				ops = append(ops, Op{Kind: WarmForward, Pass: s.Pass})
				if hasBackward[s.Pass] {
					ops = append(ops, Op{Kind: WarmBackward, Pass: s.Pass})
				}
				ops = append(ops, Op{Kind: DropWarm, Pass: s.Pass})
			}
		}
		return ops
	}
	for it := 0; it < iters; it++ {
		for _, s := range p.Steps {
			switch s.Kind {
			case schedule.Forward:
				ops = append(ops, Op{Kind: WarmForward, Pass: s.Pass})
				if !hasBackward[s.Pass] {
					ops = append(ops, Op{Kind: DropWarm, Pass: s.Pass})
				}
			case schedule.Backward:
				ops = append(ops, Op{Kind: WarmBackward, Pass: s.Pass}, Op{Kind: DropWarm, Pass: s.Pass})
			case schedule.WGrad:
				ops = append(ops, Op{Kind: WarmWGrad, Pass: s.Pass})
			}
		}
	}
	return ops
}
