package state

import (
	"fmt"
	"strings"
	"sync"
	"testing"
)

// step is one capture or replay in an order test: pass name ("A", "B", ...)
// and kind. A replay step may instead discard (close) or reset the pass.
type step struct {
	pass string
	kind GraphKind
	op   string // "" replay, "discard", "reset"
}

func f(p string) step { return step{pass: p, kind: Forward} }
func b(p string) step { return step{pass: p, kind: Backward} }
func w(p string) step { return step{pass: p, kind: WGrad} }
func discard(p string) step {
	return step{pass: p, op: "discard"}
}
func resetStep(p string) step { return step{pass: p, op: "reset"} }

func repeat(n int, steps ...step) []step {
	var out []step
	for i := 0; i < n; i++ {
		out = append(out, steps...)
	}
	return out
}

// orderFixture captures steps in order in one pool (every pass guarded unless
// listed in unguarded) and seals the passes.
type orderFixture struct {
	l   *Ledger
	fg  *fakeGraphs
	ids map[string]int64
}

func newOrderFixture(t testing.TB, pool string, captures []step, unguarded ...string) *orderFixture {
	t.Helper()
	fg := newFakeGraphs()
	fx := &orderFixture{l: NewLedger(fg), fg: fg, ids: map[string]int64{}}
	fx.capture(t, pool, captures, unguarded...)
	return fx
}

func (fx *orderFixture) capture(t testing.TB, pool string, captures []step, unguarded ...string) {
	t.Helper()
	var names []string
	for _, c := range captures {
		id, ok := fx.ids[c.pass]
		if !ok {
			var err error
			id, err = fx.l.NewPass(len(fx.ids), c.pass)
			if err != nil {
				t.Fatal(err)
			}
			fx.ids[c.pass] = id
			names = append(names, c.pass)
		}
		capture(t, fx.l, id, c.kind, pool, 7)
	}
	skip := map[string]bool{}
	for _, u := range unguarded {
		skip[u] = true
	}
	for _, n := range names {
		if !skip[n] {
			if err := fx.l.SetOrderCheck(fx.ids[n], true); err != nil {
				t.Fatal(err)
			}
		}
		if err := fx.l.Seal(fx.ids[n]); err != nil {
			t.Fatal(err)
		}
	}
}

// run replays steps and returns the index of the first failing step and its
// error (-1, nil when all succeed).
func (fx *orderFixture) run(steps []step) (int, error) {
	for i, s := range steps {
		id := fx.ids[s.pass]
		var err error
		switch s.op {
		case "discard":
			_, err = fx.l.DiscardOpen(id)
		case "reset":
			_, err = fx.l.ResetPass(id)
		default:
			_, err = fx.l.Replay(id, s.kind, 7)
		}
		if err != nil {
			return i, err
		}
	}
	return -1, nil
}

func TestReplayOrderTable(t *testing.T) {
	train3 := []step{f("A"), f("B"), f("C"), b("C"), b("B"), b("A")}
	// A pipeline-like capture order (1F1B over micro-batch passes): each pass
	// is one micro-batch of one chunk.
	pipeline := []step{f("m1"), f("m2"), b("m1"), f("m3"), b("m2"), f("m4"), b("m3"), b("m4")}
	wgrad := []step{f("A"), f("B"), b("B"), w("B"), b("A"), w("A")}
	cases := []struct {
		name     string
		captures []step
		replays  []step
		failAt   int      // -1: no error
		want     []string // substrings of the error
	}{
		{"training order repeated", train3, repeat(4, train3...), -1, nil},
		{"eval-only chain of forward-only passes", []step{f("A"), f("B"), f("C")},
			append(repeat(3, f("A"), f("B"), f("C")), f("C"), f("A"), f("B")), -1, nil},
		{"forward-only use of training graphs, discarded", train3,
			repeat(3, f("A"), discard("A"), f("B"), discard("B"), f("C"), discard("C")), -1, nil},
		{"eval forwards between training iterations", train3,
			append(append(append([]step{}, train3...), f("A"), discard("A"), f("B"), discard("B")), train3...), -1, nil},
		{"pipeline schedule in capture order", pipeline, repeat(3, pipeline...), -1, nil},
		{"wgrad chains in capture order", wgrad, repeat(3, wgrad...), -1, nil},
		{"a pass's own forward again re-opens it", train3,
			[]step{f("A"), f("A"), f("B"), f("C"), b("C"), b("B"), b("A")}, -1, nil},
		{"reset closes an open pass", train3, []step{f("A"), f("B"), resetStep("B"), f("A")}, -1, nil},
		{"forward-only use of training graphs, not discarded", train3,
			[]step{f("A"), f("B"), f("C"), f("A")}, 3,
			[]string{`refusing to replay the forward of graphed callable 0 ("A", pass 1)`,
				`graphed callable 1 ("B", pass 2) ran its forward and its backward has not run since`,
				"captured before that pass's forward (capture #1 < #2 in the pool)", "pool p0"}},
		{"forward captured before another open forward", []step{f("B"), f("A"), b("A"), b("B")},
			[]step{f("A"), f("B")}, 1,
			[]string{`refusing to replay the forward of graphed callable 0 ("B", pass 1)`,
				`graphed callable 1 ("A", pass 2) ran its forward and its backward has not run since`,
				"capture #1 < #2", `run the backward of graphed callable 1 ("A", pass 2) first`}},
		{"backward out of order", []step{f("A"), f("B"), b("B"), b("A")},
			[]step{f("A"), f("B"), b("A")}, 2,
			[]string{`refusing to replay the backward of graphed callable 0 ("A", pass 1)`,
				`graphed callable 1 ("B", pass 2) ran its forward`,
				"captured after that pass's backward (capture #4 > #3 in the pool)"}},
		{"pipeline step skipped", pipeline, []step{f("m1"), f("m2"), f("m3")}, 2,
			[]string{`forward of graphed callable 2 ("m3", pass 3)`, `graphed callable 0 ("m1", pass 1) ran its forward`}},
		{"wgrad still pending", wgrad, []step{f("A"), f("B"), b("B"), b("A")}, 3,
			[]string{`backward of graphed callable 0 ("A", pass 1)`, `("B", pass 2) ran its forward and its wgrad has not run since`}},
		{"second iteration starts before the first finished", train3,
			[]step{f("A"), f("B"), f("C"), b("C"), f("A")}, 4,
			[]string{`forward of graphed callable 0 ("A", pass 1)`, `("B", pass 2) ran its forward and its backward has not run since`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fx := newOrderFixture(t, "p0", tc.captures)
			at, err := fx.run(tc.replays)
			if at != tc.failAt {
				t.Fatalf("first failure at step %d (%v), want %d", at, err, tc.failAt)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\nlacks %q", err, w)
				}
			}
			fx.fg.check(t)
		})
	}
}

func TestRefusedReplayLaunchesNothingAndChangesNothing(t *testing.T) {
	fx := newOrderFixture(t, "p", []step{f("A"), f("B"), b("B"), b("A")})
	if at, err := fx.run([]step{f("A"), f("B")}); at != -1 {
		t.Fatal(err)
	}
	before := fx.l.OrderState("p")
	launches := len(fx.fg.launches)
	if _, err := fx.l.Replay(fx.ids["A"], Backward, 7); err == nil {
		t.Fatal("out-of-order backward was not refused")
	}
	if got := fx.l.OrderState("p"); got != before {
		t.Fatalf("state changed by a refused replay:\n%s\nwas\n%s", got, before)
	}
	if g := fx.l.passes[fx.ids["A"]].Graphs[Backward]; fx.fg.launches[g] != 0 || len(fx.fg.launches) != launches {
		t.Fatal("a refused replay launched its graph")
	}
	// The right order still works afterwards.
	if at, err := fx.run([]step{b("B"), b("A")}); at != -1 {
		t.Fatal(err)
	}
	if s := fx.l.OrderState("p"); s != "" {
		t.Fatalf("passes left open: %s", s)
	}
}

func TestOrderStateDescribesOpenPasses(t *testing.T) {
	fx := newOrderFixture(t, "p", []step{f("A"), f("B"), b("B"), w("B"), b("A")})
	if at, err := fx.run([]step{f("A"), f("B"), b("B")}); at != -1 {
		t.Fatal(err)
	}
	want := `graphed callable 0 ("A", pass 1): opened by its forward (capture #1), last ran its forward, backward pending (its last capture is #5)` + "\n" +
		`graphed callable 1 ("B", pass 2): opened by its forward (capture #2), last ran its backward, wgrad pending (its last capture is #4)`
	if got := fx.l.OrderState("p"); got != want {
		t.Fatalf("OrderState =\n%s\nwant\n%s", got, want)
	}
	if fx.l.OrderState("nope") != "" {
		t.Fatal("unknown pool has state")
	}
}

func TestUnguardedPassesAreNotTracked(t *testing.T) {
	fx := newOrderFixture(t, "p", []step{f("A"), f("B"), b("B"), b("A")}, "B")
	// B is unguarded: its replays are neither checked nor open anything.
	if at, err := fx.run([]step{f("B"), f("A"), b("A"), b("B"), f("A")}); at != -1 {
		t.Fatalf("step %d: %v", at, err)
	}
	if got := fx.l.OrderState("p"); !strings.Contains(got, `"A"`) || strings.Contains(got, `"B"`) {
		t.Fatalf("OrderState = %q", got)
	}
	// Turning the guard off closes the pass; turning it off twice is harmless.
	must(t, fx.l.SetOrderCheck(fx.ids["A"], false))
	must(t, fx.l.SetOrderCheck(fx.ids["A"], false))
	if s := fx.l.OrderState("p"); s != "" {
		t.Fatalf("OrderState = %q", s)
	}
	if open, err := fx.l.DiscardOpen(fx.ids["A"]); open || err != nil {
		t.Fatalf("DiscardOpen of an unguarded pass = %v, %v", open, err)
	}
}

func TestPoolsAreIndependentAndSequencesPerPool(t *testing.T) {
	fx := newOrderFixture(t, "p1", []step{f("A"), f("B"), b("B"), b("A")})
	fx.capture(t, "p2", []step{f("C"), b("C")})
	for _, c := range []struct {
		pass string
		kind GraphKind
		seq  int
		pool string
	}{{"A", Forward, 1, "p1"}, {"B", Backward, 3, "p1"}, {"A", Backward, 4, "p1"}, {"C", Forward, 1, "p2"}, {"C", Backward, 2, "p2"}, {"C", WGrad, 0, "p2"}} {
		seq, pool, err := fx.l.CaptureSeq(fx.ids[c.pass], c.kind)
		if seq != c.seq || pool != c.pool || err != nil {
			t.Errorf("CaptureSeq(%s, %s) = %d, %q, %v; want %d, %q", c.pass, c.kind, seq, pool, err, c.seq, c.pool)
		}
	}
	// C (another pool, captured last) may run anywhere in A/B's iteration.
	if at, err := fx.run([]step{f("A"), f("C"), f("B"), b("B"), b("C"), b("A")}); at != -1 {
		t.Fatalf("step %d: %v", at, err)
	}
}

func TestSharedPoolAcrossBuildsContinuesTheSequence(t *testing.T) {
	// Two make_graphed_callables calls sharing one pool (Megatron's per-layer
	// graphs): the second call's captures come after the first's.
	fx := newOrderFixture(t, "shared", []step{f("A"), b("A")})
	fx.capture(t, "shared", []step{f("B"), b("B")})
	if seq, _, _ := fx.l.CaptureSeq(fx.ids["B"], Forward); seq != 3 {
		t.Fatalf("B's forward is capture #%d, want #3", seq)
	}
	if at, err := fx.run(repeat(2, f("A"), b("A"), f("B"), b("B"))); at != -1 {
		t.Fatalf("step %d: %v", at, err)
	}
	// A's backward was captured before B's forward: running B inside A's
	// window may overwrite what A's backward reads.
	if at, err := fx.run([]step{f("A"), f("B")}); at != 1 || !strings.Contains(err.Error(), "capture #3 > #2") {
		t.Fatalf("step %d: %v", at, err)
	}
}

func TestCaptureOrderErrors(t *testing.T) {
	fg := newFakeGraphs()
	l := NewLedger(fg)
	id, _ := l.NewPass(0, "fc")
	wantErr(t, l.SetOrderCheck(id, true), "has no recorded capture")
	if _, seq := capture(t, l, id, Forward, "p", 0); seq != 1 {
		t.Fatalf("first capture seq = %d", seq)
	}
	must(t, l.SetOrderCheck(id, true))
	must(t, l.Seal(id))
	if _, err := l.ResetPass(id); err != nil {
		t.Fatal(err)
	}
	wantErr(t, l.SetOrderCheck(id, true), "was reset")
	must(t, l.SetOrderCheck(id, false))
	_, _, err := l.CaptureSeq(id, 9)
	wantErr(t, err, "unknown graph kind 9")
}

func TestPoolOrderForgottenWhenItsPassesAreDropped(t *testing.T) {
	fx := newOrderFixture(t, "p", []step{f("A"), f("B"), b("B"), b("A")})
	fx.l.DropPass(fx.ids["A"])
	if fx.l.pools["p"] == nil {
		t.Fatal("pool forgotten while B still uses it")
	}
	fx.l.DropPass(fx.ids["B"])
	fx.l.DropPass(fx.ids["B"]) // unknown now: harmless
	if len(fx.l.pools) != 0 {
		t.Fatalf("pools left: %v", fx.l.pools)
	}
	// A new build in the same pool key starts a fresh sequence.
	fx.capture(t, "p", []step{f("C")})
	if seq, _, _ := fx.l.CaptureSeq(fx.ids["C"], Forward); seq != 1 {
		t.Fatalf("seq = %d", seq)
	}
}

// TestReplayOrderConcurrent runs guarded training iterations on several pools
// at once (one goroutine per pool) plus readers, for the race detector.
func TestReplayOrderConcurrent(t *testing.T) {
	fg := newFakeGraphs()
	l := NewLedger(fg)
	const pools, layers, iters = 4, 3, 200
	var wg sync.WaitGroup
	errs := make(chan error, pools)
	for pi := 0; pi < pools; pi++ {
		pool := fmt.Sprintf("pool%d", pi)
		ids := make([]int64, layers)
		for i := range ids {
			ids[i], _ = l.NewPass(i, "layer")
			capture(t, l, ids[i], Forward, pool, int64(pi+1))
		}
		for i := layers - 1; i >= 0; i-- {
			capture(t, l, ids[i], Backward, pool, int64(pi+1))
		}
		for i, id := range ids {
			must(t, l.SetOrderCheck(id, true))
			must(t, l.Seal(id))
			if pi%2 == 1 { // half the pools with the precise checker's specs
				lo := i * 1000
				must(t, l.SetRecarveSpec(id, Forward, fmt.Sprintf("name f\nw %d %d\nh %d %d 0 output 0", lo, lo+100, lo, lo+10)))
				must(t, l.SetRecarveSpec(id, Backward, fmt.Sprintf("name b\nw %d %d\nr %d %d %d 0 saved", lo+200, lo+300, lo+10, lo+100, id)))
			}
		}
		wg.Add(2)
		go func() {
			defer wg.Done()
			for it := 0; it < iters; it++ {
				for _, id := range ids {
					if _, err := l.Replay(id, Forward, 1); err != nil {
						errs <- err
						return
					}
				}
				for i := layers - 1; i >= 0; i-- {
					if _, err := l.Replay(ids[i], Backward, 1); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
		go func() {
			defer wg.Done()
			for it := 0; it < iters; it++ {
				_ = l.OrderState(pool)
				_, _, _ = l.CaptureSeq(ids[it%layers], Forward)
				_, _ = l.RecarveClobbers(ids[it%layers], Backward)
				_ = l.CheckOrder(ids[it%layers], Forward)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	fg.check(t)
}

// BenchmarkReplayOrderGuard measures Replay's cost without and with the
// guard: a training iteration of 8 layers (16 replays) per op, eager (handle
// 0) graphs so only the ledger is timed.
func BenchmarkReplayOrderGuard(b *testing.B) {
	for _, guarded := range []bool{false, true} {
		b.Run(fmt.Sprintf("guard=%v", guarded), func(b *testing.B) {
			l := NewLedger(newFakeGraphs())
			const layers = 8
			ids := make([]int64, layers)
			for i := range ids {
				ids[i], _ = l.NewPass(i, "layer")
				capture(b, l, ids[i], Forward, "p", 0)
			}
			for i := layers - 1; i >= 0; i-- {
				capture(b, l, ids[i], Backward, "p", 0)
			}
			for _, id := range ids {
				if guarded {
					_ = l.SetOrderCheck(id, true)
				}
				_ = l.Seal(id)
			}
			b.ResetTimer()
			for n := 0; n < b.N; n++ {
				for _, id := range ids {
					if _, err := l.Replay(id, Forward, 0); err != nil {
						b.Fatal(err)
					}
				}
				for i := layers - 1; i >= 0; i-- {
					if _, err := l.Replay(ids[i], Backward, 0); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*2*layers), "ns/replay")
		})
	}
}

func TestCheckOrderPredictsReplayWithoutChangingState(t *testing.T) {
	fx := newOrderFixture(t, "p", []step{f("A"), f("B"), b("B"), b("A")})
	a, bb := fx.ids["A"], fx.ids["B"]
	must(t, fx.l.CheckOrder(a, Backward)) // nothing open: anything goes
	if at, err := fx.run([]step{f("A"), f("B")}); at != -1 {
		t.Fatal(err)
	}
	before := fx.l.OrderState("p")
	wantErr(t, fx.l.CheckOrder(a, Backward), `refusing to replay the backward of graphed callable 0 ("A", pass 1)`)
	wantErr(t, fx.l.CheckOrder(a, Forward), `refusing to replay the forward of graphed callable 0 ("A", pass 1)`)
	must(t, fx.l.CheckOrder(bb, Backward))
	must(t, fx.l.CheckOrder(bb, Forward)) // its own re-run
	if got := fx.l.OrderState("p"); got != before {
		t.Fatalf("CheckOrder changed the state:\n%s\nwas\n%s", got, before)
	}
	_, err := fx.l.ResetPass(bb)
	must(t, err)
	must(t, fx.l.CheckOrder(bb, Forward)) // not ready: Replay reports the reset
	must(t, fx.l.CheckOrder(a, Backward)) // B closed by its reset
	wantErr(t, fx.l.CheckOrder(a, 5), "unknown graph kind 5")
	wantErr(t, fx.l.CheckOrder(404, Forward), "unknown pass 404")
}

// TestRecarveChecker: with specs (what each graph writes and reads), a
// guarded pool is checked precisely: the interval rule would refuse two
// microbatches' passes whose memory is disjoint replayed out of capture
// order; the checker lets them run, and still refuses a real overwrite.
func TestRecarveChecker(t *testing.T) {
	captures := []step{f("m1"), f("m2"), b("m1"), b("m2")}
	replays := []step{f("m2"), f("m1"), b("m2"), b("m1")} // forward captured before another open forward
	fx := newOrderFixture(t, "p", captures)
	if at, err := fx.run(replays); at != 1 || err == nil {
		t.Fatalf("the capture-order rule refuses this order at step 1: %d %v", at, err)
	}
	fx = newOrderFixture(t, "p", captures)
	specs := map[string][2]string{ // forward, backward
		"m1": {"name m1 forward\nw 0 100", "name m1 backward\nw 300 350\nr 0 100 %d 0 m1's activations"},
		"m2": {"name m2 forward\nw 100 200", "name m2 backward\nw 350 400\nr 100 200 %d 0 m2's activations"},
	}
	for name, s := range specs {
		id := fx.ids[name]
		if err := fx.l.SetRecarveSpec(id, Forward, s[0]); err != nil {
			t.Fatal(err)
		}
		if err := fx.l.SetRecarveSpec(id, Backward, fmt.Sprintf(s[1], id)); err != nil {
			t.Fatal(err)
		}
	}
	if at, err := fx.run(repeat(2, replays...)); err != nil {
		t.Fatalf("disjoint memory replays in any order: step %d: %v", at, err)
	}
	// m2's backward re-carved into m1's activations: caught before launching.
	if err := fx.l.SetRecarveSpec(fx.ids["m2"], Backward, fmt.Sprintf("name m2 backward\nw 0 50\nr 100 200 %d 0 m2's activations", fx.ids["m2"])); err != nil {
		t.Fatal(err)
	}
	total := func() (n int) {
		for _, c := range fx.fg.launches {
			n += c
		}
		return n
	}
	launched := total()
	at, err := fx.run([]step{f("m1"), f("m2"), b("m2")})
	if at != 2 || err == nil || !strings.Contains(err.Error(), "m2 backward is about to overwrite pool bytes [0x0, 0x32), which hold the content m1 forward wrote and m1 backward still needs") {
		t.Fatalf("step %d: %v", at, err)
	}
	if total() != launched+2 {
		t.Errorf("the refused replay launched: %d launches, want %d", total(), launched+2)
	}
	if _, err := fx.l.DiscardOpen(fx.ids["m1"]); err != nil {
		t.Fatal(err)
	}
	if at, err := fx.run([]step{b("m2")}); err != nil {
		t.Fatalf("after m1's forward was discarded nothing needs its activations: %d %v", at, err)
	}
	if err := fx.l.SetRecarveSpec(fx.ids["m1"], Forward, "w 1"); err == nil {
		t.Error("a malformed spec was accepted")
	}
	if _, err := fx.l.ResetPass(fx.ids["m1"]); err != nil {
		t.Fatal(err)
	}
	if err := fx.l.SetRecarveSpec(fx.ids["m1"], Forward, "w 0 1"); err == nil {
		t.Error("a spec for a reset pass was accepted")
	}
}
