package cudagraph

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

// Streams of the ordering tests: two capture streams and three replay
// streams (0 is torch's default stream, the legacy one).
const (
	capA, capB        = int64(0xCA00), int64(0xCB00)
	replay0, replayS1 = int64(0), int64(0x5100)
	replayS2          = int64(0x5200)
)

// orderFixture captures graphs g[0], g[1] on capA and g[2] on capB and names
// every handle the op log mentions, so expectations read as
// "launch g0@s1", "record evA@s1", "wait s2<-evA".
type orderFixture struct {
	f     *fakeDriver
	r     *Registry
	g     [3]int64
	names map[string]string
}

func newOrderFixture(t *testing.T) *orderFixture {
	t.Helper()
	f := newFake()
	r := NewRegistry(f)
	x := &orderFixture{f: f, r: r, names: map[string]string{}}
	for i, c := range []int64{capA, capA, capB} {
		x.g[i] = capture(t, r, f, c, 1)
		x.names[fmt.Sprintf("%#x", r.graphs[x.g[i]].exec)] = fmt.Sprintf("g%d", i)
	}
	for s, n := range map[int64]string{replay0: "s0", replayS1: "s1", replayS2: "s2"} {
		x.names[fmt.Sprintf("%#x", streamHandle(s))] = n
	}
	return x
}

// log returns the driver ops since the last call, handles named.
func (x *orderFixture) log() []string {
	x.f.mu.Lock()
	for ev, s := range x.f.events {
		x.names[fmt.Sprintf("%#x", ev)] = map[uintptr]string{streamHandle(capA): "evA", streamHandle(capB): "evB"}[s]
	}
	x.f.mu.Unlock()
	ops := x.f.opLog()
	for i, op := range ops {
		verb, args, _ := strings.Cut(op, " ")
		for _, sep := range []string{"@", "<-"} {
			if a, b, ok := strings.Cut(args, sep); ok {
				args = x.names[a] + sep + x.names[b]
			}
		}
		ops[i] = verb + " " + args
	}
	return ops
}

type launchAt struct {
	graph  int // index into orderFixture.g
	stream int64
}

// TestLaunchOrder: a launch on another stream than the previous launch of a
// graph captured on the same stream first waits for that stream (an event
// recorded there); launches on one stream, and graphs of different capture
// streams, are not ordered.
func TestLaunchOrder(t *testing.T) {
	cases := []struct {
		name     string
		launches []launchAt
		want     []string
	}{
		{"one stream", []launchAt{{0, replayS1}, {1, replayS1}, {0, replayS1}},
			[]string{"launch g0@s1", "launch g1@s1", "launch g0@s1"}},
		{"the default stream, then a side stream", []launchAt{{0, replay0}, {1, replayS1}},
			[]string{"launch g0@s0", "record evA@s0", "wait s1<-evA", "launch g1@s1"}},
		{"the same graph on two streams", []launchAt{{0, replayS1}, {0, replayS2}},
			[]string{"launch g0@s1", "record evA@s1", "wait s2<-evA", "launch g0@s2"}},
		{"back and forth", []launchAt{{0, replayS1}, {1, replayS2}, {0, replayS1}},
			[]string{"launch g0@s1", "record evA@s1", "wait s2<-evA", "launch g1@s2",
				"record evA@s2", "wait s1<-evA", "launch g0@s1"}},
		{"other capture streams are not ordered", []launchAt{{0, replayS1}, {2, replayS2}, {2, replayS1}, {1, replayS1}},
			[]string{"launch g0@s1", "launch g2@s2", "record evB@s2", "wait s1<-evB", "launch g2@s1", "launch g1@s1"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x := newOrderFixture(t)
			for _, l := range tc.launches {
				if err := x.r.Launch(x.g[l.graph], l.stream); err != nil {
					t.Fatal(err)
				}
			}
			if got := x.log(); strings.Join(got, "; ") != strings.Join(tc.want, "; ") {
				t.Fatalf("ops\n got %q\nwant %q", got, tc.want)
			}
			if n := len(x.f.events); n > 2 {
				t.Fatalf("%d events created, want at most one per capture stream", n)
			}
		})
	}
}

// TestOrderWithoutLaunch: Order waits as a launch on its stream would and
// moves the order there, so the launch that follows on that stream needs no
// second wait (an RNG companion's writes go between the two); before any
// launch, and on the previous launch's stream, it does nothing.
func TestOrderWithoutLaunch(t *testing.T) {
	cases := []struct {
		name string
		ops  func(x *orderFixture) error
		want []string
	}{
		{"before any launch", func(x *orderFixture) error { return x.r.Order(x.g[0], replayS1) }, nil},
		{"on the previous stream", func(x *orderFixture) error {
			return errors.Join(x.r.Launch(x.g[0], replayS1), x.r.Order(x.g[1], replayS1))
		}, []string{"launch g0@s1"}},
		{"on another stream, then the launch", func(x *orderFixture) error {
			return errors.Join(x.r.Launch(x.g[0], replayS1), x.r.Order(x.g[1], replayS2), x.r.Launch(x.g[1], replayS2))
		}, []string{"launch g0@s1", "record evA@s1", "wait s2<-evA", "launch g1@s2"}},
		{"a later switch waits for the ordered stream", func(x *orderFixture) error {
			return errors.Join(x.r.Launch(x.g[0], replayS1), x.r.Order(x.g[1], replayS2), x.r.Launch(x.g[0], replay0))
		}, []string{"launch g0@s1", "record evA@s1", "wait s2<-evA", "record evA@s2", "wait s0<-evA", "launch g0@s0"}},
		{"another capture stream's order is its own", func(x *orderFixture) error {
			return errors.Join(x.r.Launch(x.g[0], replayS1), x.r.Order(x.g[2], replayS2), x.r.Launch(x.g[1], replayS1))
		}, []string{"launch g0@s1", "launch g1@s1"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x := newOrderFixture(t)
			if err := tc.ops(x); err != nil {
				t.Fatal(err)
			}
			if got := x.log(); strings.Join(got, "; ") != strings.Join(tc.want, "; ") {
				t.Fatalf("ops\n got %q\nwant %q", got, tc.want)
			}
		})
	}
	x := newOrderFixture(t)
	if err := x.r.Launch(x.g[0], replayS1); err != nil {
		t.Fatal(err)
	}
	x.log()
	boom := fakeErr("cuStreamWaitEvent", 400)
	x.f.set(func(f *fakeDriver) { f.failStreamWait = boom })
	err := x.r.Order(x.g[1], replayS2)
	wantErr(t, err, "order_replay: ordering the replay on stream 20992 after the previous replay on stream 20736")
	x.f.set(func(f *fakeDriver) { f.failStreamWait = nil })
	x.log()
	if err := x.r.Launch(x.g[1], replayS2); err != nil { // the failed Order left the order on s1
		t.Fatal(err)
	}
	if got := x.log(); strings.Join(got, "; ") != "record evA@s1; wait s2<-evA; launch g1@s2" {
		t.Fatalf("ops after a failed Order: %q", got)
	}
	wantErr(t, x.r.Order(12345, replayS1), "order_replay: unknown graph handle 12345")
}

// TestLaunchOrderFailures: when the wait cannot be set up, nothing is
// launched (racing on the workspace would be silently wrong), the error says
// why, and the order still names the previous stream, so a retry waits.
func TestLaunchOrderFailures(t *testing.T) {
	boom := fakeErr("cuEventRecord", 400)
	cases := []struct {
		name string
		set  func(*fakeDriver, error)
	}{
		{"event create", func(f *fakeDriver, e error) { f.failEventCreate = e }},
		{"event record", func(f *fakeDriver, e error) { f.failEventRecord = e }},
		{"stream wait", func(f *fakeDriver, e error) { f.failStreamWait = e }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x := newOrderFixture(t)
			if err := x.r.Launch(x.g[0], replayS1); err != nil {
				t.Fatal(err)
			}
			x.log()
			x.f.set(func(f *fakeDriver) { tc.set(f, boom) })
			err := x.r.Launch(x.g[1], replayS2)
			wantErr(t, err, "launch_graph: ordering the replay on stream 20992 after the previous replay on stream 20736")
			if !errors.Is(err, error(boom)) {
				t.Fatalf("error %v does not wrap the driver's", err)
			}
			for _, op := range x.log() {
				if strings.HasPrefix(op, "launch") {
					t.Fatalf("launched despite the failed ordering: %s", op)
				}
			}
			if err := x.r.Launch(x.g[1], replayS1); err != nil { // the previous stream needs no wait
				t.Fatal(err)
			}
			x.f.set(func(f *fakeDriver) { tc.set(f, nil) })
			if err := x.r.Launch(x.g[1], replayS2); err != nil {
				t.Fatal(err)
			}
			want := []string{"launch g1@s1", "record evA@s1", "wait s2<-evA", "launch g1@s2"}
			if got := x.log(); strings.Join(got, "; ") != strings.Join(want, "; ") {
				t.Fatalf("ops after the failure\n got %q\nwant %q", got, want)
			}
		})
	}
}

// TestLaunchFailureKeepsTheOrder: a launch the driver refuses does not move
// the order to its stream (nothing of it runs there to wait for).
func TestLaunchFailureKeepsTheOrder(t *testing.T) {
	x := newOrderFixture(t)
	if err := x.r.Launch(x.g[0], replayS1); err != nil {
		t.Fatal(err)
	}
	x.f.set(func(f *fakeDriver) { f.failLaunch = fakeErr("cuGraphLaunch", 400) })
	wantErr(t, x.r.Launch(x.g[0], replayS2), "launch_graph: cuGraphLaunch")
	x.f.set(func(f *fakeDriver) { f.failLaunch = nil })
	x.log()
	if err := x.r.Launch(x.g[0], replayS1); err != nil {
		t.Fatal(err)
	}
	if got := x.log(); len(got) != 1 || got[0] != "launch g0@s1" {
		t.Fatalf("ops %q, want one launch on s1 without a wait", got)
	}
}

// TestLaunchOrderPanics: a panic in an event call is that launch's error.
func TestLaunchOrderPanics(t *testing.T) {
	for _, method := range []string{"EventCreate", "EventRecord", "StreamWaitEvent"} {
		t.Run(method, func(t *testing.T) {
			f := newFake()
			p := newPanicky(f)
			r := NewRegistry(p)
			h := capture(t, r, f, capA, 1)
			if err := r.Launch(h, replayS1); err != nil {
				t.Fatal(err)
			}
			p.arm(method)
			err := r.Launch(h, replayS2)
			var pe *PanicError
			if err == nil || !asPanic(err, &pe) || pe.Op != method {
				t.Fatalf("launch after a panic in %s: %v, want its PanicError", method, err)
			}
			if err := r.Launch(h, replayS2); err != nil {
				t.Fatalf("the registry is not usable after the panic: %v", err)
			}
		})
	}
}

// TestLaunchOrderConcurrent: threads launching graphs of one capture stream
// on their own streams are serialized: every launch whose predecessor ran on
// another stream comes right after a record on that stream and a wait on its
// own (run with -race).
func TestLaunchOrderConcurrent(t *testing.T) {
	x := newOrderFixture(t)
	streams := []int64{replay0, replayS1, replayS2, 0x5300}
	x.names[fmt.Sprintf("%#x", streamHandle(0x5300))] = "s3"
	var wg sync.WaitGroup
	errs := make(chan error, len(streams))
	for i, s := range streams {
		wg.Add(1)
		go func(i int, s int64) {
			defer wg.Done()
			for k := 0; k < 200; k++ {
				if err := x.r.Launch(x.g[(i+k)%2], s); err != nil {
					errs <- err
					return
				}
			}
		}(i, s)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	ops := x.log()
	last, launches := "", 0
	for i, op := range ops {
		if !strings.HasPrefix(op, "launch ") {
			continue
		}
		launches++
		_, on, _ := strings.Cut(op, "@")
		if last != "" && on != last {
			if i < 2 || ops[i-2] != "record evA@"+last || ops[i-1] != "wait "+on+"<-evA" {
				t.Fatalf("op %d %q follows a launch on %s without waiting for it: %q", i, op, last, ops[max(0, i-3):i+1])
			}
		}
		last = on
	}
	if launches != 200*len(streams) {
		t.Fatalf("%d launches, want %d", launches, 200*len(streams))
	}
}

// FuzzLaunchOrder: any sequence of launches over two capture streams and
// four replay streams, with event calls failing at random, keeps the rule:
// a launch whose order's previous launch ran on another stream comes right
// after a record on that stream and a wait on its own; a launch that
// returned an error put nothing on the device; the driver sees no misuse.
func FuzzLaunchOrder(f *testing.F) {
	f.Add([]byte{0x00, 0x11, 0x02, 0x13})
	f.Add([]byte{0x40, 0x81, 0xc2, 0x03, 0x10, 0x21})
	f.Fuzz(func(t *testing.T, seq []byte) {
		x := newOrderFixture(t)
		streams := []int64{replay0, replayS1, replayS2, 0x5300}
		x.names[fmt.Sprintf("%#x", streamHandle(0x5300))] = "s3"
		captureOf := map[int]string{0: "evA", 1: "evA", 2: "evB"}
		last := map[string]string{} // order (its event's name) -> stream of its latest launch
		boom := fakeErr("cuStreamWaitEvent", 400)
		for _, b := range seq {
			g, s, fail := int(b&3)%3, streams[int(b>>2)&3], int(b>>4)&3
			x.f.set(func(f *fakeDriver) {
				f.failEventCreate, f.failEventRecord, f.failStreamWait = nil, nil, nil
				switch fail {
				case 1:
					f.failEventRecord = boom
				case 2:
					f.failStreamWait = boom
				}
			})
			err := x.r.Launch(x.g[g], s)
			ops := x.log()
			ev, on := captureOf[g], x.names[fmt.Sprintf("%#x", streamHandle(s))]
			prev, ran := last[ev]
			switching := ran && prev != on
			switch {
			case err != nil:
				if !switching || fail == 0 {
					t.Fatalf("launch g%d@%s failed without a failing wait: %v", g, on, err)
				}
				for _, op := range ops {
					if strings.HasPrefix(op, "launch") {
						t.Fatalf("launch g%d@%s returned %v but launched: %q", g, on, err, ops)
					}
				}
			case switching:
				want := []string{"record " + ev + "@" + prev, "wait " + on + "<-" + ev, fmt.Sprintf("launch g%d@%s", g, on)}
				if strings.Join(ops, "; ") != strings.Join(want, "; ") {
					t.Fatalf("switch to %s after %s: ops %q, want %q", on, prev, ops, want)
				}
				last[ev] = on
			default:
				if len(ops) != 1 || ops[0] != fmt.Sprintf("launch g%d@%s", g, on) {
					t.Fatalf("launch g%d@%s on the order's stream: ops %q, want the launch alone", g, on, ops)
				}
				last[ev] = on
			}
		}
		if _, _, misuse := x.f.counts(); len(misuse) != 0 {
			t.Fatalf("driver misuse: %v", misuse)
		}
	})
}
