package lifetime

import "github.com/gograph/gograph/internal/schedule"

// WarmupMode is how a build warms up: in the schedule's order or per
// callable, and whether warmup allocates in the build's graph pool.
type WarmupMode struct {
	PerCallable bool // torch's loop: each pass's iterations before the next pass
	InPool      bool // allocations in the graph pool the captures then use
}

// ChooseWarmup decides a build's warmup from what is known before it:
// whether capture-time hooks are given, whether the callables make the
// whole training step (the last pass of the default schedule returns only
// 0-dim outputs, one of them requiring grad: the loss, so the graphs begin
// the backward themselves) and whether the build's pool is its own (no
// graph has used it; a pool passed in may hold blocks earlier graphs write).
//
// Capture-time hooks need the schedule's order (TransformerEngine's warmup:
// a hook may stage per-layer state, such as offloaded weights, in that
// order), on the side stream. So does nothing else: an _order without hooks
// warms up per pass, each pass's forward, backward and weight gradient
// before the next pass (TransformerEngine's warmup before it followed the
// order), so that warmup holds one pass's activations where the schedule's
// order would hold every pass in flight: a pipeline rank's warmup then
// peaks far below its captures, which keep the in-flight passes in the pool.
//
// A whole step with a pool of its own warms up as eager training runs the
// step, in the schedule's order, inside the graph pool: the pool is then
// laid out as eager's step lays out its one pool (the backward's cuBLAS
// workspace in a block the loss freed, not a segment of its own) and the
// captures, which repeat that step, fit into it, so the build's peak is
// the eager step's. Other builds keep torch's per-callable loop on the
// side stream: graphs that leave the loss to the caller hold buffers an
// eager step does not, and a pool laid out by a step measured up to 8 %
// larger there (docs/BENCHMARKS.md, "Warmup inside the graph pool").
func ChooseWarmup(p *schedule.Plan, hooks, wholeStep, ownPool bool) WarmupMode {
	if hooks {
		return WarmupMode{}
	}
	if wholeStep && ownPool && !p.Ordered {
		return WarmupMode{InPool: true}
	}
	return WarmupMode{PerCallable: true}
}

// Warmup plans iters warmup iterations over p.
//
// perCallable is torch's warmup (every schedule without capture-time
// hooks): each pass, in forward order, runs all its iterations before the
// next pass starts, so only one callable's activations are ever alive; a
// pass with a weight-gradient step in the schedule runs it right after its
// backward, as the schedule pairs them.
// Otherwise every iteration runs the schedule's steps in order
// (TransformerEngine's warmup, which _order and capture-time hooks need: a
// pipeline's forwards and backwards interleave as they will at replay).
//
// Either way a forward's outputs die right after the backward that consumes
// them, and at once when the schedule has no backward for the pass
// (inference: built under no_grad). In the schedule's order a pass of a
// build with backward steps may still have none (its outputs need no grad,
// which only its forward tells): a DropInference op right after each of its
// forwards lets those outputs die at once, before the next pass runs.
// Delayed weight-gradient work of the default schedule, which
// has no weight-gradient steps, is the executor's to run after the backward
// (whether a pass has any is only learnt while warming up).
func Warmup(p *schedule.Plan, iters int, perCallable bool) []Op {
	hasBackward := make([]bool, p.Passes)
	hasWGrad := make([]bool, p.Passes)
	for _, s := range p.Steps {
		switch s.Kind {
		case schedule.Backward:
			hasBackward[s.Pass] = true
		case schedule.WGrad:
			hasWGrad[s.Pass] = true
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
				if hasWGrad[s.Pass] {
					ops = append(ops, Op{Kind: WarmWGrad, Pass: s.Pass})
				}
			}
		}
		return ops
	}
	for it := 0; it < iters; it++ {
		for i, s := range p.Steps {
			switch s.Kind {
			case schedule.Forward:
				ops = append(ops, Op{Kind: WarmForward, Pass: s.Pass})
				if hasBackward[s.Pass] {
					// Not needed when its backward comes next: nothing runs
					// between them, and the DropWarm after it frees them.
					if next := i + 1; next >= len(p.Steps) || p.Steps[next].Kind != schedule.Backward || p.Steps[next].Pass != s.Pass {
						ops = append(ops, Op{Kind: DropInference, Pass: s.Pass})
					}
				} else {
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

// ZeroGrads adds to a warmup program the points where each pass's zero
// incoming grads die (DropZeroGrads): the executor makes a zero grad per
// output requiring grad for a warmup backward and, with reuse, keeps them
// for the pass's next backward while nothing else runs in between (its
// next iteration follows at once, as in torch's per-callable loop);
// autograd only reads them. Without reuse (capture-time hooks, which could
// write them) they die after every backward's DropWarm. They die at the
// latest with the pass's last DropWarm.
func ZeroGrads(ops []Op, reuse bool) []Op {
	backward := map[int]bool{}
	for _, o := range ops {
		if o.Kind == WarmBackward {
			backward[o.Pass] = true
		}
	}
	out := make([]Op, 0, len(ops)+len(backward))
	for i, o := range ops {
		out = append(out, o)
		if o.Kind != DropWarm || !backward[o.Pass] {
			continue
		}
		next := i + 1
		for next < len(ops) && ops[next].Kind == WarmWGrad && ops[next].Pass == o.Pass {
			next++ // its weight gradient reads no incoming grad
		}
		if reuse && next < len(ops) && ops[next].Pass == o.Pass && ops[next].Kind == WarmForward {
			continue // its next iteration follows: the same zeros serve it
		}
		out = append(out, Op{Kind: DropZeroGrads, Pass: o.Pass})
	}
	return out
}
