package schedule

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
)

// order renders ints/halves as Python's encoding does.
func order(xs ...float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = strconv.FormatFloat(x, 'f', -1, 64)
		if x != float64(int(x)) {
			parts[i] = strconv.FormatFloat(x, 'f', 1, 64)
		}
	}
	return strings.Join(parts, ",")
}

func build(t *testing.T, ord, layers string, callables, samples int, training bool) *Plan {
	t.Helper()
	p, err := buildErr(ord, layers, callables, samples, training, 3)
	if err != nil {
		t.Fatalf("Build(%q, layers %q): %v", ord, layers, err)
	}
	return p
}

func buildErr(ord, layers string, callables, samples int, training bool, warmup int) (*Plan, error) {
	entries, err := ParseOrder(ord)
	if err != nil {
		return nil, err
	}
	l, scalar, err := ParseLayers(layers)
	if err != nil {
		return nil, err
	}
	return Build(Spec{Order: entries, Layers: l, LayersScalar: scalar, NumCallables: callables, NumSamples: samples, Training: training, WarmupIters: warmup})
}

// compact renders steps as "F0" / "B3" / "W1" (kind, pass).
func compact(p *Plan) string {
	var parts []string
	for _, s := range p.Steps {
		parts = append(parts, fmt.Sprintf("%c%d", byte(s.Kind), s.Pass))
	}
	return strings.Join(parts, " ")
}

// TestTransformerEngineExamples expands the schedules of TransformerEngine's
// tests/pytorch/test_cuda_graphs.py (and the Megatron schedule they model)
// and checks TE's pass indexing: prefix[c]*microbatches + m*layers[c] + l.
func TestTransformerEngineExamples(t *testing.T) {
	cases := []struct {
		name               string
		order, layers      string
		callables, samples int
		chunks, micro      int
		want               string
	}{
		{
			// test_make_graphed_callables_with_interleaved_pipeline_parallelism
			name: "interleaved 2 chunks x 1 layer x 3 microbatches", order: order(1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1),
			callables: 2, samples: 6, chunks: 2, micro: 3,
			want: "F0 F3 F1 F4 B3 B0 F2 F5 B4 B1 B5 B2",
		},
		{
			name: "2 chunks x 2 layers x 2 microbatches", order: order(1, 2, 1, 2, -2, -1, -2, -1), layers: "*2",
			callables: 4, samples: 8, chunks: 2, micro: 2,
			// chunk 1 passes 0..3 (m*2+l), chunk 2 passes 4..7; backwards run layers in reverse
			want: "F0 F1 F4 F5 F2 F3 F6 F7 B5 B4 B1 B0 B7 B6 B3 B2",
		},
		{
			name: "layers inferred from sample_args", order: order(1, 2, 1, 2, -2, -1, -2, -1),
			callables: 4, samples: 8, chunks: 2, micro: 2,
			want: "F0 F1 F4 F5 F2 F3 F6 F7 B5 B4 B1 B0 B7 B6 B3 B2",
		},
		{
			name: "uneven layers per chunk", order: order(1, 2, -2, -1), layers: "1,3",
			callables: 4, samples: 4, chunks: 2, micro: 1,
			want: "F0 F1 F2 F3 B3 B2 B1 B0",
		},
		{
			// test_slot_memory_input_staging_respects_overlapping_liveness
			name: "one chunk, overlapping microbatches", order: order(1, 1, -1, -1), layers: "1",
			callables: 1, samples: 2, chunks: 1, micro: 2,
			want: "F0 F1 B0 B1",
		},
		{
			// test_slot_memory_saved_arenas_cover_alternate_schedule
			name: "one chunk, alternate schedule", order: order(1, 1, -1, 1, -1, 1, -1, -1), layers: "1",
			callables: 1, samples: 4, chunks: 1, micro: 4,
			want: "F0 F1 B0 F2 B1 F3 B2 B3",
		},
		{
			// test_slot_memory_preserves_fused_wgrad_hook: chunk 2 first
			name: "second chunk first", order: order(2, -2, 1, -1), layers: "1,1",
			callables: 2, samples: 2, chunks: 2, micro: 1,
			want: "F1 B1 F0 B0",
		},
		{
			// test_slot_memory_releases_transients_across_vpp_tail_backward (PP=2, VPP=2, rank 0)
			name: "PP2 VPP2 rank 0, 4 microbatches", order: order(1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1), layers: "*1",
			callables: 2, samples: 8, chunks: 2, micro: 4,
			want: "F0 F1 F4 F5 F2 B4 F3 B5 F6 B0 F7 B1 B6 B7 B2 B3",
		},
		{
			name: "delayed weight gradients", order: order(1, 2, -2, -2.5, -1, -1.5), layers: "1,1",
			callables: 2, samples: 2, chunks: 2, micro: 1,
			want: "F0 F1 B1 W1 B0 W0",
		},
		{
			name: "weight gradient after the next forward", order: order(1, -1, 1, -1.5, -1, -1.5), layers: "1",
			callables: 1, samples: 2, chunks: 1, micro: 2,
			want: "F0 B0 F1 W0 B1 W1",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := build(t, c.order, c.layers, c.callables, c.samples, true)
			if p.Chunks != c.chunks || p.Microbatches != c.micro {
				t.Errorf("chunks, microbatches = %d, %d; want %d, %d", p.Chunks, p.Microbatches, c.chunks, c.micro)
			}
			if got := compact(p); got != c.want {
				t.Errorf("steps\n got %s\nwant %s", got, c.want)
			}
			checkPlan(t, p, true)
		})
	}
}

// megatronOrder is Megatron-LM's interleaved 1F1B order for one pipeline
// rank (get_schedule_table + convert_schedule_table_to_order).
func megatronOrder(pp, rank, chunks, micro int) []float64 {
	group := pp
	type mc struct{ m, c int }
	var table []mc
	for lo := 0; lo < micro; lo += group {
		hi := min(lo+group, micro)
		if lo+group >= micro {
			hi = micro
		}
		for c := 0; c < chunks; c++ {
			for m := lo; m < hi; m++ {
				table = append(table, mc{m, c})
			}
		}
	}
	total := micro * chunks
	warm := (pp-rank-1)*2 + (chunks-1)*group
	warm = min(warm, total)
	var fwd, bwd []float64
	for _, e := range table {
		fwd = append(fwd, float64(e.c+1))
		bwd = append(bwd, float64(e.c-chunks))
	}
	out := append([]float64{}, fwd[:warm]...)
	for i := warm; i < len(fwd); i++ {
		out = append(out, fwd[i], bwd[i-warm])
	}
	if warm > 0 {
		out = append(out, bwd[len(bwd)-warm:]...)
	}
	return out
}

func TestMegatronInterleaved(t *testing.T) {
	for _, c := range []struct{ pp, rank, chunks, micro, layers int }{
		{4, 0, 4, 8, 2}, // bench/pipeline.py: 64 forward passes
		{4, 3, 4, 8, 1},
		{2, 0, 2, 4, 1},
		{2, 1, 3, 6, 3},
		{8, 0, 2, 16, 1},
	} {
		t.Run(fmt.Sprintf("pp%d rank%d chunks%d micro%d layers%d", c.pp, c.rank, c.chunks, c.micro, c.layers), func(t *testing.T) {
			ord := megatronOrder(c.pp, c.rank, c.chunks, c.micro)
			if len(ord) != 2*c.chunks*c.micro {
				t.Fatalf("order has %d entries", len(ord))
			}
			p := build(t, order(ord...), fmt.Sprintf("*%d", c.layers), c.chunks*c.layers, c.chunks*c.layers*c.micro, true)
			if p.Passes != c.chunks*c.layers*c.micro {
				t.Errorf("passes = %d", p.Passes)
			}
			checkPlan(t, p, true)
		})
	}
	// The bench's rank: 18 warmup forwards (6 + 3*4), then 1F1B, then 18 backwards.
	ord := megatronOrder(4, 0, 4, 8)
	want := order(1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 1, 1)
	if got := order(ord[:18]...); got != want {
		t.Errorf("warmup forwards %s, want %s", got, want)
	}
	if ord[18] != 1 || ord[19] != -4 {
		t.Errorf("first 1F1B pair %v %v, want 1 -4", ord[18], ord[19])
	}
}

// checkPlan checks the invariants every built plan has: each pass has one
// forward, and (training) one backward after it and at most one weight
// gradient after that; steps name the right callable and chunk.
func checkPlan(t *testing.T, p *Plan, training bool) {
	t.Helper()
	if err := planInvariants(p, training); err != nil {
		t.Error(err)
	}
}

func planInvariants(p *Plan, training bool) error {
	seen := make([][3]int, p.Passes)
	for i, s := range p.Steps {
		if s.Pass < 0 || s.Pass >= p.Passes {
			return fmt.Errorf("step %d: pass %d out of range", i, s.Pass)
		}
		k := map[StepKind]int{Forward: 0, Backward: 1, WGrad: 2}[s.Kind]
		if seen[s.Pass][k] != 0 {
			return fmt.Errorf("step %d: second %s of pass %d", i, s.Kind, s.Pass)
		}
		if k > 0 && seen[s.Pass][k-1] == 0 {
			return fmt.Errorf("step %d: %s of pass %d before its %s", i, s.Kind, s.Pass, StepKind("FBW"[k-1]))
		}
		seen[s.Pass][k] = i + 1
		if p.Ordered {
			if want := p.PassIndex(s.Chunk, s.Micro, s.Layer); want != s.Pass {
				return fmt.Errorf("step %d: pass %d, TE's index is %d", i, s.Pass, want)
			}
			if want := p.Prefix(s.Chunk) + s.Layer; want != s.Callable {
				return fmt.Errorf("step %d: callable %d, want %d", i, s.Callable, want)
			}
		}
	}
	for pass, s := range seen {
		if s[0] == 0 || (training && s[1] == 0) || (!training && s[1] != 0) {
			return fmt.Errorf("pass %d: steps %v", pass, s)
		}
	}
	return nil
}

func TestDefaultSchedule(t *testing.T) {
	p, err := Default(3, true)
	if err != nil {
		t.Fatal(err)
	}
	if got := compact(p); got != "F0 F1 F2 B2 B1 B0" {
		t.Errorf("training: %s", got)
	}
	p, _ = Default(2, false)
	if got := compact(p); got != "F0 F1" {
		t.Errorf("eval: %s", got)
	}
	if _, err := Default(0, true); !errors.Is(err, ErrInvalid) {
		t.Errorf("0 callables: %v", err)
	}
}

func TestEvalOrder(t *testing.T) {
	p := build(t, order(1, 2, 1, 2), "", 2, 4, false)
	if got := compact(p); got != "F0 F2 F1 F3" || p.Microbatches != 2 {
		t.Errorf("eval: %s (microbatches %d)", got, p.Microbatches)
	}
	checkPlan(t, p, false)
}

// TestInvalidOrders: every malformed schedule is an ErrInvalid error that
// names the entry (or argument) and the rule.
func TestInvalidOrders(t *testing.T) {
	cases := []struct {
		name               string
		order, layers      string
		callables, samples int
		training           bool
		warmup             int
		want               []string
	}{
		{"empty", "", "", 1, 1, true, 3, []string{"_order is empty"}},
		{"zero", "1,0", "", 1, 1, true, 3, []string{"entry 1 (0)", "1-based"}},
		{"garbage", "1,x,-1", "", 1, 1, true, 3, []string{"entry 1 (x)", "not a chunk id"}},
		{"exponent", "1,-1e3", "", 1, 1, true, 3, []string{"entry 1 (-1e3)", "not a chunk id"}},
		{"nan", "1,nan", "", 1, 1, true, 3, []string{"entry 1 (nan)"}},
		{"double minus", "1,--1", "", 1, 1, true, 3, []string{"entry 1 (--1)"}},
		{"fractional forward", "1.5,-1", "", 1, 1, true, 3, []string{"entry 0 (1.5)", "forward entries must be integers"}},
		{"float forward", "1.0,-1", "", 1, 1, true, 3, []string{"entry 0 (1.0)", "got a float"}},
		{"quarter wgrad", "1,-1,-1.25", "1", 1, 1, true, 3, []string{"entry 2 (-1.25)", "exactly -(c+0.5)"}},
		{"backward before forward", "-1,1", "", 1, 1, true, 3, []string{"entry 0 (-1)", "comes before its forward"}},
		{"backward before forward, later microbatch", "1,-1,-1,1", "", 1, 2, true, 3, []string{"entry 2 (-1)", "microbatch 1", "comes before its forward"}},
		{"eval with backward", "1,-1", "", 1, 1, false, 3, []string{"entry 1 (-1)", "eval mode", "forward entries only"}},
		{"eval with wgrad", "1,-1.5", "1", 1, 1, false, 3, []string{"entry 1 (-1.5)", "eval mode"}},
		{"no warmup", "1,-1", "", 1, 1, true, 0, []string{"num_warmup_iters=0", "KeyError"}},
		{"odd length", "1,2,-1", "", 2, 2, true, 3, []string{"dimension mismatch"}},
		{"unbalanced chunks", "1,1,-1,-1,2,-2", "", 2, 4, true, 3, []string{"dimension mismatch"}},
		{"too many forwards of a chunk", "1,1,1,2,-1,-1,-2,-2", "", 2, 4, true, 3, []string{"entry 2 (1)", "only 2 microbatches"}},
		{"backward of a chunk without forwards", "1,1,-2,-1", "", 1, 2, true, 3, []string{"entry 2 (-2)", "chunk 2 has no forward entries"}},
		{"no forwards", "-1,-2", "", 1, 1, true, 3, []string{"no forward entries"}},
		{"wgrad without layers", "1,-1,-1.5", "", 1, 1, true, 3, []string{"entry 2 (-1.5)", "_num_layers_per_chunk"}},
		{"wgrad with two layers", "1,-1,-1.5", "*2", 2, 2, true, 3, []string{"entry 2 (-1.5)", "exactly one layer", "chunk 1 has 2"}},
		{"wgrad before backward", "1,-1.5,-1", "1", 1, 1, true, 3, []string{"entry 1 (-1.5)", "before any backward"}},
		{"two wgrads for one backward", "1,1,-1,-1,-1.5,-1.5", "1", 1, 2, true, 3, []string{"entry 5 (-1.5)", "already has its weight-gradient pass (entry 4)"}},
		{"wgrad of unknown chunk", "1,-1,-2.5", "1", 1, 1, true, 3, []string{"entry 2 (-2.5)", "chunk 2 has no forward entries"}},
		{"callables mismatch", "1,-1", "2", 1, 2, true, 3, []string{"callables should have 2 entries", "got 1"}},
		{"samples mismatch", "1,-1", "", 1, 2, true, 3, []string{"callables should have 2 entries"}},
		{"samples mismatch with layers", "1,-1", "1", 1, 2, true, 3, []string{"expected 1 sample_args", "got 2"}},
		{"layers list length", "1,2,-2,-1", "1", 2, 2, true, 3, []string{"_num_layers_per_chunk has 1 entries", "2 chunks"}},
		{"layers zero", "1,-1", "0", 1, 1, true, 3, []string{"_num_layers_per_chunk[0] = 0"}},
		{"layers garbage", "1,-1", "a", 1, 1, true, 3, []string{"_num_layers_per_chunk[0]", "not an integer"}},
		{"samples not a multiple", "1,2,-2,-1", "", 3, 3, true, 3, []string{"not a multiple"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := buildErr(c.order, c.layers, c.callables, c.samples, c.training, c.warmup)
			if err == nil {
				t.Fatal("no error")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("%v does not wrap ErrInvalid", err)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}
