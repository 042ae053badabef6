package lifetime

import (
	"fmt"
	"strconv"
	"strings"
)

// ParseFacts parses what warmup learned, as Python sends it: one line per
// item, numbers separated by spaces, booleans as 0 or 1:
//
//	pass P backward wgrad npos inputKey gradKey   once per pass
//	in P sig requiresGrad unique slottable [region param]
//	                                              its user input leaves, in order
//	out P sig requiresGrad                        its outputs, in order
//	pg P index param sig                          its parameter grads returned as owned tensors
//
// Keys of -1 mean "none". A pass without a "pass" line has no backward and
// no weight-gradient graph. An input's region numbers (from 1) the memory its
// sample shares with other input leaves or parameters of the build (0: none)
// and
// param says that memory overlaps a parameter; without the two fields the
// leaf shares nothing the planner must separate.
func ParseFacts(s string, passes int) ([]Facts, error) {
	facts := make([]Facts, passes)
	for i := range facts {
		facts[i].Keys = Keys{-1, -1}
	}
	seen := make([]bool, passes)
	for n, line := range strings.Split(strings.TrimSpace(s), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		want, ok := map[string]int{"pass": 7, "in": 6, "out": 4, "pg": 5}[f[0]]
		if !ok || (len(f) != want && (f[0] != "in" || len(f) != want+2)) {
			return nil, fmt.Errorf("facts line %d (%q): want \"pass P bwd wgrad npos inKey gradKey\", \"in P sig rg unique slottable [region param]\", \"out P sig rg\" or \"pg P index param sig\"", n, line)
		}
		v, err := smallInts(f[1:])
		if err != nil {
			return nil, fmt.Errorf("facts line %d (%q): %w", n, line, err)
		}
		if v[0] < 0 || v[0] >= passes {
			return nil, fmt.Errorf("facts line %d (%q): pass %d out of range [0, %d)", n, line, v[0], passes)
		}
		p := &facts[v[0]]
		switch f[0] {
		case "pass":
			if seen[v[0]] {
				return nil, fmt.Errorf("facts line %d (%q): a second \"pass\" line for pass %d", n, line, v[0])
			}
			seen[v[0]] = true
			p.Backward, p.WGrad, p.NPos = v[1] != 0, v[2] != 0, v[3]
			p.Keys = Keys{Input: v[4], Grad: v[5]}
		case "in":
			in := InputLeaf{Sig: v[1], RequiresGrad: v[2] != 0, Unique: v[3] != 0, Slottable: v[4] != 0}
			if len(v) == 7 {
				in.Region, in.Param = v[5], v[6] != 0
			}
			p.Inputs = append(p.Inputs, in)
		case "out":
			p.Outputs = append(p.Outputs, OutputLeaf{Sig: v[1], RequiresGrad: v[2] != 0})
		case "pg":
			p.ParamGrads = append(p.ParamGrads, ParamLeaf{Index: v[1], Param: v[2], Sig: v[3]})
		}
	}
	return facts, nil
}

// smallInts parses fields as integers in [-1, 2^30].
func smallInts(fields []string) ([]int, error) {
	out := make([]int, len(fields))
	for i, s := range fields {
		x, err := strconv.Atoi(s)
		if err != nil || x < -1 || x > 1<<30 {
			return nil, fmt.Errorf("field %d (%q) is not a small integer", i+1, s)
		}
		out[i] = x
	}
	return out, nil
}
