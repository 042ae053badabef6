package state

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

// fakeGraphs stands in for the cudagraph registry. It hands out graph
// handles, counts launches and destroys per handle, and records violations:
// launching or destroying a graph that is not alive.
type fakeGraphs struct {
	mu          sync.Mutex
	next        int64
	live        map[int64]bool
	destroyed   map[int64]int
	launches    map[int64]int
	violations  []string
	failDestroy map[int64]bool
	failLaunch  error
}

func newFakeGraphs() *fakeGraphs {
	return &fakeGraphs{
		live:        make(map[int64]bool),
		destroyed:   make(map[int64]int),
		launches:    make(map[int64]int),
		failDestroy: make(map[int64]bool),
	}
}

func (f *fakeGraphs) create() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	f.live[f.next] = true
	return f.next
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
}

// replayErr is Replay for tests that only look at the error.
func replayErr(l *Ledger, id int64, k Kind, stream int64) error {
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

func TestPassLifecycle(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, err := l.NewPass(3, "layer3")
	must(t, err)
	if id != 1 {
		t.Fatalf("first pass id = %d, want 1", id)
	}
	fwd, bwd := f.create(), f.create()
	must(t, l.AttachGraph(id, Forward, fwd))
	must(t, l.AttachGraph(id, Backward, bwd))
	must(t, l.AddPoolRef(id))
	must(t, l.AddPoolRef(id))
	wantErr(t, replayErr(l, id, Forward, 7), `graphed callable 3 ("layer3") is still being captured`)
	if st, _ := l.State(id); st != Building || st.String() != "building" {
		t.Fatalf("state = %v", st)
	}
	must(t, l.Seal(id))
	if st, _ := l.State(id); st.String() != "ready" {
		t.Fatalf("state = %v", st)
	}
	for _, k := range []Kind{Forward, Backward, Forward} {
		if launched, err := l.Replay(id, k, 7); !launched || err != nil {
			t.Fatalf("Replay(%v) = %v, %v; want a launch", k, launched, err)
		}
	}
	if f.launches[fwd] != 2 || f.launches[bwd] != 1 {
		t.Fatalf("launches = %v", f.launches)
	}
	wantErr(t, replayErr(l, id, WGrad, 7), `graphed callable 3 ("layer3") has no wgrad graph`)
	if g, _ := l.Graph(id, Backward); g != bwd {
		t.Fatalf("Graph(backward) = %d, want %d", g, bwd)
	}
	snap, err := l.Snapshot(id)
	must(t, err)
	if snap.PoolRefs != 2 || snap.Label != "layer3" || !snap.Has[Forward] || snap.Has[WGrad] {
		t.Fatalf("snapshot = %+v", snap)
	}

	refs, err := l.ResetPass(id)
	must(t, err)
	if refs != 2 {
		t.Fatalf("ResetPass returned %d refs, want 2", refs)
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
	if st, _ := l.State(id); st.String() != "reset" {
		t.Fatalf("state = %v", st)
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
		must(t, l.AttachGraph(e.id, Forward, f.create()))
		e.sealed, _ = l.NewPass(1, "fc2")
		must(t, l.AttachGraph(e.sealed, Forward, f.create()))
		must(t, l.Seal(e.sealed))
		e.reset, _ = l.NewPass(2, "fc3")
		_, err := l.ResetPass(e.reset)
		must(t, err)
		return e
	}
	tests := []struct {
		name string
		do   func(env) error
		want string
	}{
		{"negative callable index", func(e env) error { _, err := e.l.NewPass(-1, "x"); return err }, "callable index -1 is negative"},
		{"attach unknown pass", func(e env) error { return e.l.AttachGraph(99, Forward, 0) }, "unknown pass 99"},
		{"attach unknown kind", func(e env) error { return e.l.AttachGraph(e.id, 3, 0) }, "unknown graph kind 3 (want 0 forward, 1 backward or 2 wgrad)"},
		{"attach negative handle", func(e env) error { return e.l.AttachGraph(e.id, Backward, -4) }, "invalid graph handle -4"},
		{"attach kind twice", func(e env) error { return e.l.AttachGraph(e.id, Forward, 0) }, `graphed callable 0 ("fc1") already has a forward graph`},
		{"attach after seal", func(e env) error { return e.l.AttachGraph(e.sealed, Backward, 0) }, `graphed callable 1 ("fc2") is sealed; cannot attach a backward graph`},
		{"attach after reset", func(e env) error { return e.l.AttachGraph(e.reset, Forward, 0) }, `graphed callable 2 ("fc3") was reset; call make_graphed_callables again to graph it anew`},
		{"attach another pass's graph", func(e env) error {
			g, _ := e.l.Graph(e.sealed, Forward)
			return e.l.AttachGraph(e.id, Backward, g)
		}, "graph 2 is already owned by pass 2; a graph belongs to exactly one pass"},
		{"pool ref unknown pass", func(e env) error { return e.l.AddPoolRef(0) }, "unknown pass 0"},
		{"pool ref after seal", func(e env) error { return e.l.AddPoolRef(e.sealed) }, `graphed callable 1 ("fc2") is sealed; cannot take a pool reference`},
		{"pool ref after reset", func(e env) error { return e.l.AddPoolRef(e.reset) }, "was reset"},
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
	must(t, l.AttachGraph(id, Forward, 0))
	must(t, l.AttachGraph(id, Backward, 0))
	must(t, l.Seal(id))
	for _, k := range []Kind{Forward, Backward} {
		if launched, err := l.Replay(id, k, 0); launched || err != nil { // nothing to launch
			t.Fatalf("Replay(%v) = %v, %v; want no launch", k, launched, err)
		}
	}
	wantErr(t, replayErr(l, id, WGrad, 0), "has no wgrad graph")
	if len(f.launches) != 0 {
		t.Fatalf("eager pass launched %v", f.launches)
	}
	refs, err := l.ResetPass(id)
	if refs != 0 || err != nil || len(f.destroyed) != 0 {
		t.Fatalf("reset = %d, %v; destroyed %v", refs, err, f.destroyed)
	}
}

func TestResetFromBuilding(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, _ := l.NewPass(0, "half")
	g := f.create()
	must(t, l.AttachGraph(id, Forward, g))
	must(t, l.AddPoolRef(id))
	must(t, l.AddPoolRef(id))
	refs, err := l.ResetPass(id)
	if refs != 2 || err != nil || f.destroyed[g] != 1 {
		t.Fatalf("reset = %d, %v; destroyed %v", refs, err, f.destroyed)
	}
	wantErr(t, l.Seal(id), "was reset")
	f.check(t)
}

func TestResetContinuesPastDestroyFailure(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	id, _ := l.NewPass(4, "moe")
	gs := []int64{f.create(), f.create(), f.create()}
	for k, g := range gs {
		must(t, l.AttachGraph(id, Kind(k), g))
	}
	must(t, l.AddPoolRef(id))
	must(t, l.Seal(id))
	f.failDestroy[gs[0]] = true
	f.failDestroy[gs[1]] = true
	refs, err := l.ResetPass(id)
	wantErr(t, err, `graphed callable 4 ("moe"): destroying its forward graph: destroy_graph: cuGraphExecDestroy`)
	if refs != 1 {
		t.Fatalf("refs = %d, want 1 even though a destroy failed", refs)
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

func TestDropPass(t *testing.T) {
	f := newFakeGraphs()
	l := NewLedger(f)
	a, _ := l.NewPass(0, "a")
	b, _ := l.NewPass(1, "b")
	g := f.create()
	must(t, l.AttachGraph(a, Forward, g))
	must(t, l.AddPoolRef(a))
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
		must(t, l.AttachGraph(ids[i], Forward, f.create()))
		must(t, l.AttachGraph(ids[i], Backward, f.create()))
		must(t, l.AddPoolRef(ids[i]))
		refsIn++
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
					err := replayErr(l, id, Kind((i+r)%2), 1)
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
	go func() { // new passes appear concurrently
		defer wg.Done()
		for i := 0; i < 100; i++ {
			id, _ := l.NewPass(i, "late")
			_, _ = l.DropPass(id)
		}
	}()
	wg.Wait()
	for _, id := range ids {
		n, err := l.DropPass(id)
		must(t, err)
		refsOut += n
	}
	if refsOut != refsIn {
		t.Fatalf("pool refs handed back %d, taken %d", refsOut, refsIn)
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
