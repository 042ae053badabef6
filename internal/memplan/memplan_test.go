package memplan

import (
	"fmt"
	"math/rand"
	"runtime"
	"strings"
	"testing"

	"github.com/gograph/gograph/internal/allocsim"
	"github.com/gograph/gograph/internal/lifetime"
	"github.com/gograph/gograph/internal/schedule"
)

const MiB = 1 << 20

// twoLayerTrace is torch's per-callable warmup of two MLP-like layers
// (f0 b0 x0 f1 b1 x1): each forward saves a 64 MiB activation and returns
// a 64 MiB output; each backward frees the saved tensor, makes a 64 MiB
// transient and returns a 64 MiB input grad and a 32 MiB weight grad.
const twoLayerTrace = `
step 0 f 0
a 1 67108864 0
a 2 67108864 0
step 1 b 0
a 3 67108864 1
r 1 1
a 4 67108864 1
a 5 33554432 1
r 3 1
step 2 x 0
r 2 -1
r 4 -1
r 5 -1
step 3 f 1
a 6 67108864 3
a 7 67108864 3
step 4 b 1
a 8 67108864 4
r 6 4
a 9 67108864 4
a 10 33554432 4
r 8 4
step 5 x 1
r 7 -1
r 9 -1
r 10 -1
out 0 0 2
out 1 0 7
grad 0 0 4
grad 0 1 5
grad 1 0 9
grad 1 1 10
`

// layerFacts are the facts of n passes, each a layer with one input that
// requires grad, one output and one weight.
func layerFacts(n int) []lifetime.Facts {
	facts := make([]lifetime.Facts, n)
	for i := range facts {
		facts[i] = lifetime.Facts{
			Inputs:     []lifetime.InputLeaf{{Sig: 0, RequiresGrad: true, Unique: true, Slottable: true}},
			NPos:       1,
			Outputs:    []lifetime.OutputLeaf{{Sig: 0, RequiresGrad: true}},
			ParamGrads: []lifetime.ParamLeaf{{Index: 1, Param: i, Sig: 1}},
			Backward:   true,
			Keys:       lifetime.Keys{Input: 0, Grad: 0},
		}
	}
	return facts
}

func program(t *testing.T, opt lifetime.Options) *lifetime.Program {
	t.Helper()
	p, err := schedule.Default(2, true)
	if err != nil {
		t.Fatal(err)
	}
	prog, err := lifetime.Capture(p, layerFacts(2), opt)
	if err != nil {
		t.Fatal(err)
	}
	return prog
}

func TestSimulate(t *testing.T) {
	tr, err := ParseTrace(twoLayerTrace, 2)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name                 string
		opt                  lifetime.Options
		reserved, peak, live int64
	}{
		// F0 F1: saved and output of both, 4 segments of 64. B1: its transient
		// (a 5th), the freed saved block takes its input grad, the weight grad
		// a 32 MiB segment, the transient dies. B0: the transient takes the
		// free 64, the input grad the freed saved block, the weight grad a
		// second 32: 384 reserved and, just before B0's transient dies, 384
		// allocated; outputs and grads stay (320).
		{"no release: every output and grad stays", lifetime.Options{}, 384 * MiB, 384 * MiB, 320 * MiB},
		// Chain+Release: pass 1's input grad (layer 0's grad output) dies after B0.
		{"chain releases the chained input grad", lifetime.Options{Chain: true, Release: true}, 384 * MiB, 384 * MiB, 256 * MiB},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res, err := Simulate(program(t, c.opt), tr)
			if err != nil {
				t.Fatal(err)
			}
			if res.PoolReserved != c.reserved || res.PoolPeakAllocated != c.peak || res.PoolLive != c.live {
				t.Errorf("reserved %d peak %d live %d MiB; want %d %d %d\n%s", res.PoolReserved/MiB, res.PoolPeakAllocated/MiB,
					res.PoolLive/MiB, c.reserved/MiB, c.peak/MiB, c.live/MiB, res.Encode())
			}
			// f0 b0 peaks at 3x64+32; x0 frees it all and layer 1 reuses it.
			if res.WarmupAllocated != 224*MiB || res.WarmupReserved != 224*MiB {
				t.Errorf("warmup reserved %d allocated %d MiB, want 224, 224", res.WarmupReserved/MiB, res.WarmupAllocated/MiB)
			}
			if len(res.Unrecorded) != 0 {
				t.Errorf("unrecorded %v", res.Unrecorded)
			}
			var sum int64
			for _, s := range res.Segments {
				sum += s
			}
			if sum != res.PoolReserved || len(res.Places) != 6 {
				t.Errorf("segments %v (sum %d), places %v", res.Segments, sum, res.Places)
			}
			// Pass 1's input grad (block 9) went where its saved activation was (block 6).
			if res.Places[9] != [2]int64{2, 0} {
				t.Errorf("block 9 at %v, want segment 2 (block 6's)", res.Places[9])
			}
		})
	}
}

func TestUnrecordedPass(t *testing.T) {
	tr, err := ParseTrace("step 0 f 0\na 1 100 0\nout 0 0 1\n", 2)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Simulate(program(t, lifetime.Options{}), tr)
	if err != nil {
		t.Fatal(err)
	}
	if got := res.Unrecorded; len(got) != 3 || got[0] != 1 {
		t.Errorf("unrecorded %v: pass 1's forward and both backwards were not recorded", got)
	}
	if !strings.Contains(res.Encode(), "unrecorded 1\n") {
		t.Error(res.Encode())
	}
}

func TestParseTraceErrors(t *testing.T) {
	for _, bad := range []string{
		"step 1 f 0",  // numbered out of order
		"step 0 q 0",  // unknown kind
		"step 0 f 9",  // pass out of range
		"a 1 100 0",   // a step that does not exist
		"a -1 100 -1", // negative block
		"a 1 x -1",    // not a number
		"r 1",         // short
		"out 5 0 1",   // pass out of range
		"grad 0 -1 1", // negative index
		"what 1 2 3",  // unknown line
	} {
		if _, err := ParseTrace(bad, 2); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func FuzzSimulate(f *testing.F) {
	f.Add(twoLayerTrace)
	f.Fuzz(func(t *testing.T, s string) {
		tr, err := ParseTrace(s, 2)
		if err != nil {
			return
		}
		p, _ := schedule.Default(2, true)
		facts := make([]lifetime.Facts, 2)
		for i := range facts {
			facts[i] = lifetime.Facts{Inputs: []lifetime.InputLeaf{{Sig: 0, RequiresGrad: true, Unique: true}}, NPos: 1,
				Outputs: []lifetime.OutputLeaf{{Sig: 0, RequiresGrad: true}}, Backward: true, Keys: lifetime.Keys{Input: -1, Grad: -1}}
		}
		prog, err := lifetime.Capture(p, facts, lifetime.Options{Chain: true, Release: true})
		if err != nil {
			t.Fatal(err)
		}
		res, err := Simulate(prog, tr)
		if err != nil {
			if !strings.Contains(err.Error(), "already live") && !strings.Contains(err.Error(), "bytes") {
				t.Fatalf("unexpected error %v", err)
			}
			return
		}
		if res.PoolPeakAllocated > res.PoolReserved || res.PoolLive > res.PoolPeakAllocated || res.WarmupAllocated > res.WarmupReserved {
			t.Fatalf("inconsistent %+v", res)
		}
		seeded, err := ChooseSeed(prog, tr)
		if err != nil {
			t.Fatalf("seeded: %v", err)
		}
		// Block sizes may differ (a remainder of 1 MiB or less stays in its
		// block), so only the pool and the seed's bound are compared.
		if seeded.PoolReserved > res.PoolReserved || seeded.Seed > res.PoolPeakAllocated {
			t.Fatalf("seed %d: %+v against unseeded %+v", seeded.Seed, seeded, res)
		}
	})
}

// fragmentingTrace is one pass whose forward saves two 30 MiB blocks and
// returns a 12 MiB output, and whose backward frees both saved blocks, makes
// a 50 MiB transient and returns a 12 MiB input grad and a 12 MiB weight grad.
// Captured segment by segment, the two freed 30 MiB blocks cannot merge to
// hold the transient: 30+30+12+50 = 122 MiB for a peak of 86 held at once.
const fragmentingTrace = `
step 0 f 0
a 1 31457280 0
a 2 31457280 0
a 3 12582912 0
step 1 b 0
r 1 1
r 2 1
a 4 52428800 1
a 5 12582912 1
a 6 12582912 1
r 4 1
out 0 0 3
grad 0 0 5
grad 0 1 6
`

func onePassProgram(t *testing.T) *lifetime.Program {
	t.Helper()
	p, err := schedule.Default(1, true)
	if err != nil {
		t.Fatal(err)
	}
	facts := []lifetime.Facts{{
		Inputs:     []lifetime.InputLeaf{{Sig: 0, RequiresGrad: true, Unique: true, Slottable: true}},
		NPos:       1,
		Outputs:    []lifetime.OutputLeaf{{Sig: 0, RequiresGrad: true}},
		ParamGrads: []lifetime.ParamLeaf{{Index: 1, Param: 0, Sig: 1}},
		Backward:   true,
		Keys:       lifetime.Keys{Input: 0, Grad: 0},
	}}
	prog, err := lifetime.Capture(p, facts, lifetime.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return prog
}

func TestChooseSeed(t *testing.T) {
	cases := []struct {
		name           string
		trace          string
		passes         int
		prog           func(*testing.T) *lifetime.Program
		unseeded       int64
		seeded         bool
		reservedAtMost int64
	}{
		// Every block is 64 MiB or a 32 MiB grad: the segments the captures
		// make are the blocks they hold at the peak, and no seed does better.
		{"no fragmentation: no seed", twoLayerTrace, 2, func(t *testing.T) *lifetime.Program { return program(t, lifetime.Options{}) }, 384 * MiB, false, 384 * MiB},
		// A seed holding both saved blocks lets them merge again for the
		// transient: the best (61 MiB) makes the pool the peak, 86 MiB.
		{"freed neighbours merge in the seed", fragmentingTrace, 1, onePassProgram, 122 * MiB, true, 86 * MiB},
		// The build did not record its warmup (every request in the small
		// pool, _probe.seed_may_matter): it carves nothing, so neither does
		// the prediction.
		{"noseed keeps the unseeded pool", fragmentingTrace + "noseed\n", 1, onePassProgram, 122 * MiB, false, 122 * MiB},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr, err := ParseTrace(c.trace, c.passes)
			if err != nil {
				t.Fatal(err)
			}
			prog := c.prog(t)
			base, err := Simulate(prog, tr)
			if err != nil {
				t.Fatal(err)
			}
			best, err := ChooseSeed(prog, tr)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("seed %d MiB: pool %d MiB (unseeded %d)", best.Seed/MiB, best.PoolReserved/MiB, base.PoolReserved/MiB)
			if base.PoolReserved != c.unseeded {
				t.Errorf("unseeded pool %d MiB, want %d\n%s", base.PoolReserved/MiB, c.unseeded/MiB, base.Encode())
			}
			if (best.Seed > 0) != c.seeded || best.PoolReserved > c.reservedAtMost || best.PoolReserved > base.PoolReserved {
				t.Errorf("seed %d MiB: pool %d MiB; want seeded %v, at most %d", best.Seed/MiB, best.PoolReserved/MiB, c.seeded, c.reservedAtMost/MiB)
			}
			if best.Seed > base.PoolPeakAllocated {
				t.Errorf("seed %d MiB, peak %d; the unseeded peak is %d", best.Seed/MiB, best.PoolPeakAllocated/MiB, base.PoolPeakAllocated/MiB)
			}
		})
	}
}

func TestOutside(t *testing.T) {
	cases := []struct {
		name  string
		trace string
		kept  int64
	}{
		{"everything freed", "step 0 f 0\na 1 1048576 0\na 2 8388608 0\nr 1 0\nr 2 0\n", 0},
		// The capture stream's cuBLAS workspace (32 MiB, a segment of its own)
		// and cuBLASLt's (1 MiB: a 2 MiB small-pool segment) outlive warmup.
		{"cuBLAS workspaces", "step 0 f 0\na 1 33554432 -1\na 2 1048576 0\na 3 8388608 0\nr 3 0\n", 34 * MiB},
		// A 4 MiB block left behind keeps the 20 MiB segment it was split from.
		{"a mid-size block keeps its segment", "step 0 f 0\na 1 4194304 0\na 2 4194304 0\nr 2 0\n", 20 * MiB},
		// An 8 MiB grad-output buffer outside the pool takes a 20 MiB segment; a
		// second one shares it.
		{"new buffers", "step 0 f 0\nnew 8388608\n", 20 * MiB},
		{"two new buffers share a segment", "step 0 f 0\nnew 8388608\nnew 8388608\n", 20 * MiB},
		{"new buffers beside a workspace", "step 0 f 0\na 1 33554432 -1\nnew 33554432\n", 64 * MiB},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr, err := ParseTrace(c.trace, 1)
			if err != nil {
				t.Fatal(err)
			}
			res, err := Simulate(&lifetime.Program{}, tr)
			if err != nil {
				t.Fatal(err)
			}
			if res.Outside != c.kept {
				t.Errorf("outside %d MiB, want %d", res.Outside/MiB, c.kept/MiB)
			}
		})
	}
}

// pipelineTrace is a trace of n passes, each a layer whose forward saves a
// few blocks of mixed sizes and returns an output, and whose backward frees
// them, makes a transient and returns an input grad and a weight grad: the
// shape of a pipeline rank's warmup, at a size where the seed search runs
// many simulations.
func pipelineTrace(n int, rng *rand.Rand) string {
	var b strings.Builder
	id, step := 1, 0
	for p := 0; p < n; p++ {
		fmt.Fprintf(&b, "step %d f %d\n", step, p)
		saved := []int{}
		for k := 0; k < 3+rng.Intn(3); k++ {
			fmt.Fprintf(&b, "a %d %d %d\n", id, (1+rng.Int63n(40))*MiB, step)
			saved = append(saved, id)
			id++
		}
		fmt.Fprintf(&b, "a %d %d %d\nout %d 0 %d\n", id, 8*MiB, step, p, id)
		id++
		step++
		fmt.Fprintf(&b, "step %d b %d\n", step, p)
		for _, s := range saved {
			fmt.Fprintf(&b, "r %d %d\n", s, step)
		}
		fmt.Fprintf(&b, "a %d %d %d\nr %d %d\n", id, (1+rng.Int63n(60))*MiB, step, id, step)
		id++
		fmt.Fprintf(&b, "a %d %d %d\ngrad %d 0 %d\n", id, 8*MiB, step, p, id)
		id++
		fmt.Fprintf(&b, "a %d %d %d\ngrad %d 1 %d\n", id, 4*MiB, step, p, id)
		id++
		step++
	}
	return b.String()
}

func pipelineProgram(tb testing.TB, n int) *lifetime.Program {
	tb.Helper()
	p, err := schedule.Default(n, true)
	if err != nil {
		tb.Fatal(err)
	}
	prog, err := lifetime.Capture(p, layerFacts(n), lifetime.Options{Release: true})
	if err != nil {
		tb.Fatal(err)
	}
	return prog
}

// chooseSeedInOrder is the seed search one simulation at a time, as the
// reference the batched search must agree with.
func chooseSeedInOrder(prog *lifetime.Program, tr *Trace) (*Result, error) {
	best, err := Simulate(prog, tr)
	if err != nil || tr.NoSeed {
		return best, err
	}
	peak := best.PoolPeakAllocated
	floor := allocsim.RoundLarge * ((peak + allocsim.RoundLarge - 1) / allocsim.RoundLarge)
	step := max(allocsim.RoundLarge, peak/2/seedSteps)
	for seed := peak / 2; seed <= peak && best.PoolReserved > floor; seed += step {
		res, err := SimulateSeeded(prog, tr, seed)
		if err != nil {
			return nil, err
		}
		if res.PoolReserved < best.PoolReserved {
			best = res
		}
	}
	return best, nil
}

func TestChooseSeedBatchedAgreesWithInOrder(t *testing.T) {
	for _, procs := range []int{1, 3, 16} {
		for trial := 0; trial < 6; trial++ {
			rng := rand.New(rand.NewSource(int64(trial)))
			n := 2 + rng.Intn(12)
			tr, err := ParseTrace(pipelineTrace(n, rng), n)
			if err != nil {
				t.Fatal(err)
			}
			prog := pipelineProgram(t, n)
			prev := runtime.GOMAXPROCS(procs)
			got, err := ChooseSeed(prog, tr)
			runtime.GOMAXPROCS(prev)
			if err != nil {
				t.Fatal(err)
			}
			want, err := chooseSeedInOrder(prog, tr)
			if err != nil {
				t.Fatal(err)
			}
			if got.Encode() != want.Encode() {
				t.Errorf("GOMAXPROCS %d, %d passes (trial %d): seed %d pool %d, in order seed %d pool %d",
					procs, n, trial, got.Seed, got.PoolReserved, want.Seed, want.PoolReserved)
			}
		}
	}
}

func BenchmarkChooseSeed(b *testing.B) {
	for _, n := range []int{64, 128} {
		b.Run(fmt.Sprintf("passes=%d", n), func(b *testing.B) {
			rng := rand.New(rand.NewSource(1))
			tr, err := ParseTrace(pipelineTrace(n, rng), n)
			if err != nil {
				b.Fatal(err)
			}
			prog := pipelineProgram(b, n)
			b.Run("batched", func(b *testing.B) {
				for b.Loop() {
					if _, err := ChooseSeed(prog, tr); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("in-order", func(b *testing.B) {
				for b.Loop() {
					if _, err := chooseSeedInOrder(prog, tr); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
