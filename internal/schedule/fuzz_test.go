package schedule

import (
	"errors"
	"strings"
	"testing"
)

// FuzzBuild feeds arbitrary _order and _num_layers_per_chunk encodings and
// sizes through ParseOrder, ParseLayers and Build. It never panics, and the
// outcome is either an error or a plan that satisfies every invariant (each
// pass forward once, then backward once when training, then at most one
// weight gradient; TransformerEngine's pass indexing), encoded one line per
// step. Validation errors wrap ErrInvalid.
func FuzzBuild(f *testing.F) {
	f.Add("1,2,1,2,-2,-1,1,2,-2,-1,-2,-1", "", 2, 6, true, 3)
	f.Add("1,2,1,2,-2,-1,-2,-1", "*2", 4, 8, true, 1)
	f.Add("1,2,-2,-2.5,-1,-1.5", "1,1", 2, 2, true, 2)
	f.Add("1,1,-1,-1,-1.5,-1.5", "1", 1, 2, true, 3)
	f.Add("1,2,1,2", "", 2, 4, false, 0)
	f.Add("-1,1", "", 1, 1, true, 3)
	f.Add("1,-1.25", "1", 1, 1, true, 3)
	f.Add("0,,+1,-0.50", "*0", 0, -1, true, -5)
	f.Add("1,1,2,2,1,-2,1,-2,2,-1,2,-1,-2,-2,-1,-1", "*1", 2, 8, true, 2)
	f.Fuzz(func(t *testing.T, ord, layers string, callables, samples int, training bool, warmup int) {
		if len(ord) > 4096 {
			return // keep each run small; the parser is linear
		}
		entries, err := ParseOrder(ord)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseOrder(%q): %v does not wrap ErrInvalid", ord, err)
			}
			return
		}
		l, scalar, err := ParseLayers(layers)
		if err != nil {
			return
		}
		p, err := Build(Spec{Order: entries, Layers: l, LayersScalar: scalar, NumCallables: callables, NumSamples: samples, Training: training, WarmupIters: warmup})
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Build: %v does not wrap ErrInvalid", err)
			}
			return
		}
		if p.Passes != samples || p.Callables != callables {
			t.Fatalf("plan has %d passes and %d callables for %d samples and %d callables", p.Passes, p.Callables, samples, callables)
		}
		if err := planInvariants(p, training); err != nil {
			t.Fatalf("order %q layers %q: %v", ord, layers, err)
		}
		if lines := strings.Count(p.Encode(), "\n"); lines != len(p.Steps)+1 {
			t.Fatalf("Encode wrote %d lines for %d steps", lines, len(p.Steps))
		}
	})
}

// FuzzDecode: Decode never panics on arbitrary text, and what it accepts
// re-encodes to something it accepts again, unchanged.
