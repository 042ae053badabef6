package lifetime

import (
	"reflect"
	"testing"

	"github.com/gograph/gograph/internal/schedule"
)

// interleaved is Megatron-LM's interleaved 1F1B order for one rank with
// microbatch groups of pp: the warmup forwards, the steady 1F1B pairs, the
// cooldown backwards (wgrad: each backward followed by its -(c+0.5) entry).
func interleaved(pp, rank, chunks, micro int, wgrad bool) []float64 {
	var fwd, bwd []float64
	for lo := 0; lo < micro; lo += pp {
		for c := 0; c < chunks; c++ {
			for m := lo; m < lo+pp && m < micro; m++ {
				fwd = append(fwd, float64(c+1))
				bwd = append(bwd, float64(c-chunks))
			}
		}
	}
	warm := min((pp-rank-1)*2+(chunks-1)*pp, len(fwd))
	var ord []float64
	back := func(b float64) {
		ord = append(ord, b)
		if wgrad {
			ord = append(ord, b-0.5)
		}
	}
	ord = append(ord, fwd[:warm]...)
	for i := warm; i < len(fwd); i++ {
		ord = append(ord, fwd[i])
		back(bwd[i-warm])
	}
	for _, b := range bwd[len(bwd)-warm:] {
		back(b)
	}
	return ord
}

func TestShareGraphs(t *testing.T) {
	oneF1B := []float64{1, 1, -1, 1, -1, 1, -1, -1} // pp 2, rank 0: two microbatches in flight
	cases := []struct {
		name    string
		ord     []float64
		layers  string
		nCall   int
		wgrad   bool
		noBack  bool
		differ  []int // passes with other facts (another output signature)
		colours []int // captures (colours) per callable
		share   map[int]int
	}{
		{name: "1F1B: two in flight, four microbatches", ord: oneF1B, nCall: 1, colours: []int{2},
			share: map[int]int{2: 0, 3: 1}},
		{name: "sequential microbatches share one graph", ord: []float64{1, -1, 1, -1, 1, -1}, nCall: 1, colours: []int{1},
			share: map[int]int{1: 0, 2: 0}},
		{name: "all forwards first: nothing shares", ord: []float64{1, 1, 1, -1, -1, -1}, nCall: 1, colours: []int{3}},
		{name: "forward-only passes share one graph", ord: []float64{1, 1, 1, -1, -1, -1}, nCall: 1, noBack: true, colours: []int{1},
			share: map[int]int{1: 0, 2: 0}},
		{name: "a weight-gradient entry keeps its microbatch in flight", ord: []float64{1, -1, 1, -1.5, -1, -1.5}, layers: "*1", nCall: 1,
			wgrad: true, colours: []int{2}},
		{name: "weight-gradient entries right after their backwards", ord: []float64{1, -1, -1.5, 1, -1, -1.5}, layers: "*1", nCall: 1,
			wgrad: true, colours: []int{1}, share: map[int]int{1: 0}},
		{name: "passes with other facts never share", ord: []float64{1, -1, 1, -1, 1, -1}, nCall: 1, differ: []int{1},
			colours: []int{2}, share: map[int]int{2: 0}},
		{name: "two layers per chunk colour alike", ord: []float64{1, -1, 1, -1}, layers: "*2", nCall: 2, colours: []int{1, 1},
			share: map[int]int{2: 0, 3: 1}},
		{name: "interleaved, 4 stages, rank 0, 2 chunks, 8 microbatches", ord: interleaved(4, 0, 2, 8, false), nCall: 2},
		{name: "interleaved, rank 0, 32 microbatches: no more graphs", ord: interleaved(4, 0, 2, 32, false), nCall: 2},
		{name: "interleaved, last rank, 16 microbatches", ord: interleaved(4, 3, 2, 16, false), nCall: 2},
		{name: "interleaved with weight-gradient entries", ord: interleaved(4, 1, 2, 16, true), layers: "*1", nCall: 2, wgrad: true},
		{name: "interleaved, 2 layers per chunk", ord: interleaved(2, 0, 3, 8, false), layers: "*2", nCall: 6},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			layers := c.layers
			p := plan(t, c.ord, layers, c.nCall, c.nCall*countForwards(c.ord)/chunksOf(c.ord))
			facts := layer(p)
			for i := range facts {
				facts[i].Backward, facts[i].WGrad = !c.noBack, c.wgrad
				facts[i].Outputs[0].RequiresGrad = !c.noBack
				if c.noBack {
					facts[i].ParamGrads = nil
				}
			}
			for _, d := range c.differ {
				facts[d].Outputs[0].Sig = 7
			}
			opt := Options{Release: true, Share: true}
			prog := mustCapture(t, p, facts, opt)
			captures := map[int]int{}
			for _, s := range p.Steps {
				if prog.Share[s.Pass] == s.Pass && s.Kind == 'F' {
					captures[s.Callable]++
				}
			}
			for callable, want := range c.colours {
				if captures[callable] != want {
					t.Errorf("callable %d: %d forward captures, want %d (share %v)", callable, captures[callable], want, prog.Share)
				}
			}
			// The fewest a colouring can give: the most passes of a callable in flight at one step.
			for callable, depth := range inFlight(p, facts) {
				if c.differ == nil && captures[callable] != depth {
					t.Errorf("callable %d: %d captures, %d in flight at most", callable, captures[callable], depth)
				}
			}
			if c.share != nil {
				got := map[int]int{}
				for _, s := range prog.Sharers() {
					got[s[0]] = s[1]
				}
				if !reflect.DeepEqual(got, c.share) {
					t.Errorf("sharers %v, want %v", got, c.share)
				}
			}
			// Without the option, or with Chain, every pass captures its own; Reuse shares alike.
			for _, o := range []Options{{Release: true}, {Release: true, Share: true, Chain: true}} {
				if s := mustCapture(t, p, facts, o).Sharers(); len(s) != 0 {
					t.Errorf("options %+v: sharers %v", o, s)
				}
			}
			withReuse := mustCapture(t, p, facts, Options{Release: true, Share: true, Reuse: p.Ordered})
			if p.Ordered && !reflect.DeepEqual(withReuse.Share, prog.Share) {
				t.Errorf("with Reuse: share %v, without %v", withReuse.Share, prog.Share)
			}
		})
	}
}

func countForwards(ord []float64) int {
	n := 0
	for _, e := range ord {
		if e > 0 {
			n++
		}
	}
	return n
}

func chunksOf(ord []float64) int {
	c := 0
	for _, e := range ord {
		c = max(c, int(e))
	}
	return c
}

func TestShareEncodesSharers(t *testing.T) {
	p := plan(t, []float64{1, -1, 1, -1}, "", 1, 2)
	prog := mustCapture(t, p, layer(p), Options{Share: true})
	if got := prog.Encode(); !containsLine(got, "share 1 0") || containsLine(got, "op F 1") {
		t.Errorf("program:\n%s", got)
	}
}

func containsLine(text, line string) bool {
	for _, l := range splitLines(text) {
		if l == line {
			return true
		}
	}
	return false
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

// inFlight gives, per callable, the most of its passes whose lifetimes
// contain one step (brute force, independent of the colouring).
func inFlight(p *schedule.Plan, facts []Facts) map[int]int {
	at := readSteps(p, facts)
	callableOf := map[int]int{}
	for _, s := range p.Steps {
		callableOf[s.Pass] = s.Callable
	}
	out := map[int]int{}
	for step := range p.Steps {
		n := map[int]int{}
		for pass, f := range facts {
			if l := inputLifetime(f, at, pass); l[0] <= step && step <= l[1] {
				n[callableOf[pass]]++
			}
		}
		for c, k := range n {
			out[c] = max(out[c], k)
		}
	}
	return out
}

// TestShareCapturesStayFlat: past the in-flight depth, more microbatches
// capture no more graphs (bench/pipeline.py's rank: 4 stages, 4 chunks).
func TestShareCapturesStayFlat(t *testing.T) {
	var first []int
	for _, micro := range []int{8, 16, 32, 64} {
		p := plan(t, interleaved(4, 0, 4, micro, false), "*2", 8, 8*micro)
		prog := mustCapture(t, p, layer(p), Options{Release: true, Share: true})
		captures := make([]int, 8)
		for pass, r := range prog.Share {
			if r == pass {
				captures[pass/(2*micro)*2+pass%2]++ // the pass's callable: chunk*2 + layer
			}
		}
		if first == nil {
			first = captures
			continue
		}
		if !reflect.DeepEqual(captures, first) {
			t.Errorf("%d microbatches: captures per callable %v, with 8: %v", micro, captures, first)
		}
	}
}
