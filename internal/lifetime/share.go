package lifetime

// Graphs shared by the microbatches of one layer.
//
// An _order captures one set of graphs per (chunk, microbatch, layer) pass,
// although a pipeline rank holds only a few microbatches of a layer in
// flight at once. Two passes of one callable can replay one set of graphs --
// its static buffers, its saved activations, its weight-gradient graph --
// when their lifetimes in the schedule never overlap: from the forward (the
// copy-in) to the last step that reads what the forward left (the backward,
// or the weight-gradient step), one microbatch is done with the buffers
// before the next one's forward writes them. Interval colouring per callable
// (passes in forward order, each joining the colour that fell free earliest,
// else starting one) gives the fewest captures: the layer's in-flight depth.
// Passes whose facts differ (signatures, grads, graphs) never share.
//
// A sharing pass captures nothing and owns no buffer; the passes of one
// colour replay its first member's graphs (its representative). What a
// representative's buffers must outlive is then every member's lifetime:
// separate() gives its input leaves the colour's enclosing lifetime.

import (
	"fmt"
	"sort"
	"strings"

	"github.com/gograph/gograph/internal/schedule"
)

// shareGraphs returns, per pass, the pass whose graphs it replays: itself
// unless opt asks for sharing and the schedule allows it (an _order without
// Chain, whose chained buffers span passes). With Reuse, a colour's buffers
// are planned over the colour's enclosing lifetime and none goes back to the
// pool (its graphs capture once, in a pool of their own: nothing later could
// carve what they free), and the caller's sample entries are reorganised per
// callable (ReuseSampleEntries with per-callable keys), so that a colour's
// members take its representative's entry.
func shareGraphs(p *schedule.Plan, facts []Facts, at steps, opt Options) []int {
	rep := make([]int, p.Passes)
	for i := range rep {
		rep[i] = i
	}
	if !opt.Share || !p.Ordered || opt.Chain {
		return rep
	}
	byCallable := map[int][]int{} // callable -> its passes in forward order
	for _, s := range p.Steps {
		if s.Kind == schedule.Forward {
			byCallable[s.Callable] = append(byCallable[s.Callable], s.Pass)
		}
	}
	for _, passes := range byCallable {
		colourPasses(passes, facts, at, rep)
	}
	return rep
}

// colourPasses assigns passes (one callable's, in forward order) to colours.
func colourPasses(passes []int, facts []Facts, at steps, rep []int) {
	type colour struct {
		rep, end int
		key      string
	}
	var colours []*colour
	for _, pass := range passes {
		life := inputLifetime(facts[pass], at, pass)
		key := shareKey(facts[pass])
		var free *colour
		for _, c := range colours {
			if c.key == key && c.end < life[0] && (free == nil || c.end < free.end) {
				free = c
			}
		}
		if free == nil {
			colours = append(colours, &colour{rep: pass, end: life[1], key: key})
			continue
		}
		rep[pass], free.end = free.rep, life[1]
	}
}

// shareKey is what two passes must agree on to replay one set of graphs.
func shareKey(f Facts) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d %t %t|", f.NPos, f.Backward, f.WGrad)
	for _, in := range f.Inputs {
		fmt.Fprintf(&b, "%d:%t ", in.Sig, in.RequiresGrad)
	}
	b.WriteString("|")
	for _, o := range f.Outputs {
		fmt.Fprintf(&b, "%d:%t ", o.Sig, o.RequiresGrad)
	}
	b.WriteString("|")
	for _, g := range f.ParamGrads {
		fmt.Fprintf(&b, "%d:%d:%d ", g.Index, g.Param, g.Sig)
	}
	return b.String()
}

// colourLifetimes gives each representative the enclosing lifetime of its
// colour's members (a pass that shares nothing: its own).
func colourLifetimes(facts []Facts, at steps, rep []int) map[int][2]int {
	life := map[int][2]int{}
	for pass, f := range facts {
		l := inputLifetime(f, at, pass)
		r := rep[pass]
		if cur, ok := life[r]; ok {
			l = [2]int{min(cur[0], l[0]), max(cur[1], l[1])}
		}
		life[r] = l
	}
	return life
}

// colourSizes gives each representative the number of passes in its colour.
func colourSizes(rep []int) map[int]int {
	n := map[int]int{}
	for _, r := range rep {
		n[r]++
	}
	return n
}

// Sharers lists the passes that replay another's graphs, as (pass,
// representative) pairs in pass order.
func (p *Program) Sharers() [][2]int {
	var out [][2]int
	for pass, r := range p.Share {
		if r != pass {
			out = append(out, [2]int{pass, r})
		}
	}
	sort.Slice(out, func(a, b int) bool { return out[a][0] < out[b][0] })
	return out
}
