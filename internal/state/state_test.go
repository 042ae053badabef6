package state

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

// fakeGraphs stands in for the cudagraph registry. It captures (a stream's
// EndCapture hands out a new graph handle), counts launches and destroys per
// handle, and records violations: launching or destroying a graph that is
// not alive, ending a stream that is not capturing, beginning one twice.
type fakeGraphs struct {
	mu          sync.Mutex
	next        int64
	live        map[int64]bool
	capturing   map[int64]bool
	destroyed   map[int64]int
	launches    map[int64]int
	orders      map[int64]int
	aborts      int
	violations  []string
	failDestroy map[int64]bool
	failLaunch  error
	failBegin   error
	failEnd     error
}

func newFakeGraphs() *fakeGraphs {
	return &fakeGraphs{
		live:        make(map[int64]bool),
		capturing:   make(map[int64]bool),
		destroyed:   make(map[int64]int),
		launches:    make(map[int64]int),
		orders:      make(map[int64]int),
		failDestroy: make(map[int64]bool),
	}
}

func (f *fakeGraphs) BeginCapture(stream int64, mode int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failBegin != nil {
		return f.failBegin
	}
	if f.capturing[stream] {
		f.violations = append(f.violations, fmt.Sprintf("stream %d began capturing twice", stream))
		return fmt.Errorf("begin_capture: stream %d is already capturing", stream)
	}
	f.capturing[stream] = true
	return nil
}

func (f *fakeGraphs) EndCapture(stream int64) (int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.capturing[stream] {
		f.violations = append(f.violations, fmt.Sprintf("end of stream %d, which is not capturing", stream))
		return 0, fmt.Errorf("end_capture: stream %d is not capturing", stream)
	}
	delete(f.capturing, stream)
	if f.failEnd != nil {
		return 0, f.failEnd // the registry destroys what the driver produced
	}
	f.next++
	f.live[f.next] = true
	return f.next, nil
}

func (f *fakeGraphs) AbortCapture(stream int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.capturing, stream)
	f.aborts++
	return nil
}

func (f *fakeGraphs) Launch(g, stream int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.live[g] {
		f.violations = append(f.violations, fmt.Sprintf("launch of dead graph %d", g))
		return fmt.Errorf("launch_graph: unknown graph handle %d", g)
	}
	if f.failLaunch != nil {
		return f.failLaunch
	}
	f.launches[g]++
	return nil
}

func (f *fakeGraphs) Order(g, stream int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.live[g] {
		f.violations = append(f.violations, fmt.Sprintf("ordering of dead graph %d", g))
		return fmt.Errorf("order_replay: unknown graph handle %d", g)
	}
	if f.failLaunch != nil {
		return f.failLaunch
	}
	f.orders[g]++
	return nil
}

func (f *fakeGraphs) Destroy(g int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.destroyed[g]++
	if !f.live[g] {
		f.violations = append(f.violations, fmt.Sprintf("destroy of dead graph %d", g))
		return fmt.Errorf("destroy_graph: unknown graph handle %d", g)
	}
	// Like the registry, a failed destroy still unregisters the handle.
	delete(f.live, g)
	if f.failDestroy[g] {
		return fmt.Errorf("destroy_graph: cuGraphExecDestroy: CUDA_ERROR_ILLEGAL_STATE (401): boom")
	}
	return nil
}

func (f *fakeGraphs) check(t testing.TB) {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.violations) > 0 {
		t.Fatalf("graph misuse: %v", f.violations)
	}
	if len(f.capturing) > 0 {
		t.Fatalf("streams left capturing: %v", f.capturing)
	}
}

// capture runs one successful capture transaction of pass id's kind in pool
// on stream (0: eager, nothing captured) and returns the attached graph
// handle and the capture's sequence number.
func capture(t testing.TB, l *Ledger, id int64, kind GraphKind, pool string, stream int64) (int64, int) {
	t.Helper()
	if err := l.BeginCapture(id, kind, pool, stream, 0); err != nil {
		t.Fatal(err)
	}
	seq, err := l.EndCapture(id, kind, stream)
	if err != nil {
		t.Fatal(err)
	}
	g, err := l.Graph(id, kind)
	if err != nil {
		t.Fatal(err)
	}
	return g, seq
}

// replayErr is Replay for tests that only look at the error.
func replayErr(l *Ledger, id int64, k GraphKind, stream int64) error {
	_, err := l.Replay(id, k, stream)
	return err
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantErr(t *testing.T, err error, want string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %q", want)
	}
	if err.Error() != want && !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q\nwant %q", err, want)
	}
}

// TestOrder: a ready pass's graph is ordered (no launch); a pass still
// building, a kind it lacks, an eager kind and a reset pass order nothing and
// leave the reason to the replay; the registry's error names the pass.
func TestOrder(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, err := l.NewPass(1, "drop")
	must(t, err)
	fwd, _ := capture(t, l, id, Forward, "pool", 5)
	capture(t, l, id, Backward, "pool", 0) // stream 0: eager, no graph
	if ordered, err := l.Order(id, Forward, 7); ordered || err != nil {
		t.Fatalf("Order while building = %v, %v", ordered, err)
	}
	must(t, l.Seal(id))
	for _, tc := range []struct {
		kind GraphKind
		want bool
	}{{Forward, true}, {Backward, false}, {WGrad, false}} {
		if ordered, err := l.Order(id, tc.kind, 7); ordered != tc.want || err != nil {
			t.Fatalf("Order(%v) = %v, %v; want %v", tc.kind, ordered, err, tc.want)
		}
	}
	if f.orders[fwd] != 1 || f.launches[fwd] != 0 {
		t.Fatalf("orders %v, launches %v: want one ordering and no launch", f.orders, f.launches)
	}
	f.failLaunch = fmt.Errorf("boom")
	_, err = l.Order(id, Forward, 7)
	wantErr(t, err, `graphed callable 1 ("drop"): ordering the replay of its forward graph: boom`)
	f.failLaunch = nil
	_, err = l.Order(id, GraphKind(9), 7)
	if err == nil {
		t.Fatal("Order of an unknown kind accepted")
	}
	if _, err := l.ResetPass(id); err != nil {
		t.Fatal(err)
	}
	if ordered, err := l.Order(id, Forward, 7); ordered || err != nil {
		t.Fatalf("Order after reset = %v, %v", ordered, err)
	}
	if _, err := l.DropPass(id); err != nil {
		t.Fatal(err)
	}
}

func TestPassLifecycle(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, err := l.NewPass(3, "layer3")
	must(t, err)
	if id != 1 {
		t.Fatalf("first pass id = %d, want 1", id)
	}
	fwd, seq1 := capture(t, l, id, Forward, "pool", 5)
	bwd, seq2 := capture(t, l, id, Backward, "pool", 5)
	if fwd == 0 || bwd == 0 || fwd == bwd || seq1 != 1 || seq2 != 2 {
		t.Fatalf("captures gave graphs %d, %d and seqs %d, %d", fwd, bwd, seq1, seq2)
	}
	if n := l.PoolRefs("pool"); n != 2 {
		t.Fatalf("PoolRefs = %d, want 2 (one per capture)", n)
	}
	wantErr(t, replayErr(l, id, Forward, 7), `graphed callable 3 ("layer3") is still being captured`)
	if st, _ := l.State(id); st != Building || st.String() != "building" {
		t.Fatalf("state = %v", st)
	}
	must(t, l.Seal(id))
	if st, _ := l.State(id); st.String() != "ready" {
		t.Fatalf("state = %v", st)
	}
	for _, k := range []GraphKind{Forward, Backward, Forward} {
		if launched, err := l.Replay(id, k, 7); !launched || err != nil {
			t.Fatalf("Replay(%v) = %v, %v; want a launch", k, launched, err)
		}
	}
	if f.launches[fwd] != 2 || f.launches[bwd] != 1 {
		t.Fatalf("launches = %v", f.launches)
	}
	wantErr(t, replayErr(l, id, WGrad, 7), `graphed callable 3 ("layer3") has no wgrad graph`)
	snap, err := l.Snapshot(id)
	must(t, err)
	if snap.PoolRefs != 2 || snap.Label != "layer3" || !snap.Has[Forward] || snap.Has[WGrad] || snap.Pool != "pool" {
		t.Fatalf("snapshot = %+v", snap)
	}

	refs, err := l.ResetPass(id)
	must(t, err)
	if refs != 2 || l.PoolRefs("pool") != 0 {
		t.Fatalf("ResetPass returned %d refs (pool left with %d), want 2 (0)", refs, l.PoolRefs("pool"))
	}
	if f.destroyed[fwd] != 1 || f.destroyed[bwd] != 1 {
		t.Fatalf("destroyed = %v", f.destroyed)
	}
	const resetMsg = `graphed callable 3 ("layer3") was reset; call make_graphed_callables again to graph it anew`
	for k := Forward; k < NumKinds; k++ {
		err := replayErr(l, id, k, 7)
		if err == nil || err.Error() != resetMsg {
			t.Fatalf("replay after reset: %v", err)
		}
	}
	if g, _ := l.Graph(id, Forward); g != 0 {
		t.Fatalf("a reset pass still names graph %d", g)
	}
	refs, err = l.ResetPass(id) // harmless twice
	if refs != 0 || err != nil {
		t.Fatalf("second reset = %d, %v", refs, err)
	}
	if f.destroyed[fwd] != 1 || f.destroyed[bwd] != 1 {
		t.Fatalf("second reset destroyed again: %v", f.destroyed)
	}
	f.check(t)
}

// TestCaptureTransaction walks every failure point of one capture and checks
// what the ledger holds afterwards: pool references (on the pass and the
// pool), the attached graph, the stream's capture state.
func TestCaptureTransaction(t *testing.T) {
	boom := errors.New("cuStreamBeginCapture: CUDA_ERROR_ILLEGAL_STATE (401): boom")
	tests := []struct {
		name     string
		do       func(*testing.T, *Ledger, *fakeGraphs, int64) error
		want     string // "" = success
		refs     int    // pool references the pass holds after
		attached bool   // a forward graph is attached after
		aborts   int
	}{
		{"success", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			must(t, l.BeginCapture(id, Forward, "p", 9, 0))
			_, err := l.EndCapture(id, Forward, 9)
			return err
		}, "", 1, true, 0},
		{"begin fails: nothing changes", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			f.failBegin = boom
			return l.BeginCapture(id, Forward, "p", 9, 0)
		}, `graphed callable 0 ("fc"): beginning its forward capture: cuStreamBeginCapture`, 0, false, 0},
		{"body fails: abort keeps the reference", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			must(t, l.BeginCapture(id, Forward, "p", 9, 0))
			must(t, l.AbortCapture(id, Forward, 9))
			return l.AbortCapture(id, Forward, 9) // twice: harmless
		}, "", 1, false, 1},
		{"end fails: nothing attached, reference kept", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			must(t, l.BeginCapture(id, Forward, "p", 9, 0))
			f.failEnd = errors.New("end_capture: cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901)")
			_, err := l.EndCapture(id, Forward, 9)
			return err
		}, `graphed callable 0 ("fc"): ending its forward capture: end_capture: cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, 1, false, 0},
		{"end without begin", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			_, err := l.EndCapture(id, Forward, 9)
			return err
		}, `graphed callable 0 ("fc") has no forward capture open on stream 9`, 0, false, 0},
		{"end of another kind", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			must(t, l.BeginCapture(id, Forward, "p", 9, 0))
			_, err := l.EndCapture(id, Backward, 9)
			must(t, l.AbortCapture(id, Forward, 9))
			return err
		}, `has no backward capture open on stream 9`, 1, false, 1},
		{"second begin while open", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			must(t, l.BeginCapture(id, Forward, "p", 9, 0))
			err := l.BeginCapture(id, Backward, "p", 9, 0)
			must(t, l.AbortCapture(id, Forward, 9))
			return err
		}, `its forward capture is still open; end or abort it before capturing its backward`, 1, false, 1},
		{"reset aborts an open capture", func(t *testing.T, l *Ledger, f *fakeGraphs, id int64) error {
			must(t, l.BeginCapture(id, Forward, "p", 9, 0))
			n, err := l.ResetPass(id)
			if n != 1 {
				t.Errorf("reset returned %d refs", n)
			}
			return err
		}, "", 0, false, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeGraphs()
			l := NewLedger(f)
			id, _ := l.NewPass(0, "fc")
			err := tc.do(t, l, f, id)
			if tc.want == "" {
				must(t, err)
			} else {
				wantErr(t, err, tc.want)
			}
			snap, _ := l.Snapshot(id)
			if snap.PoolRefs != tc.refs || l.PoolRefs("p") != tc.refs {
				t.Errorf("refs: pass %d, pool %d; want %d", snap.PoolRefs, l.PoolRefs("p"), tc.refs)
			}
			if snap.Has[Forward] != tc.attached || (snap.Graphs[Forward] != 0) != tc.attached {
				t.Errorf("attached = %v (graph %d), want %v", snap.Has[Forward], snap.Graphs[Forward], tc.attached)
			}
			if f.aborts != tc.aborts {
				t.Errorf("aborts = %d, want %d", f.aborts, tc.aborts)
			}
			n, err := l.DropPass(id)
			must(t, err)
			if n != snap.PoolRefs || l.PoolRefs("p") != 0 {
				t.Errorf("drop handed back %d refs (pool left %d), want %d", n, l.PoolRefs("p"), snap.PoolRefs)
			}
			f.check(t)
		})
	}
}

func TestErrors(t *testing.T) {
	type env struct {
		l      *Ledger
		f      *fakeGraphs
		id     int64 // pass 1: callable 0 "fc1", has a forward graph
		sealed int64 // pass 2: callable 1 "fc2", sealed with forward only
		reset  int64 // pass 3: callable 2 "fc3", reset
	}
	setup := func(t *testing.T) env {
		f := newFakeGraphs()
		l := NewLedger(f)
		e := env{l: l, f: f}
		e.id, _ = l.NewPass(0, "fc1")
		capture(t, l, e.id, Forward, "p", 1)
		e.sealed, _ = l.NewPass(1, "fc2")
		capture(t, l, e.sealed, Forward, "p", 1)
		must(t, l.Seal(e.sealed))
		e.reset, _ = l.NewPass(2, "fc3")
		_, err := l.ResetPass(e.reset)
		must(t, err)
		return e
	}
	begin := func(e env, id int64, k GraphKind, pool string) error { return e.l.BeginCapture(id, k, pool, 0, 0) }
	tests := []struct {
		name string
		do   func(env) error
		want string
	}{
		{"negative callable index", func(e env) error { _, err := e.l.NewPass(-1, "x"); return err }, "callable index -1 is negative"},
		{"capture unknown pass", func(e env) error { return begin(e, 99, Forward, "p") }, "unknown pass 99"},
		{"capture unknown kind", func(e env) error { return begin(e, e.id, 3, "p") }, "unknown graph kind 3 (want 0 forward, 1 backward or 2 wgrad)"},
		{"capture empty pool", func(e env) error { return begin(e, e.id, Backward, "") }, "empty pool key"},
		{"capture kind twice", func(e env) error { return begin(e, e.id, Forward, "p") }, `graphed callable 0 ("fc1") already has a forward graph`},
		{"capture after seal", func(e env) error { return begin(e, e.sealed, Backward, "p") }, `graphed callable 1 ("fc2") is sealed; cannot capture a backward graph`},
		{"capture after reset", func(e env) error { return begin(e, e.reset, Forward, "p") }, `graphed callable 2 ("fc3") was reset; call make_graphed_callables again to graph it anew`},
		{"capture in another pool", func(e env) error { return begin(e, e.id, Backward, "q") }, `its backward capture is in pool "q" but its earlier captures are in pool "p"`},
		{"seal unknown pass", func(e env) error { return e.l.Seal(42) }, "unknown pass 42"},
		{"seal twice", func(e env) error { return e.l.Seal(e.sealed) }, `graphed callable 1 ("fc2") is already sealed`},
		{"seal after reset", func(e env) error { return e.l.Seal(e.reset) }, "was reset"},
		{"replay unknown pass", func(e env) error { return replayErr(e.l, -1, Forward, 1) }, "unknown pass -1"},
		{"replay unknown kind", func(e env) error { return replayErr(e.l, e.sealed, 9, 1) }, "unknown graph kind 9"},
		{"replay building", func(e env) error { return replayErr(e.l, e.id, Forward, 1) }, `graphed callable 0 ("fc1") is still being captured`},
		{"replay missing kind", func(e env) error { return replayErr(e.l, e.sealed, Backward, 1) }, `graphed callable 1 ("fc2") has no backward graph`},
		{"replay launch fails", func(e env) error {
			e.f.failLaunch = errors.New("launch_graph: cuGraphLaunch: CUDA_ERROR_ILLEGAL_ADDRESS (700): boom")
			return replayErr(e.l, e.sealed, Forward, 1)
		}, `graphed callable 1 ("fc2"): replaying its forward graph: launch_graph: cuGraphLaunch: CUDA_ERROR_ILLEGAL_ADDRESS (700): boom`},
		{"state unknown pass", func(e env) error { _, err := e.l.State(5); return err }, "unknown pass 5"},
		{"graph unknown kind", func(e env) error { _, err := e.l.Graph(e.id, -1); return err }, "unknown graph kind -1"},
		{"graph unknown pass", func(e env) error { _, err := e.l.Graph(5, Forward); return err }, "unknown pass 5"},
		{"reset unknown pass", func(e env) error { _, err := e.l.ResetPass(5); return err }, "unknown pass 5"},
		{"reset error unknown pass", func(e env) error { _, err := e.l.ResetError(5); return err }, "unknown pass 5"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := setup(t)
			wantErr(t, tc.do(e), tc.want)
			e.f.check(t)
		})
	}
}

func TestEagerPass(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, _ := l.NewPass(0, "eager")
	for _, k := range []GraphKind{Forward, Backward} {
		if g, seq := capture(t, l, id, k, "eager/1", 0); g != 0 || seq != int(k)+1 {
			t.Fatalf("eager capture of %v = graph %d, seq %d", k, g, seq)
		}
	}
	must(t, l.Seal(id))
	for _, k := range []GraphKind{Forward, Backward} {
		if launched, err := l.Replay(id, k, 0); launched || err != nil { // nothing to launch
			t.Fatalf("Replay(%v) = %v, %v; want no launch", k, launched, err)
		}
	}
	wantErr(t, replayErr(l, id, WGrad, 0), "has no wgrad graph")
	if len(f.launches) != 0 || len(f.live) != 0 {
		t.Fatalf("eager pass launched %v / created %v", f.launches, f.live)
	}
	refs, err := l.ResetPass(id)
	if refs != 2 || err != nil || len(f.destroyed) != 0 {
		t.Fatalf("reset = %d, %v; destroyed %v", refs, err, f.destroyed)
	}
	f.check(t)
}

func TestResetFromBuilding(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, _ := l.NewPass(0, "half")
	g, _ := capture(t, l, id, Forward, "p", 3)
	must(t, l.BeginCapture(id, Backward, "p", 3, 0)) // its body failed and nothing aborted it
	refs, err := l.ResetPass(id)
	if refs != 2 || err != nil || f.destroyed[g] != 1 || f.aborts != 1 {
		t.Fatalf("reset = %d, %v; destroyed %v, aborts %d", refs, err, f.destroyed, f.aborts)
	}
	wantErr(t, l.Seal(id), "was reset")
	f.check(t)
}

func TestResetContinuesPastDestroyFailure(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, _ := l.NewPass(4, "moe")
	var gs []int64
	for k := Forward; k < NumKinds; k++ {
		g, _ := capture(t, l, id, k, "p", 2)
		gs = append(gs, g)
	}
	must(t, l.Seal(id))
	f.failDestroy[gs[0]] = true
	f.failDestroy[gs[1]] = true
	refs, err := l.ResetPass(id)
	const want = `graphed callable 4 ("moe"): destroying its forward graph: destroy_graph: cuGraphExecDestroy`
	wantErr(t, err, want)
	if refs != 3 || l.PoolRefs("p") != 0 {
		t.Fatalf("refs = %d (pool %d), want 3 (0) even though a destroy failed", refs, l.PoolRefs("p"))
	}
	if msg, _ := l.ResetError(id); !strings.Contains(msg, want) {
		t.Fatalf("ResetError = %q", msg)
	}
	for _, g := range gs {
		if f.destroyed[g] != 1 {
			t.Fatalf("graph %d destroyed %d times", g, f.destroyed[g])
		}
	}
	if st, _ := l.State(id); st != Reset {
		t.Fatalf("state = %v, want reset", st)
	}
	refs, err = l.ResetPass(id)
	if refs != 0 || err != nil {
		t.Fatalf("second reset = %d, %v", refs, err)
	}
	f.check(t)
}

func TestPoolRefsPerPool(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	a, _ := l.NewPass(0, "a")
	b, _ := l.NewPass(1, "b")
	c, _ := l.NewPass(2, "c")
	capture(t, l, a, Forward, "p", 0)
	capture(t, l, a, Backward, "p", 0)
	capture(t, l, b, Forward, "p", 0)
	capture(t, l, c, Forward, "q", 0)
	for pool, want := range map[string]int{"p": 3, "q": 1, "r": 0} {
		if n := l.PoolRefs(pool); n != want {
			t.Errorf("PoolRefs(%q) = %d, want %d", pool, n, want)
		}
	}
	if n, _ := l.ResetPass(a); n != 2 || l.PoolRefs("p") != 1 {
		t.Fatalf("reset a: %d refs, pool p left %d", n, l.PoolRefs("p"))
	}
	if n, _ := l.DropPass(b); n != 1 || l.PoolRefs("p") != 0 || l.PoolRefs("q") != 1 {
		t.Fatalf("drop b: %d refs, pools p %d q %d", n, l.PoolRefs("p"), l.PoolRefs("q"))
	}
	if n, _ := l.DropPass(c); n != 1 || len(l.poolRefs) != 0 {
		t.Fatalf("drop c: %d refs, pools left %v", n, l.poolRefs)
	}
}

func TestDropPass(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	a, _ := l.NewPass(0, "a")
	b, _ := l.NewPass(1, "b")
	g, _ := capture(t, l, a, Forward, "p", 4)
	if n := l.LivePasses(); n != 2 {
		t.Fatalf("LivePasses = %d", n)
	}
	refs, err := l.DropPass(a)
	if refs != 1 || err != nil || f.destroyed[g] != 1 {
		t.Fatalf("drop = %d, %v; destroyed %v", refs, err, f.destroyed)
	}
	wantErr(t, replayErr(l, a, Forward, 1), "unknown pass 1")
	if refs, err := l.DropPass(a); refs != 0 || err != nil { // unknown: not an error
		t.Fatalf("second drop = %d, %v", refs, err)
	}
	if _, err := l.ResetPass(b); err != nil {
		t.Fatal(err)
	}
	if _, err := l.DropPass(b); err != nil { // dropping a reset pass
		t.Fatal(err)
	}
	if n := l.LivePasses(); n != 0 {
		t.Fatalf("LivePasses = %d", n)
	}
	if c, _ := l.NewPass(2, "c"); c != 3 {
		t.Fatalf("pass id %d reused; want 3", c)
	}
	f.check(t)
}

// TestConcurrent replays passes from many goroutines while others reset and
// drop them. Under -race it checks the locking; the fake checks that no
// launch ever reaches a destroyed graph and nothing is destroyed twice.
func TestConcurrent(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	const passes, replayers = 64, 8
	ids := make([]int64, passes)
	var refsIn int
	for i := range ids {
		ids[i], _ = l.NewPass(i, fmt.Sprintf("layer%d", i))
		capture(t, l, ids[i], Forward, "p", int64(i+1))
		capture(t, l, ids[i], Backward, "p", int64(i+1))
		refsIn += 2
		must(t, l.Seal(ids[i]))
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	refsOut := 0
	for r := 0; r < replayers; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			for n := 0; n < 50; n++ {
				for i, id := range ids {
					err := replayErr(l, id, GraphKind((i+r)%2), 1)
					if err != nil && !strings.Contains(err.Error(), "was reset") && !strings.Contains(err.Error(), "unknown pass") {
						t.Error(err)
						return
					}
				}
			}
		}(r)
	}
	for i, id := range ids {
		wg.Add(1)
		go func(i int, id int64) {
			defer wg.Done()
			var n int
			var err error
			if i%2 == 0 {
				n, err = l.ResetPass(id)
			} else {
				n, err = l.DropPass(id)
			}
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			refsOut += n
			mu.Unlock()
		}(i, id)
	}
	wg.Add(1)
	go func() { // new passes appear and capture concurrently
		defer wg.Done()
		for i := 0; i < 100; i++ {
			id, _ := l.NewPass(i, "late")
			if err := l.BeginCapture(id, Forward, "late", 0, 0); err == nil {
				_, _ = l.EndCapture(id, Forward, 0)
			}
			_, _ = l.DropPass(id)
		}
	}()
	wg.Wait()
	for _, id := range ids {
		n, err := l.DropPass(id)
		must(t, err)
		refsOut += n
	}
	if refsOut != refsIn || l.PoolRefs("p") != 0 || l.PoolRefs("late") != 0 {
		t.Fatalf("pool refs handed back %d, taken %d; left %v", refsOut, refsIn, l.poolRefs)
	}
	if l.LivePasses() != 0 {
		t.Fatalf("LivePasses = %d", l.LivePasses())
	}
	for g := int64(1); g <= 2*passes; g++ {
		if f.destroyed[g] != 1 {
			t.Fatalf("graph %d destroyed %d times", g, f.destroyed[g])
		}
	}
	f.check(t)
}
