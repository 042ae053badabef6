package lifetime

import (
	"fmt"
	"math/rand"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/gograph/gograph/internal/schedule"
)

func plan(t testing.TB, ord []float64, layers string, callables, samples int) *schedule.Plan {
	t.Helper()
	parts := make([]string, len(ord))
	for i, x := range ord {
		parts[i] = strconv.FormatFloat(x, 'f', -1, 64)
	}
	entries, err := schedule.ParseOrder(strings.Join(parts, ","))
	if err != nil {
		t.Fatal(err)
	}
	l, scalar, err := schedule.ParseLayers(layers)
	if err != nil {
		t.Fatal(err)
	}
	p, err := schedule.Build(schedule.Spec{Order: entries, Layers: l, LayersScalar: scalar, NumCallables: callables, NumSamples: samples, Training: true, WarmupIters: 1})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func defaultPlan(t testing.TB, n int, training bool) *schedule.Plan {
	t.Helper()
	p, err := schedule.Default(n, training)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// layer gives every pass the facts of a training layer y = f(x) with x, y of
// signature 0 (x requiring grad unless noGradInput) and one parameter grad
// of signature 1, the parameter being its callable's.
func layer(p *schedule.Plan, noGradInput ...int) []Facts {
	callable := make([]int, p.Passes)
	for _, s := range p.Steps {
		callable[s.Pass] = s.Callable
	}
	skip := map[int]bool{}
	for _, n := range noGradInput {
		skip[n] = true
	}
	facts := make([]Facts, p.Passes)
	for i := range facts {
		facts[i] = Facts{
			Inputs:     []InputLeaf{{Sig: 0, RequiresGrad: !skip[i], Unique: true, Slottable: true}},
			NPos:       1,
			Outputs:    []OutputLeaf{{Sig: 0, RequiresGrad: true}},
			ParamGrads: []ParamLeaf{{Index: 1, Param: callable[i], Sig: 1}},
			Backward:   true,
			Keys:       Keys{Input: 0, Grad: 0},
		}
	}
	return facts
}

func ops(t testing.TB, o []Op) string {
	t.Helper()
	parts := make([]string, len(o))
	for i, x := range o {
		parts[i] = x.String()
	}
	return strings.Join(parts, " | ")
}

func mustCapture(t testing.TB, p *schedule.Plan, facts []Facts, opt Options) *Program {
	t.Helper()
	prog, err := Capture(p, facts, opt)
	if err != nil {
		t.Fatal(err)
	}
	if err := programInvariants(p, facts, prog, opt); err != nil {
		t.Fatal(err)
	}
	return prog
}

// TestWarmupReleasePoints names when each warmup forward's outputs die.
func TestWarmupReleasePoints(t *testing.T) {
	tests := []struct {
		name        string
		p           *schedule.Plan
		iters       int
		perCallable bool
		want        string
	}{
		{"torch's per-callable loop: outputs die after their backward", defaultPlan(t, 2, true), 2, true,
			"f 0 | b 0 | x 0 | f 0 | b 0 | x 0 | f 1 | b 1 | x 1 | f 1 | b 1 | x 1"},
		{"per-callable inference: outputs die at once", defaultPlan(t, 2, false), 1, true,
			"f 0 | x 0 | f 1 | x 1"},
		{"schedule order (capture-time hooks): all forwards, backwards in reverse", defaultPlan(t, 2, true), 1, false,
			"f 0 | y 0 | f 1 | b 1 | x 1 | b 0 | x 0"},
		{"schedule order inference", defaultPlan(t, 2, false), 2, false,
			"f 0 | x 0 | f 1 | x 1 | f 0 | x 0 | f 1 | x 1"},
		{"_order with weight-gradient entries: each pass's outputs die at its backward", plan(t, []float64{1, 2, -2, -2.5, -1, -1.5}, "1,1", 2, 2), 1, false,
			"f 0 | y 0 | f 1 | b 1 | x 1 | w 1 | b 0 | x 0 | w 0"},
		{"_order per pass: each weight gradient right after its pass's backward", plan(t, []float64{1, 2, -2, -2.5, -1, -1.5}, "1,1", 2, 2), 2, true,
			"f 0 | b 0 | x 0 | w 0 | f 0 | b 0 | x 0 | w 0 | f 1 | b 1 | x 1 | w 1 | f 1 | b 1 | x 1 | w 1"},
		{"no iterations", defaultPlan(t, 3, true), 0, true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ops(t, Warmup(tc.p, tc.iters, tc.perCallable)); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

// TestCaptureReleasePoints names every release point of the default
// schedule and of _order schedules, with and without the memory plans.
func TestCaptureReleasePoints(t *testing.T) {
	three := defaultPlan(t, 3, true)
	inference := defaultPlan(t, 2, false)
	wgradFacts := layer(three, 0)
	wgradFacts[1].WGrad = true
	noGradOut := layer(three, 0)
	noGradOut[1].Outputs[0].RequiresGrad = false
	noGradOut[1].Backward = false
	te := plan(t, []float64{1, 2, -2, -1}, "*2", 4, 4) // F0 F1 F2 F3 B3 B2 B1 B0
	tests := []struct {
		name  string
		p     *schedule.Plan
		facts []Facts
		opt   Options
		want  string
	}{
		{"default schedule: capture-time outputs die at their backward", three, layer(three, 0), Options{},
			"F 0 | F 1 | F 2 | B 2 | X 2 | B 1 | X 1 | B 0 | X 0 | H -1"},
		{"a pool buffer is released only when the plan says so", three, layer(three, 0), Options{Release: true},
			"F 0 | F 1 | F 2 | B 2 | X 2 | B 1 | X 1 | B 0 | X 0 | H -1"},
		{"default schedule, a delayed weight gradient follows its backward", three, wgradFacts, Options{},
			"F 0 | F 1 | F 2 | B 2 | X 2 | B 1 | X 1 | W 1 | B 0 | X 0 | H -1"},
		{"inference: capture-time outputs die at once", inference, []Facts{{}, {}}, Options{},
			"F 0 | X 0 | F 1 | X 1 | H -1"},
		{"a forward without backward graph drops its outputs at once", three, noGradOut, Options{},
			"F 0 | F 1 | X 1 | F 2 | B 2 | X 2 | B 0 | X 0 | H -1"},
		{"chained default schedule: an edge's grad dies at the producer's backward", three, layer(three, 0), Options{Chain: true, Release: true},
			"F 0 | F 1 | F 2 | B 2 | X 2 | B 1 | X 1 | R d 2 0 | B 0 | X 0 | R d 1 0 | H -1"},
		{"chained, a delayed weight gradient: the grad it reads outlives every capture", three, wgradFacts, Options{Chain: true, Release: true},
			"F 0 | F 1 | F 2 | B 2 | X 2 | B 1 | X 1 | W 1 | B 0 | X 0 | R d 1 0 | H -1"},
		{"reuse, a delayed weight gradient: its parameter grads stay (backward_dw() writes them whenever)", three, wgradFacts, Options{Reuse: true, Release: true},
			"F 0 | F 1 | F 2 | B 2 | X 2 | R o 2 0 | R p 2 1 | B 1 | X 1 | W 1 | R o 1 0 | B 0 | X 0 | R o 0 0 | R p 0 1 | H -1"},
		{"chained without a device pool: nothing to hand back", three, layer(three, 0), Options{Chain: true},
			"F 0 | F 1 | F 2 | B 2 | X 2 | B 1 | X 1 | B 0 | X 0 | H -1"},
		{"_order with reuse: outputs and parameter grads at their backward, input grads at their consumer", te, layer(te), Options{Reuse: true, Release: true},
			"F 0 | F 1 | F 2 | F 3 | B 3 | X 3 | R o 3 0 | R p 3 1 | B 2 | X 2 | R o 2 0 | R p 2 1 | R d 3 0 | " +
				"B 1 | X 1 | R o 1 0 | R p 1 1 | B 0 | X 0 | R o 0 0 | R p 0 1 | R d 1 0 | R d 2 0 | H -1"},
		{"_order chained with reuse: outputs live until the consumer's backward", te, layer(te), Options{Reuse: true, Chain: true, Release: true},
			"F 0 | F 1 | F 2 | F 3 | B 3 | X 3 | R o 3 0 | R p 3 1 | B 2 | X 2 | R o 2 0 | R p 2 1 | R d 3 0 | " +
				"B 1 | X 1 | R o 1 0 | R p 1 1 | B 0 | X 0 | R o 0 0 | R p 0 1 | R d 1 0 | R d 2 0 | H -1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prog := mustCapture(t, tc.p, tc.facts, tc.opt)
			if got := ops(t, prog.Ops); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

func TestChainSources(t *testing.T) {
	p := defaultPlan(t, 3, true)
	facts := layer(p, 0)
	// layer 2 takes a second positional input (a mask) that is not chained
	facts[2].Inputs = append(facts[2].Inputs, InputLeaf{Sig: 5, Unique: true})
	facts[2].NPos = 2
	facts[2].ParamGrads[0].Index = 2
	prog := mustCapture(t, p, facts, Options{Chain: true, Release: true})
	want := map[[2]int]Source{
		{0, 0}: {Kind: Own}, {1, 0}: {Kind: Chained, Pass: 0}, {2, 0}: {Kind: Chained, Pass: 1}, {2, 1}: {Kind: Own},
	}
	for k, w := range want {
		if got := prog.Inputs[k[0]][k[1]]; got != w {
			t.Errorf("input %v = %+v, want %+v", k, got, w)
		}
	}
	// pass 0's grad output is pass 1's input grad, pass 1's is pass 2's; pass 2's is its own.
	gw := []Source{{Kind: Chained, Pass: 1}, {Kind: Chained, Pass: 2}, {Kind: Own}}
	for pass, w := range gw {
		if got := prog.GradOutputs[pass][0]; got != w {
			t.Errorf("grad output of pass %d = %+v, want %+v", pass, got, w)
		}
	}
	// Layer 0's input does not require grad: layer 1's (which does) must not chain to it... it is
	// chained to layer 0's output, which requires grad. A mismatch breaks the edge:
	facts = layer(p, 0)
	facts[1].Inputs[0].RequiresGrad = false
	facts[2].Inputs[0].Sig = 7
	prog = mustCapture(t, p, facts, Options{Chain: true})
	// (The unchained grad outputs share one slot: their backward steps differ.)
	if prog.Inputs[1][0].Kind != Own || prog.Inputs[2][0].Kind != Own || prog.GradOutputs[0][0].Kind == Chained {
		t.Errorf("mismatched edges chained: %+v / %+v", prog.Inputs, prog.GradOutputs)
	}
}

// TestGradOutputsShareWithoutReuse: without Reuse the grad-output buffers
// only a pass's backward reads share one slot per signature across backward
// steps; a slot one buffer would have alone stays that pass's own, and a
// pass with a delayed weight-gradient graph keeps its own.
func TestGradOutputsShareWithoutReuse(t *testing.T) {
	slot := func(n int) Source { return Source{Kind: Slot, Slot: n} }
	own, chained := Source{Kind: Own}, func(q int) Source { return Source{Kind: Chained, Pass: q} }
	three := defaultPlan(t, 3, true)
	twoOutputs := layer(three)
	for i := range twoOutputs {
		twoOutputs[i].Outputs = []OutputLeaf{{Sig: 0, RequiresGrad: true}, {Sig: 0, RequiresGrad: true}}
	}
	wgrad := layer(three)
	wgrad[1].WGrad = true
	mixed := layer(three)
	mixed[2].Outputs[0].Sig = 4
	pipe := plan(t, []float64{1, 2, -2, -1, 1, 2, -2, -1}, "", 2, 4)
	cases := []struct {
		name  string
		p     *schedule.Plan
		facts []Facts
		opt   Options
		want  [][]Source
		slots int
	}{
		{"default schedule: one slot for three backwards", three, layer(three), Options{}, [][]Source{{slot(0)}, {slot(0)}, {slot(0)}}, 1},
		{"the same with a device pool", three, layer(three), Options{Release: true}, [][]Source{{slot(0)}, {slot(0)}, {slot(0)}}, 1},
		{"two outputs of one signature: two slots", three, twoOutputs, Options{},
			[][]Source{{slot(0), slot(1)}, {slot(0), slot(1)}, {slot(0), slot(1)}}, 2},
		{"a delayed weight gradient reads its own", three, wgrad, Options{}, [][]Source{{slot(0)}, {own}, {slot(0)}}, 1},
		{"a signature no other pass has stays own", three, mixed, Options{}, [][]Source{{slot(0)}, {slot(0)}, {own}}, 1},
		{"one callable: its own", defaultPlan(t, 1, true), layer(defaultPlan(t, 1, true)), Options{}, [][]Source{{own}}, 0},
		{"chained: only the last layer has a grad-output buffer", three, layer(three, 0), Options{Chain: true, Release: true},
			[][]Source{{chained(1)}, {chained(2)}, {own}}, 0},
		{"an _order without reuse shares across microbatches", pipe, layer(pipe), Options{Release: true},
			[][]Source{{slot(0)}, {slot(0)}, {slot(0)}, {slot(0)}}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			prog := mustCapture(t, c.p, c.facts, c.opt)
			for pass, row := range c.want {
				for k, w := range row {
					if got := prog.GradOutputs[pass][k]; got != w {
						t.Errorf("grad output %d of pass %d = %+v, want %+v", k, pass, got, w)
					}
				}
			}
			if prog.Slots != c.slots {
				t.Errorf("%d slots, want %d", prog.Slots, c.slots)
			}
			for pass := range c.facts {
				for j, src := range prog.Inputs[pass] {
					if src.Kind == Slot {
						t.Errorf("input %d of pass %d got a slot without Reuse", j, pass)
					}
				}
			}
		})
	}
}

// Samples sharing memory: a leaf keeps its sample unless another leaf
// reading the same region is live at the same time (in pass order); chained
// leaves read their producer and claim nothing; a region overlapping a
// parameter is never kept.
func TestSeparateSharedSamples(t *testing.T) {
	shared := func(region int, param bool) InputLeaf {
		return InputLeaf{Sig: 0, RequiresGrad: true, Region: region, Param: param}
	}
	unique := InputLeaf{Sig: 0, RequiresGrad: true, Unique: true}
	mask := InputLeaf{Sig: 3, Region: 1}
	own, fresh, chained := Source{Kind: Own}, Source{Kind: Fresh}, func(q int) Source { return Source{Kind: Chained, Pass: q} }
	training := defaultPlan(t, 3, true)
	two := defaultPlan(t, 2, true)
	for _, tc := range []struct {
		name   string
		p      *schedule.Plan
		inputs [][]InputLeaf // per pass; its positional leaves
		opt    Options
		want   [][]Source
	}{
		{"one sample for three layers", training, [][]InputLeaf{{shared(1, false)}, {shared(1, false)}, {shared(1, false)}},
			Options{}, [][]Source{{own}, {fresh}, {fresh}}},
		{"chained, the views need nothing", training, [][]InputLeaf{{shared(1, false)}, {shared(1, false)}, {shared(1, false)}},
			Options{Chain: true, Release: true}, [][]Source{{own}, {chained(0)}, {chained(1)}}},
		{"twice in one callable", two, [][]InputLeaf{{shared(1, false), shared(1, false)}, {unique}},
			Options{}, [][]Source{{own, fresh}, {own}}},
		{"two regions", defaultPlan(t, 4, true), [][]InputLeaf{{shared(1, false)}, {shared(2, false)}, {shared(1, false)}, {shared(2, false)}},
			Options{}, [][]Source{{own}, {own}, {fresh}, {fresh}}},
		{"a parameter's memory", two, [][]InputLeaf{{shared(1, true)}, {shared(1, true)}},
			Options{Chain: true}, [][]Source{{fresh}, {chained(0)}}},
		{"unique leaves untouched", two, [][]InputLeaf{{{Sig: 0, RequiresGrad: true, Unique: true, Slottable: true}}, {unique}},
			Options{}, [][]Source{{own}, {own}}},
		{"inference: no backward keeps a sample live", defaultPlan(t, 2, false), [][]InputLeaf{{shared(1, false)}, {shared(1, false)}},
			Options{}, [][]Source{{own}, {own}}},
		{"microbatches one after another share (Megatron's reuse)", plan(t, []float64{1, -1, 1, -1, 1, -1}, "1", 1, 3),
			[][]InputLeaf{{shared(1, false)}, {shared(1, false)}, {shared(1, false)}},
			Options{Reuse: true}, [][]Source{{own}, {own}, {own}}},
		{"microbatches in flight together do not", plan(t, []float64{1, 1, -1, 1, -1, -1}, "1", 1, 3),
			[][]InputLeaf{{shared(1, false)}, {shared(1, false)}, {shared(1, false)}},
			Options{Reuse: true}, [][]Source{{own}, {fresh}, {own}}},
		{"a mask (no grad) shared by live layers keeps one buffer", training, [][]InputLeaf{{mask}, {mask}, {mask}},
			Options{}, [][]Source{{own}, {own}, {own}}},
		{"but not twice in one callable", two, [][]InputLeaf{{mask, mask}, {mask}},
			Options{}, [][]Source{{own, fresh}, {own}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			facts := layer(tc.p)
			for i, in := range tc.inputs {
				facts[i].Inputs, facts[i].NPos = in, len(in)
				facts[i].ParamGrads[0].Index = len(in)
				facts[i].Backward = stepsOf(tc.p).bwd(i) >= 0
			}
			prog := mustCapture(t, tc.p, facts, tc.opt)
			for i, w := range tc.want {
				for j, src := range w {
					if got := prog.Inputs[i][j]; got != src {
						t.Errorf("input %d of pass %d = %+v, want %+v", j, i, got, src)
					}
				}
			}
			if err := regionInvariants(tc.p, facts, prog); err != nil {
				t.Error(err)
			}
		})
	}
	facts, err := ParseFacts("pass 0 1 0 1 -1 -1\nin 0 0 1 0 0 1 0\nout 0 0 1\npass 1 1 0 1 -1 -1\nin 1 0 1 0 0 1 0\nout 1 0 1\n", two.Passes)
	if err != nil {
		t.Fatal(err)
	}
	if got := mustCapture(t, two, facts, Options{}).Encode(); !strings.Contains(got, "in 1 0 n\n") || strings.Contains(got, "in 0 0") {
		t.Errorf("Encode of a separated leaf:\n%s", got)
	}
}

func TestGradPolicies(t *testing.T) {
	p := defaultPlan(t, 2, true)
	pipe := plan(t, []float64{1, 1, -1, -1}, "1", 1, 2) // one layer, two microbatches: two passes share its parameter
	tests := []struct {
		name string
		p    *schedule.Plan
		opt  Options
		want [][]GradPolicy
	}{
		{"default: lent (owned buffers only their own backward overwrites)", p, Options{Release: true}, [][]GradPolicy{{GradLend}, {GradLend}}},
		{"default on the eager engine: lent", p, Options{}, [][]GradPolicy{{GradLend}, {GradLend}}},
		{"default schedule with slot reuse: transient clones", p, Options{Reuse: true, Release: true}, [][]GradPolicy{{GradTransient}, {GradTransient}}},
		{"default schedule with slot reuse on the eager engine: owned clones", p, Options{Reuse: true}, [][]GradPolicy{{GradClone}, {GradClone}}},
		{"chained: lent", p, Options{Chain: true, Release: true}, [][]GradPolicy{{GradLend}, {GradLend}}},
		{"reuse: transient clones", pipe, Options{Reuse: true, Release: true}, [][]GradPolicy{{GradTransient}, {GradTransient}}},
		{"chained pipeline: transient clones (a lent buffer per microbatch pass would be a second copy)", pipe,
			Options{Chain: true, Reuse: true, Release: true}, [][]GradPolicy{{GradTransient}, {GradTransient}}},
		{"chained pipeline on the eager engine: no pool to hand back", pipe, Options{Chain: true}, [][]GradPolicy{{GradClone}, {GradClone}}},
		{"pipeline without options: transient clones (a buffer per microbatch pass, each dead after its backward)", pipe,
			Options{Release: true}, [][]GradPolicy{{GradTransient}, {GradTransient}}},
		{"pipeline on the eager engine: owned clones", pipe, Options{}, [][]GradPolicy{{GradClone}, {GradClone}}},
		{"chained default schedule on the eager engine: lent all the same", p, Options{Chain: true}, [][]GradPolicy{{GradLend}, {GradLend}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prog := mustCapture(t, tc.p, layer(tc.p), tc.opt)
			if fmt.Sprint(prog.GradPolicy) != fmt.Sprint(tc.want) {
				t.Errorf("policies %c, want %c", prog.GradPolicy, tc.want)
			}
		})
	}
}

func TestTransformerEngineInterleaved(t *testing.T) {
	// TE's test order: 2 chunks x 1 layer x 3 microbatches. At most 4
	// microbatch-chunks are live (after 1,2,1,2), so 4 input tuples; the
	// backward reads one grad-output tuple: 5 buffers in TE's scheme.
	p := plan(t, []float64{1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1}, "", 2, 6)
	prog := mustCapture(t, p, layer(p), Options{Reuse: true, Release: true})
	if st := prog.Sigs[0]; st.Buffers != 12 || st.TEFifo != 5 || st.Slots != 5 {
		t.Errorf("sig 0: %+v, want 12 buffers, 5 slots, TE 5", *st)
	}
}

func TestFewerSlotsThanTE(t *testing.T) {
	// Passes whose sample tuples differ (a mask on chunk 1 only) but whose
	// hidden states match: TE keys whole tuples and cannot share chunk 1's x
	// with chunk 2's; per-tensor slots can.
	p := plan(t, []float64{1, -1, 2, -2}, "1,1", 2, 2)
	facts := layer(p)
	facts[0].Inputs = append(facts[0].Inputs, InputLeaf{Sig: 2, Unique: true, Slottable: true}) // the mask
	facts[0].ParamGrads[0].Index = 2
	facts[1].Keys.Input = 1
	prog := mustCapture(t, p, facts, Options{Reuse: true})
	if st := prog.Sigs[0]; st.Slots != 2 || st.TEFifo != 3 {
		t.Errorf("sig 0: %+v, want 2 slots (TE 3)", *st)
	}
	// An input and a grad output of the same signature share a slot when
	// their lifetimes allow: one slot for x of both passes and one for dy.
	p = plan(t, []float64{1, -1, 1, -1}, "1", 1, 2)
	prog = mustCapture(t, p, layer(p), Options{Reuse: true})
	if st := prog.Sigs[0]; st.Slots != 2 || st.TEFifo != 2 {
		t.Errorf("alternating: %+v", *st)
	}
}

func TestWeightGradientKeepsInputsLive(t *testing.T) {
	// A forward between a backward and its weight gradient must not take the
	// input or grad output the weight gradient still reads.
	p := plan(t, []float64{1, -1, 1, -1.5, -1, -1.5}, "1", 1, 2)
	facts := layer(p)
	facts[0].WGrad, facts[1].WGrad = true, true
	prog := mustCapture(t, p, facts, Options{Reuse: true})
	if prog.Inputs[0][0].Slot == prog.Inputs[1][0].Slot {
		t.Error("pass 1's input took the slot pass 0's weight gradient still reads")
	}
	if got := ops(t, prog.Ops); got != "F 0 | B 0 | X 0 | F 1 | W 0 | B 1 | X 1 | W 1 | H -1" {
		t.Errorf("ops %s", got)
	}
}

func TestMegatronBench(t *testing.T) {
	// bench/pipeline.py's schedule: one rank of 4 stages, 4 chunks x 2
	// layers, 8 microbatches.
	var fwd, bwd []float64
	for lo := 0; lo < 8; lo += 4 {
		for c := 0; c < 4; c++ {
			for m := lo; m < lo+4; m++ {
				fwd = append(fwd, float64(c+1))
				bwd = append(bwd, float64(c-4))
			}
		}
	}
	const warm = 18
	ord := append([]float64{}, fwd[:warm]...)
	for i := warm; i < len(fwd); i++ {
		ord = append(ord, fwd[i], bwd[i-warm])
	}
	ord = append(ord, bwd[len(bwd)-warm:]...)
	p := plan(t, ord, "*2", 8, 64)
	prog := mustCapture(t, p, layer(p), Options{Reuse: true, Release: true})
	// 19 microbatch-chunks live at the first backward, 2 layers each, plus
	// the grad output: 39 of 128 buffers.
	if st := prog.Sigs[0]; st.Buffers != 128 || st.Slots != 39 || st.TEFifo != 39 {
		t.Errorf("sig 0: %+v", *st)
	}
	// Chained, each chunk's second layer reads its first layer's output and
	// only the chunk's input and its last layer's grad output need slots.
	prog = mustCapture(t, p, layer(p), Options{Reuse: true, Chain: true, Release: true})
	if st := prog.Sigs[0]; st.Buffers != 64 || st.Slots != 20 {
		t.Errorf("chained sig 0: %+v", *st)
	}
}

func TestRejectsBadFacts(t *testing.T) {
	p := plan(t, []float64{1, -1}, "", 1, 1)
	for _, s := range []string{
		"pass 1 0 0 0 -1 -1", "x 0 0", "in 0", "in 0 -3 0 0 0", "pass 0 0 0 0 0", "in a 0 0 0 0",
		"pass 0 0 0 0 -1 -1\npass 0 0 0 0 -1 -1", "out 0 99999999999 0",
		"pass 0 0 0 2 -1 -1\nin 0 0 0 1 1",             // more positional inputs than inputs
		"pass 0 0 1 0 -1 -1",                           // a weight gradient without backward
		"in 0 0 0 0 1",                                 // slottable but not unique
		"in 0 0 0 1 0 2 0",                             // unique but sharing a region
		"in 0 0 0 0 0 0 1",                             // overlapping a parameter without a region
		"in 0 0 0 0 0 -1 0",                            // a negative region
		"in 0 0 0 0 0 1",                               // seven fields
		"pass 0 1 0 0 -1 -1\nin 0 0 1 1 1\npg 0 0 0 0", // a parameter grad inside the user inputs
	} {
		facts, err := ParseFacts(s, p.Passes)
		if err == nil {
			_, err = Capture(p, facts, Options{Reuse: true, Release: true})
		}
		if err == nil {
			t.Errorf("%q accepted", s)
		}
	}
	eval := defaultPlan(t, 1, false)
	if _, err := Capture(eval, []Facts{{Backward: true}}, Options{}); err == nil {
		t.Error("a backward graph of a pass without backward step accepted")
	}
	if _, err := Capture(eval, nil, Options{}); err == nil {
		t.Error("facts for the wrong number of passes accepted")
	}
}

func TestEncode(t *testing.T) {
	p := plan(t, []float64{1, -1, 1, -1}, "1", 1, 2)
	facts, err := ParseFacts("pass 0 1 0 1 0 0\nin 0 0 1 1 1\nout 0 0 1\npg 0 1 0 3\n"+
		"pass 1 1 0 1 0 0\nin 1 0 1 1 1\nout 1 0 1\npg 1 1 0 3\n", p.Passes)
	if err != nil {
		t.Fatal(err)
	}
	prog := mustCapture(t, p, facts, Options{Reuse: true, Chain: true, Release: true})
	// One layer, two microbatches: nothing to chain; slots as with reuse alone; both
	// parameter grads transient (released after their backward).
	want := "op F 0\nop B 0\nop X 0\nop R o 0 0\nop R p 0 1\nop F 1\nop B 1\nop X 1\nop R d 0 0\nop R o 1 0\nop R p 1 1\nop H -1\n" +
		"lent F 0 12\nlent B 0 12\nlent F 1 12\nlent B 1 12\n" +
		"in 0 0 s 0\nin 1 0 s 0\ngout 0 0 s 1\ngout 1 0 s 1\ngrad 0 0 t\ngrad 1 0 t\nsig 0 4 2 2\nslots 2\n"
	if got := prog.Encode(); got != want {
		t.Errorf("Encode:\n%s\nwant\n%s", got, want)
	}
	if got := EncodeOps(Warmup(p, 1, false)); got != "op f 0\nop b 0\nop x 0\nop f 1\nop b 1\nop x 1\n" {
		t.Errorf("EncodeOps: %q", got)
	}
}

// programInvariants is what every program must satisfy: each pass's
// captures appear once, in order (forward, backward, weight gradient) and
// each forward's capture-time outputs are dropped after its last capture;
// no release precedes a read of the buffer; chained buffers are read only
// after they were written and have equal signatures; slots are never given
// to two buffers live at once and hold one signature; slots per signature
// are exactly the most buffers of it live at once.
func programInvariants(p *schedule.Plan, facts []Facts, prog *Program, opt Options) error {
	pos := map[string]int{}
	for i, o := range prog.Ops {
		key := o.String()
		if _, dup := pos[key]; dup {
			return fmt.Errorf("op %q twice", key)
		}
		pos[key] = i
	}
	at := func(k OpKind, pass int) int {
		if i, ok := pos[Op{Kind: k, Pass: pass}.String()]; ok {
			return i
		}
		return -1
	}
	if err := shareInvariants(p, facts, prog, opt); err != nil {
		return err
	}
	for pass, f := range facts {
		if prog.Share[pass] != pass {
			continue // checked by shareInvariants: it captures nothing
		}
		fw, bw, w, x := at(CaptureForward, pass), at(CaptureBackward, pass), at(CaptureWGrad, pass), at(DropCapture, pass)
		if fw < 0 || x < fw || (f.Backward != (bw >= 0)) || (bw >= 0 && (bw < fw || x < bw)) || (w >= 0 && w < bw) {
			return fmt.Errorf("pass %d: F %d B %d W %d X %d (backward %v)", pass, fw, bw, w, x, f.Backward)
		}
		for j, src := range prog.Inputs[pass] {
			if src.Kind != Chained {
				continue
			}
			q := src.Pass
			if at(CaptureForward, q) > fw || facts[q].Outputs[src.Index].Sig != f.Inputs[j].Sig {
				return fmt.Errorf("pass %d input %d chained to pass %d output %d, captured later or of another signature", pass, j, q, src.Index)
			}
			if r := pos[Op{Kind: Release, Pass: q, Role: Output, Index: src.Index}.String()]; r > 0 && (r < fw || (bw >= 0 && r < bw)) {
				return fmt.Errorf("pass %d's chained input (pass %d output %d) released at op %d before its reads", pass, q, src.Index, r)
			}
		}
		for k, src := range prog.GradOutputs[pass] {
			if src.Kind == Chained {
				q := src.Pass
				qb := at(CaptureBackward, q)
				if qb < 0 || qb > bw || !facts[q].Inputs[src.Index].RequiresGrad || facts[q].Inputs[src.Index].Sig != f.Outputs[k].Sig {
					return fmt.Errorf("pass %d grad output %d chained to pass %d input grad %d, which is not written before", pass, k, q, src.Index)
				}
				if r, ok := pos[Op{Kind: Release, Pass: q, Role: GradInput, Index: src.Index}.String()]; ok && r < bw {
					return fmt.Errorf("pass %d's chained grad output released at op %d before its backward (op %d)", pass, r, bw)
				}
			}
		}
	}
	if err := regionInvariants(p, facts, prog); err != nil {
		return err
	}
	for i, o := range prog.Ops {
		if o.Kind != Release {
			continue
		}
		if !opt.Release {
			return fmt.Errorf("op %d: a release without Options.Release", i)
		}
		if b := at(CaptureBackward, o.Pass); b < 0 || b > i {
			return fmt.Errorf("op %d (%s) before its pass's backward", i, o)
		}
	}
	return slotInvariants(p, facts, prog, opt)
}

// shareInvariants: sharing only where the options allow it; a sharing pass
// names a representative with its facts, and has no op, source or policy;
// the members of one colour are never in flight together.
func shareInvariants(p *schedule.Plan, facts []Facts, prog *Program, opt Options) error {
	if len(prog.Share) != len(facts) {
		return fmt.Errorf("share has %d entries for %d passes", len(prog.Share), len(facts))
	}
	at := readSteps(p, facts)
	members := map[int][][2]int{}
	for pass, r := range prog.Share {
		members[r] = append(members[r], inputLifetime(facts[pass], at, pass))
		if r == pass {
			continue
		}
		if !opt.Share || !p.Ordered || opt.Chain {
			return fmt.Errorf("pass %d shares pass %d's graphs with options %+v", pass, r, opt)
		}
		if prog.Share[r] != r || shareKey(facts[pass]) != shareKey(facts[r]) {
			return fmt.Errorf("pass %d shares pass %d, which is no representative or has other facts", pass, r)
		}
		if len(prog.Inputs[pass])+len(prog.GradOutputs[pass])+len(prog.GradPolicy[pass]) > 0 {
			return fmt.Errorf("sharing pass %d has sources or policies of its own", pass)
		}
		for _, o := range prog.Ops {
			if o.Pass == pass {
				return fmt.Errorf("sharing pass %d has op %s", pass, o)
			}
		}
	}
	for r, lives := range members {
		sort.Slice(lives, func(a, b int) bool { return lives[a][0] < lives[b][0] })
		for i := 1; i < len(lives); i++ {
			if lives[i][0] <= lives[i-1][1] {
				return fmt.Errorf("colour of pass %d: lifetimes %v and %v overlap", r, lives[i-1], lives[i])
			}
		}
	}
	return nil
}

// regionInvariants: no leaf that requires grad reads its sample while
// another leaf of its memory is live, no two leaves of one pass read one
// region, no leaf reading its sample overlaps a parameter, and only shared
// leaves get a buffer of their own.
func regionInvariants(p *schedule.Plan, facts []Facts, prog *Program) error {
	at := stepsOf(p)
	type reader struct {
		pass, leaf int
		life       [2]int
	}
	readers := map[int][]reader{}
	lives := colourLifetimes(facts, at, prog.Share) // a representative's buffers serve its whole colour
	for pass, f := range facts {
		if prog.Share[pass] != pass {
			continue
		}
		life := lives[pass]
		for j, in := range f.Inputs {
			switch src := prog.Inputs[pass][j]; {
			case src.Kind == Fresh && in.Region == 0:
				return fmt.Errorf("pass %d input %d shares no memory but got a buffer of its own", pass, j)
			case src.Kind != Own || in.Region == 0:
			case in.Param:
				return fmt.Errorf("pass %d input %d reads a sample overlapping a parameter", pass, j)
			default:
				for _, r := range readers[in.Region] {
					if r.pass == pass || (in.RequiresGrad && overlaps(r.life, life)) {
						return fmt.Errorf("passes %d and %d (inputs %d, %d) both read region %d while live (%v, %v)", r.pass, pass, r.leaf, j, in.Region, r.life, life)
					}
				}
				readers[in.Region] = append(readers[in.Region], reader{pass, j, life})
			}
		}
	}
	return nil
}

func slotInvariants(p *schedule.Plan, facts []Facts, prog *Program, opt Options) error {
	at := stepsOf(p)
	type live struct{ first, last, sig int }
	slots := map[int][]live{}
	add := func(slot, sig int, uses ...int) {
		b := buffer{}
		b.span(uses...)
		slots[slot] = append(slots[slot], live{b.first, b.last, sig})
	}
	lives, members := colourLifetimes(facts, at, prog.Share), map[int]int{}
	for _, r := range prog.Share {
		members[r]++
	}
	for pass, f := range facts {
		bw, w := at.bwd(pass), at.wgrad(pass)
		if !f.Backward {
			bw, w = -1, -1
		}
		colour := []int{-1, -1} // a shared colour's buffers live over every member's lifetime
		if members[pass] > 1 {
			colour = []int{lives[pass][0], lives[pass][1]}
		}
		for j, s := range prog.Inputs[pass] {
			if s.Kind == Slot {
				add(s.Slot, f.Inputs[j].Sig, at.fwd(pass), bw, w, colour[0], colour[1])
			}
		}
		for k, s := range prog.GradOutputs[pass] {
			if s.Kind == Slot && internalGradOutput(f) && !opt.Reuse { // only grad outputs share: a member's step holds it
				add(s.Slot, f.Outputs[k].Sig, bw, w)
			} else if s.Kind == Slot {
				add(s.Slot, f.Outputs[k].Sig, bw, w, colour[0], colour[1])
			}
		}
	}
	for slot, ls := range slots {
		for i, a := range ls {
			for _, b := range ls[:i] {
				if a.sig != b.sig {
					return fmt.Errorf("slot %d holds signatures %d and %d", slot, a.sig, b.sig)
				}
				if a.first <= b.last && b.first <= a.last {
					return fmt.Errorf("slot %d given to buffers live %d..%d and %d..%d at once", slot, b.first, b.last, a.first, a.last)
				}
			}
		}
	}
	if err := memberUses(at, facts, prog); err != nil {
		return err
	}
	shared := map[int]map[int]bool{} // sig -> regions of samples passes share (counted as slots with Reuse)
	if opt.Reuse {
		for pass, f := range facts {
			for j, in := range f.Inputs {
				if in.Region > 0 && !in.Param && prog.Share[pass] == pass && prog.Inputs[pass][j].Kind == Own {
					if shared[in.Sig] == nil {
						shared[in.Sig] = map[int]bool{}
					}
					shared[in.Sig][in.Region] = true
				}
			}
		}
	}
	for sig, st := range prog.Sigs {
		peak := 0
		for step := range p.Steps {
			n := 0
			for _, ls := range slots {
				for _, l := range ls {
					if l.sig == sig && l.first <= step && step <= l.last {
						n++
					}
				}
			}
			peak = max(peak, n)
		}
		if st.Slots != peak+len(shared[sig]) {
			return fmt.Errorf("signature %d: %d slots, but at most %d buffers are live at once and %d samples are shared", sig, st.Slots, peak, len(shared[sig]))
		}
	}
	return nil
}

// memberUses checks slots against every use of their buffers: a colour's
// buffers (its representative's) are used at each member's own steps, an
// input from the member's forward to its backward (or weight gradient), an
// incoming-grad buffer at its backward and weight gradient; two buffers of
// one slot are never used at one step.
func memberUses(at steps, facts []Facts, prog *Program) error {
	type use struct {
		buf         [3]int // representative, role (0 input, 1 grad output), index
		first, last int
	}
	bySlot := map[int][]use{}
	for pass, f := range facts {
		r := prog.Share[pass]
		bw, w := at.bwd(pass), at.wgrad(pass)
		if !f.Backward {
			bw, w = -1, -1
		}
		for j, s := range prog.Inputs[r] {
			if s.Kind == Slot {
				b := buffer{}
				b.span(at.fwd(pass), bw, w)
				bySlot[s.Slot] = append(bySlot[s.Slot], use{[3]int{r, 0, j}, b.first, b.last})
			}
		}
		for k, s := range prog.GradOutputs[r] {
			if s.Kind == Slot && bw >= 0 {
				b := buffer{}
				b.span(bw, w)
				bySlot[s.Slot] = append(bySlot[s.Slot], use{[3]int{r, 1, k}, b.first, b.last})
			}
		}
	}
	for slot, us := range bySlot {
		for i, a := range us {
			for _, b := range us[:i] {
				if a.buf != b.buf && a.first <= b.last && b.first <= a.last {
					return fmt.Errorf("slot %d: buffer %v used %d..%d and buffer %v used %d..%d", slot, b.buf, b.first, b.last, a.buf, a.first, a.last)
				}
			}
		}
	}
	return nil
}

// randomOrder is a random valid interleaved schedule: chunks*micro
// microbatch-chunks, each forward before backward, per chunk in microbatch
// order; with wgrad (one layer per chunk) each backward gets a weight
// gradient, directly after it when adjacent, else at a random later point
// before the chunk's next backward.
func randomOrder(rng *rand.Rand, chunks, micro int, wgrad, adjacent bool) []float64 {
	fwd := make([]int, chunks)
	bwd := make([]int, chunks)
	pendW := make([]bool, chunks)
	var out []float64
	for len(out) < 2*chunks*micro+map[bool]int{true: chunks * micro, false: 0}[wgrad] {
		c := rng.Intn(chunks)
		switch rng.Intn(3) {
		case 0:
			if fwd[c] < micro {
				out = append(out, float64(c+1))
				fwd[c]++
			}
		case 1:
			if bwd[c] < fwd[c] && !pendW[c] {
				out = append(out, float64(-(c + 1)))
				bwd[c]++
				if wgrad && adjacent {
					out = append(out, -float64(c+1)-0.5)
				} else if wgrad {
					pendW[c] = true
				}
			}
		case 2:
			if pendW[c] {
				out = append(out, -float64(c+1)-0.5)
				pendW[c] = false
			}
		}
	}
	return out
}

// randomFacts gives each callable a fixed random layout (as a layer has):
// a few input leaves and outputs over a few signatures, some requiring
// grad, and a parameter grad.
func randomFacts(rng *rand.Rand, p *schedule.Plan, wgrad bool) []Facts {
	nsig := 1 + rng.Intn(3)
	layouts := make([]Facts, p.Callables)
	for c := range layouts {
		f := &layouts[c]
		for k := 0; k < 1+rng.Intn(3); k++ {
			in := InputLeaf{Sig: rng.Intn(nsig), RequiresGrad: rng.Intn(3) > 0, Unique: true, Slottable: rng.Intn(4) > 0}
			if rng.Intn(4) == 0 { // a sample sharing memory with other leaves (every pass of the callable shares it)
				in = InputLeaf{Sig: in.Sig, RequiresGrad: in.RequiresGrad, Region: 1 + rng.Intn(2), Param: rng.Intn(5) == 0}
			}
			f.Inputs = append(f.Inputs, in)
		}
		f.NPos = 1 + rng.Intn(len(f.Inputs))
		for k := 0; k < 1+rng.Intn(2); k++ {
			f.Outputs = append(f.Outputs, OutputLeaf{Sig: rng.Intn(nsig), RequiresGrad: rng.Intn(4) > 0})
		}
		f.ParamGrads = []ParamLeaf{{Index: len(f.Inputs), Param: c, Sig: nsig}}
		f.Keys = Keys{Input: c, Grad: c}
	}
	callable := make([]int, p.Passes)
	for _, s := range p.Steps {
		callable[s.Pass] = s.Callable
	}
	facts := make([]Facts, p.Passes)
	for pass := range facts {
		f := layouts[callable[pass]]
		facts[pass] = f
		facts[pass].Backward = false
		for _, o := range f.Outputs {
			facts[pass].Backward = facts[pass].Backward || o.RequiresGrad
		}
		facts[pass].WGrad = wgrad && facts[pass].Backward
	}
	return facts
}

// TestPropertyRandomSchedules: over random schedules, layouts and options,
// every program has the invariants, and (without weight gradients that
// trail their backward) no signature needs more slots than
// TransformerEngine's FIFO scheme.
func TestPropertyRandomSchedules(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for iter := 0; iter < 500; iter++ {
		chunks, micro := 1+rng.Intn(4), 1+rng.Intn(5)
		wgrad := rng.Intn(3) == 0
		adjacent := !wgrad || rng.Intn(2) == 0
		layers := 1
		if !wgrad {
			layers = 1 + rng.Intn(3)
		}
		var p *schedule.Plan
		if rng.Intn(4) == 0 && !wgrad {
			p = defaultPlan(t, 1+rng.Intn(5), true)
		} else {
			p = plan(t, randomOrder(rng, chunks, micro, wgrad, adjacent), fmt.Sprintf("*%d", layers), chunks*layers, chunks*layers*micro)
		}
		facts := randomFacts(rng, p, wgrad && p.Ordered)
		if wgrad && p.Ordered { // a W step needs its pass to have a weight-gradient graph
			for pass := range facts {
				facts[pass].Backward, facts[pass].WGrad = true, true
				facts[pass].Outputs[0].RequiresGrad = true
			}
		}
		opt := Options{Reuse: p.Ordered && rng.Intn(2) == 0, Chain: rng.Intn(2) == 0, Release: rng.Intn(3) > 0, Share: rng.Intn(2) == 0}
		prog, err := Capture(p, facts, opt)
		if err != nil {
			t.Fatalf("schedule %v: %v", p.Steps, err)
		}
		if err := programInvariants(p, facts, prog, opt); err != nil {
			t.Fatalf("options %+v: %v", opt, err)
		}
		if opt.Reuse && adjacent && !opt.Chain && !opt.Share { // (shared colours hold their buffers longer: TransformerEngine has no sharing)
			for sig, st := range prog.Sigs {
				if st.Slots > st.TEFifo {
					t.Fatalf("signature %d needs %d slots, TransformerEngine's FIFO %d", sig, st.Slots, st.TEFifo)
				}
			}
		}
	}
}

// FuzzPlanCapture: arbitrary facts text never panics the parser or the
// planner, and whatever is accepted yields a program with the invariants.
func FuzzPlanCapture(f *testing.F) {
	f.Add("pass 0 1 0 1 0 0\nin 0 0 1 1 1\nout 0 0 1\npg 0 1 0 2\npass 1 1 0 1 0 0\nin 1 0 1 1 1\nout 1 0 1\n", byte(7))
	f.Add("pass 1 1 0 0 -1 -1\nout 1 0 1\nin 3 0 1 0 0\n", byte(2))
	f.Add("pass 0 1 0 1 0 0\nin 0 0 1 0 0 1 0\nout 0 0 1\npass 1 1 0 1 0 0\nin 1 0 1 0 0 1 1\nin 1 0 1 0 0 1 0\nout 1 0 1\n", byte(3))
	f.Fuzz(func(t *testing.T, s string, flags byte) {
		p := plan(t, []float64{1, 2, -2, -1, 1, 2, -2, -1}, "", 2, 4)
		facts, err := ParseFacts(s, p.Passes)
		if err != nil {
			return
		}
		opt := Options{Reuse: flags&1 != 0, Chain: flags&2 != 0, Release: flags&4 != 0, Share: flags&8 != 0}
		prog, err := Capture(p, facts, opt)
		if err != nil {
			return
		}
		if err := programInvariants(p, facts, prog, opt); err != nil {
			t.Fatal(err)
		}
		_ = prog.Encode()
	})
}

func TestChooseWarmup(t *testing.T) {
	def := defaultPlan(t, 2, true)
	pipe := plan(t, []float64{1, 1, -1, -1}, "1", 1, 2)
	tests := []struct {
		name                      string
		p                         *schedule.Plan
		hooks, wholeStep, ownPool bool
		want                      WarmupMode
	}{
		{"default: torch's per-callable loop on the side stream", def, false, false, true, WarmupMode{PerCallable: true}},
		{"the whole step, own pool: the step's order in the pool", def, false, true, true, WarmupMode{InPool: true}},
		{"the whole step, a pool passed in: its blocks may be other graphs' memory", def, false, true, false, WarmupMode{PerCallable: true}},
		{"capture-time hooks: the schedule's order on the side stream", def, true, true, true, WarmupMode{}},
		{"an _order: per pass on the side stream", pipe, false, true, true, WarmupMode{PerCallable: true}},
		{"an _order with capture-time hooks: the schedule's order", pipe, true, false, true, WarmupMode{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ChooseWarmup(tc.p, tc.hooks, tc.wholeStep, tc.ownPool); got != tc.want {
				t.Errorf("ChooseWarmup = %+v, want %+v", got, tc.want)
			}
		})
	}
}
