package lifetime

import (
	"fmt"
	"github.com/gograph/gograph/internal/schedule"
	"strings"
	"testing"
)

// lentLines renders prog.LentFrom as "K P>from" per captured graph, the op
// index shown as the op it names ("end" past the last op).
func lentLines(prog *Program) string {
	var parts []string
	for i, from := range prog.LentFrom {
		if from < 0 {
			continue
		}
		at := "end"
		if from < len(prog.Ops) {
			at = prog.Ops[from].String()
		}
		parts = append(parts, fmt.Sprintf("%s>%s", prog.Ops[i], at))
	}
	return strings.Join(parts, " | ")
}

// TestLentOverwrites names, per captured graph, the first lending backward
// whose lent parameter grads its replay may overwrite: the first one
// captured at or after it ("end": none of this build, only later builds').
func TestLentOverwrites(t *testing.T) {
	three := defaultPlan(t, 3, true)
	frozenMiddle := layer(three, 0)
	frozenMiddle[1].ParamGrads = nil // pass 1 returns no parameter grad: it lends nothing
	inference := defaultPlan(t, 2, false)
	pipe := plan(t, []float64{1, 2, -2, -1}, "*2", 4, 4)
	tests := []struct {
		name  string
		p     *schedule.Plan
		facts []Facts
		opt   Options
		want  string
	}{
		{"default schedule: each graph up to the backward of pass 0, the last lender", three, layer(three, 0), Options{Release: true},
			"F 0>B 2 | F 1>B 2 | F 2>B 2 | B 2>B 2 | B 1>B 1 | B 0>B 0"},
		{"a backward that lends nothing is skipped", three, frozenMiddle, Options{Release: true},
			"F 0>B 2 | F 1>B 2 | F 2>B 2 | B 2>B 2 | B 1>B 0 | B 0>B 0"},
		{"inference: no backward lends", inference, []Facts{{}, {}}, Options{},
			"F 0>end | F 1>end"},
		{"slot reuse: transient clones, nothing lent", three, layer(three, 0), Options{Reuse: true, Release: true},
			"F 0>end | F 1>end | F 2>end | B 2>end | B 1>end | B 0>end"},
		{"an _order never lends", pipe, layer(pipe), Options{Release: true},
			"F 0>end | F 1>end | F 2>end | F 3>end | B 3>end | B 2>end | B 1>end | B 0>end"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prog := mustCapture(t, tc.p, tc.facts, tc.opt)
			if got := lentLines(prog); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
			last := prog.Ops[len(prog.Ops)-1]
			if last.Kind != ReturnWarmupPool || last.Pass != NoPass {
				t.Errorf("the program ends with %s, not H %d", last, NoPass)
			}
		})
	}
}

// TestZeroGrads names where each pass's warmup zero grads die.
func wgradPlan(t *testing.T) *schedule.Plan {
	return plan(t, []float64{1, 2, -2, -2.5, -1, -1.5}, "1,1", 2, 2)
}

func TestZeroGrads(t *testing.T) {
	two := defaultPlan(t, 2, true)
	tests := []struct {
		name        string
		p           *schedule.Plan
		iters       int
		perCallable bool
		reuse       bool
		want        string
	}{
		{"torch's loop: one pass's iterations share them, they die after its last", two, 2, true, true,
			"f 0 | b 0 | x 0 | f 0 | b 0 | x 0 | g 0 | f 1 | b 1 | x 1 | f 1 | b 1 | x 1 | g 1"},
		{"capture-time hooks may write them: they die after every backward", two, 2, true, false,
			"f 0 | b 0 | x 0 | g 0 | f 0 | b 0 | x 0 | g 0 | f 1 | b 1 | x 1 | g 1 | f 1 | b 1 | x 1 | g 1"},
		{"schedule order: another pass runs in between, so each iteration makes its own", two, 1, false, true,
			"f 0 | y 0 | f 1 | b 1 | x 1 | g 1 | b 0 | x 0 | g 0"},
		{"inference: no backward, no zero grads", defaultPlan(t, 2, false), 1, true, true,
			"f 0 | x 0 | f 1 | x 1"},
		{"per pass with weight gradients: they serve the next iteration, and die with the last (its weight gradient holds what it stashed)", wgradPlan(t), 2, true, true,
			"f 0 | b 0 | x 0 | w 0 | f 0 | b 0 | x 0 | g 0 | w 0 | f 1 | b 1 | x 1 | w 1 | f 1 | b 1 | x 1 | g 1 | w 1"},
		{"schedule order with weight gradients: they die before the weight gradient's next pass", wgradPlan(t), 1, false, true,
			"f 0 | y 0 | f 1 | b 1 | x 1 | g 1 | w 1 | b 0 | x 0 | g 0 | w 0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ops(t, ZeroGrads(Warmup(tc.p, tc.iters, tc.perCallable), tc.reuse)); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}
