package lifetime

import (
	"fmt"
	"math/rand"
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

// residual gives every pass the buffers of a layer y = f(x) with x, y, dy
// and dx of one signature (0), TE keys equal for all passes, and cloned
// parameter grads of signature 1.
func residual(p *schedule.Plan) ([]Buffer, []Keys) {
	var bufs []Buffer
	keys := make([]Keys, p.Passes)
	for pass := 0; pass < p.Passes; pass++ {
		bufs = append(bufs,
			Buffer{Input, pass, 0}, Buffer{GradOutput, pass, 0},
			Buffer{Output, pass, 0}, Buffer{GradInput, pass, 0}, Buffer{ParamGrad, pass, 1})
		keys[pass] = Keys{Input: 0, Grad: 0}
	}
	return bufs, keys
}

func TestTransformerEngineInterleaved(t *testing.T) {
	// TE's test order: 2 chunks x 1 layer x 3 microbatches. At most 4
	// microbatch-chunks are live (after 1,2,1,2), so 4 input tuples; the
	// backward reads one grad-output tuple: 5 buffers in TE's scheme.
	p := plan(t, []float64{1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1}, "", 2, 6)
	bufs, keys := residual(p)
	r, err := Assign(p, bufs, keys)
	if err != nil {
		t.Fatal(err)
	}
	checkAssignment(t, p, bufs, r)
	st := r.Sigs[0]
	if st.Buffers != 12 || st.TEFifo != 5 || st.Slots != 5 {
		t.Errorf("sig 0: %+v, want 12 buffers, 5 slots, TE 5", *st)
	}
	// Outputs die at their backward; input grads at their consumer.
	for i, b := range bufs {
		switch b.Role {
		case Output, ParamGrad:
			if r.Release[i] != p.StepOf(b.Pass, schedule.Backward) {
				t.Errorf("%s of pass %d released after step %d", b.Role, b.Pass, r.Release[i])
			}
		}
	}
}

func TestFewerSlotsThanTE(t *testing.T) {
	// Passes whose sample tuples differ (a mask on chunk 1 only) but whose
	// hidden states match: TE keys whole tuples and cannot share chunk 1's x
	// with chunk 2's; per-tensor slots can.
	p := plan(t, []float64{1, -1, 2, -2}, "1,1", 2, 2)
	bufs := []Buffer{
		{Input, 0, 0}, {Input, 0, 1}, {GradOutput, 0, 0},
		{Input, 1, 0}, {GradOutput, 1, 0},
	}
	keys := []Keys{{Input: 0, Grad: 0}, {Input: 1, Grad: 0}}
	r, err := Assign(p, bufs, keys)
	if err != nil {
		t.Fatal(err)
	}
	checkAssignment(t, p, bufs, r)
	if st := r.Sigs[0]; st.Slots != 2 || st.TEFifo != 3 {
		t.Errorf("sig 0: %+v, want 2 slots (TE 3)", *st)
	}
	// An input and a grad output of the same signature share a slot when
	// their lifetimes allow: one slot for x of both passes and one for dy.
	p = plan(t, []float64{1, -1, 1, -1}, "1", 1, 2)
	bufs = []Buffer{{Input, 0, 0}, {GradOutput, 0, 0}, {Input, 1, 0}, {GradOutput, 1, 0}}
	r, _ = Assign(p, bufs, []Keys{{0, 0}, {0, 0}})
	checkAssignment(t, p, bufs, r)
	if st := r.Sigs[0]; st.Slots != 2 || st.TEFifo != 2 {
		t.Errorf("alternating: %+v", *st)
	}
}

func TestWeightGradientKeepsInputsLive(t *testing.T) {
	// A forward between a backward and its weight gradient must not take the
	// input or grad output the weight gradient still reads.
	p := plan(t, []float64{1, -1, 1, -1.5, -1, -1.5}, "1", 1, 2)
	bufs := []Buffer{{Input, 0, 0}, {GradOutput, 0, 0}, {Input, 1, 0}, {GradOutput, 1, 0}}
	r, err := Assign(p, bufs, []Keys{{0, 0}, {0, 0}})
	if err != nil {
		t.Fatal(err)
	}
	checkAssignment(t, p, bufs, r)
	if r.Slot[0] == r.Slot[2] {
		t.Error("pass 1's input took the slot pass 0's weight gradient still reads")
	}
	if w := p.StepOf(0, schedule.WGrad); r.Last[0] != w || r.Last[1] != w {
		t.Errorf("pass 0's input and grad output die at %d and %d, want its weight gradient %d", r.Last[0], r.Last[1], w)
	}
}

func TestGradInputConsumers(t *testing.T) {
	// 2 chunks x 2 layers: a layer's input grad is read by the backward of
	// the layer before it; a chunk's first layer's by the next first-layer
	// backward; the last one is never released.
	p := plan(t, []float64{1, 2, -2, -1}, "*2", 4, 4)
	var bufs []Buffer
	for pass := 0; pass < 4; pass++ {
		bufs = append(bufs, Buffer{GradInput, pass, 0})
	}
	r, err := Assign(p, bufs, nil)
	if err != nil {
		t.Fatal(err)
	}
	// steps: F0 F1 F2 F3 B3 B2 B1 B0 (indices 4..7)
	want := map[int]int{3: 5, 2: 7, 1: 7, 0: -1}
	for i, b := range bufs {
		if r.Release[i] != want[b.Pass] {
			t.Errorf("input grad of pass %d released after %d, want %d", b.Pass, r.Release[i], want[b.Pass])
		}
	}
}

func TestRejectsBadBuffers(t *testing.T) {
	p := plan(t, []float64{1, -1}, "", 1, 1)
	for _, s := range []string{"i 1 0", "x 0 0", "i 0", "i 0 -3", "k 0 0", "i a 0", "i 0 0 0 0", "k 0 0 0 0"} {
		bufs, keys, err := ParseBuffers(s, p.Passes)
		if err == nil {
			_, err = Assign(p, bufs, keys)
		}
		if err == nil {
			t.Errorf("%q accepted", s)
		}
	}
	eval, _ := schedule.Default(1, false)
	if _, err := Assign(eval, []Buffer{{GradOutput, 0, 0}}, nil); err == nil {
		t.Error("grad output of a pass without backward accepted")
	}
}

func TestEncode(t *testing.T) {
	p := plan(t, []float64{1, -1, 1, -1}, "1", 1, 2)
	bufs, keys, err := ParseBuffers("i 0 0\ng 0 0\no 0 3\ni 1 0\ng 1 0\no 1 3\nk 0 0 0\nk 1 0 0\n", p.Passes)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Assign(p, bufs, keys)
	if err != nil {
		t.Fatal(err)
	}
	want := "assign 0 1 1 0 1 3\nsig 0 4 2 2\nslots 2\n"
	if got := r.Encode(bufs); got != want {
		t.Errorf("Encode:\n%s\nwant\n%s", got, want)
	}
}

// checkAssignment is the property every plan must have: no slot is given to
// two buffers live at once, slots hold one signature, every buffer's use
// steps lie within its interval, and no release precedes a last use.
func checkAssignment(t testing.TB, p *schedule.Plan, bufs []Buffer, r *Result) {
	t.Helper()
	if err := assignmentInvariants(p, bufs, r); err != nil {
		t.Fatal(err)
	}
}

func assignmentInvariants(p *schedule.Plan, bufs []Buffer, r *Result) error {
	at := make([][3]int, p.Passes)
	for i := range at {
		at[i] = [3]int{-1, -1, -1}
	}
	for i, s := range p.Steps {
		at[s.Pass][strings.IndexByte("FBW", byte(s.Kind))] = i
	}
	slotSig := map[int]int{}
	for i, b := range bufs {
		u, err := uses(p, at, b)
		if err != nil {
			return err
		}
		for _, s := range u {
			if s < r.First[i] || s > r.Last[i] {
				return fmt.Errorf("buffer %d (%s of pass %d) used at step %d outside [%d, %d]", i, b.Role, b.Pass, s, r.First[i], r.Last[i])
			}
			if !b.Role.Slotted() && r.Release[i] >= 0 && r.Release[i] < s {
				return fmt.Errorf("buffer %d (%s of pass %d) released after step %d but used at step %d", i, b.Role, b.Pass, r.Release[i], s)
			}
		}
		if !b.Role.Slotted() {
			if r.Slot[i] != -1 {
				return fmt.Errorf("pool buffer %d has slot %d", i, r.Slot[i])
			}
			continue
		}
		if r.Slot[i] < 0 || r.Slot[i] >= r.Slots {
			return fmt.Errorf("buffer %d: slot %d of %d", i, r.Slot[i], r.Slots)
		}
		if s, ok := slotSig[r.Slot[i]]; ok && s != b.Sig {
			return fmt.Errorf("slot %d holds signatures %d and %d", r.Slot[i], s, b.Sig)
		}
		slotSig[r.Slot[i]] = b.Sig
		for j := 0; j < i; j++ {
			if !bufs[j].Role.Slotted() || r.Slot[j] != r.Slot[i] {
				continue
			}
			if r.First[i] <= r.Last[j] && r.First[j] <= r.Last[i] {
				return fmt.Errorf("slot %d given to buffer %d (%s of pass %d, live %d..%d) and buffer %d (%s of pass %d, live %d..%d) at once",
					r.Slot[i], j, bufs[j].Role, bufs[j].Pass, r.First[j], r.Last[j], i, b.Role, b.Pass, r.First[i], r.Last[i])
			}
		}
	}
	// Slots per signature are exactly the most buffers of it live at once.
	for sig, st := range r.Sigs {
		peak := 0
		for step := range p.Steps {
			n := 0
			for i, b := range bufs {
				if b.Role.Slotted() && b.Sig == sig && r.First[i] <= step && step <= r.Last[i] {
					n++
				}
			}
			peak = max(peak, n)
		}
		if st.Slots != peak {
			return fmt.Errorf("signature %d: %d slots, but at most %d buffers are live at once", sig, st.Slots, peak)
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

// TestPropertyRandomSchedules: over random schedules and buffer sets, no
// slot is shared by buffers live at once, no release precedes a last use,
// and (without weight gradients that trail their backward) no signature
// needs more slots than TransformerEngine's FIFO scheme.
func TestPropertyRandomSchedules(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for iter := 0; iter < 400; iter++ {
		chunks, micro := 1+rng.Intn(4), 1+rng.Intn(5)
		wgrad := rng.Intn(3) == 0
		adjacent := !wgrad || rng.Intn(2) == 0
		layers := 1
		if !wgrad {
			layers = 1 + rng.Intn(3)
		}
		ord := randomOrder(rng, chunks, micro, wgrad, adjacent)
		p := plan(t, ord, fmt.Sprintf("*%d", layers), chunks*layers, chunks*layers*micro)

		// Each callable has a fixed buffer layout (as a layer does); a few
		// signatures so that sharing across kinds and layers happens.
		nsig := 1 + rng.Intn(3)
		type layout struct{ in, grad []int }
		lay := make([]layout, p.Callables)
		for c := range lay {
			for k := 0; k < 1+rng.Intn(3); k++ {
				lay[c].in = append(lay[c].in, rng.Intn(nsig))
			}
			for k := 0; k < 1+rng.Intn(2); k++ {
				lay[c].grad = append(lay[c].grad, rng.Intn(nsig))
			}
		}
		callableOf := make([]int, p.Passes)
		for _, s := range p.Steps {
			callableOf[s.Pass] = s.Callable
		}
		var bufs []Buffer
		keys := make([]Keys, p.Passes)
		for pass := 0; pass < p.Passes; pass++ {
			c := callableOf[pass]
			for _, s := range lay[c].in {
				bufs = append(bufs, Buffer{Input, pass, s})
			}
			for _, s := range lay[c].grad {
				bufs = append(bufs, Buffer{GradOutput, pass, s}, Buffer{Output, pass, s})
			}
			bufs = append(bufs, Buffer{GradInput, pass, lay[c].in[0]}, Buffer{ParamGrad, pass, nsig})
			keys[pass] = Keys{Input: c, Grad: c}
			// equal layouts share keys, as TE's signature tuples would
			for d := 0; d < c; d++ {
				if fmt.Sprint(lay[d]) == fmt.Sprint(lay[c]) {
					keys[pass] = Keys{Input: d, Grad: d}
					break
				}
			}
		}
		rng.Shuffle(len(bufs), func(i, j int) { bufs[i], bufs[j] = bufs[j], bufs[i] })
		r, err := Assign(p, bufs, keys)
		if err != nil {
			t.Fatalf("order %v: %v", ord, err)
		}
		if err := assignmentInvariants(p, bufs, r); err != nil {
			t.Fatalf("order %v layers %d: %v", ord, layers, err)
		}
		if adjacent {
			for sig, st := range r.Sigs {
				if st.Slots > st.TEFifo {
					t.Fatalf("order %v layers %d: signature %d needs %d slots, TransformerEngine's FIFO %d", ord, layers, sig, st.Slots, st.TEFifo)
				}
			}
		}
	}
}

// TestMegatronBench is the bench's schedule (bench/pipeline.py): one rank of
// 4 stages, 4 chunks x 2 layers, 8 microbatches.
func TestMegatronBench(t *testing.T) {
	ord := []float64{}
	// Megatron's order for pp=4, rank 0, 4 chunks, 8 microbatches.
	var fwd, bwd []float64
	for lo := 0; lo < 8; lo += 4 {
		for c := 0; c < 4; c++ {
			for m := lo; m < lo+4; m++ {
				fwd = append(fwd, float64(c+1))
				bwd = append(bwd, float64(c-4))
			}
		}
	}
	warm := 18
	ord = append(ord, fwd[:warm]...)
	for i := warm; i < len(fwd); i++ {
		ord = append(ord, fwd[i], bwd[i-warm])
	}
	ord = append(ord, bwd[len(bwd)-warm:]...)
	p := plan(t, ord, "*2", 8, 64)
	bufs, keys := residual(p)
	r, err := Assign(p, bufs, keys)
	if err != nil {
		t.Fatal(err)
	}
	checkAssignment(t, p, bufs, r)
	st := r.Sigs[0]
	// 19 microbatch-chunks live at the first backward, 2 layers each, plus
	// the grad output: 39 of 128 buffers.
	if st.Buffers != 128 || st.Slots != 39 || st.TEFifo != 39 {
		t.Errorf("sig 0: %+v", *st)
	}
}

// FuzzParseBuffers: arbitrary buffer text never panics the parser or the
// planner, and whatever is accepted yields a plan with the invariants.
func FuzzParseBuffers(f *testing.F) {
	f.Add("i 0 0\ng 0 0\no 0 1\nd 0 0\np 0 2\nk 0 0 0\ni 1 0\ng 1 0\n")
	f.Add("k 1 -1 -1\nd 1 0\n")
	f.Fuzz(func(t *testing.T, s string) {
		p := plan(t, []float64{1, 2, -2, -1, 1, 2, -2, -1}, "", 2, 4)
		bufs, keys, err := ParseBuffers(s, p.Passes)
		if err != nil {
			return
		}
		r, err := Assign(p, bufs, keys)
		if err != nil {
			return
		}
		if err := assignmentInvariants(p, bufs, r); err != nil {
			t.Fatal(err)
		}
		_ = r.Encode(bufs)
	})
}
